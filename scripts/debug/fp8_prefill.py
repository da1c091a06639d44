"""fp8 prefill tiles and the block-mode scale promotion, timed on a GPU (issue 13's fp8 targets).

    PYTHONPATH=src python scripts/debug/fp8_prefill.py [--out FILE.json] [--shapes qwen3,deepseek]
                                                       [--tokens 8192] [--budget-s 480] [--wide]
                                                       [--decode --tokens 8,64,256]

For each shape and T: `experts_triton` with the default configs in bf16, fp8 per-tensor and fp8
block mode (workspace, device num_valid, CUDA-graph replay over 4 rotating routings;
`safemoe.bench.harness.time_graph`), then candidate prefill tiles of each fp8 mode. Block mode's
default tiles also run forced to the per-column promotion (QUANT 2) that the one-scale-per-tile
promotion (QUANT 3/4) replaced; the two must agree bitwise (the same products in the same order),
which the script checks. --wide: a second block-mode candidate list; --decode: decode tiles. For every
compiled GEMM it also prints registers, spills, shared memory and, from the TTGIR, how many
warp-group MMAs were made asynchronous: the question is whether the block-mode promotion
serialises the MMAs. A measurement script, not a test; it prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from dataclasses import replace

import torch

from safemoe._checks import NumValid, check_fp8_weights
from safemoe.bench.experts import Inputs, timing_args
from safemoe.bench.harness import distinct_experts, time_graph
from safemoe.configs import ExpertsConfig, GemmTiles
from safemoe.fp8 import quantize_experts
from safemoe.kernels import experts as ex
from safemoe.workspace import Workspace

SHAPES = {  # E, K, H, I, activation
    "qwen3": (128, 8, 2048, 768, "silu"),
    "deepseek": (256, 8, 7168, 2048, "silu"),
    "gptoss": (128, 4, 2880, 2880, "swigluoai"),
}
VARIANTS = 4


def _cfg(block_m: int, g1: tuple, g2: tuple, pps: int) -> ExpertsConfig:
    def tiles(t: tuple) -> GemmTiles:
        block_n, block_k, group_m, warps, stages, tma = t
        return GemmTiles(block_n=block_n, block_k=block_k, group_m=group_m, num_warps=warps,
                         num_stages=stages, tma=tma)
    return ExpertsConfig(block_m=block_m, gemm1=tiles(g1), gemm2=tiles(g2), programs_per_sm=pps, few=False)


# (name, config): BLOCK_K 128 throughout (128 bytes of fp8 a row; block mode's scale group).
# Run 1 (H200, 2026-11-26) timed the first six against the tiles before it; the rest (--wide)
# look around its winners: 128-column GEMM1 tiles with TMA, and two 4-warp programs per SM.
BLOCK_CANDIDATES = [
    ("g1n64-s4", _cfg(128, (64, 128, 8, 8, 4, False), (128, 128, 8, 8, 4, False), 1)),
    ("g1n64-s4-tma", _cfg(128, (64, 128, 8, 8, 4, True), (128, 128, 8, 8, 4, True), 1)),
    ("g1n128-s3-tma", _cfg(128, (128, 128, 8, 8, 3, True), (128, 128, 8, 8, 4, True), 1)),
    ("bm64-w4-pps2-tma", _cfg(64, (64, 128, 8, 4, 4, True), (128, 128, 8, 4, 4, True), 2)),
    ("bm128-s3-pps2-tma", _cfg(128, (64, 128, 8, 8, 3, True), (128, 128, 8, 8, 3, True), 2)),
    ("bm64-n128-w4-pps2-tma", _cfg(64, (128, 128, 8, 4, 3, True), (128, 128, 8, 4, 3, True), 2)),
]
WIDE_BLOCK_CANDIDATES = [
    # GEMM2 256 columns wide as two 128-column halves (QUANT 4). Run 3's --wide list (eleven
    # variations of stages, warps, programs per SM, group_m and TMA around the run 1 winners) found
    # nothing faster than the default (fp8_prefill3.json of bench/results/logs).
    ("g2n256-s3-tma", _cfg(128, (128, 128, 8, 8, 3, True), (256, 128, 8, 8, 3, True), 1)),
    ("g2n256-s4-tma", _cfg(128, (128, 128, 8, 8, 3, True), (256, 128, 8, 8, 4, True), 1)),
    ("g2n256-s3", _cfg(128, (128, 128, 8, 8, 3, True), (256, 128, 8, 8, 3, False), 1)),
    ("g2n256-gm16-s3-tma", _cfg(128, (128, 128, 16, 8, 3, True), (256, 128, 16, 8, 3, True), 1)),
    ("bm64-g2n256-pps2-tma", _cfg(64, (128, 128, 8, 4, 3, True), (256, 128, 8, 4, 3, True), 2)),
]
# Decode (--decode: T = 8, 64, 256), both modes; per-tensor may step 256 wide.
BOTH = ("per_tensor", "block")
DECODE_CANDIDATES = [
    ("bm16-s6-tma", _cfg(16, (32, 128, 1, 4, 6, True), (64, 128, 1, 4, 6, True), 4), BOTH),
    ("bm16-s4-tma", _cfg(16, (32, 128, 1, 4, 4, True), (64, 128, 1, 4, 4, True), 4), BOTH),
    ("bm16-n64-s6", _cfg(16, (64, 128, 1, 4, 6, False), (128, 128, 1, 4, 6, False), 4), BOTH),
    ("bm16-s8", _cfg(16, (32, 128, 1, 4, 8, False), (64, 128, 1, 4, 8, False), 4), BOTH),
    ("bm32-n64-s4", _cfg(32, (64, 128, 4, 4, 4, False), (128, 128, 4, 4, 4, False), 4), BOTH),
    ("bm32-n128-w8-s3", _cfg(32, (128, 128, 4, 8, 3, False), (128, 128, 4, 8, 3, False), 4),
     BOTH),
    ("bm16-k256-s4", _cfg(16, (32, 256, 1, 4, 4, False), (64, 256, 1, 4, 4, False), 4), ("per_tensor",)),
    ("bm16-k256-s4-tma", _cfg(16, (32, 256, 1, 4, 4, True), (64, 256, 1, 4, 4, True), 4), ("per_tensor",)),
]
PER_TENSOR_CANDIDATES = [
    ("n128-tma", _cfg(128, (128, 128, 8, 8, 3, True), (128, 128, 8, 8, 4, True), 1)),
    ("g2n256-tma", _cfg(128, (128, 128, 8, 8, 3, True), (256, 128, 8, 8, 3, True), 1)),
    ("g1s4-g2n256-tma", _cfg(128, (128, 128, 8, 8, 4, True), (256, 128, 8, 8, 3, True), 1)),
]

_compiled: dict[str, dict] = {}


def _record_compiles() -> None:
    """Keep registers, spills, shared memory and the async-MMA count of each GEMM launch."""
    for name in ("_gemm1_kernel", "_gemm2_kernel"):
        fn = getattr(ex, name)
        run = fn.run

        def wrapped(*args, _run=run, _name=name, **kwargs):
            kernel = _run(*args, **kwargs)
            try:
                ttgir = kernel.asm.get("ttgir", "")
                info = {
                    "regs": getattr(kernel, "n_regs", None), "spills": getattr(kernel, "n_spills", None),
                    "shared": getattr(kernel.metadata, "shared", None),
                    "dots": len(re.findall(r"warp_group_dot ", ttgir)),
                    "async_dots": len(re.findall(r"warp_group_dot .*isAsync = true", ttgir)),
                    "dot_waits": re.findall(r"warp_group_dot_wait .*pendings = (\d+)", ttgir),
                }
                _compiled[_name] = info
            except Exception as exc:  # diagnostics only
                _compiled[_name] = {"error": repr(exc)}
            return kernel

        fn.run = wrapped


class _ForceQuant2:
    """With `on`, block mode with the per-column promotion the one-scale-per-tile one replaced."""

    def __init__(self, on: bool) -> None:
        self.on = on

    def __enter__(self):
        self.saved = ex.Fp8Operands.code
        original = self.saved
        if self.on:
            ex.Fp8Operands.code = lambda op, tiles, **kwargs: min(original(op, tiles, **kwargs), 2)

    def __exit__(self, *exc):
        ex.Fp8Operands.code = self.saved


def _case(shape_name: str, num_tokens: int, w13: torch.Tensor, w2: torch.Tensor, fp8: dict,
          rows: list[dict], deadline: float, wide: bool = False, decode: bool = False) -> None:
    """Every variant of one (shape, T)."""
    device = w13.device
    num_experts, top_k, hidden, inter, activation = shape = SHAPES[shape_name]
    inputs = Inputs(shape, num_tokens, device, seed=num_tokens)
    ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16, device, fp8=True)
    nv = NumValid(None, torch.tensor(num_tokens, device=device, dtype=torch.int32))
    outs = [torch.empty_like(x) for x in inputs.xs]
    flops = 2 * num_tokens * top_k * 3 * hidden * inter
    head = f"{shape_name:9} {num_tokens:6}"

    def run(mode: str | None, config: ExpertsConfig | None, label: str, force2: bool = False,
            want_us: bool = False):
        if time.time() > deadline:
            print(f"{head} {label:32} skipped (budget)", flush=True)
            return None
        w_13, w_2, weights = (w13, w2, None) if mode is None else fp8[mode]

        def step(j: int) -> None:
            ex.experts_triton(inputs.xs[j], w_13, w_2, inputs.weights[j], inputs.ids[j],
                              activation=activation, num_valid=nv, health=None, workspace=ws, out=outs[j],
                              config=config, fp8=weights)
        try:
            with _ForceQuant2(force2):
                us = time_graph(step, n_variants=VARIANTS, **timing_args(3000.0))
                step(0)
            torch.cuda.synchronize()
        except Exception as exc:  # keep going: record the failure
            print(f"{head} {label:32} FAILED {type(exc).__name__}: {exc}"[:300], flush=True)
            rows.append({"shape": shape_name, "tokens": num_tokens, "label": label, "error": repr(exc)})
            return None
        row = {"shape": shape_name, "tokens": num_tokens, "label": label, "us": round(us, 1),
               "tflops": round(flops / us / 1e6, 1), "compiled": json.loads(json.dumps(_compiled))}
        rows.append(row)
        g1, g2 = _compiled.get("_gemm1_kernel", {}), _compiled.get("_gemm2_kernel", {})
        print(f"{head} {label:32} {us:9.1f} us {row['tflops']:6.1f} TFLOP/s  "
              f"g1 regs {g1.get('regs')} spills {g1.get('spills')} async {g1.get('async_dots')}/"
              f"{g1.get('dots')} waits {g1.get('dot_waits')}  g2 regs {g2.get('regs')} spills "
              f"{g2.get('spills')} async {g2.get('async_dots')}/{g2.get('dots')} waits "
              f"{g2.get('dot_waits')}", flush=True)
        return us if want_us else outs[0].clone()

    if decode:
        read_bytes = distinct_experts(num_experts, top_k, num_tokens) * 3 * hidden * inter  # fp8 weights
        for mode in ("per_tensor", "block"):
            us_default = run(mode, None, f"{mode} default", want_us=True)
            if us_default:
                print(f"{head}   -> {read_bytes / us_default / 1e3:.0f} GB/s of fp8 weights", flush=True)
            for label, cfg, modes in DECODE_CANDIDATES:
                if mode in modes:  # with PDL, as the heuristic's decode tiles run
                    us = run(mode, replace(cfg, pdl=True), f"{mode} {label}", want_us=True)
                    if us:
                        print(f"{head}   -> {read_bytes / us / 1e3:.0f} GB/s of fp8 weights", flush=True)
        return
    bf16 = run(None, None, "bf16 default")
    block = run("block", None, "block default (QUANT 3)")
    if bf16 is not None and block is not None:
        rel = ((block.float() - bf16.float()).norm() / bf16.float().norm()).item()
        print(f"{head} block vs bf16 rel. error {rel:.4f}", flush=True)
        if not math.isfinite(rel) or rel > 0.1:
            print("  ^ too large: fp8 block result is wrong", flush=True)
    if wide:
        for label, cfg in WIDE_BLOCK_CANDIDATES:
            run("block", cfg, f"block {label}")
        return
    run("per_tensor", None, "per_tensor default")
    block2 = run("block", None, "block default forced QUANT 2", force2=True)
    if block is not None and block2 is not None:
        same = torch.equal(block, block2)
        print(f"{head} QUANT 3 vs 2 bitwise equal: {same}", flush=True)
        rows.append({"shape": shape_name, "tokens": num_tokens, "quant3_equals_quant2": same})
    for label, cfg in BLOCK_CANDIDATES:
        run("block", cfg, f"block {label}")
    for label, cfg in PER_TENSOR_CANDIDATES:
        run("per_tensor", cfg, f"per_tensor {label}")

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--shapes", default="qwen3,deepseek")
    parser.add_argument("--tokens", default="8192")
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--wide", action="store_true", help="block mode only: the wider candidate list")
    parser.add_argument("--decode", action="store_true",
                        help="decode tiles of both modes (use --tokens 8,64,256)")
    args = parser.parse_args()
    deadline = time.time() + args.budget_s
    _record_compiles()
    rows: list[dict] = []
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}; us per experts_triton call (median, graph replay)", flush=True)
    for shape_name in args.shapes.split(","):
        num_experts, _, hidden, inter, _ = SHAPES[shape_name]
        gen = torch.Generator(device=device).manual_seed(0)
        w13 = torch.randn(num_experts, 2 * inter, hidden, device=device, dtype=torch.bfloat16, generator=gen)
        w13.mul_(hidden**-0.5)
        w2 = torch.randn(num_experts, hidden, inter, device=device, dtype=torch.bfloat16, generator=gen)
        w2.mul_(inter**-0.5)
        fp8 = {}
        for mode in ("per_tensor", "block"):
            q13, q2, s13, s2 = quantize_experts(w13, w2, mode)
            fp8[mode] = (q13, q2, check_fp8_weights(q13, q2, s13, s2))
        for num_tokens in (int(t) for t in args.tokens.split(",")):
            _case(shape_name, num_tokens, w13, w2, fp8, rows, deadline, args.wide, args.decode)
            torch.cuda.empty_cache()
        del w13, w2, fp8
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
