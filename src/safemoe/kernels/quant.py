"""Dynamic fp8 (e4m3) activation quantisation for the fp8 expert GEMMs.

Contract (the executable form is `reference.quantize_groups_reference`; this kernel matches it
bit for bit): each row of src [R, C] (bf16/fp16) is cut into groups of `group_len` consecutive
columns (group_len = C: one group per row, i.e. per token; 128: DeepSeek-V3's 1x128 groups). Per
group, in fp32:
    scale = max(amax, 1e-10) / 448            (amax: largest |value| of the group; IEEE division)
    q     = rne(clamp(value / scale, -448, 448))   (IEEE division, round to nearest even)
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
in use. Rounding is done in fp32 arithmetic (`round_to_e4m3`), so the final cast converts an
exactly representable value: the same bits on the GPU and under the Triton interpreter (whose
fp32 -> fp8 cast neither rounds to nearest even nor carries a mantissa overflow correctly).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from safemoe._checks import NumValid
from safemoe.kernels.dispatch import _load_num_valid, launch_options, wait_for_previous_kernel
from safemoe.reference import FP8_AMAX_FLOOR, FP8_MAX

_FLT_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)
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
def _group_stats(src_ptr, row_offsets, row_ok, start, end, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """(amax over finite values, 1 if any value is NaN/Inf) of columns [start, end) per row."""
    amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
    bad = tl.zeros((BLOCK_R,), dtype=tl.int32)
    for c0 in range(start, end, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = row_ok[:, None] & (cols < end)[None, :]
        v = tl.load(src_ptr + row_offsets[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        magnitude = tl.abs(v)
        finite = magnitude <= _FLT_MAX  # False for NaN and +-Inf
        amax = tl.maximum(amax, tl.max(tl.where(finite, magnitude, 0.0), axis=1))
        bad = tl.maximum(bad, tl.max(tl.where(finite, 0, 1), axis=1))
    return amax, bad


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
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    if SORTED:
        limit = tl.maximum(tl.load(count_ptr) * block_m0, tl.load(count_ptr + 1) * block_m1)
    else:
        limit = _load_num_valid(count_ptr, count, num_rows, HAS_NUM_VALID_PTR)
    for row_block in range(tl.program_id(0), tl.cdiv(limit, BLOCK_R), tl.num_programs(0)):
        rows = row_block * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < limit
        if SORTED:
            slots = tl.load(sorted_slots_ptr + rows, mask=row_ok, other=-1)
            row_ok = slots >= 0
        rows64 = rows.to(tl.int64)
        row_offsets = rows64 * row_len
        for group in range(0, num_groups):
            start = group * group_len
            end = tl.minimum(start + group_len, row_len)
            amax, bad = _group_stats(src_ptr, row_offsets, row_ok, start, end, BLOCK_R, BLOCK_C)
            scale = tl.math.div_rn(tl.maximum(amax, _AMAX_FLOOR), _FP8_MAX)
            is_bad = bad > 0
            tl.store(scale_ptr + rows64 * num_groups + group, tl.where(is_bad, float("nan"), scale),
                     mask=row_ok)
            divisor = tl.broadcast_to(tl.where(is_bad, 1.0, scale)[:, None], (BLOCK_R, BLOCK_C))
            for c0 in range(start, end, BLOCK_C):
                cols = c0 + tl.arange(0, BLOCK_C)
                mask = row_ok[:, None] & (cols < end)[None, :]
                offsets = row_offsets[:, None] + cols[None, :]
                v = tl.load(src_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
                q = tl.math.div_rn(tl.where(tl.abs(v) <= _FLT_MAX, v, 0.0), divisor)
                q = round_to_e4m3(tl.minimum(tl.maximum(q, -_FP8_MAX), _FP8_MAX))
                q = tl.where(is_bad[:, None], 0.0, q)
                tl.store(q_ptr + offsets, q.to(q_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _tiles(row_len: int, group_len: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps): 128-column chunks for 1x128 groups, up to 1024 for a
    per-token group; ~4096 elements a program (two passes over them: amax, then quantise)."""
    block_c = min(triton.next_power_of_2(min(group_len, row_len)), 1024)
    block_c = max(block_c, 16)
    block_r = max(1, min(32, 4096 // block_c))
    return block_r, block_c, 4


def _grid(max_rows: int, block_r: int, device: torch.device) -> tuple[int]:
    blocks = max(1, triton.cdiv(max_rows, block_r))
    if device.type != "cuda":
        return (min(blocks, 8),)
    return (min(blocks, _num_sms(device.index or 0) * 8),)


def quantize_rows_into(src: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group_len: int,
                       num_valid: NumValid, *, use_pdl: bool = False) -> None:
    """Quantise rows < num_valid of src [T, C] into q [T, C] fp8 and scale [T, ceil(C/group_len)]."""
    num_rows, row_len = src.shape
    block_r, block_c, num_warps = _tiles(row_len, group_len)
    has_nv_ptr = num_valid.tensor is not None
    # grid: persistent programs over blocks of BLOCK_R rows, up to the rows below num_valid
    _quantize_kernel[_grid(num_rows, block_r, src.device)](
        src, src, num_valid.tensor if has_nv_ptr else src,
        q, scale,
        num_valid.count if num_valid.count is not None else num_rows, num_rows, row_len, group_len,
        scale.shape[1], 0, 0,
        SORTED=False, HAS_NUM_VALID_PTR=has_nv_ptr, BLOCK_R=block_r, BLOCK_C=block_c, USE_PDL=use_pdl,
        num_warps=num_warps, **launch_options(use_pdl),
    )


def quantize_positions_into(src: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group_len: int,
                            sorted_slots: torch.Tensor, num_blocks: torch.Tensor, block_m0: int,
                            block_m1: int, max_positions: int, *, use_pdl: bool = False) -> None:
    """Quantise the sorted positions of src [capacity, C] that hold a slot, below the used M-blocks
    of either dispatch layout (block_m1 = 0: one layout), into q and scale; `max_positions` bounds
    the positions any call with these shapes can use (it sizes the grid)."""
    row_len = src.shape[1]
    block_r, block_c, num_warps = _tiles(row_len, group_len)
    # grid: persistent programs over blocks of BLOCK_R positions, up to the used M-blocks
    _quantize_kernel[_grid(max_positions, block_r, src.device)](
        src, sorted_slots, num_blocks,
        q, scale,
        0, src.shape[0], row_len, group_len, scale.shape[1], block_m0, block_m1,
        SORTED=True, HAS_NUM_VALID_PTR=False, BLOCK_R=block_r, BLOCK_C=block_c, USE_PDL=use_pdl,
        num_warps=num_warps, **launch_options(use_pdl),
    )
