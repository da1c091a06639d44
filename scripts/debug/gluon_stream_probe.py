"""Debug (issue 13): can a warp-specialised TMA producer stream decode-sized weights faster than a
Triton tile loop?

    PYTHONPATH=src:scripts/debug python3 scripts/debug/gluon_stream_probe.py [--mb 327] [--rounds 5]

The eighth session found every order a Triton loop can express (tile loop, swap-AB, one slab a
program, pointers or TMA) at <= ~92% of the bench's read ceiling kernel on the ~330 MB a Qwen3
decode GEMM1 streams (tile_stream_probe.py), and named a Gluon kernel with a producer warp issuing
TMA far ahead as the remaining streaming engine. This probe measures that engine before anything
is built on it: the same row-major [R, 2048] bf16 buffer, read as [BN, BK] boxes one K step after
another (the GEMMs' order) by a one-warp producer partition into a ring of STAGES shared-memory
slots (ready/empty mbarriers, as kernels/experts_ws.py), consumed either by a partition that only
releases the slot (`stream`: the engine's ceiling) or by wgmma of the box against a constant
[XN, BK] activation tile held in shared memory (`mma`: a swap-AB decode GEMM's inner loop, weights
on the MMA's M side, XN token columns), on a persistent grid of P programs per SM. Beside it, in the
same process: the read ceiling kernel and torch's sum on the same buffer, and the best Triton tile
loop of tile_stream_probe.py. The mma rows are checked against torch (sum of each program's boxes
times x.T). A measurement script, not a test.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from safemoe.bench.harness import _measure_read_gbps, event_times_us

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
K = 2048


@gluon.jit
def _producer(desc, bufs, ready, empty, n_tiles, K: gl.constexpr, STAGES: gl.constexpr):
    BN: gl.constexpr = desc.block_type.shape[0]
    BK: gl.constexpr = desc.block_type.shape[1]
    count = 0
    for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        for k in range(K // BK):
            slot = count % STAGES
            mbarrier.wait(empty.index(slot), ((count // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), desc.block_type.nbytes)
            _tma_load(desc, [tile * BN, k * BK], ready.index(slot), bufs.index(slot))
            count += 1


@gluon.jit
def _release(
    bufs,
    ready,
    empty,
    x_smem,
    out_ptr,
    n_tiles,
    K: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    XN: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Consumer that only frees each slot once its bytes have landed: the stream's own ceiling."""
    count = 0
    for _tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        for _k in range(K // BK):
            slot = count % STAGES
            mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
            mbarrier.arrive(empty.index(slot), count=1)
            count += 1


@gluon.jit
def _mma(
    bufs,
    ready,
    empty,
    x_smem,
    out_ptr,
    n_tiles,
    K: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    XN: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Consumer that multiplies each [BN, BK] weight box by x[XN, BK].T (wgmma, one group in flight,
    a slot freed once the MMA reading it has retired): a swap-AB decode tile's inner loop."""
    BN: gl.constexpr = bufs.type.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, XN, 16]
    )
    acc = gl.zeros((BN, XN), dtype=gl.float32, layout=acc_layout)
    count = 0
    for _tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        for _k in range(K // BK):
            slot = count % STAGES
            mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
            acc = warpgroup_mma(bufs.index(slot), x_smem.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), count=1, pred=count > 0)
            count += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), count=1, pred=count > 0)
    r = gl.arange(0, BN, layout=gl.SliceLayout(1, acc_layout))
    c = gl.arange(0, XN, layout=gl.SliceLayout(0, acc_layout))
    gl.store(out_ptr + gl.program_id(0) * BN * XN + r[:, None] * XN + c[None, :], acc)


@gluon.jit
def _stream_kernel(
    desc,
    x_ptr,
    out_ptr,
    n_tiles,
    K: gl.constexpr,
    STAGES: gl.constexpr,
    XN: gl.constexpr,
    MMA: gl.constexpr,
    num_warps: gl.constexpr,
):
    BN: gl.constexpr = desc.block_type.shape[0]
    BK: gl.constexpr = desc.block_type.shape[1]
    bufs = gl.allocate_shared_memory(desc.dtype, [STAGES, BN, BK], desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    x_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    xr = gl.arange(0, XN, layout=gl.SliceLayout(1, x_layout))
    xc = gl.arange(0, BK, layout=gl.SliceLayout(0, x_layout))
    x = gl.load(x_ptr + xr[:, None] * BK + xc[None, :])
    x_smem = gl.allocate_shared_memory(
        desc.dtype, [XN, BK], gl.NVMMASharedLayout.get_default_for([XN, BK], desc.dtype), x
    )
    fence_async_shared()
    if MMA:
        gl.warp_specialize(
            [
                (_mma, (bufs, ready, empty, x_smem, out_ptr, n_tiles, K, BK, STAGES, XN, num_warps)),
                (_producer, (desc, bufs, ready, empty, n_tiles, K, STAGES)),
            ],
            [1],
            [40],
        )
    else:
        gl.warp_specialize(
            [
                (_release, (bufs, ready, empty, x_smem, out_ptr, n_tiles, K, BK, STAGES, XN, num_warps)),
                (_producer, (desc, bufs, ready, empty, n_tiles, K, STAGES)),
            ],
            [1],
            [40],
        )
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


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
    print(f"{torch.cuda.get_device_name()}: {nbytes / 1e6:.0f} MB, {rows} rows of {K}, {sms} SMs")
    best, each = _measure_read_gbps(w.device, nbytes)
    print(f"bench read ceiling kernel on this size: {best:.0f} GB/s {each}")
    us = timed(lambda: w.sum(dtype=torch.float32), args.rounds)
    print(f"torch sum: {us:.1f} us, {nbytes / us / 1e3:.0f} GB/s")
    from tile_stream_probe import _stream

    for programs in (2, 3):
        out = torch.empty(sms * programs * 64 * 128, device="cuda", dtype=torch.float32)
        us = timed(
            lambda out=out, programs=programs: _stream[(sms * programs,)](
                w, out, rows // 64, K=K, BN=64, BK=128, PRETILED=False, STAGES=4, num_warps=4
            ),
            args.rounds,
        )
        print(
            f"triton tile loop BN 64 BK 128 stages 4, {programs}/SM: {us:7.1f} us, "
            f"{nbytes / us / 1e3:5.0f} GB/s",
            flush=True,
        )
    # (BN, BK, STAGES, programs per SM); shared memory = STAGES * BN * BK * 2 bytes a program
    variants = [
        (128, 128, 6, 1),
        (128, 128, 4, 1),
        (64, 128, 8, 1),
        (64, 128, 12, 1),
        (256, 64, 6, 1),
        (128, 64, 12, 1),
        (64, 128, 4, 2),
        (64, 128, 6, 2),
        (128, 128, 3, 2),
        (64, 64, 6, 3),
        (64, 128, 3, 3),
        (64, 64, 4, 4),
    ]
    xn = 16
    x = torch.randn(xn, 128, device="cuda", dtype=torch.bfloat16)
    for bn, bk, stages, programs in variants:
        layout = gl.NVMMASharedLayout.get_default_for([bn, bk], gl.bfloat16)
        desc = TensorDescriptor.from_tensor(w, [bn, bk], layout)
        n_tiles = rows // bn
        grid = sms * programs
        out = torch.zeros(grid * bn * xn, device="cuda", dtype=torch.float32)
        xk = x[:, :bk].contiguous()
        for mma in (False, True):
            warps = 4

            def run(
                desc=desc, xk=xk, out=out, n_tiles=n_tiles, grid=grid, stages=stages, mma=mma, warps=warps
            ) -> None:
                _stream_kernel[(grid,)](
                    desc, xk, out, n_tiles, K=K, STAGES=stages, XN=xn, MMA=mma, num_warps=warps
                )

            try:
                us = timed(run, args.rounds)
            except Exception as exc:  # a probe: report and go on
                print(
                    f"gluon BN {bn} BK {bk} stages {stages} {programs}/SM mma={mma}: "
                    f"{type(exc).__name__}: {exc}"[:300],
                    flush=True,
                )
                continue
            note = ""
            if mma:
                tiles = w.view(n_tiles, bn, K // bk, bk).float().sum(2)  # [n_tiles, BN, BK]
                expect = torch.zeros(grid, bn, bk, device="cuda")
                owner = torch.arange(n_tiles, device="cuda") % grid
                expect.index_add_(0, owner, tiles)
                expect = expect @ xk.float().T
                got = out.view(grid, bn, xn)
                err = ((got - expect).abs().max() / expect.abs().max()).item()
                note = f"  max rel err {err:.1e}" + ("  WRONG" if err > 2e-2 else "")
            print(
                f"gluon {'mma   ' if mma else 'stream'} BN {bn:3d} BK {bk:3d} stages {stages:2d} "
                f"{programs}/SM "
                f"({stages * bn * bk * 2 // 1024} KB): {us:7.1f} us, {nbytes / us / 1e3:5.0f} GB/s{note}",
                flush=True,
            )


if __name__ == "__main__":
    main()
