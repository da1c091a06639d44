"""Expert parallelism on 2 GPUs with NCCL (NVLink multicast off): the CPU file's checks in bf16 on
the Triton kernels, and the capacity mode captured in a CUDA graph, replayed with each rank's
`num_valid` changed in place (including 0) and the common bucket agreed inside the same graph.

One spawned group runs everything (process start and NCCL init are the expensive part); checks
make their collectives first and assert after, so ranks stay in step when a check fails.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist

from helpers import assert_close, assert_equal
from safemoe.distributed import EPMoE, common_bucket, spawn
from safemoe.health import DROPPED_SLOTS, EP_OVERFLOW_SLOTS, PADDED_ROWS, new_health_tensor
from safemoe.workspace import Workspace
from test_distributed import BUCKETS, CHECKS, COUNTS, Ctx, Setup, assert_group_passed, rank_checks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
]

WORLD = 2
GPU_SETUP = Setup(device="cuda", dtype=torch.bfloat16, backend="auto", shapes=(256, 128, 16, 4))
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _replay_counts(n: int) -> list[int]:
    """The num_valid values a rank replays with (same length on every rank)."""
    return [n, n // 2, 0, max(0, n - 1), n]


def check_graph_capture(ctx: Ctx) -> None:
    hidden, inter, experts, top_k = ctx.setup.shapes
    moe = ctx.moe()
    bucket = ctx.bucket()
    workspace = Workspace(WORLD * bucket, experts // WORLD, top_k, hidden, inter, ctx.dtype, ctx.device)
    health = new_health_tensor(ctx.device)
    ep = EPMoE.from_moe(moe, mode="capacity", workspace=workspace, health=health, backend="auto")
    static_x = torch.full((bucket, hidden), float("nan"), dtype=ctx.dtype, device=ctx.device)
    static_x[: ctx.n] = ctx.x_own
    num_valid = torch.tensor(ctx.n, dtype=torch.int32, device=ctx.device)
    counts = _replay_counts(ctx.n)

    with torch.no_grad():
        want = []  # eager, before any capture
        for count in counts:
            num_valid.fill_(count)
            want.append(ep(static_x, num_valid=num_valid).clone())
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ep(static_x, num_valid=num_valid)
            common_bucket(num_valid, buckets=BUCKETS)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        dist.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = ep(static_x, num_valid=num_valid)
            agreed = common_bucket(num_valid, buckets=BUCKETS)
        health.zero_()
        got = []
        for count in counts:
            num_valid.fill_(count)
            graph.replay()
            got.append((out.clone(), agreed.clone()))
        torch.cuda.synchronize()

    every_rank = [_replay_counts(n) for n in ctx.counts]
    for step, count in enumerate(counts):
        most = max(rank_counts[step] for rank_counts in every_rank)
        bucket_of = min(b for b in BUCKETS if b >= most)
        out_step, agreed_step = got[step]
        assert int(agreed_step) == bucket_of, (step, int(agreed_step), bucket_of)
        assert_close(out_step[:count], want[step][:count], dtype=ctx.dtype, what=f"replay {step}")
        assert_equal(out_step[count:], torch.zeros_like(out_step[count:]), what=f"replay {step} padding")
    values = health.tolist()
    assert values[PADDED_ROWS] == sum(bucket - c for c in counts), values
    assert values[DROPPED_SLOTS] == values[EP_OVERFLOW_SLOTS] == 0, values


def gpu_rank_checks(rank: int, world: int, scenarios: tuple[tuple[int, ...], ...]) -> dict:
    return rank_checks(rank, world, GPU_SETUP, scenarios, {**CHECKS, "graph_capture": check_graph_capture})


@functools.cache
def gpu_group_results() -> tuple[dict, ...] | str:
    for name, value in NO_MULTICAST.items():
        os.environ.setdefault(name, value)
    try:
        return tuple(spawn(gpu_rank_checks, WORLD, COUNTS[WORLD], backend="nccl", timeout_s=60.0,
                           join_timeout_s=240.0, env=NO_MULTICAST))  # fmt: skip
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _keys() -> list[str]:
    names = [*CHECKS, "graph_capture"]
    return [f"{name}[{','.join(map(str, counts))}]" for counts in COUNTS[WORLD] for name in names]


@pytest.mark.parametrize("key", _keys())
def test_nccl_group(key: str) -> None:
    assert_group_passed(gpu_group_results(), key)
