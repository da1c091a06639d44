"""Dispatch kernel (kernels/dispatch.py) against reference.dispatch_reference, on every device:
under the Triton interpreter on CPU and compiled on a GPU (where several count programs really
race for the ticket).

Checks per call: per-expert slot sets equal the reference's, counts exact, every padding position
holds -1, the layout fits the capacity, the counters are back at zero, DROPPED_SLOTS exact. The
layout is integer and exact on any device, so every case runs on both, and with both ways of
writing a one-program layout's padding (`padding_fill`).
"""

from __future__ import annotations

import pytest
import torch

from helpers import STALE_ID, by_device, garbage_ids, interpreter_only
from safemoe._checks import NumValid
from safemoe.health import DROPPED_SLOTS, new_health_tensor
from safemoe.kernels.dispatch import ALONE_SLOTS, ATOMIC_COUNT_BINS, CHUNK, dispatch_into, dispatch_triton
from safemoe.reference import dispatch_reference
from safemoe.workspace import Workspace, capacity, max_m_blocks


@pytest.fixture(autouse=True, params=[False, True], ids=["bin_fill", "range_fill"])
def padding_fill(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Every case with the one-program layout's padding written per bin and as one range
    (kernels/dispatch.py RANGE_PADDING_FILL, an A/B switch)."""
    import safemoe.kernels.dispatch as dispatch_module

    monkeypatch.setattr(dispatch_module, "RANGE_PADDING_FILL", request.param)
    return request.param


def _routing_ids(num_tokens: int, top_k: int, num_experts: int, gen: torch.Generator,
                 device: str = "cpu") -> torch.Tensor:
    """Distinct ids per row, as the router produces."""
    if num_tokens == 0:
        return torch.zeros(0, top_k, dtype=torch.int32, device=device)
    ids = torch.argsort(torch.rand(num_tokens, num_experts, generator=gen), dim=1)[:, :top_k]
    return ids.to(torch.int32).to(device)


def _nv(count: int | None, tensor: int | None = None, device: str = "cpu", dtype=torch.int64) -> NumValid:
    """NumValid with a host count, or with a device tensor holding `tensor`."""
    if tensor is None:
        return NumValid(count, None)
    return NumValid(None, torch.tensor(tensor, dtype=dtype, device=device))


def _check_layout(ids: torch.Tensor, num_experts: int, nv: NumValid, block_m: int,
                  ws: Workspace | None = None, health: torch.Tensor | None = None) -> None:
    num_tokens, top_k = ids.shape
    views = None if ws is None else ws.views(num_tokens, num_experts, top_k, ws.hidden, ws.inter)
    got = dispatch_triton(ids, num_experts, nv, block_m, health=health, views=views)
    ref = dispatch_reference(ids, num_experts, nv)
    counts = ref.counts.cpu()
    blocks_ref = (counts.to(torch.int64) + block_m - 1) // block_m
    assert torch.equal(got.block_end, torch.cumsum(blocks_ref, 0)), "block ends"
    assert got.num_blocks == int(blocks_ref.sum())
    assert got.num_blocks <= max_m_blocks(num_tokens, num_experts, top_k, block_m)
    assert got.num_blocks * block_m <= capacity(num_tokens, num_experts, top_k, block_m)
    sorted_slots = got.sorted_slots.cpu()
    for expert in range(num_experts):
        start = 0 if expert == 0 else int(got.block_end[expert - 1]) * block_m
        end = int(got.block_end[expert]) * block_m
        part = sorted_slots[start:end]
        count = int(counts[expert])
        expected = torch.sort(ref.sorted_slots[ref.offsets[expert] : ref.offsets[expert + 1]]).values.cpu()
        assert torch.equal(torch.sort(part[:count]).values, expected), f"expert {expert} slots"
        assert torch.equal(got.expert_slots(expert).cpu(), expected), f"expert {expert} (expert_slots)"
        assert bool((part[count:] == -1).all()), f"expert {expert} padding must be -1"
    if views is not None:
        assert int(views.counts.abs().sum()) == 0 and int(views.ticket.item()) == 0, "counters not reset"
    if health is not None:
        assert int(health[DROPPED_SLOTS]) == ref.dropped


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 7, 17, 127, 128, 129, 255, 256, 257])
def test_boundaries_match_reference(device: str, num_tokens: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    ids = _routing_ids(num_tokens, 4, 16, gen, device)
    _check_layout(ids, 16, NumValid(num_tokens, None), block_m=16)


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
def test_block_sizes(device: str, block_m: int) -> None:
    gen = torch.Generator().manual_seed(block_m)
    ids = _routing_ids(200, 2, 8, gen, device)
    _check_layout(ids, 8, NumValid(200, None), block_m=block_m)


@pytest.mark.memcheck
@pytest.mark.parametrize(("device", "num_tokens", "num_experts", "top_k", "block_m", "num_valid", "calls"),
                         by_device(cpu=[(4097, 6, 2, 32, 4000, 1), (600, 300, 8, 16, 599, 2)],
                                   cuda=[(4097, 6, 2, 32, 4000, 1), (5000, 8, 2, 16, 4997, 3),
                                         (3000, 128, 8, 64, 2997, 3), (1200, 256, 8, 128, 1197, 3)]))
def test_multi_chunk_with_separate_scatter(device: str, num_tokens: int, num_experts: int, top_k: int,
                                           block_m: int, num_valid: int, calls: int) -> None:
    """T*K past one chunk: count programs race for the ticket (only visible compiled: more shapes
    there, each called again on the same workspace) and scatter runs as its own kernel."""
    gen = torch.Generator().manual_seed(1)
    ids = garbage_ids(num_tokens, top_k, num_experts, generator=gen).to(device)
    assert num_valid * top_k > ALONE_SLOTS
    ws = Workspace(num_tokens, num_experts, top_k, 16, 16, torch.float32, device)
    for _ in range(calls):
        health = new_health_tensor(device)
        _check_layout(ids, num_experts, NumValid(num_valid, None), block_m, ws=ws, health=health)


def test_garbage_ids_dropped_and_counted(device: str) -> None:
    gen = torch.Generator().manual_seed(2)
    ids = garbage_ids(300, 4, 12, generator=gen).to(device)
    health = new_health_tensor(device)
    ws = Workspace(300, 12, 4, 16, 16, torch.float32, device)
    _check_layout(ids, 12, NumValid(300, None), 16, ws=ws, health=health)
    assert int(health[DROPPED_SLOTS]) > 0


def test_padded_rows_never_read_device_num_valid(device: str) -> None:
    """Stale ids past num_valid (a device tensor) are neither served nor counted as dropped."""
    gen = torch.Generator().manual_seed(3)
    ids = _routing_ids(64, 4, 16, gen, device)
    ids[40:] = STALE_ID
    health = new_health_tensor(device)
    ws = Workspace(64, 16, 4, 16, 16, torch.float32, device)
    _check_layout(ids, 16, _nv(None, 40, device), 16, ws=ws, health=health)
    assert int(health[DROPPED_SLOTS]) == 0


@pytest.mark.parametrize("num_valid", [0, 1, 63])
def test_num_valid_int_and_tensor_agree(device: str, num_valid: int) -> None:
    gen = torch.Generator().manual_seed(4)
    ids = _routing_ids(64, 2, 8, gen, device)
    for nv in (_nv(num_valid), _nv(None, num_valid, device, torch.int32)):
        _check_layout(ids, 8, nv, 16)


def test_device_num_valid_is_clamped(device: str) -> None:
    gen = torch.Generator().manual_seed(5)
    ids = _routing_ids(10, 2, 8, gen, device)
    got = dispatch_triton(ids, 8, _nv(None, 10**12, device), 16)
    assert got.num_blocks == int(((dispatch_reference(ids, 8).counts + 15) // 16).sum())
    got = dispatch_triton(ids, 8, _nv(None, -5, device), 16)
    assert got.num_blocks == 0


def test_all_tokens_to_one_expert_and_empty_experts(device: str) -> None:
    ids = torch.full((300, 1), 5, dtype=torch.int32, device=device)
    _check_layout(ids, 8, NumValid(300, None), 64)
    dup = torch.full((50, 4), 2, dtype=torch.int32, device=device)  # duplicates in every row: all served
    _check_layout(dup, 4, NumValid(50, None), 16)


def test_poisoned_workspace_and_reuse(device: str) -> None:
    """Stale sorted_slots/cursor/block_end are overwritten; back-to-back calls reuse the counters."""
    gen = torch.Generator().manual_seed(6)
    ws = Workspace(256, 16, 4, 16, 16, torch.float32, device)
    views = ws.views(256, 16, 4, 16, 16)
    for buf in (views.sorted_slots, views.cursor, views.block_end, views.num_blocks):
        buf.fill_(STALE_ID)
    for num_tokens in (256, 3, 129):
        ids = _routing_ids(num_tokens, 4, 16, gen, device)
        _check_layout(ids, 16, NumValid(num_tokens, None), 32, ws=ws)


@pytest.mark.parametrize("num_valid", [1, 256, 257])
def test_one_valid_chunk_in_a_multi_chunk_grid(device: str, num_valid: int) -> None:
    """T*K past ALONE_SLOTS (several programs) but num_valid*K <= CHUNK (device tensor): program 0
    alone builds the layout and the scatter launch returns at once; 256 * 4 is exactly one chunk,
    257 * 4 is not."""
    gen = torch.Generator().manual_seed(num_valid)
    num_tokens, top_k, num_experts = 1100, 4, 16
    ids = _routing_ids(num_tokens, top_k, num_experts, gen, device)
    ids[num_valid:] = STALE_ID
    assert num_tokens * top_k > ALONE_SLOTS and 256 * top_k == CHUNK
    health = new_health_tensor(device)
    ws = Workspace(num_tokens, num_experts, top_k, 16, 16, torch.float32, device)
    _check_layout(ids, num_experts, _nv(None, num_valid, device), 32, ws=ws, health=health)


@pytest.mark.parametrize(("num_tokens", "top_k", "num_experts", "num_valid"),
                         [(1000, 4, 16, None), (1000, 4, 16, 257), (512, 8, 128, None), (512, 8, 128, 130),
                          (400, 10, 512, None), (300, 8, 600, 41)])
def test_wide_chunk_one_program(device: str, num_tokens: int, top_k: int, num_experts: int,
                                    num_valid: int | None) -> None:
    """CHUNK < T*K <= ALONE_SLOTS: one program takes every slot as one wide chunk, no ticket and
    no scatter launch (garbage ids dropped and counted, stale padding never read); E >= 512
    (1024 bins, ATOMIC_COUNT_BINS) counts with atomics into the workspace counters, which end at
    zero."""
    gen = torch.Generator().manual_seed(num_tokens + top_k)
    ids = garbage_ids(num_tokens, top_k, num_experts, generator=gen).to(device)
    assert CHUNK < num_tokens * top_k <= ALONE_SLOTS and ATOMIC_COUNT_BINS == 1024
    nv = _nv(num_tokens) if num_valid is None else _nv(None, num_valid, device)
    if num_valid is not None:
        ids[num_valid:] = STALE_ID
    ws = Workspace(num_tokens, num_experts, top_k, 16, 16, torch.float32, device)
    for _ in range(2):
        health = new_health_tensor(device)
        _check_layout(ids, num_experts, nv, 32, ws=ws, health=health)


@pytest.mark.parametrize("warps", [4, 8, 16])
@pytest.mark.parametrize(("num_tokens", "top_k", "num_experts", "num_valid"),
                         [(8, 10, 512, None), (8, 10, 512, 3), (64, 10, 512, 37), (2, 10, 600, None)])
def test_many_bins_decode_program_at_any_warps(device: str, warps: int, num_tokens: int, top_k: int,
                                               num_experts: int, num_valid: int | None,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-program decode dispatch (T*K <= CHUNK) with 1024 bins or more (E = 512, Qwen3-Next)
    builds the same layout whatever its warps (MANY_BINS_WARPS, an A/B switch): garbage ids
    dropped and counted, stale padding rows never read, counters zero after each call."""
    import safemoe.kernels.dispatch as dispatch_module

    monkeypatch.setattr(dispatch_module, "MANY_BINS_WARPS", warps)
    assert num_tokens * top_k <= CHUNK
    gen = torch.Generator().manual_seed(num_tokens * 31 + warps)
    ids = garbage_ids(num_tokens, top_k, num_experts, generator=gen).to(device)
    nv = _nv(num_tokens) if num_valid is None else _nv(None, num_valid, device)
    if num_valid is not None:
        ids[num_valid:] = STALE_ID
    ws = Workspace(num_tokens, num_experts, top_k, 16, 16, torch.float32, device)
    for _ in range(2):
        _check_layout(ids, num_experts, nv, 16, ws=ws, health=new_health_tensor(device))


@pytest.mark.parametrize("bad", ["rows", "x_dtype", "xq_dtype", "xq_shape", "scale_groups", "group_len",
                                 "non_contiguous"])
def test_quantize_x_rejected_before_any_launch(bad: str) -> None:
    """dispatch_into's quantize_x (x, xq, x_scale, group_len) is checked on the host, before any
    kernel: a wrong shape, dtype, group count or layout names the argument."""
    ids = torch.zeros(4, 2, dtype=torch.int32)
    ws = Workspace(4, 8, 2, 256, 16, torch.bfloat16, torch.device("cpu"))
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    xq = torch.zeros(4, 256, dtype=torch.float8_e4m3fn)
    scale = torch.zeros(4, 2)
    group = 128
    if bad == "rows":
        x, xq = x[:3], xq[:3]
    elif bad == "x_dtype":
        x = x.float()
    elif bad == "xq_dtype":
        xq = xq.view(torch.uint8)
    elif bad == "xq_shape":
        xq = xq[:, :128]
    elif bad == "scale_groups":
        scale = torch.zeros(4, 1)
    elif bad == "group_len":
        group = 0
    else:
        x = torch.zeros(256, 4, dtype=torch.bfloat16).t()
    views = ws.views(4, 8, 2, 256, 16)
    views.num_blocks.fill_(-7)  # every dispatch launch writes it
    with pytest.raises(ValueError, match="quantize_x"):
        dispatch_into(ids, 8, NumValid(4, None), 16, views, None, quantize_x=(x, xq, scale, group))
    assert bool((views.num_blocks == -7).all()), "a kernel ran"


@interpreter_only("CPU tensors through a Triton launch (a GPU machine runs the kernels on CUDA tensors)")
def test_quantize_x_accepted_when_well_formed() -> None:
    """The inputs test_quantize_x_rejected_before_any_launch spoils, as they are: accepted (the
    launch writes the layout, and x's codes and scales)."""
    ids = torch.zeros(4, 2, dtype=torch.int32)
    ws = Workspace(4, 8, 2, 256, 16, torch.bfloat16, torch.device("cpu"))
    views = ws.views(4, 8, 2, 256, 16)
    views.num_blocks.fill_(-7)
    x = torch.ones(4, 256, dtype=torch.bfloat16)
    xq = torch.zeros(4, 256, dtype=torch.float8_e4m3fn)
    scale = torch.zeros(4, 2)
    assert dispatch_into(ids, 8, NumValid(4, None), 16, views, None, quantize_x=(x, xq, scale, 128))
    assert not bool((views.num_blocks == -7).any())
    assert bool((scale > 0).all()) and bool((xq.float() > 0).all())
