"""Expert parallelism: EPMoE / ep_experts against a single-process reference, on CPU (gloo, the
reference backend, fp32) and on 2 GPUs (NCCL with NVLink multicast off, the Triton kernels, bf16).

Spawned groups (one group per device and world size, reused by every check: process start and
NCCL init are the expensive part) run `rank_checks`: ragged real-token counts including a rank
with none, each rank padded to the common bucket with NaN rows, stale ids in padded rows,
out-of-range ids in valid rows, both modes, capacity overflow counted exactly. On CPU groups of 2
and 4 ranks; on CUDA a group of 2 that also captures the capacity mode in a CUDA graph, replayed
with each rank's `num_valid` changed in place (including 0) and the common bucket agreed inside
the same graph (`check_graph_capture`). Checks make all their collectives first and assert after,
so one failing check cannot desynchronise the ranks for the next one. scripts/ep_gpu_run.sh runs
the CUDA group (`-m gpu`).

Inputs are quantised (x and router weights multiples of 1/8) so the router logits are exact in
fp32 whatever the matmul's summation order: the EP layer (logits of a padded per-rank batch) and
the reference (logits of all real rows at once) route identically, and the comparison is about
the exchange, not about near-ties.
"""

from __future__ import annotations

import functools
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from helpers import (
    INTERPRETER,
    STALE_ID,
    assert_close,
    assert_equal,
    device_param,
    garbage_ids,
    interpreter_only,
)
from safemoe._checks import NumValid
from safemoe.check.cases.ep import expected_overflow  # the capacity policy in plain Python, shared
from safemoe.distributed import EPLayout, EPMoE, common_bucket, ep_experts, pad_to_common_bucket, spawn
from safemoe.distributed.ep import _pack, _unpack, capacity_rows, check_mode, run_exchange
from safemoe.graphs import warm_up
from safemoe.health import DROPPED_SLOTS, EP_OVERFLOW_SLOTS, NONFINITE_ROWS, PADDED_ROWS, new_health_tensor
from safemoe.layer import MoE
from safemoe.reference import experts_reference, route_reference
from safemoe.routing import Routing
from safemoe.workspace import Workspace

H, I, E, K = 16, 8, 8, 3  # noqa: E741 (the project's shape names)
EXCHANGES = ("torch", "triton")  # both exchange paths run every check in the same spawned group
BUCKETS = (1, 2, 4, 8, 16, 32)
# Real tokens per rank; each tuple is one scenario (a rank with 0 real tokens in each).
COUNTS = {2: ((6, 0), (3, 13)), 4: ((5, 0, 3, 8),)}


@dataclass(frozen=True)
class Setup:
    """What a group of ranks runs: device, dtype, backend, and the router's logits dtype."""

    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    backend: str = "reference"
    shapes: tuple[int, int, int, int] = (H, I, E, K)
    exchange: str = "torch"  # "triton": safemoe.kernels.ep_exchange (the interpreter on CPU)


class Ctx:
    """One rank's view of a scenario: the global inputs (identical on every rank: same seeds)."""

    def __init__(self, rank: int, world: int, setup: Setup, counts: tuple[int, ...]) -> None:
        self.rank, self.world, self.setup, self.counts = rank, world, setup, counts
        self.device, self.dtype = torch.device(setup.device), setup.dtype
        hidden, inter, experts, top_k = setup.shapes
        self.hidden, self.inter, self.experts, self.top_k = hidden, inter, experts, top_k
        gen = torch.Generator().manual_seed(1234)
        total = sum(counts)
        # Multiples of 1/8: exact in bf16, and logits sums exact in fp32 (see the module docstring).
        self.x_all = (torch.randint(-8, 9, (total, hidden), generator=gen) / 8).to(self.dtype)
        self.n = counts[rank]
        self.first_row = sum(counts[:rank])
        self.x_own = self.x_all[self.first_row : self.first_row + self.n].to(self.device)
        self.gen = gen

    def moe(self, **kwargs: object) -> MoE:
        """The single-process layer (reference backend), identical on every rank."""
        hidden, inter, experts, top_k = self.setup.shapes
        moe = MoE(hidden, inter, experts, top_k, backend="reference", dtype=self.dtype, device=self.device,
                  **kwargs)  # type: ignore[arg-type]  # fmt: skip
        gen = torch.Generator().manual_seed(99)
        with torch.no_grad():
            moe.gate.weight.copy_(torch.randint(-8, 9, moe.gate.weight.shape, generator=gen) / 8)
            moe.w13.copy_(torch.randn(moe.w13.shape, generator=gen) * hidden**-0.5)
            moe.w2.copy_(torch.randn(moe.w2.shape, generator=gen) * inter**-0.5)
            if moe.gate.selection_bias is not None:
                moe.gate.selection_bias.copy_(torch.randint(-4, 5, (experts,), generator=gen) / 64)
        return moe

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows padded to the common bucket, padding rows NaN."""
        return pad_to_common_bucket(self.x_own, self.n, buckets=BUCKETS, fill=float("nan"))

    def bucket(self) -> int:
        most = max(self.counts)
        return min(b for b in BUCKETS if b >= most) if most <= BUCKETS[-1] else most

    def own_rows(self, all_rows: torch.Tensor) -> torch.Tensor:
        return all_rows[self.first_row : self.first_row + self.n]

    def ep_kwargs(self) -> dict:
        return {"backend": self.setup.backend, "exchange": self.setup.exchange}


CPU_SETUPS = tuple(Setup(exchange=exchange) for exchange in EXCHANGES)


def _full_reference(ctx: Ctx, moe: MoE) -> torch.Tensor:
    """The single-process layer on the real rows of ALL ranks, concatenated; this rank's rows."""
    with torch.no_grad():
        return ctx.own_rows(moe(ctx.x_all.to(ctx.device)))


def _check_padded_zero(out: torch.Tensor, n: int, what: str) -> None:
    assert_equal(out[n:], torch.zeros_like(out[n:]), what=f"{what}: padded rows")


# ------------------------------------------------------------------------------------------------
# Checks run on every rank of a spawned group. Collectives first, asserts last.
# ------------------------------------------------------------------------------------------------


def check_common_bucket(ctx: Ctx) -> None:
    local = torch.tensor(ctx.n, dtype=torch.int32, device=ctx.device)
    agreed = common_bucket(local, buckets=BUCKETS)
    raw = common_bucket(local)
    from_int = common_bucket(ctx.n, device=ctx.device)
    x_pad, nv = ctx.padded()
    assert agreed.dim() == 0 and agreed.device == local.device  # cuda:r, not just "cuda"
    assert int(agreed) == ctx.bucket(), (int(agreed), ctx.counts)
    assert int(raw) == max(ctx.counts) == int(from_int)
    assert x_pad.shape == (ctx.bucket(), ctx.hidden) and int(nv) == ctx.n and nv.dtype == torch.int32
    assert bool(torch.isnan(x_pad[ctx.n :]).all())
    assert_equal(x_pad[: ctx.n], ctx.x_own, what="real rows kept")


def _layer_check(ctx: Ctx, **moe_kwargs: object) -> None:
    moe = ctx.moe(**moe_kwargs)
    x_pad, nv = ctx.padded()
    outs, healths = {}, {}
    for mode in ("dynamic", "capacity"):
        health = new_health_tensor(ctx.device)
        ep = EPMoE.from_moe(moe, mode=mode, health=health, **ctx.ep_kwargs())
        with torch.no_grad():
            outs[mode] = ep(x_pad, num_valid=nv)
        healths[mode] = health.tolist()
    want = _full_reference(ctx, moe)
    for mode, out in outs.items():
        assert_close(out[: ctx.n], want, dtype=ctx.dtype, what=f"{mode}: real rows vs single process")
        _check_padded_zero(out, ctx.n, mode)
        health = healths[mode]
        assert health[PADDED_ROWS] == ctx.bucket() - ctx.n, health
        assert health[DROPPED_SLOTS] == health[EP_OVERFLOW_SLOTS] == health[NONFINITE_ROWS] == 0, health
    # Enough capacity (C = the bucket): the same rows as the exact-size exchange.
    assert_close(outs["capacity"], outs["dynamic"], dtype=ctx.dtype, what="capacity vs dynamic")


def check_layer_softmax(ctx: Ctx) -> None:
    _layer_check(ctx)


def check_layer_grouped_sigmoid(ctx: Ctx) -> None:
    """DeepSeek-V3's routing: sigmoid, selection bias, group-limited, scaled weights."""
    _layer_check(
        ctx, scoring="sigmoid", selection_bias=True, n_group=4, topk_group=2, routed_scaling_factor=2.5
    )


def check_deterministic(ctx: Ctx) -> None:
    moe = ctx.moe()
    x_pad, nv = ctx.padded()
    runs = []
    for mode in ("dynamic", "dynamic", "capacity", "capacity"):
        ep = EPMoE.from_moe(moe, mode=mode, **ctx.ep_kwargs())
        with torch.no_grad():
            runs.append(ep(x_pad, num_valid=nv))
    assert_equal(runs[0], runs[1], what="dynamic twice")
    assert_equal(runs[2], runs[3], what="capacity twice")


def _local_routing(ctx: Ctx, x: torch.Tensor, moe: MoE) -> tuple[torch.Tensor, torch.Tensor]:
    logits = moe.gate.logits(x.to(ctx.device))
    return route_reference(logits.float(), ctx.top_k)


def check_capacity_overflow(ctx: Ctx) -> None:
    moe = ctx.moe()
    x_pad, nv = ctx.padded()
    results = {}
    for cap in (1, 2):
        health = new_health_tensor(ctx.device)
        ep = EPMoE.from_moe(moe, mode="capacity", capacity=cap, health=health, **ctx.ep_kwargs())
        with torch.no_grad():
            results[cap] = (ep(x_pad, num_valid=nv), health.tolist())
    with torch.no_grad():
        weights, ids = _local_routing(ctx, ctx.x_own, moe)
    per_rank = ctx.experts // ctx.world
    for cap, (out, health) in results.items():
        kept, overflow = expected_overflow(ids.cpu(), ctx.n, cap, per_rank, ctx.world, ctx.experts)
        with torch.no_grad():
            want = experts_reference(ctx.x_own, moe.w13, moe.w2, weights, kept.to(ctx.device))
        assert health[EP_OVERFLOW_SLOTS] == overflow, (cap, health, overflow)
        assert health[DROPPED_SLOTS] == 0, health
        assert_close(out[: ctx.n], want, dtype=ctx.dtype, what=f"capacity {cap}: overflowed slots dropped")
        _check_padded_zero(out, ctx.n, f"capacity {cap}")


def check_stale_ids_and_poisoned_padding(ctx: Ctx) -> None:
    """ep_experts on hand-made routing: valid rows hold -1, -7, E, 123456789 and duplicates; padded
    rows hold ids that look real or stale, NaN weights and NaN x."""
    moe = ctx.moe()
    bucket = ctx.bucket()
    gen = torch.Generator().manual_seed(7 + ctx.rank)
    ids = garbage_ids(bucket, ctx.top_k, ctx.experts, generator=gen)
    ids[ctx.n :: 2] = STALE_ID
    ids[ctx.n + 1 :: 2] = ctx.rank % ctx.experts  # padded rows that look like real routing
    weights = torch.rand(bucket, ctx.top_k, generator=gen)
    weights[ctx.n :] = float("nan")
    x = torch.full((bucket, ctx.hidden), float("nan"), dtype=ctx.dtype, device=ctx.device)
    x[: ctx.n] = ctx.x_own
    ids, weights = ids.to(ctx.device), weights.to(ctx.device)
    first, per_rank = ctx.rank * (ctx.experts // ctx.world), ctx.experts // ctx.world
    w13 = moe.w13[first : first + per_rank].detach().contiguous()
    w2 = moe.w2[first : first + per_rank].detach().contiguous()
    routing = Routing(weights=weights, ids=ids)
    results = {}
    for mode, cap in (("dynamic", None), ("capacity", None), ("capacity", bucket)):
        health = new_health_tensor(ctx.device)
        out = ep_experts(
            x, w13, w2, routing, num_experts=ctx.experts, mode=mode, capacity=cap,
            num_valid=torch.tensor(ctx.n, device=ctx.device), health=health, **ctx.ep_kwargs(),
        )  # fmt: skip
        results[(mode, cap)] = (out, health.tolist())
    want = experts_reference(x, moe.w13.detach(), moe.w2.detach(), weights, ids,
                             num_valid=NumValid(count=ctx.n, tensor=None))  # fmt: skip
    dropped = int(((ids[: ctx.n] < 0) | (ids[: ctx.n] >= ctx.experts)).sum())
    for key, (out, health) in results.items():
        assert bool(torch.isfinite(out).all()), key
        assert_close(out[: ctx.n], want[: ctx.n], dtype=ctx.dtype, what=f"{key}: real rows")
        _check_padded_zero(out, ctx.n, str(key))
        assert health[DROPPED_SLOTS] == dropped and health[EP_OVERFLOW_SLOTS] == 0, (key, health, dropped)


def check_no_real_tokens_anywhere(ctx: Ctx) -> None:
    """Every rank at num_valid 0 (both modes), then one rank with an EMPTY batch (T = 0) while the
    others have rows (dynamic mode, ranks may differ in T)."""
    moe = ctx.moe()
    x = torch.full((4, ctx.hidden), float("nan"), dtype=ctx.dtype, device=ctx.device)
    outs = []
    for mode in ("dynamic", "capacity"):
        ep = EPMoE.from_moe(moe, mode=mode, **ctx.ep_kwargs())
        with torch.no_grad():
            outs.append(ep(x, num_valid=0))
    ep = EPMoE.from_moe(moe, mode="dynamic", **ctx.ep_kwargs())
    empty_rank = ctx.world - 1
    mine = ctx.x_own[:0] if ctx.rank == empty_rank else ctx.x_own
    with torch.no_grad():
        ragged = ep(mine)
    for out in outs:
        assert_equal(out, torch.zeros_like(out), what="all padding")
    if ctx.rank == empty_rank:
        assert ragged.shape == (0, ctx.hidden)
    else:
        assert_close(ragged, _full_reference(ctx, moe), dtype=ctx.dtype, what="beside an empty rank")


def check_nan_router_rows(ctx: Ctx) -> None:
    """Rank 1's real rows include a NaN row and an Inf row (its router emits non-finite logits for
    them): counted in that rank's health, no hang, no crash, and every other row of every rank
    equals the single-process layer; in both modes and with a capacity that overflows (there the
    other rows equal the reference with the overflowed slots dropped, as check_capacity_overflow
    models)."""
    bad_rank = 1 % ctx.world
    start = sum(ctx.counts[:bad_rank])
    bad = [start + j for j in (0, 2) if j < ctx.counts[bad_rank]]
    x_all = ctx.x_all.clone()
    for row, value in zip(bad, (float("nan"), float("inf")), strict=False):
        x_all[row] = value
    x_own = x_all[ctx.first_row : ctx.first_row + ctx.n].to(ctx.device)
    x_pad, nv = pad_to_common_bucket(x_own, ctx.n, buckets=BUCKETS, fill=float("nan"))
    moe = ctx.moe()
    results = {}
    for mode, cap in (("dynamic", None), ("capacity", None), ("capacity", 1)):
        health = new_health_tensor(ctx.device)
        ep = EPMoE.from_moe(moe, mode=mode, capacity=cap, health=health, **ctx.ep_kwargs())
        with torch.no_grad():
            results[(mode, cap)] = (ep(x_pad, num_valid=nv), health.tolist())
    with torch.no_grad():
        want = ctx.own_rows(moe(x_all.to(ctx.device)))
        weights, ids = _local_routing(ctx, x_own, moe)
    mine_bad = [row - ctx.first_row for row in bad if ctx.first_row <= row < ctx.first_row + ctx.n]
    clean = torch.ones(ctx.n, dtype=torch.bool)
    clean[mine_bad] = False
    for (mode, cap), (out, health) in results.items():
        what = f"{mode} C={cap}"
        assert health[NONFINITE_ROWS] == len(mine_bad), (what, health, mine_bad)
        _check_padded_zero(out, ctx.n, what)
        if cap is None:
            assert_close(out[: ctx.n][clean], want[clean], dtype=ctx.dtype, what=f"{what}: clean rows")
            assert health[EP_OVERFLOW_SLOTS] == 0, health
        else:
            kept, overflow = expected_overflow(ids.cpu(), ctx.n, cap, ctx.experts // ctx.world, ctx.world,
                                                ctx.experts)  # fmt: skip
            with torch.no_grad():
                capped = experts_reference(x_own, moe.w13, moe.w2, weights, kept.to(ctx.device))
            assert health[EP_OVERFLOW_SLOTS] == overflow, (what, health, overflow)
            assert_close(out[: ctx.n][clean], capped[clean], dtype=ctx.dtype, what=f"{what}: clean rows")


def check_stale_ids_on_the_wire(ctx: Ctx) -> None:
    """Ids corrupted IN TRANSIT: every rank overwrites, in the wire it received, one slot of each
    blank row (ids all -1) with an id it does not own (123456789, -7, E + 3, another rank's expert).
    Each is counted as a stray in DROPPED_SLOTS, never used, and every rank's output is bitwise the
    uncorrupted one (capacity mode, C = the bucket, through `run_exchange` with the real group)."""
    moe = ctx.moe()
    x_pad, nv = ctx.padded()
    layout = EPLayout.of_group(ctx.experts)
    first, per_rank = layout.first_expert, layout.experts_per_rank
    w13 = moe.w13[first : first + per_rank].detach()
    w2 = moe.w2[first : first + per_rank].detach()
    with torch.no_grad():
        weights, ids = moe.gate(x_pad, nv)
    routing = Routing(weights=weights, ids=ids)
    foreign = [STALE_ID, -7, ctx.experts + 3, (first + per_rank) % ctx.experts]
    injected = [0]

    def collective(corrupt: bool):
        calls = [0]

        def all_to_all(out, inp, out_splits, in_splits) -> None:
            dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits)
            calls[0] += 1
            if corrupt and calls[0] == 1:  # the dispatch wire: x bytes, then K ids, K weights
                meta = out[:, -8 * ctx.top_k :].view(torch.int32)
                blank = torch.nonzero((meta[:, : ctx.top_k] == -1).all(dim=1)).flatten().tolist()
                for j, row in enumerate(blank):
                    meta[row, 0] = foreign[j % len(foreign)]
                injected[0] = len(blank)

        return all_to_all

    def local_experts(x_recv, w, local_ids):
        return experts_reference(x_recv, w13, w2, w, local_ids)

    outs, healths = [], []
    for corrupt in (False, True):
        health = new_health_tensor(ctx.device)
        with torch.no_grad():
            outs.append(run_exchange(ctx.setup.exchange, x_pad, routing, layout, "capacity", None,
                                     NumValid(count=ctx.n, tensor=None), health, collective(corrupt),
                                     local_experts))  # fmt: skip
        healths.append(health.tolist())
    assert injected[0] > 0, "no blank row received: the scenario does not test anything"
    assert_equal(outs[1], outs[0], what="output with ids corrupted in transit")
    assert healths[1][DROPPED_SLOTS] - healths[0][DROPPED_SLOTS] == injected[0], (healths, injected)


CHECKS: dict[str, Callable[[Ctx], None]] = {
    "stale_ids_on_the_wire": check_stale_ids_on_the_wire,
    "nan_router_rows": check_nan_router_rows,
    "common_bucket": check_common_bucket,
    "layer_softmax": check_layer_softmax,
    "layer_grouped_sigmoid": check_layer_grouped_sigmoid,
    "deterministic": check_deterministic,
    "capacity_overflow": check_capacity_overflow,
    "stale_ids_and_poisoned_padding": check_stale_ids_and_poisoned_padding,
    "no_real_tokens_anywhere": check_no_real_tokens_anywhere,
}


def rank_checks(
    rank: int,
    world: int,
    setups: tuple[Setup, ...],
    scenarios: tuple[tuple[int, ...], ...],
    checks: dict[str, Callable[[Ctx], None]] | None = None,
) -> dict:
    """Run every check (default CHECKS) for every setup and scenario on this rank;
    {"exchange:name[counts]": None or the traceback}."""
    results: dict[str, str | None] = {}
    for setup in setups:
        for counts in scenarios:
            for name, check in (CHECKS if checks is None else checks).items():
                key = _key(setup.exchange, name, counts)
                try:
                    check(Ctx(rank, world, setup, counts))
                    results[key] = None
                except Exception:
                    results[key] = traceback.format_exc(limit=-6)
    return results


def _key(exchange: str, name: str, counts: tuple[int, ...]) -> str:
    return f"{exchange}:{name}[{','.join(map(str, counts))}]"


# ------------------------------------------------------------------------------------------------
# CUDA only: the capacity mode captured in a CUDA graph (run by the NCCL group with CHECKS)
# ------------------------------------------------------------------------------------------------

GPU_WORLD = 2
GPU_SETUPS = tuple(Setup(device="cuda", dtype=torch.bfloat16, backend="auto", shapes=(256, 128, 16, 4),
                         exchange=exchange) for exchange in EXCHANGES)  # fmt: skip
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _replay_counts(n: int) -> list[int]:
    """The num_valid values a rank replays with (same length on every rank)."""
    return [n, n // 2, 0, max(0, n - 1), n]


def check_graph_capture(ctx: Ctx) -> None:
    hidden, inter, experts, top_k = ctx.setup.shapes
    moe = ctx.moe()
    bucket = ctx.bucket()
    workspace = Workspace(GPU_WORLD * bucket, experts // GPU_WORLD, top_k, hidden, inter, ctx.dtype,
                          ctx.device)
    health = new_health_tensor(ctx.device)
    ep = EPMoE.from_moe(moe, mode="capacity", workspace=workspace, health=health, **ctx.ep_kwargs())
    static_x = torch.full((bucket, hidden), float("nan"), dtype=ctx.dtype, device=ctx.device)
    static_x[: ctx.n] = ctx.x_own
    num_valid = torch.tensor(ctx.n, dtype=torch.int32, device=ctx.device)
    counts = _replay_counts(ctx.n)

    with torch.no_grad():
        want = []  # eager, before any capture
        for count in counts:
            num_valid.fill_(count)
            want.append(ep(static_x, num_valid=num_valid).clone())
        warm_up(lambda: (ep(static_x, num_valid=num_valid), common_bucket(num_valid, buckets=BUCKETS)))
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


GPU_CHECKS: dict[str, Callable[[Ctx], None]] = {**CHECKS, "graph_capture": check_graph_capture}


def gpu_rank_checks(rank: int, world: int, scenarios: tuple[tuple[int, ...], ...]) -> dict:
    return rank_checks(rank, world, GPU_SETUPS, scenarios, GPU_CHECKS)


# ------------------------------------------------------------------------------------------------
# The spawned groups: gloo on CPU (2 and 4 ranks), NCCL on 2 GPUs
# ------------------------------------------------------------------------------------------------


@functools.cache
def group_results(device: str, world: int) -> tuple[dict, ...] | str:
    """Each rank's results for a spawned group of `world` ranks on `device` (cached: one spawn per
    device and world size), or the reason the group failed."""
    try:
        if device == "cpu":
            return tuple(spawn(rank_checks, world, CPU_SETUPS, COUNTS[world], timeout_s=45.0,
                               join_timeout_s=240.0))
        for name, value in NO_MULTICAST.items():
            os.environ.setdefault(name, value)
        return tuple(spawn(gpu_rank_checks, world, COUNTS[world], backend="nccl", timeout_s=60.0,
                           join_timeout_s=240.0, env=NO_MULTICAST))  # fmt: skip
    except Exception as exc:  # spawning, a timeout, a crashed rank: every check of the group fails
        return f"{type(exc).__name__}: {exc}"


def assert_group_passed(results: tuple[dict, ...] | str, key: str) -> None:
    assert not isinstance(results, str), f"the spawned group failed: {results}"
    failures = [f"rank {rank}:\n{res[key]}" for rank, res in enumerate(results) if res[key] is not None]
    assert not failures, "\n".join(failures)


def _group_params() -> list:
    """(device, world, key) per check: gloo groups on CPU run everywhere (reference backend, no
    Triton); the NCCL group needs 2 GPUs."""
    two_gpus = pytest.mark.skipif(torch.cuda.device_count() < GPU_WORLD, reason="needs 2 GPUs")
    params = []
    for device, worlds, checks, setups in (("cpu", COUNTS, CHECKS, CPU_SETUPS),
                                           ("cuda", (GPU_WORLD,), GPU_CHECKS, GPU_SETUPS)):  # fmt: skip
        for world in worlds:
            for setup in setups:
                for counts in COUNTS[world]:
                    for name in checks:
                        key = _key(setup.exchange, name, counts)
                        if device == "cpu":
                            # the Triton exchange on CPU tensors runs under the interpreter only
                            marks = [interpreter_only("CPU ranks")] if setup.exchange == "triton" else []
                            params.append(pytest.param(device, world, key, marks=marks))
                        else:
                            params.append(device_param(device, world, key, marks=[two_gpus]))
    return params


@pytest.mark.parametrize(("device", "world", "key"), _group_params())
def test_spawned_group(device: str, world: int, key: str) -> None:
    assert_group_passed(group_results(device, world), key)


# ------------------------------------------------------------------------------------------------
# In-process: the layout's bounds checks, the wire format, arguments; a world of one.
# ------------------------------------------------------------------------------------------------


def test_layout_rejects_bad_splits() -> None:
    with pytest.raises(ValueError, match="multiple of the world size"):
        EPLayout(world_size=4, rank=0, num_experts=6)
    with pytest.raises(ValueError, match="multiple of the world size"):
        EPLayout(world_size=4, rank=0, num_experts=2)
    with pytest.raises(ValueError, match="rank"):
        EPLayout(world_size=2, rank=2, num_experts=8)
    with pytest.raises(TypeError):
        EPLayout(world_size=2, rank=True, num_experts=8)


def test_to_local_bounds_checks_every_id() -> None:
    layout = EPLayout(world_size=4, rank=2, num_experts=16)  # owns [8, 12)
    int_min, int_max = -(2**31), 2**31 - 1
    ids = torch.tensor([[-1, 8, 11, 12, 7, STALE_ID, int_min, int_max, int_min + 8, 0]], dtype=torch.int32)
    local, ok = layout.to_local(ids)
    assert_equal(local, torch.tensor([[-1, 0, 3, -1, -1, -1, -1, -1, -1, -1]], dtype=torch.int32))
    assert ok.tolist() == [[False, True, True, False, False, False, False, False, False, False]]
    served = torch.tensor([[False, True, True, True, True, False, False, False, False, True]])
    owner = layout.owner(ids, served)
    assert owner.tolist() == [[-1, 2, 2, 3, 1, -1, -1, -1, -1, 0]]


@pytest.mark.parametrize("dtype,hidden", [(torch.float32, 5), (torch.bfloat16, 5), (torch.float16, 8)])
def test_wire_roundtrip_keeps_bits_and_blanks_unused_rows(dtype: torch.dtype, hidden: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, hidden, generator=gen).to(dtype)
    x[3] = float("nan")  # a padded row: must never reach the wire
    ids = torch.tensor([[0, 5, 6], [7, 1, 2], [4, 4, 6], [STALE_ID, -1, 3]], dtype=torch.int32)
    weights = torch.tensor([[0.5, float("nan"), 0.25], [1.0, 2.0, 3.0], [0.1, 0.2, 0.3], [9.0] * 3])
    layout = EPLayout(world_size=2, rank=0, num_experts=8)
    served = torch.tensor([[True] * 3, [True] * 3, [True] * 3, [False] * 3])
    owner = layout.owner(ids, served)
    send_token = torch.tensor([0, 1, -1, 0, 2, -1])  # peer 0 owns experts [0, 4), peer 1 [4, 8)
    send_peer = torch.tensor([0, 0, 0, 1, 1, 1])
    wire = _pack(x, ids, weights, owner, send_token, send_peer)
    x_r, ids_r, w_r = _unpack(wire, hidden, 3, dtype)
    assert x_r.is_contiguous() and ids_r.is_contiguous() and w_r.is_contiguous()
    assert_equal(x_r[[0, 1, 3, 4]], x[[0, 1, 0, 2]])
    assert_equal(x_r[[2, 5]], torch.zeros(2, hidden, dtype=dtype), what="unused rows")
    assert ids_r.tolist() == [[0, -1, -1], [-1, 1, 2], [-1] * 3, [-1, 5, 6], [4, 4, 6], [-1] * 3]
    assert_equal(w_r[0], torch.tensor([0.5, 0.0, 0.0]))
    assert torch.isnan(w_r[3, 1]), "a weight's bits travel unchanged"
    assert_equal(w_r[[2, 5]], torch.zeros(2, 3))


def test_capacity_and_mode_arguments() -> None:
    assert capacity_rows(None, 7) == 7 and capacity_rows(None, 0) == 1
    assert capacity_rows(3, 100) == 3 and capacity_rows(0.25, 10) == 3
    for bad, exc in ((0, ValueError), (-1.0, ValueError), (float("inf"), ValueError), (True, TypeError),
                     ("4", TypeError)):  # fmt: skip
        with pytest.raises(exc):
            capacity_rows(bad, 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode"):
        check_mode("static", None)
    with pytest.raises(ValueError, match="only used with mode='capacity'"):
        check_mode("dynamic", 4)


def test_needs_an_initialised_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        EPMoE(H, I, E, K)


@pytest.fixture
def world_of_one():
    """A single-rank gloo group in this process (a HashStore: no ports)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("world_of_one")
def test_world_of_one_is_the_plain_layer_and_checks_arguments() -> None:
    ctx = Ctx(0, 1, Setup(), (5,))
    moe = ctx.moe()
    x = torch.cat([ctx.x_own, torch.full((3, H), float("nan"))])
    want = moe(ctx.x_own)
    for mode in ("dynamic", "capacity"):
        for exchange in EXCHANGES if INTERPRETER else tuple(e for e in EXCHANGES if e != "triton"):
            ep = EPMoE.from_moe(moe, mode=mode, exchange=exchange)
            out = ep(x, num_valid=torch.tensor(5))
            assert_close(out[:5], want, what=f"{mode} {exchange}")
            _check_padded_zero(out, 5, mode)
            assert ep(x.view(2, 4, H), num_valid=5).shape == (2, 4, H)
            assert "rank=0/1" in repr(ep) and f"exchange={exchange}" in repr(ep)
    with pytest.raises(ValueError, match="exchange"):
        EPMoE.from_moe(moe, exchange="nccl")
    if not INTERPRETER:  # a CUDA machine: CPU tensors cannot run compiled Triton, said before any launch
        with pytest.raises(RuntimeError, match=r"exchange='triton'.*TRITON_INTERPRET"):
            EPMoE.from_moe(moe, exchange="triton")(x, num_valid=5)
    ep = EPMoE.from_moe(moe)
    routing = Routing(weights=torch.ones(8, K), ids=torch.zeros(8, K, dtype=torch.int32))
    with pytest.raises(ValueError, match="per rank"):
        ep_experts(x, ep.w13[:4].contiguous(), ep.w2[:4].contiguous(), routing, num_experts=E)
    with pytest.raises(ValueError, match="num_valid"):
        ep_experts(x, ep.w13, ep.w2, routing, num_experts=E, num_valid=9)
    with pytest.raises(TypeError, match="routing"):
        ep_experts(x, ep.w13, ep.w2, (routing.weights, routing.ids), num_experts=E)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="capacity"):
        EPMoE(H, I, E, K, mode="dynamic", capacity=4)
    with pytest.raises(ValueError, match="end with H"):
        ep(torch.zeros(2, H + 1))
    with pytest.raises(ValueError, match="trailing dims"):
        ep.load_experts(moe.w13[:, :, :4], moe.w2)
    # Shared experts (with their gate) and expert biases work in EPMoE as in MoE.
    full = ctx.moe(shared_intermediate_size=8, shared_expert_gate=True, expert_bias=True)
    for mode in ("dynamic", "capacity"):
        ep = EPMoE.from_moe(full, mode=mode)
        out = ep(x, num_valid=5)
        assert_close(out[:5], full(ctx.x_own), what=f"{mode}: shared expert and expert biases")
        _check_padded_zero(out, 5, mode)


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("quant", ["per_tensor", "block"])
def test_world_of_one_from_an_fp8_moe(quant: str) -> None:
    """EPMoE.from_moe of an fp8 MoE keeps its fp8 experts (sliced) and computes what the MoE does."""
    moe = MoE(H, I, E, K, backend="reference", dtype=torch.bfloat16)
    moe.quantize_(quant)
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    x_pad = torch.cat([x, torch.full((2, H), float("nan"), dtype=torch.bfloat16)])
    with torch.no_grad():
        want = moe(x)
        for mode in ("dynamic", "capacity"):
            ep = EPMoE.from_moe(moe, mode=mode)
            assert ep.quant == quant and ep.w13.dtype == torch.float8_e4m3fn
            out = ep(x_pad, num_valid=6)
            assert_close(out[:6], want, dtype=torch.bfloat16, what=f"{quant} {mode}")
            _check_padded_zero(out, 6, f"{quant} {mode}")
