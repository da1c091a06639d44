"""Debug (issue 13): how fast can a Gluon (explicit Hopper TMA + wgmma) prefill GEMM2 run?

    PYTHONPATH=src python3 scripts/debug/gluon_gemm2_probe.py [--shapes qwen3,deepseek,gptoss,mixtral]

The prefill targets need ~20 more points of the bf16 peak than the expert GEMMs' Triton tile loop
reaches (54-71% at T = 8192, docs/experts.md); a plain Triton 3.6 GEMM tops out near 570 TFLOP/s
on an H100 (`ws_probe.py`) while Triton's Gluon tutorials report ~670 for a pipelined wgmma
kernel. This probe writes GEMM2 of the prefill layer in Gluon, the half whose operands are both
TMA-able (the intermediate is sorted by expert and contiguous per M-block; w2 rows are K-major):
a persistent grid, one flat producer/consumer pipeline over each program's (tile, K step)
sequence so the next tile's loads are in flight during this tile's epilogue, wgmma from shared
memory with one MMA in flight, and the same epilogue as the library's GEMM2 (each row scaled by
its slot's routing weight and scattered to y[slot]; rows of slot -1 never stored). It times that
kernel at T = 8192 with uniform routing (T*K/E rows an expert, the bench shapes) against torch's
grouped_mm on the same rows, and checks its result against torch. The library's own GEMM2 time is
what `profile_padding.py SHAPE:8192` prints in the same call. A measurement script, not a test.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from safemoe.bench.harness import event_times_us

SHAPES = {
    "qwen3": (128, 8, 2048, 768),
    "deepseek": (256, 8, 7168, 2048),
    "gptoss": (128, 4, 2880, 2880),
    "mixtral": (8, 2, 4096, 14336),
}


@gluon.constexpr_function
def _warps_per_cta(block_m, num_warps):
    return [num_warps, 1] if block_m >= 16 * num_warps else [4, num_warps // 4]


@gluon.constexpr_function
def _instr_n(block_m, block_n, num_warps):
    m_reps = triton.cdiv(block_m, 16)
    n_reps = triton.cdiv(num_warps, m_reps)
    n = 256
    while n > max(block_n // n_reps, 8) or block_n % n != 0:
        n -= 8
    return n


@gluon.jit
def _tile_of(local, pid, nprog, num_m_blocks, num_n_blocks, GROUP_M: gl.constexpr):
    """(m_block, n_block) of this program's local-th tile, grouped GROUP_M M-blocks at a time."""
    tile = pid + local * nprog
    width = GROUP_M * num_n_blocks
    first_m = (tile // width) * GROUP_M
    size_m = gl.minimum(num_m_blocks - first_m, GROUP_M)
    return first_m + (tile % width) % size_m, (tile % width) // size_m


@gluon.jit
def _issue_loads(
    step,
    total,
    pid,
    nprog,
    num_m_blocks,
    num_n_blocks,
    k_steps,
    hidden,
    a_desc,
    b_desc,
    block_expert_ptr,
    bars,
    a_bufs,
    b_bufs,
    NUM_BUFFERS: gl.constexpr,
    GROUP_M: gl.constexpr,
):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    ok = step < total
    m_block, n_block = _tile_of(step // k_steps, pid, nprog, num_m_blocks, num_n_blocks, GROUP_M)
    expert = gl.load(block_expert_ptr + m_block, mask=ok, other=0)
    k = (step % k_steps) * BK
    buf = step % NUM_BUFFERS
    bar = bars.index(buf)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(a_desc, [m_block * BM, k], bar, a_bufs.index(buf), ok)
    tma.async_copy_global_to_shared(b_desc, [expert * hidden + n_block * BN, k], bar, b_bufs.index(buf), ok)


@gluon.jit
def _grouped_gemm2(
    a_desc,
    b_desc,
    block_expert_ptr,
    slots_ptr,
    weights_ptr,
    y_ptr,
    num_m_blocks,
    hidden,
    inter,
    GROUP_M: gl.constexpr,
    NUM_BUFFERS: gl.constexpr,
    STORE_BLOCKED: gl.constexpr,
    num_warps: gl.constexpr,
):
    """y[slot] = weight[slot] * (inter rows of each M-block) @ w2[block expert].T; a_desc: boxes
    [BM, BK] of the intermediate [rows, I], b_desc: boxes [BN, BK] of w2 seen as [E * H, I]."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    dtype: gl.constexpr = a_desc.dtype
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0],
        warps_per_cta=_warps_per_cta(BM, num_warps),
        instr_shape=[16, _instr_n(BM, BN, num_warps), 16],
    )
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    num_n_blocks = gl.cdiv(hidden, BN)
    k_steps = gl.cdiv(inter, BK)
    num_tiles = num_m_blocks * num_n_blocks
    my_tiles = gl.maximum(num_tiles - pid + nprog - 1, 0) // nprog
    total = my_tiles * k_steps

    a_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, BM, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, BN, BK], b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(bars.index(i), count=1)
    for s in gl.static_range(NUM_BUFFERS - 1):
        _issue_loads(s, total, pid, nprog, num_m_blocks, num_n_blocks, k_steps, hidden, a_desc, b_desc,
            block_expert_ptr, bars, a_bufs, b_bufs, NUM_BUFFERS, GROUP_M)  # fmt: skip

    acc = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
    for step in range(total):
        buf = step % NUM_BUFFERS
        mbarrier.wait(bars.index(buf), (step // NUM_BUFFERS) & 1)
        k = step % k_steps
        acc = warpgroup_mma(
            a_bufs.index(buf), b_bufs.index(buf).permute((1, 0)), acc, use_acc=k > 0, is_async=True
        )
        # one MMA in flight: the previous step's is done, so its buffer takes the next loads
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        _issue_loads(step + NUM_BUFFERS - 1, total, pid, nprog, num_m_blocks, num_n_blocks, k_steps, hidden,
            a_desc, b_desc, block_expert_ptr, bars, a_bufs, b_bufs, NUM_BUFFERS, GROUP_M)  # fmt: skip
        if k == k_steps - 1:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            m_block, n_block = _tile_of(step // k_steps, pid, nprog, num_m_blocks, num_n_blocks, GROUP_M)
            if STORE_BLOCKED:
                out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
            else:
                out_layout: gl.constexpr = mma_layout
            out = gl.convert_layout(acc.to(y_ptr.dtype.element_ty), out_layout)
            rows = m_block * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, out_layout))
            cols = n_block * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, out_layout))
            slots = gl.load(slots_ptr + rows)
            row_ok = slots >= 0
            weight = gl.load(weights_ptr + gl.where(row_ok, slots, 0), mask=row_ok, other=0.0)
            out = (out.to(gl.float32) * weight[:, None]).to(y_ptr.dtype.element_ty)
            ptrs = y_ptr + gl.where(row_ok, slots, 0).to(gl.int64)[:, None] * hidden + cols[None, :]
            gl.store(ptrs, out, mask=row_ok[:, None] & (cols < hidden)[None, :])
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.invalidate(bars.index(i))


def expected_gemm2(inter_rows: torch.Tensor, w2: torch.Tensor, slots: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:
    """y in fp32 for rows laid out E equal groups in expert order: y[slot] = weight * row @ w2[e].T."""
    experts, hidden, inter = w2.shape
    rows = (inter_rows.view(experts, -1, inter).float() @ w2.float().transpose(1, 2)).reshape(-1, hidden)
    expected_y = torch.empty_like(rows)
    expected_y[slots.long()] = rows * weights[slots.long(), None]
    return expected_y


def timed(fn, rounds: int = 25) -> float:
    """Median microseconds of a call (the bench's per-call CUDA-event timing)."""
    return statistics.median(event_times_us(fn, iters=rounds, warmup=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3,deepseek,gptoss,mixtral")
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    from safemoe.bench.harness import _measure_bf16_tflops
    from safemoe.peers import _grouped_mm_op

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    peak = _measure_bf16_tflops(torch.device("cuda"), 8192)
    print(
        f"{torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__}: "
        f"bf16 peak (torch.mm 8192^3) {peak:.0f} TFLOP/s",
        flush=True,
    )
    # (BM, BN, BK, buffers, warps, group_m, store through a blocked layout)
    configs = [
        (128, 256, 64, 3, 8, 8, True),
        (128, 256, 64, 4, 8, 8, False),
        (128, 256, 64, 3, 8, 8, False),
        (128, 128, 64, 4, 8, 8, True),
        (128, 128, 64, 5, 4, 8, True),
        (64, 256, 64, 4, 4, 8, True),
        (128, 256, 32, 6, 8, 8, False),
    ]
    for name in args.shapes.split(","):
        experts, top_k, hidden, inter = SHAPES[name]
        slots_total = args.tokens * top_k
        rows_per_expert = slots_total // experts
        g = torch.Generator(device="cuda").manual_seed(0)
        inter_rows = torch.randn(slots_total, inter, device="cuda", dtype=torch.bfloat16, generator=g)
        w2 = (
            torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16, generator=g)
            * inter**-0.5
        )
        # row r belongs to expert r // rows_per_expert; its slot is a permutation of the slots
        slots = torch.randperm(slots_total, device="cuda", generator=g).to(torch.int32)
        weights = torch.rand(slots_total, device="cuda", generator=g)
        flops = 2 * slots_total * hidden * inter
        offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * rows_per_expert

        grouped_mm = _grouped_mm_op()[0]

        def torch_grouped(inter_rows=inter_rows, w2=w2, offs=offs, grouped_mm=grouped_mm) -> None:
            grouped_mm(inter_rows, w2.transpose(1, 2), offs=offs)

        try:
            us = timed(torch_grouped)
            print(
                f"{name} GEMM2 T={args.tokens} ({slots_total} rows, N {hidden}, K {inter}): torch grouped_mm "
                f"{us:8.1f} us {flops / us / 1e6:6.0f} TFLOP/s ({flops / us / 1e6 / peak:5.1%} of peak)",
                flush=True,
            )
        except Exception as exc:
            print(f"{name}: torch grouped_mm failed: {type(exc).__name__}: {exc}"[:200], flush=True)
        expected_y = expected_gemm2(inter_rows, w2, slots, weights)
        y = torch.empty(slots_total, hidden, device="cuda", dtype=torch.bfloat16)
        for bm, bn, bk, buffers, warps, group_m, blocked in configs:
            if rows_per_expert % bm:
                continue
            num_m_blocks = slots_total // bm
            block_expert = (
                torch.arange(num_m_blocks, device="cuda", dtype=torch.int32) * bm
            ) // rows_per_expert
            a_layout = gl.NVMMASharedLayout.get_default_for([bm, bk], gl.bfloat16)
            b_layout = gl.NVMMASharedLayout.get_default_for([bn, bk], gl.bfloat16)
            a_desc = TensorDescriptor.from_tensor(inter_rows, [bm, bk], a_layout)
            b_desc = TensorDescriptor.from_tensor(w2.view(experts * hidden, inter), [bn, bk], b_layout)
            tiles = num_m_blocks * triton.cdiv(hidden, bn)
            store = " blocked-store" if blocked else ""
            label = f"BM {bm} BN {bn} BK {bk} buffers {buffers} warps {warps}{store}"
            for per_sm in (1,):
                grid = min(tiles, sms * per_sm)

                args_now = (a_desc, b_desc, block_expert, slots, weights, y, num_m_blocks, hidden, inter)

                def run(args_now=args_now, buffers=buffers, warps=warps, group_m=group_m, blocked=blocked,
                        grid=grid) -> None:  # fmt: skip
                    _grouped_gemm2[(grid,)](
                        *args_now,
                        GROUP_M=group_m,
                        NUM_BUFFERS=buffers,
                        STORE_BLOCKED=blocked,
                        num_warps=warps,
                    )

                try:
                    y.fill_(float("nan"))
                    run()
                    torch.cuda.synchronize()
                    err = ((y.float() - expected_y).norm() / expected_y.norm()).item()
                    us = timed(run)
                except Exception as exc:  # a probe: report and go on
                    print(f"  gluon {label}: {type(exc).__name__}: {exc}"[:400], flush=True)
                    continue
                print(
                    f"  gluon {label} {per_sm}/SM: {us:8.1f} us {flops / us / 1e6:6.0f} TFLOP/s "
                    f"({flops / us / 1e6 / peak:5.1%} of peak)"
                    + ("" if err < 1e-2 else f"  WRONG rel err {err:.3g}"),
                    flush=True,
                )
        del inter_rows, w2, expected_y, y
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
