"""The expert MLPs on the dispatch layout: GEMM1 (gate, up, activation) and GEMM2 (down, weight).

Data path of `experts_triton` (five launches, four when one dispatch chunk covers all slots, plus
two GEMM launches when a batch has small-batch tiles that are not in the GEMMs' own launch):
  dispatch (count [+ scatter]) -> GEMM1 -> GEMM2 -> combine, all buffers in one `Workspace`.

GEMM1 reads x rows *through* `sorted_slots` (token = slot // K; a -1 sentinel row is a masked load
of zeros, so no permuted copy of x exists), accumulates the gate rows [n] and the up rows [I + n]
of w13[e] in two fp32 accumulators, applies the activation in the epilogue and stores only the
I-wide intermediate, rounded to x's dtype (as the reference does), at the row's sorted position.
GEMM2 multiplies intermediate rows by w2[e]^T, scales each row by its slot's routing weight (fp32)
and stores it, rounded to x's dtype, at y[slot]; sentinel rows are neither loaded nor stored.
Combine sums the K rows of each token in order k = 0..K-1 (see kernels/combine.py).

Both GEMMs run persistent grids (at most `programs_per_sm` programs per SM) that loop over
(M-block, N-block) tiles up to the number of M-blocks in use, read on the device: the grid is a
function of T alone (CUDA-graph safe) and the work a function of num_valid. An M-block's expert is
the number of experts whose inclusive block end is <= the block index. Results are deterministic:
each output row depends on its own input row and the same K-loop order whatever its position, and
the combine is an ordered reduction. With `batch_invariant` one configuration serves every T and
the small-batch switch is off, so a valid row's bits depend on nothing but its own inputs (the
tiles fix each output's K-loop order and MMA shape; the grid only decides which program runs a
tile). Addresses that are products of a row and a row length use
int64 (T*K*H and capacity*I can pass 2^31).

Two tile regimes: a batch bucket above SMALL_BATCH_TOKENS whose tiles differ from the small-batch
ones has both. Dispatch builds one layout, chosen on the device from num_valid, and zeroes the
other's M-block count. Either each GEMM is launched twice (main tiles over layout 0, small tiles
over layout 1; the launch of the unused layout finds no M-block and returns), or, with the
bucket's config `one_launch`, once, compiled with both sets of tile constexprs (HAS_SMALL): each
program reads num_blocks[1] first and loops over the small tiles when it is > 0, else over the
main ones. The empty launch costs ~3-4 us per GEMM in the CUDA-graph chain (H100, Qwen3 shape,
T=1024 with one valid row); the merged kernel runs the small tiles with the main config's
num_warps/num_stages and can cost the main tiles a few percent, so it is a tuned choice.

Activations (gate g, up u, fp32): silu g*sigmoid(g)*u; gelu (tanh form) 0.5*g*(1+tanh(...))*u;
swigluoai min(g,7)*sigmoid(1.702*min(g,7))*(clamp(u,-7,7)+1) on the same gate-then-up layout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from safemoe._checks import Fp8Weights, NumValid
from safemoe._triton import interpreter_enabled
from safemoe.configs import (
    ExpertsConfig,
    GemmTiles,
    batch_invariant_config,
    few_tiles_within,
    get_config,
    has_table,
    small_batch_entry,
)
from safemoe.kernels.act_quant import quantize_positions_into, quantize_rows_into, quantize_tile_rows
from safemoe.kernels.combine import combine_into
from safemoe.kernels.dispatch import dispatch_into
from safemoe.kernels.experts_ws import gemm2_ws_into, ws_usable
from safemoe.kernels.launch import (
    cdiv,
    hopper_or_newer,
    launch_options,
    load_num_valid,
    next_power_of_2,
    pdl_usable,
    persistent_grid,
    rowwise_product,
    wait_for_previous_kernel,
)
from safemoe.numerics import FP8_BLOCK, SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT
from safemoe.workspace import Fp8Views, Workspace, WorkspaceViews, max_m_blocks, num_bins

_ACTIVATION_CODES = {"silu": 0, "gelu": 1, "swigluoai": 2}
# num_valid at or below this (read on the device) runs the small-batch tiles in a larger batch.
SMALL_BATCH_TOKENS = 8
# num_valid * K at or below this (read on the device) runs the few-slot path: every GEMM program
# builds the layout in its registers from the ids (no dispatch kernel), one FEW_SLOTS-row tile per
# expert routed to. It is the M of the smallest tensor-core tile, so a tile holds every slot.
FEW_SLOTS = 16
# With PACK_FUSED_ROWS off, a bucket of up to this many slots (T*K) whose own config is `fused` runs
# every batch as the fused few-slot launch with tiles of FUSED_SLOTS rows (no dispatch launch,
# GEMM2's tiles of an expert starting as its GEMM1 tiles finish): the decode buckets above 16 slots
# whose GEMM1 runs several waves, where the fused launch paid at 16 slots (gpt-oss T = 4: -5.1% on
# an H200).
FUSED_SLOTS = 32
# ... and up to this many with PACK_FUSED_ROWS (below, the default): 16-row tiles whatever the
# slots. Packed buckets of 65-128 slots were 12-53% slower than two launches on an H200
# (2026-12-02: Qwen3-Next T = 8, Qwen3 T = 16, gpt-oss T = 32, DeepSeek-V3 T = 16).
PACKED_FUSED_SLOTS = 64
# On: that launch packs each expert's slots into FEW_SLOTS-row tiles (`_few_groups`) instead of
# FUSED_SLOTS-row tiles whose rows are every slot number, most of them masked (off: the twenty-
# fourth session's launch, kept as an A/B switch). The 32-row tiles cost shared memory and MMA
# rows for nothing (a CPU compile for sm_90: 123 KB against 102 KB, one program an SM instead of
# two). Whole layer on an H200, 2026-12-02 (scripts/debug/packed_fused_ab.sh; two launches ->
# fused 32-row -> fused packed, us): gpt-oss T = 8 341.1 -> 439.2 -> 329.8, Qwen3-Next T = 2 56.8
# -> 49.4 -> 43.6, Qwen3 T = 4 80.6 -> 81.1 -> 76.7, DeepSeek-V3 T = 4 624.7 -> 677.7 -> 603.4,
# Mixtral T = 16 648.1 -> 653.7 -> 648.4; 33-64 slots, packed only: Qwen3 T = 8 127.3 -> 120.4,
# DeepSeek-V3 T = 8 1149.2 -> 1136.7.
PACK_FUSED_ROWS = True
# A shape without a tuned table compiles lighter few-slot tiles into its 64-row buckets' launches
# (`light_few_tiles`: K steps of at most 128, 4 stages) than its decode bucket runs (256-wide K
# steps): with the decode bucket's tiles compiled in, a path the full batch never takes cost it
# 2-7%, with the light ones nothing (H200
# 2026-12-02, heuristic_eval runs 3 and 5, us, full batch / one valid row, decode tiles inside ->
# light tiles inside: OLMoE T = 256 239.0 / 37.8 -> 224.8 / 34.1, Qwen3 T = 512 362.0 / 33.8 ->
# 337.1 / 30.7, gpt-oss T = 1024 1680 / 67.6 -> 1625 / 64.1, DeepSeek-V3 T = 1024 5816 / 187.7
# -> 5597 / 189.4). The fused launch ahead of the GEMMs gave the same full batches but slower
# one-row steps on five of those six shapes (40.7, 36.7, 76.8 us; DeepSeek-V3 182.7). 32- and
# 128-row buckets showed no such cost and keep the decode bucket's tiles.
LIGHT_FEW_BLOCK_M = 64
LIGHT_FEW_BLOCK_K = 128


def fused_slots() -> int:
    """The most slots (T*K) of a bucket that can run every batch as the fused few-slot launch:
    FUSED_SLOTS, or PACKED_FUSED_SLOTS with PACK_FUSED_ROWS (read at call time: an A/B switch)."""
    return PACKED_FUSED_SLOTS if PACK_FUSED_ROWS else FUSED_SLOTS


def fused_bucket(num_tokens: int, top_k: int) -> bool:
    """Whether a bucket of T tokens can run every batch as the fused few-slot launch when its own
    config is `fused` (K <= FEW_SLOTS and T*K <= fused_slots()): the one rule experts_triton,
    few_tiles_from and scripts/tune_experts.py apply."""
    return top_k <= FEW_SLOTS and num_tokens * top_k <= fused_slots()


_SQRT_2_OVER_PI: tl.constexpr = tl.constexpr(0.7978845608028654)
# fp8 block mode: 128x128 weight blocks, 1x128 activation groups (reference.FP8_BLOCK)
SCALE_BLOCK: tl.constexpr = tl.constexpr(FP8_BLOCK)
# fp8 block mode: GEMM1 quantises the intermediate in its epilogue where its tiles hold whole 1x128
# groups (`fuses_inter_quant`), instead of a separate pass over the stored intermediate. A switch
# for A/B runs (docs/fp8.md, seventeenth session); the two ways give the same bits.
FUSE_INTER_QUANT = True
_SWIGLUOAI_ALPHA: tl.constexpr = tl.constexpr(SWIGLUOAI_ALPHA)
_SWIGLUOAI_LIMIT: tl.constexpr = tl.constexpr(SWIGLUOAI_LIMIT)
_QUANT_CODES = {None: 0, "per_tensor": 1, "block": 2}


@triton.jit
def _activation(gate, up, ACTIVATION: tl.constexpr):
    if ACTIVATION == 0:
        return gate * tl.sigmoid(gate) * up
    elif ACTIVATION == 1:
        inner = _SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        # tanh(z) = 2 * sigmoid(2z) - 1 (no tanh in every triton's tl.math)
        return 0.5 * gate * (2.0 * tl.sigmoid(2.0 * inner)) * up
    else:
        gate = tl.minimum(gate, _SWIGLUOAI_LIMIT)
        up = tl.minimum(tl.maximum(up, -_SWIGLUOAI_LIMIT), _SWIGLUOAI_LIMIT)
        return gate * tl.sigmoid(gate * _SWIGLUOAI_ALPHA) * (up + 1.0)


@triton.jit
def _tile_coords(tile, num_m_blocks, num_n_blocks, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M M-blocks share each weight tile while it sits in L2."""
    tiles_per_group = GROUP_M * num_n_blocks
    group = tile // tiles_per_group
    first_m = group * GROUP_M
    group_rows = tl.minimum(num_m_blocks - first_m, GROUP_M)
    m_block = first_m + (tile % tiles_per_group) % group_rows
    n_block = (tile % tiles_per_group) // group_rows
    return m_block, n_block


@triton.jit
def _layout_in_use(num_blocks_ptr, block_end_ptr, num_experts, NUM_BINS: tl.constexpr):
    """(M-blocks in use, [NUM_BINS] block ends with int32 max past E) of this launch's layout."""
    bins = tl.arange(0, NUM_BINS)
    return tl.load(num_blocks_ptr), tl.load(block_end_ptr + bins, mask=bins < num_experts, other=2147483647)


@triton.jit
def _tile_rows(tile, num_m_blocks, num_n_blocks, block_end, sorted_slots_ptr, BLOCK_M: tl.constexpr,
               GROUP_M: tl.constexpr):
    """(n_block, expert, rows, slots) of a tile. The M-block's expert is the number of experts whose
    inclusive block end is <= the block index (one vector compare, no search); rows are sorted
    positions, slots hold -1 in padding positions."""
    m_block, n_block = _tile_coords(tile, num_m_blocks, num_n_blocks, GROUP_M)
    expert = tl.sum((block_end <= m_block).to(tl.int32), 0)
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + rows)
    return n_block, expert, rows, slots


@triton.jit
def _operand(tile, UPCAST: tl.constexpr):
    """An MMA operand as loaded; upcast to fp32 where the interpreter has no arithmetic for its
    dtype (bf16: its dot would multiply the raw bits)."""
    if UPCAST:
        return tile.to(tl.float32)
    else:
        return tile


@triton.jit
def _group_scale(a_scale_rows_ptr, row_ok, k, BLOCK_K: tl.constexpr, QUANT: tl.constexpr):
    """Block mode: the [BLOCK_M] activation-group scales of K step k (BLOCK_K divides 128, so one
    step lies inside one group); other modes: 1."""
    if QUANT >= 2:
        return tl.load(a_scale_rows_ptr + (k * BLOCK_K) // SCALE_BLOCK, mask=row_ok, other=0.0)
    else:
        return 1.0


@triton.jit
def _mma(acc, a, b, a_scale, w_scale_rows_ptr, k, BLOCK_K: tl.constexpr, QUANT: tl.constexpr,
         DOT_PRECISION: tl.constexpr, ROWWISE: tl.constexpr, SWAP_AB: tl.constexpr = False):
    """acc + a @ b. Block mode: the K step's product is scaled by its activation-group scale
    (rows) times its 128x128 weight-block scale (columns) before it is added, DeepSeek-V3's
    promotion of each 128-wide partial sum into the fp32 accumulator. QUANT 3 and 4 (block mode,
    every column of this product in one weight block): w_scale_rows_ptr is one pointer, the weight
    scale one number, and the promotion one multiply-add per element (a [BLOCK_M] scale vector)
    instead of an outer product of scales and a multiply before the add. ROWWISE (interpreter,
    batch-invariant): the product is `rowwise_product` (see kernels/launch.py). SWAP_AB: acc is
    the transposed accumulator [N, M] and the product is b^T a^T, the weights on the MMA's M side:
    with a 16-row decode tile Triton then takes Hopper's wgmma, whose fp8 operands need no
    conversion (its 16-row dot is mma.sync on f16 after converting every fp8 operand; measured in
    scripts/debug/fp8_swap_ab_probe.py; the swap-AB lever issue 13 lists from the peers' small-M GEMMs)."""
    # One return at the end: a return inside a constexpr branch with more statements after it is
    # not where code generation stops (Triton 3.9 for sm_90 compiles the statements after it too).
    if QUANT >= 2:
        w_scale = tl.load(w_scale_rows_ptr + (k * BLOCK_K) // SCALE_BLOCK)
        if SWAP_AB:
            product = tl.dot(tl.trans(b), tl.trans(a))
            if QUANT >= 3:
                scale = (a_scale * w_scale)[None, :]
            else:
                scale = w_scale[:, None] * a_scale[None, :]
        else:
            if ROWWISE:
                product = rowwise_product(a, b)
            else:
                product = tl.dot(a, b)
            if QUANT >= 3:
                scale = (a_scale * w_scale)[:, None]
            else:
                scale = a_scale[:, None] * w_scale[None, :]
        result = acc + product * scale
    elif ROWWISE:
        result = acc + rowwise_product(a, b)
    elif SWAP_AB:
        result = tl.dot(tl.trans(b), tl.trans(a), acc, input_precision=DOT_PRECISION)
    else:
        result = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return result


@triton.jit
def _dequantize(acc, a_scale_rows_ptr, row_ok, w_scale_ptr, QUANT: tl.constexpr):
    """Per-tensor mode: acc x the rows' per-token scales x the expert matrix's scale."""
    if QUANT == 1:
        a_scale = tl.load(a_scale_rows_ptr, mask=row_ok, other=0.0)
        return acc * (a_scale[:, None] * tl.load(w_scale_ptr))
    else:
        return acc


@triton.jit
def _few_ids(ids_ptr, num_slots, FEW: tl.constexpr):
    """The ids of the first min(FEW, num_slots) slots (-1 past them)."""
    slot = tl.arange(0, FEW)
    return tl.load(ids_ptr + slot, mask=slot < num_slots, other=-1)


@triton.jit
def _load_few_ids(ids_ptr, num_valid_ptr, num_valid_count, num_tokens, TOP_K: tl.constexpr,
                  FEW: tl.constexpr, HAS_NUM_VALID_PTR: tl.constexpr, IDS_COMPLETE: tl.constexpr):
    """(ids of the first FEW slots, valid slots = num_valid * K). Without IDS_COMPLETE the ids load
    is masked by num_valid, so the ids of padding rows are never read, and with num_valid on the
    device it waits for that load (a second round trip before any weight load). IDS_COMPLETE: the
    caller's router wrote every row's ids in this same call (padding rows' as -1), so the ids of
    the batch's first FEW slots are loaded together with num_valid, and _few_slots discards the
    padding rows' among them before any use."""
    if IDS_COMPLETE:
        raw_ids = _few_ids(ids_ptr, num_tokens * TOP_K, FEW)
        valid_slots = load_num_valid(num_valid_ptr, num_valid_count, num_tokens, HAS_NUM_VALID_PTR) * TOP_K
    else:
        valid_slots = load_num_valid(num_valid_ptr, num_valid_count, num_tokens, HAS_NUM_VALID_PTR) * TOP_K
        raw_ids = _few_ids(ids_ptr, valid_slots, FEW)
    return raw_ids, valid_slots


@triton.jit
def _served_positions(raw_ids, valid_slots, num_experts, FEW: tl.constexpr):
    """(slot [FEW], whether it is a row of the batch, its expert or -1 when it is not served,
    whether it is served, its position among its expert's served slots) from the ids themselves."""
    slot = tl.arange(0, FEW)
    in_rows = slot < valid_slots
    expert = tl.where(in_rows, raw_ids, -1)
    served = in_rows & (expert >= 0) & (expert < num_experts)
    expert = tl.where(served, expert, -1)
    earlier_same = (expert[:, None] == expert[None, :]) & (slot[None, :] < slot[:, None])
    return slot, in_rows, expert, served, tl.sum(earlier_same.to(tl.int32), 1)


@triton.jit
def _ranked(leader, in_rows, served):
    """(each leader's rank or -1, number of leaders, dropped slots)."""
    rank = tl.where(leader, tl.cumsum(leader.to(tl.int32), 0) - 1, -1)
    dropped = tl.sum((in_rows & ~served).to(tl.int64), 0)
    return rank, tl.sum(leader.to(tl.int32), 0), dropped


@triton.jit
def _few_slots(raw_ids, valid_slots, num_experts, FEW: tl.constexpr):
    """The few-slot layout, built in registers by every GEMM program from the ids themselves
    (`raw_ids`, from _load_few_ids): (slot [FEW], its expert or -1 when the slot is not served, its
    rank among the leaders or -1, number of leaders, dropped slots). A leader is the first served
    slot of its expert: each tile of the few-slot path is one leader's expert, whose rows are all
    the slots routed to it."""
    slot, in_rows, expert, served, position = _served_positions(raw_ids, valid_slots, num_experts, FEW)
    rank, leaders, dropped = _ranked(served & (position == 0), in_rows, served)
    return slot, expert, rank, leaders, dropped


@triton.jit
def _few_groups(raw_ids, valid_slots, num_experts, FEW: tl.constexpr, ROWS: tl.constexpr):
    """The few-slot layout packed into ROWS-row tiles (PACK_FUSED_ROWS): (slot [FEW], its expert or
    -1 when not served, its position among its expert's served slots, its rank among the group
    leaders or -1, number of groups, dropped slots). A group is ROWS consecutive served slots of one
    expert (positions g * ROWS ..), its leader the first of them: one tile a group, so an expert
    with more than ROWS slots in a batch (duplicate ids) has several."""
    slot, in_rows, expert, served, position = _served_positions(raw_ids, valid_slots, num_experts, FEW)
    rank, groups, dropped = _ranked(served & (position % ROWS == 0), in_rows, served)
    return slot, expert, position, rank, groups, dropped


@triton.jit
def _few_group_rows(tile, num_n_blocks, slot, expert, position, rank, ROWS: tl.constexpr):
    """(n_block, expert, rows, slots) of a packed few-slot tile (`_few_groups`): row r holds the
    group's r-th slot (rows: its slot number, the intermediate's row; slots: the same or -1 past the
    group's last slot)."""
    group = tile // num_n_blocks
    is_leader = rank == group
    tile_expert = tl.sum(tl.where(is_leader, expert, 0), 0)
    first = tl.sum(tl.where(is_leader, position, 0), 0)
    row = tl.arange(0, ROWS)
    match = (expert[None, :] == tile_expert) & (position[None, :] == first + row[:, None])  # [ROWS, FEW]
    found = tl.sum(match.to(tl.int32), 1) > 0
    row_slot = tl.sum(tl.where(match, slot[None, :], 0), 1)
    return tile % num_n_blocks, tile_expert, row_slot, tl.where(found, row_slot, -1)


@triton.jit
def _few_tile_rows(tile, num_n_blocks, slot, expert, rank):
    """(n_block, expert, rows, slots) of a few-slot tile: rows are slot numbers (the intermediate
    is indexed by slot on this path), slots hold -1 where the slot is not the tile's expert's."""
    leader = tile // num_n_blocks
    tile_expert = tl.sum(tl.where(rank == leader, expert, 0), 0)
    return tile % num_n_blocks, tile_expert, slot, tl.where(expert == tile_expert, slot, -1)


@triton.jit
def _k_step_rows(a_ptrs, row_ok, ks, k, reduction, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """K step k's A tile [BLOCK_M, BLOCK_K] at a_ptrs: rows outside row_ok and (without EVEN_K)
    columns past the reduction read as 0, never loaded."""
    if EVEN_K:
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
    else:
        a = tl.load(a_ptrs, mask=row_ok[:, None] & (ks < reduction - k * BLOCK_K)[None, :], other=0.0)
    return a


@triton.jit
def _k_step_weights(w_ptrs, ks, k, reduction, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """K step k's weight tile [BLOCK_K, N] at w_ptrs (pointer loads): without EVEN_K, rows past the
    reduction read as 0."""
    if EVEN_K:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=(ks < reduction - k * BLOCK_K)[:, None], other=0.0)
    return w


@triton.jit
def _two_weight_tiles(
    a_ptrs, row_ok, a_scale_rows, w_arg, w0_ptrs, w1_ptrs, w0_row, w1_row, w0_scales, w1_scales, reduction,
    acc0, acc1, QUANT: tl.constexpr, UPCAST: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, ROWWISE: tl.constexpr, SWAP_AB: tl.constexpr = False,
):
    """(acc0 + A @ W0, acc1 + A @ W1) over the reduction: each K step's A tile (rows of row_ok,
    a_ptrs [BLOCK_M, BLOCK_K]) against two weight tiles, GEMM1's gate and up rows or the two
    128-column halves of a QUANT 4 GEMM2 tile. Weights through the descriptor w_arg at rows w0_row
    and w1_row (USE_TMA; w0_ptrs/w1_ptrs unused), else through the pointers w0_ptrs/w1_ptrs
    [BLOCK_K, N] (w0_row/w1_row unused); w0_scales/w1_scales are _mma's weight-scale pointers.
    SWAP_AB: the K loop accumulates the transposes (see _mma), turned back once after it."""
    ks = tl.arange(0, BLOCK_K)
    if SWAP_AB:
        acc0 = tl.trans(acc0)
        acc1 = tl.trans(acc1)
    for k in range(0, tl.cdiv(reduction, BLOCK_K)):
        a = _k_step_rows(a_ptrs, row_ok, ks, k, reduction, BLOCK_K, EVEN_K)
        if USE_TMA:
            b0 = w_arg.load([w0_row, k * BLOCK_K]).T
            b1 = w_arg.load([w1_row, k * BLOCK_K]).T
        else:
            b0 = _k_step_weights(w0_ptrs, ks, k, reduction, BLOCK_K, EVEN_K)
            b1 = _k_step_weights(w1_ptrs, ks, k, reduction, BLOCK_K, EVEN_K)
        a = _operand(a, UPCAST)
        a_scale = _group_scale(a_scale_rows, row_ok, k, BLOCK_K, QUANT)
        b0 = _operand(b0, UPCAST)
        b1 = _operand(b1, UPCAST)
        acc0 = _mma(acc0, a, b0, a_scale, w0_scales, k, BLOCK_K, QUANT, DOT_PRECISION, ROWWISE, SWAP_AB)
        acc1 = _mma(acc1, a, b1, a_scale, w1_scales, k, BLOCK_K, QUANT, DOT_PRECISION, ROWWISE, SWAP_AB)
        a_ptrs += BLOCK_K
        if not USE_TMA:
            w0_ptrs += BLOCK_K
            w1_ptrs += BLOCK_K
    if SWAP_AB:
        acc0 = tl.trans(acc0)
        acc1 = tl.trans(acc1)
    return acc0, acc1


@triton.jit
def _gemm1_tile(
    x_ptr, w13_arg, n_block, expert, rows, slots, x_scale_ptr, w13_scale_ptr, inter_ptr, inter_scale_ptr,
    hidden, inter, expert_stride, up_offset, x_scale_stride, w_scale_expert_stride, w_scale_row_stride,
    up_scale_row, up_scale_offset,
    TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, QUANT: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, ROWWISE: tl.constexpr,
    INTERLEAVE: tl.constexpr = False, SWAP_AB: tl.constexpr = False, INTER_QUANT: tl.constexpr = 0,
    NATIVE_CAST: tl.constexpr = True,
):
    """One GEMM1 tile: intermediate rows `rows` (columns of N-block n_block) from the x rows of
    `slots` (-1: a masked row, neither loaded nor stored) and expert `expert`'s w13 (arguments as
    in _gemm1_kernel; w13_arg's boxes, if a descriptor, are [BLOCK_N, BLOCK_K]). INTERLEAVE (QUANT
    0 or 1): gate and up rows as the even and odd columns of ONE [BLOCK_K, 2 BLOCK_N] weight tile and
    one dot per K step (one 2 BLOCK_N-wide MMA instead of two BLOCK_N-wide ones reading the same A
    tile), split after the K loop; through pointers, or with USE_TMA through w13_arg, then a
    descriptor over w13 seen as [E, I, 2, H] with [1, BLOCK_N, 2, BLOCK_K] boxes. INTER_QUANT
    (fp8 block mode, BLOCK_N a multiple of 128; 1: x is bf16, 2: fp16): the tile's rows quantised
    in 1x128 groups here, codes to inter_ptr (fp8) and scales to inter_scale_ptr, as
    `quantize_positions_into` would from the intermediate stored in x's dtype."""
    row_ok = slots >= 0
    tokens = tl.where(row_ok, slots // TOP_K, 0).to(tl.int64)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    # Columns past I wrap onto valid rows of w13 (loads need no mask); they are never stored.
    w_cols = (cols % inter).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * hidden + ks[None, :]
    x_scale_rows = x_scale_ptr + tokens * x_scale_stride
    w_scales = w13_scale_ptr + expert.to(tl.int64) * w_scale_expert_stride
    # QUANT 2: each output column's row of 128x128 block scales (gate, then up); QUANT 3: the
    # tile's one row (its columns lie in one block; columns past I are never stored)
    if QUANT == 3:
        gate_scale_rows = w_scales + ((n_block * BLOCK_N) // SCALE_BLOCK) * w_scale_row_stride
        up_scale_rows = w_scales + ((up_scale_row + n_block * BLOCK_N) // SCALE_BLOCK
                                    + up_scale_offset) * w_scale_row_stride
    else:
        gate_scale_rows = w_scales + (w_cols // SCALE_BLOCK) * w_scale_row_stride
        up_blocks = (up_scale_row + w_cols) // SCALE_BLOCK + up_scale_offset
        up_scale_rows = w_scales + up_blocks * w_scale_row_stride
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if INTERLEAVE:
        pair = tl.arange(0, 2 * BLOCK_N)
        # even columns: gate row c, odd: up row c (c = n_block * BLOCK_N + pair // 2, wrapped as w_cols)
        w_rows = ((n_block * BLOCK_N + pair // 2) % inter + (pair % 2) * inter).to(tl.int64)
        if not USE_TMA:
            b_ptrs = w13_arg + expert.to(tl.int64) * expert_stride + w_rows[None, :] * hidden + ks[:, None]
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(hidden, BLOCK_K)):
            a = _k_step_rows(a_ptrs, row_ok, ks, k, hidden, BLOCK_K, EVEN_K)
            if USE_TMA:
                # w13_arg: a descriptor over w13 seen as [E, I, 2, H] (_interleaved_operand): its
                # [1, BLOCK_N, 2, BLOCK_K] box holds gate row c and up row c next to each other
                # (zeros past I and H)
                b = tl.reshape(w13_arg.load([expert, n_block * BLOCK_N, 0, k * BLOCK_K]),
                               (2 * BLOCK_N, BLOCK_K)).T
            else:
                b = _k_step_weights(b_ptrs, ks, k, hidden, BLOCK_K, EVEN_K)
            # QUANT 0 or 1 (fp8 per-tensor: dequantised after the loop, as the two accumulators are)
            acc = _mma(acc, _operand(a, UPCAST), _operand(b, UPCAST), 0.0, 0, k, BLOCK_K, 0, DOT_PRECISION,
                       ROWWISE)
            a_ptrs += BLOCK_K
            if not USE_TMA:
                b_ptrs += BLOCK_K
        acc_gate, acc_up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
    elif USE_TMA:
        # Boxes past an expert's rows read the next rows (columns never stored), past the
        # tensor or past H zeros (the descriptor's bounds).
        gate_row = expert * 2 * inter + n_block * BLOCK_N
        acc_gate, acc_up = _two_weight_tiles(
            a_ptrs, row_ok, x_scale_rows, w13_arg, 0, 0, gate_row, gate_row + inter, gate_scale_rows,
            up_scale_rows, hidden, acc_gate, acc_up, QUANT, UPCAST, BLOCK_K, EVEN_K, DOT_PRECISION, True,
            ROWWISE, SWAP_AB)
    else:
        gate_ptrs = w13_arg + expert.to(tl.int64) * expert_stride + w_cols[None, :] * hidden + ks[:, None]
        acc_gate, acc_up = _two_weight_tiles(
            a_ptrs, row_ok, x_scale_rows, w13_arg, gate_ptrs, gate_ptrs + up_offset, 0, 0, gate_scale_rows,
            up_scale_rows, hidden, acc_gate, acc_up, QUANT, UPCAST, BLOCK_K, EVEN_K, DOT_PRECISION, False,
            ROWWISE, SWAP_AB)
    acc_gate = _dequantize(acc_gate, x_scale_rows, row_ok, w_scales, QUANT)
    acc_up = _dequantize(acc_up, x_scale_rows, row_ok, w_scales + up_scale_offset, QUANT)
    h = _activation(acc_gate, acc_up, ACTIVATION)
    out_ptrs = inter_ptr + rows.to(tl.int64)[:, None] * inter + cols[None, :]
    out_mask = row_ok[:, None] & (cols < inter)[None, :]
    if INTER_QUANT > 0:
        # The intermediate as the unfused path stores it (x's dtype), then its 1x128 groups: each
        # is 128 of this tile's columns (columns past I lie outside the last group).
        if INTER_QUANT == 1:
            stored = h.to(tl.bfloat16).to(tl.float32)
        else:
            stored = h.to(tl.float16).to(tl.float32)
        GROUPS: tl.constexpr = BLOCK_N // SCALE_BLOCK
        in_group = tl.broadcast_to((cols < inter)[None, :], (BLOCK_M, BLOCK_N))
        codes, scales = quantize_tile_rows(tl.reshape(stored, (BLOCK_M * GROUPS, SCALE_BLOCK)),
                                           tl.reshape(in_group, (BLOCK_M * GROUPS, SCALE_BLOCK)), NATIVE_CAST)
        codes = tl.reshape(codes, (BLOCK_M, BLOCK_N))
        tl.store(out_ptrs, codes.to(inter_ptr.dtype.element_ty), mask=out_mask)
        groups = n_block * GROUPS + tl.arange(0, GROUPS)
        scale_rows = inter_scale_ptr + rows.to(tl.int64) * tl.cdiv(inter, SCALE_BLOCK)
        scale_ptrs = scale_rows[:, None] + groups[None, :]
        tl.store(scale_ptrs, tl.reshape(scales, (BLOCK_M, GROUPS)),
                 mask=row_ok[:, None] & (groups * SCALE_BLOCK < inter)[None, :])
    else:
        tl.store(out_ptrs, h.to(inter_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _gemm1_tiles(
    x_ptr, w13_arg, sorted_slots_ptr, num_m_blocks, block_end, x_scale_ptr, w13_scale_ptr, inter_ptr,
    inter_scale_ptr, hidden, inter, expert_stride, up_offset, x_scale_stride, w_scale_expert_stride,
    w_scale_row_stride, up_scale_row, up_scale_offset,
    TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, QUANT: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, ROWWISE: tl.constexpr,
    INTERLEAVE: tl.constexpr = False, SWAP_AB: tl.constexpr = False, INTER_QUANT: tl.constexpr = 0,
    NATIVE_CAST: tl.constexpr = True,
):
    """GEMM1's persistent tile loop over `num_m_blocks` M-blocks of BLOCK_M rows of the dispatch
    layout with one set of tiles."""
    num_n_blocks = tl.cdiv(inter, BLOCK_N)
    for tile in range(tl.program_id(0), num_m_blocks * num_n_blocks, tl.num_programs(0)):
        n_block, expert, rows, slots = _tile_rows(tile, num_m_blocks, num_n_blocks, block_end,
                                                  sorted_slots_ptr, BLOCK_M, GROUP_M)
        _gemm1_tile(x_ptr, w13_arg, n_block, expert, rows, slots, x_scale_ptr, w13_scale_ptr, inter_ptr,
                    inter_scale_ptr, hidden, inter, expert_stride, up_offset, x_scale_stride,
                    w_scale_expert_stride, w_scale_row_stride, up_scale_row, up_scale_offset, TOP_K,
                    ACTIVATION, QUANT, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION, USE_TMA,
                    ROWWISE, INTERLEAVE, SWAP_AB, INTER_QUANT, NATIVE_CAST)


@triton.jit
def _gemm1_few_tiles(
    x_ptr, w13_arg, raw_ids, valid_slots, num_experts, health_ptr, x_scale_ptr, w13_scale_ptr, inter_ptr,
    hidden, inter, expert_stride, up_offset, x_scale_stride, w_scale_expert_stride, w_scale_row_stride,
    up_scale_row, up_scale_offset,
    TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, QUANT: tl.constexpr, UPCAST: tl.constexpr,
    FEW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, ROWWISE: tl.constexpr, HAS_HEALTH: tl.constexpr,
):
    """GEMM1 over the few-slot layout (valid_slots <= FEW): one tile per (expert routed to, N-block),
    with FEW rows; program 0 counts the dropped slots (no dispatch kernel ran for them)."""
    slot, expert, rank, leaders, dropped = _few_slots(raw_ids, valid_slots, num_experts, FEW)
    if HAS_HEALTH:  # noqa: SIM102 (a constexpr guard: the atomic is not compiled without health)
        if tl.program_id(0) == 0:
            tl.atomic_add(health_ptr + 1, dropped, sem="relaxed")
    num_n_blocks = tl.cdiv(inter, BLOCK_N)
    for tile in range(tl.program_id(0), leaders * num_n_blocks, tl.num_programs(0)):
        n_block, tile_expert, rows, slots = _few_tile_rows(tile, num_n_blocks, slot, expert, rank)
        _gemm1_tile(x_ptr, w13_arg, n_block, tile_expert, rows, slots, x_scale_ptr, w13_scale_ptr, inter_ptr,
                    inter_ptr, hidden, inter, expert_stride, up_offset, x_scale_stride, w_scale_expert_stride,
                    w_scale_row_stride, up_scale_row, up_scale_offset, TOP_K, ACTIVATION, QUANT, UPCAST,
                    FEW, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION, USE_TMA, ROWWISE)


@triton.jit
def _gemm1_layout_tiles(
    x_ptr, w13_arg, w13_small_arg, sorted_slots_ptr, block_end_ptr, num_blocks_ptr, x_scale_ptr,
    w13_scale_ptr, inter_ptr, inter_scale_ptr, hidden, inter, num_experts, expert_stride, up_offset,
    x_scale_stride, w_scale_expert_stride, w_scale_row_stride, up_scale_row, up_scale_offset,
    TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, NUM_BINS: tl.constexpr, QUANT: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, HAS_SMALL: tl.constexpr,
    SMALL_BLOCK_M: tl.constexpr, SMALL_BLOCK_N: tl.constexpr, SMALL_BLOCK_K: tl.constexpr,
    SMALL_GROUP_M: tl.constexpr, SMALL_EVEN_K: tl.constexpr, SMALL_USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ROWWISE: tl.constexpr, INTERLEAVE: tl.constexpr,
    SWAP_AB: tl.constexpr = False, INTER_QUANT: tl.constexpr = 0, NATIVE_CAST: tl.constexpr = True,
):
    """GEMM1 over the dispatch layout: the main tiles, or (HAS_SMALL) the small-batch ones when
    dispatch built their layout (INTERLEAVE, SWAP_AB: the main tiles')."""
    num_m_blocks, block_end = _layout_in_use(num_blocks_ptr, block_end_ptr, num_experts, NUM_BINS)
    if HAS_SMALL:
        # Dispatch built one of the two layouts (its block_end is the one in block_end_ptr) and set
        # the other's M-block count to 0: one launch serves both regimes.
        num_small_blocks = tl.load(num_blocks_ptr + 1)
        if num_small_blocks > 0:
            _gemm1_tiles(x_ptr, w13_small_arg, sorted_slots_ptr, num_small_blocks, block_end, x_scale_ptr,
                         w13_scale_ptr, inter_ptr, inter_scale_ptr, hidden, inter, expert_stride, up_offset,
                         x_scale_stride, w_scale_expert_stride, w_scale_row_stride, up_scale_row,
                         up_scale_offset, TOP_K, ACTIVATION, QUANT, UPCAST, SMALL_BLOCK_M, SMALL_BLOCK_N,
                         SMALL_BLOCK_K, SMALL_GROUP_M, SMALL_EVEN_K, DOT_PRECISION, SMALL_USE_TMA, ROWWISE,
                         False, False, INTER_QUANT, NATIVE_CAST)
        else:
            _gemm1_tiles(x_ptr, w13_arg, sorted_slots_ptr, num_m_blocks, block_end, x_scale_ptr,
                         w13_scale_ptr, inter_ptr, inter_scale_ptr, hidden, inter, expert_stride, up_offset,
                         x_scale_stride, w_scale_expert_stride, w_scale_row_stride, up_scale_row,
                         up_scale_offset, TOP_K, ACTIVATION, QUANT, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K,
                         GROUP_M, EVEN_K, DOT_PRECISION, USE_TMA, ROWWISE, INTERLEAVE, SWAP_AB, INTER_QUANT,
                         NATIVE_CAST)
    else:
        _gemm1_tiles(x_ptr, w13_arg, sorted_slots_ptr, num_m_blocks, block_end, x_scale_ptr,
                     w13_scale_ptr, inter_ptr, inter_scale_ptr, hidden, inter, expert_stride, up_offset,
                     x_scale_stride, w_scale_expert_stride, w_scale_row_stride, up_scale_row, up_scale_offset,
                     TOP_K, ACTIVATION, QUANT, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K,
                     DOT_PRECISION, USE_TMA, ROWWISE, INTERLEAVE, SWAP_AB, INTER_QUANT, NATIVE_CAST)


@triton.jit
def _gemm1_kernel(
    # inputs
    x_ptr,  # [T, H] x, or (QUANT) its fp8 rows
    w13_arg,  # pointer to [E, 2I, H] (gate rows [0, I), up rows [I, 2I)), or with USE_TMA a
    #           tensor descriptor over its [E*2I, H] view with [BLOCK_N, BLOCK_K] boxes
    w13_small_arg,  # HAS_SMALL: w13 again, with SMALL_USE_TMA a descriptor with the small tiles' boxes
    w13_few_arg,  # FEW > 0: w13 again, with FEW_USE_TMA a descriptor with the few-slot tiles' boxes
    sorted_slots_ptr,  # [capacity] int32, -1 in padding
    block_end_ptr,  # [E] int32
    num_blocks_ptr,  # [2] int32: M-blocks of the main layout, of the small-batch layout (one is 0)
    ids_ptr,  # FEW > 0: [T, K] int32 routing ids (the few-slot path reads them itself)
    num_valid_ptr,  # FEW > 0 and HAS_NUM_VALID_PTR: 0-dim int32/int64
    health_ptr,  # FEW > 0 and HAS_HEALTH: [8] int64
    x_scale_ptr,  # QUANT: [T, x_scale_stride] float32 per-token (1) or 1x128-group scales of x
    w13_scale_ptr,  # QUANT 1: [E] or [E, 2] float32; QUANT 2: [E, rows of 128-blocks, ceil(H/128)]
    # outputs
    inter_ptr,  # [capacity, I]: rows at sorted positions, or at slot numbers on the few-slot path;
    #             INTER_QUANT: the fp8 codes of those rows
    inter_scale_ptr,  # INTER_QUANT: [capacity, ceil(I/128)] float32 scales of the intermediate rows
    # shapes
    num_valid_count,
    num_tokens,
    hidden,
    inter,
    num_experts,
    expert_stride,  # 2 * I * H
    up_offset,  # I * H
    x_scale_stride,  # QUANT: scale columns per x row
    w_scale_expert_stride,  # QUANT: scales per expert
    w_scale_row_stride,  # QUANT 2: scale columns per 128-row block (ceil(H/128))
    up_scale_row,  # QUANT 2: up row n's scale row is (up_scale_row + n) // 128 + up_scale_offset
    up_scale_offset,  # QUANT 1: index of the up scale in an expert's scales (0 or 1)
    TOP_K: tl.constexpr,
    ACTIVATION: tl.constexpr,
    NUM_BINS: tl.constexpr,
    QUANT: tl.constexpr,  # 0: none; 1: fp8 per-tensor weights, per-token x; 2: fp8 128x128 blocks;
    #                       3: 2 with every tile's columns in one weight block (Fp8Operands.code;
    #                       GEMM2 also 4: 256-column tiles as two such halves)
    UPCAST: tl.constexpr,  # interpreter with bf16 operands: multiply in fp32
    # tunable: main tiles (layout 0)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_TMA: tl.constexpr,
    INTERLEAVE: tl.constexpr,  # one [BLOCK_K, 2 BLOCK_N] gate/up weight tile per K step (_gemm1_tile)
    SWAP_AB: tl.constexpr,  # the weights on the MMA's M side (_mma)
    # tunable: small-batch tiles (layout 1), used when HAS_SMALL and num_blocks[1] > 0
    HAS_SMALL: tl.constexpr,
    SMALL_BLOCK_M: tl.constexpr,
    SMALL_BLOCK_N: tl.constexpr,
    SMALL_BLOCK_K: tl.constexpr,
    SMALL_GROUP_M: tl.constexpr,
    SMALL_EVEN_K: tl.constexpr,
    SMALL_USE_TMA: tl.constexpr,
    # few-slot path (FEW > 0): num_valid * K <= FEW slots (read on the device), or always (ONLY_FEW)
    FEW: tl.constexpr,
    ONLY_FEW: tl.constexpr,
    FEW_BLOCK_N: tl.constexpr,
    FEW_BLOCK_K: tl.constexpr,
    FEW_EVEN_K: tl.constexpr,
    FEW_USE_TMA: tl.constexpr,
    HAS_NUM_VALID_PTR: tl.constexpr,
    IDS_COMPLETE: tl.constexpr,  # FEW > 0: every row's ids written by the caller's router (_load_few_ids)
    HAS_HEALTH: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
    ROWWISE: tl.constexpr,  # interpreter in batch-invariant mode: see _mma
    INTER_QUANT: tl.constexpr,  # fp8 block mode: the intermediate quantised in the epilogue (_gemm1_tile)
    NATIVE_CAST: tl.constexpr,  # compiled: the fp8 cast rounds (act_quant._codes)
):
    wait_for_previous_kernel(USE_PDL)
    if FEW > 0:
        raw_ids, valid_slots = _load_few_ids(ids_ptr, num_valid_ptr, num_valid_count, num_tokens, TOP_K, FEW,
                                             HAS_NUM_VALID_PTR, IDS_COMPLETE)
        if valid_slots <= FEW:
            _gemm1_few_tiles(x_ptr, w13_few_arg, raw_ids, valid_slots, num_experts, health_ptr, x_scale_ptr,
                             w13_scale_ptr, inter_ptr, hidden, inter, expert_stride, up_offset,
                             x_scale_stride, w_scale_expert_stride, w_scale_row_stride, up_scale_row,
                             up_scale_offset, TOP_K, ACTIVATION, QUANT, UPCAST, FEW, FEW_BLOCK_N,
                             FEW_BLOCK_K, FEW_EVEN_K, DOT_PRECISION, FEW_USE_TMA, ROWWISE, HAS_HEALTH)
        elif not ONLY_FEW:  # (compiled out when every call takes the few-slot path)
            _gemm1_layout_tiles(x_ptr, w13_arg, w13_small_arg, sorted_slots_ptr, block_end_ptr,
                                num_blocks_ptr, x_scale_ptr, w13_scale_ptr, inter_ptr, inter_scale_ptr,
                                hidden, inter, num_experts, expert_stride, up_offset, x_scale_stride,
                                w_scale_expert_stride, w_scale_row_stride, up_scale_row, up_scale_offset,
                                TOP_K, ACTIVATION, NUM_BINS, QUANT, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K,
                                GROUP_M, EVEN_K, USE_TMA, HAS_SMALL, SMALL_BLOCK_M, SMALL_BLOCK_N,
                                SMALL_BLOCK_K, SMALL_GROUP_M, SMALL_EVEN_K, SMALL_USE_TMA, DOT_PRECISION,
                                ROWWISE, INTERLEAVE, SWAP_AB, INTER_QUANT, NATIVE_CAST)
    else:
        _gemm1_layout_tiles(x_ptr, w13_arg, w13_small_arg, sorted_slots_ptr, block_end_ptr, num_blocks_ptr,
                            x_scale_ptr, w13_scale_ptr, inter_ptr, inter_scale_ptr, hidden, inter,
                            num_experts, expert_stride, up_offset, x_scale_stride, w_scale_expert_stride,
                            w_scale_row_stride, up_scale_row, up_scale_offset, TOP_K, ACTIVATION, NUM_BINS,
                            QUANT, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K, USE_TMA, HAS_SMALL,
                            SMALL_BLOCK_M, SMALL_BLOCK_N, SMALL_BLOCK_K, SMALL_GROUP_M, SMALL_EVEN_K,
                            SMALL_USE_TMA, DOT_PRECISION, ROWWISE, INTERLEAVE, SWAP_AB, INTER_QUANT,
                            NATIVE_CAST)


@triton.jit
def _gemm2_tile(
    inter_ptr, w2_arg, weights_ptr, n_block, expert, rows, slots, inter_scale_ptr, w2_scale_ptr,
    y_ptr, hidden, inter, expert_stride, inter_scale_stride, w_scale_expert_stride, w_scale_row_stride,
    QUANT: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, ROWWISE: tl.constexpr, SWAP_AB: tl.constexpr = False,
):
    """One GEMM2 tile: y rows of `slots` (columns of N-block n_block, each scaled by its slot's
    routing weight) from the intermediate rows `rows` and expert `expert`'s w2 (arguments as in
    _gemm2_kernel). SWAP_AB: the K loop accumulates the transpose (see _mma)."""
    row_ok = slots >= 0
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    w_cols = (cols % hidden).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    rows64 = rows.to(tl.int64)
    # Padding rows of the intermediate were never written: masked, never read.
    a_ptrs = inter_ptr + rows64[:, None] * inter + ks[None, :]
    a_scale_rows = inter_scale_ptr + rows64 * inter_scale_stride
    w_scales = w2_scale_ptr + expert.to(tl.int64) * w_scale_expert_stride
    if QUANT >= 3:  # the tile's columns lie in one 128-row block of w2
        w_scale_rows = w_scales + ((n_block * BLOCK_N) // SCALE_BLOCK) * w_scale_row_stride
    else:  # QUANT 2: each output column's row of block scales
        w_scale_rows = w_scales + (w_cols // SCALE_BLOCK) * w_scale_row_stride
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_TMA:
        w_row = expert * hidden + n_block * BLOCK_N
        for k in range(0, tl.cdiv(inter, BLOCK_K)):
            a = _operand(_k_step_rows(a_ptrs, row_ok, ks, k, inter, BLOCK_K, EVEN_K), UPCAST)
            b = _operand(w2_arg.load([w_row, k * BLOCK_K]), UPCAST)
            a_scale = _group_scale(a_scale_rows, row_ok, k, BLOCK_K, QUANT)
            acc = _mma(acc, a, b.T, a_scale, w_scale_rows, k, BLOCK_K, QUANT, DOT_PRECISION, ROWWISE, SWAP_AB)
            a_ptrs += BLOCK_K
    else:
        b_ptrs = w2_arg + expert.to(tl.int64) * expert_stride + w_cols[None, :] * inter + ks[:, None]
        for k in range(0, tl.cdiv(inter, BLOCK_K)):
            a = _operand(_k_step_rows(a_ptrs, row_ok, ks, k, inter, BLOCK_K, EVEN_K), UPCAST)
            b = _operand(_k_step_weights(b_ptrs, ks, k, inter, BLOCK_K, EVEN_K), UPCAST)
            a_scale = _group_scale(a_scale_rows, row_ok, k, BLOCK_K, QUANT)
            acc = _mma(acc, a, b, a_scale, w_scale_rows, k, BLOCK_K, QUANT, DOT_PRECISION, ROWWISE, SWAP_AB)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
    if SWAP_AB:
        acc = tl.trans(acc)
    acc = _dequantize(acc, a_scale_rows, row_ok, w_scales, QUANT)
    safe_slots = tl.where(row_ok, slots, 0)
    weight = tl.load(weights_ptr + safe_slots, mask=row_ok, other=0.0)
    acc = acc * weight[:, None]
    out_ptrs = y_ptr + safe_slots.to(tl.int64)[:, None] * hidden + cols[None, :]
    tl.store(out_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < hidden)[None, :])


@triton.jit
def _gemm2_halves_tile(
    inter_ptr, w2_arg, weights_ptr, n_block, expert, rows, slots, inter_scale_ptr, w2_scale_ptr,
    y_ptr, hidden, inter, expert_stride, inter_scale_stride, w_scale_expert_stride, w_scale_row_stride,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, ROWWISE: tl.constexpr,
    SWAP_AB: tl.constexpr = False,
):
    """QUANT 4 (fp8 block mode, BLOCK_N = 256): one GEMM2 tile as two 128-column halves sharing
    each K step's A tile, each half one 128-row block of w2 with one weight scale, promoted with
    a [BLOCK_M] scale vector like QUANT 3 (twice the MMA work per wait on the promotion, A loaded
    once). w2_arg's boxes, if a descriptor, are [128, BLOCK_K]; otherwise as _gemm2_tile."""
    row_ok = slots >= 0
    lo_cols = n_block * BLOCK_N + tl.arange(0, SCALE_BLOCK)
    hi_cols = lo_cols + SCALE_BLOCK
    ks = tl.arange(0, BLOCK_K)
    rows64 = rows.to(tl.int64)
    a_ptrs = inter_ptr + rows64[:, None] * inter + ks[None, :]
    a_scale_rows = inter_scale_ptr + rows64 * inter_scale_stride
    w_scales = w2_scale_ptr + expert.to(tl.int64) * w_scale_expert_stride
    lo_scales = w_scales + (2 * n_block) * w_scale_row_stride
    # Past H (H % 256 != 0) the high half is never stored: its scale row is clamped in bounds.
    hi_scales = w_scales + tl.minimum(2 * n_block + 1, tl.cdiv(hidden, SCALE_BLOCK) - 1) * w_scale_row_stride
    acc_lo = tl.zeros((BLOCK_M, SCALE_BLOCK), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_M, SCALE_BLOCK), dtype=tl.float32)
    if USE_TMA:
        w_row = expert * hidden + n_block * BLOCK_N
        acc_lo, acc_hi = _two_weight_tiles(
            a_ptrs, row_ok, a_scale_rows, w2_arg, 0, 0, w_row, w_row + SCALE_BLOCK, lo_scales, hi_scales,
            inter, acc_lo, acc_hi, 4, UPCAST, BLOCK_K, EVEN_K, DOT_PRECISION, True, ROWWISE, SWAP_AB)
    else:
        # Columns past H wrap onto valid rows of w2 (loads need no mask); they are never stored.
        w_expert = w2_arg + expert.to(tl.int64) * expert_stride + ks[:, None]
        acc_lo, acc_hi = _two_weight_tiles(
            a_ptrs, row_ok, a_scale_rows, w2_arg, w_expert + (lo_cols % hidden).to(tl.int64)[None, :] * inter,
            w_expert + (hi_cols % hidden).to(tl.int64)[None, :] * inter, 0, 0, lo_scales, hi_scales,
            inter, acc_lo, acc_hi, 4, UPCAST, BLOCK_K, EVEN_K, DOT_PRECISION, False, ROWWISE, SWAP_AB)
    safe_slots = tl.where(row_ok, slots, 0)
    weight = tl.load(weights_ptr + safe_slots, mask=row_ok, other=0.0)
    out_rows = y_ptr + safe_slots.to(tl.int64)[:, None] * hidden
    tl.store(out_rows + lo_cols[None, :], (acc_lo * weight[:, None]).to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (lo_cols < hidden)[None, :])
    tl.store(out_rows + hi_cols[None, :], (acc_hi * weight[:, None]).to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (hi_cols < hidden)[None, :])


@triton.jit
def _gemm2_tiles(
    inter_ptr, w2_arg, weights_ptr, sorted_slots_ptr, num_m_blocks, block_end, inter_scale_ptr, w2_scale_ptr,
    y_ptr, hidden, inter, expert_stride, inter_scale_stride, w_scale_expert_stride, w_scale_row_stride,
    QUANT: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, ROWWISE: tl.constexpr, SWAP_AB: tl.constexpr = False,
):
    """GEMM2's persistent tile loop over `num_m_blocks` M-blocks of BLOCK_M rows of the dispatch
    layout with one set of tiles."""
    num_n_blocks = tl.cdiv(hidden, BLOCK_N)
    for tile in range(tl.program_id(0), num_m_blocks * num_n_blocks, tl.num_programs(0)):
        n_block, expert, rows, slots = _tile_rows(tile, num_m_blocks, num_n_blocks, block_end,
                                                  sorted_slots_ptr, BLOCK_M, GROUP_M)
        if QUANT == 4:
            _gemm2_halves_tile(inter_ptr, w2_arg, weights_ptr, n_block, expert, rows, slots, inter_scale_ptr,
                               w2_scale_ptr, y_ptr, hidden, inter, expert_stride, inter_scale_stride,
                               w_scale_expert_stride, w_scale_row_stride, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K,
                               EVEN_K, DOT_PRECISION, USE_TMA, ROWWISE, SWAP_AB)
        else:
            _gemm2_tile(inter_ptr, w2_arg, weights_ptr, n_block, expert, rows, slots, inter_scale_ptr,
                        w2_scale_ptr, y_ptr, hidden, inter, expert_stride, inter_scale_stride,
                        w_scale_expert_stride, w_scale_row_stride, QUANT, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K,
                        EVEN_K, DOT_PRECISION, USE_TMA, ROWWISE, SWAP_AB)


@triton.jit
def _gemm2_few_tiles(
    inter_ptr, w2_arg, weights_ptr, raw_ids, valid_slots, num_experts, inter_scale_ptr, w2_scale_ptr,
    y_ptr, hidden, inter, expert_stride, inter_scale_stride, w_scale_expert_stride, w_scale_row_stride,
    QUANT: tl.constexpr, UPCAST: tl.constexpr, FEW: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, ROWWISE: tl.constexpr,
):
    """GEMM2 over the few-slot layout, the tiles of _gemm1_few_tiles."""
    slot, expert, rank, leaders, _ = _few_slots(raw_ids, valid_slots, num_experts, FEW)
    num_n_blocks = tl.cdiv(hidden, BLOCK_N)
    for tile in range(tl.program_id(0), leaders * num_n_blocks, tl.num_programs(0)):
        n_block, tile_expert, rows, slots = _few_tile_rows(tile, num_n_blocks, slot, expert, rank)
        _gemm2_tile(inter_ptr, w2_arg, weights_ptr, n_block, tile_expert, rows, slots, inter_scale_ptr,
                    w2_scale_ptr, y_ptr, hidden, inter, expert_stride, inter_scale_stride,
                    w_scale_expert_stride, w_scale_row_stride, QUANT, UPCAST, FEW, BLOCK_N, BLOCK_K, EVEN_K,
                    DOT_PRECISION, USE_TMA, ROWWISE)


@triton.jit
def _gemm2_layout_tiles(
    inter_ptr, w2_arg, w2_small_arg, weights_ptr, sorted_slots_ptr, block_end_ptr, num_blocks_ptr,
    inter_scale_ptr, w2_scale_ptr, y_ptr, hidden, inter, num_experts, expert_stride, inter_scale_stride,
    w_scale_expert_stride, w_scale_row_stride,
    NUM_BINS: tl.constexpr, QUANT: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
    USE_TMA: tl.constexpr, HAS_SMALL: tl.constexpr, SMALL_BLOCK_M: tl.constexpr, SMALL_BLOCK_N: tl.constexpr,
    SMALL_BLOCK_K: tl.constexpr, SMALL_GROUP_M: tl.constexpr, SMALL_EVEN_K: tl.constexpr,
    SMALL_USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, ROWWISE: tl.constexpr,
    SWAP_AB: tl.constexpr = False,
):
    """GEMM2 over the dispatch layout, main or small-batch tiles as in _gemm1_layout_tiles."""
    num_m_blocks, block_end = _layout_in_use(num_blocks_ptr, block_end_ptr, num_experts, NUM_BINS)
    if HAS_SMALL:
        num_small_blocks = tl.load(num_blocks_ptr + 1)
        if num_small_blocks > 0:
            _gemm2_tiles(inter_ptr, w2_small_arg, weights_ptr, sorted_slots_ptr, num_small_blocks, block_end,
                         inter_scale_ptr, w2_scale_ptr, y_ptr, hidden, inter, expert_stride,
                         inter_scale_stride, w_scale_expert_stride, w_scale_row_stride, QUANT, UPCAST,
                         SMALL_BLOCK_M, SMALL_BLOCK_N, SMALL_BLOCK_K, SMALL_GROUP_M, SMALL_EVEN_K,
                         DOT_PRECISION, SMALL_USE_TMA, ROWWISE)
        else:
            _gemm2_tiles(inter_ptr, w2_arg, weights_ptr, sorted_slots_ptr, num_m_blocks, block_end,
                         inter_scale_ptr, w2_scale_ptr, y_ptr, hidden, inter, expert_stride,
                         inter_scale_stride, w_scale_expert_stride, w_scale_row_stride, QUANT, UPCAST,
                         BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K, DOT_PRECISION, USE_TMA, ROWWISE, SWAP_AB)
    else:
        _gemm2_tiles(inter_ptr, w2_arg, weights_ptr, sorted_slots_ptr, num_m_blocks, block_end,
                     inter_scale_ptr, w2_scale_ptr, y_ptr, hidden, inter, expert_stride, inter_scale_stride,
                     w_scale_expert_stride, w_scale_row_stride, QUANT, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K,
                     GROUP_M, EVEN_K, DOT_PRECISION, USE_TMA, ROWWISE, SWAP_AB)


@triton.jit
def _gemm2_kernel(
    # inputs
    inter_ptr,  # [capacity, I] intermediate, or (QUANT) its fp8 rows
    w2_arg,  # pointer to [E, H, I], or with USE_TMA a descriptor over [E*H, I], [BLOCK_N, BLOCK_K] boxes
    w2_small_arg,  # HAS_SMALL: w2 again, with SMALL_USE_TMA a descriptor with the small tiles' boxes
    w2_few_arg,  # FEW > 0: w2 again, with FEW_USE_TMA a descriptor with the few-slot tiles' boxes
    weights_ptr,  # [T, K] float32, indexed by slot
    sorted_slots_ptr,  # [capacity] int32, -1 in padding
    block_end_ptr,  # [E] int32
    num_blocks_ptr,  # [2] int32: M-blocks of the main layout, of the small-batch layout (one is 0)
    ids_ptr,  # FEW > 0: [T, K] int32 routing ids
    num_valid_ptr,  # FEW > 0 and HAS_NUM_VALID_PTR: 0-dim int32/int64
    inter_scale_ptr,  # QUANT: [capacity, inter_scale_stride] float32 scales of the intermediate rows
    w2_scale_ptr,  # QUANT 1: [E] float32; QUANT 2: [E, ceil(H/128), ceil(I/128)]
    # outputs
    y_ptr,  # [T*K, H]
    # shapes
    num_valid_count,
    num_tokens,
    hidden,
    inter,
    num_experts,
    expert_stride,  # H * I
    inter_scale_stride,  # QUANT: scale columns per intermediate row
    w_scale_expert_stride,  # QUANT: scales per expert
    w_scale_row_stride,  # QUANT 2: ceil(I/128)
    TOP_K: tl.constexpr,
    NUM_BINS: tl.constexpr,
    QUANT: tl.constexpr,
    UPCAST: tl.constexpr,
    # tunable: main tiles (layout 0)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_TMA: tl.constexpr,
    SWAP_AB: tl.constexpr,  # the weights on the MMA's M side (_mma)
    # tunable: small-batch tiles (layout 1), used when HAS_SMALL and num_blocks[1] > 0
    HAS_SMALL: tl.constexpr,
    SMALL_BLOCK_M: tl.constexpr,
    SMALL_BLOCK_N: tl.constexpr,
    SMALL_BLOCK_K: tl.constexpr,
    SMALL_GROUP_M: tl.constexpr,
    SMALL_EVEN_K: tl.constexpr,
    SMALL_USE_TMA: tl.constexpr,
    # few-slot path, as in _gemm1_kernel
    FEW: tl.constexpr,
    ONLY_FEW: tl.constexpr,
    FEW_BLOCK_N: tl.constexpr,
    FEW_BLOCK_K: tl.constexpr,
    FEW_EVEN_K: tl.constexpr,
    FEW_USE_TMA: tl.constexpr,
    HAS_NUM_VALID_PTR: tl.constexpr,
    IDS_COMPLETE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
    ROWWISE: tl.constexpr,  # interpreter in batch-invariant mode: see _mma
):
    wait_for_previous_kernel(USE_PDL)
    if FEW > 0:
        raw_ids, valid_slots = _load_few_ids(ids_ptr, num_valid_ptr, num_valid_count, num_tokens, TOP_K, FEW,
                                             HAS_NUM_VALID_PTR, IDS_COMPLETE)
        if valid_slots <= FEW:
            _gemm2_few_tiles(inter_ptr, w2_few_arg, weights_ptr, raw_ids, valid_slots, num_experts,
                             inter_scale_ptr, w2_scale_ptr, y_ptr, hidden, inter, expert_stride,
                             inter_scale_stride, w_scale_expert_stride, w_scale_row_stride, QUANT, UPCAST,
                             FEW, FEW_BLOCK_N, FEW_BLOCK_K, FEW_EVEN_K, DOT_PRECISION, FEW_USE_TMA, ROWWISE)
        elif not ONLY_FEW:  # (compiled out when every call takes the few-slot path)
            _gemm2_layout_tiles(inter_ptr, w2_arg, w2_small_arg, weights_ptr, sorted_slots_ptr, block_end_ptr,
                                num_blocks_ptr, inter_scale_ptr, w2_scale_ptr, y_ptr, hidden, inter,
                                num_experts, expert_stride, inter_scale_stride, w_scale_expert_stride,
                                w_scale_row_stride, NUM_BINS, QUANT, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K,
                                GROUP_M, EVEN_K, USE_TMA, HAS_SMALL, SMALL_BLOCK_M, SMALL_BLOCK_N,
                                SMALL_BLOCK_K, SMALL_GROUP_M, SMALL_EVEN_K, SMALL_USE_TMA, DOT_PRECISION,
                                ROWWISE, SWAP_AB)
    else:
        _gemm2_layout_tiles(inter_ptr, w2_arg, w2_small_arg, weights_ptr, sorted_slots_ptr, block_end_ptr,
                            num_blocks_ptr, inter_scale_ptr, w2_scale_ptr, y_ptr, hidden, inter, num_experts,
                            expert_stride, inter_scale_stride, w_scale_expert_stride, w_scale_row_stride,
                            NUM_BINS, QUANT, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K, USE_TMA,
                            HAS_SMALL, SMALL_BLOCK_M, SMALL_BLOCK_N, SMALL_BLOCK_K, SMALL_GROUP_M,
                            SMALL_EVEN_K, SMALL_USE_TMA, DOT_PRECISION, ROWWISE, SWAP_AB)


@triton.jit
def _few_gemms_kernel(
    x_ptr,  # [T, H]
    w13_arg,  # [E, 2I, H], or with USE_TMA1 a descriptor over [E*2I, H] with [BLOCK_N1, BLOCK_K1] boxes
    w2_arg,  # [E, H, I], or with USE_TMA2 a descriptor over [E*H, I] with [BLOCK_N2, BLOCK_K2] boxes
    weights_ptr,  # [T, K] float32, indexed by slot
    ids_ptr,  # [T, K] int32
    num_valid_ptr,  # HAS_NUM_VALID_PTR: 0-dim int32/int64
    health_ptr,  # HAS_HEALTH: [8] int64
    sync_ptr,  # [>= 2 + FEW] int32, zero on entry and on exit: claimed tiles, programs done,
    #            finished GEMM1 tiles of each leader
    inter_ptr,  # [>= FEW, I] intermediate, row = slot
    y_ptr,  # [T*K, H]
    num_valid_count, num_tokens, hidden, inter, num_experts, w13_expert_stride, up_offset, w2_expert_stride,
    TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, UPCAST: tl.constexpr, FEW: tl.constexpr,
    BLOCK_N1: tl.constexpr, BLOCK_K1: tl.constexpr, EVEN_K1: tl.constexpr, USE_TMA1: tl.constexpr,
    BLOCK_N2: tl.constexpr, BLOCK_K2: tl.constexpr, EVEN_K2: tl.constexpr, USE_TMA2: tl.constexpr,
    HAS_NUM_VALID_PTR: tl.constexpr, IDS_COMPLETE: tl.constexpr, HAS_HEALTH: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, ONLY: tl.constexpr = True,
    PACKED: tl.constexpr = False, TILE_M: tl.constexpr = 16,
):
    """GEMM1 and GEMM2 of the few-slot path in one launch (a bucket whose every batch has at most
    FEW valid slots, or with ONLY False a larger bucket's batch that has: a batch with more valid
    slots, read on the device, returns at once and leaves the work to the dispatch layout's GEMM
    launches that follow): the tiles of _gemm1_few_tiles, then those of _gemm2_few_tiles, in one order
    (GEMM1's leader by leader, then GEMM2's), each program taking the next tile from a counter.
    A GEMM2 tile waits until its leader's GEMM1 tiles are done (an acquire on the leader's
    counter, which each finished GEMM1 tile increments with release semantics after its stores):
    GEMM2's weights stream while the last GEMM1 tiles finish instead of after a kernel boundary.
    No deadlock whatever the grid or residency: tiles are claimed in order, so the GEMM1 tiles a
    waiting program needs were claimed earlier by programs that are running and never wait (a
    program claims its next tile before working on its current one, and holds an unstarted GEMM1
    tile only while it works on a GEMM1 tile). The last program out zeroes the counters. TILE_M:
    the tiles' rows, FEW (every slot number a row) or, PACKED (PACK_FUSED_ROWS), a divisor of FEW
    into which each expert's slots are packed (`_few_groups`; a leader is then a group's). Either
    way a row's result does not depend on the other rows of its tile."""
    wait_for_previous_kernel(USE_PDL)
    raw_ids, valid_slots = _load_few_ids(ids_ptr, num_valid_ptr, num_valid_count, num_tokens, TOP_K, FEW,
                                         HAS_NUM_VALID_PTR, IDS_COMPLETE)
    if ONLY or valid_slots <= FEW:  # the same on every program: all run the counters or none
        if PACKED:
            slot, expert, position, rank, leaders, dropped = _few_groups(
                raw_ids, valid_slots, num_experts, FEW, TILE_M)
        else:
            slot, expert, rank, leaders, dropped = _few_slots(raw_ids, valid_slots, num_experts, FEW)
        if HAS_HEALTH:  # noqa: SIM102 (a constexpr guard: the atomic is not compiled without health)
            if tl.program_id(0) == 0:
                tl.atomic_add(health_ptr + 1, dropped, sem="relaxed")
        n1_blocks = tl.cdiv(inter, BLOCK_N1)
        n2_blocks = tl.cdiv(hidden, BLOCK_N2)
        gemm1_tiles = leaders * n1_blocks
        all_tiles = gemm1_tiles + leaders * n2_blocks
        claimed = sync_ptr
        done = sync_ptr + 1
        ready = sync_ptr + 2
        tile = tl.atomic_add(claimed, 1, sem="relaxed")
        while tile < all_tiles:
            next_tile = tl.atomic_add(claimed, 1, sem="relaxed")
            if tile < gemm1_tiles:
                if PACKED:
                    n_block, tile_expert, rows, slots = _few_group_rows(
                        tile, n1_blocks, slot, expert, position, rank, TILE_M)
                else:
                    n_block, tile_expert, rows, slots = _few_tile_rows(tile, n1_blocks, slot, expert, rank)
                _gemm1_tile(x_ptr, w13_arg, n_block, tile_expert, rows, slots, x_ptr, x_ptr, inter_ptr,
                            inter_ptr, hidden, inter, w13_expert_stride, up_offset, 0, 0, 0, 0, 0, TOP_K,
                            ACTIVATION, 0, UPCAST, TILE_M, BLOCK_N1, BLOCK_K1, EVEN_K1, DOT_PRECISION,
                            USE_TMA1, False)
                # every thread's stores before the release (as dispatch's ticket)
                tl.debug_barrier()
                tl.atomic_add(ready + tile // n1_blocks, 1, sem="release")
            else:
                gemm2_tile = tile - gemm1_tiles
                while tl.atomic_add(ready + gemm2_tile // n2_blocks, 0, sem="acquire") < n1_blocks:
                    pass
                if PACKED:
                    n_block, tile_expert, rows, slots = _few_group_rows(
                        gemm2_tile, n2_blocks, slot, expert, position, rank, TILE_M)
                else:
                    n_block, tile_expert, rows, slots = _few_tile_rows(gemm2_tile, n2_blocks, slot, expert,
                                                                       rank)
                _gemm2_tile(inter_ptr, w2_arg, weights_ptr, n_block, tile_expert, rows, slots, inter_ptr,
                            x_ptr, y_ptr, hidden, inter, w2_expert_stride, 0, 0, 0, 0, UPCAST, TILE_M,
                            BLOCK_N2, BLOCK_K2, EVEN_K2, DOT_PRECISION, USE_TMA2, False)
            tile = next_tile
        if tl.atomic_add(done, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            # every other program has made its last claim and finished its last tile
            tl.store(claimed, 0)
            tl.store(done, 0)
            tl.store(ready + tl.arange(0, FEW), tl.zeros((FEW,), dtype=tl.int32))


@functools.lru_cache(maxsize=1)
def _tensor_descriptor_class() -> type | None:
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    return TensorDescriptor


def _use_tma(weight: torch.Tensor, tiles: GemmTiles) -> bool:
    """TMA boxes need a descriptor class, 16-byte aligned rows and base, and boxes <= 256 wide."""
    if not tiles.tma:
        return False
    # TMA is Hopper's (sm_90+); a config asking for it elsewhere loads through pointers
    if not (hopper_or_newer(weight.device) or (weight.device.type != "cuda" and interpreter_enabled())):
        return False
    if _tensor_descriptor_class() is None:
        return False
    elem = weight.element_size()
    aligned = (weight.shape[-1] * elem) % 16 == 0 and weight.data_ptr() % 16 == 0
    return aligned and max(tiles.block_n, tiles.block_k) <= 256 and tiles.block_k * elem >= 16


def _weight_operand(weight: torch.Tensor, tiles: GemmTiles) -> object:
    """The weight [E, R, C] (contiguous) as a GEMM kernel takes it: the tensor (a pointer), or a
    TMA descriptor over its [E*R, C] rows with [block_n, block_k] boxes."""
    descriptor = _tensor_descriptor_class()
    if descriptor is None or not _use_tma(weight, tiles):
        return weight
    num_experts, rows, cols = weight.shape
    return descriptor(weight, [num_experts * rows, cols], [cols, 1], [tiles.block_n, tiles.block_k])


def _interleaved_operand(w13: torch.Tensor, tiles: GemmTiles) -> object:
    """w13 [E, 2I, H] (contiguous) for GEMM1's interleave with TMA: a descriptor over it seen as
    [E, I, 2, H] (strides 2IH, H, IH, 1), whose [1, block_n, 2, block_k] boxes put gate row c and
    up row c of an expert next to each other; zeros past I and H."""
    descriptor = _tensor_descriptor_class()
    assert descriptor is not None
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    return descriptor(w13, [num_experts, inter, 2, hidden], [two_inter * hidden, hidden, inter * hidden, 1],
                      [1, tiles.block_n, 2, tiles.block_k])


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: IEEE fp32 products (the default would be tf32, off the reference's tolerance).
    return "ieee" if dtype == torch.float32 else "tf32"


@dataclass(frozen=True)
class Fp8Operands:
    """What the fp8 GEMMs read besides their fp8 A rows and weights: the validated weight scales
    and the workspace views holding the quantised x and intermediate with their scales."""

    weights: Fp8Weights
    views: Fp8Views

    def code(self, tiles: tuple[GemmTiles | None, ...], up_aligned: bool = True, halves: bool = False) -> int:
        """The kernels' QUANT: 1 per-tensor; block mode 3 when the columns of every tile of the
        launch lie in one 128-row weight block (block_n <= 128, and for w13 the up rows start a
        block: gate and up quantised apart, or I % 128 == 0), so each K step's weight scale is one
        number per tile; with `halves` (GEMM2), 4 when every tile is 256 columns wide (two
        128-column halves, one scale each: _gemm2_halves_tile); else 2 (a scale per column)."""
        code = _QUANT_CODES[self.weights.mode]
        if code != 2:
            return code
        widths = [t.block_n for t in tiles if t is not None]
        if halves and all(w == 2 * FP8_BLOCK for w in widths):
            return 4
        return 3 if up_aligned and all(w <= FP8_BLOCK for w in widths) else 2

    @property
    def group(self) -> int | None:
        """Columns per activation scale: 128 (block mode), None (one per row: per token)."""
        return FP8_BLOCK if self.weights.mode == "block" else None


def _weight_scale_strides(scale: torch.Tensor, mode: str,
                          up_rows: tuple[int, int] = (0, 0)) -> dict[str, int]:
    """Kernel arguments locating an expert's weight scales: scales per expert, scale columns per
    128-row block (block mode), and (w13) where the up rows' scales start."""
    if mode == "block":
        row_blocks, col_blocks = scale.shape[1], scale.shape[2]
        return {"w_scale_expert_stride": row_blocks * col_blocks, "w_scale_row_stride": col_blocks,
                "up_scale_row": up_rows[0], "up_scale_offset": up_rows[1]}
    per_expert = scale[0].numel()  # 1, or 2 (gate, up)
    return {"w_scale_expert_stride": per_expert, "w_scale_row_stride": 0, "up_scale_row": 0,
            "up_scale_offset": per_expert - 1}


_NO_SCALES = {"w_scale_expert_stride": 0, "w_scale_row_stride": 0, "up_scale_row": 0, "up_scale_offset": 0}


def _upcast(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and interpreter_enabled()


@dataclass(frozen=True)
class FewSlots:
    """The few-slot path of one call: the tiles its GEMMs run (`config`'s gemm1/gemm2; its block_m
    is `rows()` whatever the config says), what its programs read to build the layout (ids,
    num_valid, and health for the slots they drop), and `only`: every call takes it, T*K <=
    FEW_SLOTS or a fused bucket of T*K <= fused_slots() (no dispatch launch; the GEMMs are compiled
    with this path alone)."""

    config: ExpertsConfig
    ids: torch.Tensor
    num_valid: NumValid
    health: torch.Tensor | None
    only: bool
    ids_complete: bool = False

    def rows(self) -> int:
        """The most slots the path serves (its FEW; its tiles' rows unless packed): T*K to the next
        power of two in a fused bucket of more than FEW_SLOTS slots, else FEW_SLOTS."""
        slots = self.ids.numel()
        return next_power_of_2(slots) if self.only and slots > FEW_SLOTS else FEW_SLOTS

    def kernel_args(self) -> dict[str, object]:
        has_nv_ptr = self.num_valid.tensor is not None
        return {
            "ids_ptr": self.ids, "num_valid_ptr": self.num_valid.tensor if has_nv_ptr else self.ids,
            "num_valid_count": self.ids.shape[0] if self.num_valid.count is None else self.num_valid.count,
            "HAS_NUM_VALID_PTR": has_nv_ptr, "IDS_COMPLETE": self.ids_complete,
        }


def _no_few_args(ids_like: torch.Tensor, num_tokens: int) -> dict[str, object]:
    return {"ids_ptr": ids_like, "num_valid_ptr": ids_like, "num_valid_count": num_tokens,
            "HAS_NUM_VALID_PTR": False, "IDS_COMPLETE": False}


def _regimes(weight: torch.Tensor, reduction: int, out_cols: int, num_tokens: int, top_k: int,
             cfg: ExpertsConfig, tiles: GemmTiles, small: ExpertsConfig | None,
             small_tiles: GemmTiles | None, few: FewSlots | None,
             few_tiles: GemmTiles | None) -> tuple[object, object, int, dict[str, object], GemmTiles]:
    """(small weight operand, few-slot weight operand, grid, tile constexprs, tiles that set
    num_warps/num_stages) of one GEMM launch serving every tile regime it holds.

    The grid is the largest of the regimes' persistent grids (main: the M-blocks T tokens can
    produce; small: those of min(T, SMALL_BATCH_TOKENS) tokens; few: one tile per slot and
    N-block), so it depends on T alone. Without a small config, HAS_SMALL=False compiles the
    single-regime kernel; its SMALL_* constexprs then repeat the main ones (unused); likewise FEW=0
    without the few-slot path. A launch that only takes the few-slot path runs its tiles' warps
    and stages; any other, the main config's."""
    num_experts = weight.shape[0]
    n_blocks = cdiv(out_cols, tiles.block_n)
    main_count = max_m_blocks(num_tokens, num_experts, top_k, cfg.block_m) * n_blocks
    grid = persistent_grid(main_count, weight.device, cfg.programs_per_sm)
    meta: dict[str, object] = {
        "BLOCK_M": cfg.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k, "GROUP_M": tiles.group_m,
        "EVEN_K": reduction % tiles.block_k == 0, "USE_TMA": _use_tma(weight, tiles),
    }
    launch_tiles = tiles
    few_arg: object = weight
    if few is None or few_tiles is None:
        meta.update({"FEW": 0, "ONLY_FEW": False, "FEW_BLOCK_N": tiles.block_n, "FEW_BLOCK_K": tiles.block_k,
                     "FEW_EVEN_K": meta["EVEN_K"], "FEW_USE_TMA": False})
    else:
        few_count = min(FEW_SLOTS, num_tokens * top_k) * cdiv(out_cols, few_tiles.block_n)
        few_grid = persistent_grid(few_count, weight.device, few.config.programs_per_sm)
        grid = few_grid if few.only else max(grid, few_grid)
        meta.update({"FEW": FEW_SLOTS, "ONLY_FEW": few.only, "FEW_BLOCK_N": few_tiles.block_n,
                     "FEW_BLOCK_K": few_tiles.block_k, "FEW_EVEN_K": reduction % few_tiles.block_k == 0,
                     "FEW_USE_TMA": _use_tma(weight, few_tiles)})
        few_arg = _weight_operand(weight, few_tiles)
        if few.only:
            launch_tiles = few_tiles
    if small is None or small_tiles is None or (few is not None and few.only):
        meta.update({"HAS_SMALL": False, **{f"SMALL_{name}": meta[name] for name in
                                            ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "EVEN_K")}})
        meta["SMALL_USE_TMA"] = False
        return weight, few_arg, grid, meta, launch_tiles
    small_tokens = min(num_tokens, SMALL_BATCH_TOKENS)
    small_n_blocks = cdiv(out_cols, small_tiles.block_n)
    small_count = max_m_blocks(small_tokens, num_experts, top_k, small.block_m) * small_n_blocks
    grid = max(grid, persistent_grid(small_count, weight.device, small.programs_per_sm))
    meta.update({
        "HAS_SMALL": True, "SMALL_BLOCK_M": small.block_m, "SMALL_BLOCK_N": small_tiles.block_n,
        "SMALL_BLOCK_K": small_tiles.block_k, "SMALL_GROUP_M": small_tiles.group_m,
        "SMALL_EVEN_K": reduction % small_tiles.block_k == 0, "SMALL_USE_TMA": _use_tma(weight, small_tiles),
    })
    return _weight_operand(weight, small_tiles), few_arg, grid, meta, launch_tiles


# A merged launch (one_launch) has one num_warps/num_stages: the main config's. The small tiles
# were tuned with their own (e.g. H100 Qwen3 T=8 GEMM2: 8 warps, 3 stages; T=1024: 4 and 4).
# Measured on an H100 (2026-11-24, bench_compare, one round): padded decode (T=1024, 1 valid row)
# Qwen3 54.7 -> 49.6 us and gpt-oss 98.6 -> 93.5 us, but DeepSeek-V3 273 -> 289 us (its small
# GEMM2 tiles lose more to 8 warps / 3 stages than the launch saves), and full batches of
# Qwen3 T=256 +3.5% and DeepSeek-V3 T=2048 +4%.


def gemm1_into(x: torch.Tensor, w13: torch.Tensor, views: WorkspaceViews, top_k: int, activation: str,
               cfg: ExpertsConfig, *, small: ExpertsConfig | None = None, layout: int = 0,
               max_tokens: int | None = None, few: FewSlots | None = None, use_pdl: bool = False,
               fp8: Fp8Operands | None = None, rowwise: bool = False, inter_quant: bool = False) -> None:
    """GEMM1 over the dispatch layout: with `small` (the small-batch tiles) the kernel reads
    views.num_blocks[1] on the device and runs the small tiles over that layout when it is > 0,
    else `cfg`'s tiles over views.num_blocks[0]. Without `small`, `cfg`'s tiles over the layout
    views.num_blocks[layout] counts, the grid covering the M-blocks `max_tokens` (default T) tokens
    can produce. With `few`, a batch of at most FEW_SLOTS valid slots (read on the device) takes
    the few-slot path instead (always, with few.only). With fp8, x is ignored for its quantised
    rows in fp8.views (w13 is the fp8 weights). inter_quant (fp8 block mode, every tile 128*n
    columns wide: `fuses_inter_quant`): the intermediate goes to fp8.views' codes and scales, quantised
    in the epilogue, instead of to views.intermediate."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    tiles: GemmTiles = cfg.gemm1
    rows = num_tokens if max_tokens is None else max_tokens
    small_arg, few_arg, grid, meta, launch = _regimes(
        w13, hidden, inter, rows, top_k, cfg, tiles, small, small.gemm1 if small is not None else None,
        few, few.config.gemm1 if few is not None else None)
    a = x if fp8 is None else fp8.views.x
    quant = 0
    if fp8 is None:
        a_scale, w_scale, strides = x, x, dict(_NO_SCALES)
    else:
        split = fp8.weights.gate_up_split
        up_rows = (0, cdiv(inter, FP8_BLOCK)) if split else (inter, 0)
        a_scale, w_scale = fp8.views.x_scale, fp8.weights.w13_scale
        strides = _weight_scale_strides(w_scale, fp8.weights.mode, up_rows)
        quant = fp8.code((tiles, small.gemm1 if small is not None else None),
                         up_aligned=split or inter % FP8_BLOCK == 0)
    few_args = few.kernel_args() if few is not None else _no_few_args(views.sorted_slots, num_tokens)
    health = few.health if few is not None else None
    # Not in fp8 block mode: promoting each K step of the interleaved product needs a per-column
    # scale vector and a fresh [BLOCK_M, 2 BLOCK_N] product beside the accumulator, 1.5-1.9x slower
    # at T = 8192 on an H100 (docs/experts.md); per-tensor mode dequantises after the loop, like bf16.
    interleave = tiles.interleave and quant <= 1
    # interleave with TMA: gate and up rows side by side in one box ([E, I, 2, H] view)
    w13_arg = _interleaved_operand(w13, tiles) if interleave and meta["USE_TMA"] else _weight_operand(
        w13, tiles)
    inter_out, inter_scale, inter_code = views.intermediate, views.intermediate, 0
    if inter_quant:
        if fp8 is None or fp8.group != FP8_BLOCK or not fuses_inter_quant(cfg, small):
            raise ValueError("inter_quant: fp8 block mode with GEMM1 tiles 128*n columns wide")
        inter_out, inter_scale = fp8.views.inter, fp8.views.inter_scale
        # rounded as the unfused path's intermediate is stored
        inter_code = 1 if views.intermediate.dtype == torch.bfloat16 else 2
    # grid: persistent programs looping over (M-block, N-block) tiles of [used M-blocks, I / BLOCK_N]
    # (few-slot path: over (expert routed to, N-block) tiles)
    _gemm1_kernel[(grid,)](
        a, w13_arg, small_arg, few_arg, views.sorted_slots, views.block_end,
        views.num_blocks[layout:], few_args["ids_ptr"], few_args["num_valid_ptr"],
        health if health is not None else views.num_blocks,
        a_scale, w_scale,
        inter_out, inter_scale,
        few_args["num_valid_count"], num_tokens,
        hidden, inter, num_experts, 2 * inter * hidden, inter * hidden, a_scale.shape[1] if fp8 else 0,
        **strides,
        TOP_K=top_k, ACTIVATION=_ACTIVATION_CODES[activation], NUM_BINS=num_bins(num_experts),
        QUANT=quant, UPCAST=_upcast(a.dtype), **meta,
        INTERLEAVE=interleave, SWAP_AB=tiles.swap_ab and not interleave and not rowwise,
        HAS_NUM_VALID_PTR=few_args["HAS_NUM_VALID_PTR"], IDS_COMPLETE=few_args["IDS_COMPLETE"],
        HAS_HEALTH=health is not None,
        DOT_PRECISION=_dot_precision(a.dtype), USE_PDL=use_pdl, ROWWISE=rowwise,
        INTER_QUANT=inter_code, NATIVE_CAST=not interpreter_enabled(),
        num_warps=launch.num_warps, num_stages=launch.num_stages, **launch_options(use_pdl),
    )


def fuses_inter_quant(*configs: ExpertsConfig | None) -> bool:
    """GEMM1 of these configs can quantise the fp8 block-mode intermediate in its epilogue: every
    tile's columns are whole 1x128 groups."""
    return all(cfg is None or cfg.gemm1.block_n % FP8_BLOCK == 0 for cfg in configs)


def gemm2_into(w2: torch.Tensor, weights: torch.Tensor, views: WorkspaceViews, num_tokens: int, top_k: int,
               cfg: ExpertsConfig, *, small: ExpertsConfig | None = None, layout: int = 0,
               max_tokens: int | None = None, few: FewSlots | None = None, use_pdl: bool = False,
               fp8: Fp8Operands | None = None, rowwise: bool = False) -> None:
    """GEMM2 over the dispatch layout, main or small tiles (or one layout), or the few-slot path, as
    in gemm1_into; with fp8 its A rows are the quantised intermediate in fp8.views."""
    num_experts, hidden, inter = w2.shape
    tiles: GemmTiles = cfg.gemm2
    rows = num_tokens if max_tokens is None else max_tokens
    small_arg, few_arg, grid, meta, launch = _regimes(
        w2, inter, hidden, rows, top_k, cfg, tiles, small, small.gemm2 if small is not None else None,
        few, few.config.gemm2 if few is not None else None)
    a = views.intermediate if fp8 is None else fp8.views.inter
    quant = 0
    if fp8 is None:
        a_scale, w_scale, strides = a, a, dict(_NO_SCALES)
    else:
        a_scale, w_scale = fp8.views.inter_scale, fp8.weights.w2_scale
        strides = _weight_scale_strides(w_scale, fp8.weights.mode)
        quant = fp8.code((tiles, small.gemm2 if small is not None else None), halves=True)
    del strides["up_scale_row"], strides["up_scale_offset"]
    few_args = few.kernel_args() if few is not None else _no_few_args(views.sorted_slots, num_tokens)
    # grid: persistent programs looping over (M-block, N-block) tiles of [used M-blocks, H / BLOCK_N]
    # QUANT 4 loads each half's [128, block_k] box on its own
    weight_operand = _weight_operand(w2, replace(tiles, block_n=FP8_BLOCK) if quant == 4 else tiles)
    _gemm2_kernel[(grid,)](
        a, weight_operand, small_arg, few_arg, weights, views.sorted_slots, views.block_end,
        views.num_blocks[layout:], few_args["ids_ptr"], few_args["num_valid_ptr"], a_scale, w_scale,
        views.y,
        few_args["num_valid_count"], num_tokens,
        hidden, inter, num_experts, hidden * inter, a_scale.shape[1] if fp8 else 0, **strides,
        TOP_K=top_k, NUM_BINS=num_bins(num_experts), QUANT=quant, UPCAST=_upcast(a.dtype),
        SWAP_AB=tiles.swap_ab and not rowwise,
        **meta, HAS_NUM_VALID_PTR=few_args["HAS_NUM_VALID_PTR"], IDS_COMPLETE=few_args["IDS_COMPLETE"],
        DOT_PRECISION=_dot_precision(a.dtype), USE_PDL=use_pdl, ROWWISE=rowwise,
        num_warps=launch.num_warps, num_stages=launch.num_stages, **launch_options(use_pdl),
    )


def few_gemms_into(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                   views: WorkspaceViews, activation: str, few: FewSlots, use_pdl: bool = False) -> None:
    """GEMM1 and GEMM2 of the few-slot path as one launch (`_few_gemms_kernel`): same tiles, same
    per-tile code and so the same bits as gemm1_into + gemm2_into with `few`, with gemm1's
    num_warps/num_stages for both. For a bucket whose every batch takes the path (few.only), or,
    not few.only, launched before the GEMM launches of the dispatch layout (then compiled without
    the path) and returning at once when the batch has more than FEW_SLOTS valid slots."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = few.ids.shape[1]
    tiles1, tiles2 = few.config.gemm1, few.config.gemm2
    rows = few.rows()
    packed = PACK_FUSED_ROWS and rows > FEW_SLOTS
    if views.few_sync.numel() < 2 + rows:
        raise ValueError(f"workspace few_sync holds {views.few_sync.numel()} counters, the fused few-slot "
                         f"launch needs {2 + rows}")
    slots = min(rows, num_tokens * top_k)
    tiles = slots * (cdiv(inter, tiles1.block_n) + cdiv(hidden, tiles2.block_n))
    grid = persistent_grid(tiles, x.device, few.config.programs_per_sm)
    args = few.kernel_args()
    _few_gemms_kernel[(grid,)](
        x, _weight_operand(w13, tiles1), _weight_operand(w2, tiles2), weights, args["ids_ptr"],
        args["num_valid_ptr"], few.health if few.health is not None else views.few_sync, views.few_sync,
        views.intermediate, views.y,
        args["num_valid_count"], num_tokens, hidden, inter, num_experts, 2 * inter * hidden, inter * hidden,
        hidden * inter,
        TOP_K=top_k, ACTIVATION=_ACTIVATION_CODES[activation], UPCAST=_upcast(x.dtype), FEW=rows,
        BLOCK_N1=tiles1.block_n, BLOCK_K1=tiles1.block_k, EVEN_K1=hidden % tiles1.block_k == 0,
        USE_TMA1=_use_tma(w13, tiles1),
        BLOCK_N2=tiles2.block_n, BLOCK_K2=tiles2.block_k, EVEN_K2=inter % tiles2.block_k == 0,
        USE_TMA2=_use_tma(w2, tiles2),
        HAS_NUM_VALID_PTR=args["HAS_NUM_VALID_PTR"], IDS_COMPLETE=args["IDS_COMPLETE"],
        HAS_HEALTH=few.health is not None,
        DOT_PRECISION=_dot_precision(x.dtype), USE_PDL=use_pdl, ONLY=few.only,
        PACKED=packed, TILE_M=FEW_SLOTS if packed else rows,
        num_warps=tiles1.num_warps, num_stages=tiles1.num_stages, **launch_options(use_pdl),
    )


def small_batch_config(num_tokens: int, num_experts: int, hidden: int, inter: int, top_k: int,
                       dtype: torch.dtype, device: torch.device, cfg: ExpertsConfig,
                       quant: str | None = None) -> ExpertsConfig | None:
    """The tiles for few valid rows (num_valid <= SMALL_BATCH_TOKENS) in a batch whose bucket is
    larger, when the batch's own tiles are of another regime (a larger BLOCK_M): a graph captured
    for 1024 rows then replays a decode step with decode tiles instead of prefill tiles. Between
    two decode configs the switch stays off: its two extra (empty) launches cost ~2% at T = 64 on
    the Qwen3 shape (H200, run 2). The small-batch tiles are the device file's "small_batch" entry
    for the shapes when it has one (`safemoe.configs.small_batch_entry`), else the config of
    SMALL_BATCH_TOKENS tokens."""
    def source() -> ExpertsConfig:
        pinned = small_batch_entry(num_experts, hidden, inter, top_k, dtype, device, quant)
        if pinned is not None:
            return pinned
        return get_config(SMALL_BATCH_TOKENS, num_experts, hidden, inter, top_k, dtype, device, quant)

    return small_tiles_from(num_tokens, cfg, source)


def small_tiles_from(num_tokens: int, cfg: ExpertsConfig,
                     source: Callable[[], ExpertsConfig]) -> ExpertsConfig | None:
    """`small_batch_config`'s rule with the config serving SMALL_BATCH_TOKENS tokens from
    `source()` (called only when needed): that config when T > SMALL_BATCH_TOKENS and its BLOCK_M
    is below cfg's, else None. scripts/tune_experts.py applies it to a table it edits."""
    if num_tokens <= SMALL_BATCH_TOKENS:
        return None
    small = source()
    return small if small.block_m < cfg.block_m else None


def few_slots_bucket(top_k: int) -> int:
    """The largest token bucket whose every batch takes the few-slot path (T*K <= FEW_SLOTS)."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
    return 1 << max(0, (max(1, FEW_SLOTS // top_k)).bit_length() - 1)


def few_slots_config(num_tokens: int, num_experts: int, hidden: int, inter: int, top_k: int,
                     dtype: torch.dtype, device: torch.device, cfg: ExpertsConfig) -> ExpertsConfig | None:
    """The tiles of the few-slot path for a batch of T tokens whose own config is `cfg`, or None
    when it is off: K > FEW_SLOTS, or `cfg.few` is False (a tuned per-bucket choice). A bucket
    that always takes it (T*K <= FEW_SLOTS) runs its own tiles; a larger one those of
    `few_slots_bucket(K)` tokens. For a shape without a tuned table those larger buckets' tiles
    are lighter in a bucket of LIGHT_FEW_BLOCK_M-row tiles (`light_few_tiles`) and never need more
    shared memory than cfg's own (`few_tiles_within`: they are compiled into cfg's launches)."""
    def source() -> ExpertsConfig:
        return get_config(few_slots_bucket(top_k), num_experts, hidden, inter, top_k, dtype, device)

    untabled = not has_table(num_experts, hidden, inter, top_k, dtype, device)
    return few_tiles_from(num_tokens, top_k, cfg, source, fit=untabled, element_bytes=dtype.itemsize,
                          light=untabled and cfg.block_m == LIGHT_FEW_BLOCK_M)


def few_tiles_from(num_tokens: int, top_k: int, cfg: ExpertsConfig, source: Callable[[], ExpertsConfig],
                   fit: bool = False, element_bytes: int = 2, light: bool = False) -> ExpertsConfig | None:
    """`few_slots_config`'s rule with the config serving `few_slots_bucket(K)` tokens from
    `source()` (called only when needed); in a larger bucket, `light`: those tiles with K steps of
    at most 128 (`light_few_tiles`), and `fit`: cut to cfg's shared memory (`few_tiles_within`,
    elements of `element_bytes`). scripts/tune_experts.py applies it to a table it edits,
    scripts/heuristic_eval.py to the rules it times."""
    if top_k > FEW_SLOTS or not cfg.few:
        return None
    if num_tokens * top_k <= FEW_SLOTS or (cfg.fused and fused_bucket(num_tokens, top_k)):
        return cfg
    few = source()
    if not few.few:
        return None
    if light:
        few = light_few_tiles(few)
    return few_tiles_within(few, cfg, element_bytes) if fit else few


def light_few_tiles(few: ExpertsConfig) -> ExpertsConfig:
    """Few-slot tiles `few` with each GEMM's K step cut to at most 128 columns, 4 stages deep where
    it was cut (the decode tiles of the heuristic before 2026-12-01, which the same H200 run timed
    level with no path at all in the 64-row launches; LIGHT_FEW_BLOCK_M)."""
    if not isinstance(few, ExpertsConfig):
        raise TypeError(f"few must be a safemoe ExpertsConfig, got {type(few).__name__}")
    return _light_few_tiles(few)


@functools.lru_cache(maxsize=256)  # asked every forward of an untabled shape's 64-row buckets
def _light_few_tiles(few: ExpertsConfig) -> ExpertsConfig:
    def lighter(tiles: GemmTiles) -> GemmTiles:
        if tiles.block_k <= LIGHT_FEW_BLOCK_K:
            return tiles
        return replace(tiles, block_k=LIGHT_FEW_BLOCK_K, num_stages=4)

    gemm1, gemm2 = lighter(few.gemm1), lighter(few.gemm2)
    if (gemm1, gemm2) == (few.gemm1, few.gemm2):
        return few
    return replace(few, gemm1=gemm1, gemm2=gemm2)


def _check_fp8_config(cfg: ExpertsConfig | None, weights: Fp8Weights | None) -> None:
    if cfg is None or weights is None or weights.mode != "block":
        return
    if max(cfg.gemm1.block_k, cfg.gemm2.block_k) > FP8_BLOCK:
        raise ValueError(
            f"fp8 block mode needs block_k <= {FP8_BLOCK} (one K step inside one scale group), got "
            f"gemm1.block_k={cfg.gemm1.block_k} gemm2.block_k={cfg.gemm2.block_k}"
        )


def experts_triton(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, K] float32
    ids: torch.Tensor,  # [T, K] int32
    *,
    activation: str,
    num_valid: NumValid,
    health: torch.Tensor | None,
    workspace: Workspace | None = None,
    out: torch.Tensor | None = None,
    config: ExpertsConfig | None = None,
    small_config: ExpertsConfig | None = None,
    few_config: ExpertsConfig | None = None,
    fp8: Fp8Weights | None = None,
    batch_invariant: bool = False,
    ids_complete: bool = False,
) -> torch.Tensor:
    """Expert MLPs with the Triton kernels; arguments already validated by `safemoe.experts`.

    Returns out [T, H] in x's dtype (written in full: rows >= num_valid are exact zeros). No host
    sync and no allocation when `workspace` and `out` are given, so it captures in a CUDA graph;
    without a workspace a temporary one is allocated. Deterministic run to run.

    Tiles: `config` (default: `safemoe.configs.get_config` for T) and, for T above
    SMALL_BATCH_TOKENS, `small_config` (default: the config of SMALL_BATCH_TOKENS tokens when it
    differs) used instead whenever num_valid <= SMALL_BATCH_TOKENS on the device: dispatch builds
    the layout of the tiles that num_valid picks. Each GEMM is launched for both sets of tiles and
    the launch of the unused layout returns at once, or, when `config.one_launch`, is ONE launch
    holding both sets that reads which layout is in use on the device (num_blocks[1] > 0: small)
    and runs with the main config's num_warps/num_stages either way. So results are a
    deterministic function of (T, num_valid <= SMALL_BATCH_TOKENS, one_launch), and a row's bits do
    not depend on what padding rows hold. Launches: dispatch (one, or count + scatter when T*K >
    ALONE_SLOTS = 4096), GEMM1, GEMM2, combine: four or five, and two more with separate small tiles.

    Few slots (`few_config`; default, with `config` None: `few_slots_config`, on unless the tuned
    config turns it off): a batch with num_valid * K <= FEW_SLOTS (16, read on the device) skips the
    sorted layout. Each GEMM program reads the <= 16 ids itself, and each expert routed to is one
    tile of 16 rows (its slots; the intermediate is indexed by slot), run with `few_config`'s tiles
    in the GEMMs' own launch; dispatch then only zeroes its block counts, and a bucket with T*K <= 16
    launches no dispatch at all (GEMM1 counts the dropped ids into health). Three launches at
    decode instead of four: the fused tiny-batch dispatch that issue 13 names. In a bucket with
    block_m > 16 whose `few_config` is `fused`, the path is instead that fused launch, placed
    before the GEMM launches (one launch more on every call; it returns at once on a larger
    batch). Not with fp8 (the second quantisation pass reads the sorted layout) nor
    batch_invariant (the tiles would then depend on num_valid).

    ids_complete: the caller's router wrote the ids of every row in this call (padding rows' as
    -1), as `moe()` and `MoE` do; the few-slot path then loads the first 16 slots' ids together with a
    device num_valid instead of after it (one memory round trip less before the first weight load;
    the padding rows' among them are discarded unused). Without it the ids of rows >= num_valid are
    never read.

    batch_invariant: one configuration for every T and no small-batch switch, so a valid row's
    output is bitwise the same whatever T, num_valid and the other rows hold. The configuration is
    `config` when given (the caller then passes the same one for every T), else
    `safemoe.configs.batch_invariant_config` for the shapes; a `small_config` is an error.

    fp8 (w13, w2 float8_e4m3fn with `fp8`'s scales; x bf16/fp16; the workspace needs fp8
    buffers): x's rows < num_valid are quantised first (kernels/act_quant.py: per token, or 1x128
    groups in block mode), GEMM1 multiplies fp8 x fp8 and dequantises (per-tensor: in its
    epilogue; block: each 128-wide K step), stores the intermediate in x's dtype, a second
    quantisation pass turns the used positions into fp8 rows with their own scales, and GEMM2
    multiplies those by the fp8 w2. Seven launches (six with one dispatch chunk).
    """
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = ids.shape[1]
    quant = None if fp8 is None else fp8.mode
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}, got "
            f"{out.dtype} {tuple(out.shape)} on {out.device}"
        )
    _check_fp8_config(config, fp8)
    _check_fp8_config(small_config, fp8)
    if batch_invariant and (small_config is not None or few_config is not None):
        raise ValueError("small_config and few_config switch tiles by num_valid; batch_invariant=True runs "
                         "one config for every batch (pass config= alone)")
    if few_config is not None and not isinstance(few_config, ExpertsConfig):
        raise TypeError("few_config must be a safemoe ExpertsConfig or None, got "
                        f"{type(few_config).__name__}")
    if few_config is not None and (fp8 is not None or top_k > FEW_SLOTS):
        got = "fp8 weights" if fp8 is not None else f"K={top_k}"
        raise ValueError(f"few_config: the few-slot path takes bf16/fp16/fp32 weights and K <= {FEW_SLOTS}, "
                         f"got {got}")
    if num_tokens == 0:
        return out
    if batch_invariant:
        if config is None:
            config = batch_invariant_config(num_experts, hidden, inter, top_k, x.dtype, x.device, quant)
    elif config is None:
        config = get_config(num_tokens, num_experts, hidden, inter, top_k, x.dtype, x.device, quant)
        small_config = small_batch_config(num_tokens, num_experts, hidden, inter, top_k, x.dtype, x.device,
                                          config, quant)
        if fp8 is None:
            few_config = few_slots_config(num_tokens, num_experts, hidden, inter, top_k, x.dtype, x.device,
                                          config)
    if workspace is None:
        workspace = Workspace(num_tokens, num_experts, top_k, hidden, inter, x.dtype, x.device,
                              fp8=fp8 is not None)
    else:
        if not isinstance(workspace, Workspace):
            raise TypeError(f"workspace must be a safemoe Workspace or None, got {type(workspace).__name__}")
        workspace.check(num_tokens, num_experts, top_k, hidden, inter, x.dtype, x.device, fp8=fp8 is not None)
    views = workspace.views(num_tokens, num_experts, top_k, hidden, inter)
    use_pdl = config.pdl and pdl_usable(x.device)
    small_tokens = min(num_tokens, SMALL_BATCH_TOKENS)
    small = (small_config.block_m, small_tokens * top_k) if small_config is not None else None
    operands = None
    if fp8 is not None:
        group = FP8_BLOCK if fp8.mode == "block" else None
        operands = Fp8Operands(fp8, workspace.fp8_views(num_tokens, num_experts, top_k, hidden, inter, group))
    few = None
    if few_config is not None:
        # a fused bucket (`fused_bucket`) with its own tiles as few_config: every batch takes the
        # fused launch (packed 16-row tiles, or with PACK_FUSED_ROWS off FUSED_SLOTS-row ones)
        only = num_tokens * top_k <= FEW_SLOTS or (
            few_config.fused and few_config == config and fused_bucket(num_tokens, top_k))
        few = FewSlots(few_config, ids, num_valid, health, only, ids_complete)
        if only:
            # Every call takes the few-slot path: its tiles alone, no dispatch, no small tiles.
            config, small_config, small = few_config, None, None
            use_pdl = config.pdl and pdl_usable(x.device)
    quantize_x = None
    if operands is not None:
        quantize_x = (x, operands.views.x, operands.views.x_scale, operands.group or hidden)
    x_quantised = False
    if few is None or not few.only:
        # fp8: a decode step's dispatch launch quantises x in programs of its own (its return says)
        x_quantised = dispatch_into(ids, num_experts, num_valid, config.block_m, views, health, small=small,
                                    few_slots=FEW_SLOTS if few is not None else -1, use_pdl=use_pdl,
                                    quantize_x=quantize_x)
    if quantize_x is not None and not x_quantised:
        quantize_rows_into(*quantize_x, num_valid, use_pdl=use_pdl)
    rowwise = batch_invariant and interpreter_enabled()
    # The small-batch tiles in the GEMMs' own launch (config.one_launch) or in a second launch each.
    merged = small_config if small_config is not None and config.one_launch else None
    separate = small_config if merged is None else None
    if few is not None and few.only and config.fused:
        # GEMM1 and GEMM2 in one launch (ExpertsConfig.fused)
        few_gemms_into(x, w13, w2, weights, views, activation, few, use_pdl=use_pdl)
    else:
        if few is not None and few.config.fused and config.block_m > FEW_SLOTS:
            # A bucket with tiles larger than the few-slot path's 16 rows, whose few-slot tiles come
            # from a fused bucket: a batch with <= 16 valid slots (a padded decode step) runs that
            # fused launch, and the GEMM launches below, compiled without the path, find no
            # M-block (dispatch builds no layout for it). Inside those launches the path would run
            # with their grid, warps and stages (H200, DeepSeek-V3 one-row step at T = 1024:
            # 183.2 -> 178.1 us, full batch unchanged). With 16-row decode tiles the gain is small
            # or negative (T = 256: 176.1 -> 173.0 us; T = 8, whose tiles are the path's own:
            # 168.5 -> 170.1) and a bench run with the launch there had the full T = 256 batch 5.3%
            # slower than the day before (other decode points +0.7..+1.9%; not A/B-timed), so
            # decode buckets keep the GEMMs' path.
            few_gemms_into(x, w13, w2, weights, views, activation, few, use_pdl=use_pdl)
            few = None
        # fp8 block mode: a GEMM1 launch whose tiles hold whole 1x128 groups quantises the
        # intermediate itself (one pass over it and its x-dtype round trip less); the separate pass
        # covers the layouts the other launches produce (dispatch builds one of the two a call).
        fusable = operands is not None and operands.group == FP8_BLOCK and FUSE_INTER_QUANT
        main_fused = fusable and fuses_inter_quant(config, merged)
        small_fused = fusable and separate is not None and fuses_inter_quant(separate)
        gemm1_into(x, w13, views, top_k, activation, config, small=merged, few=few, use_pdl=use_pdl,
                   fp8=operands, rowwise=rowwise, inter_quant=main_fused)
        if separate is not None:
            gemm1_into(x, w13, views, top_k, activation, separate, layout=1, max_tokens=small_tokens,
                       use_pdl=use_pdl, fp8=operands, inter_quant=small_fused)
        if operands is not None:
            positions = max_m_blocks(num_tokens, num_experts, top_k, config.block_m) * config.block_m
            main_block_m = 0 if main_fused else config.block_m
            small_block_m = 0
            if small_config is not None:
                small_blocks = max_m_blocks(small_tokens, num_experts, top_k, small_config.block_m)
                positions = max(positions, small_blocks * small_config.block_m)
                if not (main_fused if merged is not None else small_fused):
                    small_block_m = small_config.block_m
            if main_block_m or small_block_m:
                quantize_positions_into(views.intermediate, operands.views.inter, operands.views.inter_scale,
                                        operands.group or inter, views.sorted_slots, views.num_blocks,
                                        main_block_m, small_block_m, positions, use_pdl=use_pdl)
        if config.gemm2.engine != "triton" and operands is None and ws_usable(w2, views):
            # The Gluon GEMM2 (GemmTiles.engine) over the main layout; the small-batch and few-slot
            # regimes, which it does not hold, in a Triton launch over layout 1 (dispatch leaves
            # the layout a batch does not use empty, so one of the two launches finds no work).
            gemm2_ws_into(w2, weights, views, num_tokens, top_k, config)
            if small_config is not None or few is not None:
                aux = small_config if small_config is not None else replace(
                    config, gemm2=replace(config.gemm2, engine="triton"))
                gemm2_into(w2, weights, views, num_tokens, top_k, aux, layout=1, max_tokens=small_tokens,
                           few=few, use_pdl=use_pdl, rowwise=rowwise)
        else:
            gemm2_into(w2, weights, views, num_tokens, top_k, config, small=merged, few=few, use_pdl=use_pdl,
                       fp8=operands, rowwise=rowwise)
            if separate is not None:
                gemm2_into(w2, weights, views, num_tokens, top_k, separate, layout=1, max_tokens=small_tokens,
                           use_pdl=use_pdl, fp8=operands)
    combine_into(views.y, ids, num_experts, num_valid, out, use_pdl=use_pdl)
    return out
