"""Combine: out[t] = sum over k = 0..K-1 (in that order) of y[t*K + k] for the served slots of t.

Contract: y [T*K, H] holds each served slot's weighted expert output (written by GEMM2); rows of
slots that are not served were never written and are never read here, because this kernel
re-checks the dispatch predicate (t < num_valid and 0 <= ids[t, k] < E) on the same ids. Sums run
in fp32 in the fixed order k = 0..K-1 and round once to out's dtype, so the result is
deterministic run to run (no atomics). Rows t >= num_valid are written as exact zeros; every
element of out is written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from safemoe._checks import NumValid
from safemoe.kernels.launch import (
    cdiv,
    launch_options,
    load_num_valid,
    next_power_of_2,
    wait_for_previous_kernel,
)


@triton.jit
def _combine_kernel(
    y_ptr,  # [T*K, H] weighted expert outputs by slot
    ids_ptr,  # [T, K] int32
    num_valid_ptr,
    out_ptr,  # [T, H] out
    num_valid_count,
    num_tokens,
    num_experts,
    hidden,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_NUM_VALID_PTR: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # num_valid and the padding rows' zeros depend on nothing the earlier kernels of the call write,
    # so with PDL the zeros are stored before waiting for them, while GEMM2 still runs (a padded
    # batch's zero rows were ~2.7 us of a decode step at T = 1024 on Qwen3, H100). Every program
    # still waits before it exits, so the kernel never completes before its predecessors.
    num_valid = load_num_valid(num_valid_ptr, num_valid_count, num_tokens, HAS_NUM_VALID_PTR)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < hidden
    row_valid = rows < num_valid
    rows64 = rows.to(tl.int64)
    out_ptrs = out_ptr + rows64[:, None] * hidden + cols[None, :]
    padding = (rows >= num_valid) & (rows < num_tokens)
    tl.store(out_ptrs, tl.zeros((BLOCK_T, BLOCK_H), dtype=out_ptr.dtype.element_ty),
             mask=padding[:, None] & col_ok[None, :])
    wait_for_previous_kernel(USE_PDL)
    if tl.program_id(0) * BLOCK_T < num_valid:
        acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            expert = tl.load(ids_ptr + rows64 * TOP_K + k, mask=row_valid, other=-1)
            served = row_valid & (expert >= 0) & (expert < num_experts)
            part = tl.load(y_ptr + (rows64 * TOP_K + k)[:, None] * hidden + cols[None, :],
                           mask=served[:, None] & col_ok[None, :], other=0.0)
            acc += part.to(tl.float32)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & col_ok[None, :])


def combine_tiles(num_tokens: int, hidden: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_H, num_warps): up to 8 x 512 elements a program, but at least ~256 programs
    where the shape allows (32 programs took 7 us at T=64, H=2048 on an H200: too little in
    flight), and 8 bf16 (16 bytes) per thread and load."""
    block_h = min(next_power_of_2(hidden), 512)
    block_t = max(1, 4096 // block_h)
    while block_t > 1 and cdiv(num_tokens, block_t) * cdiv(hidden, block_h) < 256:
        block_t //= 2
    num_warps = max(1, min(4, block_t * block_h // 256))
    return block_t, block_h, num_warps


def combine_into(
    y: torch.Tensor,  # [T*K, H]
    ids: torch.Tensor,  # [T, K] int32
    num_experts: int,
    num_valid: NumValid,
    out: torch.Tensor,  # [T, H]
    *,
    use_pdl: bool = False,
) -> None:
    num_tokens, top_k = ids.shape
    hidden = out.shape[1]
    block_t, block_h, num_warps = combine_tiles(num_tokens, hidden)
    has_nv_ptr = num_valid.tensor is not None
    # grid: one program per BLOCK_T rows x BLOCK_H columns of out
    grid = (cdiv(num_tokens, block_t), cdiv(hidden, block_h))
    _combine_kernel[grid](
        y, ids, num_valid.tensor if has_nv_ptr else ids, out,
        num_valid.count if num_valid.count is not None else num_tokens, num_tokens, num_experts, hidden,
        TOP_K=top_k, BLOCK_T=block_t, BLOCK_H=block_h, HAS_NUM_VALID_PTR=has_nv_ptr, USE_PDL=use_pdl,
        num_warps=num_warps, **launch_options(use_pdl),
    )
