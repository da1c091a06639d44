"""`zero_padding_`: zero the rows of a buffer at or past `num_valid`, in place.

Attention outputs, norms and other buffers of a padded CUDA-graph batch hold whatever the last
replay left in their padding rows (stale values, NaN). safemoe's own ops never read those rows,
but other kernels may; this sanitiser makes them exact zeros.

Contract: `t` is [T, ...] with its trailing dimensions contiguous (any row stride); rows
`r >= num_valid` become exact zeros (bit pattern 0), rows below are untouched. `num_valid` is None
(nothing to do), a host int in [0, T], or a 0-dim int32/int64 tensor on `t`'s device whose value is
read on the device and clamped to [0, T] (no host sync; a captured graph replays with any count).
One kernel launch on CUDA, no extra memory; on CPU the same in torch.
"""

from __future__ import annotations

import functools

import torch

from safemoe import _checks
from safemoe._triton import interpreter_enabled

# Elements per program step: 16 KiB of bf16, enough to keep stores wide; the grid is capped so
# that a program loops over the padded rows instead of launching one program per block.
_BLOCK = 8192
_PROGRAMS_PER_SM = 4


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=1)
def _kernel():  # type: ignore[no-untyped-def]
    import triton
    import triton.language as tl

    @triton.jit
    def zero_padding_kernel(
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

    return zero_padding_kernel


def _as_rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(t with bool viewed as uint8, row_elems, row_stride); checks that rows are contiguous."""
    if t.dim() < 1:
        raise ValueError(f"t must have at least one dimension (rows), got shape {tuple(t.shape)}")
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    if t.is_complex():
        raise TypeError(f"t must be a real or integer tensor, got {t.dtype}")
    row_elems = 1
    for size in t.shape[1:]:
        row_elems *= size
    if t.shape[0] > 1 and row_elems > 0 and not t[0].is_contiguous():
        raise ValueError(
            f"t's trailing dimensions must be contiguous (rows may have any stride), got strides "
            f"{t.stride()} for shape {tuple(t.shape)}"
        )
    return t, row_elems, t.stride(0) if t.shape[0] > 1 else row_elems


def _zero_padding_triton(t: torch.Tensor, nv: _checks.NumValid) -> None:
    """One launch of the Triton kernel (compiled on CUDA, interpreted on CPU tensors)."""
    t, row_elems, row_stride = _as_rows(t)
    num_rows = t.shape[0]
    if num_rows == 0 or row_elems == 0:
        return
    blocks = -(-num_rows * row_elems // _BLOCK)
    if t.device.type == "cuda":
        grid = min(blocks, _PROGRAMS_PER_SM * _num_sms(t.device.index or 0))
    else:
        grid = min(blocks, 4)  # the interpreter runs programs one after another anyway
    has_ptr = nv.tensor is not None
    _kernel()[(grid,)](
        t,
        nv.tensor if has_ptr else t,  # unused pointer when the count is a host int
        0 if has_ptr else int(nv.count or 0),
        num_rows,
        row_elems,
        row_stride,
        HAS_NUM_VALID_PTR=has_ptr,
        BLOCK=_BLOCK,
    )


def _zero_padding_torch(t: torch.Tensor, nv: _checks.NumValid) -> None:
    t, _, _ = _as_rows(t)
    if nv.tensor is not None:
        # CPU only: reading a CPU scalar is not a device sync.
        count = min(max(int(nv.tensor), 0), t.shape[0])
    else:
        count = int(nv.count if nv.count is not None else t.shape[0])
    t[count:].zero_()


def zero_padding_(t: torch.Tensor, num_valid: int | torch.Tensor | None) -> torch.Tensor:
    """Zero rows `>= num_valid` of `t` in place and return `t` (see the module docstring).

    On CUDA one Triton launch reading a device `num_valid` (CUDA-graph safe); on CPU plain torch.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() < 1:
        raise ValueError(f"t must have at least one dimension (rows), got shape {tuple(t.shape)}")
    nv = _checks.check_num_valid(num_valid, t.shape[0], t.device)
    if num_valid is None:
        return t
    if t.device.type == "cuda" and not interpreter_enabled():
        _zero_padding_triton(t, nv)
    else:
        _zero_padding_torch(t, nv)
    return t
