"""Decode timings of the expert kernels' few-slot path against the dispatch layout, on a GPU.

    PYTHONPATH=src python scripts/debug/few_slots_decode.py [--out FILE.json]

For each bench shape, `experts_triton` (default configs, workspace, device num_valid, CUDA-graph
replay of 20 calls over 8 rotating routings; `safemoe.bench.harness.time_graph`) at T = 1, 2, 8
and T = 1024 with one valid row, two ways: `layout` (the few-slot path off: dispatch + sorted
layout, as before it existed) and `few` (the default). Prints a table; --out writes the rows as
JSON. A measurement script for issue 13, not a test. (Its first run, H100 2026-11-24, also timed
GEMM2 and combine fused into one CUDA-core matrix-vector kernel at T = 1: 1.5-2x slower than the
two kernels, e.g. Qwen3 66.8 against 33.2 us, so that kernel was dropped.)
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from safemoe._checks import NumValid
from safemoe.bench.harness import time_graph
from safemoe.kernels import experts as ex
from safemoe.workspace import Workspace

SHAPES = {  # E, K, H, I, activation
    "qwen3-30b-a3b": (128, 8, 2048, 768, "silu"),
    "mixtral-8x7b": (8, 2, 4096, 14336, "silu"),
    "gpt-oss-120b": (128, 4, 2880, 2880, "swigluoai"),
    "deepseek-v3": (256, 8, 7168, 2048, "silu"),
}
VARIANTS = 8


def _time(shape, num_tokens: int, num_valid: int, mode: str) -> float:
    num_experts, top_k, hidden, inter, activation = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    w13.mul_(1 / math.sqrt(hidden))
    w2 = torch.randn(num_experts, hidden, inter, device="cuda", dtype=torch.bfloat16, generator=gen)
    w2.mul_(1 / math.sqrt(inter))
    xs = [torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(VARIANTS)]
    ids = [torch.topk(torch.rand(num_tokens, num_experts, device="cuda"), top_k).indices.to(torch.int32)
           for _ in range(VARIANTS)]
    weights = [torch.rand(num_tokens, top_k, device="cuda") for _ in range(VARIANTS)]
    outs = [torch.empty_like(x) for x in xs]
    ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16, "cuda")
    nv = NumValid(None, torch.tensor(num_valid, device="cuda", dtype=torch.int32))
    saved = ex.few_slots_config
    if mode == "layout":
        ex.few_slots_config = lambda *args, **kwargs: None
    try:
        def step(j: int) -> None:
            ex.experts_triton(xs[j], w13, w2, weights[j], ids[j], activation=activation, num_valid=nv,
                              health=None, workspace=ws, out=outs[j])

        return time_graph(step, n_variants=VARIANTS)
    finally:
        ex.few_slots_config = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    print(f"{torch.cuda.get_device_name()}; us per experts_triton call (median, graph replay)")
    print(f"{'shape':16} {'T':>5} {'valid':>5} {'layout':>9} {'few':>9}")
    for name, shape in SHAPES.items():
        for num_tokens, num_valid in ((1, 1), (2, 2), (8, 8), (1024, 1)):
            row = {"shape": name, "tokens": num_tokens, "num_valid": num_valid}
            for mode in ("layout", "few"):
                row[mode] = round(_time(shape, num_tokens, num_valid, mode), 2)
            rows.append(row)
            print(f"{name:16} {num_tokens:5} {num_valid:5} {row['layout']:9.2f} {row['few']:9.2f}",
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
