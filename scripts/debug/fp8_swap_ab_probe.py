"""Debug (issue 13, fp8 decode): does a swapped product (weights as the MMA's M side) stream fp8
weights faster than the decode tile's [16 rows] x [K, N] product?

    PYTHONPATH=src python3 scripts/debug/fp8_swap_ab_probe.py

Sixteenth session (H200): `gemm_ptx_probe.py` found the library's fp8 decode GEMMs compile to
mma.sync on f16 after converting every fp8 operand (0 e4m3 MMAs, 64-256 cvt.e4m3): Triton 3.6
has no fp8 mma.sync on sm_90 and takes wgmma only where the product's M is >= 64, which a
16-row decode tile is not. Swapping the operands (out^T = W x^T: the tile's weight columns are
wgmma's M, its 16 rows its N) lets wgmma take the fp8 operands natively. This times, per variant,
a bare persistent tile loop over E experts' [N, K] weights against 16 rows an expert (no gather,
no dispatch), as GB/s of weights, with the PTX's wgmma / mma / cvt.e4m3 counts: bf16 plain,
fp8 plain, fp8 swapped. A probe, not the library's kernel.
"""

from __future__ import annotations

import re

import torch
import triton
import triton.language as tl

from safemoe.bench.harness import time_graph


@triton.jit
def _tiles_kernel(x_ptr, w_ptr, out_ptr, num_experts, N: tl.constexpr, K: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SWAP: tl.constexpr):
    num_n = N // BLOCK_N
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    for tile in range(tl.program_id(0), num_experts * num_n, tl.num_programs(0)):
        expert = tile // num_n
        n_block = tile % num_n
        a_ptrs = x_ptr + (expert * BLOCK_M + rows).to(tl.int64)[:, None] * K + ks[None, :]
        w_rows = (expert * N + n_block * BLOCK_N + cols).to(tl.int64)
        if SWAP:
            w_ptrs = w_ptr + w_rows[:, None] * K + ks[None, :]  # [BLOCK_N, BLOCK_K]
            acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            for _ in range(0, K // BLOCK_K):
                acc = tl.dot(tl.load(w_ptrs), tl.trans(tl.load(a_ptrs)), acc)
                a_ptrs += BLOCK_K
                w_ptrs += BLOCK_K
            out = tl.trans(acc)
        else:
            w_ptrs = w_ptr + w_rows[None, :] * K + ks[:, None]  # [BLOCK_K, BLOCK_N]
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for _ in range(0, K // BLOCK_K):
                acc = tl.dot(tl.load(a_ptrs), tl.load(w_ptrs), acc)
                a_ptrs += BLOCK_K
                w_ptrs += BLOCK_K
            out = acc
        o_rows = (expert * BLOCK_M + rows).to(tl.int64)
        o_ptrs = out_ptr + o_rows[:, None] * N + n_block * BLOCK_N + cols[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty))


def main() -> None:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(torch.cuda.get_device_name(dev), "triton", triton.__version__)
    # (name, E, N, K): Qwen3's GEMM1 (gate and up as 2I rows) and GEMM2, DeepSeek-V3's GEMM1
    shapes = [("qwen3 gemm1", 128, 1536, 2048), ("qwen3 gemm2", 128, 2048, 768),
              ("deepseek gemm1", 64, 4096, 7168)]
    variants = [  # (label, dtype, swap, block_n, block_k, warps, stages)
        ("bf16 plain 64x128", torch.bfloat16, False, 64, 128, 4, 4),
        ("fp8 plain 32x128", torch.float8_e4m3fn, False, 32, 128, 4, 6),
        ("fp8 plain 64x256", torch.float8_e4m3fn, False, 64, 256, 4, 4),
        ("fp8 swap 64x128", torch.float8_e4m3fn, True, 64, 128, 4, 6),
        ("fp8 swap 64x256", torch.float8_e4m3fn, True, 64, 256, 4, 4),
        ("fp8 swap 128x128", torch.float8_e4m3fn, True, 128, 128, 4, 4),
        ("fp8 swap 128x256", torch.float8_e4m3fn, True, 128, 256, 4, 3),
        ("fp8 swap 64x128 8w", torch.float8_e4m3fn, True, 64, 128, 8, 6),
    ]
    for name, num_experts, n, k in shapes:
        print(f"=== {name}: E={num_experts} N={n} K={k}, 16 rows an expert")
        w32 = torch.randn(num_experts * n, k, device=dev) * 0.05
        x32 = torch.randn(num_experts * 16, k, device=dev)
        ref = None
        for label, dtype, swap, bn, bk, warps, stages in variants:
            w, x = w32.to(dtype), x32.to(dtype)
            out = torch.empty(num_experts * 16, n, device=dev, dtype=torch.bfloat16)
            grid = (min(4 * sms, num_experts * (n // bn)),)

            def run(w=w, x=x, out=out, e=num_experts, n=n, k=k, swap=swap, bn=bn, bk=bk, warps=warps,
                    stages=stages, grid=grid):
                return _tiles_kernel[grid](x, w, out, e, n, k, 16, bn, bk, swap,
                                           num_warps=warps, num_stages=stages)

            try:
                compiled = run()
                us = time_graph(lambda _: run())
            except Exception as exc:  # a variant that does not compile is reported, not fatal
                print(f"{label:22s} failed: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            ptx = compiled.asm.get("ptx", "")
            patterns = (("wgmma", r"wgmma\.mma_async"), ("mma", r"\bmma\.sync"),
                        ("cvt.e4m3", r"\bcvt\S*e4m3"))
            counts = {key: len(re.findall(pat, ptx)) for key, pat in patterns}
            check = (x.float().view(num_experts, 16, k) @ w.float().view(num_experts, n, k).transpose(1, 2))
            err = (out.float().view(num_experts, 16, n) - check).abs().max().item() / check.abs().max().item()
            ref = ref or us
            gbs = w.numel() * w.element_size() / us / 1e3
            print(f"{label:22s} {us:8.1f} us  {gbs:7.0f} GB/s  rel err {err:.1e}  "
                  + " ".join(f"{a} {b}" for a, b in counts.items()))


if __name__ == "__main__":
    main()
