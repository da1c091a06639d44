"""The padding sanitiser's kernel: zero rows `>= num_valid` of a [T, ...] buffer in place, reading a
device `num_valid` (no host sync). Contract and public entry point: `safemoe.padding.zero_padding_`,
which validates the arguments and flattens the buffer into rows before calling `zero_padding_into`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from safemoe._checks import NumValid
from safemoe.kernels.launch import persistent_grid

# Elements per program step: 16 KiB of bf16, enough to keep stores wide; the grid is capped so
# that a program loops over the padded rows instead of launching one program per block.
_BLOCK = 8192
_PROGRAMS_PER_SM = 4


@triton.jit
def _zero_padding_kernel(
    # inputs / outputs
    t_ptr,
    num_valid_ptr,
    # shapes
    num_valid_count,
    num_rows,
    row_elems,
    row_stride,
    # flags
    HAS_NUM_VALID_PTR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Zero t[r, :] for r in [num_valid, num_rows).

    t_ptr: first element of t, viewed as num_rows rows of row_elems contiguous elements,
        row r starting at r * row_stride (int64 addressing: T * H can pass 2^31).
    num_valid_ptr: 0-dim int32/int64 device count (read here, clamped to [0, num_rows]) when
        HAS_NUM_VALID_PTR, else num_valid_count (host int) is the count.
    Programs stride over the padded elements only, so the work is proportional to the padding.
    """
    if HAS_NUM_VALID_PTR:
        num_valid = tl.load(num_valid_ptr).to(tl.int64)
    else:
        # An int argument equal to 1 arrives as a constexpr; adding to a tensor types it.
        num_valid = tl.zeros([], dtype=tl.int64) + num_valid_count
    num_valid = tl.minimum(tl.maximum(num_valid, 0), num_rows)
    padded = (num_rows - num_valid) * row_elems
    first = tl.program_id(0).to(tl.int64) * BLOCK
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    zeros = tl.zeros([BLOCK], dtype=t_ptr.dtype.element_ty)
    for start in range(first, padded, step):
        offsets = start + tl.arange(0, BLOCK).to(tl.int64)
        rows = num_valid + offsets // row_elems
        cols = offsets % row_elems
        tl.store(t_ptr + rows * row_stride + cols, zeros, mask=offsets < padded)


def zero_padding_into(t: torch.Tensor, row_elems: int, row_stride: int, nv: NumValid) -> None:
    """One launch (compiled on CUDA, interpreted on CPU tensors): t [T, ...] viewed as T rows of
    `row_elems` contiguous elements `row_stride` apart; arguments validated by the caller."""
    num_rows = t.shape[0]
    if num_rows == 0 or row_elems == 0:
        return
    blocks = -(-num_rows * row_elems // _BLOCK)
    grid = persistent_grid(blocks, t.device, _PROGRAMS_PER_SM, cpu_programs=4)
    has_ptr = nv.tensor is not None
    _zero_padding_kernel[(grid,)](
        t,
        nv.tensor if has_ptr else t,  # unused pointer when the count is a host int
        0 if has_ptr else int(nv.count or 0),
        num_rows,
        row_elems,
        row_stride,
        HAS_NUM_VALID_PTR=has_ptr,
        BLOCK=_BLOCK,
    )
