"""Debug (issue 13): where a decode layer's time goes between its kernels, under CUDA-graph replay.

    PYTHONPATH=src python3 scripts/debug/decode_timeline.py [qwen3:64 mixtral:256 qwen3:1024:1 ...]
        [alone=SLOTS/WARPS qwen3next:128 ...]   (alone=: the dispatch's ALONE_SLOTS/_WARPS from there on)
        [quant=block qwen3:64 quant=per_tensor ... quant=none]   (fp8 weights from there on)

gluon_decode_probe.py (H200, 2026-11-27) timed the library's decode GEMMs on their own (PDL off)
at 4.26-4.55 TB/s, 93-99% of the read floor's bandwidth, while the whole layer sits at 81-90% of
the floor on the Qwen3 shape. This script captures the layer as the bench does (`safemoe.moe`,
route + experts, a workspace, 20 calls in one graph), replays it under torch.profiler and prints,
per kernel of a call (SHAPE:T[:NUM_VALID], num_valid as a device tensor; medians over the calls
of 5 replays): its start offset from the call's router
start, its duration, and the gap to the previous kernel's end; and the period of a call (router
start to the next call's router start), beside the graph-replay time `time_graph` gives. With PDL a
kernel starts before its predecessor ends and waits in griddepcontrol.wait, so a "duration" holds
that wait; the period and the ends are what count.
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import safemoe
import safemoe.kernels.dispatch as dispatch
from safemoe.bench.harness import time_graph
from safemoe.fp8 import quantize_experts

SHAPES = {
    "qwen3": (128, 8, 2048, 768),
    "mixtral": (8, 2, 4096, 14336),
    "gptoss": (128, 4, 2880, 2880),
    "deepseek": (256, 8, 7168, 2048),
    "qwen3next": (512, 10, 2048, 512),
}
CALLS = 20
QUANT: str | None = None  # fp8 weights (safemoe.fp8.quantize_experts mode) for the next cases


def short(name: str) -> str:
    for key in ("route", "count", "scatter", "quantize", "few_gemms", "gemm1", "gemm2", "combine"):
        if key in name:
            return key
    return name[:30]


def case(name: str, tokens: int, num_valid: int | None = None) -> None:
    e, k, h, i = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, h, dtype=torch.bfloat16, device="cuda", generator=g)
    logits = torch.randn(tokens, e, dtype=torch.float32, device="cuda", generator=g)
    w13 = torch.randn(e, 2 * i, h, dtype=torch.bfloat16, device="cuda", generator=g) * h**-0.5
    w2 = torch.randn(e, h, i, dtype=torch.bfloat16, device="cuda", generator=g) * i**-0.5
    scales: dict[str, torch.Tensor] = {}
    if QUANT is not None:
        w13, w2, s13, s2 = quantize_experts(w13, w2, QUANT)
        scales = {"w13_scale": s13, "w2_scale": s2}
    ws = safemoe.Workspace(tokens, e, k, h, i, torch.bfloat16, "cuda", fp8=QUANT is not None)
    nv = None if num_valid is None else torch.tensor(num_valid, dtype=torch.int32, device="cuda")

    def step(_: int) -> torch.Tensor:
        return safemoe.moe(x, logits, w13, w2, k, num_valid=nv, workspace=ws, backend="triton", **scales)

    per_call = time_graph(step, calls_per_graph=CALLS, replays=30)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for j in range(CALLS):
            step(j)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted(
        (
            (ev.time_range.start, ev.time_range.end, short(ev.name))
            for ev in prof.events()
            if ev.device_type == DeviceType.CUDA
        ),
        key=lambda kv: kv[0],
    )
    calls: list[list[tuple[float, float, str]]] = []
    for kernel in kernels:
        if kernel[2] == "route" or not calls:
            calls.append([])
        calls[-1].append(kernel)
    starts = defaultdict(list)
    durations = defaultdict(list)
    gaps = defaultdict(list)
    periods = []
    for n, call in enumerate(calls):
        t0 = call[0][0]
        if n + 1 < len(calls):
            periods.append(calls[n + 1][0][0] - t0)
        previous_end = None
        seen = defaultdict(int)
        for start, end, kind in call:
            label = f"{kind}#{seen[kind]}" if seen[kind] else kind
            seen[kind] += 1
            starts[label].append(start - t0)
            durations[label].append(end - start)
            if previous_end is not None:
                gaps[label].append(start - previous_end)
            previous_end = end
    period = statistics.median(periods) if periods else float("nan")
    print(
        f"== {name} T={tokens} num_valid={num_valid} fp8={QUANT}: time_graph {per_call:.1f} us/call; "
        f"call period in the trace {period:.1f} us; {len(calls)} calls traced",
        flush=True,
    )
    for label in starts:
        gap = f"{statistics.median(gaps[label]):7.2f}" if gaps[label] else "      -"
        print(
            f"   {label:12s} start {statistics.median(starts[label]):8.2f}  "
            f"dur {statistics.median(durations[label]):8.2f}"
            f"  gap after previous end {gap}",
            flush=True,
        )


def main() -> None:
    global QUANT
    specs = sys.argv[1:] or [
        "qwen3:1",
        "qwen3:8",
        "qwen3:64",
        "qwen3:256",
        "gptoss:1",
        "gptoss:8",
        "mixtral:64",
        "mixtral:256",
    ]
    print(torch.cuda.get_device_name())
    for spec in specs:
        if spec.startswith("alone="):  # kernels.dispatch.ALONE_SLOTS / ALONE_WARPS for the next cases
            slots, warps = spec.removeprefix("alone=").split("/")
            dispatch.ALONE_SLOTS, dispatch.ALONE_WARPS = int(slots), int(warps)
            print(f"-- ALONE_SLOTS {slots}, ALONE_WARPS {warps}")
            continue
        if spec.startswith("quant="):
            mode = spec.removeprefix("quant=")
            QUANT = None if mode == "none" else mode
            continue
        name, tokens, *valid = spec.split(":")
        case(name, int(tokens), int(valid[0]) if valid else None)


if __name__ == "__main__":
    main()
