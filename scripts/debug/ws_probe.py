"""Debug (issue 13, prefill lever): does Triton's warp specialisation (`tl.range(...,
warp_specialize=True)`) compile and pay on this Hopper GPU, for a plain bf16 GEMM whose A comes
through a tensor descriptor (as GEMM2's sorted intermediate could) or through gathered row
pointers (as GEMM1's x rows through sorted_slots must)? Prints TFLOP/s of each variant next to
torch.mm, and the error of anything that fails to compile. A measurement script, not a test.

    PYTHONPATH=src python3 scripts/debug/ws_probe.py
"""

from __future__ import annotations

import itertools
import traceback

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from safemoe.bench.harness import time_graph


@triton.jit
def _probe_kernel(a_ptr, a_desc, b_desc, c_ptr, rows_ptr, M, N, K,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GATHER_A: tl.constexpr, WS: tl.constexpr, STAGES: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    rows = tl.load(rows_ptr + offs_m).to(tl.int64)
    for k in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=STAGES, warp_specialize=WS):
        if GATHER_A:
            a = tl.load(a_ptr + rows[:, None] * K + (k * BLOCK_K + ks)[None, :])
        else:
            a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
        b = b_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
        acc = tl.dot(a, b.T, acc)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(c_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :], acc.to(tl.bfloat16))


CONFIGS = ((128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 4, 3))  # BM, BN, BK, warps, stages


def _probe_shape(m: int, n: int, k: int) -> None:
    a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
    c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    rows = torch.randperm(m, device="cuda", dtype=torch.int32)
    flops = 2 * m * n * k
    ref_us = time_graph(lambda j: torch.mm(a, b.T), calls_per_graph=5, replays=10)
    print(f"M={m} N={n} K={k}: torch.mm {flops / ref_us / 1e6:.0f} TFLOP/s ({ref_us:.0f} us)")
    gathered_ref = a[rows.long()].float() @ b.float().T
    for (bm, bn, bk, warps, stages), gather, ws in itertools.product(CONFIGS, (False, True), (False, True)):
        a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
        b_desc = TensorDescriptor.from_tensor(b, [bn, bk])
        rows_used = rows if gather else torch.arange(m, device="cuda", dtype=torch.int32)
        grid = (m // bm, n // bn)

        def step(j, a_desc=a_desc, b_desc=b_desc, rows_used=rows_used, bm=bm, bn=bn, bk=bk, warps=warps,
                 stages=stages, gather=gather, ws=ws, grid=grid):
            _probe_kernel[grid](a, a_desc, b_desc, c, rows_used, m, n, k, bm, bn, bk, gather, ws, stages,
                                num_warps=warps)
        name = f"  {bm}x{bn}x{bk} w{warps} s{stages} {'gather' if gather else 'desc  '} ws={int(ws)}"
        try:
            step(0)
            torch.cuda.synchronize()
            want = gathered_ref if gather else a.float() @ b.float().T
            err = ((c.float() - want).abs().max() / want.abs().max()).item()
            us = time_graph(step, calls_per_graph=5, replays=10)
            print(f"{name}: {flops / us / 1e6:6.0f} TFLOP/s ({us:.0f} us) max rel err {err:.1e}", flush=True)
        except Exception as exc:  # a probe reports what fails to compile
            first_line = str(exc).splitlines()[0][:200] if str(exc) else ""
            print(f"{name}: FAILED {type(exc).__name__}: {first_line}")
            traceback.print_exc(limit=1)


def main() -> None:
    torch.manual_seed(0)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    print(torch.cuda.get_device_name(), "triton", triton.__version__)
    for m, n, k in ((8192, 8192, 8192), (4096, 4096, 14336), (8192, 1536, 2048)):
        _probe_shape(m, n, k)


if __name__ == "__main__":
    main()
