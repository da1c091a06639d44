"""Debug (issue 13, twenty-eighth session; run with bench/results/logs/half_m_tiles_reverted.patch
applied): registers, spills and shared memory of the GEMM kernels with GemmTiles.half_m off and on
for a few table entries, and the experts call's time each way (CUDA graph, medians of 20 replays),
to say why the half-height tiles slowed prefill by 4-12% in the layer A/B.

    PYTHONPATH=src:scripts/debug python scripts/debug/half_m_stats.py
"""

from __future__ import annotations

import functools
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch
from ab_entry import shape_named, stand_ins

sys.path.insert(0, str(Path(__file__).parents[1]))
from heuristic_eval import _gemm_kernels  # the GEMM kernels in this process's Triton caches

from safemoe._checks import check_num_valid
from safemoe.bench.harness import event_times_us
from safemoe.configs import load_device_configs, shape_key
from safemoe.kernels.experts import experts_triton
from safemoe.workspace import Workspace


def main() -> None:
    device = torch.device("cuda")
    table = load_device_configs(torch.cuda.get_device_name(device))
    for shape, tokens in (("deepseek", 8192), ("gptoss", 8192), ("qwen3", 8192), ("mixtral", 256)):
        num_experts, top_k, hidden, inter, activation = shape_named(shape)
        cfg = table[shape_key(num_experts, hidden, inter, top_k, torch.bfloat16)][tokens]
        gen = torch.Generator(device=device).manual_seed(0)
        w13, w2, xs = stand_ins(shape, tokens, 1, device, gen)
        ids = torch.argsort(torch.rand(tokens, num_experts, device=device, generator=gen), 1)[:, :top_k]
        ids = ids.to(torch.int32)
        weights = torch.rand(tokens, top_k, device=device, generator=gen)
        ws = Workspace(tokens, num_experts, top_k, hidden, inter, torch.bfloat16, device)
        nv = check_num_valid(None, tokens, device)
        for half in (False, True):
            c = replace(cfg, gemm1=replace(cfg.gemm1, half_m=half), gemm2=replace(cfg.gemm2, half_m=half))
            before = set(_gemm_kernels())

            call = functools.partial(experts_triton, xs[0], w13, w2, weights, ids, activation=activation,
                                     num_valid=nv, health=None, workspace=ws, config=c)

            call()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(5):
                    call()
            us = statistics.median(event_times_us(graph.replay, iters=20, warmup=3)) / 5
            stats = []
            for key, k in _gemm_kernels().items():
                if key in before:
                    continue
                try:
                    stats.append(f"{key.split(':')[0]} regs {k.n_regs} spills {k.n_spills} "
                                 f"smem {k.metadata.shared // 1024} KB stages {k.metadata.num_stages}")
                except Exception as exc:
                    stats.append(f"{key.split(':')[0]}: {type(exc).__name__}")
            print(f"{shape} T={tokens} half_m={half}: {us:.1f} us; " + "; ".join(stats), flush=True)
            del graph


if __name__ == "__main__":
    main()
