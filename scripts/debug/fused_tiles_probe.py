"""Tiles for the fused few-slot launch (GEMM1 and GEMM2 in one kernel, `ExpertsConfig.fused`).

    PYTHONPATH=src:scripts/debug python3 scripts/debug/fused_tiles_probe.py [SHAPE:T ...] [--rounds 3]

The fused launch runs GEMM2's tiles with GEMM1's num_warps and num_stages, so its shared memory
is the stages of the larger of the two tile sets, which caps its programs per SM: the tuner's
`choose_fused` times it only with the two-launch winner's tiles (Qwen3 T = 1: +11-26%, so off).
For each point (a bucket whose every call takes the few-slot path) this times `experts_triton`
(bf16 stand-in weights, 8 seeded routings, num_valid a device tensor, CUDA-graph replay) with the
device table's entry as two launches, as the fused launch, and fused with other stage counts and
GEMM2 K steps, interleaved for --rounds rounds, and checks every variant's output bits against
the two launches' (the same tiles give the same bits; other K steps may differ in rounding).
A measurement script, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch
from ab_entry import VARIANTS, shape_named, stand_ins

from safemoe._checks import NumValid
from safemoe.bench.harness import time_graph
from safemoe.configs import get_config
from safemoe.kernels.experts import experts_triton
from safemoe.workspace import Workspace

DEFAULT_POINTS = ["qwen3:1", "qwen3:2", "gptoss:1", "gptoss:2", "gptoss:4", "mixtral:1", "mixtral:4",
                  "deepseek:1", "deepseek:2"]


def variants(cfg):
    """(label, config) of the fused launch to time beside the entry's two launches."""
    out = [("two launches", dataclasses.replace(cfg, fused=False)),
           ("fused, entry", dataclasses.replace(cfg, fused=True))]
    for stages in (2, 3, 4):
        g1 = dataclasses.replace(cfg.gemm1, num_stages=stages)
        for block_k in sorted({cfg.gemm2.block_k, 64, 128}):
            g2 = dataclasses.replace(cfg.gemm2, block_k=block_k)
            label = f"fused, stages {stages}, gemm2 block_k {block_k}"
            out.append((label, dataclasses.replace(cfg, fused=True, gemm1=g1, gemm2=g2)))
    return out


def run_point(point: str, rounds: int, device: torch.device) -> None:
    shape, tokens = point.split(":")
    num_tokens = int(tokens)
    num_experts, top_k, hidden, inter, activation = shape_named(shape)
    gen = torch.Generator(device=device).manual_seed(0)
    w13, w2, xs = stand_ins(shape, num_tokens, VARIANTS, device, gen)
    ids = [torch.argsort(torch.rand(num_tokens, num_experts, device=device, generator=gen), dim=1)
           [:, :top_k].to(torch.int32) for _ in range(VARIANTS)]  # fmt: skip
    weights = [torch.rand(num_tokens, top_k, device=device, generator=gen) for _ in range(VARIANTS)]
    nv = NumValid(None, torch.tensor(num_tokens, dtype=torch.int32, device=device))
    ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16, device)
    outs = [torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=device) for _ in range(VARIANTS)]
    entry = get_config(num_tokens, num_experts, hidden, inter, top_k, torch.bfloat16, device)
    print(f"== {point}: entry {entry}", flush=True)

    def step_of(cfg):
        def step(j: int) -> torch.Tensor:
            return experts_triton(xs[j], w13, w2, weights[j], ids[j], activation=activation, num_valid=nv,
                                  health=None, workspace=ws, out=outs[j], config=cfg, few_config=cfg,
                                  ids_complete=True)
        return step

    cases = variants(entry)
    reference = [step_of(cases[0][1])(j).clone() for j in range(VARIANTS)]
    same = {}
    for label, cfg in cases:
        try:
            got = [step_of(cfg)(j).clone() for j in range(VARIANTS)]
        except Exception as exc:  # a variant that does not compile (shared memory) is reported
            print(f"   {label}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            same[label] = None
            continue
        same[label] = all(torch.equal(a, b) for a, b in zip(reference, got, strict=True))
    times: dict[str, list[float]] = {label: [] for label, _ in cases if same[label] is not None}
    for _ in range(rounds):
        for label, cfg in cases:
            if label in times:
                times[label].append(time_graph(step_of(cfg), n_variants=VARIANTS, calls_per_graph=20,
                                               replays=20))
    base = statistics.median(times["two launches"])
    for label, values in times.items():
        med = statistics.median(values)
        print(f"   {label:36s} {med:8.2f} us ({100 * (med / base - 1):+5.1f}%)  same bits: {same[label]}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("points", nargs="*", default=DEFAULT_POINTS)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(device), flush=True)
    for point in args.points:
        run_point(point, args.rounds, device)


if __name__ == "__main__":
    main()
