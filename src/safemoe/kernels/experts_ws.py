"""GEMM2 of the dispatch layout as a warp-specialised Gluon kernel (Hopper, prefill tiles).

Contract (the same as `_gemm2_kernel`'s main tiles in kernels/experts.py): for each of the
`num_blocks[0]` M-blocks of 128 sorted positions, y[slot] = weight[slot] * (intermediate rows of
the block) @ w2[expert of the block].T for every position whose slot is >= 0; positions holding -1
(padding) are multiplied but never stored, so whatever the intermediate holds there (rows never
written, NaN from an earlier call) reaches no output row. The block's expert is the number of
experts whose inclusive block end is <= the block index, as in the Triton kernels. The M-block
count is read on the device, so one launch serves any batch a CUDA graph replays; a batch whose
layout is the small-batch or few-slot one (num_blocks[0] == 0) returns at once.

Structure (from CUTLASS's and Triton's Gluon tutorials' Hopper GEMMs; written for this layout): a
persistent grid of one program per SM, each walking the same grouped tile order. A one-warp
producer partition issues every TMA load of the program's (tile, K step) sequence into a ring of
`num_stages` shared-memory slots, each with a `ready` and an `empty` mbarrier; the default
partition (8 warps, two warpgroups of 64 rows each) waits on `ready`, issues wgmma with one group
in flight and frees a slot once the MMA reading it has retired. So the loads of the next tile are
in flight while a tile's epilogue runs. Epilogue: each row scaled by its slot's fp32 routing
weight, rounded to y's dtype and stored to y[slot] (engine "ws"), or (engine "ws_store") handed to
a third, two-warp store partition through shared memory, so the MMA warps start the next tile
while the last one is stored.

Measured against the Triton GEMM2 on the same rows (scripts/debug/gluon_ws_gemm2_probe.py, H200,
T = 8192, every expert T*K/E rows): Qwen3-30B-A3B 436 -> 338-345 us, Mixtral-8x7B 3023 ->
2435-2758, DeepSeek-V3 3855 -> 3305, gpt-oss-120b 966 -> 920. The bucket table says where the
layer runs it (GemmTiles.engine); it needs sm_90 (wgmma, TMA, setmaxnreg), bf16 or fp16 and rows
of 16-byte multiples, and falls back to the Triton tiles elsewhere (the CPU interpreter included).
"""

from __future__ import annotations

import functools

import torch

from safemoe.configs import ExpertsConfig
from safemoe.kernels.launch import cdiv, persistent_grid
from safemoe.workspace import WorkspaceViews, max_m_blocks, num_bins

try:  # Gluon ships with Triton >= 3.4; its Hopper TMA load was renamed in 3.7
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    GLUON_AVAILABLE = True
except ImportError:  # pragma: no cover - old triton
    GLUON_AVAILABLE = False

BLOCK_M = 128
NUM_WARPS = 8
PRODUCER_REGS = 40
STORE_WARPS = 2
STORE_REGS = 64
STORE_ROWS = 16  # rows the store partition moves per step
MAX_NREG = 168  # 65536 registers over 12 warps; the MMA warps take what the others give back
_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


if GLUON_AVAILABLE:

    @gluon.jit
    def _coords(tile, num_m_blocks, num_n_blocks, GROUP_M: gl.constexpr):
        """(m_block, n_block) of a tile, GROUP_M M-blocks sharing each weight tile while it is in L2."""
        width = GROUP_M * num_n_blocks
        first_m = (tile // width) * GROUP_M
        size_m = gl.minimum(num_m_blocks - first_m, GROUP_M)
        return first_m + (tile % width) % size_m, (tile % width) // size_m

    @gluon.jit
    def _producer(a_desc, b_desc, block_end_ptr, a_bufs, b_bufs, ready, empty, num_m_blocks, hidden, inter,
                  num_experts, NUM_BINS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        """One warp: every (tile, K step) load of this program, up to STAGES ahead of the MMAs."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[0]
        bins = gl.arange(0, NUM_BINS, layout=gl.BlockedLayout([1], [32], [1], [0]))
        block_end = gl.load(block_end_ptr + bins, mask=bins < num_experts, other=2147483647)
        num_n_blocks = gl.cdiv(hidden, BN)
        k_steps = gl.cdiv(inter, BK)
        count = 0
        for tile in range(gl.program_id(0), num_m_blocks * num_n_blocks, gl.num_programs(0)):
            m_block, n_block = _coords(tile, num_m_blocks, num_n_blocks, GROUP_M)
            expert = gl.sum((block_end <= m_block).to(gl.int32), axis=0)
            # Boxes past an expert's H rows read the next expert's (columns never stored); past the
            # tensor or past I, zeros.
            w_row = expert * hidden + n_block * BN
            for k in range(k_steps):
                slot = count % STAGES
                # empty barriers start with their phase-1 wait complete: the first STAGES pass
                mbarrier.wait(empty.index(slot), ((count // STAGES) & 1) ^ 1)
                bar = ready.index(slot)
                mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                _tma_load(a_desc, [m_block * BM, k * BK], bar, a_bufs.index(slot))
                _tma_load(b_desc, [w_row, k * BK], bar, b_bufs.index(slot))
                count += 1

    @gluon.jit
    def _mma_partition(a_bufs, b_bufs, ready, empty, c_smem, c_ready, c_empty, slots_ptr, weights_ptr, y_ptr,
                       num_m_blocks, hidden, inter, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                       GROUP_M: gl.constexpr, STAGES: gl.constexpr, STORE_PARTITION: gl.constexpr,
                       num_warps: gl.constexpr):
        """Default partition: each tile's K loop over the ring (wgmma, one group in flight, a slot
        freed once the MMA reading it has retired), the rows scaled by their slots' routing weights
        in fp32, then stored to y[slot] here, or (STORE_PARTITION) written to c_smem for the store
        partition once it has taken the previous tile."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BN, 16])
        out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        num_n_blocks = gl.cdiv(hidden, BN)
        k_steps = gl.cdiv(inter, BK)
        count = 0
        local = 0
        for tile in range(gl.program_id(0), num_m_blocks * num_n_blocks, gl.num_programs(0)):
            m_block, n_block = _coords(tile, num_m_blocks, num_n_blocks, GROUP_M)
            acc = gl.zeros((BM, BN), dtype=gl.float32, layout=acc_layout)
            for k in range(k_steps):
                slot = count % STAGES
                mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
                acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc,
                                    use_acc=k > 0, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), count=1, pred=k > 0)
                count += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), count=1)
            rows = m_block * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
            slots = gl.load(slots_ptr + rows)
            weight = gl.load(weights_ptr + gl.maximum(slots, 0), mask=slots >= 0, other=0.0)
            scaled = acc * weight[:, None]
            if STORE_PARTITION:
                mbarrier.wait(c_empty.index(0), (local & 1) ^ 1)
                c_smem.store(scaled.to(c_smem.dtype))
                mbarrier.arrive(c_ready.index(0), count=1)
            else:
                out = gl.convert_layout(scaled.to(y_ptr.dtype.element_ty), out_layout)
                out_slots = gl.convert_layout(slots, gl.SliceLayout(1, out_layout))
                cols = n_block * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, out_layout))
                ptrs = y_ptr + gl.maximum(out_slots, 0).to(gl.int64)[:, None] * hidden + cols[None, :]
                gl.store(ptrs, out, mask=(out_slots >= 0)[:, None] & (cols < hidden)[None, :])
            local += 1  # noqa: SIM113 (a Gluon loop: no enumerate)

    @gluon.jit
    def _store_partition(c_smem, c_ready, c_empty, slots_ptr, y_ptr, num_m_blocks, hidden, BM: gl.constexpr,
                         BN: gl.constexpr, GROUP_M: gl.constexpr, ROWS: gl.constexpr, WARPS: gl.constexpr):
        """Engine "ws_store": each tile from c_smem to y[slot], ROWS rows a step, then c_smem back."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
        num_n_blocks = gl.cdiv(hidden, BN)
        local = 0
        for tile in range(gl.program_id(0), num_m_blocks * num_n_blocks, gl.num_programs(0)):
            m_block, n_block = _coords(tile, num_m_blocks, num_n_blocks, GROUP_M)
            cols = n_block * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
            mbarrier.wait(c_ready.index(0), local & 1)
            for part in gl.static_range(BM // ROWS):
                values = c_smem.slice(part * ROWS, ROWS, dim=0).load(layout)
                rows = m_block * BM + part * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
                slots = gl.load(slots_ptr + rows)
                ptrs = y_ptr + gl.maximum(slots, 0).to(gl.int64)[:, None] * hidden + cols[None, :]
                gl.store(ptrs, values, mask=(slots >= 0)[:, None] & (cols < hidden)[None, :])
            mbarrier.arrive(c_empty.index(0), count=1)
            local += 1  # noqa: SIM113 (a Gluon loop: no enumerate)

    @gluon.jit
    def _gemm2_ws_kernel(
        a_desc,  # [BM, BK] boxes of the intermediate [capacity, I]
        b_desc,  # [BN, BK] boxes of w2 seen as [E * H, I]
        weights_ptr,  # [T, K] float32, indexed by slot
        sorted_slots_ptr,  # [capacity] int32, -1 in padding
        block_end_ptr,  # [E] int32: inclusive prefix sum of each expert's M-blocks
        num_blocks_ptr,  # [2] int32: M-blocks of the main layout first
        y_ptr,  # [T*K, H]
        hidden, inter, num_experts,
        NUM_BINS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, STORE_PARTITION: gl.constexpr,
        PRODUCER_REGS: gl.constexpr, STORE_WARPS: gl.constexpr, STORE_REGS: gl.constexpr,
        STORE_ROWS: gl.constexpr, num_warps: gl.constexpr,
    ):
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[0]
        num_m_blocks = gl.load(num_blocks_ptr)
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        # Each partition's arguments are written out in place: a tuple variable would turn the
        # constexprs in it into runtime values.
        if STORE_PARTITION:
            c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], a_desc.dtype)
            c_smem = gl.allocate_shared_memory(a_desc.dtype, [BM, BN], c_layout)
            c_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
            c_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
            mbarrier.init(c_ready.index(0), count=1)
            mbarrier.init(c_empty.index(0), count=1)
            gl.warp_specialize([
                (_mma_partition, (a_bufs, b_bufs, ready, empty, c_smem, c_ready, c_empty,
                                  sorted_slots_ptr, weights_ptr, y_ptr, num_m_blocks, hidden, inter, BM, BN,
                                  BK, GROUP_M, STAGES, True, num_warps)),
                (_producer, (a_desc, b_desc, block_end_ptr, a_bufs, b_bufs, ready, empty, num_m_blocks,
                             hidden, inter, num_experts, NUM_BINS, GROUP_M, STAGES)),
                (_store_partition, (c_smem, c_ready, c_empty, sorted_slots_ptr, y_ptr, num_m_blocks, hidden,
                                    BM, BN, GROUP_M, STORE_ROWS, STORE_WARPS)),
            ], [1, STORE_WARPS], [PRODUCER_REGS, STORE_REGS])
            mbarrier.invalidate(c_ready.index(0))
            mbarrier.invalidate(c_empty.index(0))
        else:  # (the ring's buffers stand in for the store partition's, never touched)
            gl.warp_specialize([
                (_mma_partition, (a_bufs, b_bufs, ready, empty, a_bufs, ready, ready,
                                  sorted_slots_ptr, weights_ptr, y_ptr, num_m_blocks, hidden, inter, BM, BN,
                                  BK, GROUP_M, STAGES, False, num_warps)),
                (_producer, (a_desc, b_desc, block_end_ptr, a_bufs, b_bufs, ready, empty, num_m_blocks,
                             hidden, inter, num_experts, NUM_BINS, GROUP_M, STAGES)),
            ], [1], [PRODUCER_REGS])
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))


@functools.lru_cache(maxsize=16)
def _is_sm90(device_index: int) -> bool:
    """Whether the GPU is sm_90 (asked once per device: ws_usable runs on every forward)."""
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def ws_usable(w2: torch.Tensor, views: WorkspaceViews) -> bool:
    """Whether this call can run the Gluon GEMM2: a Hopper (sm_90) GPU, bf16/fp16, and rows of
    the intermediate and of w2 that TMA can address (16-byte aligned starts and strides)."""
    if not GLUON_AVAILABLE or w2.device.type != "cuda" or w2.dtype not in _GL_DTYPES:
        return False
    if not _is_sm90(w2.device.index if w2.device.index is not None else torch.cuda.current_device()):
        return False
    inter = views.intermediate
    rows_ok = (inter.shape[1] * inter.element_size()) % 16 == 0 and inter.stride(1) == 1
    return bool(rows_ok and inter.data_ptr() % 16 == 0 and w2.is_contiguous() and w2.data_ptr() % 16 == 0
                and inter.dtype == w2.dtype)


def gemm2_ws_into(w2: torch.Tensor, weights: torch.Tensor, views: WorkspaceViews, num_tokens: int, top_k: int,
                  cfg: ExpertsConfig) -> None:
    """GEMM2 over the main dispatch layout (views.num_blocks[0] M-blocks of 128 positions) with
    the Gluon kernel; `cfg.gemm2` gives block_n, block_k, group_m, num_stages and the engine
    ("ws" or "ws_store"). The caller checked `ws_usable`. Launched without PDL: it starts after
    the previous kernel has finished."""
    num_experts, hidden, inter = w2.shape
    tiles = cfg.gemm2
    gl_dtype = getattr(gl, _GL_DTYPES[w2.dtype])
    a_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, tiles.block_k], gl_dtype)
    b_layout = gl.NVMMASharedLayout.get_default_for([tiles.block_n, tiles.block_k], gl_dtype)
    a_desc = TensorDescriptor.from_tensor(views.intermediate, [BLOCK_M, tiles.block_k], a_layout)
    w2_rows = w2.view(num_experts * hidden, inter)
    b_desc = TensorDescriptor.from_tensor(w2_rows, [tiles.block_n, tiles.block_k], b_layout)
    tile_count = max_m_blocks(num_tokens, num_experts, top_k, BLOCK_M) * cdiv(hidden, tiles.block_n)
    grid = persistent_grid(tile_count, w2.device, 1)  # one program an SM: the ring fills its shared memory
    _gemm2_ws_kernel[(grid,)](
        a_desc, b_desc, weights, views.sorted_slots, views.block_end, views.num_blocks, views.y,
        hidden, inter, num_experts,
        NUM_BINS=num_bins(num_experts), GROUP_M=tiles.group_m, STAGES=tiles.num_stages,
        STORE_PARTITION=tiles.engine == "ws_store", PRODUCER_REGS=PRODUCER_REGS, STORE_WARPS=STORE_WARPS,
        STORE_REGS=STORE_REGS, STORE_ROWS=STORE_ROWS, num_warps=NUM_WARPS, maxnreg=MAX_NREG,
    )
