"""Debug (issue 13): how much DRAM bandwidth the decode GEMMs' weight-tile order can get.

    PYTHONPATH=src python3 scripts/debug/tile_stream_probe.py [--mb 327] [--rounds 5]

Nsight Compute (scripts/debug/ncu_layer.sh, H200, Qwen3 T = 8) finds GEMM1 at 78% of DRAM peak
with its warps waiting on the TMA weight barrier: it is waiting for weight bytes while holding
~190 KB of loads in flight per SM. This probe streams the same number of bytes as that GEMM1
(--mb) with no math, in three orders: `rows` (every program reads whole 4 KB weight rows, the
streaming ceiling's order), `tiles` (a program reads [BN, BK] tiles of a row-major [R, 2048]
weight one K step after another, as the expert GEMMs do: BN rows x BK*2 bytes, rows 4 KB apart)
and `pretiled` (the same tiles stored contiguously, [R/BN, 2048/BK, BN, BK]: each K step one
contiguous BN*BK*2-byte block). If `tiles` sits near 78% and `pretiled` near `rows`, the loss is
the access pattern's DRAM efficiency and a pre-tiled weight layout is the lever. (H200,
2026-11-26: it is not; `tiles` and `pretiled` agree within 1% at <= 3.97 TB/s against the read
ceiling kernel's 4.33 on this buffer; log `bench/results/logs/tile_stream_probe_*`.) `slab`: one
program per [BN, 2048] slab, a non-persistent grid like the ceiling kernel's, the order a GEMV-like
tiny-M kernel would stream in (H200, 2026-11-27: 3.68-4.04 TB/s against the ceiling kernel's 4.40
on the buffer, no better than the tile order; `tile_stream_probe_slab_*`).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

from safemoe.bench.harness import event_times_us

K = 2048


@triton.jit
def _stream(w_ptr, out_ptr, n_tiles, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
            PRETILED: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    r = tl.arange(0, BN)[:, None]
    c = tl.arange(0, BK)[None, :]
    for t in range(pid, n_tiles, tl.num_programs(0)):
        for kk in tl.range(0, K // BK, num_stages=STAGES):
            if PRETILED:
                offs = ((t * (K // BK) + kk) * BN + r).to(tl.int64) * BK + c
            else:
                offs = (t * BN + r).to(tl.int64) * K + kk * BK + c
            acc += tl.load(w_ptr + offs).to(tl.float32)
    tl.store(out_ptr + pid * BN * BK + r * BK + c, acc)


@triton.jit
def _stream_slab(w_ptr, out_ptr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    """One program per [BN, K] slab (a non-persistent grid, as the read-ceiling kernel has): the
    GEMV-like order a tiny-M decode kernel could stream its weights in."""
    t = tl.program_id(0)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    r = tl.arange(0, BN)[:, None]
    c = tl.arange(0, BK)[None, :]
    for kk in tl.range(0, K // BK, num_stages=STAGES):
        acc += tl.load(w_ptr + (t * BN + r).to(tl.int64) * K + kk * BK + c).to(tl.float32)
    tl.store(out_ptr + t * BN + tl.arange(0, BN), tl.sum(acc, axis=1))


def timed(fn, rounds: int) -> float:
    """Median microseconds of a call (the bench's per-call CUDA-event timing)."""
    return statistics.median(event_times_us(fn, iters=rounds * 5, warmup=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=327.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = int(args.mb * 1e6 / (K * 2)) // 256 * 256
    w = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
    nbytes = w.numel() * 2
    print(f"{torch.cuda.get_device_name()}: {nbytes / 1e6:.0f} MB, {rows} rows of {K}")
    ceiling_us = timed(lambda: w.sum(dtype=torch.float32), args.rounds)
    print(f"torch sum (fp32 acc): {ceiling_us:.1f} us, {nbytes / ceiling_us / 1e3:.0f} GB/s")
    from safemoe.bench.harness import _measure_read_gbps

    best, each = _measure_read_gbps(w.device, nbytes)
    print(f"bench read ceiling (one 16 KB block a program, 8 warps): {best:.0f} GB/s {each}")
    # (BN, BK, stages, warps, programs per SM): the decode tiles' shapes with deep cp.async pipelines,
    # then shallow pipelines with more warps and programs (the ceiling kernel loads to registers)
    shapes = [(64, 128, 4, 4, (2, 4)), (32, 256, 4, 4, (2, 4)), (64, 64, 6, 4, (2, 4)),
              (128, 128, 3, 4, (2, 4)), (16, 512, 3, 4, (2, 4)), (32, 256, 1, 8, (8, 16)),
              (32, 256, 2, 8, (4, 8)),
              (16, 512, 1, 8, (8, 16)), (64, 128, 1, 4, (8, 16)), (32, 128, 2, 4, (8, 16))]
    for bn, bk, stages, warps, programs_list in shapes:
        for pretiled in (False, True) if stages > 2 and warps == 4 and bn == 64 else (False,):
            for programs in programs_list:
                grid = sms * programs
                out = torch.empty(grid * bn * bk, device="cuda", dtype=torch.float32)

                def run(bn=bn, bk=bk, stages=stages, warps=warps, pretiled=pretiled, grid=grid,
                        out=out) -> None:
                    _stream[(grid,)](w, out, rows // bn, K=K, BN=bn, BK=bk, PRETILED=pretiled,
                                     STAGES=stages, num_warps=warps)

                us = timed(run, args.rounds)
                order = "pretiled" if pretiled else "tiles   "
                print(f"{order} BN {bn:3d} BK {bk:3d} stages {stages} warps {warps} {programs:2d}/SM: "
                      f"{us:7.1f} us, {nbytes / us / 1e3:5.0f} GB/s", flush=True)
    # one slab a program (non-persistent)
    for bn, bk, stages, warps in ((16, 256, 1, 4), (16, 256, 2, 4), (8, 512, 1, 4), (32, 128, 3, 4),
                                  (16, 512, 1, 8), (64, 64, 4, 4)):
        slab_out = torch.empty(rows, device="cuda", dtype=torch.float32)

        def slabs(bn=bn, bk=bk, stages=stages, warps=warps, slab_out=slab_out) -> None:
            _stream_slab[(rows // bn,)](w, slab_out, K=K, BN=bn, BK=bk, STAGES=stages, num_warps=warps)

        try:
            us = timed(slabs, args.rounds)
        except Exception as exc:  # a probe: report and go on
            print(f"slab     BN {bn:3d} BK {bk:3d}: {type(exc).__name__}: {exc}"[:200])
            continue
        print(f"slab     BN {bn:3d} BK {bk:3d} stages {stages} warps {warps} one slab a program: "
              f"{us:7.1f} us, {nbytes / us / 1e3:5.0f} GB/s", flush=True)
    rows_out = torch.empty(sms * 4 * 1 * K, device="cuda", dtype=torch.float32)

    def whole_rows() -> None:
        _stream[(sms * 4,)](w, rows_out, rows, K=K, BN=1, BK=K, PRETILED=False, STAGES=1, num_warps=4)

    us = timed(whole_rows, args.rounds)
    print(f"rows     (a 4 KB row a step):        {us:7.1f} us, {nbytes / us / 1e3:5.0f} GB/s")


if __name__ == "__main__":
    main()
