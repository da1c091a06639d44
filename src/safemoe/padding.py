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

import torch

from safemoe import _checks
from safemoe._triton import interpreter_enabled


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
    from safemoe.kernels.padding import zero_padding_into

    zero_padding_into(*_as_rows(t), nv)


def _zero_padding_torch(t: torch.Tensor, nv: _checks.NumValid) -> None:
    t, _, _ = _as_rows(t)
    if nv.tensor is not None:
        # CPU only: reading a CPU scalar is not a device sync.
        count = min(max(int(nv.tensor), 0), t.shape[0])
    else:
        count = int(nv.count if nv.count is not None else t.shape[0])
    t[count:].zero_()


def zero_padding_rows(t: torch.Tensor, nv: _checks.NumValid) -> None:
    """The body of the `safemoe::zero_padding_` op: the kernel on CUDA, plain torch elsewhere."""
    if t.device.type == "cuda" and not interpreter_enabled():
        _zero_padding_triton(t, nv)
    else:
        _zero_padding_torch(t, nv)


def zero_padding_(t: torch.Tensor, num_valid: int | torch.Tensor | None) -> torch.Tensor:
    """Zero rows `>= num_valid` of `t` in place and return `t` (see the module docstring).

    On CUDA one Triton launch reading a device `num_valid` (CUDA-graph safe); on CPU plain torch.
    Goes through the registered op `safemoe::zero_padding_`, so it also works in compiled code.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() < 1:
        raise ValueError(f"t must have at least one dimension (rows), got shape {tuple(t.shape)}")
    nv = _checks.check_num_valid(num_valid, t.shape[0], t.device)
    if num_valid is None:
        return t
    _as_rows(t)  # trailing dimensions contiguous, checked before the op
    from safemoe import ops

    return ops.zero_padding_(t, nv)
