"""Expert parallelism: each rank owns a contiguous block of E / W experts; token rows travel to the
ranks owning their experts with all-to-all and come back combined.

One call on rank r of W ranks (E experts, E_local = E / W; rank r owns global ids
[r * E_local, (r + 1) * E_local)), x [T, H] with `num_valid` real rows:

1. Plan (source side). A slot (t, k) is served when t < num_valid and 0 <= ids[t, k] < E; every
   other id (-1, negative, >= E, a stale 123456789 from a torch.empty buffer) is dropped, counted
   in health[DROPPED_SLOTS], and never used as an index or sent. A row goes ONCE to each peer p
   owning at least one of its served experts (need[t, p]), carrying its K GLOBAL ids with the
   slots of other peers set to -1 (weight 0). A peer's rows are sent in increasing t. Padded rows
   (t >= num_valid) have no served slot, so they are never sent and never read.
2. Exchange: one all_to_all_single of the packed rows: x's bytes, then K int32 ids and K float32
   weights (one collective instead of three; the wire is raw bytes, so any dtype travels).
3. Receive: global -> LOCAL ids, bounds-checked again: an id outside this rank's block becomes -1
   (other peers' slots are -1 on the wire already; anything else is a stray, counted in
   DROPPED_SLOTS). `safemoe.experts` runs on the received rows with local ids and its own row
   count, and sums each row's local experts with their weights.
4. Return: one all_to_all_single of the [rows, H] partial outputs back to their sources.
5. Combine: out[t] = sum over peers p = 0, 1, ..., W-1 (in that order, in fp32) of p's partial
   for t, rounded once to x's dtype: the result does not depend on timing. Rows never sent are
   exact zeros. (Each partial was rounded to x's dtype by the expert kernel; in bf16 a row served
   by several ranks carries one extra rounding against the single-GPU layer.)

Modes:
- "dynamic": exact split sizes. The per-peer row counts are exchanged first (all_to_all_single of
  W int64) and read on the host: ONE host sync per call, to size the buffers. Ranks may hold
  different T. Not CUDA-graph capturable.
- "capacity": every peer slot of the wire holds a fixed C rows (unused rows zero-filled and
  carrying ids -1), so the shapes depend only on (W, C, H, K): no host sync, capturable in a CUDA
  graph, replayable with any device `num_valid`. Every rank must use the same C (with the default
  C = T: the same T, i.e. the common bucket of `safemoe.distributed.bucket`). Overflow policy: a
  peer takes a rank's rows in increasing t; rows past its C are not sent, so their slots on that
  peer lose that expert's contribution (its weight is dropped, the other weights are not
  renormalised), the rest of the row (other peers' experts) is intact, and each lost slot adds 1
  to health[EP_OVERFLOW_SLOTS]. Nothing is ever written out of bounds: C >= T never overflows,
  because a row goes at most once to a peer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from safemoe import _checks, ops
from safemoe._checks import NumValid
from safemoe._triton import require_triton
from safemoe.health import DROPPED_SLOTS, EP_OVERFLOW_SLOTS, Health, check_health
from safemoe.layer import MoE
from safemoe.route_config import RouteConfig
from safemoe.routing import Routing
from safemoe.workspace import Workspace

MODES = ("dynamic", "capacity")
EXCHANGES = ("auto", "triton", "torch")

# Wire row: x's H elements as bytes, padded to 4 bytes, then K int32 ids and K float32 weights.
_META_BYTES_PER_SLOT = 8
_META_ALIGN = 4


@dataclass(frozen=True)
class EPLayout:
    """Expert ownership: rank `rank` of `world_size` owns the global expert ids
    [first_expert, first_expert + experts_per_rank), contiguous blocks of E / world_size."""

    world_size: int
    rank: int
    num_experts: int

    def __post_init__(self) -> None:
        for name in ("world_size", "rank", "num_experts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"EPLayout {name} must be an int, got {type(value).__name__}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"EPLayout needs 0 <= rank < world_size, got {self.rank=} {self.world_size=}")
        if self.num_experts < self.world_size or self.num_experts % self.world_size != 0:
            raise ValueError(
                f"num_experts={self.num_experts} must be a positive multiple of the world size "
                f"{self.world_size} (each rank owns E / world experts)"
            )

    @classmethod
    def of_group(cls, num_experts: int, group: Any = None) -> EPLayout:
        """The layout of this process in `group` (None: the default group)."""
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "expert parallelism needs torch.distributed: call "
                "torch.distributed.init_process_group(backend, timeout=...) first "
                "(or use safemoe.distributed.spawn)"
            )
        return cls(dist.get_world_size(group), dist.get_rank(group), num_experts)

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size

    @property
    def first_expert(self) -> int:
        return self.rank * self.experts_per_rank

    def owner(self, ids: torch.Tensor, served: torch.Tensor) -> torch.Tensor:
        """[T, K] int32: the rank owning each served global id, -1 elsewhere (never divides an
        unserved id into something that looks like a rank)."""
        return torch.where(served, torch.div(ids, self.experts_per_rank, rounding_mode="floor"), -1)

    def to_local(self, global_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(local ids int32, ok bool): local = global - first_expert where the global id is in this
        rank's block, -1 everywhere else. The range test runs on the global id itself, so no
        subtraction can wrap a garbage id into range."""
        ok = (global_ids >= self.first_expert) & (global_ids < self.first_expert + self.experts_per_rank)
        local = torch.where(ok, global_ids - self.first_expert, -1).to(torch.int32)
        return local, ok


@dataclass
class _Plan:
    """Where a rank's rows go. T rows, K slots, W peers."""

    served: torch.Tensor  # [T, K] bool: row valid and id in [0, E)
    hit: torch.Tensor  # [T, K, W] bool: slot (t, k) is served by peer p
    need: torch.Tensor  # [T, W] bool: row t has at least one served slot on peer p
    pos: torch.Tensor  # [T, W] int64: rank of row t among the rows that need peer p (from 0)
    owner: torch.Tensor  # [T, K] int32: the peer owning the slot, -1 when not served


def _plan(ids: torch.Tensor, rows_valid: torch.Tensor, layout: EPLayout) -> _Plan:
    in_range = (ids >= 0) & (ids < layout.num_experts)
    served = rows_valid[:, None] & in_range  # [T, K]
    owner = layout.owner(ids, served)  # [T, K] int32
    peers = torch.arange(layout.world_size, device=ids.device, dtype=owner.dtype)
    hit = owner[:, :, None] == peers  # [T, K, W]; -1 matches no peer
    need = hit.any(dim=1)  # [T, W]
    pos = torch.cumsum(need, dim=0, dtype=torch.int64) - 1  # [T, W]
    return _Plan(served=served, hit=hit, need=need, pos=pos, owner=owner)


def _place(
    plan: _Plan, capacity: int | None, send_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row_of [T, W] int64, send_token [S] int64, send_peer [S] int64, overflow 0-dim int64).

    row_of[t, p]: the wire row of (t, p), `send_rows` (a trash row past the end) where t is not
    placed on p. send_token[j]: the row in wire row j, -1 for a blank row. capacity None: dynamic
    mode (peer p's rows start after those of peers < p); an int C: capacity mode (peer p owns wire
    rows [p * C, (p + 1) * C), rows with pos >= C are not placed: overflow counts their slots)."""
    num_tokens, world = plan.need.shape
    device = plan.need.device
    peers = torch.arange(world, device=device)
    if capacity is None:
        send_counts = plan.need.sum(dim=0)
        placed = plan.need
        base = torch.cumsum(send_counts, 0) - send_counts  # [W] first wire row of each peer
        send_peer = torch.repeat_interleave(peers, send_counts, output_size=send_rows)
    else:
        placed = plan.need & (plan.pos < capacity)  # [T, W]
        base = peers * capacity
        send_peer = torch.arange(send_rows, device=device) // capacity
    overflow = (plan.hit & ~placed[:, None, :]).sum()
    row_of = torch.where(placed, base[None, :] + plan.pos, send_rows)  # [T, W] int64
    token_of = torch.arange(num_tokens, device=device)[:, None].expand(num_tokens, world)
    send_token = torch.full((send_rows + 1,), -1, dtype=torch.int64, device=device)
    send_token.scatter_(0, row_of.reshape(-1), token_of.reshape(-1))  # the trash row may take many
    return row_of, send_token[:send_rows], send_peer, overflow


def rows_per_peer(ids: torch.Tensor, rows_valid: torch.Tensor, layout: EPLayout) -> torch.Tensor:
    """[W] int64: how many rows this rank's dynamic-mode dispatch sends to each peer (itself
    included). A row goes once to every peer that serves at least one of its slots; `rows_valid`
    [T] bool marks the rows dispatched at all, and ids outside [0, E) are served by no peer."""
    return _plan(ids, rows_valid, layout).need.sum(dim=0)


def _wire_layout(hidden: int, top_k: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(x bytes, meta offset, row bytes) of one wire row."""
    x_bytes = hidden * torch.empty((), dtype=dtype).element_size()
    meta_offset = -(-x_bytes // _META_ALIGN) * _META_ALIGN
    return x_bytes, meta_offset, meta_offset + _META_BYTES_PER_SLOT * top_k


def wire_row_bytes(hidden: int, top_k: int, dtype: torch.dtype) -> int:
    """Bytes of one dispatched row on the wire (x, then K ids and K weights)."""
    return _wire_layout(hidden, top_k, dtype)[2]


def _pack(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    owner: torch.Tensor,
    send_token: torch.Tensor,
    send_peer: torch.Tensor,
) -> torch.Tensor:
    """uint8 [S, row bytes]: wire row j holds token send_token[j] (-1: unused, all zeros and ids
    -1) for peer send_peer[j], with only that peer's slots kept."""
    num_tokens, hidden = x.shape
    top_k = ids.shape[1]
    x_bytes, meta_offset, row_bytes = _wire_layout(hidden, top_k, x.dtype)
    rows = send_token.shape[0]
    wire = torch.empty(rows, row_bytes, dtype=torch.uint8, device=x.device)
    used = send_token >= 0  # [S]
    if num_tokens == 0:  # nothing to gather from; every row is unused
        wire.zero_()
        wire[:, meta_offset:].view(torch.int32)[:, :top_k] = -1
        return wire
    token = send_token.clamp(min=0)  # [S]: -1 never becomes an index
    xs = x.index_select(0, token)  # unused rows read row 0, maybe padding (NaN): overwritten next
    xs.masked_fill_(~used[:, None], 0)
    wire[:, :x_bytes].view(x.dtype).copy_(xs)
    if meta_offset > x_bytes:
        wire[:, x_bytes:meta_offset].zero_()
    mine = (owner.index_select(0, token) == send_peer[:, None]) & used[:, None]  # [S, K]
    meta = wire[:, meta_offset:].view(torch.int32)  # [S, 2K]
    meta[:, :top_k] = torch.where(mine, ids.index_select(0, token), -1)
    meta[:, top_k:] = torch.where(mine, weights.index_select(0, token), 0.0).view(torch.int32)
    return wire


def _unpack(
    wire: torch.Tensor, hidden: int, top_k: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [S, H] contiguous, global ids [S, K] int32, weights [S, K] float32) of received rows."""
    x_bytes, meta_offset, _ = _wire_layout(hidden, top_k, dtype)
    x = wire[:, :x_bytes].view(dtype).contiguous()
    meta = wire[:, meta_offset:].view(torch.int32)
    ids = meta[:, :top_k].contiguous()
    weights = meta[:, top_k:].contiguous().view(torch.float32)
    return x, ids, weights


def capacity_rows(capacity: int | float | None, num_tokens: int) -> int:
    """Per-peer rows C: None -> T (never overflows); an int -> itself; a float f -> ceil(f * T).
    At least 1 (a zero-row collective is legal but useless)."""
    if capacity is None:
        return max(1, num_tokens)
    if isinstance(capacity, bool):
        raise TypeError("capacity must be None, an int or a float, got bool")
    if isinstance(capacity, int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 rows per peer, got {capacity}")
        return capacity
    if isinstance(capacity, float):
        if not (math.isfinite(capacity) and capacity > 0):
            raise ValueError(f"capacity as a factor of T must be finite and > 0, got {capacity}")
        return max(1, math.ceil(capacity * num_tokens))
    raise TypeError(f"capacity must be None, an int or a float, got {type(capacity).__name__}")


def check_mode(mode: object, capacity: object) -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "dynamic" and capacity is not None:
        raise ValueError(f"capacity={capacity!r} is only used with mode='capacity'")
    if mode == "capacity":
        capacity_rows(capacity, 1)  # type: ignore[arg-type]  # checks the type and range
    return str(mode)


def check_exchange(exchange: object) -> str:
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    return str(exchange)


def resolve_exchange(exchange: str, device: torch.device) -> str:
    """'auto' is the Triton exchange on CUDA and the torch one elsewhere (the interpreter is slow)."""
    return _checks.resolve_auto(exchange, device, "torch")


def _all_to_all(
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: list[int] | None,
    in_splits: list[int] | None,
    group: Any,
) -> None:
    dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)


def ep_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    routing: Routing,
    *,
    num_experts: int,
    group: Any = None,
    mode: str = "dynamic",
    capacity: int | float | None = None,
    activation: str = "silu",
    num_valid: int | torch.Tensor | None = None,
    backend: str = "auto",
    health: torch.Tensor | None = None,
    workspace: Workspace | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    exchange: str = "auto",
) -> torch.Tensor:
    """Expert-parallel `safemoe.experts`: this rank's x [T, H] and routing (GLOBAL ids in [0, E)),
    this rank's experts w13 [E/W, 2I, H] and w2 [E/W, H, I]; returns [T, H] in x's dtype.

    Every rank of `group` must call it together (same mode; in "capacity" mode the same C).
    num_valid: rows at or past it are padding: never read, never sent, output exact zeros.
    capacity ("capacity" mode): rows per peer, None -> T, an int, or a float factor of T.
    health: DROPPED_SLOTS (ids outside [0, E) in valid rows, stray ids received) and, in
        "capacity" mode, EP_OVERFLOW_SLOTS (slots not sent for lack of capacity).
    workspace: passed to the local expert call, which sees W * C rows in "capacity" mode and the
        received row count in "dynamic" mode.
    w13_scale, w2_scale: fp8 (float8_e4m3fn) local experts' scales, as in `safemoe.experts`.
    exchange: how plan/pack/unpack/combine run: "triton" (`safemoe.kernels.ep_exchange`, four
        launches), "torch" (torch ops, the reference), "auto" (triton on CUDA, torch elsewhere).
        Both give the same rows in the same places and the same output bits.
    """
    num_tokens, experts_here, _, _, fp8 = _checks.check_expert_weights(
        x, w13, w2, activation, w13_scale, w2_scale
    )
    if workspace is not None and not isinstance(workspace, Workspace):
        raise TypeError(f"workspace must be a safemoe.Workspace or None, got {type(workspace).__name__}")
    backend = _checks.resolve_backend(_checks.check_backend(backend), x.device)
    if not isinstance(routing, Routing):
        raise TypeError(f"routing must be a safemoe.Routing, got {type(routing).__name__}")
    _checks.check_routing_tensors(routing.ids, routing.weights, num_tokens, x.device)
    mode = check_mode(mode, capacity)
    exchange = check_exchange(exchange)
    nv = _checks.check_num_valid(num_valid, num_tokens, x.device)
    check_health(health, x.device)
    layout = EPLayout.of_group(num_experts, group)
    if experts_here != layout.experts_per_rank:
        raise ValueError(
            f"w13 holds {experts_here} experts, but E={num_experts} over {layout.world_size} ranks "
            f"gives {layout.experts_per_rank} per rank"
        )
    exchange = resolve_exchange(exchange, device=x.device)
    if exchange == "triton":
        require_triton(x.device, "ep_experts(exchange='triton')")

    def all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None,
                   in_splits: list[int] | None) -> None:  # fmt: skip
        _all_to_all(out, inp, out_splits, in_splits, group)

    def experts_of_rank(x_recv: torch.Tensor, weights: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        return ops.experts(
            x_recv, w13, w2, weights, local_ids, activation=activation,
            num_valid=NumValid(count=x_recv.shape[0], tensor=None), backend=backend, health=None,
            workspace=workspace, fp8=fp8,
        )  # fmt: skip

    run = _exchange_triton if exchange == "triton" and num_tokens > 0 else _exchange_torch
    return run(x, routing, layout, mode, capacity, nv, health, all_to_all, experts_of_rank)


# all_to_all(out, inp, out_splits, in_splits): the group's all_to_all_single.
AllToAll = Callable[[torch.Tensor, torch.Tensor, "list[int] | None", "list[int] | None"], None]
# local_experts(x [S, H], weights [S, K] float32, local ids [S, K] int32) -> [S, H]: this rank's experts.
LocalExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def run_exchange(
    exchange: str,
    x: torch.Tensor,
    routing: Routing,
    layout: EPLayout,
    mode: str,
    capacity: int | float | None,
    num_valid: NumValid,
    health: torch.Tensor | None,
    all_to_all: AllToAll,
    local_experts: LocalExperts,
) -> torch.Tensor:
    """`ep_experts`' exchange ("torch" or "triton") with the collective and this rank's experts
    given as functions and no argument checks: for the one-GPU exchange bench (a loopback
    collective) and tests. Layers call `ep_experts`."""
    run = {"torch": _exchange_torch, "triton": _exchange_triton}[exchange]
    return run(x, routing, layout, mode, capacity, num_valid, health, all_to_all, local_experts)


def _exchange_torch(
    x: torch.Tensor,
    routing: Routing,
    layout: EPLayout,
    mode: str,
    capacity: int | float | None,
    nv: NumValid,
    health: torch.Tensor | None,
    all_to_all: AllToAll,
    local_experts: LocalExperts,
) -> torch.Tensor:
    """The exchange in torch ops: the reference the Triton exchange is tested against. The
    collective and the local experts come in as functions (the bench swaps both to time the
    exchange's own work on one GPU)."""
    num_tokens, hidden = x.shape
    num_experts = layout.num_experts
    world, top_k = layout.world_size, routing.ids.shape[1]
    device = x.device

    # 1. Plan: served slots, their owners, one row per (token, peer).
    rows_valid = nv.row_mask(num_tokens, device)  # [T] bool
    plan = _plan(routing.ids, rows_valid, layout)
    if health is not None:
        in_range = (routing.ids >= 0) & (routing.ids < num_experts)
        health[DROPPED_SLOTS] += (rows_valid[:, None] & ~in_range).sum()

    send_splits: list[int] | None
    recv_splits: list[int] | None
    if mode == "dynamic":
        send_counts = plan.need.sum(dim=0)  # [W] int64
        recv_counts = torch.empty_like(send_counts)
        all_to_all(recv_counts, send_counts, None, None)
        counts = torch.cat([send_counts, recv_counts]).tolist()  # the dynamic mode's one host sync
        send_splits, recv_splits = counts[:world], counts[world:]
        send_rows, recv_rows = sum(send_splits), sum(recv_splits)
        cap = 0
    else:
        cap = capacity_rows(capacity, num_tokens)
        send_splits = recv_splits = None
        send_rows = recv_rows = world * cap
    row_of, send_token, send_peer, overflow = _place(plan, None if mode == "dynamic" else cap, send_rows)
    if health is not None and mode == "capacity":
        health[EP_OVERFLOW_SLOTS] += overflow

    # 2. Exchange the packed rows.
    wire = _pack(x, routing.ids, routing.weights, plan.owner, send_token, send_peer)
    received = torch.empty(recv_rows, wire.shape[1], dtype=torch.uint8, device=device)
    all_to_all(received, wire, recv_splits, send_splits)

    # 3. Local experts on the received rows, local ids bounds-checked.
    x_recv, global_ids, weights_recv = _unpack(received, hidden, top_k, x.dtype)
    local_ids, ok = layout.to_local(global_ids)
    if health is not None:
        health[DROPPED_SLOTS] += ((global_ids != -1) & ~ok).sum()  # strays: not ours, not empty
    y = local_experts(x_recv, torch.where(ok, weights_recv, 0.0), local_ids)  # [recv rows, H]

    # 4. Send the partial outputs back; the extra zero row answers every row_of pointing at trash.
    row_bytes = y.shape[1] * y.element_size()
    back = torch.empty(send_rows + 1, row_bytes, dtype=torch.uint8, device=device)
    back[send_rows:].zero_()
    all_to_all(back[:send_rows], y.view(torch.uint8), send_splits, recv_splits)
    partials = back.view(x.dtype)  # [send rows + 1, H]

    # 5. Combine in a fixed peer order, in fp32, rounded once.
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=device)
    for peer in range(world):
        out.add_(partials.index_select(0, row_of[:, peer]))
    return out.to(x.dtype)


def _exchange_triton(
    x: torch.Tensor,
    routing: Routing,
    layout: EPLayout,
    mode: str,
    capacity: int | float | None,
    nv: NumValid,
    health: torch.Tensor | None,
    all_to_all: AllToAll,
    local_experts: LocalExperts,
) -> torch.Tensor:
    """The same exchange with plan/pack, unpack and combine as Triton launches
    (`safemoe.kernels.ep_exchange`): count + pack, all-to-all, unpack, local experts, all-to-all,
    combine. Same wire format, same rows in the same places, same sums in the same order."""
    from safemoe.kernels import ep_exchange as kx

    num_tokens, hidden = x.shape
    world, top_k = layout.world_size, routing.ids.shape[1]
    device = x.device
    _, meta_offset, row_bytes = _wire_layout(hidden, top_k, x.dtype)
    ids, weights = routing.ids, routing.weights

    # 1. Plan: rows per (row block, peer).
    block_counts = torch.empty(kx.row_blocks(num_tokens), kx.peer_pad(world), dtype=torch.int32,
                               device=device)  # fmt: skip
    kx.count_into(ids, nv, layout.num_experts, world, block_counts, health)
    send_splits: list[int] | None
    recv_splits: list[int] | None
    if mode == "dynamic":
        send_counts = block_counts[:, :world].sum(dim=0, dtype=torch.int64)  # [W]
        recv_counts = torch.empty_like(send_counts)
        all_to_all(recv_counts, send_counts, None, None)
        counts = torch.cat([send_counts, recv_counts]).tolist()  # the dynamic mode's one host sync
        send_splits, recv_splits = counts[:world], counts[world:]
        send_rows, recv_rows = sum(send_splits), sum(recv_splits)
        cap = None
    else:
        cap = capacity_rows(capacity, num_tokens)
        send_splits = recv_splits = None
        send_rows = recv_rows = world * cap

    # 2. Pack and exchange. Buffers hold at least one row, so no kernel gets an empty tensor.
    wire = torch.empty(max(send_rows, 1), row_bytes, dtype=torch.uint8, device=device)[:send_rows]
    row_of = torch.empty(num_tokens, world, dtype=torch.int32, device=device)
    kx.pack_into(x, ids, weights, nv, layout.num_experts, world, block_counts, wire, meta_offset, row_of,
                 health, capacity=cap)  # fmt: skip
    received = torch.empty(recv_rows, row_bytes, dtype=torch.uint8, device=device)
    all_to_all(received, wire, recv_splits, send_splits)

    # 3. Unpack (global -> local ids, bounds-checked) and run the local experts.
    x_recv = torch.empty(recv_rows, hidden, dtype=x.dtype, device=device)
    local_ids = torch.empty(recv_rows, top_k, dtype=torch.int32, device=device)
    weights_recv = torch.empty(recv_rows, top_k, dtype=torch.float32, device=device)
    kx.unpack_into(received, meta_offset, layout.first_expert, layout.experts_per_rank, x_recv, local_ids,
                   weights_recv, health)  # fmt: skip
    y = local_experts(x_recv, weights_recv, local_ids)  # [recv rows, H]

    # 4. Return the partial outputs; 5. combine them in peer order (fp32, rounded once).
    back = torch.empty(max(send_rows, 1), hidden, dtype=x.dtype, device=device)
    all_to_all(back[:send_rows], y, send_splits, recv_splits)
    out = torch.empty_like(x)
    kx.combine_into(back, row_of, out)
    return out


class EPMoE(MoE):
    """An expert-parallel MoE layer: `safemoe.MoE` whose routed experts run across ranks. The
    router (and any shared expert) is replicated; the experts are split over the ranks.

    Parameters on rank r: those of `safemoe.MoE`, with `w13` [E/W, 2I, H] and `w2` [E/W, H, I]
    (or their fp8 form with `w13_scale` / `w2_scale` sliced alike) holding global experts
    [r * E/W, (r + 1) * E/W). The router must hold the same weights on every rank: build with
    `EPMoE.from_moe(moe)` or load them (`load_experts` slices a global [E, ...] tensor).

    mode: "dynamic" (exact sizes, one host sync per call) or "capacity" (fixed `capacity` rows per
        peer, CUDA-graph capturable); see safemoe.distributed.ep.
    exchange: "auto" (Triton plan/pack/unpack/combine on CUDA, torch ops elsewhere), "triton" or
        "torch"; see `ep_experts`.
    group: the process group (None: default). Every other argument as in `safemoe.MoE`.
    forward(x [..., H], num_valid) -> [..., H]; rows at or past num_valid come out as exact zeros.
    """

    _supports_batch_invariant = False

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int | RouteConfig,
        *,
        group: Any = None,
        mode: str = "dynamic",
        capacity: int | float | None = None,
        exchange: str = "auto",
        **moe_options: Any,
    ) -> None:
        layout = EPLayout.of_group(num_experts, group)
        mode = check_mode(mode, capacity)
        exchange = check_exchange(exchange)
        super().__init__(hidden_size, intermediate_size, num_experts, top_k,
                         local_experts=layout.experts_per_rank, **moe_options)
        self.layout = layout
        self.group = group
        self.mode = mode
        self.capacity = capacity
        self.exchange = exchange

    @classmethod
    def from_moe(
        cls,
        moe: MoE,
        *,
        group: Any = None,
        mode: str = "dynamic",
        capacity: int | float | None = None,
        workspace: Workspace | None = None,
        health: Health | torch.Tensor | None = None,
        backend: str | None = None,
        exchange: str = "auto",
    ) -> EPMoE:
        """This rank's share of a `safemoe.MoE` (the same router, shared expert and expert biases
        on every rank; the experts, fp8 or not, sliced to this rank's block)."""
        if not isinstance(moe, MoE):
            raise TypeError(f"EPMoE.from_moe takes a safemoe.MoE, got {type(moe).__name__}")
        gate = moe.gate
        ep = cls(
            moe.hidden_size,
            moe.intermediate_size,
            moe.num_experts,
            moe.route_config,
            group=group,
            mode=mode,
            capacity=capacity,
            exchange=exchange,
            activation=moe.activation,
            router_bias=gate.bias is not None,
            selection_bias=gate.selection_bias is not None,
            router_logits_fp32=gate.logits_fp32,
            expert_bias=moe.expert_bias,
            input_weighted=moe.input_weighted,
            health=health,
            backend=moe.backend if backend is None else backend,
            dtype=gate.weight.dtype,
            device=gate.weight.device,
        )
        with torch.no_grad():
            ep.gate.load_state_dict(gate.state_dict())
            if moe.w2_bias is not None and ep.w2_bias is not None:
                ep.w2_bias.copy_(moe.w2_bias)
        ep.shared_expert, ep.shared_expert_gate = moe.shared_expert, moe.shared_expert_gate
        first, local = ep.layout.first_expert, ep.layout.experts_per_rank
        if moe.quant is not None:
            assert moe.w13_scale is not None and moe.w2_scale is not None
            ep.set_fp8_experts(*(t[first : first + local].contiguous()
                                 for t in (moe.w13, moe.w2, moe.w13_scale, moe.w2_scale)))
        else:
            with torch.no_grad():
                ep.w13.copy_(moe.w13[first : first + local])
                ep.w2.copy_(moe.w2[first : first + local])
        ep.set_workspace(workspace)
        return ep

    def load_experts(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
    ) -> None:
        """Copy expert weights in: global [E, 2I, H] / [E, H, I] (this rank's block is taken) or
        already local [E/W, ...]; biases as in `MoE.load_experts` (w13_bias sliced alike, w2_bias
        global [E, H])."""
        first, local = self.layout.first_expert, self.layout.experts_per_rank
        sliced = []
        for name, src in (("w13", w13), ("w2", w2), ("w13_bias", w13_bias)):
            if src is not None and src.shape[0] == self.num_experts and self.num_experts != local:
                src = src[first : first + local]
            if src is not None and src.shape[0] != local:
                raise ValueError(
                    f"{name} must hold E={self.num_experts} or E/W={local} experts, got {tuple(src.shape)}"
                )
            sliced.append(src)
        assert sliced[0] is not None and sliced[1] is not None
        super().load_experts(sliced[0], sliced[1], sliced[2], w2_bias)

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 nv: NumValid) -> torch.Tensor:
        fp8 = self._fp8()
        return ep_experts(
            x,
            self.w13,
            self.w2,
            Routing(weights=weights, ids=ids),
            num_experts=self.num_experts,
            group=self.group,
            mode=self.mode,
            capacity=self.capacity,
            activation=self.activation,
            num_valid=nv.tensor if nv.tensor is not None else nv.count,
            backend=self.backend,
            health=self._health,
            workspace=self._workspace,
            w13_scale=None if fp8 is None else fp8.w13_scale,
            w2_scale=None if fp8 is None else fp8.w2_scale,
            exchange=self.exchange,
        )

    def extra_repr(self) -> str:
        lay = self.layout
        return (
            f"{super().extra_repr()}, rank={lay.rank}/{lay.world_size}, experts=[{lay.first_expert}, "
            f"{lay.first_expert + lay.experts_per_rank}), mode={self.mode}, capacity={self.capacity}, "
            f"exchange={self.exchange}"
        )
