"""Dispatch kernel (kernels/dispatch.py) against reference.dispatch_reference, on the interpreter.

Checks per call: per-expert slot sets equal the reference's, counts exact, every padding position
holds -1, the layout fits the capacity, the counters are back at zero, DROPPED_SLOTS exact.
"""

from __future__ import annotations

import pytest
import torch

from helpers import STALE_ID, garbage_ids
from safemoe._checks import NumValid
from safemoe.health import DROPPED_SLOTS, new_health_tensor
from safemoe.kernels.dispatch import CHUNK, dispatch_triton
from safemoe.reference import dispatch_reference
from safemoe.workspace import Workspace, capacity, max_m_blocks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests (CPU tensors)")


def _routing_ids(num_tokens: int, top_k: int, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct ids per row, as the router produces."""
    if num_tokens == 0:
        return torch.zeros(0, top_k, dtype=torch.int32)
    return torch.argsort(torch.rand(num_tokens, num_experts, generator=gen), dim=1)[:, :top_k].to(torch.int32)


def _check_layout(ids: torch.Tensor, num_experts: int, nv: NumValid, block_m: int,
                  ws: Workspace | None = None, health: torch.Tensor | None = None) -> None:
    num_tokens, top_k = ids.shape
    views = None if ws is None else ws.views(num_tokens, num_experts, top_k, ws.hidden, ws.inter)
    got = dispatch_triton(ids, num_experts, nv, block_m, health=health, views=views)
    ref = dispatch_reference(ids, num_experts, nv)
    blocks_ref = (ref.counts.to(torch.int64) + block_m - 1) // block_m
    assert torch.equal(got.block_end, torch.cumsum(blocks_ref, 0)), "block ends"
    assert got.num_blocks == int(blocks_ref.sum())
    assert got.num_blocks <= max_m_blocks(num_tokens, num_experts, top_k, block_m)
    assert got.num_blocks * block_m <= capacity(num_tokens, num_experts, top_k, block_m)
    for expert in range(num_experts):
        start = 0 if expert == 0 else int(got.block_end[expert - 1]) * block_m
        end = int(got.block_end[expert]) * block_m
        part = got.sorted_slots[start:end]
        count = int(ref.counts[expert])
        expected = torch.sort(ref.sorted_slots[ref.offsets[expert] : ref.offsets[expert + 1]]).values
        assert torch.equal(torch.sort(part[:count]).values, expected), f"expert {expert} slots"
        assert bool((part[count:] == -1).all()), f"expert {expert} padding must be -1"
    if views is not None:
        assert int(views.counts.abs().sum()) == 0 and int(views.ticket.item()) == 0, "counters not reset"
    if health is not None:
        assert int(health[DROPPED_SLOTS]) == ref.dropped


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 7, 17, 127, 128, 129, 255, 256, 257])
def test_boundaries_match_reference(num_tokens: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    ids = _routing_ids(num_tokens, 4, 16, gen)
    _check_layout(ids, 16, NumValid(num_tokens, None), block_m=16)


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
def test_block_sizes(block_m: int) -> None:
    gen = torch.Generator().manual_seed(block_m)
    ids = _routing_ids(200, 2, 8, gen)
    _check_layout(ids, 8, NumValid(200, None), block_m=block_m)


def test_multi_chunk_with_separate_scatter() -> None:
    """T*K past one chunk: count programs race for the ticket and scatter runs as its own kernel."""
    gen = torch.Generator().manual_seed(1)
    num_tokens = 4097
    ids = garbage_ids(num_tokens, 2, 6, generator=gen)
    assert num_tokens * 2 > CHUNK
    health = new_health_tensor()
    ws = Workspace(num_tokens, 6, 2, 16, 16, torch.float32, "cpu")
    _check_layout(ids, 6, NumValid(4000, None), 32, ws=ws, health=health)


def test_garbage_ids_dropped_and_counted() -> None:
    gen = torch.Generator().manual_seed(2)
    ids = garbage_ids(300, 4, 12, generator=gen)
    health = new_health_tensor()
    ws = Workspace(300, 12, 4, 16, 16, torch.float32, "cpu")
    _check_layout(ids, 12, NumValid(300, None), 16, ws=ws, health=health)
    assert int(health[DROPPED_SLOTS]) > 0


def test_padded_rows_never_read_device_num_valid() -> None:
    """Stale ids past num_valid (a device tensor) are neither served nor counted as dropped."""
    gen = torch.Generator().manual_seed(3)
    ids = _routing_ids(64, 4, 16, gen)
    ids[40:] = STALE_ID
    health = new_health_tensor()
    ws = Workspace(64, 16, 4, 16, 16, torch.float32, "cpu")
    _check_layout(ids, 16, NumValid(None, torch.tensor(40)), 16, ws=ws, health=health)
    assert int(health[DROPPED_SLOTS]) == 0


@pytest.mark.parametrize("num_valid", [0, 1, 63])
def test_num_valid_int_and_tensor_agree(num_valid: int) -> None:
    gen = torch.Generator().manual_seed(4)
    ids = _routing_ids(64, 2, 8, gen)
    for nv in (NumValid(num_valid, None), NumValid(None, torch.tensor(num_valid, dtype=torch.int32))):
        _check_layout(ids, 8, nv, 16)


def test_device_num_valid_is_clamped() -> None:
    gen = torch.Generator().manual_seed(5)
    ids = _routing_ids(10, 2, 8, gen)
    got = dispatch_triton(ids, 8, NumValid(None, torch.tensor(10**12)), 16)
    assert got.num_blocks == int(((dispatch_reference(ids, 8).counts + 15) // 16).sum())
    got = dispatch_triton(ids, 8, NumValid(None, torch.tensor(-5)), 16)
    assert got.num_blocks == 0


def test_all_tokens_to_one_expert_and_empty_experts() -> None:
    ids = torch.full((300, 1), 5, dtype=torch.int32)
    _check_layout(ids, 8, NumValid(300, None), 64)
    dup = torch.full((50, 4), 2, dtype=torch.int32)  # duplicates in every row: each slot served
    _check_layout(dup, 4, NumValid(50, None), 16)


def test_poisoned_workspace_and_reuse() -> None:
    """Stale sorted_slots/cursor/block_end are overwritten; back-to-back calls reuse the counters."""
    gen = torch.Generator().manual_seed(6)
    ws = Workspace(256, 16, 4, 16, 16, torch.float32, "cpu")
    views = ws.views(256, 16, 4, 16, 16)
    for buf in (views.sorted_slots, views.cursor, views.block_end, views.num_blocks):
        buf.fill_(STALE_ID)
    for num_tokens in (256, 3, 129):
        ids = _routing_ids(num_tokens, 4, 16, gen)
        _check_layout(ids, 16, NumValid(num_tokens, None), 32, ws=ws)


@pytest.mark.parametrize("num_valid", [1, 256, 257])
def test_one_valid_chunk_in_a_multi_chunk_grid(num_valid: int) -> None:
    """T*K past one chunk but num_valid*K <= CHUNK (device tensor): program 0 alone builds the
    layout and the scatter launch returns at once; 256 * 4 is exactly one chunk, 257 * 4 is not."""
    gen = torch.Generator().manual_seed(num_valid)
    num_tokens, top_k, num_experts = 700, 4, 16
    ids = _routing_ids(num_tokens, top_k, num_experts, gen)
    ids[num_valid:] = STALE_ID
    assert num_tokens * top_k > CHUNK and 256 * top_k == CHUNK
    health = new_health_tensor()
    ws = Workspace(num_tokens, num_experts, top_k, 16, 16, torch.float32, "cpu")
    _check_layout(ids, num_experts, NumValid(None, torch.tensor(num_valid)), 32, ws=ws, health=health)
