"""Expert-parallel exchange: plan, pack, unpack and combine of `safemoe.distributed.ep` as four
Triton launches (the torch version in `safemoe.distributed.ep` stays the reference the tests
compare with).

Contract (rank r of W, E experts, E_local = E / W; rank p owns global ids [p * E_local, (p+1) *
E_local); slot (t, k) is *served* iff t < num_valid and 0 <= ids[t, k] < E):
- `count` (grid: one program per BLOCK_T rows): block_counts[b, p] = rows of block b that hold at
  least one served slot owned by p. Every entry of [NB, W_PAD] is written (no clearing needed).
  Dropped slots (valid rows, id outside [0, E)) are added to health[DROPPED_SLOTS]. Ids of rows
  >= num_valid (read on the device, clamped to [0, T]) are never read.
- `pack` (grid: NB row blocks + the blank-row programs, times H tiles): row t goes ONCE to each
  peer p it needs, at wire row base[p] + pos[t, p], pos = the number of earlier rows needing p
  (rows in increasing t, exactly the torch plan). base[p] = p * C in capacity mode (rows with pos
  >= C are not placed: their slots on p add to health[EP_OVERFLOW_SLOTS]) and the exclusive prefix
  sum of the per-peer totals in dynamic mode. A placed row carries x's H elements, then K int32
  global ids with the other peers' slots -1, then K float32 weights (their bits unchanged) with
  the other peers' slots 0. row_of[t, p] = the wire row, -1 when t is not placed on p (all of
  [T, W] is written). Capacity mode: the wire rows [base[p] + total[p], base[p] + C) are blank:
  ids -1 and weights 0; their x bytes are NOT written (a blank row has no served slot, so no
  expert reads it, and blanking 14 KB rows of a mostly padded bucket would cost what the
  exchange saves). Nothing is ever addressed through an unserved id.
- `unpack` (receiver; grid: row blocks of the received wire, times H tiles): local ids = global -
  first where first <= global < first + E_local (the test runs on the global id itself: no
  subtraction wraps garbage into range), -1 elsewhere; weights kept where the id is local, 0
  elsewhere; ids that are neither -1 nor local are strays, added to health[DROPPED_SLOTS]. x is
  copied to a contiguous [S, H] only for rows holding a local slot (rows without one are never
  read by the experts).
- `combine` (grid: row blocks of T, times H tiles): out[t] = sum over p = 0, ..., W-1 in this
  order, in fp32, of partials[row_of[t, p]] (skipped where -1), rounded once to out's dtype: the
  same sum, in the same order, as the torch combine, so the two paths agree bitwise. Rows never
  placed anywhere (padding included) come out exact zeros.
No launch syncs with the host; grids depend on T, W, C and H only, so the capacity mode captures
in a CUDA graph and replays with any device num_valid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from safemoe._checks import NumValid
from safemoe.kernels.launch import cdiv, load_num_valid, next_power_of_2

BLOCK_T = 32  # rows per program of count/pack/combine: a [32, K, W] plan tile stays in registers
BLOCK_S = 32  # received rows per program of unpack
FILL_ROWS = 256  # blank wire rows (meta only) per program of pack
_MAX_BLOCK_H = 512  # columns per program of the row copies (1 KB of bf16 per row per program)
# Warps of the row-copying launches: a [32, 512] tile is 64 elements per thread with 8 warps (the
# combine's fp32 accumulator then fits in registers; 4 warps would hold 128 per thread).
_COPY_WARPS = 8


@triton.jit
def _plan_tile(ids_ptr, rows, num_valid, num_experts, experts_per_rank,
               TOP_K: tl.constexpr, K_PAD: tl.constexpr, W_PAD: tl.constexpr):
    """(ids, slot_ok, served, owner, hits) of one row block: owner [BT, K_PAD] is the peer of a
    served slot, -1 elsewhere; hits [BT, W_PAD] counts each row's served slots per peer."""
    ks = tl.arange(0, K_PAD)
    peers = tl.arange(0, W_PAD)
    slot_ok = (rows < num_valid)[:, None] & (ks < TOP_K)[None, :]
    ids = tl.load(ids_ptr + rows.to(tl.int64)[:, None] * TOP_K + ks[None, :], mask=slot_ok, other=-1)
    served = slot_ok & (ids >= 0) & (ids < num_experts)
    owner = tl.where(served, ids // experts_per_rank, -1)
    hits = tl.sum((owner[:, :, None] == peers[None, None, :]).to(tl.int32), axis=1)
    return ids, slot_ok, served, owner, hits


@triton.jit
def _count_kernel(
    # inputs
    ids_ptr,  # [T, K] int32
    num_valid_ptr,  # 0-dim int32/int64 (if HAS_NUM_VALID_PTR)
    # outputs
    block_counts_ptr,  # [NB, W_PAD] int32: rows of each block needing each peer
    health_ptr,  # [8] int64 (if HAS_HEALTH)
    # shapes
    num_valid_count,
    num_tokens,
    num_experts,
    experts_per_rank,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    W_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_NUM_VALID_PTR: tl.constexpr,
    HAS_HEALTH: tl.constexpr,
):
    pid = tl.program_id(0)
    num_valid = load_num_valid(num_valid_ptr, num_valid_count, num_tokens, HAS_NUM_VALID_PTR)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    _, slot_ok, served, _, hits = _plan_tile(ids_ptr, rows, num_valid, num_experts, experts_per_rank,
                                             TOP_K, K_PAD, W_PAD)
    counts = tl.sum((hits > 0).to(tl.int32), axis=0)
    tl.store(block_counts_ptr + pid * W_PAD + tl.arange(0, W_PAD), counts)
    if HAS_HEALTH:
        dropped = tl.sum(tl.sum((slot_ok & ~served).to(tl.int64), axis=1), axis=0)
        tl.atomic_add(health_ptr + 1, dropped, sem="relaxed")


@triton.jit
def _pack_kernel(
    # inputs
    x_ptr,  # [T, H]
    ids_ptr,  # [T, K] int32, global ids
    weight_bits_ptr,  # [T, K] int32: the float32 weights' bits
    num_valid_ptr,
    block_counts_ptr,  # [NB, W_PAD] int32 from count
    # outputs
    wire_x_ptr,  # [S, row elements] x's dtype view of the wire
    wire_meta_ptr,  # [S, row words] int32 view of the same wire
    row_of_ptr,  # [T, WORLD] int32: wire row of (t, p), -1 if not placed
    health_ptr,
    # shapes
    num_valid_count,
    num_tokens,
    hidden,
    num_experts,
    experts_per_rank,
    capacity,  # C rows per peer (capacity mode)
    wire_rows,  # S
    row_elems,  # wire row stride in x elements
    row_words,  # wire row stride in int32 words
    meta_word,  # first int32 word of the ids in a wire row
    num_blocks,  # NB
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    WORLD: tl.constexpr,
    W_PAD: tl.constexpr,
    NB_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FILL_ROWS: tl.constexpr,
    DYNAMIC: tl.constexpr,
    HAS_NUM_VALID_PTR: tl.constexpr,
    HAS_HEALTH: tl.constexpr,
):
    pid = tl.program_id(0)
    col_block = tl.program_id(1)
    peers = tl.arange(0, W_PAD)
    ks = tl.arange(0, K_PAD)
    blocks = tl.arange(0, NB_PAD)
    block_counts = tl.load(block_counts_ptr + blocks[:, None] * W_PAD + peers[None, :],
                           mask=(blocks < num_blocks)[:, None], other=0)  # fmt: skip
    totals = tl.sum(block_counts, axis=0)  # [W_PAD] rows per peer
    if DYNAMIC:
        # Exclusive prefix sums as masked sums, not tl.cumsum: Triton 3.6 fails to lower a scan
        # over these narrow [W_PAD] / [BLOCK_T, W_PAD] tiles with 8 warps (ScanOpToLLVM assertion,
        # H100, 2026-11-24).
        base = tl.sum(tl.where(peers[None, :] < peers[:, None], totals[None, :], 0), axis=1)
    else:
        base = peers * capacity
    if pid < num_blocks:
        num_valid = load_num_valid(num_valid_ptr, num_valid_count, num_tokens, HAS_NUM_VALID_PTR)
        rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        ids, slot_ok, _, owner, hits = _plan_tile(ids_ptr, rows, num_valid, num_experts,
                                                  experts_per_rank, TOP_K, K_PAD, W_PAD)
        need = (hits > 0).to(tl.int32)
        before = tl.sum(tl.where(blocks[:, None] < pid, block_counts, 0), axis=0)  # [W_PAD]
        local = tl.arange(0, BLOCK_T)
        earlier = local[None, :, None] < local[:, None, None]  # [BT, BT, 1]: row j before row i
        pos = before[None, :] + tl.sum(tl.where(earlier, need[None, :, :], 0), axis=1)  # exclusive rank
        placed = (need > 0) & (peers < WORLD)[None, :]
        if not DYNAMIC:
            placed = placed & (pos < capacity)
        dest = tl.where(placed, base[None, :] + pos, -1)  # [BT, W_PAD]
        rows64 = rows.to(tl.int64)
        cols = col_block * BLOCK_H + tl.arange(0, BLOCK_H)
        col_ok = cols < hidden
        x = tl.load(x_ptr + rows64[:, None] * hidden + cols[None, :],
                    mask=(rows < num_valid)[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
        weight_bits = tl.load(weight_bits_ptr + rows64[:, None] * TOP_K + ks[None, :], mask=slot_ok, other=0)
        for p in tl.static_range(WORLD):
            dest_p = tl.sum(tl.where(peers[None, :] == p, dest, 0), axis=1)  # [BT]
            on_p = dest_p >= 0
            wire_row = dest_p.to(tl.int64)
            tl.store(wire_x_ptr + wire_row[:, None] * row_elems + cols[None, :], x,
                     mask=on_p[:, None] & col_ok[None, :])  # fmt: skip
            if col_block == 0:
                mine = owner == p
                meta = wire_meta_ptr + wire_row[:, None] * row_words + meta_word + ks[None, :]
                meta_ok = on_p[:, None] & (ks < TOP_K)[None, :]
                tl.store(meta, tl.where(mine, ids, -1), mask=meta_ok)
                tl.store(meta + TOP_K, tl.where(mine, weight_bits, 0), mask=meta_ok)
        if col_block == 0:
            tl.store(row_of_ptr + rows64[:, None] * WORLD + peers[None, :], dest,
                     mask=(rows < num_tokens)[:, None] & (peers < WORLD)[None, :])  # fmt: skip
            if HAS_HEALTH and not DYNAMIC:
                lost = tl.where((need > 0) & ~placed, hits, 0).to(tl.int64)
                tl.atomic_add(health_ptr + 3, tl.sum(tl.sum(lost, axis=1), axis=0), sem="relaxed")
    elif col_block == 0:
        # Blank rows of the capacity wire (the dynamic mode's grid has no such programs): ids -1,
        # weights 0; x bytes unspecified, never read.
        j = (pid - num_blocks) * FILL_ROWS + tl.arange(0, FILL_ROWS)
        peer_of = j // capacity
        total_of = tl.sum(tl.where(peers[None, :] == peer_of[:, None], totals[None, :], 0), axis=1)
        blank = (j < wire_rows) & (j - peer_of * capacity >= total_of)
        meta = wire_meta_ptr + j.to(tl.int64)[:, None] * row_words + meta_word + ks[None, :]
        meta_ok = blank[:, None] & (ks < TOP_K)[None, :]
        tl.store(meta, tl.full((FILL_ROWS, K_PAD), -1, tl.int32), mask=meta_ok)
        tl.store(meta + TOP_K, tl.zeros((FILL_ROWS, K_PAD), tl.int32), mask=meta_ok)


@triton.jit
def _unpack_kernel(
    # inputs
    wire_x_ptr,  # [S, row elements] received wire, x's dtype view
    wire_meta_ptr,  # [S, row words] int32 view
    # outputs
    x_ptr,  # [S, H] contiguous: rows with a local slot written
    local_ids_ptr,  # [S, K] int32
    weights_ptr,  # [S, K] float32
    health_ptr,
    # shapes
    wire_rows,
    hidden,
    row_elems,
    row_words,
    meta_word,
    first_expert,
    experts_per_rank,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_HEALTH: tl.constexpr,
):
    pid = tl.program_id(0)
    col_block = tl.program_id(1)
    rows = pid * BLOCK_S + tl.arange(0, BLOCK_S)
    rows64 = rows.to(tl.int64)
    ks = tl.arange(0, K_PAD)
    slot_ok = (rows < wire_rows)[:, None] & (ks < TOP_K)[None, :]
    meta = wire_meta_ptr + rows64[:, None] * row_words + meta_word + ks[None, :]
    global_ids = tl.load(meta, mask=slot_ok, other=-1)
    local = slot_ok & (global_ids >= first_expert) & (global_ids < first_expert + experts_per_rank)
    if col_block == 0:
        weight_bits = tl.load(meta + TOP_K, mask=slot_ok, other=0)
        weights = tl.where(local, weight_bits.to(tl.float32, bitcast=True), 0.0)
        out = rows64[:, None] * TOP_K + ks[None, :]
        tl.store(local_ids_ptr + out, tl.where(local, global_ids - first_expert, -1), mask=slot_ok)
        tl.store(weights_ptr + out, weights, mask=slot_ok)
        if HAS_HEALTH:
            strays = tl.sum(tl.sum((slot_ok & (global_ids != -1) & ~local).to(tl.int64), axis=1), axis=0)
            tl.atomic_add(health_ptr + 1, strays, sem="relaxed")
    has_local = tl.sum(local.to(tl.int32), axis=1) > 0
    cols = col_block * BLOCK_H + tl.arange(0, BLOCK_H)
    copy = has_local[:, None] & (cols < hidden)[None, :]
    x = tl.load(wire_x_ptr + rows64[:, None] * row_elems + cols[None, :], mask=copy)
    tl.store(x_ptr + rows64[:, None] * hidden + cols[None, :], x, mask=copy)


@triton.jit
def _combine_kernel(
    partials_ptr,  # [S, H] returned partial outputs
    row_of_ptr,  # [T, WORLD] int32 from pack
    out_ptr,  # [T, H]
    num_tokens,
    hidden,
    WORLD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rows64 = rows.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < hidden
    in_rows = rows < num_tokens
    acc = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    for p in tl.static_range(WORLD):  # fixed peer order: deterministic, the torch combine's sum
        src = tl.load(row_of_ptr + rows64 * WORLD + p, mask=in_rows, other=-1)
        ok = (src >= 0)[:, None] & col_ok[None, :]
        part = tl.load(partials_ptr + src.to(tl.int64)[:, None] * hidden + cols[None, :], mask=ok, other=0.0)
        acc += part.to(tl.float32)
    out = _round_once(acc, out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows64[:, None] * hidden + cols[None, :], out, mask=in_rows[:, None] & col_ok[None, :])


@triton.jit
def _round_once(acc, out_type: tl.constexpr):
    """fp32 -> out_type rounded to nearest even, as torch's `.to()` does. bf16 is rounded by hand:
    the Triton interpreter truncates fp32 -> bf16 (seen with triton 3.9), and the CPU tests compare
    this combine bitwise with the torch one."""
    if out_type == tl.bfloat16:
        bits = acc.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        acc = tl.where(acc != acc, acc, rounded.to(tl.float32, bitcast=True))  # NaN stays NaN
    return acc.to(out_type)


# ------------------------------------------------------------------------------------------------
# Launchers (no allocation inside; callers own the buffers)
# ------------------------------------------------------------------------------------------------


def _block_h(hidden: int) -> int:
    return min(_MAX_BLOCK_H, next_power_of_2(max(hidden, 16)))


def _nv_args(num_valid: NumValid, num_tokens: int, dummy: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
    if num_valid.tensor is not None:
        return num_valid.tensor, num_tokens, True
    assert num_valid.count is not None
    return dummy, num_valid.count, False


def row_blocks(num_tokens: int) -> int:
    """NB: the count/pack row blocks of T rows (at least 1)."""
    return max(1, cdiv(num_tokens, BLOCK_T))


def peer_pad(world: int) -> int:
    return next_power_of_2(max(world, 2))


def count_into(
    ids: torch.Tensor,  # [T, K] int32, global
    num_valid: NumValid,
    num_experts: int,
    world: int,
    block_counts: torch.Tensor,  # [NB, W_PAD] int32 out
    health: torch.Tensor | None,
) -> None:
    """Rows per (row block, peer) into `block_counts`; dropped slots into health."""
    num_tokens, top_k = ids.shape
    nb, w_pad = row_blocks(num_tokens), peer_pad(world)
    if block_counts.shape != (nb, w_pad) or block_counts.dtype != torch.int32:
        raise ValueError(f"block_counts must be int32 [{nb}, {w_pad}], got {block_counts.dtype} "
                         f"{tuple(block_counts.shape)}")  # fmt: skip
    nv_ptr, nv_count, has_nv = _nv_args(num_valid, num_tokens, ids)
    # grid: one program per BLOCK_T rows of T
    _count_kernel[(nb,)](
        ids, nv_ptr,
        block_counts, health if health is not None else ids,
        nv_count, num_tokens, num_experts, num_experts // world,
        TOP_K=top_k, K_PAD=next_power_of_2(top_k), W_PAD=w_pad, BLOCK_T=BLOCK_T,
        HAS_NUM_VALID_PTR=has_nv, HAS_HEALTH=health is not None,
    )  # fmt: skip


def pack_into(
    x: torch.Tensor,  # [T, H]
    ids: torch.Tensor,  # [T, K] int32
    weights: torch.Tensor,  # [T, K] float32
    num_valid: NumValid,
    num_experts: int,
    world: int,
    block_counts: torch.Tensor,  # [NB, W_PAD] int32 from count_into
    wire: torch.Tensor,  # [S, row bytes] uint8 out
    meta_offset: int,  # bytes before the ids in a wire row
    row_of: torch.Tensor,  # [T, W] int32 out
    health: torch.Tensor | None,
    *,
    capacity: int | None,  # C rows per peer; None: dynamic mode (S = the exact total)
) -> None:
    """Pack this rank's rows into the wire (see the module contract)."""
    num_tokens, hidden = x.shape
    top_k = ids.shape[1]
    wire_rows, row_bytes = wire.shape
    itemsize = x.element_size()
    if row_bytes % 4 or row_bytes % itemsize or meta_offset % 4:
        raise ValueError(f"wire rows must be whole int32 words, got {row_bytes=} {meta_offset=}")
    if row_of.shape != (num_tokens, world) or row_of.dtype != torch.int32:
        raise ValueError(f"row_of must be int32 [{num_tokens}, {world}], got {row_of.dtype} "
                         f"{tuple(row_of.shape)}")  # fmt: skip
    if capacity is not None and wire_rows != world * capacity:
        raise ValueError(f"a capacity wire holds W*C = {world * capacity} rows, got {wire_rows}")
    nb, w_pad = row_blocks(num_tokens), peer_pad(world)
    block_h = _block_h(hidden)
    fill = 0 if capacity is None else cdiv(wire_rows, FILL_ROWS)
    nv_ptr, nv_count, has_nv = _nv_args(num_valid, num_tokens, ids)
    # grid: (row blocks of T, then blank-row programs of the capacity wire) x column tiles of H
    _pack_kernel[(nb + fill, cdiv(hidden, block_h))](
        x, ids, weights.view(torch.int32), nv_ptr, block_counts,
        wire.view(x.dtype), wire.view(torch.int32), row_of, health if health is not None else ids,
        nv_count, num_tokens, hidden, num_experts, num_experts // world, capacity or 1, wire_rows,
        row_bytes // itemsize, row_bytes // 4, meta_offset // 4, nb,
        TOP_K=top_k, K_PAD=next_power_of_2(top_k), WORLD=world, W_PAD=w_pad,
        NB_PAD=next_power_of_2(nb), BLOCK_T=BLOCK_T, BLOCK_H=block_h, FILL_ROWS=FILL_ROWS,
        DYNAMIC=capacity is None, HAS_NUM_VALID_PTR=has_nv, HAS_HEALTH=health is not None,
        num_warps=_COPY_WARPS,
    )  # fmt: skip


def unpack_into(
    wire: torch.Tensor,  # [S, row bytes] uint8, received
    meta_offset: int,
    first_expert: int,
    experts_per_rank: int,
    x: torch.Tensor,  # [S, H] out (rows with a local slot written)
    local_ids: torch.Tensor,  # [S, K] int32 out
    weights: torch.Tensor,  # [S, K] float32 out
    health: torch.Tensor | None,
) -> None:
    """Received rows -> x, local ids (bounds-checked), weights; strays into health."""
    wire_rows, row_bytes = wire.shape
    hidden, top_k = x.shape[1], local_ids.shape[1]
    if wire_rows == 0:
        return
    block_h = _block_h(hidden)
    # grid: row blocks of the received wire x column tiles of H
    _unpack_kernel[(cdiv(wire_rows, BLOCK_S), cdiv(hidden, block_h))](
        wire.view(x.dtype), wire.view(torch.int32),
        x, local_ids, weights, health if health is not None else local_ids,
        wire_rows, hidden, row_bytes // x.element_size(), row_bytes // 4, meta_offset // 4,
        first_expert, experts_per_rank,
        TOP_K=top_k, K_PAD=next_power_of_2(top_k), BLOCK_S=BLOCK_S, BLOCK_H=block_h,
        HAS_HEALTH=health is not None, num_warps=_COPY_WARPS,
    )  # fmt: skip


def combine_into(partials: torch.Tensor, row_of: torch.Tensor, out: torch.Tensor) -> None:
    """out[t] = sum over peers in order of partials[row_of[t, p]] (fp32), zeros where unplaced."""
    num_tokens, hidden = out.shape
    if num_tokens == 0:
        return
    world = row_of.shape[1]
    block_h = _block_h(hidden)
    # grid: row blocks of T x column tiles of H
    _combine_kernel[(cdiv(num_tokens, BLOCK_T), cdiv(hidden, block_h))](
        partials, row_of, out, num_tokens, hidden, WORLD=world, BLOCK_T=BLOCK_T, BLOCK_H=block_h,
        num_warps=_COPY_WARPS,
    )  # fmt: skip
