"""The fp8 and ep families of `safemoe check`: they pass on safemoe's backends on CPU, and each of
their checks fails on an implementation with the bug it is there for (a check that cannot fail is
a defect): a quantiser with one batch-global scale, a quantiser that writes padded rows, a
dispatch that clamps bad ids instead of dropping them, an EP exchange that loses a row, one that
ignores its capacity, one that counts dropped ids in the wrong health slot.

The ep faults are plugin files (`--plugin`): the ep cases import the plugins in every spawned
rank, which is where the patched code runs. Each ep case spawns a process group (~5 s on 2 cores).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import safemoe
from safemoe import reference
from safemoe.check import adapters, worker
from safemoe.check.cases.ep import expected_overflow
from safemoe.check.registry import select_cases
from safemoe.check.worker import CaseResult, run_case

CPU = torch.device("cpu")


def _run(check: str, backend: str = "reference", scale: int = 0, index: int = 0) -> CaseResult:
    case = select_cases([check])[0]
    adapter = adapters.make_adapter(backend, CPU)
    if not (adapter.installed and adapter.available):
        pytest.skip(f"{backend}: {adapter.reason}")
    grid = case.grid(scale, CPU)
    return run_case(case, adapter, index, grid[index], seed=0, scale=scale)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as `safemoe check` runs on CPU
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fp8_family_passes(backend: str) -> None:
    """Every --quick case on the reference; the first of each check on the interpreted kernels
    (`safemoe check --quick` in CI runs them all)."""
    for case in select_cases(["fp8"]):
        count = len(case.grid(0, CPU))
        for index in range(count if backend == "reference" else 1):
            result = _run(case.name, backend, index=index)
            assert result.status == "passed", (case.name, index, result.message)


def test_fp8_is_not_applicable_on_peers() -> None:
    result = _run("fp8.padding", "torch")
    assert result.status == "n/a" and "takes no fp8 expert weights" in result.message


def _global_scale_quantiser(t: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The bug of vLLM #40047: one scale for the whole batch (NaN anywhere poisons every row)."""
    rows, cols = t.shape
    group = min(group, cols)
    groups = -(-cols // group)
    v = t.float()
    scale = v.abs().amax().clamp(min=reference.FP8_AMAX_FLOOR) / reference.FP8_MAX  # NaN if any NaN
    q = (v / scale).clamp(-reference.FP8_MAX, reference.FP8_MAX).to(reference.FP8_DTYPE)
    return q, scale.expand(rows, groups).contiguous()


@pytest.mark.usefixtures("one_thread")
def test_fp8_nonfinite_rows_fails_on_a_batch_global_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reference, "quantize_groups_reference", _global_scale_quantiser)
    result = _run("fp8.nonfinite_rows")
    assert result.status == "failed", result
    assert "rows without nan" in result.message and "differ bitwise" in result.message


@pytest.mark.usefixtures("one_thread")
def test_fp8_padding_fails_when_padded_rows_are_quantised(monkeypatch: pytest.MonkeyPatch) -> None:
    """A quantiser that ignores num_valid: it writes every row of the workspace's quantised x (the
    outputs still come out right, so only the buffer check can see it)."""
    real = safemoe.experts

    def quantise_every_row(x, w13, w2, routing, **kwargs: Any):
        workspace = kwargs.get("workspace")
        if workspace is not None:
            num_experts, two_inter, hidden = w13.shape
            group = 128 if kwargs["w13_scale"].dim() == 3 else None
            views = workspace.fp8_views(x.shape[0], num_experts, routing.ids.shape[1], hidden, two_inter // 2,
                                        group)  # fmt: skip
            q, scale = reference.quantize_groups_reference(x, group or hidden)
            views.x.copy_(q)
            views.x_scale.copy_(scale)
        return real(x, w13, w2, routing, **kwargs)

    monkeypatch.setattr(safemoe, "experts", quantise_every_row)
    result = _run("fp8.padding", "triton")
    assert result.status == "failed", result
    assert "of the quantised x was written" in result.message


@pytest.mark.usefixtures("one_thread")
def test_fp8_padding_fails_when_padded_rows_are_computed(monkeypatch: pytest.MonkeyPatch) -> None:
    real = safemoe.experts

    def no_num_valid(x, w13, w2, routing, **kwargs: Any):
        kwargs.pop("num_valid", None)
        return real(x, w13, w2, routing, **kwargs)

    monkeypatch.setattr(safemoe, "experts", no_num_valid)
    result = _run("fp8.padding")
    assert result.status == "failed", result


@pytest.mark.usefixtures("one_thread")
def test_fp8_bad_ids_fails_on_clamped_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dispatch that clamps out-of-range ids into [0, E) instead of dropping them."""
    real = safemoe.experts

    def clamping(x, w13, w2, routing, **kwargs: Any):
        ids = routing.ids.clamp(0, w13.shape[0] - 1)
        weights = torch.nan_to_num(routing.weights, nan=0.5)
        return real(x, w13, w2, safemoe.Routing(weights=weights, ids=ids), **kwargs)

    monkeypatch.setattr(safemoe, "experts", clamping)
    result = _run("fp8.bad_ids")
    assert result.status == "failed", result
    assert "experts_fp8_reference" in result.message or "DROPPED_SLOTS" in result.message


def test_expected_overflow_model() -> None:
    """The capacity policy's plain model: rank rows in increasing t, C rows per peer."""
    ids = torch.tensor([[0, 2], [1, 3], [0, 1], [3, -1]])  # E = 4 over 2 peers: {0, 1} and {2, 3}
    kept, overflow = expected_overflow(ids, 4, 1, 2, 2, 4)
    # peer 0 takes row 0 only; peer 1 takes row 0 only: rows 1-3 lose every in-range slot
    assert kept.tolist() == [[0, 2], [-1, -1], [-1, -1], [-1, -1]] and overflow == 5
    kept, overflow = expected_overflow(ids, 4, 2, 2, 2, 4)
    assert kept.tolist() == [[0, 2], [1, 3], [-1, -1], [-1, -1]] and overflow == 3
    kept, overflow = expected_overflow(ids, 4, 4, 2, 2, 4)
    assert torch.equal(kept, ids) and overflow == 0


# ------------------------------------------------------------------------------------------------
# ep: spawned gloo groups
# ------------------------------------------------------------------------------------------------

EP_FAULTS = {
    # The exchange loses the last row each rank sends to each peer (its count too).
    "drop_row": """
        import torch
        from safemoe.distributed import ep

        _real_plan = ep._plan

        def _plan(ids, rows_valid, layout):
            plan = _real_plan(ids, rows_valid, layout)
            for peer in range(plan.need.shape[1]):
                rows = torch.nonzero(plan.need[:, peer]).flatten()
                if rows.numel():
                    plan.need[rows[-1], peer] = False
            return plan

        ep._plan = _plan
    """,
    # Capacity mode that ignores its capacity (never overflows, never counts). The same room on
    # every rank: a room that follows each rank's own T makes the ranks' all-to-all sizes disagree,
    # and gloo may then abort a rank (SIGABRT) before the check can report (seen once in CI).
    "ignore_capacity": """
        from safemoe.distributed import ep

        ep.capacity_rows = lambda capacity, num_tokens: 4096
    """,
    # Dropped ids counted in the wrong health slot.
    "miscount_dropped": """
        from safemoe.distributed import ep
        from safemoe.health import NONFINITE_ROWS

        ep.DROPPED_SLOTS = NONFINITE_ROWS
    """,
}


def _ep_case_with_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str, check: str
) -> CaseResult:
    plugin = tmp_path / f"ep_fault_{fault}.py"
    plugin.write_text(textwrap.dedent(EP_FAULTS[fault]))
    monkeypatch.setattr(worker, "LOADED_PLUGINS", [str(plugin)])
    return _run(check)


@pytest.mark.parametrize(
    ("fault", "check", "message"),
    [
        ("drop_row", "ep.ragged", "real rows vs the single-process layer"),
        ("ignore_capacity", "ep.capacity_overflow", "capacity 1: real rows vs overflowed slots dropped"),
        ("miscount_dropped", "ep.stale_ids", "health[dropped_slots] is 0, expected"),
    ],
)
def test_ep_checks_fail_on_a_broken_exchange(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str, check: str, message: str
) -> None:
    result = _ep_case_with_plugin(tmp_path, monkeypatch, fault, check)
    assert result.status == "failed", result
    assert result.message.startswith("rank ") and message in result.message, result.message


def test_ep_four_ranks_pass() -> None:
    """The 4-rank group of the CPU scale (--quick runs 2 ranks in CI): stale ids and NaN padding."""
    grid = select_cases(["ep.stale_ids"])[0].grid(1, CPU)
    index = next(i for i, p in enumerate(grid) if p["world"] == 4)
    result = _run("ep.stale_ids", scale=1, index=index)
    assert result.status == "passed", result.message


def test_ep_transport_on_cuda() -> None:
    """NCCL with a GPU per rank; gloo when ranks share GPUs (rank r on cuda:r mod GPUs); n/a with none."""
    from safemoe.check.cases.ep import collective_backend, rank_device
    from safemoe.check.registry import NotApplicable

    assert collective_backend(2, 2) == "nccl" and collective_backend(2, 8) == "nccl"
    assert collective_backend(4, 1) == "gloo" and collective_backend(4, 2) == "gloo"
    with pytest.raises(NotApplicable, match="no CUDA device"):
        collective_backend(2, 0)
    assert [rank_device("cuda", r, 1) for r in range(4)] == [torch.device("cuda", 0)] * 4
    assert [rank_device("cuda", r, 2).index for r in range(4)] == [0, 1, 0, 1]
    assert [rank_device("cuda", r, 4).index for r in range(4)] == [0, 1, 2, 3]
    assert rank_device("cpu", 3, 0) == torch.device("cpu")


def test_ep_case_runs_in_a_worker_process(tmp_path: Path) -> None:
    """Through the worker pool: the ranks a case spawns re-import the worker's entry module, which
    must not start a second worker reading the jobs on the inherited stdin (that hung the run)."""
    import json
    import subprocess
    import sys

    out_json = tmp_path / "ep.json"
    done = subprocess.run(
        [sys.executable, "-m", "safemoe", "check", "--device", "cpu", "--quick", "--only", "ep.stale_ids",
         "--backend", "reference", "--peers", "none", "--jobs", "1", "--json", str(out_json)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out_json.read_text())
    assert [r["status"] for r in report["results"]] == ["passed"]


# ------------------------------------------------------------------------------------------------
# GPU: the CUDA-scale grids (fp8; ep on NCCL groups, or gloo where ranks share GPUs)
# ------------------------------------------------------------------------------------------------


def _cuda_cases(family: str, backend: str) -> list[CaseResult]:
    from safemoe.check.worker import indexed_device

    device = indexed_device(torch.device("cuda"))
    adapter = adapters.make_adapter(backend, device)
    assert adapter.installed and adapter.available, adapter.reason
    results = []
    for case in select_cases([family]):
        grid = case.grid(2, device)
        for index in range(len(grid)):
            results.append(run_case(case, adapter, index, grid[index], seed=0, scale=2))
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fp8_family_on_cuda(backend: str) -> None:
    """Every CUDA-scale fp8 case (96: both modes, bf16/fp16, every fill and num_valid form)."""
    results = _cuda_cases("fp8", backend)
    failed = [f"{r.check}#{r.case} [{r.params}]: {r.message}" for r in results if r.status != "passed"]
    assert not failed, "\n".join(failed[:10])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_ep_family_on_cuda(backend: str) -> None:
    """Every CUDA-scale ep case passes: NCCL with a GPU per rank, gloo where ranks share GPUs
    (so one GPU runs groups of 2 and 4 ranks on the same kernels)."""
    results = _cuda_cases("ep", backend)
    assert results
    failed = [f"{r.check}#{r.case} [{r.params}]: {r.message}" for r in results if r.status != "passed"]
    assert not failed, "\n".join(failed[:10])
