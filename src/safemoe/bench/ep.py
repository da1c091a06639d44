"""Suite `ep`: the expert-parallel layer (`safemoe.distributed.EPMoE`) on W GPUs of one host,
against one GPU running the same global batch.

Cases: Qwen3-30B-A3B (E=128, K=8, H=2048, I=768), DeepSeek-V3 (E=256, K=8, H=7168, I=2048) and
Qwen3-Next (E=512, K=10, H=2048, I=512) dims, bf16, random weights and router; T real tokens PER
RANK in {8, 64, 256, 1024, 4096, 8192} (data parallel: the global batch is W*T); W = every power
of two from 2 up to the GPUs present (or `--worlds`). NCCL with NVLink multicast off. Each world
size runs in one spawned group of W ranks (`safemoe.distributed.spawn`).

Impls (variant "W=<world>"):
- `ep-capacity`: the whole layer (router, dispatch all-to-all, local experts, return all-to-all,
  combine) in capacity mode with C = T rows per peer (no overflow possible), the Triton exchange
  (`safemoe.kernels.ep_exchange`: count, pack, unpack, combine), CUDA-graph replay.
- `ep-capacity-torch`: the same with the torch-ops exchange (the first version), graph replay.
- `ep-dynamic`: the dynamic mode (exact sizes, one host sync per call), Triton exchange, eager.
- `a2a-only`: the capacity mode's two all_to_all_single calls alone (same buffers), graph replay:
  the communication inside `ep-capacity`.
- `local-experts`: this rank's expert kernels alone on the W*T rows it receives in capacity mode
  (the global batch with this rank's slots as local ids, the others -1), graph replay: the compute
  inside `ep-capacity`.
- `1gpu-global`: `safemoe.MoE` (Triton) with all E experts on ONE GPU and the W*T global tokens,
  graph replay: what EP is compared with.

Times: each rank times its own replays (CUDA events; median of replays / calls per graph, the
harness's method); an EP row reports the SLOWEST rank (the layer is as fast as its slowest rank).
The graph of a collective step is captured on every rank, and replayed only if every rank
captured it (agreed on a gloo side group, so a failed capture cannot leave one rank waiting).

Bytes (per rank, per call; bf16): dispatch W*C rows of H*2 + 8K bytes (x, K int32 ids, K fp32
weights), return W*C rows of H*2 bytes; `remote_bytes` leave the GPU ((W-1)/W of them; the own
chunk is a local copy). The dynamic mode moves the exact rows (measured from the routing).

Floors: `1gpu-global`: the harness's MoE floor for W*T tokens (max of distinct-expert bytes / read
bandwidth and FLOPs / bf16 peak). EP rows: per rank, 1/W of the distinct experts of the global
batch (+ the router) / read bandwidth, or 1/W of the FLOPs / peak, whichever is larger. `a2a-only`
has no floor (the harness does not measure NVLink).

extra: `tokens_per_s` = W*T / time (global tokens per second of the whole layer);
`scaling_vs_1gpu` = 1gpu-global / ep time (> 1: EP on W GPUs beats one GPU on the same global
batch; the ideal is W), `efficiency` = scaling / W; on `ep-capacity` the split `comm_us`
(a2a-only), `compute_us` (local-experts) and `rest_us` (what remains: router, count/pack/unpack/
combine, launch gaps); `comm_share` = a2a-only / ep-capacity, `a2a_gbps` = remote bytes / a2a-only
time, `ranks_us` = every rank's median.

Run alone: `python -m safemoe.bench.ep --out DIR [--quick] [--worlds 2,4,8] [--shapes deepseek-v3]
[--tokens 1024,4096]`; writes ep.{csv,json,png} and ep_scaling.md (the scaling table).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from safemoe.bench.harness import (
    BenchRow,
    DeviceCeilings,
    bytes_floor_us,
    distinct_experts,
    event_times_us,
    flops_floor_us,
    moe_floor_us,
    moe_flops,
)
from safemoe.graphs import warm_up

SUITE = "ep"
SHAPES: dict[str, tuple[int, int, int, int]] = {  # E, K, H, I
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v3": (256, 8, 7168, 2048),
    "qwen3-next": (512, 10, 2048, 512),
}
TOKENS = (8, 64, 256, 1024, 4096, 8192)
QUICK_TOKENS = (8, 256, 4096)
N_VARIANTS = 2  # the weights (GBs) dwarf L2 already; two input sets keep activations honest
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
IMPLS = ("ep-capacity", "ep-capacity-torch", "ep-dynamic", "a2a-only", "local-experts", "1gpu-global")
EP_IMPLS = ("ep-capacity", "ep-capacity-torch", "ep-dynamic")
# Where rank 0 appends each finished row as JSON (set by main(): a run cut short keeps its rows).
PARTIAL_ENV = "SAFEMOE_BENCH_EP_PARTIAL"


def _graph_budget(global_tokens: int) -> tuple[int, int]:
    """(calls per graph, timed replays): fewer for big batches, whose calls take milliseconds."""
    if global_tokens <= 128:
        return 10, 10
    if global_tokens <= 1024:
        return 4, 8
    return 1, 5


# ------------------------------------------------------------------------------------------------
# Timing inside a rank
# ------------------------------------------------------------------------------------------------


def _time_graph_all_ranks(
    step: Callable[[int], object], ctrl: Any, global_tokens: int
) -> tuple[float | None, str]:
    """`harness.time_graph` for a step holding collectives: warm up eagerly on a side stream,
    capture on every rank (thread-local capture mode: the NCCL watchdog thread may query events
    meanwhile), agree on the gloo group `ctrl` that every rank captured, then time replays.
    Returns (median us per call, note); None when some rank could not capture."""
    import torch.distributed as dist

    calls, replays = _graph_budget(global_tokens)
    warm_up(lambda: [step(j % N_VARIANTS) for j in range(max(2, N_VARIANTS))])
    dist.barrier(group=ctrl)
    graph = torch.cuda.CUDAGraph()
    error = ""
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for j in range(calls):
                step(j % N_VARIANTS)
    except Exception as exc:
        error = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:160]}"
        with contextlib.suppress(RuntimeError):
            torch.cuda.synchronize()
    errors: list[str] = [""] * dist.get_world_size(ctrl)
    dist.all_gather_object(errors, error, group=ctrl)
    if any(errors):
        del graph
        return None, "capture failed: " + "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
    dist.barrier(group=ctrl)
    times = event_times_us(graph.replay, iters=replays, warmup=1)
    del graph
    return statistics.median(times) / calls, "graph"


def _time_eager_all_ranks(step: Callable[[int], object], ctrl: Any, iters: int) -> float:
    import torch.distributed as dist

    for j in range(max(2, N_VARIANTS)):
        step(j % N_VARIANTS)
    torch.cuda.synchronize()
    dist.barrier(group=ctrl)
    counter = iter(range(1 << 30))
    return statistics.median(
        event_times_us(lambda: step(next(counter) % N_VARIANTS), iters=iters, warmup=0)
    )


# ------------------------------------------------------------------------------------------------
# One rank of a spawned group
# ------------------------------------------------------------------------------------------------


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _ep_floor_us(
    shape: tuple[int, int, int, int], tokens: int, world: int, ceilings: DeviceCeilings
) -> float:
    """Per-rank floor: 1/W of the global batch's distinct experts (+ the router) read once, or
    1/W of its expert FLOPs, whichever takes longer."""
    num_experts, top_k, hidden, inter = shape
    global_tokens = tokens * world
    expert_bytes = distinct_experts(num_experts, top_k, global_tokens) / world * 3 * hidden * inter * 2
    read = bytes_floor_us(expert_bytes + num_experts * hidden * 2, ceilings.read_gbps)
    compute = flops_floor_us(moe_flops(global_tokens, top_k, hidden, inter) / world, ceilings.bf16_tflops)
    return max(read, compute)


def _measure(
    ep: Any, moe: Any, ctrl: Any, rank: int, world: int, tokens: int, shape: tuple[int, int, int, int]
) -> tuple[dict[str, tuple[float | None, str]], list[int]]:
    """This rank's timings of every impl at T tokens per rank, and the rows its dynamic-mode
    dispatch sends to each peer."""
    import torch.distributed as dist

    from safemoe.distributed.ep import rows_per_peer, wire_row_bytes

    _, top_k, hidden, _ = shape
    device = _device()
    global_tokens = world * tokens
    gen = torch.Generator(device=device).manual_seed(1000 + tokens)
    # Every rank makes every rank's batch (same seeds): the 1-GPU run gets the global batch.
    xs_all = [torch.randn(global_tokens, hidden, generator=gen, device=device, dtype=torch.bfloat16)
              for _ in range(N_VARIANTS)]  # fmt: skip
    xs = [x[rank * tokens : (rank + 1) * tokens] for x in xs_all]
    num_valid = torch.tensor(tokens, dtype=torch.int32, device=device)
    wire_row = wire_row_bytes(hidden, top_k, torch.bfloat16)
    wire = torch.zeros(world * tokens, wire_row, dtype=torch.uint8, device=device)
    wire_in = torch.empty_like(wire)
    back = torch.zeros(world * tokens, hidden * 2, dtype=torch.uint8, device=device)
    back_in = torch.empty_like(back)

    def ep_step(j: int) -> torch.Tensor:
        return ep(xs[j], num_valid=num_valid)

    def a2a_step(j: int) -> None:  # the capacity mode's two exchanges, same buffer sizes
        dist.all_to_all_single(wire_in, wire)
        dist.all_to_all_single(back_in, back)

    def one_gpu_step(j: int) -> torch.Tensor:  # every rank, on its own GPU, independently
        return moe(xs_all[j])

    import safemoe
    from safemoe.routing import Routing

    with torch.no_grad():  # what this rank receives in capacity mode: the global batch, local ids
        local_routing = []
        for x_all in xs_all:
            weights_all, ids_all = ep.gate(x_all, None)
            local_ids, ok = ep.layout.to_local(ids_all)
            local_routing.append(Routing(weights=torch.where(ok, weights_all, 0.0).contiguous(),
                                         ids=local_ids.contiguous()))  # fmt: skip

    def local_step(j: int) -> torch.Tensor:
        return safemoe.experts(xs_all[j], ep.w13, ep.w2, local_routing[j], workspace=ep._workspace)

    measured: dict[str, tuple[float | None, str]] = {}
    iters = 10 if global_tokens <= 1024 else 5
    with torch.no_grad():
        ep.mode, ep.capacity = "capacity", None
        ep.exchange = "triton"
        measured["ep-capacity"] = _guarded(lambda: _time_graph_all_ranks(ep_step, ctrl, global_tokens))
        ep.exchange = "torch"
        measured["ep-capacity-torch"] = _guarded(lambda: _time_graph_all_ranks(ep_step, ctrl, global_tokens))
        ep.exchange = "triton"
        measured["a2a-only"] = _guarded(lambda: _time_graph_all_ranks(a2a_step, ctrl, global_tokens))
        measured["local-experts"] = _guarded(lambda: _time_graph_all_ranks(local_step, ctrl, global_tokens))
        ep.mode = "dynamic"
        measured["ep-dynamic"] = _guarded(lambda: (_time_eager_all_ranks(ep_step, ctrl, iters), "eager"))
        ep.mode = "capacity"
        measured["1gpu-global"] = _guarded(lambda: _time_graph_all_ranks(one_gpu_step, ctrl, global_tokens))
        _, ids = ep.gate(xs[0], num_valid)
        rows_valid = torch.ones(tokens, dtype=torch.bool, device=device)
        per_peer = [int(v) for v in rows_per_peer(ids, rows_valid, ep.layout).tolist()]
    return measured, per_peer


def _rank_case(
    case: str,
    shape: tuple[int, int, int, int],
    tokens_list: tuple[int, ...],
    rank: int,
    world: int,
    ctrl: Any,
    ceilings: DeviceCeilings,
) -> list[BenchRow]:
    import torch.distributed as dist

    from safemoe.distributed import EPMoE
    from safemoe.distributed.ep import wire_row_bytes
    from safemoe.layer import MoE
    from safemoe.workspace import Workspace

    num_experts, top_k, hidden, inter = shape
    device = _device()
    dtype = torch.bfloat16
    workspace = Workspace(world * max(tokens_list), num_experts, top_k, hidden, inter, dtype, device)
    torch.manual_seed(0)  # the same router and experts on every rank
    moe = MoE(hidden, inter, num_experts, top_k, dtype=dtype, device=device, workspace=workspace)
    with torch.no_grad():
        moe.gate.weight.normal_(0, hidden**-0.5)
        moe.w13.normal_(0, hidden**-0.5)
        moe.w2.normal_(0, inter**-0.5)
    ep = EPMoE.from_moe(moe, mode="capacity", workspace=workspace)
    row_bytes = wire_row_bytes(hidden, top_k, dtype) + hidden * 2  # dispatch + return, per row
    rows: list[BenchRow] = []
    for tokens in tokens_list:
        global_tokens = world * tokens
        measured, per_peer = _measure(ep, moe, ctrl, rank, world, tokens, shape)
        gathered: list[dict[str, float | None]] = [{} for _ in range(world)]
        dist.all_gather_object(gathered, {impl: us for impl, (us, _) in measured.items()}, group=ctrl)
        if rank != 0:
            continue
        cap_bytes = world * tokens * row_bytes
        bytes_of = {
            "ep-capacity": (cap_bytes, cap_bytes * (world - 1) // world),
            "ep-capacity-torch": (cap_bytes, cap_bytes * (world - 1) // world),
            "a2a-only": (cap_bytes, cap_bytes * (world - 1) // world),
            "ep-dynamic": (sum(per_peer) * row_bytes, (sum(per_peer) - per_peer[rank]) * row_bytes),
        }
        slowest = {impl: _slowest([g[impl] for g in gathered]) for impl in IMPLS}
        one_gpu = measured["1gpu-global"][0]
        ep_floor = _ep_floor_us(shape, tokens, world, ceilings)
        floors = {
            "ep-capacity": ep_floor,
            "ep-capacity-torch": ep_floor,
            "ep-dynamic": ep_floor,
            "a2a-only": None,
            "local-experts": None,
            "1gpu-global": moe_floor_us(num_experts, top_k, hidden, inter, global_tokens, ceilings)[0],
        }
        for impl in IMPLS:
            us = one_gpu if impl == "1gpu-global" else slowest[impl]
            extra: dict[str, Any] = {"ranks_us": [None if g[impl] is None else round(float(g[impl] or 0), 2)
                                                  for g in gathered]}  # fmt: skip
            if impl in bytes_of:
                extra["a2a_bytes"], extra["remote_bytes"] = bytes_of[impl]
            if us and impl != "a2a-only" and impl != "local-experts":
                extra["tokens_per_s"] = round(global_tokens / (us * 1e-6))
            if impl in EP_IMPLS and us and one_gpu:
                extra["scaling_vs_1gpu"] = round(one_gpu / us, 3)
                extra["efficiency"] = round(one_gpu / us / world, 3)
            if impl == "ep-capacity" and us and slowest["a2a-only"] and slowest["local-experts"]:
                extra["comm_us"] = round(slowest["a2a-only"], 1)
                extra["compute_us"] = round(slowest["local-experts"], 1)
                extra["rest_us"] = round(us - slowest["a2a-only"] - slowest["local-experts"], 1)
            if impl == "a2a-only" and us:
                extra["a2a_gbps"] = round(bytes_of[impl][1] / (us * 1e-6) / 1e9, 1)
                if slowest["ep-capacity"]:
                    extra["comm_share"] = round(us / slowest["ep-capacity"], 3)
            note = measured[impl][1]
            rows.append(BenchRow(SUITE, case, tokens, f"W={world}", impl, us, floors[impl], note, extra))
            _append_partial(rows[-1])
    torch.cuda.empty_cache()
    return rows


def _append_partial(row: BenchRow) -> None:
    path = os.environ.get(PARTIAL_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(asdict(row), default=str) + "\n")


def _slowest(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else max(float(v or 0) for v in values)


def _guarded(fn: Callable[[], tuple[float | None, str]]) -> tuple[float | None, str]:
    """Run a timing; an error becomes (None, note) so the other measurements go on. (An error on
    one rank between collectives leaves the others waiting: the group's timeout ends that.)"""
    try:
        return fn()
    except Exception as exc:
        traceback.print_exc()
        with contextlib.suppress(RuntimeError):
            torch.cuda.synchronize()
        return None, f"error: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:160]}"


def _rank_main(
    rank: int, world: int, tokens_list: tuple[int, ...], ceilings_data: dict, shapes: dict[str, tuple]
) -> list[dict]:
    import torch.distributed as dist

    ceilings = DeviceCeilings.from_dict(ceilings_data)
    ctrl = dist.new_group(backend="gloo")
    rows: list[BenchRow] = []
    for case, shape in shapes.items():
        started = time.monotonic()
        rows += _rank_case(case, tuple(shape), tokens_list, rank, world, ctrl, ceilings)  # type: ignore[arg-type]
        if rank == 0:
            print(f"ep bench: {case} W={world} done in {time.monotonic() - started:.0f} s", flush=True)
    return [asdict(row) for row in rows]


def default_worlds(gpus: int) -> tuple[int, ...]:
    """Every power of two from 2 up to the GPUs present."""
    return tuple(w for w in (2, 4, 8, 16) if w <= gpus)


def run(
    ceilings: DeviceCeilings,
    *,
    quick: bool,
    worlds: tuple[int, ...] | None = None,
    shapes: tuple[str, ...] | None = None,
    tokens: tuple[int, ...] | None = None,
) -> list[BenchRow]:
    """Every world size (default: `default_worlds` of the GPUs present; sizes above it are
    skipped with a note), shape and T per rank."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    chosen = {name: SHAPES[name] for name in (shapes or tuple(SHAPES))}
    if gpus < 2:
        note = f"skipped: expert parallelism needs >= 2 GPUs on one host, this machine has {gpus}"
        print(f"suite {SUITE}: {note}")
        return [BenchRow(SUITE, case, 0, "skipped", "ep-capacity", None, note=note) for case in chosen]
    for name, value in NO_MULTICAST.items():
        os.environ.setdefault(name, value)
    from safemoe.distributed import spawn

    token_list = tokens or (QUICK_TOKENS if quick else TOKENS)
    rows: list[BenchRow] = []
    for world in worlds or default_worlds(gpus):
        if world > gpus:
            note = f"skipped: W={world} needs {world} GPUs, this host has {gpus}"
            print(f"suite {SUITE}: {note}", flush=True)
            rows += [BenchRow(SUITE, case, 0, f"W={world}", "ep-capacity", None, note=note)
                     for case in chosen]  # fmt: skip
            continue
        results = spawn(
            _rank_main, world, token_list, ceilings.to_dict(), chosen,
            backend="nccl", timeout_s=300.0, join_timeout_s=3600.0, env=NO_MULTICAST,
        )  # fmt: skip
        rows += [BenchRow(**data) for data in results[0]]
    return rows


def _cell(row: BenchRow | None, key: str, suffix: str = "") -> str:
    value = None if row is None else row.extra.get(key)
    if value is None:
        return "-"
    return f"{value:,}{suffix}" if isinstance(value, int) else f"{value}{suffix}"


def scaling_table(rows: list[BenchRow]) -> str:
    """Markdown: per case, W and T per rank, one GPU's and EP's global tokens/s, the scaling of
    the Triton exchange (ep-capacity), the torch exchange and the dynamic mode, and the
    ep-capacity time split."""
    by_key = {(r.case, r.variant, r.tokens, r.impl): r for r in rows}
    lines = []
    for case in sorted({r.case for r in rows}):
        lines += [
            f"\n{case}\n",
            "| W | T/rank | 1 GPU tok/s | EP tok/s | scaling | torch exchange | dynamic | comm us | "
            "compute us | rest us |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        keys = sorted({(r.variant, r.tokens) for r in rows if r.case == case}, key=lambda k: (len(k[0]), k))
        for variant, tokens in keys:
            row = {impl: by_key.get((case, variant, tokens, impl)) for impl in IMPLS}
            ep = row["ep-capacity"]
            if ep is None or ep.median_us is None:
                continue
            lines.append(
                f"| {variant[2:]} | {tokens} | {_cell(row['1gpu-global'], 'tokens_per_s')} | "
                f"{_cell(ep, 'tokens_per_s')} | {_cell(ep, 'scaling_vs_1gpu', 'x')} | "
                f"{_cell(row['ep-capacity-torch'], 'scaling_vs_1gpu', 'x')} | "
                f"{_cell(row['ep-dynamic'], 'scaling_vs_1gpu', 'x')} | {_cell(ep, 'comm_us')} | "
                f"{_cell(ep, 'compute_us')} | {_cell(ep, 'rest_us')} |"
            )
    return "\n".join(lines) + "\n"


def run_exchange_only(
    *, shapes: tuple[str, ...] | None = None, tokens: tuple[int, ...] | None = None,
    worlds: tuple[int, ...] = (2, 4, 8), quick: bool = False,
) -> list[BenchRow]:
    """The exchange's own work on ONE GPU, torch ops against the Triton kernels: rank 0 of a W-rank
    capacity-mode layer (C = T) with the all-to-all replaced by a local copy (loopback: the wire
    this rank sends stands for the one it receives) and the local experts by a stand-in (x where
    a row has a local slot, zeros elsewhere), graph replay. Impls `exchange-torch`,
    `exchange-triton` and `loopback-copies` (the two copies alone, which the real exchange does not
    pay: subtract them). extra `same_output`: the two exchanges'
    outputs agree bitwise (checked once, eagerly); `speedup_vs_torch` on the Triton row."""
    rows: list[BenchRow] = []
    for case in shapes or tuple(SHAPES):
        for num_tokens in tokens or (QUICK_TOKENS if quick else TOKENS):
            for world in worlds:
                rows += _exchange_rows(case, num_tokens, world)
            print(f"ep exchange-only: {case} T={num_tokens} done", flush=True)
    return rows


def _exchange_rows(case: str, num_tokens: int, world: int) -> list[BenchRow]:
    from safemoe._checks import NumValid
    from safemoe.bench.harness import time_graph
    from safemoe.distributed.ep import EPLayout, run_exchange, wire_row_bytes
    from safemoe.health import new_health_tensor
    from safemoe.routing import Routing

    num_experts, top_k, hidden, _ = SHAPES[case]
    device = _device()
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    xs = [torch.randn(num_tokens, hidden, generator=gen, device=device, dtype=torch.bfloat16)
          for _ in range(N_VARIANTS)]  # fmt: skip
    routings = []
    for _ in range(N_VARIANTS):
        weights, ids = torch.rand(num_tokens, num_experts, generator=gen, device=device).topk(top_k, dim=1)
        routings.append(Routing(weights=weights.contiguous(), ids=ids.to(torch.int32).contiguous()))
    num_valid = NumValid(count=None, tensor=torch.tensor(num_tokens, dtype=torch.int32, device=device))
    health = new_health_tensor(device)
    layout = EPLayout(world, 0, num_experts)

    def loopback(out: torch.Tensor, inp: torch.Tensor, out_splits: Any, in_splits: Any) -> None:
        out.copy_(inp)

    def stand_in(x_recv: torch.Tensor, weights: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        # What the experts leave in rows without a local slot (zeros), x elsewhere: the same two
        # small ops in both paths. (The Triton unpack does not copy x into rows without a local
        # slot, so an identity would return bytes that no real exchange ever reads.)
        return torch.where((local_ids >= 0).any(dim=1, keepdim=True), x_recv, 0.0)

    def step_of(exchange: str) -> Callable[[int], torch.Tensor]:
        return lambda j: run_exchange(exchange, xs[j], routings[j], layout, "capacity", None, num_valid,
                                      health, loopback, stand_in)  # fmt: skip

    with torch.no_grad():
        outs = [step_of(exchange)(0) for exchange in ("torch", "triton")]
    same = bool(torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)))
    rows_total = world * num_tokens
    row_bytes = wire_row_bytes(hidden, top_k, torch.bfloat16)
    wire = torch.empty(rows_total, row_bytes, dtype=torch.uint8, device=device)
    back = torch.empty(rows_total, hidden, dtype=torch.bfloat16, device=device)
    steps: dict[str, Callable[[int], object]] = {
        "exchange-torch": step_of("torch"),
        "exchange-triton": step_of("triton"),
        "loopback-copies": _copies_step(wire, back),
    }
    calls, replays = _graph_budget(rows_total)
    measured: dict[str, tuple[float | None, str]] = {}
    for name, step in steps.items():
        try:
            with torch.no_grad():
                timed = time_graph(step, n_variants=N_VARIANTS, calls_per_graph=calls, replays=replays,
                                   warmup=2)  # fmt: skip
            measured[name] = (timed, "graph, 1 GPU loopback")
        except Exception as exc:
            traceback.print_exc()
            measured[name] = (None, f"error: {type(exc).__name__}: {str(exc)[:160]}")
    rows = []
    torch_us = measured["exchange-torch"][0]
    for name, (us, note) in measured.items():
        extra: dict[str, Any] = {"same_output": same} if name.startswith("exchange") else {}
        if name == "exchange-triton" and us and torch_us:
            extra["speedup_vs_torch"] = round(torch_us / us, 2)
        rows.append(BenchRow(SUITE, case, num_tokens, f"W={world}", name, us, None, note, extra))
        _append_partial(rows[-1])
    return rows


def _copies_step(wire: torch.Tensor, back: torch.Tensor) -> Callable[[int], object]:
    """The loopback's two copies alone (from a second buffer, as the loopback copies send -> recv)."""
    wire_src, back_src = wire.clone(), back.clone()
    return lambda j: (wire.copy_(wire_src), back.copy_(back_src))


def plot(rows: list[BenchRow], out_dir: Path) -> Path | None:
    """ep.png: time per call against T per rank (left), scaling against one GPU (right)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped (ep.png): matplotlib is not installed (pip install 'safemoe[bench]')")
        return None
    timed = [r for r in rows if r.median_us is not None]
    if not timed:
        print("plot skipped (ep.png): nothing was timed")
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5))
    cases = sorted({r.case for r in timed})
    styles = ["-", "--", ":", "-."]
    for (case, variant, impl), points in sorted(_series(timed).items()):
        style = styles[cases.index(case) % len(styles)]
        color = f"C{IMPLS.index(impl) if impl in IMPLS else 9}"
        xs = [t for t, _ in points]
        left.plot(xs, [r.median_us for _, r in points], marker="o", linestyle=style, color=color,
                  label=f"{case} {impl} {variant}")  # fmt: skip
        scaled = [(t, r.extra.get("scaling_vs_1gpu")) for t, r in points if r.extra.get("scaling_vs_1gpu")]
        if scaled:
            right.plot([t for t, _ in scaled], [s for _, s in scaled], marker="o", linestyle=style,
                       color=color, label=f"{case} {impl} {variant}")  # fmt: skip
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per rank T (global batch W*T)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    left.set_yscale("log")
    left.set_ylabel("us per layer call (slowest rank)")
    left.set_title("EP layer vs one GPU on the global batch")
    right.axhline(1.0, color="gray", linewidth=0.8)
    right.set_ylabel("speed-up over one GPU (1gpu-global / ep)")
    right.set_title("scaling (ideal = W)")
    fig.tight_layout()
    path = Path(out_dir) / f"{SUITE}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _series(rows: list[BenchRow]) -> dict[tuple[str, str, str], list[tuple[int, BenchRow]]]:
    series: dict[tuple[str, str, str], list[tuple[int, BenchRow]]] = {}
    for r in rows:
        series.setdefault((r.case, r.variant, r.impl), []).append((r.tokens, r))
    for points in series.values():
        points.sort(key=lambda p: p[0])
    return series


def main(argv: list[str] | None = None) -> int:
    from safemoe.bench.harness import measure_ceilings, write_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ceilings", type=Path, default=None,
                        help="reuse the ceilings of an earlier run's JSON")  # fmt: skip
    parser.add_argument("--worlds", type=_ints, default=None,
                        help="world sizes, e.g. 2,4,8 (default: powers of two up to the GPUs present)")
    parser.add_argument("--shapes", type=lambda v: tuple(v.split(",")), default=None,
                        help=f"cases among {','.join(SHAPES)} (default: all)")
    parser.add_argument("--tokens", type=_ints, default=None, help="T per rank, e.g. 256,1024")
    parser.add_argument("--exchange-only", action="store_true",
                        help="one GPU: the exchange's own work, torch ops vs Triton (no collectives)")
    args = parser.parse_args(argv)
    for name in args.shapes or ():
        if name not in SHAPES:
            parser.error(f"--shapes: unknown case {name!r}; known: {', '.join(SHAPES)}")
    if not torch.cuda.is_available():
        print("GPU timings need a CUDA GPU; nothing timed (this machine has no CUDA device).")
        return 0
    if args.ceilings is not None:
        ceilings = DeviceCeilings.from_dict(json.loads(args.ceilings.read_text())["ceilings"])
    else:
        ceilings = measure_ceilings()
    print(ceilings.summary(), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ[PARTIAL_ENV] = str(args.out / f"{SUITE}.partial.jsonl")
    # Through the imported module, so the spawned ranks find _rank_main under its real name even
    # when this file runs as __main__.
    suite = importlib.import_module("safemoe.bench.ep")
    if args.exchange_only:
        rows = suite.run_exchange_only(shapes=args.shapes, tokens=args.tokens,
                                       worlds=args.worlds or (2, 4, 8), quick=args.quick)  # fmt: skip
        write_results(rows, args.out, f"{SUITE}_exchange", ceilings)
        return 0
    rows = suite.run(ceilings, quick=args.quick, worlds=args.worlds, shapes=args.shapes, tokens=args.tokens)
    write_results(rows, args.out, SUITE, ceilings)
    table = scaling_table(rows)
    (args.out / f"{SUITE}_scaling.md").write_text(table)
    print(table)
    plot(rows, args.out)
    return 0


def _ints(value: str) -> tuple[int, ...]:
    return tuple(int(v) for v in value.split(",") if v)


if __name__ == "__main__":
    raise SystemExit(main())
