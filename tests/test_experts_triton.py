"""Expert kernels (kernels/experts.py + combine.py) against reference.experts_reference, interpreted.

fp32 and fp16 (the interpreter has no bf16 arithmetic), H and I <= 128, small E. Outputs and
workspaces are poisoned beforehand so any element read before it was written shows up as NaN.
"""

from __future__ import annotations

import math

import pytest
import torch

import safemoe
from helpers import STALE_ID, assert_close, assert_equal, garbage_ids, poisoned
from safemoe._checks import NumValid
from safemoe.configs import ExpertsConfig, GemmTiles
from safemoe.health import DROPPED_SLOTS, new_health_tensor
from safemoe.kernels.experts import experts_triton
from safemoe.reference import dispatch_reference, experts_reference
from safemoe.workspace import Workspace, workspace_bytes

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests (CPU tensors)")


def _weights(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, gen: torch.Generator):
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / math.sqrt(hidden)).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / math.sqrt(inter)).to(dtype)
    return w13, w2


def _routing(num_tokens: int, top_k: int, num_experts: int, gen: torch.Generator):
    ids = torch.argsort(torch.rand(num_tokens, num_experts, generator=gen), dim=1)[:, :top_k].to(torch.int32)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return weights, ids


def _config(block_m: int, block_k: int = 32) -> ExpertsConfig:
    tiles = GemmTiles(block_n=32, block_k=block_k, group_m=2, num_warps=4, num_stages=1)
    return ExpertsConfig(block_m=block_m, gemm1=tiles, gemm2=tiles)


def _run(x, w13, w2, weights, ids, *, activation="silu", num_valid=None, health=None, workspace=None,
         out=None, config=None):
    if not isinstance(num_valid, NumValid):
        num_valid = NumValid(x.shape[0] if num_valid is None else num_valid, None)
    return experts_triton(x, w13, w2, weights, ids, activation=activation, num_valid=num_valid, health=health,
                          workspace=workspace, out=out, config=config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation", ["silu", "gelu", "swigluoai"])
def test_matches_reference(dtype: torch.dtype, activation: str) -> None:
    gen = torch.Generator().manual_seed(7)
    num_tokens, num_experts, top_k, hidden, inter = 45, 8, 2, 64, 48  # I not a multiple of BLOCK_N
    w13, w2 = _weights(num_experts, hidden, inter, dtype, gen)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    weights, ids = _routing(num_tokens, top_k, num_experts, gen)
    out = _run(x, w13, w2, weights, ids, activation=activation, out=poisoned(x.shape, dtype))
    assert_close(out, experts_reference(x, w13, w2, weights, ids, activation=activation), what=activation)


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
@pytest.mark.parametrize("tma", [False, True])
def test_block_sizes_and_k_tails(block_m: int, tma: bool) -> None:
    """Every BLOCK_M, H not a multiple of BLOCK_K (masked K tail) and I not a multiple of BLOCK_N,
    weights through pointers and through TMA descriptors (zero-filled past H)."""
    gen = torch.Generator().manual_seed(block_m)
    num_tokens, num_experts, top_k, hidden, inter = 70, 4, 2, 80, 40
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32, gen)
    x = torch.randn(num_tokens, hidden, generator=gen)
    weights, ids = _routing(num_tokens, top_k, num_experts, gen)
    tiles = GemmTiles(block_n=32, block_k=64, group_m=2, num_warps=4, num_stages=1, tma=tma)
    out = _run(x, w13, w2, weights, ids, config=ExpertsConfig(block_m, tiles, tiles))
    assert_close(out, experts_reference(x, w13, w2, weights, ids))


@pytest.mark.parametrize("num_valid", [0, 1, 8, 9, 299])
def test_small_batch_tiles_in_a_large_batch(num_valid: int) -> None:
    """num_valid <= 8 in a batch whose own tiles differ: the small-batch layout and GEMMs run (the
    main ones find no M-block), chosen on the device; results match either way."""
    from safemoe.kernels.experts import SMALL_BATCH_TOKENS

    gen = torch.Generator().manual_seed(num_valid)
    num_tokens, num_experts, top_k, hidden, inter = 300, 8, 2, 32, 32
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32, gen)
    x = torch.randn(num_tokens, hidden, generator=gen)
    weights, ids = _routing(num_tokens, top_k, num_experts, gen)
    x[num_valid:] = math.nan
    ids[num_valid:] = garbage_ids(num_tokens - num_valid, top_k, num_experts, generator=gen)
    ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.float32, "cpu")
    out = _run(x, w13, w2, weights, ids, num_valid=NumValid(None, torch.tensor(num_valid)), workspace=ws,
               out=poisoned(x.shape, torch.float32))
    expected = experts_reference(x, w13, w2, weights, ids, num_valid=NumValid(num_valid, None))
    assert_close(out, expected)
    assert_equal(out[num_valid:], torch.zeros_like(out[num_valid:]))
    blocks = ws.views(num_tokens, num_experts, top_k, hidden, inter).num_blocks
    small = num_valid <= SMALL_BATCH_TOKENS
    assert (int(blocks[1]) > 0) == (small and num_valid > 0) and (int(blocks[0]) > 0) == (not small)


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 7, 17, 127, 128, 129, 255, 256, 257])
def test_boundaries(num_tokens: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    num_experts, top_k, hidden, inter = 8, 2, 32, 32
    w13, w2 = _weights(num_experts, hidden, inter, torch.float16, gen)
    x = torch.randn(num_tokens, hidden, generator=gen).half()
    weights, ids = _routing(num_tokens, top_k, num_experts, gen)
    out = _run(x, w13, w2, weights, ids, out=poisoned(x.shape, torch.float16))
    assert_close(out, experts_reference(x, w13, w2, weights, ids))


@pytest.mark.parametrize("num_tokens", [4095, 4096, 4097])
def test_large_boundaries_tiny_dims(num_tokens: int) -> None:
    """Past one dispatch chunk (T*K > 4096): separate scatter launch, many M-blocks per program."""
    gen = torch.Generator().manual_seed(num_tokens)
    num_experts, top_k, hidden, inter = 4, 2, 16, 16
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32, gen)
    x = torch.randn(num_tokens, hidden, generator=gen)
    weights, ids = _routing(num_tokens, top_k, num_experts, gen)
    cfg = ExpertsConfig(block_m=128, gemm1=GemmTiles(16, 16, 8, 4, 1), gemm2=GemmTiles(16, 16, 8, 4, 1))
    out = _run(x, w13, w2, weights, ids, num_valid=num_tokens - 1, out=poisoned(x.shape, torch.float32),
               config=cfg)
    expected = experts_reference(x, w13, w2, weights, ids, num_valid=NumValid(num_tokens - 1, None))
    assert_close(out, expected)


def test_zero_tokens() -> None:
    w13, w2 = _weights(4, 16, 16, torch.float32, torch.Generator().manual_seed(0))
    x = torch.zeros(0, 16)
    out = _run(x, w13, w2, torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int32))
    assert out.shape == (0, 16)


def test_garbage_ids_via_public_api() -> None:
    """Stale, duplicate, -1, negative and >= E ids: dropped ones counted exactly, duplicates served."""
    gen = torch.Generator().manual_seed(11)
    num_tokens, num_experts, top_k, hidden, inter = 50, 6, 4, 32, 32
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32, gen)
    x = torch.randn(num_tokens, hidden, generator=gen)
    ids = garbage_ids(num_tokens, top_k, num_experts, generator=gen)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    health = new_health_tensor()
    routing = safemoe.Routing(weights=weights, ids=ids)
    out = safemoe.experts(x, w13, w2, routing, backend="triton", health=health, num_valid=45)
    nv = NumValid(45, None)
    assert_close(out, experts_reference(x, w13, w2, weights, ids, num_valid=nv))
    assert int(health[DROPPED_SLOTS]) == dispatch_reference(ids, num_experts, nv).dropped > 0


def test_all_tokens_to_one_expert() -> None:
    gen = torch.Generator().manual_seed(12)
    num_tokens, num_experts, hidden, inter = 150, 8, 32, 32
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32, gen)
    x = torch.randn(num_tokens, hidden, generator=gen)
    ids = torch.full((num_tokens, 1), 3, dtype=torch.int32)
    weights = torch.rand(num_tokens, 1, generator=gen)
    out = _run(x, w13, w2, weights, ids, config=_config(64))
    assert_close(out, experts_reference(x, w13, w2, weights, ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_padding_isolation_bitwise(dtype: torch.dtype) -> None:
    """Real rows are bitwise identical whatever the padding rows hold; padded rows are exact zeros."""
    gen = torch.Generator().manual_seed(13)
    num_tokens, valid, num_experts, top_k, hidden, inter = 40, 23, 8, 2, 32, 32
    w13, w2 = _weights(num_experts, hidden, inter, dtype, gen)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    weights, ids = _routing(num_tokens, top_k, num_experts, gen)
    clean_x, clean_w, clean_ids = x.clone(), weights.clone(), ids.clone()
    clean_x[valid:], clean_w[valid:], clean_ids[valid:] = 0, 0, -1
    dirty_x, dirty_w, dirty_ids = x.clone(), weights.clone(), ids.clone()
    dirty_x[valid:], dirty_w[valid:] = math.nan, math.nan
    dirty_ids[valid:] = garbage_ids(num_tokens - valid, top_k, num_experts, generator=gen)
    dirty_ids[valid::3] = STALE_ID
    ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, dtype, "cpu")
    clean = _run(clean_x, w13, w2, clean_w, clean_ids, num_valid=valid, workspace=ws)
    dirty = _run(dirty_x, w13, w2, dirty_w, dirty_ids, num_valid=NumValid(None, torch.tensor(valid)),
                 out=poisoned(x.shape, dtype), workspace=ws)
    assert_equal(dirty[:valid], clean[:valid], what="real rows")
    assert_equal(dirty[valid:], torch.zeros_like(dirty[valid:]), what="padded rows")
    # the real rows alone (T = num_valid, no padding at all) give the same bits too
    alone = _run(x[:valid].contiguous(), w13, w2, weights[:valid].contiguous(), ids[:valid].contiguous(),
                 config=ExpertsConfig.from_json(_default_cfg_json(num_tokens, num_experts, top_k)))
    assert_equal(alone, clean[:valid], what="T=num_valid vs padded T")


def _default_cfg_json(num_tokens: int, num_experts: int, top_k: int) -> dict:
    from safemoe.configs import get_config

    return get_config(num_tokens, num_experts, 32, 32, top_k, torch.float32, torch.device("cpu")).to_json()


def test_num_valid_zero_writes_zeros() -> None:
    gen = torch.Generator().manual_seed(14)
    w13, w2 = _weights(4, 32, 32, torch.float32, gen)
    x = torch.full((9, 32), math.nan)
    ids = torch.full((9, 2), STALE_ID, dtype=torch.int32)
    weights = torch.full((9, 2), math.nan)
    out = _run(x, w13, w2, weights, ids, num_valid=NumValid(None, torch.tensor(0)),
               out=poisoned((9, 32), torch.float32))
    assert_equal(out, torch.zeros_like(out))


def test_poisoned_workspace_and_sharing() -> None:
    """A NaN/stale workspace gives the same bits as a fresh one; one workspace serves two layer shapes."""
    gen = torch.Generator().manual_seed(15)
    ws = Workspace(64, 8, 2, 64, 64, torch.float32, "cpu")
    views = ws.views(64, 8, 2, 64, 64)
    views.intermediate.fill_(math.nan)
    views.y.fill_(math.nan)
    views.sorted_slots.fill_(STALE_ID)
    views.block_end.fill_(STALE_ID)
    views.cursor.fill_(-STALE_ID)
    for num_tokens, num_experts, hidden, inter in ((64, 8, 64, 64), (20, 6, 32, 48), (64, 8, 64, 64)):
        w13, w2 = _weights(num_experts, hidden, inter, torch.float32, gen)
        x = torch.randn(num_tokens, hidden, generator=gen)
        weights, ids = _routing(num_tokens, 2, num_experts, gen)
        shared = _run(x, w13, w2, weights, ids, workspace=ws)
        fresh = _run(x, w13, w2, weights, ids)
        assert_equal(shared, fresh)
        assert_close(shared, experts_reference(x, w13, w2, weights, ids))


def test_workspace_validation() -> None:
    ws = Workspace(16, 8, 2, 32, 32, torch.float32, "cpu")
    assert ws.nbytes == workspace_bytes(16, 8, 2, 32, 32, torch.float32)
    gen = torch.Generator().manual_seed(16)
    w13, w2 = _weights(8, 32, 32, torch.float32, gen)
    weights, ids = _routing(17, 2, 8, gen)
    with pytest.raises(ValueError, match="T <= 16"):
        _run(torch.randn(17, 32), w13, w2, weights, ids, workspace=ws)
    with pytest.raises(TypeError, match="dtype"):
        _run(torch.randn(4, 32).half(), w13.half(), w2.half(), weights[:4], ids[:4], workspace=ws)
    w13_big, w2_big = _weights(8, 64, 32, torch.float32, gen)
    with pytest.raises(ValueError, match="H <= 32"):
        _run(torch.randn(4, 64), w13_big, w2_big, weights[:4], ids[:4], workspace=ws)
    with pytest.raises(ValueError, match="positive int"):
        Workspace(0, 8, 2, 32, 32, torch.float32, "cpu")
    with pytest.raises(ValueError, match="out must be"):
        _run(torch.randn(4, 32), w13, w2, weights[:4], ids[:4], out=torch.empty(4, 31))


def test_deterministic_run_to_run() -> None:
    gen = torch.Generator().manual_seed(17)
    w13, w2 = _weights(8, 64, 64, torch.float16, gen)
    x = torch.randn(100, 64, generator=gen).half()
    weights, ids = _routing(100, 4, 8, gen)
    first = _run(x, w13, w2, weights, ids)
    assert_equal(_run(x, w13, w2, weights, ids), first)
