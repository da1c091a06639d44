"""The bench harness, the peers and `safemoe bench` on a CPU machine (GPU timing tests are marked)."""

from __future__ import annotations

import argparse
import ast
import csv
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import safemoe.bench as bench
from helpers import assert_close, assert_equal, tie_free_logits
from safemoe import peers
from safemoe.bench import cli as bench_cli
from safemoe.bench import harness
from safemoe.reference import experts_reference, route_reference
from safemoe.route_config import RouteConfig

REPO = Path(__file__).resolve().parents[1]
CEILINGS = harness.DeviceCeilings(
    name="Test GPU", read_gbps=4000.0, copy_gbps=3600.0, bf16_tflops=800.0, fp8_tflops=None
)


# ---------------------------------------------------------------------------------------------
# Rows, floors, result files
# ---------------------------------------------------------------------------------------------


def test_pct_of_floor():
    row = harness.BenchRow("s", "c", 8, "clean", "impl", median_us=20.0, floor_us=15.0)
    assert row.pct_of_floor == pytest.approx(75.0)
    assert harness.BenchRow("s", "c", 8, "clean", "impl", None, 15.0).pct_of_floor is None
    assert harness.BenchRow("s", "c", 8, "clean", "impl", 20.0).pct_of_floor is None
    assert row.to_dict()["pct_of_floor"] == pytest.approx(75.0)


def test_floor_formulas():
    # Qwen3-30B-A3B at T=1: 8 experts x 3*2048*768*2 bytes = 75.5 MB; at 4300 GB/s that is 17.6 us
    # (the figure in shared/anchors.md).
    assert harness.distinct_experts(128, 8, 1) == pytest.approx(8.0)
    assert harness.distinct_experts(128, 8, 100_000) == pytest.approx(128.0)
    assert harness.distinct_experts(8, 2, 2) == pytest.approx(8 * (1 - 0.75**2))
    # the experts samples actually hit (issue 13's "% read"), padded slots (-1) not counted
    samples = [torch.tensor([[0, 1], [1, 2]]), torch.tensor([[3, 3], [-1, -1]])]
    assert harness.sampled_distinct_experts(samples) == pytest.approx((3 + 1) / 2)
    with pytest.raises(ValueError, match="no routing sample"):
        harness.sampled_distinct_experts([])


def test_sampled_computed_rows_pads_each_expert_to_its_blocks():
    """Rows computed / rows routed with each expert's slots padded to whole M-blocks, averaged over
    samples; ids outside [0, E) are not routed (dropped, as dispatch drops them)."""
    # expert 0: 3 slots, expert 2: 5 slots; blocks of 4 -> 4 + 8 = 12 computed for 8 routed
    first = torch.tensor([[0, 2], [0, 2], [0, 2], [2, 2], [-1, 7]])
    second = torch.tensor([[1, 1], [1, 1]])  # 4 slots of expert 1: one whole block
    assert harness.sampled_computed_rows([first], 4, 4) == pytest.approx(1.5)
    assert harness.sampled_computed_rows([first, second], 4, 4) == pytest.approx((1.5 + 1.0) / 2)
    assert harness.sampled_computed_rows([torch.full((2, 2), -1)], 4, 4) == 1.0  # nothing routed
    with pytest.raises(ValueError, match="no routing sample"):
        harness.sampled_computed_rows([], 4, 4)
    with pytest.raises(ValueError, match="block_m"):
        harness.sampled_computed_rows([first], 4, 0)
    with pytest.raises(ValueError, match="num_experts"):
        harness.sampled_computed_rows([first], 0, 4)
    at_4300 = harness.DeviceCeilings("x", 4300.0, 4300.0, 790.0, None)
    assert harness.moe_decode_floor_us(128, 8, 2048, 768, 1, at_4300) == pytest.approx(17.56, abs=0.01)
    flops = 2 * 16384 * 8 * 3 * 2048 * 768
    assert harness.moe_flops(16384, 8, 2048, 768) == flops
    assert harness.moe_prefill_floor_us(8, 2048, 768, 16384, at_4300) == pytest.approx(flops / 790e12 * 1e6)
    assert harness.bytes_floor_us(4e9, 4000.0) == pytest.approx(1000.0)
    assert harness.flops_floor_us(8e12, 800.0) == pytest.approx(10_000.0)
    floor, bound = harness.moe_floor_us(128, 8, 2048, 768, 1, at_4300)
    assert bound == "read" and floor == pytest.approx(17.56, abs=0.01)
    floor, bound = harness.moe_floor_us(128, 8, 2048, 768, 16384, at_4300)
    assert bound == "flops" and floor == pytest.approx(flops / 790e12 * 1e6)
    # a sample's D replaces the expectation: half the experts, half the read floor
    floor, bound = harness.moe_floor_us(128, 8, 2048, 768, 1, at_4300, distinct=4.0)
    assert bound == "read" and floor == pytest.approx(17.56 / 2, abs=0.01)


def test_add_speedups():
    rows = [
        harness.BenchRow("s", "c", 8, "clean", "peer", 30.0),
        harness.BenchRow("s", "c", 8, "clean", "ours", 10.0),
        harness.BenchRow("s", "c", 16, "clean", "ours", 10.0),
        harness.BenchRow("s", "c", 8, "clean", "gone", None),
    ]
    harness.add_speedups(rows, "peer")
    assert rows[1].extra == {"x_vs_peer": 3.0}
    assert rows[0].extra == {} and rows[2].extra == {} and rows[3].extra == {}


def test_write_results(tmp_path, capsys):
    rows = [
        harness.BenchRow(
            "demo", "qwen3", 64, "clean", "fast", 12.5, 10.0, note="graph", extra={"x_vs_slow": 4.0}
        ),
        harness.BenchRow("demo", "qwen3", 64, "clean", "slow", 50.0, 10.0),
        harness.BenchRow("demo", "qwen3", 64, "clean", "absent", None, 10.0, note="vllm: not installed"),
    ]
    harness.write_results(rows, tmp_path / "out", "demo", CEILINGS)
    with open(tmp_path / "out" / "demo.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["impl"] for r in table] == ["fast", "slow", "absent"]
    assert float(table[0]["median_us"]) == 12.5 and float(table[0]["pct_of_floor"]) == 80.0
    assert json.loads(table[0]["extra"]) == {"x_vs_slow": 4.0}
    assert (
        table[2]["median_us"] == "" and table[2]["pct_of_floor"] == "" and "not installed" in table[2]["note"]
    )
    data = json.loads((tmp_path / "out" / "demo.json").read_text())
    assert data["suite"] == "demo" and data["ceilings"]["name"] == "Test GPU"
    assert data["ceilings"]["read_gbps"] == 4000.0 and data["ceilings"]["fp8_tflops"] is None
    assert {"date", "torch", "device"} <= set(data)
    assert data["rows"][1]["pct_of_floor"] == pytest.approx(20.0) and data["rows"][2]["median_us"] is None
    printed = capsys.readouterr().out
    assert "safemoe bench demo on Test GPU" in printed and "absent" in printed


def test_ceilings_round_trip():
    again = harness.DeviceCeilings.from_dict(json.loads(json.dumps(CEILINGS.to_dict())))
    assert again == CEILINGS
    assert "fp8 n/a" in CEILINGS.summary()
    # the sustained peak (results since 2026-11-27) travels too; older results read as None
    sustained = dataclasses.replace(CEILINGS, bf16_tflops_sustained=671.0)
    assert harness.DeviceCeilings.from_dict(json.loads(json.dumps(sustained.to_dict()))) == sustained
    assert "(671 sustained)" in sustained.summary()
    old = {k: v for k, v in CEILINGS.to_dict().items() if k != "bf16_tflops_sustained"}
    assert harness.DeviceCeilings.from_dict(old).bf16_tflops_sustained is None


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [
        harness.BenchRow("s", "c", t, "clean", impl, 10.0 * t, 5.0 * t)
        for t in (1, 8, 64)
        for impl in ("a", "b")
    ]
    path = harness.plot_pct_of_floor(rows, tmp_path / "p.png", "test")
    assert path is not None and path.read_bytes()[:4] == b"\x89PNG"
    assert (
        harness.plot_pct_of_floor([rows[0].__class__("s", "c", 1, "v", "a", None)], tmp_path / "q.png", "t")
        is None
    )


def test_timing_needs_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for timer in (harness.time_graph, harness.time_eager):
        with pytest.raises(RuntimeError, match="CUDA"):
            timer(lambda j: None)
    with pytest.raises(RuntimeError, match="CUDA"):
        harness.measure_ceilings()


# ---------------------------------------------------------------------------------------------
# Registry and CLI
# ---------------------------------------------------------------------------------------------


def test_registry_missing_suite(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(bench.SUITES, "ghost", "safemoe.bench._no_such_suite")
    assert bench.load_suite("ghost") is None
    assert bench_cli.run_suite("ghost", CEILINGS, tmp_path, quick=True) == "not built yet"
    assert "not built yet" in capsys.readouterr().out
    assert bench.load_suite("layer") is not None
    with pytest.raises(KeyError):
        bench.load_suite("nope")


def test_run_suite_passes_the_chosen_shapes(monkeypatch, tmp_path):
    """`safemoe bench --shapes`: run_suite hands the names to the suite's run (and nothing when none
    are given, so suites without shapes keep their signature); every SHAPED_SUITES run takes them."""
    import inspect
    import types

    seen: list[object] = []
    fake = types.ModuleType("fake_suite")
    fake.SHAPES = {"a": 1, "b": 2}

    def fake_run(ceilings, *, quick, **kwargs):
        seen.append(kwargs.get("shapes"))
        return []

    fake.run = fake_run
    monkeypatch.setattr(bench_cli, "load_suite", lambda name: fake)
    assert bench_cli.run_suite("fake", CEILINGS, tmp_path, quick=True, shapes=["b"]) == "ok"
    assert bench_cli.run_suite("fake", CEILINGS, tmp_path, quick=True) == "ok"
    assert seen == [["b"], None]
    for name in bench.SHAPED_SUITES:
        module = bench.load_suite(name)
        assert module.SHAPES and "shapes" in inspect.signature(module.run).parameters, name


def _safemoe_imports(path: Path) -> list[tuple[str, str | None, int]]:
    """(module, imported name or None, line) of every `safemoe` import in a source file, and
    (module, attribute, line) for every `alias._attr` on a safemoe module bound by an import."""
    tree = ast.parse(path.read_text())
    found: list[tuple[str, str | None, int]] = []
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("safemoe"):
                    found.append((alias.name, None, node.lineno))
                    aliases[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("safemoe"):
            for alias in node.names:
                found.append((str(node.module), alias.name, node.lineno))
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            found.append((aliases[node.value.id], node.attr, node.lineno))
    return found


def test_tooling_layering():
    """check/ never imports the bench; the bench imports neither the demo command nor the check,
    nor a private (`_name`) name of another safemoe module (the peers live in safemoe.peers, the
    demo's models in safemoe.demo_models)."""
    src = REPO / "src" / "safemoe"
    bad = []
    for path in sorted((src / "check").rglob("*.py")):
        bad += [f"{path.name}:{line} imports {module}" for module, _, line in _safemoe_imports(path)
                if module.startswith("safemoe.bench")]
    for path in sorted((src / "bench").rglob("*.py")):
        own = f"safemoe.bench.{path.stem}"
        for module, name, line in _safemoe_imports(path):
            target = f"{module}.{name}" if name else module
            if target.startswith(("safemoe.demo", "safemoe.check")) and not target.startswith(
                "safemoe.demo_models"
            ):
                bad.append(f"{path.name}:{line} imports {target}")
            elif name and name.startswith("_") and not name.startswith("__") and module != own:
                bad.append(f"{path.name}:{line} uses the private {module}.{name}")
    assert not bad, bad


def _bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_on_cpu(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_cli.run(_bench_args("--out", str(tmp_path / "o"), "--quick")) == 0
    assert bench_cli.NO_GPU_MESSAGE in capsys.readouterr().out
    assert not (tmp_path / "o").exists()
    assert bench_cli.run(_bench_args("--suite", "router,nope")) == 2
    assert "unknown suite" in capsys.readouterr().err
    args = _bench_args()
    assert args.suite.split(",") == list(bench.SUITES) and args.out == Path("bench-out")


def test_scripts_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("on a GPU this script runs the real sanitizer cases (scripts/gpu_run.sh does)")
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "sanitize.py")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "needs a CUDA GPU" in done.stdout


# ---------------------------------------------------------------------------------------------
# Peers against the reference
# ---------------------------------------------------------------------------------------------


def _by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted by expert id, so routings that list the same experts in another order compare."""
    order = ids.long().argsort(dim=1)
    return weights.gather(1, order), ids.long().gather(1, order)


@pytest.mark.parametrize("mode", ["softmax", "softmax-plain", "sigmoid-grouped", "sigmoid-bias"])
def test_torch_route_matches_reference(mode):
    generator = torch.Generator().manual_seed(1)
    num_experts, top_k = (32, 4)
    logits = tie_free_logits(13, num_experts, generator=generator)
    kwargs: dict = {"scoring": "softmax", "renormalize": True}
    if mode == "softmax-plain":
        kwargs.update(renormalize=False, routed_scaling_factor=2.0)
    elif mode.startswith("sigmoid"):
        # A bias that is a small multiple of a fixed step keeps selection scores tie-free.
        bias = (torch.randperm(num_experts, generator=generator).float() - 16) / 512
        kwargs.update(scoring="sigmoid", bias=bias, routed_scaling_factor=2.5)
        if mode == "sigmoid-grouped":
            kwargs.update(n_group=4, topk_group=2)
    ref_w, ref_ids = route_reference(logits, top_k, **kwargs)
    for nan_to_num in (False, True):
        w, ids = peers.torch_route(logits, top_k, nan_to_num=nan_to_num, **kwargs)
        assert w.dtype == torch.float32 and ids.shape == (13, top_k)
        w, ids = _by_id(w, ids)
        want_w, want_ids = _by_id(ref_w, ref_ids)
        assert_equal(ids, want_ids, what=f"{mode} ids")
        assert_close(w, want_w, what=f"{mode} weights")
    # The config whole, as the bench and the check pass it: the same routing.
    options = {k: v for k, v in kwargs.items() if k != "bias"}
    whole = peers.torch_route(logits, RouteConfig(top_k, **options), bias=kwargs.get("bias"))
    by_keywords = peers.torch_route(logits, top_k, **kwargs)
    assert_equal(whole[1], by_keywords[1], what=f"{mode} ids, config whole")
    assert_equal(whole[0], by_keywords[0], what=f"{mode} weights, config whole")
    with pytest.raises(TypeError, match="RouteConfig"):
        peers.torch_route(logits, RouteConfig(top_k), scoring="sigmoid")


def test_router_suite_cases_route_with_their_config():
    """Each router shape holds one RouteConfig; the torch peer and the reference route it alike."""
    from safemoe.bench import router

    generator = torch.Generator().manual_seed(4)
    for name, case in router.CASES.items():
        case.route.check(case.num_experts)
        logits = tie_free_logits(6, case.num_experts, generator=generator)
        bias = torch.randperm(case.num_experts, generator=generator).float() / (8 * case.num_experts)
        bias = bias if case.bias else None
        weights, ids = peers.torch_route(logits, case.route, bias=bias)
        assert router.contract_violations(weights, ids.int(), case.num_experts, 6) == 0, name
        want_w, want_ids = _by_id(*route_reference(logits, case.route, bias=bias))
        got_w, got_ids = _by_id(weights, ids)
        assert_equal(got_ids, want_ids, what=f"{name} ids")
        assert_close(got_w, want_w, what=f"{name} weights")


@pytest.mark.parametrize("activation", ["silu", "gelu", "swigluoai"])
def test_hf_loop_matches_reference(activation):
    generator = torch.Generator().manual_seed(2)
    num_tokens, num_experts, top_k, hidden, inter = 9, 6, 2, 16, 8
    x = torch.randn(num_tokens, hidden, generator=generator)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=generator) * 0.3
    w2 = torch.randn(num_experts, hidden, inter, generator=generator) * 0.3
    weights, ids = route_reference(tie_free_logits(num_tokens, num_experts, generator=generator), top_k)
    want = experts_reference(x, w13, w2, weights, ids, activation=activation)
    assert_close(peers.hf_experts_loop(x, w13, w2, weights, ids, activation), want, what="hf loop")
    if peers.grouped_mm_available() is None:
        pytest.skip("this torch has no grouped_mm")
    try:
        got = peers.grouped_mm_experts(x, w13, w2, weights, ids, activation)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"grouped_mm cannot run on CPU here: {exc}")
    assert_close(got, want, what="grouped_mm")


def test_library_peers_report_unavailable():
    status = peers.peer_status()
    assert set(status) == {"torch grouped_mm", "vllm", "sglang", "flashinfer"}
    logits = torch.randn(4, 8)
    calls = {
        "vllm": lambda: peers.vllm_route(logits, 2),
        "sglang": lambda: peers.sglang_route(logits, 2),
        "flashinfer": lambda: peers.flashinfer_fused_experts(
            torch.randn(4, 8),
            torch.randn(2, 8, 8),
            torch.randn(2, 8, 4),
            torch.rand(4, 1),
            torch.zeros(4, 1, dtype=torch.int32),
        ),
    }
    for name, call in calls.items():
        if status[name] == "available":
            continue
        assert "not installed" in status[name]
        with pytest.raises(peers.PeerUnavailable, match="not installed"):
            call()


# ---------------------------------------------------------------------------------------------
# GPU: the timers themselves
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_time_graph_and_eager_gpu():
    a = [torch.randn(1024, 1024, device="cuda") for _ in range(2)]
    us = harness.time_graph(lambda j: a[j] @ a[j], n_variants=2, calls_per_graph=5, replays=5, warmup=1)
    assert 0 < us < 1e5
    us, how = harness.time_auto(lambda j: a[j] @ a[j], n_variants=2, calls_per_graph=5, replays=5, warmup=1)
    assert how == "graph" and us > 0
    assert 0 < harness.time_eager(lambda j: a[j].sum().item(), n_variants=2, iters=5, warmup=1) < 1e6
    with pytest.raises(harness.GraphCaptureError):
        harness.time_graph(lambda j: a[j].sum().item(), calls_per_graph=2, replays=2, warmup=1)
    # The device is usable after a failed capture.
    assert math.isfinite(float((a[0] @ a[1]).sum()))


@pytest.mark.gpu
def test_grouped_mm_peer_gpu():
    if peers.grouped_mm_available() is None:
        pytest.skip("this torch has no grouped_mm")
    generator = torch.Generator().manual_seed(3)
    num_tokens, num_experts, top_k, hidden, inter = 40, 8, 2, 128, 64
    x = torch.randn(num_tokens, hidden, generator=generator).to("cuda", torch.bfloat16)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=generator) * 0.1).to("cuda", torch.bfloat16)
    w2 = (torch.randn(num_experts, hidden, inter, generator=generator) * 0.1).to("cuda", torch.bfloat16)
    weights, ids = route_reference(
        tie_free_logits(num_tokens, num_experts, generator=generator).cuda(), top_k
    )
    want = experts_reference(x, w13, w2, weights, ids)
    assert_close(peers.grouped_mm_experts(x, w13, w2, weights, ids), want, what="grouped_mm bf16")
    assert_close(peers.hf_experts_loop(x, w13, w2, weights, ids), want, what="hf loop bf16")
