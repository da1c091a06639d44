"""The Triton exchange (`safemoe.kernels.ep_exchange`) against the torch exchange of
`safemoe.distributed.ep` (`_plan`, `_place`, `_pack`, `_unpack`, `EPLayout.to_local`, the combine
sum), in one process: no process group is needed for the kernels themselves.

Adversarial routing everywhere: -1, -7, E, 123456789 and duplicate ids in valid rows; stale or
real-looking ids, NaN weights and NaN x in padded rows; num_valid 0, 1, some and T, as an int and as
a device tensor; one peer receiving every row; capacities that overflow. Output buffers are
poisoned first, so a row the kernel should write and does not shows up.
"""

from __future__ import annotations

import pytest
import torch

from helpers import STALE_ID, assert_equal, capture_graph, garbage_ids, poisoned
from safemoe._checks import NumValid
from safemoe.check.cases.ep import expected_overflow
from safemoe.distributed.ep import (
    EPLayout,
    _exchange_torch,
    _exchange_triton,
    _pack,
    _place,
    _plan,
    _unpack,
    _wire_layout,
)
from safemoe.health import DROPPED_SLOTS, EP_OVERFLOW_SLOTS, new_health_tensor
from safemoe.kernels import ep_exchange as kx
from safemoe.routing import Routing

K = 3


def _routing(num_tokens: int, num_experts: int, num_valid: int, dtype: torch.dtype, hidden: int,
             seed: int, one_peer: int | None = None, world: int = 1):  # fmt: skip
    """(x, ids, weights) with garbage in valid rows and poison in padded rows."""
    gen = torch.Generator().manual_seed(seed)
    ids = garbage_ids(num_tokens, K, num_experts, generator=gen)
    if one_peer is not None:  # every valid slot on one peer (a few dropped ids kept)
        per_rank = num_experts // world
        ids = torch.where((ids >= 0) & (ids < num_experts), one_peer * per_rank + ids % per_rank, ids)
    ids[num_valid::2] = STALE_ID
    ids[num_valid + 1 :: 2] = 0  # padded rows that look routed
    weights = torch.rand(num_tokens, K, generator=gen)
    weights[0, -1] = float("nan")  # a valid weight's bits travel unchanged
    weights[num_valid:] = float("nan")
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    x[num_valid:] = float("nan")
    return x, ids, weights


def _num_valid(count: int, as_tensor: bool, device: str) -> NumValid:
    if as_tensor:
        return NumValid(count=None, tensor=torch.tensor(count, dtype=torch.int32, device=device))
    return NumValid(count=count, tensor=None)


def _torch_side(x, ids, weights, num_valid: int, layout: EPLayout, capacity: int | None):
    """The torch exchange's send side: wire, row_of (-1 where not placed), send_token, overflow,
    dropped slots."""
    num_tokens = x.shape[0]
    rows_valid = torch.arange(num_tokens) < num_valid
    plan = _plan(ids, rows_valid, layout)
    send_rows = int(plan.need.sum()) if capacity is None else layout.world_size * capacity
    row_of, send_token, send_peer, overflow = _place(plan, capacity, send_rows)
    wire = _pack(x, ids, weights, plan.owner, send_token, send_peer)
    in_range = (ids >= 0) & (ids < layout.num_experts)
    dropped = int((rows_valid[:, None] & ~in_range).sum())
    row_of = torch.where(row_of == send_rows, -1, row_of).to(torch.int32)
    return wire, row_of, send_token, int(overflow), dropped, plan.need.sum(dim=0)


def _triton_side(x, ids, weights, nv: NumValid, layout: EPLayout, capacity: int | None, send_rows: int,
                 device: str):  # fmt: skip
    num_tokens, hidden = x.shape
    world = layout.world_size
    _, meta_offset, row_bytes = _wire_layout(hidden, K, x.dtype)
    health = new_health_tensor(device)
    block_counts = poisoned((kx.row_blocks(num_tokens), kx.peer_pad(world)), torch.int32, device)
    x, ids, weights = x.to(device), ids.to(device), weights.to(device)
    kx.count_into(ids, nv, layout.num_experts, world, block_counts, health)
    wire = torch.full((max(send_rows, 1), row_bytes), 0xAB, dtype=torch.uint8, device=device)[:send_rows]
    row_of = poisoned((num_tokens, world), torch.int32, device)
    kx.pack_into(x, ids, weights, nv, layout.num_experts, world, block_counts, wire, meta_offset, row_of,
                 health, capacity=capacity)  # fmt: skip
    return wire.cpu(), row_of.cpu(), block_counts.cpu(), health.cpu()


CASES = [  # (world, E, T, H, dtype, capacity: None dynamic, "T" = T rows, an int)
    pytest.param(2, 8, 70, 5, torch.float32, None, id="W2-dynamic-fp32-oddH"),
    pytest.param(4, 16, 70, 24, torch.bfloat16, "T", id="W4-capacityT-bf16"),
    pytest.param(4, 16, 70, 5, torch.bfloat16, 9, id="W4-capacity9-bf16-oddH-overflow"),
    pytest.param(8, 16, 33, 16, torch.float16, None, id="W8-dynamic-fp16"),
    pytest.param(8, 16, 33, 16, torch.float32, 2, id="W8-capacity2-overflow"),
]


@pytest.mark.parametrize(("world", "num_experts", "num_tokens", "hidden", "dtype", "capacity"), CASES)
@pytest.mark.parametrize("nv_kind", ["zero", "one", "some-tensor", "all"])
def test_count_and_pack_match_the_torch_plan(device, world, num_experts, num_tokens, hidden, dtype, capacity,
                                             nv_kind) -> None:  # fmt: skip
    num_valid = {"zero": 0, "one": 1, "some-tensor": num_tokens // 2 + 3, "all": num_tokens}[nv_kind]
    cap = num_tokens if capacity == "T" else capacity
    layout = EPLayout(world, 0, num_experts)
    x, ids, weights = _routing(num_tokens, num_experts, num_valid, dtype, hidden, seed=world + num_valid)
    want_wire, want_row_of, send_token, overflow, dropped, per_peer = _torch_side(x, ids, weights, num_valid,
                                                                                 layout, cap)  # fmt: skip
    nv = _num_valid(num_valid, nv_kind.endswith("tensor"), device)
    wire, row_of, block_counts, health = _triton_side(x, ids, weights, nv, layout, cap, want_wire.shape[0],
                                                      device)  # fmt: skip
    assert_equal(block_counts[:, :world].sum(dim=0).to(torch.int64), per_peer, what="rows per peer")
    assert_equal(row_of, want_row_of, what="row_of")
    assert bool((row_of[num_valid:] == -1).all()), "a padding row was placed on the wire"
    x_bytes, meta_offset, _ = _wire_layout(hidden, K, dtype)
    assert_equal(wire[:, meta_offset:], want_wire[:, meta_offset:], what="ids and weight bits, every row")
    used = send_token >= 0
    assert_equal(wire[used, :x_bytes], want_wire[used, :x_bytes], what="x of the rows sent")
    assert health[DROPPED_SLOTS] == dropped, (health, dropped)
    assert health[EP_OVERFLOW_SLOTS] == overflow, (health, overflow)
    if cap is not None and cap >= num_tokens:
        assert overflow == 0


@pytest.mark.parametrize("capacity", [None, 5])
def test_one_peer_receives_everything(device, capacity) -> None:
    world, num_experts, num_tokens, hidden = 4, 16, 40, 8
    layout = EPLayout(world, 1, num_experts)
    x, ids, weights = _routing(num_tokens, num_experts, 37, torch.float32, hidden, seed=3, one_peer=2,
                               world=world)  # fmt: skip
    want_wire, want_row_of, send_token, overflow, dropped, per_peer = _torch_side(x, ids, weights, 37, layout,
                                                                                 capacity)  # fmt: skip
    assert int(per_peer[2]) >= 25 and int(per_peer.sum()) == int(per_peer[2])
    wire, row_of, _, health = _triton_side(x, ids, weights, _num_valid(37, True, device), layout, capacity,
                                           want_wire.shape[0], device)  # fmt: skip
    assert_equal(row_of, want_row_of, what="row_of")
    _, meta_offset, _ = _wire_layout(hidden, K, torch.float32)
    assert_equal(wire[:, meta_offset:], want_wire[:, meta_offset:], what="meta")
    assert_equal(wire[send_token >= 0], want_wire[send_token >= 0], what="rows sent")
    assert health[DROPPED_SLOTS] == dropped and health[EP_OVERFLOW_SLOTS] == overflow
    if capacity is not None:
        assert overflow > 0  # 5 rows of >= 25 fit


@pytest.mark.parametrize(("world", "rank", "dtype", "hidden"),
                         [(2, 1, torch.bfloat16, 5), (4, 2, torch.float32, 24)])  # fmt: skip
def test_unpack_matches_to_local_and_counts_strays(device, world, rank, dtype, hidden) -> None:
    num_experts, rows = 4 * world, 45
    layout = EPLayout(world, rank, num_experts)
    gen = torch.Generator().manual_seed(11)
    _, meta_offset, row_bytes = _wire_layout(hidden, K, dtype)
    wire = torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, generator=gen)
    meta = wire[:, meta_offset:].view(torch.int32)
    # Ids: this rank's, other ranks' (strays), -1 (other peers' slots), garbage; weights with a NaN.
    ids = torch.randint(-1, num_experts, (rows, K), generator=gen, dtype=torch.int32)
    ids[::7, 0] = STALE_ID
    ids[::5, 1] = -(2**31)
    ids[3] = -1  # a blank row: its x must not be needed
    meta[:, :K] = ids
    weights = torch.rand(rows, K, generator=gen)
    weights[1, 0] = float("nan")
    meta[:, K:] = weights.view(torch.int32)
    x_ref, global_ids, w_ref = _unpack(wire, hidden, K, dtype)
    local_ref, ok = layout.to_local(global_ids)
    strays = int(((global_ids != -1) & ~ok).sum())
    health = new_health_tensor(device)
    x = poisoned((rows, hidden), dtype, device)
    local = poisoned((rows, K), torch.int32, device)
    w = poisoned((rows, K), torch.float32, device)
    kx.unpack_into(wire.to(device), meta_offset, layout.first_expert, layout.experts_per_rank, x, local, w,
                   health)  # fmt: skip
    assert_equal(local.cpu(), local_ref, what="local ids")
    assert_equal(w.cpu(), torch.where(ok, w_ref, 0.0), what="weights (bits)")
    has_local = ok.any(dim=1)
    assert_equal(x.cpu()[has_local], x_ref[has_local], what="x of rows with a local slot")
    assert int(health[DROPPED_SLOTS]) == strays > 0


@pytest.mark.parametrize(("world", "dtype"), [(2, torch.bfloat16), (8, torch.float32)])
def test_combine_is_the_torch_sum_bitwise(device, world, dtype) -> None:
    num_tokens, hidden, send_rows = 50, 40, 70
    gen = torch.Generator().manual_seed(5)
    partials = torch.randn(send_rows + 1, hidden, generator=gen).to(dtype)
    row_of = torch.randint(0, send_rows, (num_tokens, world), generator=gen)
    row_of[torch.rand(num_tokens, world, generator=gen) < 0.4] = send_rows  # not placed
    row_of[40:] = send_rows  # padding rows: placed nowhere
    unread = torch.ones(send_rows + 1, dtype=torch.bool)
    unread[row_of.reshape(-1)] = False
    partials[unread] = float("nan")  # rows nobody points at must never be read
    partials[send_rows] = 0  # the torch combine's trash row
    want = torch.zeros(num_tokens, hidden, dtype=torch.float32)
    for peer in range(world):
        want.add_(partials.index_select(0, row_of[:, peer]))
    want = want.to(dtype)
    out = poisoned((num_tokens, hidden), dtype, device)
    row_of32 = torch.where(row_of == send_rows, -1, row_of).to(torch.int32)
    kx.combine_into(partials[:send_rows].contiguous().to(device), row_of32.to(device), out)
    assert_equal(out.cpu(), want, what="combine")
    assert_equal(out.cpu()[40:], torch.zeros(10, hidden, dtype=dtype), what="padding rows")


def test_launchers_reject_wrong_buffers() -> None:
    ids = torch.zeros(4, K, dtype=torch.int32)
    nv = NumValid(count=4, tensor=None)
    with pytest.raises(ValueError, match="block_counts"):
        kx.count_into(ids, nv, 8, 2, torch.zeros(1, 4, dtype=torch.int32), None)
    x = torch.zeros(4, 5)
    weights = torch.zeros(4, K)
    block_counts = torch.zeros(1, 2, dtype=torch.int32)
    _, meta_offset, row_bytes = _wire_layout(5, K, x.dtype)
    wire = torch.zeros(6, row_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="row_of"):
        kx.pack_into(x, ids, weights, nv, 8, 2, block_counts, wire, meta_offset,
                     torch.zeros(4, 3, dtype=torch.int32), None, capacity=3)  # fmt: skip
    with pytest.raises(ValueError, match="W\\*C"):
        kx.pack_into(x, ids, weights, nv, 8, 2, block_counts, wire, meta_offset,
                     torch.zeros(4, 2, dtype=torch.int32), None, capacity=4)  # fmt: skip


@pytest.mark.parametrize(("mode", "capacity"), [("dynamic", None), ("capacity", None), ("capacity", 4)])
def test_whole_exchange_loopback_is_bitwise_the_torch_one(device, mode, capacity) -> None:
    """Both exchanges end to end on one process: rank 1 of 4 with the all-to-all as a loopback copy
    (what it sends stands for what it receives: other peers' ids arrive as strays) and a local
    "expert" that scales each received row by its summed local weights (NaN-free stand-in that
    still depends on the ids and weights). Outputs bitwise equal, health equal."""
    world, num_experts, num_tokens, hidden, num_valid = 4, 16, 45, 24, 40
    layout = EPLayout(world, 1, num_experts)
    x, ids, weights = _routing(num_tokens, num_experts, num_valid, torch.bfloat16, hidden, seed=21)
    weights[0, -1] = 0.5  # no NaN here: the stand-in expert multiplies by the weights
    x, ids, weights = x.to(device), ids.to(device), weights.to(device)

    def loopback(out, inp, out_splits, in_splits) -> None:
        assert out_splits == in_splits  # the loopback only works when a rank receives what it sends
        out.copy_(inp)

    def stand_in(x_recv, w, local_ids):
        # Rows without a local slot are zeros, as safemoe.experts leaves them (their x is never read).
        scale = torch.where(local_ids >= 0, w, 0.0).sum(dim=1, keepdim=True)
        has_local = (local_ids >= 0).any(dim=1, keepdim=True)
        return torch.where(has_local, (x_recv.float() * scale).to(x_recv.dtype), 0.0)

    outs, healths = [], []
    for path in (_exchange_torch, _exchange_triton):
        health = new_health_tensor(device)
        nv = _num_valid(num_valid, True, device)
        outs.append(path(x, Routing(weights=weights, ids=ids), layout, mode, capacity, nv, health, loopback,
                         stand_in))  # fmt: skip
        healths.append(health.cpu())
    assert_equal(outs[1].cpu(), outs[0].cpu(), what=f"{mode} C={capacity}")
    assert_equal(healths[1], healths[0], what="health")
    assert_equal(outs[1].cpu()[num_valid:], torch.zeros(num_tokens - num_valid, hidden, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.memcheck
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_capacity_exchange_captures_in_a_cuda_graph() -> None:
    """The Triton exchange in capacity mode (loopback collective, stand-in experts, model-sized H)
    captured once in a CUDA graph and replayed with num_valid changed in place, including 0 and
    T: each replay equals the eager call bitwise, padded rows are zeros, health adds up."""
    world, num_experts, num_tokens, hidden = 8, 128, 300, 2048
    CAPACITY = 32
    layout = EPLayout(world, 3, num_experts)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16).cuda()
    ids = garbage_ids(num_tokens, K, num_experts, generator=gen).cuda()
    weights = torch.rand(num_tokens, K, generator=gen).cuda()
    routing = Routing(weights=weights, ids=ids)
    num_valid = torch.tensor(num_tokens, dtype=torch.int32, device="cuda")
    nv = NumValid(count=None, tensor=num_valid)
    health = new_health_tensor("cuda")

    def loopback(out, inp, out_splits, in_splits) -> None:
        out.copy_(inp)

    def stand_in(x_recv, w, local_ids):
        return torch.where((local_ids >= 0).any(dim=1, keepdim=True), x_recv, 0.0)

    def step():
        return _exchange_triton(x, routing, layout, "capacity", CAPACITY, nv, health, loopback, stand_in)

    counts = [num_tokens, 1, 0, 211, num_tokens]
    eager, eager_health = [], []
    for count in counts:
        num_valid.fill_(count)
        health.zero_()
        eager.append(step().clone())
        eager_health.append(health.clone())
    graph, out = capture_graph(step)
    for count, want, want_health in zip(counts, eager, eager_health, strict=True):
        num_valid.fill_(count)
        health.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert_equal(out, want, what=f"replay at num_valid {count}")
        assert_equal(out[count:], torch.zeros_like(out[count:]), what=f"padding at {count}")
        assert_equal(health, want_health, what=f"health at {count}")
    # At C = 32 rows per peer these 300 rows overflow by 128 slots (the policy's plain-Python model;
    # at C = 64, as first written, nothing overflowed: the H100 run of 2026-11-24 caught it).
    per_rank = num_experts // world
    _, want_overflow = expected_overflow(ids.cpu(), num_tokens, CAPACITY, per_rank, world, num_experts)
    assert int(eager_health[0][EP_OVERFLOW_SLOTS]) == want_overflow > 0
