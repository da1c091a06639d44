"""Debug (issue 13, decode): the combine fused into the few-slot GEMM2 (kernels/experts.py
FUSED_COMBINE) on against off, whole layer (`safemoe.moe`: route + experts, one workspace, num_valid
as a device tensor) under CUDA-graph replay, at the buckets whose every call takes the few-slot path.

    PYTHONPATH=src python3 scripts/debug/fused_combine.py [shape:T ...] [--rounds 3]

Interleaved rounds (off, on, ...), medians per side, the change, bitwise equality of the two
outputs, and % of the read floor (the experts the routings hit, read bandwidth measured in this
run, as `safemoe bench --suite layer` computes it). A measurement script, not a test.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import safemoe
from safemoe.bench.harness import measure_ceilings, moe_floor_us, sampled_distinct_experts, time_graph
from safemoe.kernels import experts as ex

SHAPES = {"qwen3": (128, 8, 2048, 768), "mixtral": (8, 2, 4096, 14336), "gptoss": (128, 4, 2880, 2880),
          "deepseek": (256, 8, 7168, 2048)}
DEFAULT_CASES = ("qwen3:1", "qwen3:2", "gptoss:1", "gptoss:4", "mixtral:1", "mixtral:8", "deepseek:1",
                 "deepseek:2")
VARIANTS = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", default=list(DEFAULT_CASES))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    ceilings = measure_ceilings(dev)
    print(f"{torch.cuda.get_device_name()}: read {ceilings.read_gbps:.0f} GB/s", flush=True)
    for spec in args.cases:
        name, tokens = spec.split(":")
        t = int(tokens)
        e, k, h, i = SHAPES[name]
        g = torch.Generator(device=dev).manual_seed(0)
        w13 = torch.randn(e, 2 * i, h, dtype=torch.bfloat16, device=dev, generator=g) * h**-0.5
        w2 = torch.randn(e, h, i, dtype=torch.bfloat16, device=dev, generator=g) * i**-0.5
        xs = [torch.randn(t, h, dtype=torch.bfloat16, device=dev, generator=g) for _ in range(VARIANTS)]
        logits = [torch.randn(t, e, dtype=torch.bfloat16, device=dev, generator=g) for _ in range(VARIANTS)]
        distinct = sampled_distinct_experts([safemoe.route(sample, k).ids for sample in logits])
        floor, _ = moe_floor_us(e, k, h, i, t, ceilings, distinct=distinct)
        nv = torch.tensor(t, dtype=torch.int32, device=dev)
        ws = safemoe.Workspace(t, e, k, h, i, torch.bfloat16, dev)

        def step(j: int) -> torch.Tensor:
            return safemoe.moe(xs[j], logits[j], w13, w2, k, num_valid=nv, workspace=ws, backend="triton")

        times: dict[bool, list[float]] = {False: [], True: []}
        outs = {}
        for _ in range(args.rounds):
            for on in (False, True):
                ex.FUSED_COMBINE = on
                outs[on] = step(0).clone()
                times[on].append(time_graph(step, n_variants=VARIANTS, calls_per_graph=20, replays=30))
        ex.FUSED_COMBINE = True
        off, on = statistics.median(times[False]), statistics.median(times[True])
        print(f"{spec:12s} off {off:9.2f} us ({100 * floor / off:5.1f}%)  on {on:9.2f} us ({100 * floor / on:5.1f}%)"
              f"  {100 * (on / off - 1):+5.1f}%  bitwise equal: {torch.equal(outs[False], outs[True])}",
              flush=True)
        del w13, w2, xs, logits, ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
