"""One eager `safemoe.moe` step of a bench shape inside an NVTX range "profiled", for Nsight Compute
(`scripts/debug/ncu_layer.sh` profiles only the kernels of that range; three warm-up steps run
before it, so compilation and autotuning stay outside).

    PYTHONPATH=src:scripts/debug python3 scripts/debug/ncu_step.py SHAPE T [per_tensor|block]
"""

from __future__ import annotations

import sys

import torch
from ab_entry import layer_step


def main() -> None:
    shape, num_tokens = sys.argv[1], int(sys.argv[2])
    quant = sys.argv[3] if len(sys.argv) > 3 else None
    step = layer_step(shape, num_tokens, num_tokens, torch.device("cuda"), quant)
    for j in range(3):
        step(j)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profiled")
    step(0)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main()
