"""`safemoe check` and the `safemoe` command in this process (--jobs 0): passes on a correct backend,
catches a broken one, reports what is not built, writes JSON, and every --help works. The
matrix itself (workers, crashes, peers, counting) is tested in test_check_matrix.py."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import safemoe
from safemoe import cli
from safemoe.check import adapters, runner
from safemoe.check.registry import Plan, all_pairs, select_cases
from safemoe.check.worker import run_case


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


# In this process (--jobs 0): monkeypatched APIs are seen by the cases.
IN_PROCESS = ("--quick", "--peers", "none", "--jobs", "0", "--device", "cpu")


def test_check_passes_on_the_reference(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_json = tmp_path / "nested" / "check.json"
    code, out = run_cli(
        capsys, "check", "--backend", "reference", *IN_PROCESS, "--only", "routing,padding,e2e",
        "--json", str(out_json),
    )  # fmt: skip
    assert code == 0, out
    assert "routing" in out and "padding" in out and "0 failed" in out
    assert f"created directory {out_json.parent} for --json" in out
    report = json.loads(out_json.read_text())
    assert report["safemoe_version"] == safemoe.__version__
    assert report["summary"]["failed"] == 0 and report["summary"]["crashed"] == 0
    statuses = {(r["check"], r["backend"], r["case"]): r["status"] for r in report["results"]}
    assert set(statuses.values()) <= {"passed", "n/a"} and "passed" in statuses.values()
    checks = {c.name for c in select_cases(["routing", "padding", "e2e"])}
    assert {name for name, _, _ in statuses} == checks


def test_shards_partition_the_matrix() -> None:
    """--shard K/N: runs 1/N..N/N plan every (backend, check, case) of the matrix exactly once."""
    cases = select_cases(["routing", "dispatch.bad_ids", "ep"])
    backends = [adapters.make_adapter("reference", torch.device("cpu"))]
    device = torch.device("cpu")

    def planned(part):
        jobs, decided, _ = runner.plan_jobs(cases, backends, device=device, scale=1, only_case=None,
                                            sanitizer=False, part=part)  # fmt: skip
        keys = [(job.backend, name, i) for job in jobs for name, i in job.items]
        return keys + [(r.backend, r.check, r.case) for r in decided]

    whole = planned(None)
    assert len(whole) == len(set(whole)) > 20
    for n in (1, 3, 7):
        parts = [planned((k, n)) for k in range(1, n + 1)]
        assert sorted(key for part in parts for key in part) == sorted(whole), n
        assert all(parts), n


def test_resume_runs_only_the_cases_not_yet_run(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--resume FILE: a cut-short run goes on where it stopped; together the two cover the matrix once,
    and a file of another seed or scale is refused before anything runs."""
    only = "dispatch.duplicates,padding.num_valid"
    common = ("check", "--backend", "reference", *IN_PROCESS, "--only", only)
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    code, out = run_cli(capsys, *common, "--shard", "1/2", "--json", str(first))
    assert code == 0, out
    code, out = run_cli(capsys, *common, "--resume", str(first), "--json", str(second))
    assert code == 0, out
    ran = [json.loads(path.read_text())["results"] for path in (first, second)]
    keys = [(r["check"], r["backend"], r["case"]) for results in ran for r in results]
    sizes = {c.name: len(c.grid(0, torch.device("cpu")))
             for c in select_cases(["dispatch.duplicates", "padding.num_valid"])}  # fmt: skip
    assert sorted(keys) == sorted((name, "reference", i) for name, n in sizes.items() for i in range(n))
    assert ran[0] and ran[1] and f"resuming first.json: {len(ran[0])} cases already run" in out
    assert json.loads(second.read_text())["resume"] == str(first)
    for flags, what in ((("--seed", "5"), "seed 0 at matrix scale 0; this run is seed 5"),
                        (("--scale", "cpu"), "seed 0 at matrix scale 0; this run is seed 0 at scale 1")):
        code, out = run_cli(capsys, *common, *flags, "--resume", str(first))
        assert code == 2 and "--resume" in out and what in out, out
    not_json = tmp_path / "notes.txt"
    not_json.write_text("hello")
    code, out = run_cli(capsys, *common, "--resume", str(not_json))
    assert code == 2 and "not readable as JSON" in out, out
    code, out = run_cli(capsys, *common, "--resume", str(tmp_path / "missing.json"))
    assert code == 2 and "no such file" in out, out


def _duplicating_route(real_route):
    def route(logits, top_k, **kwargs):
        routing = real_route(logits, top_k, **kwargs)
        ids = routing.ids.clone()
        if ids.shape[1] > 1:
            ids[:, 1] = ids[:, 0]  # the bug class: duplicate ids in a row
        return safemoe.Routing(weights=routing.weights, ids=ids)

    return route


def test_broken_backend_fails_with_repro(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(safemoe, "route", _duplicating_route(safemoe.route))
    code, out = run_cli(
        capsys, "check", "--backend", "reference", *IN_PROCESS, "--only", "routing", "--seed", "3"
    )
    assert code == 1
    assert "FAIL" in out and "duplicate ids" in out
    assert "safemoe (reference): FAILED: " in out and "exit status 1" in out
    repro = (
        "python3 -m safemoe check --only routing.nan_rows --case 0 --backend reference --peers none --seed 3 "
        "--device cpu --quick --jobs 0"
    )
    assert repro in out


def test_raising_backend_is_a_failure(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(safemoe, "experts", crash)
    code, out = run_cli(capsys, "check", "--backend", "reference", *IN_PROCESS, "--only", "dispatch.bad_ids")
    assert code == 1
    assert "raised RuntimeError: CUDA error: an illegal memory access" in out


def test_missing_kernels_are_not_applicable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(adapters.TRITON_MODULES, "route", ("safemoe.kernels.not_written_yet",))
    monkeypatch.setitem(adapters.TRITON_MODULES, "moe", ("safemoe.kernels.not_written_yet",))
    out_json = tmp_path / "check.json"
    code, out = run_cli(
        capsys, "check", "--backend", "triton", *IN_PROCESS, "--only", "routing.health,padding.moe",
        "--json", str(out_json),
    )  # fmt: skip
    report = json.loads(out_json.read_text())
    triton = report["backends"]["triton"]
    if triton["state"] != "available":
        pytest.skip(f"triton cannot run here: {triton['reason']}")
    assert code == 0, out
    assert {r["status"] for r in report["results"]} == {"n/a"}
    assert all("does not exist yet" in r["message"] for r in report["results"])
    assert triton["ops"]["route"]["state"] == "not built"


def test_broken_kernel_module_is_a_failure(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    broken = tmp_path / "safemoe_broken_kernel.py"
    broken.write_text("raise ImportError('kernel module fails to load')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(adapters.TRITON_MODULES, "route", ("safemoe_broken_kernel",))
    code, out = run_cli(capsys, "check", "--backend", "triton", *IN_PROCESS, "--only", "routing.health")
    if "unavailable" in out:
        pytest.skip("triton cannot run here")
    assert code == 1
    assert "kernel module fails to load" in out


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="--device cpu runs the triton backend only under the Triton interpreter, which a "
                    "CUDA machine's tests do not set (check then reports NOT RUN)")
def test_triton_backend_runs_when_built(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(capsys, "check", "--backend", "triton", *IN_PROCESS, "--only", "routing.nan_rows")
    assert code == 0, out
    assert any(word in out for word in (" ok", "n/a", "unavailable"))


def test_only_and_backend_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(capsys, "check", "--only", "no_such_check")[0] == 2
    assert run_cli(capsys, "check", "--backend", "cutlass")[0] == 2
    code, out = run_cli(capsys, "check", "--list")
    assert code == 0 and "routing.nan_rows" in out and "dispatch.bad_ids" in out


def test_globs_and_families_select_cases() -> None:
    names = [c.name for c in select_cases(["routing.*_rows", "dispatch"])]
    assert names and all(n.startswith(("routing.", "dispatch.")) for n in names)
    assert "routing.nan_rows" in names and "routing.tie_free" not in names


def test_grid_covers_every_value() -> None:
    cpu = Plan(scale=1, device=torch.device("cpu"), check="x.y")
    combos = cpu.pairs(a=[1, 2, 3], b="xy", c=[True])
    assert len(combos) == 3
    assert {c["a"] for c in combos} == {1, 2, 3} and {c["b"] for c in combos} == {"x", "y"}
    assert len(cpu.cross(combos, d=[0, 1])) == 3  # one cheap value per row off CUDA
    cuda = Plan(scale=2, device=torch.device("cpu"), check="x.y")
    rows = cuda.pairs(a=[1, 2, 3], b="xy")
    assert len(rows) == 6
    assert len(cuda.cross(rows, d=[0, 1])) == 12  # the full product on CUDA


def test_not_built_subcommand(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(cli.SUBCOMMANDS, "demo", ("safemoe.no_such_module", "not here"))
    code, out = run_cli(capsys, "demo")
    assert code == 2
    assert "not built yet" in out and "Traceback" not in out


def test_main_without_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(capsys)
    assert code == 2 and "check" in out and "bench" in out
    code, out = run_cli(capsys, "--version")
    assert code == 0 and safemoe.__version__ in out


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "120"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=False)


def test_console_script_help() -> None:
    argvs = [[sys.executable, "-m", "safemoe", "--help"]]
    # The console script exists only where safemoe is installed (the GPU machine runs the source
    # tree with PYTHONPATH=src).
    if shutil.which("safemoe"):
        argvs += [["safemoe", "--help"], ["safemoe", "check", "--help"]]
    for argv in argvs:
        done = _run(*argv)
        assert done.returncode == 0, done.stderr
        assert "usage:" in done.stdout
    module = [sys.executable, "-m", "safemoe"]
    check_help = ["safemoe", "check"] if shutil.which("safemoe") else [*module, "check"]
    assert "--only" in _run(*check_help, "--help").stdout


@pytest.mark.parametrize("command", ["bench", "demo"])
def test_other_subcommands_help_or_not_built(command: str) -> None:
    done = _run(sys.executable, "-m", "safemoe", command, "--help")
    assert done.returncode in (0, 2), done.stderr
    assert ("usage:" in done.stdout) or ("not built yet" in done.stderr), done.stdout + done.stderr
    assert "Traceback" not in done.stderr


def test_cli_imports_subcommands_lazily() -> None:
    code = "import sys, safemoe.cli; print(sorted(m for m in sys.modules if m.startswith('safemoe.')))"
    done = _run(sys.executable, "-c", code)
    assert done.returncode == 0, done.stderr
    assert "safemoe.check" not in done.stdout and "safemoe.bench" not in done.stdout


def test_all_pairs_covers_every_pair() -> None:
    for sizes in ([8, 7, 3, 3, 1], [8, 7, 3, 3, 3], [2, 2, 2, 2], [5], [4, 1]):
        rows = all_pairs(sizes)
        for a, b in itertools.combinations(range(len(sizes)), 2):
            seen = {(row[a], row[b]) for row in rows}
            assert len(seen) == sizes[a] * sizes[b]
    assert len(all_pairs([8, 7, 3, 3])) == 56  # the minimum for 8 x 7


def test_cuda_sized_cases_run_on_the_reference() -> None:
    """The CUDA-sized grids and shapes, exercised on the CPU reference: the first, middle and last
    case of every check (the whole CUDA grid is thousands of cases). Not the ep family: each of its
    cases spawns a process group (~5 s), and on a CPU device its ranks' shapes do not depend on the
    scale (tests/test_check_fp8_ep.py runs its CPU-scale groups)."""
    adapter = adapters.reference_adapter(torch.device("cpu"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as `safemoe check` does on CPU: 4x faster on a busy 2-core machine
    try:
        for case in select_cases(None):
            if case.family == "ep":
                continue
            grid = case.grid(2, torch.device("cpu"))
            for index in sorted({0, len(grid) // 2, len(grid) - 1}):
                result = run_case(case, adapter, index, grid[index], seed=0, scale=2)
                assert result.status in ("passed", "n/a"), f"{case.name}#{index}: {result.message}"
    finally:
        torch.set_num_threads(threads)


def test_default_run_reads_right(capsys: pytest.CaptureFixture[str]) -> None:
    """safemoe's verdict first and unmistakable, peers after it as peers, and the last line says
    both apart: the torch peer fails routing.nan_rows (NaN weights) and the run still passes."""
    code, out = run_cli(
        capsys, "check", "--backend", "reference", "--peers", "torch", "--only", "routing.nan_rows",
        "--quick", "--jobs", "0", "--device", "cpu",
    )  # fmt: skip
    assert code == 0, out
    verdict = out.index("safemoe (reference): PASSED: 0 failed, 0 crashed of ")
    peers = out.index("peers: what the others do with the same inputs")
    assert verdict < peers < out.index("torch routing.nan_rows (peer): ")
    assert "never judged" in out[peers:]
    assert "reference routing.nan_rows" not in out  # no failure block for safemoe
    last = out.rstrip().splitlines()[-1]
    assert last.startswith("check: ")
    assert " on safemoe (reference): PASSED; peers, not judged (torch): " in last


def test_progress_counts_match_the_summary(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The progress counts every case the summary counts, those decided without running (n/a: the
    CUDA-graph family on CPU) included: it ends at N/N with N the summary's total."""
    monkeypatch.setattr(runner, "PROGRESS_LINE_S", -1.0)  # a line per case (output is not a terminal)
    code, out = run_cli(
        capsys, "check", "--backend", "reference", "--peers", "none", "--only", "routing.health,graphs.route",
        "--quick", "--jobs", "0", "--device", "cpu",
    )  # fmt: skip
    assert code == 0, out
    counts = [line.split()[1] for line in out.splitlines() if line.startswith("checking: ")]
    done, total = (int(n) for n in counts[-1].split("/"))
    graphs = len(select_cases(["graphs.route"])[0].grid(0, torch.device("cpu")))
    assert int(counts[0].split("/")[0]) == graphs + 1  # the n/a cases counted from the start
    summary = out.rstrip().splitlines()[-1]
    assert done == total and f"; {total} cases in " in summary, summary


def _result(backend: str, status: str) -> runner.CaseResult:
    return runner.CaseResult("routing.health", backend, 0, status, "")


def test_exit_status_is_the_chosen_backends() -> None:
    """1 when a chosen backend failed, crashed, had memcheck errors or cases left by --max-time;
    a peer's failures, crashes, memcheck errors and unrun cases never change it."""
    from safemoe.check.pool import SanitizerReport

    chosen = ["reference", "triton"]
    passed = [_result("reference", "passed"), _result("triton", "passed")]
    peer_trouble = [_result("torch", "failed"), _result("hf-eager", "crashed")]
    memcheck_peer = {"torch": SanitizerReport(errors=3)}
    verdict = runner.verdict_of(passed + peer_trouble, chosen, {"torch": 5}, memcheck_peer)
    assert (verdict.word, verdict.exit_status) == ("PASSED", 0)
    for results, not_run, memcheck, word in (
        ([*passed, _result("triton", "failed")], {}, None, "FAILED"),
        ([*passed, _result("reference", "crashed")], {}, None, "FAILED"),
        (passed, {}, {"triton": SanitizerReport(errors=1)}, "FAILED"),
        (passed, {"reference": 1}, None, "INCOMPLETE"),
    ):
        verdict = runner.verdict_of(results + peer_trouble, chosen, not_run, memcheck)
        assert (verdict.word, verdict.exit_status) == (word, 1)
    # A chosen backend that cannot run here is named, never counted as passed; none at all: NOT RUN.
    verdict = runner.verdict_of(passed[:1], chosen, {}, None, {"triton": "unavailable"})
    assert verdict.word == "PASSED"
    assert "not run here: triton (unavailable)" in runner.verdict_line(verdict, chosen)
    verdict = runner.verdict_of(peer_trouble, ["vllm"], {}, None, {"vllm": "not installed"})
    assert (verdict.word, verdict.exit_status) == ("NOT RUN", 1)
    line = runner.summary_line(passed + peer_trouble, 3.0, chosen, ["vllm"])
    assert line == (
        "check: 2 cases, 2 passed, 0 failed, 0 crashed, 0 n/a on safemoe (reference, triton): PASSED; "
        "peers, not judged (torch, hf-eager): 2 cases, 0 passed, 1 failed, 1 crashed, 0 n/a; 4 cases in 3 s; "
        "not installed: vllm"
    )
