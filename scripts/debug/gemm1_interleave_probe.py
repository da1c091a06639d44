"""Debug (issue 13, prefill): what does GEMM1's `interleave` (gate and up rows as one
[BLOCK_K, 2 BLOCK_N] weight tile, one MMA a K step, instead of two BLOCK_N-wide MMAs reading the
same A tile) give the expert GEMMs of the tuned prefill buckets? Times `experts_triton` (experts
only: dispatch, GEMM1, GEMM2, combine; bf16, seeded weights and routings, CUDA-graph replay) with
the device table's config and with each variant, interleaved over --rounds rounds, checks every
variant's output against the table config's (max relative difference), and prints medians and
TFLOP/s. A measurement script, not a test. (Its predecessor probed `flatten` and `a_tma`:
bench/results/logs/prefill_levers_flatten-a_tma_reverted_NVIDIA-H100_2026-11-26.txt.)

    PYTHONPATH=src python3 scripts/debug/gemm1_interleave_probe.py [--shapes qwen3,mixtral]
        [--tokens 2048,8192] [--compile-only] [--quant block|per_tensor]

With --variants JSON: instead, the table's config and each named override of it, e.g.
'{"g1s4": {"gemm1": {"num_stages": 4}}, "pps4": {"programs_per_sm": 4}}' (GemmTiles fields under
"gemm1"/"gemm2", ExpertsConfig fields at the top).

With --quant: the stand-in weights quantised to fp8 (safemoe.quantize_experts), the device table's
fp8 entry (`get_config(..., quant=)`), and GEMM1 interleaved as the table has it (pointers or
TMA), through pointers, and at one stage fewer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import traceback

import torch
from ab_entry import shape_named, stand_ins  # scripts/debug is on sys.path when run as a script

import safemoe
from safemoe._checks import check_fp8_weights, check_num_valid
from safemoe.bench.harness import time_graph
from safemoe.configs import ExpertsConfig, GemmTiles, get_config
from safemoe.kernels.experts import experts_triton
from safemoe.workspace import Workspace

INPUT_SETS = 4


def _tiles(tiles: GemmTiles, **flags: object) -> GemmTiles:
    return dataclasses.replace(tiles, **flags)


def variants(base: ExpertsConfig, quant: str | None = None,
             overrides: dict[str, dict] | None = None) -> dict[str, ExpertsConfig]:
    """The table's config, its GEMM1 through pointers (interleave needs them), and interleaved (fp8:
    interleaved as the table loads the weights, through pointers, and at one stage fewer); with
    `overrides`, the table's config and each named override of it instead."""
    g1 = base.gemm1
    if overrides:
        out = {"table": base}
        for name, fields in overrides.items():
            top = {k: v for k, v in fields.items() if k not in ("gemm1", "gemm2")}
            out[name] = dataclasses.replace(base, gemm1=_tiles(base.gemm1, **fields.get("gemm1", {})),
                                            gemm2=_tiles(base.gemm2, **fields.get("gemm2", {})), **top)
        return out
    if quant is not None:
        return {
            "table": base,
            "interleave1": dataclasses.replace(base, gemm1=_tiles(g1, interleave=True)),
            "interleave1-ptr": dataclasses.replace(base, gemm1=_tiles(g1, interleave=True, tma=False)),
            "interleave1-s-1": dataclasses.replace(base, gemm1=_tiles(g1, interleave=True,
                                                                       num_stages=g1.num_stages - 1)),
        }
    return {
        "table": base,
        "pointers1": dataclasses.replace(base, gemm1=_tiles(g1, tma=False)),
        "interleave1": dataclasses.replace(base, gemm1=_tiles(g1, tma=False, interleave=True)),
        "interleave1-s3": dataclasses.replace(base, gemm1=_tiles(g1, tma=False, interleave=True,
                                                                  num_stages=3)),
        "interleave1-bn64": dataclasses.replace(base, gemm1=_tiles(g1, tma=False, interleave=True,
                                                                    block_n=64)),
    }


def probe(prefix: str, num_tokens: int, rounds: int, compile_only: bool, quant: str | None = None,
          overrides: dict[str, dict] | None = None) -> None:
    num_experts, top_k, hidden, inter, activation = shape_named(prefix)
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    w13, w2, xs = stand_ins(prefix, num_tokens, INPUT_SETS, device, gen)
    fp8 = None
    if quant is not None:
        q13, q2, s13, s2 = safemoe.quantize_experts(w13, w2, quant)
        w13, w2, fp8 = q13, q2, check_fp8_weights(q13, q2, s13, s2)
    routings = [safemoe.route(torch.randn(num_tokens, num_experts, device=device, dtype=torch.bfloat16,
                                          generator=gen), top_k) for _ in range(INPUT_SETS)]
    nv = check_num_valid(None, num_tokens, device)
    ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16, device, fp8=fp8 is not None)
    outs = [torch.empty(num_tokens, hidden, device=device, dtype=torch.bfloat16) for _ in range(INPUT_SETS)]
    flops = 2 * num_tokens * top_k * 3 * hidden * inter
    base = get_config(num_tokens, num_experts, hidden, inter, top_k, torch.bfloat16, device, quant)
    print(f"\n{prefix} T={num_tokens}: table config {base.to_json()}", flush=True)

    def step_for(cfg: ExpertsConfig):
        def step(j: int) -> torch.Tensor:
            r = routings[j]
            return experts_triton(xs[j], w13, w2, r.weights, r.ids, activation=activation, num_valid=nv,
                                  health=None, workspace=ws, out=outs[j], config=cfg, fp8=fp8)
        return step

    steps, reference = {}, None
    for name, cfg in variants(base, quant, overrides).items():
        try:
            got = step_for(cfg)(0).clone()
            torch.cuda.synchronize()
        except Exception as exc:  # a probe reports what fails to compile
            first_line = str(exc).splitlines()[0][:200] if str(exc) else ""
            print(f"  {name}: FAILED {type(exc).__name__}: {first_line}")
            traceback.print_exc(limit=2)
            continue
        if reference is None:
            reference = got
        diff = float((got.float() - reference.float()).abs().max() / reference.float().abs().max())
        print(f"  {name}: max |diff| / max |table| {diff:.2e}", flush=True)
        if diff < 1e-2:
            steps[name] = step_for(cfg)
    if compile_only:
        return
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(time_graph(step, n_variants=INPUT_SETS, calls_per_graph=4, replays=10))
    table_us = statistics.median(times["table"])
    for name, samples in times.items():
        us = statistics.median(samples)
        change = 100 * (us / table_us - 1)
        print(f"  {name:16s} {us:9.1f} us  {flops / us / 1e6:5.0f} TFLOP/s  {change:+6.1f}%  "
              f"({', '.join(f'{s:.1f}' for s in samples)})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3,mixtral,gptoss,deepseek")
    parser.add_argument("--quant", choices=("block", "per_tensor"), default=None)
    parser.add_argument("--variants", type=json.loads, default=None,
                        help="JSON {name: overrides} timed against the table's config instead")
    parser.add_argument("--tokens", default="8192")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile-only", action="store_true",
                        help="compile and check every variant, time nothing (run shapes in parallel first)")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for prefix in args.shapes.split(","):
        for num_tokens in (int(t) for t in args.tokens.split(",")):
            probe(prefix, num_tokens, args.rounds, args.compile_only, args.quant, args.variants)


if __name__ == "__main__":
    main()
