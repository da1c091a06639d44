"""Suite `ep`: the expert-parallel layer (`safemoe.distributed.EPMoE`) on W GPUs of one host,
against one GPU running the same global batch.

Cases: Qwen3-30B-A3B (E=128, K=8, H=2048, I=768) and DeepSeek-V3 (E=256, K=8, H=7168, I=2048)
dims, bf16, random weights and router; T real tokens PER RANK in {1, 8, 64, 256, 4096} (data
parallel: the global batch is W*T); W = 2, and 4 too where the host has 4 GPUs. NCCL with NVLink
multicast off. Each configuration runs in a spawned group of W ranks (`safemoe.distributed.spawn`).

Impls (variant "W=<world>"):
- `ep-capacity`: the whole layer (router, dispatch all-to-all, local experts, return all-to-all,
  combine) in capacity mode with C = T rows per peer (no overflow possible), CUDA-graph replay.
- `ep-dynamic`: the dynamic mode (exact sizes, one host sync per call), eager.
- `a2a-only`: the capacity mode's two all_to_all_single calls alone (same buffers), graph replay:
  the communication inside `ep-capacity`.
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

extra: `scaling_vs_1gpu` = 1gpu-global / ep time (> 1: EP on W GPUs beats one GPU on the same
global batch; the ideal is W), `efficiency` = scaling / W, `comm_share` = a2a-only / ep-capacity,
`a2a_gbps` = remote bytes / a2a-only time, `ranks_us` = every rank's median.

Run alone (before the suite is registered): `python -m safemoe.bench.ep --out DIR [--quick]`.
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

SUITE = "ep"
SHAPES: dict[str, tuple[int, int, int, int]] = {  # E, K, H, I
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v3": (256, 8, 7168, 2048),
}
TOKENS = (1, 8, 64, 256, 4096)
QUICK_TOKENS = (1, 64, 4096)
N_VARIANTS = 2  # the weights (GBs) dwarf L2 already; two input sets keep activations honest
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
IMPLS = ("ep-capacity", "ep-dynamic", "a2a-only", "1gpu-global")
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
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for j in range(max(2, N_VARIANTS)):
            step(j % N_VARIANTS)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
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
    """This rank's timings of the four impls at T tokens per rank, and the rows its dynamic-mode
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

    measured: dict[str, tuple[float | None, str]] = {}
    iters = 10 if global_tokens <= 1024 else 5
    with torch.no_grad():
        ep.mode, ep.capacity = "capacity", None
        measured["ep-capacity"] = _guarded(lambda: _time_graph_all_ranks(ep_step, ctrl, global_tokens))
        measured["a2a-only"] = _guarded(lambda: _time_graph_all_ranks(a2a_step, ctrl, global_tokens))
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
            "a2a-only": (cap_bytes, cap_bytes * (world - 1) // world),
            "ep-dynamic": (sum(per_peer) * row_bytes, (sum(per_peer) - per_peer[rank]) * row_bytes),
        }
        slowest = {impl: _slowest([g[impl] for g in gathered]) for impl in IMPLS}
        one_gpu = measured["1gpu-global"][0]
        ep_floor = _ep_floor_us(shape, tokens, world, ceilings)
        floors = {
            "ep-capacity": ep_floor,
            "ep-dynamic": ep_floor,
            "a2a-only": None,
            "1gpu-global": moe_floor_us(num_experts, top_k, hidden, inter, global_tokens, ceilings)[0],
        }
        for impl in IMPLS:
            us = one_gpu if impl == "1gpu-global" else slowest[impl]
            extra: dict[str, Any] = {"ranks_us": [None if g[impl] is None else round(float(g[impl] or 0), 2)
                                                  for g in gathered]}  # fmt: skip
            if impl in bytes_of:
                extra["a2a_bytes"], extra["remote_bytes"] = bytes_of[impl]
            if impl.startswith("ep-") and us and one_gpu:
                extra["scaling_vs_1gpu"] = round(one_gpu / us, 3)
                extra["efficiency"] = round(one_gpu / us / world, 3)
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


def run(ceilings: DeviceCeilings, *, quick: bool) -> list[BenchRow]:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        note = f"skipped: expert parallelism needs >= 2 GPUs on one host, this machine has {gpus}"
        print(f"suite {SUITE}: {note}")
        return [BenchRow(SUITE, case, 0, "skipped", "ep-capacity", None, note=note) for case in SHAPES]
    for name, value in NO_MULTICAST.items():
        os.environ.setdefault(name, value)
    from safemoe.distributed import spawn

    tokens = QUICK_TOKENS if quick else TOKENS
    rows: list[BenchRow] = []
    for world in (w for w in (2, 4) if w <= gpus):
        results = spawn(
            _rank_main, world, tokens, ceilings.to_dict(), SHAPES,
            backend="nccl", timeout_s=180.0, join_timeout_s=1800.0, env=NO_MULTICAST,
        )  # fmt: skip
        rows += [BenchRow(**data) for data in results[0]]
    return rows


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
    args = parser.parse_args(argv)
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
    rows = suite.run(ceilings, quick=args.quick)
    write_results(rows, args.out, SUITE, ceilings)
    plot(rows, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
