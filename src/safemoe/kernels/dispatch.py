"""Dispatch: routing ids [T, K] -> the expert-sorted, BLOCK_M-padded slot layout the GEMMs read.

Contract (see also reference.dispatch_reference, which this matches up to the order of slots
inside one expert):
- Slots are numbered s = t * K + k. A slot is *served* iff t < num_valid and 0 <= ids[t, k] < E.
  Duplicate ids in a row are each served. Ids of rows >= num_valid are never read. Every slot of a
  valid row whose id is outside [0, E) (-1, negative, >= E, stale garbage) is dropped, never used
  as an address, and counted into health[DROPPED_SLOTS].
- Output (in the workspace): counts per expert are folded into `block_end[e]` (inclusive prefix sum
  of ceil(count_e / BLOCK_M)), `num_blocks` (M-blocks in use), and `sorted_slots`, where expert e
  owns positions [BLOCK_M * (block_end[e-1]), BLOCK_M * block_end[e]): its served slots first (in
  an unspecified order: positions come from atomics), then -1 in the padding positions. Positions
  at or past num_blocks * BLOCK_M are not written and must not be read.
- Two launches for large T, one when one chunk covers every slot (T*K <= ALONE_SLOTS): `count`
  histograms each chunk of slots into `counts` with atomics; the last program to finish (an
  acq_rel ticket) turns the counts into the padded layout, writes the -1 padding and cursor[e] =
  first position of e, and puts `counts` and the ticket back to zero, so a workspace needs no
  clearing between calls. `scatter` then gives each served slot `pos = atomic_add(cursor[e], 1)`.
  When the valid slots fit program 0's chunk (num_valid * K <= the chunk: every slot when
  T*K <= ALONE_SLOTS, else CHUNK; decided on the device) program 0 does all of it from its own
  counts (tl.histogram, or with 1024+ bins in a chunk wider than CHUNK atomic adds,
  `_count_alone`): the same steps minus the ticket, and the scatter kernel, if launched, returns
  at once (two dependent atomic round trips fewer at decode, and a graph captured for many rows
  costs little more than decode when few rows are valid). Grids depend on T only; programs past
  the last chunk holding a slot of a valid row return at once, so the work scales with
  num_valid, which may be a device tensor (read on the device, clamped to [0, T]).
- fp8 (`dispatch_into(quantize_x=...)`): when one program builds the layout (T*K <= ALONE_SLOTS),
  the launch has more programs that quantise x's rows below num_valid into the fp8 views
  (act_quant.quantize_items: the bits of the separate quantisation launch, which runs instead
  for larger T). They read only x and num_valid, never the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from safemoe._checks import NumValid
from safemoe._triton import interpreter_enabled
from safemoe.kernels.act_quant import lent_rows_tiles, quantize_items
from safemoe.kernels.launch import (
    cdiv,
    launch_options,
    load_num_valid,
    next_power_of_2,
    wait_for_previous_kernel,
)
from safemoe.workspace import WorkspaceViews, capacity, num_bins

# Slots per program of count/scatter. Whenever num_valid * K <= CHUNK (read on the device) one
# program does count + scan + scatter alone; more programs split larger batches (a 4096-slot
# chunk per program took 17-41 us at 16-64k slots on an H200, mostly per-program serial work).
CHUNK = 1024
# T*K up to this: one program takes every slot as one chunk (no counters, no scatter launch), with
# ALONE_WARPS warps once that chunk is wider than CHUNK. H200, whole layer
# (scripts/debug/dispatch_alone_ab.py, 2026-11-27): 4096 slots / 8 warps against count + scatter
# launches: gpt-oss T = 1024 with one valid row -1.4% (0.9 us), Qwen3 T = 256 -0.5%, full
# T*K = 4096 steps unchanged; 8192 slots cost Qwen3's full T = 1024 step +2.5% (the one program's
# serial work) for -3% on its one-row step, and a 4-warp loop over 1024-slot chunks +1.6% at 4096.
ALONE_SLOTS = 4096
ALONE_WARPS = 8
# fp8: a one-program dispatch launch (decode) also quantises x in more programs of its grid
# (`dispatch_into(quantize_x=...)`), one launch boundary less on the step's critical path
# (eighteenth session, docs/fp8.md). A switch for A/B runs; the bits are the same either way.
FUSE_X_QUANT = True
# Bins (E < bins <= 2E) from which one wide program (chunk > CHUNK) counts its slots with atomics
# instead of tl.histogram (see _count_alone). H200, 2026-11-27 (dispatch_alone_ab.py): Qwen3-Next
# (E = 512) layer T = 128 / 256 -1.2 / -1.7%. Not for 4-warp chunks (Qwen3-Next T = 8: +4.4%) nor
# the multi-program path (T = 1024: +2.1%); DeepSeek-V3 (512 bins) gained 23% on the dispatch
# alone at 4096 slots but nothing in the layer (-0.1% at T = 512, 2026-11-27), so it keeps the
# histogram.
ATOMIC_COUNT_BINS = 1024
# Warps of a one-program launch whose chunk is at most CHUNK (decode) with this many bins or more
# (E = 512: Qwen3-Next): its histogram and scan are per-bin work, spread over the program's
# threads. Timed on an H200 (2026-12-02, dispatch alone under graph replay, E = 512 K = 10 T = 8):
# 16 warps took 22.1 us against 4 warps' 10.7 with the per-bin padding fill, 11.0 against 4.7 with
# the range fill below; 8 warps with the range fill 6.40 against 4.72 (T = 64: 8.63 against 7.49;
# Qwen3-Next layer T = 8 128.3 against 126.8 us); 4 stays, the same as the other decode launches.
# An A/B switch (`scripts/debug/dispatch_alone_ab.py`, fourth field).
MANY_BINS = 1024
MANY_BINS_WARPS = 4
# A layout built by one program (T*K <= ALONE_SLOTS, or a batch of at most CHUNK valid slots)
# writes its -1 padding as one contiguous range, [0, M-blocks * BLOCK_M), before its scatter
# overwrites the real slots' positions, instead of per bin ([NUM_BINS, FILL] masked stores, most of
# them masked off at decode, and most of the program's code: 4358 against 2355 sm_90 PTX lines at
# E = 512). On since 2026-12-02: on an H200 the dispatch alone went 10.70 -> 4.70 us at E = 512
# K = 10 T = 8 and 2.99 -> 2.36 at E = 128 K = 8 T = 8; the whole Qwen3-Next layer 135.5 -> 129.2
# us at T = 8, 558.7 -> 546.8 at T = 64; Qwen3's level. False is the per-bin fill, kept as the A/B
# side (`scripts/debug/dispatch_alone_ab.py`, fifth field) and tested with every dispatch case.
RANGE_PADDING_FILL = True
# Positions a step of that range fill writes.
_RANGE_FILL_STEP: tl.constexpr = tl.constexpr(1024)
_PADDING_FILL = 16  # padding positions written per step of the scan's fill loop


@triton.jit
def _load_chunk(ids_ptr, slots, valid_slots, num_experts):
    """(expert, served, in_rows) of these slots; ids past the valid rows are not read."""
    in_rows = slots < valid_slots
    expert = tl.load(ids_ptr + slots, mask=in_rows, other=-1)
    served = in_rows & (expert >= 0) & (expert < num_experts)
    return expert, served, in_rows


@triton.jit
def _count_alone(expert, served, bins, num_experts, counts_ptr, NUM_BINS: tl.constexpr,
                 ATOMIC_COUNT: tl.constexpr):
    """Served slots per expert ([NUM_BINS], 0 past E) counted by one program. ATOMIC_COUNT: one
    relaxed atomic add per served slot into the zeroed `counts` workspace, read back and reset with
    atomic_xchg after a barrier; else tl.histogram, whose warp-ballot algorithm costs
    ~(bins / 32) * log2(bins) instructions per slot a thread holds (~30 us for 4096 slots into 1024
    bins on an H200, E = 512), whatever num_valid is."""
    if ATOMIC_COUNT:
        tl.atomic_add(counts_ptr + tl.where(served, expert, 0), 1, mask=served, sem="relaxed")
        # Every thread's adds are ordered before the reads by the barrier (one program, one L2 line
        # per counter: the exchange sees them all).
        tl.debug_barrier()
        counts = tl.atomic_xchg(counts_ptr + bins, 0, mask=bins < num_experts, sem="relaxed")
        return tl.where(bins < num_experts, counts, 0)
    else:
        return tl.histogram(tl.where(served, expert, num_experts), NUM_BINS)


@triton.jit
def _scatter(expert, served, slots, cursor_ptr, sorted_slots_ptr):
    """Give each served slot a position in its expert's range (cursor[e] advances by one each)."""
    pos = tl.atomic_add(cursor_ptr + tl.where(served, expert, 0), 1, mask=served, sem="relaxed")
    tl.store(sorted_slots_ptr + pos, slots, mask=served)


@triton.jit
def _write_layout(counts, bins, num_experts, cursor_ptr, block_end_ptr, num_blocks_ptr, sorted_slots_ptr,
                  BLOCK_M: tl.constexpr, NUM_BINS: tl.constexpr, FILL: tl.constexpr,
                  RANGE_FILL: tl.constexpr = False):
    """From per-expert counts: block ends, used M-blocks, cursor = first position, -1 padding.
    RANGE_FILL: every position of the used M-blocks gets -1, real slots' included, so the caller
    must order this before its scatter (one program: a barrier; RANGE_PADDING_FILL)."""
    counts = tl.where(bins < num_experts, counts, 0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, 0)
    start = (block_end - blocks) * BLOCK_M
    tl.store(block_end_ptr + bins, block_end, mask=bins < num_experts)
    tl.store(cursor_ptr + bins, start, mask=bins < num_experts)
    used = tl.sum(blocks, 0)
    tl.store(num_blocks_ptr, used)
    if RANGE_FILL:
        positions = used * BLOCK_M
        for p0 in range(0, positions, _RANGE_FILL_STEP):
            p = p0 + tl.arange(0, _RANGE_FILL_STEP)
            tl.store(sorted_slots_ptr + p, tl.full((_RANGE_FILL_STEP,), -1, tl.int32), mask=p < positions)
    else:
        for j0 in tl.static_range(0, BLOCK_M, FILL):
            j = j0 + tl.arange(0, FILL)
            fill = counts[:, None] + j[None, :]  # position inside the expert's range
            pad = (bins[:, None] < num_experts) & (fill < (blocks * BLOCK_M)[:, None])
            sentinel = tl.full((NUM_BINS, FILL), -1, tl.int32)
            tl.store(sorted_slots_ptr + start[:, None] + fill, sentinel, mask=pad)


@triton.jit
def _count_kernel(
    # inputs
    ids_ptr,  # [T, K] int32
    num_valid_ptr,  # 0-dim int32/int64 (if HAS_NUM_VALID_PTR)
    # workspace
    counts_ptr,  # [NUM_BINS] int32, zero on entry and on exit
    ticket_ptr,  # [1] int32, zero on entry and on exit
    cursor_ptr,  # [E] int32 out: first position of each expert (next free one with one chunk)
    block_end_ptr,  # [E] int32 out: inclusive prefix sum of M-blocks per expert
    num_blocks_ptr,  # [2] int32 out: M-blocks in use with BLOCK_M, with BLOCK_M_SMALL (one is 0)
    sorted_slots_ptr,  # [capacity] int32 out: -1 in padding positions (and the slots with one chunk)
    health_ptr,  # [8] int64 (if HAS_HEALTH)
    # QUANT_X: x [T, H] quantised into xq / x_scale by the programs past the first (act_quant)
    x_ptr,
    xq_ptr,
    x_scale_ptr,
    # shapes
    num_valid_count,
    num_tokens,
    num_experts,
    x_row_len,
    x_group_len,
    x_num_groups,
    TOP_K: tl.constexpr,
    # meta
    BLOCK_M: tl.constexpr,
    BLOCK_M_SMALL: tl.constexpr,
    SMALL_SLOTS: tl.constexpr,  # -1: no small-batch layout
    FEW_SLOTS: tl.constexpr,  # -1: no few-slot path; else its GEMMs build their own layout up to this
    CHUNK: tl.constexpr,
    ATOMIC_COUNT: tl.constexpr,  # one program counts with atomics, not tl.histogram
    NUM_BINS: tl.constexpr,
    FILL: tl.constexpr,
    HAS_NUM_VALID_PTR: tl.constexpr,
    HAS_HEALTH: tl.constexpr,
    USE_PDL: tl.constexpr,
    QUANT_X: tl.constexpr = False,  # one program builds the layout (decode), the others quantise x
    X_BLOCK_R: tl.constexpr = 1,
    X_BLOCK_C: tl.constexpr = 16,
    X_ONE_CHUNK: tl.constexpr = True,
    NATIVE_CAST: tl.constexpr = False,
    RANGE_FILL: tl.constexpr = False,  # the one-program layout's padding as one range (RANGE_PADDING_FILL)
):
    wait_for_previous_kernel(USE_PDL)
    pid = tl.program_id(0)
    if QUANT_X:
        lent = pid > 0
    else:
        lent = False
    if lent:
        # x's fp8 quantisation in this launch: a decode step saves the quantisation launch's
        # boundary (its rows below num_valid, as act_quant.quantize_rows_into).
        quantize_items(pid - 1, tl.num_programs(0) - 1, x_ptr, x_ptr, num_valid_ptr, xq_ptr, x_scale_ptr,
                       num_valid_count, num_tokens, x_row_len, x_group_len, x_num_groups, 0, 0, False,
                       HAS_NUM_VALID_PTR, X_BLOCK_R, X_BLOCK_C, X_ONE_CHUNK, NATIVE_CAST)
    else:
        num_valid = load_num_valid(num_valid_ptr, num_valid_count, num_tokens, HAS_NUM_VALID_PTR)
        valid_slots = num_valid * TOP_K
        slots = pid * CHUNK + tl.arange(0, CHUNK)
        bins = tl.arange(0, NUM_BINS)
        if valid_slots <= FEW_SLOTS:
            # The GEMMs take the few-slot path (and count its dropped ids): no layout, no M-block.
            if pid == 0:
                tl.store(num_blocks_ptr + tl.arange(0, 2), tl.zeros((2,), tl.int32))
        elif valid_slots <= CHUNK:
            # One chunk holds every valid slot (decode, or a padded batch with few valid rows: decided
            # on the device, so a graph captured for many rows replays few at decode cost). Program 0
            # does it all from its own histogram: no counter, no ticket, no scatter launch.
            if pid == 0:
                expert, served, in_rows = _load_chunk(ids_ptr, slots, valid_slots, num_experts)
                counts = _count_alone(expert, served, bins, num_experts, counts_ptr, NUM_BINS, ATOMIC_COUNT)
                if valid_slots <= SMALL_SLOTS:
                    # Few valid slots in a batch tuned for many: the small-batch tiles' layout, whose
                    # GEMM launches run while the main ones find 0 blocks (and the reverse otherwise).
                    _write_layout(counts, bins, num_experts, cursor_ptr, block_end_ptr, num_blocks_ptr + 1,
                                  sorted_slots_ptr, BLOCK_M_SMALL, NUM_BINS, FILL, RANGE_FILL)
                    tl.store(num_blocks_ptr, 0)
                else:
                    _write_layout(counts, bins, num_experts, cursor_ptr, block_end_ptr, num_blocks_ptr,
                                  sorted_slots_ptr, BLOCK_M, NUM_BINS, FILL, RANGE_FILL)
                    tl.store(num_blocks_ptr + 1, 0)
                if HAS_HEALTH:
                    tl.atomic_add(health_ptr + 1, tl.sum((in_rows & ~served).to(tl.int64)), sem="relaxed")
                # cursor (and with RANGE_FILL the -1 of every used position) was stored by other
                # threads of this program: order those stores first.
                tl.debug_barrier()
                _scatter(expert, served, slots, cursor_ptr, sorted_slots_ptr)
        else:
            if pid * CHUNK < valid_slots:
                expert, served, in_rows = _load_chunk(ids_ptr, slots, valid_slots, num_experts)
                # Slots that are not served land in bin E, which is dropped.
                hist = tl.histogram(tl.where(served, expert, num_experts), NUM_BINS)
                tl.atomic_add(counts_ptr + bins, hist, mask=(bins < num_experts) & (hist > 0), sem="relaxed")
                if HAS_HEALTH:
                    tl.atomic_add(health_ptr + 1, tl.sum((in_rows & ~served).to(tl.int64)), sem="relaxed")
            # Every thread's count atomics are ordered before the ticket by this barrier and the
            # ticket's release; the last program's acquire then sees all of them.
            tl.debug_barrier()
            ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
            if ticket == tl.num_programs(0) - 1:
                # Read-and-reset at L2 (never a stale L1 line): counters are zero again for the next call.
                counts = tl.atomic_xchg(counts_ptr + bins, 0, mask=bins < num_experts, sem="relaxed")
                _write_layout(counts, bins, num_experts, cursor_ptr, block_end_ptr, num_blocks_ptr,
                              sorted_slots_ptr, BLOCK_M, NUM_BINS, FILL)
                tl.store(num_blocks_ptr + 1, 0)
                tl.atomic_xchg(ticket_ptr, 0, sem="relaxed")


@triton.jit
def _scatter_kernel(
    ids_ptr,  # [T, K] int32
    num_valid_ptr,
    cursor_ptr,  # [E] int32: advanced by one per served slot
    sorted_slots_ptr,  # [capacity] int32 out
    num_valid_count,
    num_tokens,
    num_experts,
    TOP_K: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_NUM_VALID_PTR: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    pid = tl.program_id(0)
    num_valid = load_num_valid(num_valid_ptr, num_valid_count, num_tokens, HAS_NUM_VALID_PTR)
    valid_slots = num_valid * TOP_K
    # With one chunk of valid slots the count kernel scattered them already.
    if (valid_slots > CHUNK) & (pid * CHUNK < valid_slots):
        slots = pid * CHUNK + tl.arange(0, CHUNK)
        expert, served, _ = _load_chunk(ids_ptr, slots, valid_slots, num_experts)
        _scatter(expert, served, slots, cursor_ptr, sorted_slots_ptr)


def _check_quantize_x(quantize_x: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int],
                      ids: torch.Tensor) -> None:
    """dispatch_into's quantize_x, before any launch: x [T, H] bf16/fp16 with ids' T and device, xq
    the same shape in float8_e4m3fn, x_scale [T, ceil(H / group_len)] float32, group_len >= 1."""
    x, xq, x_scale, group_len = quantize_x
    num_tokens = ids.shape[0]
    if x.dim() != 2 or x.shape[0] != num_tokens or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"quantize_x: x must be [T={num_tokens}, H] bf16/fp16, "
                         f"got {tuple(x.shape)} {x.dtype}")
    if not isinstance(group_len, int) or group_len < 1:
        raise ValueError(f"quantize_x: group_len must be an int >= 1, got {group_len!r}")
    groups = -(-x.shape[1] // min(group_len, x.shape[1]))
    if xq.shape != x.shape or xq.dtype != torch.float8_e4m3fn:
        raise ValueError(f"quantize_x: xq must be {tuple(x.shape)} float8_e4m3fn, "
                         f"got {tuple(xq.shape)} {xq.dtype}")
    if x_scale.shape != (num_tokens, groups) or x_scale.dtype != torch.float32:
        raise ValueError(f"quantize_x: x_scale must be ({num_tokens}, {groups}) float32, "
                         f"got {tuple(x_scale.shape)} {x_scale.dtype}")
    for name, tensor in (("x", x), ("xq", xq), ("x_scale", x_scale)):
        if tensor.device != ids.device or not tensor.is_contiguous():
            raise ValueError(f"quantize_x: {name} must be contiguous on {ids.device}, got {tensor.device}")


def dispatch_into(
    ids: torch.Tensor,  # [T, K] int32
    num_experts: int,
    num_valid: NumValid,
    block_m: int,
    views: WorkspaceViews,
    health: torch.Tensor | None,
    *,
    small: tuple[int, int] | None = None,
    few_slots: int = -1,
    use_pdl: bool = False,
    quantize_x: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None,
) -> bool:
    """Build the padded expert-sorted layout for `ids` into the workspace views (no allocation).

    small: (block_m, max slots) of the small-batch tiles: when num_valid * K <= max slots (read on
    the device) the layout uses that block_m and its count goes to num_blocks[1], else num_blocks[0]
    (the other one is set to 0). few_slots (-1: none): when num_valid * K <= few_slots (read on the device)
    the GEMMs take the few-slot path (kernels/experts.py): no layout is built, both block counts
    are set to 0, and the dropped ids are the GEMMs' to count.

    quantize_x: (x, xq, x_scale, group_len) of the fp8 path. When one program builds the layout
    (T*K <= ALONE_SLOTS: decode), x's rows below num_valid are quantised by more programs of the same
    launch (act_quant.quantize_items; the same bits as act_quant.quantize_rows_into), and the
    return is True; otherwise nothing is quantised here and the return is False."""
    num_tokens, top_k = ids.shape
    slots = num_tokens * top_k
    if slots == 0:
        raise ValueError("dispatch_into needs T >= 1 (the caller returns early for T = 0)")
    if slots >= 2**31 or capacity(num_tokens, num_experts, top_k) >= 2**31:
        raise ValueError(f"T*K = {slots} slots are past int32 indexing; split the batch")
    if quantize_x is not None:
        _check_quantize_x(quantize_x, ids)
    grid = 1 if slots <= ALONE_SLOTS else cdiv(slots, CHUNK)
    # A single program takes just the (power-of-two) slots there are: less to histogram at decode.
    chunk = max(16, next_power_of_2(slots)) if grid == 1 else CHUNK
    wide = chunk > CHUNK  # one program past one chunk: more warps, atomic counts with many bins
    bins = num_bins(num_experts)
    has_nv_ptr = num_valid.tensor is not None
    nv_ptr = num_valid.tensor if has_nv_ptr else ids
    nv_count = num_valid.count if num_valid.count is not None else num_tokens
    num_warps = ALONE_WARPS if wide else (MANY_BINS_WARPS if bins >= MANY_BINS else 4)
    # x's quantisation in this launch's other programs (placeholders without it: never read)
    lent: dict[str, object] = {"x_ptr": ids, "xq_ptr": ids, "x_scale_ptr": ids, "x_row_len": 0,
                               "x_group_len": 0, "x_num_groups": 0}
    quant_programs = 0
    if quantize_x is not None and grid == 1 and FUSE_X_QUANT:
        x, xq, x_scale, group_len = quantize_x
        quant_programs, block_r, block_c, one_chunk = lent_rows_tiles(x, x_scale, group_len, num_warps)
        lent = {"x_ptr": x, "xq_ptr": xq, "x_scale_ptr": x_scale, "x_row_len": x.shape[1],
                "x_group_len": min(group_len, x.shape[1]), "x_num_groups": x_scale.shape[1], "QUANT_X": True,
                "X_BLOCK_R": block_r, "X_BLOCK_C": block_c, "X_ONE_CHUNK": one_chunk,
                "NATIVE_CAST": not interpreter_enabled()}
    # grid: one program per CHUNK slots of [T * K] (and the programs that quantise x)
    _count_kernel[(grid + quant_programs,)](
        ids, nv_ptr,
        views.counts, views.ticket, views.cursor, views.block_end, views.num_blocks, views.sorted_slots,
        health if health is not None else ids,
        num_valid_count=nv_count, num_tokens=num_tokens, num_experts=num_experts, TOP_K=top_k,
        BLOCK_M=block_m, BLOCK_M_SMALL=small[0] if small else block_m,
        SMALL_SLOTS=min(small[1], chunk, CHUNK) if small else -1, FEW_SLOTS=few_slots, CHUNK=chunk,
        NUM_BINS=bins, ATOMIC_COUNT=wide and bins >= ATOMIC_COUNT_BINS,
        FILL=min(block_m, small[0] if small else block_m, _PADDING_FILL),
        HAS_NUM_VALID_PTR=has_nv_ptr, HAS_HEALTH=health is not None, USE_PDL=use_pdl, **lent,
        RANGE_FILL=RANGE_PADDING_FILL,
        num_warps=num_warps, **launch_options(use_pdl),
    )
    if grid > 1:
        _scatter_kernel[(grid,)](
            ids, nv_ptr, views.cursor, views.sorted_slots,
            nv_count, num_tokens, num_experts, top_k,
            CHUNK=CHUNK, HAS_NUM_VALID_PTR=has_nv_ptr, USE_PDL=use_pdl,
            num_warps=4, **launch_options(use_pdl),
        )
    return quant_programs > 0


@dataclass
class DispatchResult:
    """The dispatch layout copied out of a workspace (for tests and inspection; host syncs)."""

    block_m: int
    num_blocks: int
    block_end: torch.Tensor  # [E] int64
    sorted_slots: torch.Tensor  # [num_blocks * block_m] int64, -1 in padding

    def expert_slots(self, expert: int) -> torch.Tensor:
        """Served slots of `expert`, sorted (the kernel's order inside an expert is unspecified)."""
        start = 0 if expert == 0 else int(self.block_end[expert - 1]) * self.block_m
        end = int(self.block_end[expert]) * self.block_m
        part = self.sorted_slots[start:end]
        return torch.sort(part[part >= 0]).values


def dispatch_triton(
    ids: torch.Tensor,
    num_experts: int,
    num_valid: NumValid,
    block_m: int,
    *,
    health: torch.Tensor | None = None,
    views: WorkspaceViews | None = None,
) -> DispatchResult:
    """Run dispatch alone and return its layout (allocates a workspace unless `views` is given)."""
    from safemoe.workspace import Workspace

    num_tokens, top_k = ids.shape
    if views is None:
        ws = Workspace(max(num_tokens, 1), num_experts, top_k, 16, 16, torch.float32, ids.device)
        views = ws.views(num_tokens, num_experts, top_k, 16, 16)
    dispatch_into(ids, num_experts, num_valid, block_m, views, health)
    used = int(views.num_blocks[0].item())
    return DispatchResult(
        block_m=block_m,
        num_blocks=used,
        block_end=views.block_end.to(torch.int64).cpu(),
        sorted_slots=views.sorted_slots[: used * block_m].to(torch.int64).cpu(),
    )
