"""The expert MLPs on the dispatch layout: GEMM1 (gate, up, activation) and GEMM2 (down, weight).

Data path of `experts_triton` (five launches, four when one dispatch chunk covers all slots):
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
the combine is an ordered reduction. Addresses that are products of a row and a row length use
int64 (T*K*H and capacity*I can pass 2^31).

Activations (gate g, up u, fp32): silu g*sigmoid(g)*u; gelu (tanh form) 0.5*g*(1+tanh(...))*u;
swigluoai min(g,7)*sigmoid(1.702*min(g,7))*(clamp(u,-7,7)+1) on the same gate-then-up layout.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from safemoe._checks import NumValid
from safemoe._triton import interpreter_enabled
from safemoe.configs import ExpertsConfig, GemmTiles, get_config
from safemoe.kernels.combine import combine_into
from safemoe.kernels.dispatch import dispatch_into, launch_options, pdl_supported, wait_for_previous_kernel
from safemoe.workspace import Workspace, WorkspaceViews, max_m_blocks, num_bins

_ACTIVATION_CODES = {"silu": 0, "gelu": 1, "swigluoai": 2}
# num_valid at or below this (read on the device) runs the small-batch tiles in a larger batch.
SMALL_BATCH_TOKENS = 8
_SQRT_2_OVER_PI: tl.constexpr = tl.constexpr(0.7978845608028654)


@triton.jit
def _activation(gate, up, ACTIVATION: tl.constexpr):
    if ACTIVATION == 0:
        return gate * tl.sigmoid(gate) * up
    elif ACTIVATION == 1:
        inner = _SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        # tanh(z) = 2 * sigmoid(2z) - 1 (no tanh in every triton's tl.math)
        return 0.5 * gate * (2.0 * tl.sigmoid(2.0 * inner)) * up
    else:
        gate = tl.minimum(gate, 7.0)
        up = tl.minimum(tl.maximum(up, -7.0), 7.0)
        return gate * tl.sigmoid(1.702 * gate) * (up + 1.0)


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
def _gemm1_kernel(
    # inputs
    x_ptr,  # [T, H]
    w13_arg,  # pointer to [E, 2I, H] (gate rows [0, I), up rows [I, 2I)), or with USE_TMA a
    #           tensor descriptor over its [E*2I, H] view with [BLOCK_N, BLOCK_K] boxes
    sorted_slots_ptr,  # [capacity] int32, -1 in padding
    block_end_ptr,  # [E] int32
    num_blocks_ptr,  # [1] int32: M-blocks of this launch's layout (0: nothing to do)
    # outputs
    inter_ptr,  # [capacity, I]
    # shapes
    hidden,
    inter,
    num_experts,
    expert_stride,  # 2 * I * H
    up_offset,  # I * H
    TOP_K: tl.constexpr,
    ACTIVATION: tl.constexpr,
    NUM_BINS: tl.constexpr,
    # tunable
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    num_m_blocks, block_end = _layout_in_use(num_blocks_ptr, block_end_ptr, num_experts, NUM_BINS)
    num_n_blocks = tl.cdiv(inter, BLOCK_N)
    for tile in range(tl.program_id(0), num_m_blocks * num_n_blocks, tl.num_programs(0)):
        n_block, expert, rows, slots = _tile_rows(tile, num_m_blocks, num_n_blocks, block_end,
                                                  sorted_slots_ptr, BLOCK_M, GROUP_M)
        row_ok = slots >= 0
        tokens = tl.where(row_ok, slots // TOP_K, 0).to(tl.int64)
        cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        # Columns past I wrap onto valid rows of w13 (loads need no mask); they are never stored.
        w_cols = (cols % inter).to(tl.int64)
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + tokens[:, None] * hidden + ks[None, :]
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if USE_TMA:
            # Boxes past an expert's rows read the next rows (columns never stored), past the
            # tensor or past H zeros (the descriptor's bounds).
            gate_row = expert * 2 * inter + n_block * BLOCK_N
            for k in range(0, tl.cdiv(hidden, BLOCK_K)):
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                else:
                    k_ok = ks < hidden - k * BLOCK_K
                    a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                g = w13_arg.load([gate_row, k * BLOCK_K])
                u = w13_arg.load([gate_row + inter, k * BLOCK_K])
                acc_gate = tl.dot(a, g.T, acc_gate, input_precision=DOT_PRECISION)
                acc_up = tl.dot(a, u.T, acc_up, input_precision=DOT_PRECISION)
                a_ptrs += BLOCK_K
        else:
            gate_ptrs = w13_arg + expert.to(tl.int64) * expert_stride + w_cols[None, :] * hidden + ks[:, None]
            up_ptrs = gate_ptrs + up_offset
            for k in range(0, tl.cdiv(hidden, BLOCK_K)):
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                    g = tl.load(gate_ptrs)
                    u = tl.load(up_ptrs)
                else:
                    k_ok = ks < hidden - k * BLOCK_K
                    a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                    g = tl.load(gate_ptrs, mask=k_ok[:, None], other=0.0)
                    u = tl.load(up_ptrs, mask=k_ok[:, None], other=0.0)
                acc_gate = tl.dot(a, g, acc_gate, input_precision=DOT_PRECISION)
                acc_up = tl.dot(a, u, acc_up, input_precision=DOT_PRECISION)
                a_ptrs += BLOCK_K
                gate_ptrs += BLOCK_K
                up_ptrs += BLOCK_K
        h = _activation(acc_gate, acc_up, ACTIVATION)
        out_ptrs = inter_ptr + rows.to(tl.int64)[:, None] * inter + cols[None, :]
        tl.store(out_ptrs, h.to(inter_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < inter)[None, :])


@triton.jit
def _gemm2_kernel(
    # inputs
    inter_ptr,  # [capacity, I]
    w2_arg,  # pointer to [E, H, I], or with USE_TMA a descriptor over [E*H, I], [BLOCK_N, BLOCK_K] boxes
    weights_ptr,  # [T, K] float32, indexed by slot
    sorted_slots_ptr,  # [capacity] int32, -1 in padding
    block_end_ptr,  # [E] int32
    num_blocks_ptr,  # [1] int32: M-blocks of this launch's layout (0: nothing to do)
    # outputs
    y_ptr,  # [T*K, H]
    # shapes
    hidden,
    inter,
    num_experts,
    expert_stride,  # H * I
    NUM_BINS: tl.constexpr,
    # tunable
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    num_m_blocks, block_end = _layout_in_use(num_blocks_ptr, block_end_ptr, num_experts, NUM_BINS)
    num_n_blocks = tl.cdiv(hidden, BLOCK_N)
    for tile in range(tl.program_id(0), num_m_blocks * num_n_blocks, tl.num_programs(0)):
        n_block, expert, rows, slots = _tile_rows(tile, num_m_blocks, num_n_blocks, block_end,
                                                  sorted_slots_ptr, BLOCK_M, GROUP_M)
        row_ok = slots >= 0
        cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        w_cols = (cols % hidden).to(tl.int64)
        ks = tl.arange(0, BLOCK_K)
        # Padding rows of the intermediate were never written: masked, never read.
        a_ptrs = inter_ptr + rows.to(tl.int64)[:, None] * inter + ks[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if USE_TMA:
            w_row = expert * hidden + n_block * BLOCK_N
            for k in range(0, tl.cdiv(inter, BLOCK_K)):
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                else:
                    a = tl.load(a_ptrs, mask=row_ok[:, None] & (ks < inter - k * BLOCK_K)[None, :], other=0.0)
                b = w2_arg.load([w_row, k * BLOCK_K])
                acc = tl.dot(a, b.T, acc, input_precision=DOT_PRECISION)
                a_ptrs += BLOCK_K
        else:
            b_ptrs = w2_arg + expert.to(tl.int64) * expert_stride + w_cols[None, :] * inter + ks[:, None]
            for k in range(0, tl.cdiv(inter, BLOCK_K)):
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                    b = tl.load(b_ptrs)
                else:
                    k_ok = ks < inter - k * BLOCK_K
                    a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                    b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K
        safe_slots = tl.where(row_ok, slots, 0)
        weight = tl.load(weights_ptr + safe_slots, mask=row_ok, other=0.0)
        acc = acc * weight[:, None]
        out_ptrs = y_ptr + safe_slots.to(tl.int64)[:, None] * hidden + cols[None, :]
        tl.store(out_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < hidden)[None, :])


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _grid_size(tiles: int, device: torch.device, programs_per_sm: int) -> int:
    if device.type != "cuda":
        return max(1, min(tiles, 8))
    return max(1, min(tiles, _num_sms(device.index or 0) * programs_per_sm))


@functools.lru_cache(maxsize=1)
def _tensor_descriptor_class() -> type | None:
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    return TensorDescriptor


def _use_tma(weight: torch.Tensor, tiles: GemmTiles) -> bool:
    """TMA boxes need a descriptor class, 16-byte aligned rows and base, and boxes <= 256 wide."""
    if not tiles.tma or (weight.device.type != "cuda" and not interpreter_enabled()):
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


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: IEEE fp32 products (the default would be tf32, off the reference's tolerance).
    return "ieee" if dtype == torch.float32 else "tf32"


def gemm1_into(x: torch.Tensor, w13: torch.Tensor, views: WorkspaceViews, top_k: int, activation: str,
               cfg: ExpertsConfig, *, layout: int = 0, max_tokens: int | None = None,
               use_pdl: bool = False) -> None:
    """GEMM1 over the layout whose M-block count is views.num_blocks[layout] (0: main, 1: small
    batch); the grid covers the M-blocks `max_tokens` (default T) tokens can produce."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    tiles: GemmTiles = cfg.gemm1
    rows = num_tokens if max_tokens is None else max_tokens
    max_tiles = max_m_blocks(rows, num_experts, top_k, cfg.block_m) * triton.cdiv(inter, tiles.block_n)
    # grid: persistent programs looping over (M-block, N-block) tiles of [used M-blocks, I / BLOCK_N]
    grid = (_grid_size(max_tiles, x.device, cfg.programs_per_sm),)
    _gemm1_kernel[grid](
        x, _weight_operand(w13, tiles), views.sorted_slots, views.block_end, views.num_blocks[layout:],
        views.intermediate,
        hidden, inter, num_experts, 2 * inter * hidden, inter * hidden,
        TOP_K=top_k, ACTIVATION=_ACTIVATION_CODES[activation], NUM_BINS=num_bins(num_experts),
        BLOCK_M=cfg.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        EVEN_K=hidden % tiles.block_k == 0, DOT_PRECISION=_dot_precision(x.dtype),
        USE_TMA=_use_tma(w13, tiles), USE_PDL=use_pdl,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **launch_options(use_pdl),
    )


def gemm2_into(w2: torch.Tensor, weights: torch.Tensor, views: WorkspaceViews, num_tokens: int, top_k: int,
               cfg: ExpertsConfig, *, layout: int = 0, max_tokens: int | None = None,
               use_pdl: bool = False) -> None:
    """GEMM2 over the layout views.num_blocks[layout] counts (see gemm1_into)."""
    num_experts, hidden, inter = w2.shape
    tiles: GemmTiles = cfg.gemm2
    rows = num_tokens if max_tokens is None else max_tokens
    max_tiles = max_m_blocks(rows, num_experts, top_k, cfg.block_m) * triton.cdiv(hidden, tiles.block_n)
    # grid: persistent programs looping over (M-block, N-block) tiles of [used M-blocks, H / BLOCK_N]
    grid = (_grid_size(max_tiles, w2.device, cfg.programs_per_sm),)
    _gemm2_kernel[grid](
        views.intermediate, _weight_operand(w2, tiles), weights, views.sorted_slots, views.block_end,
        views.num_blocks[layout:],
        views.y,
        hidden, inter, num_experts, hidden * inter,
        NUM_BINS=num_bins(num_experts),
        BLOCK_M=cfg.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        EVEN_K=inter % tiles.block_k == 0, DOT_PRECISION=_dot_precision(w2.dtype),
        USE_TMA=_use_tma(w2, tiles), USE_PDL=use_pdl,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **launch_options(use_pdl),
    )


def small_batch_config(num_tokens: int, num_experts: int, hidden: int, inter: int, top_k: int,
                       dtype: torch.dtype, device: torch.device, cfg: ExpertsConfig) -> ExpertsConfig | None:
    """The tiles for few valid rows (num_valid <= SMALL_BATCH_TOKENS) in a batch whose bucket is
    larger, when the batch's own tiles are of another regime (a larger BLOCK_M): a graph captured
    for 1024 rows then replays a decode step with decode tiles instead of prefill tiles. Between
    two decode configs the switch is not worth its two extra (empty) launches, which cost ~2% at
    T = 64 on the Qwen3 shape (H200, run 2)."""
    if num_tokens <= SMALL_BATCH_TOKENS:
        return None
    small = get_config(SMALL_BATCH_TOKENS, num_experts, hidden, inter, top_k, dtype, device)
    return small if small.block_m < cfg.block_m else None


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
) -> torch.Tensor:
    """Expert MLPs with the Triton kernels; arguments already validated by `safemoe.experts`.

    Returns out [T, H] in x's dtype (written in full: rows >= num_valid are exact zeros). No host
    sync and no allocation when `workspace` and `out` are given, so it captures in a CUDA graph;
    without a workspace a temporary one is allocated. Deterministic run to run.

    Tiles: `config` (default: `safemoe.configs.get_config` for T) and, for T above
    SMALL_BATCH_TOKENS, `small_config` (default: the config of SMALL_BATCH_TOKENS tokens when it
    differs) used instead whenever num_valid <= SMALL_BATCH_TOKENS on the device: both GEMMs are
    launched for both, and the pair that dispatch did not pick finds no M-block and returns. So
    results are a deterministic function of (T, num_valid <= SMALL_BATCH_TOKENS), and a row's bits
    do not depend on what padding rows hold.
    """
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = ids.shape[1]
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}, got "
            f"{out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if num_tokens == 0:
        return out
    if config is None:
        config = get_config(num_tokens, num_experts, hidden, inter, top_k, x.dtype, x.device)
        small_config = small_batch_config(num_tokens, num_experts, hidden, inter, top_k, x.dtype, x.device,
                                          config)
    if workspace is None:
        workspace = Workspace(num_tokens, num_experts, top_k, hidden, inter, x.dtype, x.device)
    else:
        if not isinstance(workspace, Workspace):
            raise TypeError(f"workspace must be a safemoe Workspace or None, got {type(workspace).__name__}")
        workspace.check(num_tokens, num_experts, top_k, hidden, inter, x.dtype, x.device)
    views = workspace.views(num_tokens, num_experts, top_k, hidden, inter)
    use_pdl = config.pdl and x.device.type == "cuda" and pdl_supported()
    small_tokens = min(num_tokens, SMALL_BATCH_TOKENS)
    small = (small_config.block_m, small_tokens * top_k) if small_config is not None else None
    dispatch_into(ids, num_experts, num_valid, config.block_m, views, health, small=small, use_pdl=use_pdl)
    gemm1_into(x, w13, views, top_k, activation, config, use_pdl=use_pdl)
    if small_config is not None:
        gemm1_into(x, w13, views, top_k, activation, small_config, layout=1, max_tokens=small_tokens,
                   use_pdl=use_pdl)
    gemm2_into(w2, weights, views, num_tokens, top_k, config, use_pdl=use_pdl)
    if small_config is not None:
        gemm2_into(w2, weights, views, num_tokens, top_k, small_config, layout=1, max_tokens=small_tokens,
                   use_pdl=use_pdl)
    combine_into(views.y, ids, num_experts, num_valid, out, use_pdl=use_pdl)
    return out
