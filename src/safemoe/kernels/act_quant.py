"""Dynamic fp8 (e4m3) activation quantisation for the fp8 expert GEMMs.

Contract (the executable form is `reference.quantize_groups_reference`; this kernel matches it
bit for bit): each row of src [R, C] (bf16/fp16) is cut into groups of `group_len` consecutive
columns (group_len = C: one group per row, i.e. per token; 128: DeepSeek-V3's 1x128 groups). Per
group, in fp32:
    scale = max(amax, 1e-10) / 448            (amax: largest |value| of the group; IEEE division)
    q     = rne(clamp(value * (448 / max(amax, 1e-10)), -448, 448))
            (one IEEE division a group, an IEEE multiply a value, round to nearest even)
A group holding a NaN or +-Inf gets scale NaN and q = 0, so it dequantises (q * scale) to NaN:
the non-finite value poisons its own group, hence its own row's GEMM outputs, and nothing else.
Each scale depends on its own group only (vLLM #40047: one shared scale let a NaN row poison
every row).

Which rows are quantised (the others are neither read nor written):
- x: rows < num_valid (a host int, or a 0-dim device tensor read here and clamped to [0, T]);
- the intermediate: sorted positions below the used M-blocks of the dispatch layout in use
  (max(num_blocks[0] * block_m0, num_blocks[1] * block_m1), read on the device) whose slot is
  not the -1 padding sentinel.
Grids are persistent and depend on shapes only (CUDA-graph safe); the work scales with the rows
in use. Compiled, the final fp32 -> e4m3 cast rounds to nearest even and saturates (the hardware's
cvt.rn.satfinite, as torch's cast); under the Triton interpreter, whose cast neither rounds to
nearest even nor carries a mantissa overflow correctly, the values are rounded in fp32 arithmetic
first (`round_to_e4m3`), so the cast converts exactly representable values: the same bits either
way (tests/test_experts_fp8.py checks both against the reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from safemoe._checks import NumValid
from safemoe._triton import interpreter_enabled
from safemoe.kernels.launch import (
    cdiv,
    launch_options,
    load_num_valid,
    next_power_of_2,
    persistent_grid,
    wait_for_previous_kernel,
)
from safemoe.numerics import FLT_MAX, FP8_AMAX_FLOOR, FP8_MAX

_FLT_MAX: tl.constexpr = tl.constexpr(FLT_MAX)
_FP8_MAX: tl.constexpr = tl.constexpr(FP8_MAX)
_AMAX_FLOOR: tl.constexpr = tl.constexpr(FP8_AMAX_FLOOR)
# 1.5 * 2^23: adding then subtracting it rounds an fp32 of magnitude < 2^22 to an integer, ties
# to even (the FPU's own rounding), with no rint in every triton's math library.
_ROUND_MAGIC: tl.constexpr = tl.constexpr(12582912.0)


@triton.jit
def round_to_e4m3(v):
    """The nearest e4m3 value to fp32 v (finite, |v| <= 448), ties to even, as an fp32.

    e4m3 holds 3 mantissa bits: in the binade [2^e, 2^(e+1)) its step is 2^(e-3); below 2^-6
    (subnormals) the step stays 2^-9. Scale v by 1/step (a power of two: exact), round to an
    integer, scale back."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = tl.maximum((bits >> 23) & 0xFF, 127 - 6)  # biased
    step = ((exponent - 3) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
    inv_step = ((257 - exponent) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e)
    rounded = ((v * inv_step + _ROUND_MAGIC) - _ROUND_MAGIC) * step
    # keep v's sign on a result rounded to zero (-0.0, as a cast would give)
    sign = bits & -2147483648
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _stats(v, amax, bad):
    """Running (amax over finite values, 1 if any NaN/Inf) per row, updated with the tile v."""
    magnitude = tl.abs(v)
    finite = magnitude <= _FLT_MAX  # False for NaN and +-Inf
    amax = tl.maximum(amax, tl.max(tl.where(finite, magnitude, 0.0), axis=1))
    bad = tl.maximum(bad, tl.max(tl.where(finite, 0, 1), axis=1))
    return amax, bad


@triton.jit
def _codes(v, multiplier, is_bad, NATIVE_CAST: tl.constexpr):
    """The tile v's rows times their groups' 448 / amax, ready for the cast to e4m3; 0 in
    non-finite groups. A multiply, not a division by the scale: div_rn is a long instruction
    sequence a value, and with it this kernel ran at 40% of the copy floor at prefill sizes.
    NATIVE_CAST (compiled): the cast itself rounds to nearest even and saturates at 448
    (cvt.rn.satfinite on sm_89+, as torch's cast), so the clamp and `round_to_e4m3` are left to it:
    they were about a third of this kernel's instructions, and the kernel was issue-bound (H200,
    ncu: 68% issue slots busy, 21% of DRAM bandwidth). Interpreter: its cast does neither, so
    the values are rounded here, in fp32 arithmetic (exact e4m3 values: the cast converts them
    as they are)."""
    if NATIVE_CAST:
        # A non-finite value's product is replaced below with its whole group's: no guard needed.
        q = v * multiplier
    else:
        q = tl.where(tl.abs(v) <= _FLT_MAX, v, 0.0) * multiplier
        q = round_to_e4m3(tl.minimum(tl.maximum(q, -_FP8_MAX), _FP8_MAX))
    return tl.where(is_bad[:, None], 0.0, q)


@triton.jit
def _scale_and_multiplier(amax, bad):
    """Per group, from its amax and non-finite flag: (the scale to store, NaN for a non-finite
    group; the multiplier 448 / amax, 0 for a non-finite group; whether it is non-finite)."""
    floored = tl.maximum(amax, _AMAX_FLOOR)
    is_bad = bad > 0
    scale = tl.where(is_bad, float("nan"), tl.math.div_rn(floored, _FP8_MAX))
    multiplier = tl.where(is_bad, 0.0, tl.math.div_rn(tl.zeros_like(floored) + _FP8_MAX, floored))
    return scale, multiplier, is_bad


@triton.jit
def quantize_tile_rows(v, valid, NATIVE_CAST: tl.constexpr):
    """Each row of the fp32 tile v [R, C] one group (entries where `valid` is False lie outside
    it): (codes [R, C] ready for the cast to e4m3, scales [R]), the bits `_quantize_kernel` gives
    for the same group. For kernels that hold a whole group in registers (GEMM1's epilogue)."""
    amax, bad = _stats(tl.where(valid, v, 0.0), tl.zeros((v.shape[0],), dtype=tl.float32),
                       tl.zeros((v.shape[0],), dtype=tl.int32))
    scale, multiplier, is_bad = _scale_and_multiplier(amax, bad)
    return _codes(v, multiplier[:, None], is_bad, NATIVE_CAST), scale


@triton.jit
def quantize_items(
    program, num_programs, src_ptr, sorted_slots_ptr, count_ptr, q_ptr, scale_ptr, count, num_rows, row_len,
    group_len, num_groups, block_m0, block_m1, SORTED: tl.constexpr, HAS_NUM_VALID_PTR: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ONE_CHUNK: tl.constexpr, NATIVE_CAST: tl.constexpr,
):
    """The work of _quantize_kernel (arguments as there) for program `program` of `num_programs`:
    its launch, or the programs another kernel gives it (dispatch's, which quantise x beside the
    layout in a decode step: kernels/dispatch.py)."""
    if SORTED:
        limit = tl.maximum(tl.load(count_ptr) * block_m0, tl.load(count_ptr + 1) * block_m1)
    else:
        limit = load_num_valid(count_ptr, count, num_rows, HAS_NUM_VALID_PTR)
    # One work item = BLOCK_R rows x one group, so the groups of a row run in parallel (a program
    # walking a row's 56 groups of 128 one after another took ~400 us at H = 7168, H200).
    for item in range(program, tl.cdiv(limit, BLOCK_R) * num_groups, num_programs):
        group = item % num_groups
        rows = (item // num_groups) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < limit
        if SORTED:
            slots = tl.load(sorted_slots_ptr + rows, mask=row_ok, other=-1)
            row_ok = slots >= 0
        rows64 = rows.to(tl.int64)
        row_offsets = rows64 * row_len
        start = group * group_len
        end = tl.minimum(start + group_len, row_len)
        amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
        bad = tl.zeros((BLOCK_R,), dtype=tl.int32)
        if ONE_CHUNK:
            cols = start + tl.arange(0, BLOCK_C)
            mask = row_ok[:, None] & (cols < end)[None, :]
            offsets = row_offsets[:, None] + cols[None, :]
            v = tl.load(src_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            amax, bad = _stats(v, amax, bad)
        else:
            for c0 in range(start, end, BLOCK_C):
                cols = c0 + tl.arange(0, BLOCK_C)
                mask = row_ok[:, None] & (cols < end)[None, :]
                v = tl.load(src_ptr + row_offsets[:, None] + cols[None, :], mask=mask, other=0.0)
                amax, bad = _stats(v.to(tl.float32), amax, bad)
        scale, multiplier, is_bad = _scale_and_multiplier(amax, bad)
        tl.store(scale_ptr + rows64 * num_groups + group, scale, mask=row_ok)
        multiplier = tl.broadcast_to(multiplier[:, None], (BLOCK_R, BLOCK_C))
        if ONE_CHUNK:
            q = _codes(v, multiplier, is_bad, NATIVE_CAST)
            tl.store(q_ptr + offsets, q.to(q_ptr.dtype.element_ty), mask=mask)
        else:
            for c0 in range(start, end, BLOCK_C):
                cols = c0 + tl.arange(0, BLOCK_C)
                mask = row_ok[:, None] & (cols < end)[None, :]
                offsets = row_offsets[:, None] + cols[None, :]
                v = tl.load(src_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
                q = _codes(v, multiplier, is_bad, NATIVE_CAST)
                tl.store(q_ptr + offsets, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_kernel(
    # inputs
    src_ptr,  # [R, C] bf16/fp16
    sorted_slots_ptr,  # SORTED: [capacity] int32, -1 in padding positions
    count_ptr,  # SORTED: num_blocks [2] int32; else (HAS_NUM_VALID_PTR) the 0-dim num_valid
    # outputs
    q_ptr,  # [R, C] float8_e4m3fn
    scale_ptr,  # [R, num_groups] float32
    # shapes
    count,  # not SORTED: the host num_valid (rows to quantise)
    num_rows,  # R: T for x (the clamp of a device num_valid)
    row_len,  # C
    group_len,  # columns per group (C: one group per row)
    num_groups,  # ceil(C / group_len)
    block_m0,  # SORTED: BLOCK_M of layout 0 (num_blocks[0])
    block_m1,  # SORTED: BLOCK_M of layout 1 (num_blocks[1]; 0 when there is no second layout)
    SORTED: tl.constexpr,
    HAS_NUM_VALID_PTR: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ONE_CHUNK: tl.constexpr,  # BLOCK_C >= group_len: a group is loaded once and kept in registers
    USE_PDL: tl.constexpr,
    NATIVE_CAST: tl.constexpr,  # compiled: the fp8 cast rounds (see _codes)
):
    wait_for_previous_kernel(USE_PDL)
    quantize_items(tl.program_id(0), tl.num_programs(0), src_ptr, sorted_slots_ptr, count_ptr, q_ptr,
                   scale_ptr, count, num_rows, row_len, group_len, num_groups, block_m0, block_m1, SORTED,
                   HAS_NUM_VALID_PTR, BLOCK_R, BLOCK_C, ONE_CHUNK, NATIVE_CAST)


# Longest group quantised from registers in one load (fp32: 64 values a thread at 8 warps); a
# longer one (a per-token group past 16384 columns) takes two passes over 1024-column chunks.
_MAX_ONE_CHUNK = 16384


def _tiles(group_len: int) -> tuple[int, int, bool, int]:
    """(BLOCK_R, BLOCK_C, ONE_CHUNK, num_warps): a whole group per load where it fits (1x128
    groups: 16 rows x 128; a per-token row: max(1, 2048 // H) rows), ~8 values a thread (16 at
    H > 4096): the IEEE divisions take registers (sm_90 ptxas: 64 registers at 8 values a thread,
    236 at 32)."""
    block_c = max(16, next_power_of_2(group_len))
    if block_c > _MAX_ONE_CHUNK:
        return 4, min(1024, _MAX_ONE_CHUNK), False, 4
    block_r = max(1, min(32, 2048 // block_c))
    return block_r, block_c, True, min(16, max(4, block_r * block_c // 256))


def _grid(items: int, device: torch.device) -> tuple[int]:
    return (persistent_grid(items, device, programs_per_sm=8),)


def lent_rows_tiles(src: torch.Tensor, scale: torch.Tensor, group_len: int,
                    num_warps: int) -> tuple[int, int, int, bool]:
    """(programs, BLOCK_R, BLOCK_C, ONE_CHUNK) for quantising src [T, C] rows below num_valid into
    scale's groups (as quantize_rows_into) in programs another launch of `num_warps` warps lends
    (they call quantize_items; the lender supplies num_valid and the pointers). The tiles fit those
    warps; a group's codes do not depend on its tile, so the bits are quantize_rows_into's."""
    num_rows, row_len = src.shape
    block_r, block_c, one_chunk, _ = _tiles(min(group_len, row_len))
    if one_chunk:
        block_r = max(1, min(block_r, 256 * num_warps // block_c))
    return _grid(cdiv(num_rows, block_r) * scale.shape[1], src.device)[0], block_r, block_c, one_chunk


def quantize_rows_into(src: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group_len: int,
                       num_valid: NumValid, *, use_pdl: bool = False) -> None:
    """Quantise rows < num_valid of src [T, C] into q [T, C] fp8 and scale [T, ceil(C/group_len)]."""
    num_rows, row_len = src.shape
    group_len = min(group_len, row_len)
    block_r, block_c, one_chunk, num_warps = _tiles(group_len)
    has_nv_ptr = num_valid.tensor is not None
    # grid: persistent programs over (BLOCK_R rows, one group) items, up to the rows below num_valid
    _quantize_kernel[_grid(cdiv(num_rows, block_r) * scale.shape[1], src.device)](
        src, src, num_valid.tensor if has_nv_ptr else src,
        q, scale,
        num_valid.count if num_valid.count is not None else num_rows, num_rows, row_len, group_len,
        scale.shape[1], 0, 0,
        SORTED=False, HAS_NUM_VALID_PTR=has_nv_ptr, BLOCK_R=block_r, BLOCK_C=block_c, ONE_CHUNK=one_chunk,
        USE_PDL=use_pdl, NATIVE_CAST=not interpreter_enabled(), num_warps=num_warps,
        **launch_options(use_pdl),
    )


def quantize_positions_into(src: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group_len: int,
                            sorted_slots: torch.Tensor, num_blocks: torch.Tensor, block_m0: int,
                            block_m1: int, max_positions: int, *, use_pdl: bool = False) -> None:
    """Quantise the sorted positions of src [capacity, C] that hold a slot, below the used M-blocks
    of the dispatch layouts whose block_m is not 0, into q and scale; `max_positions` bounds
    the positions any call with these shapes can use (it sizes the grid)."""
    row_len = src.shape[1]
    group_len = min(group_len, row_len)
    block_r, block_c, one_chunk, num_warps = _tiles(group_len)
    # grid: persistent programs over (BLOCK_R positions, one group) items, up to the used M-blocks
    _quantize_kernel[_grid(cdiv(max_positions, block_r) * scale.shape[1], src.device)](
        src, sorted_slots, num_blocks,
        q, scale,
        0, src.shape[0], row_len, group_len, scale.shape[1], block_m0, block_m1,
        SORTED=True, HAS_NUM_VALID_PTR=False, BLOCK_R=block_r, BLOCK_C=block_c, ONE_CHUNK=one_chunk,
        USE_PDL=use_pdl, NATIVE_CAST=not interpreter_enabled(), num_warps=num_warps,
        **launch_options(use_pdl),
    )
