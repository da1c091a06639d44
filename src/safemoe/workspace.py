"""One scratch workspace for the expert kernels, allocated once and shared by every layer.

Every buffer the dispatch, GEMM and combine kernels need between launches lives here, sized from
(max_tokens, E, K, H, I, dtype) for the largest BLOCK_M any configuration may use
(`configs.MAX_BLOCK_M`), so the kernels never allocate (CUDA-graph safe) and one workspace serves
every layer whose dims are the same or smaller. Nothing in it needs clearing between calls: the
dispatch kernel leaves its counters at zero when it finishes (they start at zero because the
workspace is allocated zeroed), and every other buffer is written before it is read in a call.
Calls that share a workspace must run one after another (one stream).

Sizes, with S = max_tokens * K slots and BM = MAX_BLOCK_M:
- capacity = S + min(E, S) * (BM - 1): expert-sorted positions with each expert padded to a
  multiple of BLOCK_M (each used expert wastes at most BLOCK_M - 1 positions).
- sorted_slots [capacity] int32, intermediate [capacity, I] (x's dtype), y [S, H] (x's dtype).
- counts, cursor, block_end [E] int32 (counts padded to a power of two for the histogram), ticket
  (int32), num_blocks [2] int32 (M-blocks of the layout for the batch's tiles, and of the layout
  for the small-batch tiles; the one not used in a call is 0), few_sync [SYNC_ELEMS] int32 (the
  counters of the fused few-slot launch: tiles claimed, programs done, each expert's finished
  GEMM1 tiles; zero between calls like counts and ticket).
- With `fp8=True` (fp8 expert weights), also the quantised activations: x_fp8 [max_tokens, H]
  and inter_fp8 [capacity, I] float8_e4m3fn, and their fp32 scales, sized for 1x128 groups
  (x_scale [max_tokens, ceil(H/128)], inter_scale [capacity, ceil(I/128)]; per-token scales use
  the first column's worth).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from safemoe.configs import MAX_BLOCK_M
from safemoe.numerics import FP8_BLOCK, FP8_DTYPE

_INDEX_DTYPE = torch.int32
# few_sync: tile claim counter, exit counter, and a readiness counter per leader of the fused
# few-slot launch (at most 64: kernels/experts.py PACKED_FUSED_SLOTS), with room to spare.
SYNC_ELEMS = 128


def num_bins(num_experts: int) -> int:
    """Histogram bins: a power of two above E, so bin E collects the slots that are not served."""
    return 1 << num_experts.bit_length()


def capacity(num_tokens: int, num_experts: int, top_k: int, block_m: int = MAX_BLOCK_M) -> int:
    """Expert-sorted positions needed for T tokens when experts are padded to `block_m` rows."""
    slots = num_tokens * top_k
    return slots + min(num_experts, slots) * (block_m - 1)


def max_m_blocks(num_tokens: int, num_experts: int, top_k: int, block_m: int) -> int:
    """Upper bound of the M-blocks dispatch can produce: sum_e ceil(c_e / BM) <= ceil(S / BM) + min(E, S)."""
    slots = num_tokens * top_k
    return -(-slots // block_m) + min(num_experts, slots)


def _meta_elems(num_experts: int) -> int:
    # counts (num_bins) | ticket | num_blocks (2) | cursor (E) | block_end (E) | few_sync
    return num_bins(num_experts) + 3 + 2 * num_experts + SYNC_ELEMS


def _fp8_elems(max_tokens: int, cap: int, hidden: int, inter: int) -> tuple[int, int]:
    """(fp8 elements, fp32 scales) of the quantised x and intermediate."""
    groups_h, groups_i = -(-hidden // FP8_BLOCK), -(-inter // FP8_BLOCK)
    return max_tokens * hidden + cap * inter, max_tokens * groups_h + cap * groups_i


# Every segment of the one byte buffer starts on this boundary (vector loads, any element size).
_SEGMENT_ALIGN = 256


def _segments(max_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
              dtype: torch.dtype, fp8: bool) -> tuple[list[tuple[int, int, torch.dtype]], int]:
    """[(byte offset, elements, dtype)] of index | data | fp8 | fp8 scales, and the total bytes."""
    cap = capacity(max_tokens, num_experts, top_k)
    parts = [(_meta_elems(num_experts) + cap, _INDEX_DTYPE),
             (cap * inter + max_tokens * top_k * hidden, dtype)]
    if fp8:
        fp8_elems, scales = _fp8_elems(max_tokens, cap, hidden, inter)
        parts += [(fp8_elems, FP8_DTYPE), (scales, torch.float32)]
    segments, offset = [], 0
    for elems, part_dtype in parts:
        segments.append((offset, elems, part_dtype))
        nbytes = elems * part_dtype.itemsize
        offset += -(-nbytes // _SEGMENT_ALIGN) * _SEGMENT_ALIGN
    return segments, offset


def workspace_bytes(max_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
                    dtype: torch.dtype, *, fp8: bool = False) -> int:
    """Bytes a `Workspace` of these dims allocates (computed without allocating)."""
    return _segments(max_tokens, num_experts, top_k, hidden, inter, dtype, fp8)[1]


_MAX_CACHED_VIEWS = 64


@dataclass(frozen=True)
class WorkspaceViews:
    """The buffers one call uses, as views sized for that call (no allocation). Frozen: a
    workspace hands the same object to every call of the same dims (`Workspace.views`)."""

    counts: torch.Tensor  # [num_bins] int32, zero between calls
    ticket: torch.Tensor  # [1] int32, zero between calls
    num_blocks: torch.Tensor  # [2] int32: M-blocks in use for the main tiles, for the small-batch tiles
    cursor: torch.Tensor  # [E] int32: next free position of each expert while scattering
    block_end: torch.Tensor  # [E] int32: inclusive prefix sum of each expert's M-blocks
    few_sync: torch.Tensor  # [SYNC_ELEMS] int32, zero between calls: the fused few-slot launch's counters
    sorted_slots: torch.Tensor  # [capacity] int32: slot s = t*K + k, or -1 in padding positions
    intermediate: torch.Tensor  # [capacity, I] act(gate) * up, by sorted position
    y: torch.Tensor  # [T*K, H] weighted expert outputs, by slot


@dataclass
class Fp8Views:
    """The quantised activations of one fp8 call (views, no allocation)."""

    x: torch.Tensor  # [T, H] float8_e4m3fn: rows < num_valid written
    x_scale: torch.Tensor  # [T, groups of H] float32
    inter: torch.Tensor  # [capacity, I] float8_e4m3fn: positions holding a slot written
    inter_scale: torch.Tensor  # [capacity, groups of I] float32


class Workspace:
    """Scratch buffers for `experts(...)` calls with up to `max_tokens` tokens.

    `Workspace(max_tokens, num_experts, top_k, hidden, inter, dtype, device)`; `.nbytes` is what
    it holds. Pass it as `workspace=` to `safemoe.experts` (or the layer runtime) for every layer
    with the same dtype and device and E, K, H, I no larger than these.
    """

    def __init__(self, max_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
                 dtype: torch.dtype, device: torch.device | str, *, fp8: bool = False) -> None:
        for name, value in (("max_tokens", max_tokens), ("num_experts", num_experts), ("top_k", top_k),
                            ("hidden", hidden), ("inter", inter)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Workspace {name} must be a positive int, got {value!r}")
        # top_k > num_experts is legal: experts() serves duplicate ids, and capacity() bounds the
        # padded layout with min(E, S) whatever K is.
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"Workspace dtype must be bfloat16, float16 or float32, got {dtype}")
        cap = capacity(max_tokens, num_experts, top_k)
        if cap >= 2**31:
            raise ValueError(
                f"Workspace for max_tokens={max_tokens}, top_k={top_k} needs {cap} sorted positions, "
                "past int32 indexing; split the batch"
            )
        self.max_tokens = max_tokens
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden = hidden
        self.inter = inter
        self.dtype = dtype
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.capacity = cap
        self.fp8 = bool(fp8)
        # One byte buffer, because one tensor is what the registered op carries (`op_args`). Only
        # the index segment is zeroed: its counters must start at zero (the dispatch kernel leaves
        # them so). The data segment (intermediate, y) is left uninitialised: every call writes the
        # positions it reads, which `check`'s buffers family proves by poisoning it with NaN/Inf.
        # Zeroing it cost a workspace-less moe() of T = 1024 a ~70 MB memset per call (Qwen3).
        segments, nbytes = _segments(max_tokens, num_experts, top_k, hidden, inter, dtype, self.fp8)
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        data_start, data_elems, data_dtype = segments[1]
        data_end = data_start + data_elems * data_dtype.itemsize
        buffer[:data_start].zero_()
        if self.fp8:
            buffer[data_end:].zero_()  # the fp8 segments: zeroed as before
        self._bind(buffer)

    def _bind(self, buffer: torch.Tensor) -> None:
        """Carve the typed buffers out of `buffer` (views, no allocation)."""
        self.buffer = buffer
        segments, _ = _segments(self.max_tokens, self.num_experts, self.top_k, self.hidden, self.inter,
                                self.dtype, self.fp8)
        typed = [buffer[off : off + elems * dt.itemsize].view(dt)
                 for off, elems, dt in segments]
        self._index, self._data = typed[0], typed[1]
        self._fp8: torch.Tensor | None = typed[2] if self.fp8 else None
        self._fp8_scales: torch.Tensor | None = typed[3] if self.fp8 else None
        # views() by call dims: nine tensor slices a call were ~10% of an eager decode step's host
        # time (cProfile, H100 host, 2026-11-27); one entry per distinct (T, E, K, H, I), at most
        # _MAX_CACHED_VIEWS (an eager server sees every T; a graph engine its few buckets)
        self._views: dict[tuple[int, int, int, int, int], WorkspaceViews] = {}

    # -- the op boundary: one tensor and the dims that lay it out --------------------------------
    def op_args(self) -> tuple[torch.Tensor, list[int]]:
        """(buffer, dims) for the registered `safemoe::experts` op; `Workspace.over` undoes it."""
        dims = [self.max_tokens, self.num_experts, self.top_k, self.hidden, self.inter, int(self.fp8)]
        return self.buffer, dims

    @classmethod
    def over(cls, buffer: torch.Tensor, dims: list[int], dtype: torch.dtype) -> Workspace:
        """The workspace laid out over an existing `buffer` (from `op_args`), without allocating."""
        ws = cls.__new__(cls)
        max_tokens, num_experts, top_k, hidden, inter, fp8 = dims
        ws.max_tokens, ws.num_experts, ws.top_k = max_tokens, num_experts, top_k
        ws.hidden, ws.inter = hidden, inter
        ws.dtype, ws.device, ws.fp8 = dtype, buffer.device, bool(fp8)
        ws.capacity = capacity(max_tokens, num_experts, top_k)
        ws._bind(buffer)
        return ws

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def __repr__(self) -> str:
        return (
            f"Workspace(max_tokens={self.max_tokens}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"hidden={self.hidden}, inter={self.inter}, dtype={self.dtype}, device={self.device}, "
            f"{'fp8=True, ' if self.fp8 else ''}nbytes={self.nbytes})"
        )

    def check(self, num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
              dtype: torch.dtype, device: torch.device, *, fp8: bool = False) -> None:
        """Raise ValueError/TypeError when this workspace cannot serve a call with these dims
        (fp8: a call with fp8 expert weights, which needs the fp8 buffers)."""
        if fp8 and not self.fp8:
            raise ValueError(
                "fp8 expert weights need a workspace with fp8 buffers: Workspace(..., fp8=True); "
                f"got {self!r}"
            )
        if dtype != self.dtype:
            raise TypeError(f"workspace has dtype {self.dtype} but x has {dtype}")
        if device != self.device:
            raise ValueError(f"workspace is on {self.device} but x is on {device}")
        for name, need, have in (("T", num_tokens, self.max_tokens), ("E", num_experts, self.num_experts),
                                 ("H", hidden, self.hidden), ("I", inter, self.inter)):
            if need > have:
                raise ValueError(f"workspace was sized for {name} <= {have}, got {name}={need}; {self!r}")
        too_many_slots = num_tokens * top_k > self.max_tokens * self.top_k
        if too_many_slots or capacity(num_tokens, num_experts, top_k) > self.capacity:
            raise ValueError(
                f"workspace was sized for {self.max_tokens} tokens x top_k {self.top_k}, got T={num_tokens} "
                f"x K={top_k}; {self!r}"
            )

    def views(self, num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int) -> WorkspaceViews:
        """Views for one call (dims already checked with `check`)."""
        key = (num_tokens, num_experts, top_k, hidden, inter)
        cached = self._views.get(key)
        if cached is None:
            if len(self._views) >= _MAX_CACHED_VIEWS:
                self._views.clear()
            cached = self._views[key] = self._carve(num_tokens, num_experts, top_k, hidden, inter)
        return cached

    def _carve(self, num_tokens: int, num_experts: int, top_k: int, hidden: int,
               inter: int) -> WorkspaceViews:
        bins = num_bins(self.num_experts)  # the histogram of a smaller E still fits in these bins
        e = num_experts
        idx = self._index
        sync = bins + 3 + 2 * self.num_experts
        meta = sync + SYNC_ELEMS
        cap = capacity(num_tokens, num_experts, top_k)
        slots = num_tokens * top_k
        return WorkspaceViews(
            counts=idx[:bins],
            ticket=idx[bins : bins + 1],
            num_blocks=idx[bins + 1 : bins + 3],
            cursor=idx[bins + 3 : bins + 3 + e],
            block_end=idx[bins + 3 + self.num_experts : bins + 3 + self.num_experts + e],
            few_sync=idx[sync:meta],
            sorted_slots=idx[meta : meta + cap],
            intermediate=self._data[: cap * inter].view(cap, inter),
            y=self._data[cap * inter : cap * inter + slots * hidden].view(slots, hidden),
        )

    def fp8_views(self, num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
                  group: int | None) -> Fp8Views:
        """Views of the quantised activations for one call (dims already checked with
        `check(..., fp8=True)`); group: 128 for 1x128 groups, None for one group per row."""
        assert self._fp8 is not None and self._fp8_scales is not None, "workspace has no fp8 buffers"
        cap = capacity(num_tokens, num_experts, top_k)
        groups_h = 1 if group is None else -(-hidden // group)
        groups_i = 1 if group is None else -(-inter // group)
        x_elems, x_scales = num_tokens * hidden, num_tokens * groups_h
        return Fp8Views(
            x=self._fp8[:x_elems].view(num_tokens, hidden),
            x_scale=self._fp8_scales[:x_scales].view(num_tokens, groups_h),
            inter=self._fp8[x_elems : x_elems + cap * inter].view(cap, inter),
            inter_scale=self._fp8_scales[x_scales : x_scales + cap * groups_i].view(cap, groups_i),
        )
