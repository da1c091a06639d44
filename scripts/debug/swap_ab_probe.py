"""Debug (issue 13): does swap-AB feed the decode GEMMs' weight stream better than [BLOCK_M, N] tiles?

    PYTHONPATH=src python3 scripts/debug/swap_ab_probe.py [--experts 52] [--rounds 5] [--quick]

A decode GEMM1 tile has 1-16 real rows (BLOCK_M 16), so `tl.dot(a [16, BK], w.T [BK, BN])` runs
as Ampere-style mma.sync fed by ldmatrix from shared memory (wgmma needs 64 rows a warpgroup).
Swap-AB, a lever issue 13 names (as TensorRT-LLM's and vLLM's CUTLASS small-M paths do), puts
the weights on the M side instead: `tl.dot(w [BN, BK], a.T [BK, 16])`, a wgmma of BN rows by
16 columns, and transposes the [BN, 16] accumulator once at the store. This probe times
GEMM1-shaped work on the Qwen3-30B-A3B shape (H = 2048, 2I = 1536 weight rows an expert,
--experts experts hit, 16 activation rows each, bf16): both orientations, weights through
pointers or TMA, a persistent grid of 2 or 4 programs per SM or one tile a program. It reports
the weight bytes streamed per second against the bench's read ceiling on the same bytes, and
checks every variant's result against torch. A measurement script, not a test.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

from safemoe.bench.harness import event_times_us

H = 2048
ROWS_PER_EXPERT = 1536  # Qwen3-30B-A3B w13: gate and up, 2 x 768
BLOCK_M = 16


@triton.jit
def _gemm1_like(x_ptr, w_ptr, w_desc, out_ptr, n_tiles, num_n_blocks, H: tl.constexpr, N: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr, TMA: tl.constexpr,
                STAGES: tl.constexpr):
    """out[e * BM + m, n] = sum_k x[e * BM + m, k] w[e, n, k] over tiles (expert e, N-block)."""
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    ks = tl.arange(0, BK)
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        e = tile // num_n_blocks
        n0 = (tile % num_n_blocks) * BN
        a_ptrs = x_ptr + (e * BM + rm).to(tl.int64)[:, None] * H + ks[None, :]
        w_ptrs = w_ptr + e.to(tl.int64) * N * H + (n0 + rn).to(tl.int64)[:, None] * H + ks[None, :]
        if SWAP:
            acc = tl.zeros((BN, BM), dtype=tl.float32)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in tl.range(0, H // BK, num_stages=STAGES):
            a = tl.load(a_ptrs)
            if TMA:
                w = w_desc.load([e * N + n0, k * BK])
            else:
                w = tl.load(w_ptrs)
            if SWAP:
                acc = tl.dot(w, a.T, acc)
            else:
                acc = tl.dot(a, w.T, acc)
            a_ptrs += BK
            w_ptrs += BK
        if SWAP:
            result = acc.T
        else:
            result = acc
        out_ptrs = out_ptr + (e * BM + rm).to(tl.int64)[:, None] * N + (n0 + rn)[None, :]
        tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty))


def timed(fn, rounds: int) -> float:
    """Median microseconds of a call (the bench's per-call CUDA-event timing)."""
    return statistics.median(event_times_us(fn, iters=rounds * 10, warmup=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=52)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one grid per tile shape")
    args = parser.parse_args()
    from triton.tools.tensor_descriptor import TensorDescriptor

    from safemoe.bench.harness import _measure_read_gbps

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    experts = args.experts
    w = torch.randn(experts, ROWS_PER_EXPERT, H, device="cuda", dtype=torch.bfloat16) / 32
    x = torch.randn(experts * BLOCK_M, H, device="cuda", dtype=torch.bfloat16)
    expected = torch.bmm(x.view(experts, BLOCK_M, H).float(), w.float().transpose(1, 2))
    expected = expected.reshape(experts * BLOCK_M, ROWS_PER_EXPERT)
    nbytes = w.numel() * 2
    ceiling, each = _measure_read_gbps(w.device, nbytes)
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}: {experts} experts, "
          f"{nbytes / 1e6:.0f} MB of weights; read ceiling {ceiling:.0f} GB/s {each}", flush=True)
    w2d = w.view(experts * ROWS_PER_EXPERT, H)
    out = torch.empty(experts * BLOCK_M, ROWS_PER_EXPERT, device="cuda", dtype=torch.bfloat16)
    # (BN, BK, stages, warps): the decode entries' tiles and their neighbours
    shapes = [(64, 128, 4, 4), (64, 64, 6, 4), (64, 256, 3, 4), (128, 128, 3, 4), (128, 64, 4, 4),
              (32, 128, 4, 4), (128, 128, 3, 8)]
    grids = ((2, "2/SM"), (0, "1 tile a program")) if args.quick else ((2, "2/SM"), (4, "4/SM"),
                                                                       (0, "1 tile a program"))
    for bn, bk, stages, warps in shapes:
        desc = TensorDescriptor.from_tensor(w2d, [bn, bk])
        n_blocks = ROWS_PER_EXPERT // bn
        n_tiles = experts * n_blocks
        for swap in (False, True):
            for tma in (False, True):
                for per_sm, grid_name in grids:
                    grid = n_tiles if per_sm == 0 else min(n_tiles, sms * per_sm)

                    def run(bn=bn, bk=bk, stages=stages, warps=warps, swap=swap, tma=tma, grid=grid,
                            desc=desc, n_blocks=n_blocks, n_tiles=n_tiles) -> None:
                        _gemm1_like[(grid,)](x, w2d, desc, out, n_tiles, n_blocks, H=H, N=ROWS_PER_EXPERT,
                                             BM=BLOCK_M, BN=bn, BK=bk, SWAP=swap, TMA=tma, STAGES=stages,
                                             num_warps=warps)

                    name = (f"BN {bn:3d} BK {bk:3d} s{stages} w{warps} {'swap  ' if swap else 'normal'} "
                            f"{'tma ' if tma else 'ptrs'} {grid_name:>16}")
                    try:
                        out.fill_(float("nan"))
                        us = timed(run, args.rounds)
                    except Exception as exc:  # a probe: report and go on
                        print(f"{name}: {type(exc).__name__}: {exc}"[:220], flush=True)
                        continue
                    err = ((out.float() - expected).norm() / expected.norm()).item()
                    gbps = nbytes / us / 1e3
                    print(f"{name}: {us:7.1f} us {gbps:5.0f} GB/s ({gbps / ceiling:5.1%} of ceiling)"
                          f"{'' if err < 1e-2 else f'  WRONG: rel err {err:.3g}'}", flush=True)


if __name__ == "__main__":
    main()
