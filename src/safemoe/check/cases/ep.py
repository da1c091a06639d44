"""Family 9, expert parallelism: `safemoe.distributed.EPMoE` / `ep_experts` across spawned ranks
(gloo on CPU, NCCL with rank r on cuda:r), each rank's output against the single-process layer on
the same tokens (same backend). Every case spawns one process group (`safemoe.distributed.spawn`,
start method spawn, collectives with a timeout so a broken exchange fails instead of hanging) and
runs all its scenarios in it: process start dominates the cost (~3-5 s on CPU), so the family has
few cases.

- `ep.ragged`: ragged real-token counts, one rank with none (it still joins every collective),
  each rank padded to the common bucket with NaN/Inf rows; both modes ("dynamic", "capacity" with
  C = the bucket): real rows match, padded rows exact zeros, health counts the padded rows and
  nothing dropped or overflowed.
- `ep.stale_ids`: `ep_experts` on hand-made routing: valid rows hold -1, -7, E, 123456789 and
  duplicates, padded rows hold stale ids or ids that look real, NaN weights and NaN x: bad slots
  dropped and counted in health[DROPPED_SLOTS], padded rows never sent.
- `ep.capacity_overflow`: capacity mode with C = 1 and 2 rows per peer: the slots past C are
  dropped exactly as the documented policy says (a peer takes a rank's rows in increasing t),
  counted in health[EP_OVERFLOW_SLOTS], every other slot of every row intact, no crash.

Inputs are multiples of 1/8 (x and router weights), so router logits are exact in fp32 whatever
the summation order and the padded per-rank batch routes exactly as the concatenated batch (as in
tests/test_distributed.py). Ranks make every collective of a case before any assertion, so one
rank's failure cannot leave the others waiting. With --quick on CPU the triton backend's cases
are n/a (the reference runs the same exchange; interpreted kernels in two spawned ranks cost
~15 s a case); the CPU scale runs them. `--plugin` files are imported in every rank too
(a plugin may patch what the ranks run). On CUDA with fewer GPUs than ranks, the ranks share the
GPUs (rank r on cuda:r mod the count) and exchange through gloo, whose collectives take CUDA
tensors (staged through host memory) where NCCL refuses two ranks on one GPU: the CUDA kernels,
the Triton exchange and the all-to-all sizes are the same code; only the transport differs
(a failure's message says so when they share GPUs).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from safemoe.check.inputs import STALE_ID
from safemoe.check.invariants import expect_close, expect_zero_rows
from safemoe.check.registry import CaseContext, CheckFailure, NotApplicable, Plan, case, case_seed

# Real tokens per rank, per world size; each tuple is one scenario of a case (a rank with 0 real
# tokens in each, and a ragged one).
SCENARIOS = {2: ((5, 0), (3, 11)), 4: ((5, 0, 3, 8),)}
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
PAD_FILLS = {"nan": math.nan, "inf": math.inf}
# NVLink multicast stays off (KINDS.md of the GPU machines; NCCL's NVLS needs it).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# A collective waiting longer fails the case instead of hanging it. On CUDA a rank may wait while
# its peer compiles the expert kernels (tens of seconds on a cold Triton cache); the join timeout
# stays under the runner's 300 s per case on CUDA.
COLLECTIVE_TIMEOUT_S = {"cpu": 60.0, "cuda": 150.0}
JOIN_TIMEOUT_S = {"cpu": 240.0, "cuda": 280.0}


@dataclass(frozen=True)
class RankSpec:
    """What every rank of one case runs (pickled to the spawned ranks)."""

    check: str
    params: dict[str, Any]
    seed: int  # the case's seed: every rank draws the same global inputs from it
    backend: str  # backend= of the layers (safemoe's reference or triton)
    device: str  # "cpu" (gloo) or "cuda" (NCCL, or gloo when ranks share GPUs: rank r on cuda:r mod GPUs)
    scale: int
    plugins: tuple[str, ...] = field(default_factory=tuple)

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device == "cuda" else torch.float32

    @property
    def shapes(self) -> tuple[int, int, int, int]:
        """(H, I, E, K); E divisible by every world size."""
        return (256, 128, 16, 4) if self.device == "cuda" else (16, 8, 8, 3)


def _worlds(plan: Plan) -> tuple[int, ...]:
    return plan.choose((2,), (2, 4), (2, 4))


def _ragged_params(plan: Plan) -> list[dict[str, Any]]:
    return plan.cross([{"world": w} for w in _worlds(plan)], fill=plan.choose(("nan",), tuple(PAD_FILLS),
                                                                              tuple(PAD_FILLS)))  # fmt: skip


def _world_params(plan: Plan) -> list[dict[str, Any]]:
    return [{"world": w} for w in _worlds(plan)]


def collective_backend(world: int, gpus: int) -> str:
    """The process-group backend of a CUDA case: NCCL with one GPU per rank, else gloo (NCCL
    refuses two ranks on one GPU; gloo stages CUDA tensors through the host)."""
    if gpus < 1:
        raise NotApplicable("no CUDA device visible to run the ranks on")
    return "nccl" if gpus >= world else "gloo"


def rank_device(spec_device: str, rank: int, gpus: int) -> torch.device:
    """Rank r's device: cuda:r, or cuda:(r mod gpus) when ranks share GPUs; cpu for gloo on CPU."""
    return torch.device("cuda", rank % gpus) if spec_device == "cuda" else torch.device("cpu")


def _run_group(ctx: CaseContext, check: str, params: dict[str, Any]) -> None:
    """Spawn the case's process group and raise CheckFailure with every rank's failures."""
    from safemoe.check.worker import LOADED_PLUGINS
    from safemoe.distributed import spawn

    backend = ctx.api.module_backend
    if backend is None:
        raise NotApplicable(f"{ctx.api.name} has no safemoe.MoE backend to run EPMoE with")
    if backend == "triton" and ctx.scale == 0 and not ctx.cuda:
        raise NotApplicable(
            "--quick on CPU runs EP on the reference only: the exchange is the same code, and the "
            "interpreted kernels in spawned ranks cost ~15 s a case (the CPU scale runs them)"
        )
    world = params["world"]
    spec = RankSpec(check, dict(params), case_seed(ctx.seed, f"{ctx.case_name}#{ctx.index}"), backend,
                    ctx.device.type, ctx.scale, tuple(LOADED_PLUGINS))  # fmt: skip
    shared = ""  # names the transport in a failure where ranks share GPUs
    if ctx.cuda:
        transport = collective_backend(world, torch.cuda.device_count())
        shared = "[gloo, ranks sharing GPUs] " if transport == "gloo" else ""
        for name, value in NO_MULTICAST.items():
            os.environ.setdefault(name, value)
        results = spawn(_rank_main, world, spec, backend=transport, timeout_s=COLLECTIVE_TIMEOUT_S["cuda"],
                        join_timeout_s=JOIN_TIMEOUT_S["cuda"], env=NO_MULTICAST)  # fmt: skip
    else:
        results = spawn(_rank_main, world, spec, backend="gloo", timeout_s=COLLECTIVE_TIMEOUT_S["cpu"],
                        join_timeout_s=JOIN_TIMEOUT_S["cpu"])  # fmt: skip
    failures = [f"rank {rank}: {message}" for rank, messages in enumerate(results) for message in messages]
    if failures:
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        raise CheckFailure(f"{shared}{failures[0]}{more}")


@case("ep.ragged", ops=("moe",), params=_ragged_params)
def ragged(ctx: CaseContext, **p: Any) -> None:
    """EPMoE, both modes: ragged counts, a rank with no tokens, NaN/Inf padding vs the single-process layer"""
    _run_group(ctx, "ragged", p)


@case("ep.stale_ids", ops=("experts",), params=_world_params)
def stale_ids(ctx: CaseContext, **p: Any) -> None:
    """ep_experts: -1/-7/E/123456789/duplicate ids in valid rows dropped and counted; stale padding unsent"""
    _run_group(ctx, "stale_ids", p)


@case("ep.capacity_overflow", ops=("moe",), params=_world_params)
def capacity_overflow(ctx: CaseContext, **p: Any) -> None:
    """EPMoE capacity mode, C = 1 and 2: overflowed slots dropped by the policy, counted, the rest intact"""
    _run_group(ctx, "capacity_overflow", p)


# ----------------------------------------------------------------------------------------------
# In each spawned rank
# ----------------------------------------------------------------------------------------------


class _Rank:
    """One rank's view of a scenario: the global inputs (the same on every rank: same seed)."""

    def __init__(self, rank: int, world: int, spec: RankSpec, counts: tuple[int, ...]) -> None:
        self.rank, self.world, self.spec, self.counts = rank, world, spec, counts
        gpus = torch.cuda.device_count() if spec.device == "cuda" else 0
        self.device = rank_device(spec.device, rank, gpus)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = spec.dtype
        self.hidden, self.inter, self.experts, self.top_k = spec.shapes
        self.gen = torch.Generator().manual_seed(spec.seed + 7919 * sum(counts))
        total = sum(counts)
        self.x_all = (torch.randint(-8, 9, (total, self.hidden), generator=self.gen) / 8).to(self.dtype)
        self.x_all = self.x_all.to(self.device)
        self.n = counts[rank]
        self.first_row = sum(counts[:rank])
        self.x_own = self.x_all[self.first_row : self.first_row + self.n]
        most = max(counts)
        self.bucket = min(b for b in BUCKETS if b >= most)

    def moe(self) -> Any:
        """The single-process layer (the case's backend), identical on every rank."""
        from safemoe.layer import MoE

        moe = MoE(self.hidden, self.inter, self.experts, self.top_k, backend=self.spec.backend,
                  dtype=self.dtype, device=self.device)  # fmt: skip
        with torch.no_grad():
            moe.gate.weight.copy_(torch.randint(-8, 9, moe.gate.weight.shape, generator=self.gen) / 8)
            moe.w13.copy_(torch.randn(moe.w13.shape, generator=self.gen) * self.hidden**-0.5)
            moe.w2.copy_(torch.randn(moe.w2.shape, generator=self.gen) * self.inter**-0.5)
        return moe

    def own(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[self.first_row : self.first_row + self.n]

    def local_experts(self, moe: Any) -> tuple[torch.Tensor, torch.Tensor]:
        per_rank = self.experts // self.world
        first = self.rank * per_rank
        return (moe.w13[first : first + per_rank].detach().contiguous(),
                moe.w2[first : first + per_rank].detach().contiguous())  # fmt: skip


def _health_problems(health: list[float], want: dict[int, int], what: str) -> list[str]:
    from safemoe.health import SLOT_NAMES

    return [
        f"{what}: health[{SLOT_NAMES.get(slot, slot)}] is {int(health[slot])}, expected {value}"
        for slot, value in want.items()
        if int(health[slot]) != value
    ]


def _collect(problems: list[str], fn: Any, *args: Any) -> None:
    """Run an assertion; a CheckFailure (or any error) becomes one problem line."""
    try:
        fn(*args)
    except CheckFailure as error:
        problems.append(str(error))
    except Exception as error:
        problems.append(f"raised {type(error).__name__}: {error}")


def _ragged(r: _Rank, fill: str) -> list[str]:
    from safemoe.distributed import EPMoE, pad_to_common_bucket
    from safemoe.health import (
        DROPPED_SLOTS,
        EP_OVERFLOW_SLOTS,
        NONFINITE_ROWS,
        PADDED_ROWS,
        new_health_tensor,
    )

    moe = r.moe()
    x_pad, nv = pad_to_common_bucket(r.x_own, r.n, buckets=BUCKETS, fill=PAD_FILLS[fill])
    outs, healths = {}, {}
    with torch.no_grad():
        for mode in ("dynamic", "capacity"):
            health = new_health_tensor(r.device)
            ep = EPMoE.from_moe(moe, mode=mode, health=health, backend=r.spec.backend)
            outs[mode] = ep(x_pad, num_valid=nv)
            healths[mode] = health.tolist()
        want = r.own(moe(r.x_all))
    problems: list[str] = []
    for mode, out in outs.items():
        what = f"counts {r.counts}, {fill} padding, {mode}"
        if tuple(out.shape) != (r.bucket, r.hidden):
            problems.append(f"{what}: output shape {tuple(out.shape)}, expected {(r.bucket, r.hidden)}")
            continue
        _collect(problems, expect_close, out[: r.n], want, f"{what}: real rows vs the single-process layer")
        _collect(problems, expect_zero_rows, out, r.n, what)
        want_health = {PADDED_ROWS: r.bucket - r.n, DROPPED_SLOTS: 0, EP_OVERFLOW_SLOTS: 0, NONFINITE_ROWS: 0}
        problems += _health_problems(healths[mode], want_health, what)
    return problems


def _stale_ids(r: _Rank) -> list[str]:
    import safemoe
    from safemoe.distributed import ep_experts
    from safemoe.health import DROPPED_SLOTS, EP_OVERFLOW_SLOTS, new_health_tensor
    from safemoe.reference import valid_slot_mask
    from safemoe.routing import Routing

    moe = r.moe()
    bucket, num_experts, top_k = r.bucket, r.experts, r.top_k
    gen = torch.Generator().manual_seed(r.spec.seed + 31 * r.rank)
    ids = torch.randint(0, num_experts, (bucket, top_k), generator=gen, dtype=torch.int32)
    bad = torch.tensor([-1, -7, num_experts, STALE_ID], dtype=torch.int32)
    for row in range(0, r.n, 2):  # every other valid row: a bad id in its last slot
        ids[row, -1] = bad[(row // 2 + r.rank) % len(bad)]
    ids[1 : r.n : 3, 0] = ids[1 : r.n : 3, 1]  # duplicates
    ids[r.n :: 2] = STALE_ID
    ids[r.n + 1 :: 2] = r.rank % num_experts  # padded rows that look routed
    weights = torch.rand(bucket, top_k, generator=gen)
    dropped = ~valid_slot_mask(ids, num_experts)
    weights = torch.where(dropped, math.nan, weights)
    weights[r.n :] = math.nan
    x = torch.full((bucket, r.hidden), math.nan, dtype=r.dtype, device=r.device)
    x[: r.n] = r.x_own
    routing = Routing(weights=weights.to(r.device), ids=ids.to(r.device))
    w13, w2 = r.local_experts(moe)
    results = {}
    for mode, cap in (("dynamic", None), ("capacity", None), ("capacity", bucket)):
        health = new_health_tensor(r.device)
        out = ep_experts(x, w13, w2, routing, num_experts=num_experts, mode=mode, capacity=cap,
                         num_valid=torch.tensor(r.n, device=r.device), health=health,
                         backend=r.spec.backend)  # fmt: skip
        results[(mode, cap)] = (out, health.tolist())
    want = safemoe.experts(x, moe.w13.detach(), moe.w2.detach(), routing, num_valid=r.n,
                           backend=r.spec.backend)  # fmt: skip
    want_dropped = int(dropped[: r.n].sum())
    problems: list[str] = []
    for (mode, cap), (out, counted) in results.items():
        what = f"counts {r.counts}, {mode}" + ("" if cap is None else f" C={cap}")
        _collect(problems, expect_close, out[: r.n], want[: r.n],
                 f"{what}: real rows vs single-process experts")  # fmt: skip
        _collect(problems, expect_zero_rows, out, r.n, what)
        problems += _health_problems(counted, {DROPPED_SLOTS: want_dropped, EP_OVERFLOW_SLOTS: 0}, what)
    return problems


def expected_overflow(ids: torch.Tensor, n: int, cap: int, per_rank: int, world: int,
                      num_experts: int) -> tuple[torch.Tensor, int]:  # fmt: skip
    """The capacity policy in plain Python: (ids with the overflowed slots set to -1, how many).
    A peer takes a rank's rows in increasing t, at most `cap` of them; a row goes once to each
    peer owning one of its in-range ids."""
    kept = ids.clone()
    taken = [0] * world
    overflow = 0
    for t in range(n):
        owners = sorted({int(e) // per_rank for e in ids[t].tolist() if 0 <= int(e) < num_experts})
        for peer in owners:
            taken[peer] += 1
            if taken[peer] <= cap:
                continue
            for k in range(ids.shape[1]):
                e = int(ids[t, k])
                if 0 <= e < num_experts and e // per_rank == peer:
                    kept[t, k] = -1
                    overflow += 1
    return kept, overflow


def _capacity_overflow(r: _Rank) -> list[str]:
    import safemoe
    from safemoe._checks import check_num_valid
    from safemoe.distributed import EPMoE, pad_to_common_bucket
    from safemoe.health import DROPPED_SLOTS, EP_OVERFLOW_SLOTS, new_health_tensor
    from safemoe.routing import Routing

    moe = r.moe()
    x_pad, nv = pad_to_common_bucket(r.x_own, r.n, buckets=BUCKETS, fill=math.nan)
    results = {}
    with torch.no_grad():
        for cap in (1, 2):
            health = new_health_tensor(r.device)
            ep = EPMoE.from_moe(moe, mode="capacity", capacity=cap, health=health, backend=r.spec.backend)
            results[cap] = (ep(x_pad, num_valid=nv), health.tolist())
        weights, ids = moe.gate(r.x_own, check_num_valid(None, r.n, r.device))
    per_rank = r.experts // r.world
    problems: list[str] = []
    for cap, (out, counted) in results.items():
        what = f"counts {r.counts}, capacity {cap}"
        kept, overflow = expected_overflow(ids.cpu(), r.n, cap, per_rank, r.world, r.experts)
        with torch.no_grad():
            routing = Routing(weights=weights, ids=kept.to(r.device))
            want = safemoe.experts(r.x_own, moe.w13.detach(), moe.w2.detach(), routing,
                                   backend=r.spec.backend)  # fmt: skip
        _collect(problems, expect_close, out[: r.n], want,
                 f"{what}: real rows vs overflowed slots dropped")  # fmt: skip
        _collect(problems, expect_zero_rows, out, r.n, what)
        problems += _health_problems(counted, {EP_OVERFLOW_SLOTS: overflow, DROPPED_SLOTS: 0}, what)
    return problems


def _rank_main(rank: int, world: int, spec: RankSpec) -> list[str]:
    """Every scenario of the case on this rank; the problems it saw (empty: passed)."""
    import warnings

    from safemoe.check.worker import load_plugin

    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
    warnings.filterwarnings("ignore", category=UserWarning)
    for plugin in spec.plugins:
        load_plugin(plugin)
    problems: list[str] = []
    for counts in SCENARIOS[world]:
        r = _Rank(rank, world, spec, counts)
        if spec.check == "ragged":
            problems += _ragged(r, spec.params["fill"])
        elif spec.check == "stale_ids":
            problems += _stale_ids(r)
        elif spec.check == "capacity_overflow":
            problems += _capacity_overflow(r)
        else:
            raise ValueError(f"unknown ep check {spec.check!r}")
    return problems
