"""`safemoe check` as a fault-injection matrix: worker processes that crash, hang or print memcheck
reports are recorded (CRASHED, timed out, FAILED) and the run goes on; peers that are missing are
listed as not installed; a peer's failures do not fail the command, a chosen backend's do; the
JSON schema; case counting (the GPU matrix holds >= 10,000 cases); repro commands reproduce.

The misbehaving backends come from a plugin file (`--plugin`), which every worker imports."""

from __future__ import annotations

import importlib.util
import json
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from safemoe import cli
from safemoe.check import adapters
from safemoe.check.cases.graphs import experts_graph, moe_graph, route_graph
from safemoe.check.pool import Job, Pool, PoolOptions
from safemoe.check.registry import CaseContext, NotApplicable, select_cases
from safemoe.check.worker import CaseResult, WorkerConfig

PLUGIN = textwrap.dedent(
    '''
    """Misbehaving backends for the tests of `safemoe check` (routing only)."""
    import os
    import signal
    import time

    import safemoe
    from safemoe.check.adapters import BUILT, NOT_BUILT, Adapter, OpStatus, register_backend


    class Base(Adapter):
        def route(self, logits, top_k, **kwargs):
            return safemoe.route(logits, top_k, backend="reference", **kwargs)


    class Broken(Base):  # the bug class: duplicate ids in a row
        def route(self, logits, top_k, **kwargs):
            routing = super().route(logits, top_k, **kwargs)
            ids = routing.ids.clone()
            if ids.shape[1] > 1:
                ids[:, 1] = ids[:, 0]
            return safemoe.Routing(weights=routing.weights, ids=ids)


    class Crashy(Base):  # dies like a segfaulting process, but only for E = 60
        def route(self, logits, top_k, **kwargs):
            if logits.shape[1] == 60:
                os._exit(139)
            return super().route(logits, top_k, **kwargs)


    class Segv(Base):
        def route(self, logits, top_k, **kwargs):
            os.kill(os.getpid(), signal.SIGSEGV)


    class Hangs(Base):
        def route(self, logits, top_k, **kwargs):
            time.sleep(600)


    class Memcheck(Base):  # what compute-sanitizer prints on an out-of-bounds read
        def route(self, logits, top_k, **kwargs):
            if logits.shape[1] == 60:
                print("========= Invalid __global__ read of size 4 bytes", flush=True)
            return super().route(logits, top_k, **kwargs)


    def factory(cls, name):
        def make(device):
            ops = {"route": OpStatus(BUILT), "experts": OpStatus(NOT_BUILT, "routing only"),
                   "moe": OpStatus(NOT_BUILT, "routing only")}
            return cls(name, device, kind="peer", ops=ops, counts_health=False)

        return make


    for name, cls in {"broken": Broken, "crashy": Crashy, "segv": Segv, "hangs": Hangs,
                      "memcheck": Memcheck}.items():
        register_backend(name, factory(cls, name))
    '''
)


@pytest.fixture(scope="module")
def plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plugin") / "bad_backends.py"
    path.write_text(PLUGIN)
    return path


def run_check(tmp_path: Path, *argv: str, timeout: float = 240) -> tuple[int, str, dict]:
    """`python -m safemoe check --device cpu ... --json` in a fresh process (plugins register in
    it); on CPU wherever the tests run, so counts and n/a reasons are the CPU ones."""
    out_json = tmp_path / f"check_{len(list(tmp_path.iterdir()))}.json"
    done = subprocess.run(
        [sys.executable, "-m", "safemoe", "check", "--device", "cpu", *argv, "--json", str(out_json)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    report = json.loads(out_json.read_text()) if out_json.exists() else {}
    return done.returncode, done.stdout + done.stderr, report


def statuses(report: dict, backend: str) -> list[str]:
    return [r["status"] for r in report["results"] if r["backend"] == backend]


def by_backend(report: dict, backend: str) -> list[dict]:
    return [r for r in report["results"] if r["backend"] == backend]


def test_crashes_hangs_and_failures_are_recorded_and_the_run_goes_on(plugin: Path, tmp_path: Path) -> None:
    code, out, report = run_check(
        tmp_path, "--plugin", str(plugin), "--quick", "--only", "routing.nan_rows",
        "--backend", "reference", "--peers", "broken,crashy,segv,hangs", "--timeout", "8",
        "--max-crashes", "2",
    )  # fmt: skip
    assert code == 0, out  # the chosen backend (reference) passed; peers' troubles do not fail the run
    assert set(statuses(report, "reference")) == {"passed"}
    assert set(statuses(report, "broken")) == {"failed"}
    assert all("duplicate ids" in r["message"] for r in by_backend(report, "broken"))
    # crashy dies on the E = 60 cases only: those are CRASHED, the others (requeued) pass.
    crashy = by_backend(report, "crashy")
    for r in crashy:
        want = "crashed" if "E=60 " in r["params"] else "passed"
        assert r["status"] == want, r
    assert any("worker died: exit status 139" in r["message"] for r in crashy)
    # segv: killed by a signal; after --max-crashes 2 the rest is recorded without running.
    segv = by_backend(report, "segv")
    assert set(statuses(report, "segv")) == {"crashed"}
    assert sum("killed by SIGSEGV" in r["message"] for r in segv) == 2
    assert all("not run: routing.nan_rows crashed 2 times on segv" in r["message"] for r in segv[2:])
    hangs = by_backend(report, "hangs")
    assert set(statuses(report, "hangs")) == {"crashed"}
    assert any("timed out: no progress in 8 s" in r["message"] for r in hangs)
    for r in report["results"]:
        if r["status"] in ("failed", "crashed"):
            assert r["repro"].startswith("python3 -m safemoe check --only routing.nan_rows --case ")
            assert f"--plugin {plugin}" in r["repro"]
    assert "CRASH" in out and "FAIL" in out
    assert out.rstrip().splitlines()[-1].startswith("check: ")


def test_chosen_backend_failing_sets_the_exit_status_and_repro_reproduces(
    plugin: Path, tmp_path: Path
) -> None:
    code, out, report = run_check(
        tmp_path, "--plugin", str(plugin), "--quick", "--only", "routing.tie_free", "--backend", "broken",
        "--peers", "none",
    )  # fmt: skip
    assert code == 1, out
    failed = [r for r in report["results"] if r["status"] == "failed"]
    assert failed
    repro = failed[0]["repro"].split()
    assert repro[:4] == ["python3", "-m", "safemoe", "check"]
    again = subprocess.run(
        [sys.executable, *repro[1:]], capture_output=True, text=True, timeout=120, check=False
    )
    assert again.returncode == 1
    assert failed[0]["message"][:60] in again.stdout
    assert "check: 1 cases, 0 passed, 1 failed" in again.stdout


def test_not_installed_peers_are_listed_not_passed(tmp_path: Path) -> None:
    code, out, report = run_check(
        tmp_path,
        "--quick",
        "--only",
        "routing.health",
        "--backend",
        "reference",
        "--peers",
        "all",
        "--case",
        "0",
    )
    assert code == 0, out
    missing = [name for name in ("vllm", "sglang", "flashinfer") if importlib.util.find_spec(name) is None]
    for name in missing:
        assert report["backends"][name]["state"] == "not installed"
        assert not by_backend(report, name)
        assert f"{name}: not installed" in out
    if missing:
        assert "not installed: " + ", ".join(missing) in out.rstrip().splitlines()[-1]
    # the torch peer has no health counter: n/a with the reason, never passed
    torch_results = by_backend(report, "torch")
    assert [r["status"] for r in torch_results] == ["n/a"]
    assert "no health counter" in torch_results[0]["message"]


def test_json_schema(tmp_path: Path) -> None:
    code, out, report = run_check(
        tmp_path,
        "--quick",
        "--only",
        "dispatch.duplicates,graphs.route",
        "--peers",
        "torch,hf-eager",
        "--jobs",
        "2",
    )
    assert code == 0, out
    assert report["schema"] == "safemoe-check/2"
    for key in (
        "safemoe_version",
        "torch_version",
        "device",
        "seed",
        "quick",
        "scale",
        "sanitizer",
        "command",
    ):
        assert key in report
    assert report["families"] == ["dispatch", "graphs"]
    summary = report["summary"]
    assert summary["cases"] == len(report["results"])
    assert summary["cases"] == sum(summary[s] for s in ("passed", "failed", "crashed", "n/a"))
    for name in ("reference", "triton", "torch", "hf-eager"):
        backend = report["backends"][name]
        assert set(backend) >= {"kind", "description", "state", "reason", "chosen", "ops", "counts"}
        if backend["state"] != "available":
            continue
        counted = sum(sum(c.values()) for c in backend["counts"].values())
        assert counted == len(by_backend(report, name))
    assert report["backends"]["reference"]["chosen"] and not report["backends"]["torch"]["chosen"]
    for r in report["results"]:
        assert set(r) == {
            "check",
            "family",
            "backend",
            "case",
            "status",
            "params",
            "seconds",
            "message",
            "repro",
        }
        assert r["status"] in ("passed", "failed", "crashed", "n/a")
        if r["check"] == "graphs.route":
            assert r["status"] == "n/a" and r["message"] == "needs CUDA"


def test_case_counting(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    grids = {c.name: len(c.grid(0, cpu)) for c in select_cases(None)}
    code = cli.main(["check", "--quick", "--list", "--device", "cpu"])
    listed = capsys.readouterr().out
    assert code == 0
    for name, count in grids.items():
        assert f"{name} " in listed and f" {count} cases" in listed
    # A run has one result per case of every check on every backend that is here.
    _, _, report = run_check(tmp_path, "--quick", "--only", "buffers", "--peers", "torch")
    here = [n for n in ("reference", "triton", "torch") if report["backends"][n]["state"] == "available"]
    want = sum(n for name, n in grids.items() if name.startswith("buffers.")) * len(here)
    assert len(report["results"]) == want
    # The GPU matrix: >= 10,000 cases the safemoe and torch/transformers backends actually run.
    cuda = torch.device("cuda")
    runnable = 0
    for case in select_cases(None):
        size = len(case.grid(2, cuda))
        route_only = case.ops == ("route",)
        # reference, triton, torch run every op; the three transformers backends have no router
        runnable += size * (3 if route_only else 6)
    assert runnable >= 10_000


def test_in_process_and_workers_agree(tmp_path: Path) -> None:
    args = ("--quick", "--only", "padding.experts,dispatch.bad_ids", "--backend", "reference", "--peers",
            "torch,hf-grouped_mm")  # fmt: skip
    _, _, alone = run_check(tmp_path, *args, "--jobs", "0")
    _, _, pooled = run_check(tmp_path, *args, "--jobs", "2")

    def key(report: dict) -> list[tuple]:
        return sorted((r["backend"], r["check"], r["case"], r["status"]) for r in report["results"])

    assert key(alone) == key(pooled)
    assert {"passed", "failed"} <= {r["status"] for r in alone["results"]}


def test_sanitizer_needs_cuda(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, out, _ = run_check(tmp_path, "--sanitizer", "--only", "routing.health")
    assert code == 2
    assert "needs CUDA" in out


def test_sanitizer_reports_are_attributed(plugin: Path, tmp_path: Path) -> None:
    """The sanitizer path on CPU, with a stand-in for compute-sanitizer that runs the worker and
    prints a summary; the plugin backend prints a memcheck report during its E = 60 case."""
    fake = tmp_path / "fake-sanitizer"
    fake.write_text(
        '#!/bin/sh\necho "========= COMPUTE-SANITIZER"\n"$@"\nrc=$?\n'
        'echo "========= ERROR SUMMARY: 1 error"\nexit $rc\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    results: list[CaseResult] = []
    config = WorkerConfig(device="cpu", seed=0, scale=0, plugins=[str(plugin)])
    pool = Pool(config, PoolOptions(workers=1, timeout=120, sanitizer=[str(fake)]), results.append)
    grid = select_cases(["routing.nan_rows"])[0].grid(0, torch.device("cpu"))
    pool.run([Job(1, "memcheck", [("routing.nan_rows", i) for i in range(len(grid))])])
    assert len(results) == len(grid)
    for r in results:
        if "E=60 " in r.params:
            assert r.status == "failed" and r.message == "memcheck: Invalid __global__ read of size 4 bytes"
        else:
            assert r.status == "passed", r
    report = pool.sanitizer["memcheck"]
    assert report.errors == 1 and report.processes == 1
    assert report.reports and "Invalid __global__ read" in report.reports[0]


def test_graph_checks_replay_eagerly_off_cuda() -> None:
    """The CUDA-graph checks' sequence (num_valid changed in place, NaN injected between replays),
    run eagerly on CPU: passes on a correct backend, n/a where capture is documented impossible,
    fails on a backend that leaks padding."""
    cpu = torch.device("cpu")
    reference = adapters.reference_adapter(cpu)
    for check in (route_graph, experts_graph, moe_graph):
        name = check.__name__
        case = next(c for c in select_cases(None) if c.fn is check)
        params = case.grid(0, cpu)[0]
        ctx = CaseContext(api=reference, device=cpu, seed=0, scale=0, case_name=name)
        if name == "route_graph":
            check(ctx, **params)
        else:
            with pytest.raises(NotApplicable):
                check(ctx, **params)

    class Leaky(adapters.Adapter):
        def route(self, logits, top_k, **kwargs):
            kwargs.pop("num_valid", None)  # routes padded (NaN) rows as real ones
            import safemoe

            return safemoe.route(logits, top_k, backend="reference", **kwargs)

    leaky = Leaky("leaky", cpu)
    case = next(c for c in select_cases(None) if c.fn is route_graph)
    ctx = CaseContext(api=leaky, device=cpu, seed=0, scale=0, case_name="graphs.route")
    with pytest.raises(AssertionError, match="padded row"):
        route_graph(ctx, **case.grid(0, cpu)[0])


def test_max_time_reports_cases_not_run(tmp_path: Path) -> None:
    code, out, report = run_check(
        tmp_path, "--quick", "--only", "routing", "--peers", "none", "--max-time", "0"
    )
    assert code == 1
    assert report["summary"]["not_run"] > 0 and report["summary"]["cases"] == 0
    assert "cases not run (--max-time 0 s)" in out.rstrip().splitlines()[-1]
