"""Debug (issue 13, eighteenth session): registers, spills and shared memory of the compiled
_gemm2_kernel variants with the L2 prefetch off and on, at one fp8/bf16 layer step, and the
step's graph time each way (a probe for why the prefetch made fp8 Qwen3 T = 256 slower).

    PYTHONPATH=src:scripts/debug python scripts/debug/prefetch_regs.py qwen3 256 block [BYTES ...]
"""

from __future__ import annotations

import sys

import torch
from ab_entry import VARIANTS, layer_step

import safemoe.kernels.experts as ex
from safemoe.bench.harness import time_graph


def main() -> None:
    shape, tokens, quant, *budgets = sys.argv[1:]
    mode = None if quant == "none" else quant
    step = layer_step(shape, int(tokens), int(tokens), torch.device("cuda"), mode)
    for budget in [0, ex.PREFETCH_L2_BYTES, *map(int, budgets)]:
        ex.PREFETCH_L2_BYTES = budget
        us = time_graph(step, n_variants=VARIANTS, calls_per_graph=10, replays=20)
        print(f"budget {budget:>9d} B: {us:9.2f} us", flush=True)
    for caches in getattr(ex._gemm2_kernel, "device_caches", {}).values():
        for compiled in caches[0].values():  # in compile order: the prefetch-off variants first
            print(f"gemm2 variant: regs {compiled.n_regs} spills {compiled.n_spills} "
                  f"shared {compiled.metadata.shared} warps {compiled.metadata.num_warps}")


if __name__ == "__main__":
    main()
