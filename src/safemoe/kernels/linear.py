"""Batch-invariant dense linear: out = x @ weight.T (+ bias), for the gate logits and the shared
expert of a `safemoe.MoE` built with `batch_invariant=True`.

Why: torch's matmul (cuBLAS on CUDA) picks its algorithm, and with it the order of each output's
sum, by shape, so a row's logits can change bits with T. This kernel's tiles are constants, so
each output element is the same fp32 sum in the same order whatever T is.

Contract:
- x: [T, K] bf16/fp16/fp32, rows contiguous (row stride given). weight: [N, K] in x's dtype (any
  strides: a transposed view works). bias: optional [N] (any float dtype).
- out[t, n] = round(sum over K steps of BLOCK_K, in order, of the fp32 dot of x[t, step] and
  weight[n, step], + bias[n]) to out's dtype. With `fp32`, x and weight are upcast to fp32 in
  the kernel and multiplied in IEEE fp32 (a Linear on fp32 copies); out is then float32.
- Row t of out depends on row t of x and on the weights only: masked rows past T are zeros and
  never mix into a valid row, and T is not specialised on (do_not_specialize). Under the Triton
  interpreter the products are `rowwise_product` (tl.dot there is OpenBLAS, whose bits follow a
  row's position in the tile).
- Every row is computed (padding rows too: callers zero or ignore them); no host sync, no
  allocation when `out` is given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from safemoe._triton import interpreter_enabled
from safemoe.kernels.launch import cdiv, rowwise_product


@dataclass(frozen=True)
class LinearTiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


# One tile set for every T (the invariance). Untuned: 32-row M-blocks waste less than 64 or 128 at
# decode, where this kernel is a weight stream; `safemoe bench --suite invariance` (its `layer` rows)
# measures what the gate costs with it.
_CUDA_TILES = LinearTiles(block_m=32, block_n=64, block_k=64)
# The interpreter: small tiles only cost less time.
_INTERPRETER_TILES = LinearTiles(block_m=16, block_n=16, block_k=32, num_stages=1)


def linear_tiles(device: torch.device) -> LinearTiles:
    return _CUDA_TILES if device.type == "cuda" else _INTERPRETER_TILES


@triton.jit(do_not_specialize=["num_rows"])
def _linear_rows_kernel(
    # inputs
    x_ptr,  # [T, K], row stride x_row_stride
    w_ptr,  # [N, K], strides (w_row_stride, w_col_stride)
    bias_ptr,  # [N] (read iff HAS_BIAS)
    # outputs
    out_ptr,  # [T, N] contiguous
    # shapes
    num_rows,
    num_cols,
    depth,  # K
    x_row_stride,
    w_row_stride,
    w_col_stride,
    HAS_BIAS: tl.constexpr,
    FP32: tl.constexpr,  # upcast both operands to fp32, IEEE products
    ROWWISE: tl.constexpr,  # interpreter: the position-independent product (kernels/launch.py)
    # tunable (fixed: the invariance)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    col_ok = cols < num_cols
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride + ks[None, :]
    b_ptrs = w_ptr + cols.to(tl.int64)[None, :] * w_row_stride + ks[:, None].to(tl.int64) * w_col_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(depth, BLOCK_K)):
        k_ok = ks < depth - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if ROWWISE:
            acc += rowwise_product(a, b)
        elif FP32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * w_col_stride
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * num_cols + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def linear_rows_into(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                     *, fp32: bool = False) -> torch.Tensor:
    """out [T, N] = x [T, K] @ weight [N, K].T (+ bias [N]) with fixed tiles; returns out."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [T, K] and weight [N, K], got {tuple(x.shape)=} {tuple(weight.shape)=}")
    if x.stride(1) != 1:
        raise ValueError(f"x's rows must be contiguous, got {x.stride()=}")
    wanted = torch.float32 if fp32 else x.dtype
    if not fp32 and weight.dtype != x.dtype:
        raise TypeError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    num_rows, depth = x.shape
    num_cols = weight.shape[0]
    if tuple(out.shape) != (num_rows, num_cols) or out.dtype != wanted or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {wanted} [{num_rows}, {num_cols}], got "
                         f"{out.dtype} {tuple(out.shape)}")
    if bias is not None and tuple(bias.shape) != (num_cols,):
        raise ValueError(f"bias must be [{num_cols}], got {tuple(bias.shape)}")
    if num_rows == 0 or num_cols == 0:
        return out
    tiles = linear_tiles(x.device)
    # grid: one program per (BLOCK_M rows, BLOCK_N columns) tile of out
    grid = (cdiv(num_rows, tiles.block_m), cdiv(num_cols, tiles.block_n))
    _linear_rows_kernel[grid](
        x, weight, bias if bias is not None else x,
        out,
        num_rows, num_cols, depth, x.stride(0), weight.stride(0), weight.stride(1),
        HAS_BIAS=bias is not None, FP32=fp32 or x.dtype == torch.float32,
        ROWWISE=interpreter_enabled(),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                fp32: bool = False) -> torch.Tensor:
    """Allocating wrapper of `linear_rows_into`: [T, N] in x's dtype (float32 with `fp32`)."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32 if fp32 else x.dtype, device=x.device)
    return linear_rows_into(x, weight, bias, out, fp32=fp32)


def linear_rows_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                      fp32: bool = False) -> torch.Tensor:
    """The plain-torch op it matches (to tolerance, not bits): F.linear, on fp32 copies with fp32."""
    if fp32:
        return torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    out = x.float() @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
