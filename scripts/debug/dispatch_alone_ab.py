"""A/B the T*K up to which one dispatch program takes every slot (`ALONE_SLOTS`), in the layer.

    PYTHONPATH=src python scripts/debug/dispatch_alone_ab.py [--alone 1024/4 4096/16 8192/16]
        [--rounds 5] [SHAPE:T[:NUM_VALID] ...]

Times `safemoe.moe` (ab_entry.layer_step: route + experts, bf16, a workspace, num_valid as a
device tensor, CUDA-graph replay over 8 seeded routings) with `kernels.dispatch.ALONE_SLOTS` /
`ALONE_WARPS` set to each SLOTS/WARPS pair in turn, interleaved for --rounds rounds, and prints
each pair's median per point (and its change from the first pair); a third field sets
`ATOMIC_COUNT_BINS` (the bins from which slots are counted with atomics, not tl.histogram), a
fourth `MANY_BINS_WARPS` (the warps of a one-program launch of at most CHUNK slots with 1024 bins
or more: Qwen3-Next's decode dispatch, e.g. 4096/8/1024/16) and a fifth `RANGE_PADDING_FILL`
(0: the per-bin fill; 1, shipped: a one-program layout's -1 padding written as one range, e.g.
4096/8/1024/4/0). 1024/4
is the dispatch before the change: one program only up to one 1024-slot chunk, count + scatter
launches past it. With T*K <= ALONE_SLOTS the grid is one program of ALONE_WARPS warps holding
every slot as one chunk and there is no scatter launch. Also checks that every pair gives the same
output bits (the layout's order inside an expert may differ; the GEMMs read each row by its slot).
With --dispatch-only a point is E:K:T[:NUM_VALID] and the step is the dispatch alone
(`dispatch_into`, block_m 16, random distinct ids per row), for shapes the bench has no layer of
(Qwen3-Next: 512:10). A measurement script, not a test. Layer points may also name EXTRA_SHAPES
(qwen3next: E = 512, K = 10).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import ab_entry
import torch
from ab_entry import VARIANTS, layer_step

import safemoe.kernels.dispatch as dispatch
from safemoe._checks import NumValid
from safemoe.bench.harness import time_graph
from safemoe.workspace import Workspace

# Layer shapes the bench has no entry for (heuristic tiles): (E, K, H, I, activation).
EXTRA_SHAPES = {"qwen3next": (512, 10, 2048, 512, "silu")}  # Qwen3-Next-80B-A3B's MoE

DEFAULT_POINTS = ["qwen3:256", "qwen3:512", "qwen3:1024", "qwen3:1024:1", "gptoss:512", "gptoss:1024",
                  "gptoss:1024:1", "deepseek:256", "deepseek:512", "mixtral:1024", "mixtral:2048:1"]


def set_alone(pair: str) -> None:
    """SLOTS/WARPS[/BINS[/MANY_BINS_WARPS[/RANGE_FILL]]]: ALONE_SLOTS, ALONE_WARPS,
    ATOMIC_COUNT_BINS (default 1024), MANY_BINS_WARPS (default 4: the warps of a decode-sized
    program with 1024 bins or more, E = 512) and RANGE_PADDING_FILL (0 or 1, default 1, as shipped: a
    one-program layout's padding written as one range)."""
    slots, warps, *rest = pair.split("/")
    dispatch.ALONE_SLOTS, dispatch.ALONE_WARPS = int(slots), int(warps)
    dispatch.ATOMIC_COUNT_BINS = int(rest[0]) if rest else 1024
    dispatch.MANY_BINS_WARPS = int(rest[1]) if len(rest) > 1 else 4
    dispatch.RANGE_PADDING_FILL = bool(int(rest[2])) if len(rest) > 2 else True


def dispatch_step(point: str, device: torch.device) -> Callable[[int], torch.Tensor]:
    """The dispatch alone on E:K:T[:NUM_VALID] (num_valid a device tensor); returns num_blocks."""
    num_experts, top_k, num_tokens, *valid = (int(v) for v in point.split(":"))
    gen = torch.Generator().manual_seed(0)
    ids = [torch.argsort(torch.rand(num_tokens, num_experts, generator=gen), dim=1)[:, :top_k]
           .to(torch.int32).to(device) for _ in range(VARIANTS)]  # fmt: skip
    nv = NumValid(None, torch.tensor(valid[0] if valid else num_tokens, dtype=torch.int32, device=device))
    ws = Workspace(num_tokens, num_experts, top_k, 16, 16, torch.bfloat16, device)
    views = ws.views(num_tokens, num_experts, top_k, 16, 16)

    def step(j: int) -> torch.Tensor:
        dispatch.dispatch_into(ids[j], num_experts, nv, 16, views, None, use_pdl=True)
        return views.num_blocks

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("points", nargs="*", default=DEFAULT_POINTS)
    parser.add_argument("--alone", nargs="+", default=["1024/4", "4096/16", "8192/16"],
                        help="SLOTS/WARPS[/ATOMIC_COUNT_BINS[/MANY_BINS_WARPS[/RANGE_FILL]]] settings")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dispatch-only", action="store_true", help="points are E:K:T[:NUM_VALID]")
    args = parser.parse_args()
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(device), "ALONE_SLOTS", args.alone)
    for point in args.points:
        if args.dispatch_only:
            step = dispatch_step(point, device)
            label = f"dispatch E:K:T[:NUM_VALID] = {point}"
        else:
            shape, tokens, *valid = point.split(":")
            num_tokens = int(tokens)
            num_valid = int(valid[0]) if valid else num_tokens
            bench_shapes = ab_entry.SHAPES
            if shape in EXTRA_SHAPES:
                ab_entry.SHAPES = {shape: EXTRA_SHAPES[shape]}
            step = layer_step(shape, num_tokens, num_valid, device)
            ab_entry.SHAPES = bench_shapes
            label = f"{shape} T={num_tokens} num_valid={num_valid}"
        outputs = {}
        for alone in args.alone:
            set_alone(alone)
            outputs[alone] = step(0).clone()
        same = all(torch.equal(outputs[args.alone[0]], o) for o in outputs.values())
        times: dict[str, list[float]] = {a: [] for a in args.alone}
        for _ in range(args.rounds):
            for alone in args.alone:
                set_alone(alone)
                times[alone].append(time_graph(step, n_variants=VARIANTS, calls_per_graph=10, replays=20))
        med = {a: statistics.median(v) for a, v in times.items()}
        base = med[args.alone[0]]
        cells = ", ".join(f"{a}: {m:.2f} us ({m / base - 1:+.1%})" for a, m in med.items())
        spread = ", ".join(f"{a}: {min(v):.2f}-{max(v):.2f}" for a, v in times.items())
        print(f"{label} (same bits {same}): {cells}; "
              f"rounds {spread}", flush=True)


if __name__ == "__main__":
    main()
