"""Debug (issue 13, decode): GEMM2's L2 prefetch of its first tile's w2 rows while GEMM1 still runs
(PDL prologue, kernels/experts.py W2_PREFETCH), on against off, whole layer (`safemoe.moe`: route +
experts, with a workspace and num_valid as a device tensor) under CUDA-graph replay.

    PYTHONPATH=src python3 scripts/debug/w2_prefetch.py [shape:T[:num_valid] ...] [--rounds 3]

Each case is timed in interleaved rounds (off, on, off, on, ...); the medians of each side are
printed with the change, and the outputs of the two must be bitwise equal (a prefetch is a hint).
It also counts the prefetch instructions in the compiled GEMM2 PTX, to show that the prologue is
there at all. A measurement script, not a test.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import safemoe
from safemoe.bench.harness import time_graph
from safemoe.kernels import experts as ex

SHAPES = {"qwen3": (128, 8, 2048, 768), "mixtral": (8, 2, 4096, 14336), "gptoss": (128, 4, 2880, 2880),
          "deepseek": (256, 8, 7168, 2048)}
DEFAULT_CASES = ("qwen3:1", "qwen3:8", "qwen3:64", "qwen3:256", "qwen3:1024:1", "gptoss:1", "gptoss:8",
                 "gptoss:64", "mixtral:1", "mixtral:64", "deepseek:1", "deepseek:64")
VARIANTS = 4


def _prefetches_in_ptx() -> int:
    count = 0
    for cache in getattr(ex._gemm2_kernel, "device_caches", {}).values():
        kernels = cache[0] if isinstance(cache, tuple) else cache
        for kernel in kernels.values():
            count += getattr(kernel, "asm", {}).get("ptx", "").count("prefetch.global.L2")
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", default=list(DEFAULT_CASES))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    dev = "cuda"
    print(torch.cuda.get_device_name(), flush=True)
    for spec in args.cases:
        name, tokens, *valid = spec.split(":")
        t = int(tokens)
        e, k, h, i = SHAPES[name]
        g = torch.Generator(device=dev).manual_seed(0)
        w13 = torch.randn(e, 2 * i, h, dtype=torch.bfloat16, device=dev, generator=g) * h**-0.5
        w2 = torch.randn(e, h, i, dtype=torch.bfloat16, device=dev, generator=g) * i**-0.5
        xs = [torch.randn(t, h, dtype=torch.bfloat16, device=dev, generator=g) for _ in range(VARIANTS)]
        logits = [torch.randn(t, e, dtype=torch.float32, device=dev, generator=g) for _ in range(VARIANTS)]
        nv = torch.tensor(int(valid[0]) if valid else t, dtype=torch.int32, device=dev)
        ws = safemoe.Workspace(t, e, k, h, i, torch.bfloat16, dev)

        def step(j: int) -> torch.Tensor:
            return safemoe.moe(xs[j % VARIANTS], logits[j % VARIANTS], w13, w2, k, num_valid=nv, workspace=ws,
                               backend="triton")

        times: dict[bool, list[float]] = {False: [], True: []}
        outs = {}
        for _ in range(args.rounds):
            for on in (False, True):
                ex.W2_PREFETCH = on
                outs[on] = step(0).clone()
                times[on].append(time_graph(step, n_variants=VARIANTS, calls_per_graph=20, replays=30))
        ex.W2_PREFETCH = True
        off, on = statistics.median(times[False]), statistics.median(times[True])
        same = torch.equal(outs[False], outs[True])
        print(f"{spec:14s} off {off:9.2f} us  on {on:9.2f} us  {100 * (on / off - 1):+6.1f}%  "
              f"bitwise equal: {same}  rounds off {[round(v, 1) for v in times[False]]} "
              f"on {[round(v, 1) for v in times[True]]}", flush=True)
        del w13, w2, xs, logits, ws
        torch.cuda.empty_cache()
    print(f"prefetch instructions in compiled GEMM2 PTX: {_prefetches_in_ptx()}")


if __name__ == "__main__":
    main()
