"""Run the fp8 block-mode experts a few times at one shape, for `ncu` to profile the activation
quantisation launches (kernels/act_quant.py); prints the time of the two quantisation launches
alone too. A measurement script for issue 13, not a test.

    PYTHONPATH=src ncu --kernel-name regex:_quantize --launch-skip 4 --launch-count 2 \\
        --section SpeedOfLight --section WarpStateStats --section Occupancy \\
        python scripts/debug/quantize_profile.py [--shape qwen3] [--tokens 16384]
"""

from __future__ import annotations

import argparse

import torch

from safemoe._checks import NumValid, check_fp8_weights
from safemoe.bench.experts import Inputs
from safemoe.bench.harness import time_graph
from safemoe.fp8 import quantize_experts
from safemoe.kernels.act_quant import quantize_positions_into, quantize_rows_into
from safemoe.kernels.experts import experts_triton
from safemoe.workspace import Workspace

SHAPES = {"qwen3": (128, 8, 2048, 768, "silu"), "deepseek": (256, 8, 7168, 2048, "silu")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--time", action="store_true", help="also time the two launches (graph replay)")
    args = parser.parse_args()
    num_experts, top_k, hidden, inter, activation = shape = SHAPES[args.shape]
    device = torch.device("cuda")
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=device, dtype=torch.bfloat16) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, device=device, dtype=torch.bfloat16) * inter**-0.5
    q13, q2, s13, s2 = quantize_experts(w13, w2, "block")
    fp8 = check_fp8_weights(q13, q2, s13, s2)
    del w13, w2
    inputs = Inputs(shape, args.tokens, device, seed=0)
    ws = Workspace(args.tokens, num_experts, top_k, hidden, inter, torch.bfloat16, device, fp8=True)
    nv = NumValid(None, torch.tensor(args.tokens, device=device, dtype=torch.int32))
    for _ in range(3):
        experts_triton(inputs.xs[0], q13, q2, inputs.weights[0], inputs.ids[0], activation=activation,
                       num_valid=nv, health=None, workspace=ws, fp8=fp8)
    torch.cuda.synchronize()
    if args.time:
        views = ws.views(args.tokens, num_experts, top_k, hidden, inter)
        f8 = ws.fp8_views(args.tokens, num_experts, top_k, hidden, inter, 128)
        cfg_block_m = 128
        positions = f8.inter.shape[0]

        def x_pass(j: int) -> None:
            quantize_rows_into(inputs.xs[j], f8.x, f8.x_scale, 128, nv)

        def inter_pass(j: int) -> None:
            quantize_positions_into(views.intermediate, f8.inter, f8.inter_scale, 128, views.sorted_slots,
                                    views.num_blocks, cfg_block_m, 0, positions)

        for name, step in (("x rows", x_pass), ("intermediate positions", inter_pass)):
            us = time_graph(step, n_variants=1, calls_per_graph=10, replays=20)
            print(f"{args.shape} T={args.tokens} quantise {name}: {us:.1f} us", flush=True)


if __name__ == "__main__":
    main()
