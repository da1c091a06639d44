"""A/B the T*K up to which one dispatch program takes every slot (`ALONE_SLOTS`), in the layer.

    PYTHONPATH=src python scripts/debug/dispatch_alone_ab.py [--alone 1024/4 4096/16 8192/16]
        [--rounds 5] [SHAPE:T[:NUM_VALID] ...]

Times `safemoe.moe` (ab_entry.layer_step: route + experts, bf16, a workspace, num_valid as a
device tensor, CUDA-graph replay over 8 seeded routings) with `kernels.dispatch.ALONE_SLOTS` /
`ALONE_WARPS` set to each SLOTS/WARPS pair in turn, interleaved for --rounds rounds, and prints
each pair's median per point (and its change from the first pair). 1024/4 is the dispatch before
the change: one program only up to one 1024-slot chunk, count + scatter launches past it. With
T*K <= ALONE_SLOTS the grid is one program of ALONE_WARPS warps holding every slot as one chunk
and there is no scatter launch. Also checks that every pair gives the same output bits (the
layout's order inside an expert may differ; the GEMMs read each row by its slot). A measurement
script, not a test.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from ab_entry import VARIANTS, layer_step

import safemoe.kernels.dispatch as dispatch
from safemoe.bench.harness import time_graph

DEFAULT_POINTS = ["qwen3:256", "qwen3:512", "qwen3:1024", "qwen3:1024:1", "gptoss:512", "gptoss:1024",
                  "gptoss:1024:1", "deepseek:256", "deepseek:512", "mixtral:1024", "mixtral:2048:1"]


def set_alone(pair: str) -> None:
    slots, warps = pair.split("/")
    dispatch.ALONE_SLOTS, dispatch.ALONE_WARPS = int(slots), int(warps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("points", nargs="*", default=DEFAULT_POINTS)
    parser.add_argument("--alone", nargs="+", default=["1024/4", "4096/16", "8192/16"],
                        help="SLOTS/WARPS pairs")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(device), "ALONE_SLOTS", args.alone)
    for point in args.points:
        shape, tokens, *valid = point.split(":")
        num_tokens = int(tokens)
        num_valid = int(valid[0]) if valid else num_tokens
        step = layer_step(shape, num_tokens, num_valid, device)
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
        print(f"{shape} T={num_tokens} num_valid={num_valid} (T*K slots, same bits {same}): {cells}; "
              f"rounds {spread}", flush=True)


if __name__ == "__main__":
    main()
