"""Debug (issue 13): warp-specialised swap-AB Gluon GEMMs on the decode layout, against the library's.

    PYTHONPATH=src:scripts/debug python3 scripts/debug/gluon_decode_probe.py [--tokens 8,64,256]

gluon_stream_probe.py (H200, 2026-11-27) streamed the ~330 MB of a Qwen3 decode GEMM1 at 4.35 TB/s
through a one-warp TMA producer and a ring of mbarrier slots (99% of the read ceiling kernel on the
same bytes) and at 4.22 TB/s with a wgmma consuming every box, against 4.04 for the best Triton
tile loop. This probe builds the two decode GEMMs on that engine over the library's own dispatch
layout (BLOCK_M-row M-blocks of sorted positions, BLOCK_M = the bucket's, 16 or 32) and times them
beside the library's Triton GEMMs on the same layout:

- GEMM1: a producer partition gathers the M-block's x rows (x[slot // K], -1 rows zero-filled) with
  cp.async and loads the expert's gate and up boxes ([BN, BK] of w13 seen as [E * 2I, H]) with TMA;
  the MMA warpgroup multiplies each weight box by the rows (swap-AB: weights on the wgmma's M side,
  the M-block's positions on its N side, so a 16-row block costs a 16-wide MMA), and the epilogue
  stores silu(gate) * up, transposed, at the intermediate's rows.
- GEMM2: the producer loads the M-block's intermediate rows and a [BN, BK] box of w2 (seen as
  [E * H, I]) with TMA; the epilogue scales each position's column by its slot's routing weight and
  stores it at y[slot].

Both results are checked against the library's intermediate / y on the same layout (WRONG where they
differ). The library's GEMMs are timed from a profiler trace of `experts_triton` with the bucket's
tiles and PDL off (so a kernel's time is its own, not a wait on the previous one). A measurement
script, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from safemoe.bench.harness import event_times_us
from safemoe.kernels.experts_ws import _coords

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

SHAPES = {
    "qwen3": (128, 8, 2048, 768),
    "gpt-oss": (128, 4, 2880, 2880),
    "mixtral": (8, 2, 4096, 14336),
    "deepseek": (256, 8, 7168, 2048),
}


@gluon.jit
def _expert_of(block_end, m_block):
    return gl.sum((block_end <= m_block).to(gl.int32), axis=0)


@gluon.jit
def _gemm1_producer(
    x_ptr,
    w_desc,
    slots_ptr,
    block_end_ptr,
    x_bufs,
    gate_bufs,
    up_bufs,
    ready,
    empty,
    num_m_blocks,
    hidden,
    inter,
    num_experts,
    TOP_K: gl.constexpr,
    NUM_BINS: gl.constexpr,
    BM: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    WARPS: gl.constexpr,
):
    BN: gl.constexpr = w_desc.block_type.shape[0]
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BK, BK // 8], [WARPS, 1], [1, 0])
    bins = gl.arange(0, NUM_BINS, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    block_end = gl.load(block_end_ptr + bins, mask=bins < num_experts, other=2147483647)
    num_n_blocks = gl.cdiv(inter, BN)
    k_steps = gl.cdiv(hidden, BK)
    ks = gl.arange(0, BK, layout=gl.SliceLayout(0, rows_layout))
    count = 0
    for tile in range(gl.program_id(0), num_m_blocks * num_n_blocks, gl.num_programs(0)):
        m_block, n_block = _coords(tile, num_m_blocks, num_n_blocks, 1)
        gate_row = _expert_of(block_end, m_block) * 2 * inter + n_block * BN
        slots = gl.load(slots_ptr + m_block * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, rows_layout)))
        row_offsets = (gl.maximum(slots, 0) // TOP_K).to(gl.int64) * hidden
        for k in range(k_steps):
            slot = count % STAGES
            mbarrier.wait(empty.index(slot), ((count // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            cols = k * BK + ks
            _cp_async(
                x_bufs.index(slot),
                x_ptr + row_offsets[:, None] + cols[None, :],
                mask=(slots >= 0)[:, None] & (cols < hidden)[None, :],
            )
            async_copy.mbarrier_arrive(bar, increment_count=False)
            mbarrier.expect(bar, 2 * w_desc.block_type.nbytes)
            _tma_load(w_desc, [gate_row, k * BK], bar, gate_bufs.index(slot))
            _tma_load(w_desc, [gate_row + inter, k * BK], bar, up_bufs.index(slot))
            count += 1


@gluon.jit
def _gemm1_tile(
    x_bufs,
    gate_bufs,
    up_bufs,
    ready,
    empty,
    slots_ptr,
    inter_ptr,
    m_block,
    n_block,
    count,
    k_steps,
    inter,
    BM: gl.constexpr,
    N: gl.constexpr,
    BN: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """One tile over the first N positions of the M-block (N = BM, or BM // 2 when the block's
    used rows fit: the MMA then multiplies half as many columns)."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, N, 16]
    )
    gate = gl.zeros((BN, N), dtype=gl.float32, layout=acc_layout)
    up = gl.zeros((BN, N), dtype=gl.float32, layout=acc_layout)
    for k in range(k_steps):
        slot = count % STAGES
        mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
        fence_async_shared()  # the cp.async rows are generic-proxy writes; wgmma reads async
        rows_t = x_bufs.index(slot).slice(0, N, dim=0).permute((1, 0))
        gate = warpgroup_mma(gate_bufs.index(slot), rows_t, gate, use_acc=k > 0, is_async=True)
        up = warpgroup_mma(up_bufs.index(slot), rows_t, up, use_acc=k > 0, is_async=True)
        gate, up = warpgroup_mma_wait(num_outstanding=2, deps=(gate, up))
        mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), count=1, pred=k > 0)
        count += 1
    gate, up = warpgroup_mma_wait(num_outstanding=0, deps=(gate, up))
    mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), count=1)
    h = gate / (1.0 + gl.exp(-gate)) * up
    positions = m_block * BM + gl.arange(0, N, layout=gl.SliceLayout(0, acc_layout))
    cols = n_block * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_layout))
    slots = gl.load(slots_ptr + positions)
    ptrs = inter_ptr + positions.to(gl.int64)[None, :] * inter + cols[:, None]
    gl.store(ptrs, h.to(inter_ptr.dtype.element_ty), mask=(slots >= 0)[None, :] & (cols < inter)[:, None])
    return count


@gluon.jit
def _used_rows(slots_ptr, m_block, BM: gl.constexpr, num_warps: gl.constexpr):
    """Positions of the M-block holding a slot (dispatch packs them at the block's front)."""
    offs = gl.arange(0, BM, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
    return gl.sum((gl.load(slots_ptr + m_block * BM + offs) >= 0).to(gl.int32), axis=0)


@gluon.jit
def _gemm1_mma(
    x_bufs,
    gate_bufs,
    up_bufs,
    ready,
    empty,
    slots_ptr,
    inter_ptr,
    num_m_blocks,
    hidden,
    inter,
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    HALF_N: gl.constexpr,
    num_warps: gl.constexpr,
):
    num_n_blocks = gl.cdiv(inter, BN)
    k_steps = gl.cdiv(hidden, BK)
    count = 0
    for tile in range(gl.program_id(0), num_m_blocks * num_n_blocks, gl.num_programs(0)):
        m_block, n_block = _coords(tile, num_m_blocks, num_n_blocks, 1)
        # HALF_N: a block whose used rows fit in its first half runs a half-width MMA
        if HALF_N and _used_rows(slots_ptr, m_block, BM, num_warps) <= BM // 2:
            count = _gemm1_tile(x_bufs, gate_bufs, up_bufs, ready, empty, slots_ptr, inter_ptr, m_block,
                                n_block, count, k_steps, inter, BM, BM // 2, BN, STAGES, num_warps)
        else:
            count = _gemm1_tile(x_bufs, gate_bufs, up_bufs, ready, empty, slots_ptr, inter_ptr, m_block,
                                n_block, count, k_steps, inter, BM, BM, BN, STAGES, num_warps)


@gluon.jit
def _gemm1_decode(
    x_ptr,
    w_desc,
    slots_ptr,
    block_end_ptr,
    num_blocks_ptr,
    inter_ptr,
    hidden,
    inter,
    num_experts,
    TOP_K: gl.constexpr,
    NUM_BINS: gl.constexpr,
    BM: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    HALF_N: gl.constexpr,
    num_warps: gl.constexpr,
):
    BN: gl.constexpr = w_desc.block_type.shape[0]
    num_m_blocks = gl.load(num_blocks_ptr)
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], w_desc.dtype)
    x_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BM, BK], x_layout)
    gate_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    up_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(
            ready.index(i), count=1 + 32 * PRODUCER_WARPS
        )  # expect-tx + one cp.async arrive a thread
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize(
        [
            (
                _gemm1_mma,
                (
                    x_bufs,
                    gate_bufs,
                    up_bufs,
                    ready,
                    empty,
                    slots_ptr,
                    inter_ptr,
                    num_m_blocks,
                    hidden,
                    inter,
                    BM,
                    BN,
                    BK,
                    STAGES,
                    HALF_N,
                    num_warps,
                ),
            ),
            (
                _gemm1_producer,
                (
                    x_ptr,
                    w_desc,
                    slots_ptr,
                    block_end_ptr,
                    x_bufs,
                    gate_bufs,
                    up_bufs,
                    ready,
                    empty,
                    num_m_blocks,
                    hidden,
                    inter,
                    num_experts,
                    TOP_K,
                    NUM_BINS,
                    BM,
                    BK,
                    STAGES,
                    PRODUCER_WARPS,
                ),
            ),
        ],
        [PRODUCER_WARPS],
        [PRODUCER_REGS],
    )
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


@gluon.jit
def _gemm2_producer(
    a_desc,
    w_desc,
    block_end_ptr,
    a_bufs,
    w_bufs,
    ready,
    empty,
    num_m_blocks,
    hidden,
    inter,
    num_experts,
    NUM_BINS: gl.constexpr,
    STAGES: gl.constexpr,
):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    bins = gl.arange(0, NUM_BINS, layout=gl.BlockedLayout([1], [32], [1], [0]))
    block_end = gl.load(block_end_ptr + bins, mask=bins < num_experts, other=2147483647)
    num_n_blocks = gl.cdiv(hidden, BN)
    k_steps = gl.cdiv(inter, BK)
    count = 0
    for tile in range(gl.program_id(0), num_m_blocks * num_n_blocks, gl.num_programs(0)):
        m_block, n_block = _coords(tile, num_m_blocks, num_n_blocks, 1)
        w_row = _expert_of(block_end, m_block) * hidden + n_block * BN
        for k in range(k_steps):
            slot = count % STAGES
            mbarrier.wait(empty.index(slot), ((count // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes)
            _tma_load(a_desc, [m_block * BM, k * BK], bar, a_bufs.index(slot))
            _tma_load(w_desc, [w_row, k * BK], bar, w_bufs.index(slot))
            count += 1


@gluon.jit
def _gemm2_tile(
    a_bufs,
    w_bufs,
    ready,
    empty,
    slots_ptr,
    weights_ptr,
    y_ptr,
    m_block,
    n_block,
    count,
    k_steps,
    hidden,
    BM: gl.constexpr,
    N: gl.constexpr,
    BN: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, N, 16]
    )
    acc = gl.zeros((BN, N), dtype=gl.float32, layout=acc_layout)
    for k in range(k_steps):
        slot = count % STAGES
        mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
        acc = warpgroup_mma(
            w_bufs.index(slot),
            a_bufs.index(slot).slice(0, N, dim=0).permute((1, 0)),
            acc,
            use_acc=k > 0,
            is_async=True,
        )
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), count=1, pred=k > 0)
        count += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), count=1)
    positions = m_block * BM + gl.arange(0, N, layout=gl.SliceLayout(0, acc_layout))
    cols = n_block * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_layout))
    slots = gl.load(slots_ptr + positions)
    weight = gl.load(weights_ptr + gl.maximum(slots, 0), mask=slots >= 0, other=0.0)
    out = (acc * weight[None, :]).to(y_ptr.dtype.element_ty)
    ptrs = y_ptr + gl.maximum(slots, 0).to(gl.int64)[None, :] * hidden + cols[:, None]
    gl.store(ptrs, out, mask=(slots >= 0)[None, :] & (cols < hidden)[:, None])
    return count


@gluon.jit
def _gemm2_mma(
    a_bufs,
    w_bufs,
    ready,
    empty,
    slots_ptr,
    weights_ptr,
    y_ptr,
    num_m_blocks,
    hidden,
    inter,
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    HALF_N: gl.constexpr,
    num_warps: gl.constexpr,
):
    num_n_blocks = gl.cdiv(hidden, BN)
    k_steps = gl.cdiv(inter, BK)
    count = 0
    for tile in range(gl.program_id(0), num_m_blocks * num_n_blocks, gl.num_programs(0)):
        m_block, n_block = _coords(tile, num_m_blocks, num_n_blocks, 1)
        # HALF_N: a block whose used rows fit in its first half runs a half-width MMA
        if HALF_N and _used_rows(slots_ptr, m_block, BM, num_warps) <= BM // 2:
            count = _gemm2_tile(a_bufs, w_bufs, ready, empty, slots_ptr, weights_ptr, y_ptr, m_block, n_block,
                                count, k_steps, hidden, BM, BM // 2, BN, STAGES, num_warps)
        else:
            count = _gemm2_tile(a_bufs, w_bufs, ready, empty, slots_ptr, weights_ptr, y_ptr, m_block, n_block,
                                count, k_steps, hidden, BM, BM, BN, STAGES, num_warps)


@gluon.jit
def _gemm2_decode(
    a_desc,
    w_desc,
    weights_ptr,
    slots_ptr,
    block_end_ptr,
    num_blocks_ptr,
    y_ptr,
    hidden,
    inter,
    num_experts,
    NUM_BINS: gl.constexpr,
    STAGES: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    HALF_N: gl.constexpr,
    num_warps: gl.constexpr,
):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    num_m_blocks = gl.load(num_blocks_ptr)
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize(
        [
            (
                _gemm2_mma,
                (
                    a_bufs,
                    w_bufs,
                    ready,
                    empty,
                    slots_ptr,
                    weights_ptr,
                    y_ptr,
                    num_m_blocks,
                    hidden,
                    inter,
                    BM,
                    BN,
                    BK,
                    STAGES,
                    HALF_N,
                    num_warps,
                ),
            ),
            (
                _gemm2_producer,
                (
                    a_desc,
                    w_desc,
                    block_end_ptr,
                    a_bufs,
                    w_bufs,
                    ready,
                    empty,
                    num_m_blocks,
                    hidden,
                    inter,
                    num_experts,
                    NUM_BINS,
                    STAGES,
                ),
            ),
        ],
        [1],
        [PRODUCER_REGS],
    )
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


def _desc(t: torch.Tensor, rows: int, cols: int) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(
        t, [rows, cols], gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)
    )


def library_gemm_us(fn) -> tuple[float, float]:
    """Median device time of the library's GEMM1 and GEMM2 launches in `fn` (10 calls; with two
    launches a GEMM per call, the 10 longest: the launch of the unused layout returns at once)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    found: dict[str, list[float]] = {"_gemm1_": [], "_gemm2_": []}
    for event in prof.events():
        if event.device_type != DeviceType.CUDA:
            continue
        for key, times in found.items():
            if key in event.name:
                times.append(event.time_range.elapsed_us())
    return tuple(statistics.median(sorted(t)[-10:]) if t else float("nan") for t in found.values())


def probe(name: str, tokens: int, gemm1_variants: list, gemm2_variants: list, sms: int, rounds: int) -> None:
    import safemoe
    from safemoe.configs import get_config
    from safemoe.kernels.experts import experts_triton
    from safemoe.workspace import Workspace, num_bins

    experts, top_k, hidden, inter = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    w13 = (
        torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
        * hidden**-0.5
    )
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16, generator=g) * inter**-0.5
    ids = torch.rand(tokens, experts, device="cuda", generator=g).argsort(dim=1)[:, :top_k].to(torch.int32)
    weights = torch.rand(tokens, top_k, device="cuda", generator=g)
    distinct = int(torch.unique(ids).numel())
    bytes1 = distinct * 2 * inter * hidden * 2
    bytes2 = distinct * hidden * inter * 2
    cfg = dataclasses.replace(
        get_config(tokens, experts, hidden, inter, top_k, torch.bfloat16, x.device), pdl=False, fused=False
    )
    ws = Workspace(tokens, experts, top_k, hidden, inter, torch.bfloat16, "cuda")
    nv = safemoe._checks.check_num_valid(None, tokens, x.device)

    def library() -> torch.Tensor:
        return experts_triton(
            x,
            w13,
            w2,
            weights,
            ids,
            activation="silu",
            num_valid=nv,
            health=None,
            workspace=ws,
            config=cfg,
            small_config=cfg,
        )

    gemm1_us, gemm2_us = library_gemm_us(library)
    library()
    torch.cuda.synchronize()
    views = ws.views(tokens, experts, top_k, hidden, inter)
    bm = cfg.block_m
    num_m_blocks = int(views.num_blocks[0])
    slots = views.sorted_slots[: num_m_blocks * bm]
    used = slots >= 0
    inter_ref = views.intermediate[: num_m_blocks * bm].clone()
    y_ref = views.y.clone()
    print(
        f"{name} T={tokens}: {distinct} experts hit, block_m {bm}, {num_m_blocks} M-blocks "
        f"(num_blocks {views.num_blocks.tolist()}); "
        f"GEMM1 {bytes1 / 1e6:.0f} MB, GEMM2 {bytes2 / 1e6:.0f} MB; "
        f"cfg gemm1 {cfg.gemm1}, gemm2 {cfg.gemm2}",
        flush=True,
    )
    print(
        f"  library GEMM1 {gemm1_us:8.1f} us {bytes1 / gemm1_us / 1e3:5.0f} GB/s | GEMM2 {gemm2_us:8.1f} us "
        f"{bytes2 / gemm2_us / 1e3:5.0f} GB/s",
        flush=True,
    )
    if num_m_blocks == 0:
        print("  (no main-layout blocks: the few-slot path ran)")
        return
    inter_out = torch.empty_like(views.intermediate)
    w13_rows = w13.view(experts * 2 * inter, hidden)
    big = bm >= 64
    for bn, bk, stages, programs, pwarps, pregs, warps, half in gemm1_variants[big]:
        w_desc = _desc(w13_rows, bn, bk)
        grid = min(num_m_blocks * ((inter + bn - 1) // bn), sms * programs)

        def run1(
            w_desc=w_desc, bk=bk, stages=stages, grid=grid, pwarps=pwarps, pregs=pregs, warps=warps, half=half
        ) -> None:
            _gemm1_decode[(grid,)](
                x,
                w_desc,
                views.sorted_slots,
                views.block_end,
                views.num_blocks,
                inter_out,
                hidden,
                inter,
                experts,
                TOP_K=top_k,
                NUM_BINS=num_bins(experts),
                BM=bm,
                BK=bk,
                STAGES=stages,
                PRODUCER_WARPS=pwarps,
                PRODUCER_REGS=pregs,
                HALF_N=half,
                num_warps=warps,
            )

        label = f"gluon GEMM1 BN {bn} BK {bk} x{stages} {programs}/SM {warps}w{' half-N' if half else ''}"
        try:
            inter_out.fill_(float("nan"))
            run1()
            torch.cuda.synchronize()
            got = inter_out[: num_m_blocks * bm][used].float()
            ref = inter_ref[used].float()
            err = ((got - ref).norm() / ref.norm()).item()
            us = statistics.median(event_times_us(run1, iters=rounds * 5, warmup=2))
        except Exception as exc:  # a probe: report and go on
            print(f"  {label}: {type(exc).__name__}: {exc}"[:400], flush=True)
            continue
        bad = "" if err < 1e-2 else "  WRONG"
        print(
            f"  {label:52s} {us:8.1f} us {bytes1 / us / 1e3:5.0f} GB/s ({gemm1_us / us - 1:+.1%} faster) "
            f"err {err:.1e}{bad}",
            flush=True,
        )
    y_out = torch.empty_like(views.y)
    w2_rows = w2.view(experts * hidden, inter)
    for bn, bk, stages, programs, pregs, warps, half in gemm2_variants[big]:
        a_desc = _desc(views.intermediate, bm, bk)
        w_desc = _desc(w2_rows, bn, bk)
        grid = min(num_m_blocks * ((hidden + bn - 1) // bn), sms * programs)

        def run2(
            a_desc=a_desc, w_desc=w_desc, stages=stages, grid=grid, pregs=pregs, warps=warps, half=half
        ) -> None:
            _gemm2_decode[(grid,)](
                a_desc,
                w_desc,
                weights,
                views.sorted_slots,
                views.block_end,
                views.num_blocks,
                y_out,
                hidden,
                inter,
                experts,
                NUM_BINS=num_bins(experts),
                STAGES=stages,
                PRODUCER_REGS=pregs,
                HALF_N=half,
                num_warps=warps,
            )

        label = f"gluon GEMM2 BN {bn} BK {bk} x{stages} {programs}/SM {warps}w{' half-N' if half else ''}"
        try:
            y_out.fill_(float("nan"))
            run2()
            torch.cuda.synchronize()
            valid = slots[used].long()
            got = y_out[valid].float()
            ref = y_ref[valid].float()
            err = ((got - ref).norm() / ref.norm()).item()
            us = statistics.median(event_times_us(run2, iters=rounds * 5, warmup=2))
        except Exception as exc:  # a probe: report and go on
            print(f"  {label}: {type(exc).__name__}: {exc}"[:400], flush=True)
            continue
        bad = "" if err < 1e-2 else "  WRONG"
        print(
            f"  {label:52s} {us:8.1f} us {bytes2 / us / 1e3:5.0f} GB/s ({gemm2_us / us - 1:+.1%} faster) "
            f"err {err:.1e}{bad}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="mixtral,qwen3,gpt-oss")
    parser.add_argument("--tokens", default="256,1024")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name())
    # GEMM1 (BN, BK, stages, programs per SM, producer warps, producer registers, MMA warps, half-N);
    # a stage holds two [BN, BK] weight boxes and a [BLOCK_M, BK] row tile. Index: block_m >= 64.
    gemm1 = {
        False: [(64, 128, 5, 1, 1, 88, 4, False), (64, 64, 8, 1, 1, 88, 4, False)],
        True: [
            (64, 64, 6, 1, 1, 88, 4, False),
            (64, 64, 6, 1, 1, 88, 4, True),
            (128, 64, 4, 1, 1, 88, 8, False),
            (128, 64, 4, 1, 1, 88, 8, True),
            (64, 128, 3, 1, 1, 88, 4, True),
            (128, 64, 3, 1, 1, 88, 8, True),
        ],
    }
    # GEMM2 (BN, BK, stages, programs per SM, producer registers, MMA warps, half-N)
    gemm2 = {
        False: [(128, 128, 5, 1, 40, 4, False), (128, 64, 8, 1, 40, 4, False)],
        True: [
            (128, 64, 6, 1, 40, 8, False),
            (128, 64, 6, 1, 40, 8, True),
            (64, 64, 8, 1, 40, 4, True),
            (128, 128, 3, 1, 40, 8, True),
            (256, 64, 4, 1, 40, 8, True),
        ],
    }
    for name in args.shapes.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            probe(name, tokens, gemm1, gemm2, sms, args.rounds)


if __name__ == "__main__":
    main()
