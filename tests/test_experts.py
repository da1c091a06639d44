"""Expert kernels (kernels/experts.py + combine.py) against reference.experts_reference, on every
device: under the Triton interpreter on CPU (fp32 and fp16, H and I <= 128, small E) and compiled
on a GPU (bf16 at small and real model shapes, CUDA-graph replay with a changed device num_valid,
PDL and TMA, int64 addressing past 2^31, token-count boundaries, determinism).

Outputs and workspaces are poisoned beforehand so any element read before it was written shows up
as NaN. Cases on both devices draw their inputs per device (`_draw`) and compare per device
(`_assert_matches`): elementwise within the dtype's tolerance on the interpreter, relative
Frobenius error on the GPU (bf16, other accumulation orders).

Cases marked `memcheck` use small shapes only, so their cuda variants also run under
compute-sanitizer (tests/memcheck.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch

import safemoe
from helpers import (
    INTERPRETER,
    STALE_ID,
    assert_close,
    assert_equal,
    by_device,
    capture_graph,
    case_id,
    garbage_ids,
    interpreter_only,
    poisoned,
    run_compiled,
)
from safemoe._checks import NumValid, check_num_valid
from safemoe.configs import ExpertsConfig, GemmTiles
from safemoe.health import DROPPED_SLOTS, new_health_tensor
from safemoe.kernels.experts import experts_triton
from safemoe.reference import dispatch_reference, experts_reference, moe_reference
from safemoe.routing import Routing
from safemoe.workspace import Workspace, workspace_bytes

# (E, K, H, I, activation)
MODEL_SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768, "silu"),
    "mixtral-8x7b": (8, 2, 4096, 14336, "silu"),
    "gpt-oss-120b": (128, 4, 2880, 2880, "swigluoai"),
    "deepseek-v3": (256, 8, 7168, 2048, "silu"),
}
# Not compiled yet: elementwise fp32/fp16 tolerances and layouts measured on the interpreter; the
# cuda variants of the cases above cover the same contract in bf16.
INTERPRETER_ONLY = "elementwise fp32/fp16 tolerances as measured on the interpreter"


def _weights(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, gen: torch.Generator):
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / math.sqrt(hidden)).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / math.sqrt(inter)).to(dtype)
    return w13, w2


def _routing(num_tokens: int, top_k: int, num_experts: int, gen: torch.Generator):
    ids = torch.argsort(torch.rand(num_tokens, num_experts, generator=gen), dim=1)[:, :top_k].to(torch.int32)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return weights, ids


def _gpu_weights(num_experts: int, hidden: int, inter: int, dtype=torch.bfloat16, seed: int = 0):
    """Drawn on the GPU in the weights' dtype (real model shapes: no fp32 copy of them)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda", dtype=dtype, generator=gen)
    w13.mul_(1.0 / math.sqrt(hidden))
    w2 = torch.randn(num_experts, hidden, inter, device="cuda", dtype=dtype, generator=gen)
    w2.mul_(1.0 / math.sqrt(inter))
    return w13, w2


def _gpu_routing(num_tokens: int, top_k: int, num_experts: int, seed: int = 1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, device="cuda", generator=gen)
    ids = torch.topk(scores, top_k, dim=1).indices.to(torch.int32)
    weights = torch.rand(num_tokens, top_k, device="cuda", generator=gen)
    return weights, ids


def _draw(device: str, num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
          dtype: torch.dtype, seed: int):
    """(x, w13, w2, weights, ids). cpu: one CPU generator seeded `seed`; cuda: drawn on the GPU
    (weights seed 0, x from the global RNG, routing seed `seed`)."""
    if device == "cpu":
        gen = torch.Generator().manual_seed(seed)
        w13, w2 = _weights(num_experts, hidden, inter, dtype, gen)
        x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
        weights, ids = _routing(num_tokens, top_k, num_experts, gen)
        return x, w13, w2, weights, ids
    w13, w2 = _gpu_weights(num_experts, hidden, inter, dtype)
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=dtype)
    weights, ids = _gpu_routing(num_tokens, top_k, num_experts, seed=seed)
    return x, w13, w2, weights, ids


def _nv(value, num_tokens: int, device: torch.device | str) -> NumValid:
    if isinstance(value, NumValid):
        return value
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return check_num_valid(value, num_tokens, device)


def _config(block_m: int, block_k: int = 32) -> ExpertsConfig:
    tiles = GemmTiles(block_n=32, block_k=block_k, group_m=2, num_warps=4, num_stages=1)
    return ExpertsConfig(block_m=block_m, gemm1=tiles, gemm2=tiles)


def _run(x, w13, w2, weights, ids, *, activation="silu", num_valid=None, health=None, workspace=None,
         out=None, config=None, small_config=None):
    """experts_triton; num_valid None, an int, a device tensor or a NumValid."""
    return experts_triton(x, w13, w2, weights, ids, activation=activation,
                          num_valid=_nv(num_valid, x.shape[0], x.device), health=health,
                          workspace=workspace, out=out, config=config, small_config=small_config)


def _reference(x, w13, w2, weights, ids, *, activation="silu", num_valid=None):
    return experts_reference(x, w13, w2, weights, ids, activation=activation,
                             num_valid=_nv(num_valid, x.shape[0], x.device))


def _check_rel(out: torch.Tensor, ref: torch.Tensor, what: str, tol: float = 1e-2) -> float:
    """Frobenius-relative error below tol, nothing non-finite, worst element within 4 tol of max|ref|."""
    assert bool(torch.isfinite(out).all()), f"{what}: non-finite output"
    diff = out.float() - ref.float()
    rel = float(diff.norm() / ref.float().norm().clamp_min(1e-30))
    worst = float(diff.abs().max() / ref.float().abs().max().clamp_min(1e-30))
    assert rel < tol and worst < 4 * tol, f"{what}: rel error {rel:.3g}, worst {worst:.3g} of max|ref|"
    return rel


def _assert_matches(device: str, out: torch.Tensor, ref: torch.Tensor, what: str = "",
                    gpu_tol: float = 1e-2) -> None:
    """cpu: every element within the dtype's tolerance; cuda: relative error below gpu_tol."""
    if device == "cpu":
        assert_close(out, ref, what=what)
    else:
        _check_rel(out, ref, what, tol=gpu_tol)


# ---------------------------------------------------------------------------------------------
# Every device (shapes per device)
# ---------------------------------------------------------------------------------------------

# (T, E, K, H, I): I not a multiple of BLOCK_N on the interpreter; K tails and N tails compiled.
ACTIVATION_SHAPES = {"cpu": (45, 8, 2, 64, 48), "cuda": (50, 8, 2, 96, 80)}
GPU_TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.mark.memcheck
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=case_id)
@pytest.mark.parametrize("activation", ["silu", "gelu", "swigluoai"])
def test_matches_reference(device: str, dtype: torch.dtype, activation: str) -> None:
    num_tokens, num_experts, top_k, hidden, inter = ACTIVATION_SHAPES[device]
    x, w13, w2, weights, ids = _draw(device, num_tokens, num_experts, top_k, hidden, inter, dtype, seed=7)
    out = _run(x, w13, w2, weights, ids, activation=activation, out=poisoned(x.shape, dtype, device))
    ref = _reference(x, w13, w2, weights, ids, activation=activation)
    _assert_matches(device, out, ref, f"{activation} {dtype}", gpu_tol=GPU_TOL[dtype])


# (E, K, H, I, dtype) per device
BOUNDARY_SHAPES = {"cpu": (8, 2, 32, 32, torch.float16), "cuda": (16, 4, 128, 64, torch.bfloat16)}


@pytest.mark.memcheck
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 7, 17, 127, 128, 129, 255, 256, 257])
def test_boundaries(device: str, num_tokens: int) -> None:
    num_experts, top_k, hidden, inter, dtype = BOUNDARY_SHAPES[device]
    x, w13, w2, weights, ids = _draw(device, num_tokens, num_experts, top_k, hidden, inter, dtype,
                                     seed=num_tokens)
    out = _run(x, w13, w2, weights, ids, out=poisoned(x.shape, dtype, device))
    _assert_matches(device, out, _reference(x, w13, w2, weights, ids), f"T={num_tokens}")


# Past one dispatch chunk (T*K > 4096): separate scatter launch, many M-blocks per program. Per
# device: (E, K, H, I, dtype, config, padded rows, num_valid as a device tensor).
_TINY_TILES = ExpertsConfig(block_m=128, gemm1=GemmTiles(16, 16, 8, 4, 1), gemm2=GemmTiles(16, 16, 8, 4, 1))
LARGE_T_SHAPES = {
    "cpu": (4, 2, 16, 16, torch.float32, _TINY_TILES, 1, False),
    "cuda": (64, 4, 256, 128, torch.bfloat16, None, 2, True),
}


@pytest.mark.parametrize(("device", "num_tokens"), by_device(
    cpu=[4095, 4096, 4097], cuda=[4095, 4096, 4097, 65535, 65536, 65537]))
def test_token_boundaries(device: str, num_tokens: int) -> None:
    """T around one dispatch chunk (and 2^16 compiled); NaN padding rows come out exact zeros."""
    num_experts, top_k, hidden, inter, dtype, config, padded, as_tensor = LARGE_T_SHAPES[device]
    x, w13, w2, weights, ids = _draw(device, num_tokens, num_experts, top_k, hidden, inter, dtype,
                                     seed=num_tokens)
    valid = num_tokens - padded
    x[valid:] = math.nan
    num_valid = torch.tensor(valid, device=device) if as_tensor else valid
    out = _run(x, w13, w2, weights, ids, num_valid=num_valid, out=poisoned(x.shape, dtype, device),
               config=config)
    ref = _reference(x, w13, w2, weights, ids, num_valid=valid)
    _assert_matches(device, out[:valid], ref[:valid], f"T={num_tokens}")
    assert_equal(out[valid:], torch.zeros_like(out[valid:]))


# (E, H, I, dtype) per device
ZERO_SHAPES = {"cpu": (4, 32, 32, torch.float32), "cuda": (8, 64, 32, torch.bfloat16)}


@pytest.mark.memcheck
def test_zero_tokens_and_zero_valid(device: str) -> None:
    """T = 0 returns [0, H]; num_valid = 0 (a device tensor) writes zeros over NaN inputs and
    stale ids."""
    num_experts, hidden, inter, dtype = ZERO_SHAPES[device]
    _, w13, w2, _, _ = _draw(device, 0, num_experts, 2, hidden, inter, dtype, seed=14)
    x = torch.zeros(0, hidden, dtype=dtype, device=device)
    empty_w, empty_ids = torch.zeros(0, 2, device=device), torch.zeros(0, 2, dtype=torch.int32, device=device)
    assert _run(x, w13, w2, empty_w, empty_ids).shape == (0, hidden)
    x = torch.full((9, hidden), math.nan, dtype=dtype, device=device)
    ids = torch.full((9, 2), STALE_ID, dtype=torch.int32, device=device)
    weights = torch.full((9, 2), math.nan, device=device)
    out = _run(x, w13, w2, weights, ids, num_valid=torch.tensor(0, device=device),
               out=poisoned((9, hidden), dtype, device))
    assert_equal(out, torch.zeros_like(out))


# (T, E, K, H, I, dtype, runs after the first) per device
DETERMINISM_SHAPES = {"cpu": (100, 8, 4, 64, 64, torch.float16, 1), "cuda": (700, 32, 4, 256, 128,
                                                                            torch.bfloat16, 4)}


@pytest.mark.memcheck
def test_deterministic_run_to_run(device: str) -> None:
    num_tokens, num_experts, top_k, hidden, inter, dtype, again = DETERMINISM_SHAPES[device]
    x, w13, w2, weights, ids = _draw(device, num_tokens, num_experts, top_k, hidden, inter, dtype, seed=17)
    first = _run(x, w13, w2, weights, ids)
    for _ in range(again):
        assert_equal(_run(x, w13, w2, weights, ids), first, what="run to run")


@pytest.mark.parametrize("with_workspace", [False, True])
def test_more_slots_than_experts(device: str, with_workspace: bool) -> None:
    """K > E is legal input to `experts`: duplicate ids are each served (contract, docs/contract.md
    section 2). A Workspace used to reject it; the H200 check run of 2026-11-21 found that."""
    gen = torch.Generator().manual_seed(7)
    num_tokens, num_experts, top_k, hidden, inter = 5, 3, 5, 16, 16
    x = torch.randn(num_tokens, hidden, generator=gen).half().to(device)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / 4).half().to(device)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / 4).half().to(device)
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen, dtype=torch.int32).to(device)
    routing = Routing(weights=torch.rand(num_tokens, top_k, generator=gen).to(device), ids=ids)
    workspace = None
    if with_workspace:
        workspace = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.float16, device)
    out = safemoe.experts(x, w13, w2, routing, num_valid=4, backend="triton", workspace=workspace)
    want = safemoe.experts(x, w13, w2, routing, num_valid=4, backend="reference")
    assert_close(out, want, what="K > E")
    assert torch.equal(out[4], torch.zeros_like(out[4]))


# ---------------------------------------------------------------------------------------------
# Interpreter only
# ---------------------------------------------------------------------------------------------


@interpreter_only(INTERPRETER_ONLY)
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


@interpreter_only(INTERPRETER_ONLY)
@pytest.mark.parametrize(("block_m", "tma"), [(16, False), (32, True)])
def test_swapped_product_matches_the_reference(block_m: int, tma: bool) -> None:
    """GemmTiles.swap_ab (each K step as W^T x^T into a transposed accumulator) on both GEMMs,
    with a K tail and I not a multiple of BLOCK_N: the reference's result, padded rows exact zeros,
    a NaN row in its row only. The small-batch tiles beside it stay unswapped."""
    gen = torch.Generator().manual_seed(block_m)
    num_tokens, num_experts, top_k, hidden, inter = 70, 4, 2, 80, 40
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32, gen)
    x = torch.randn(num_tokens, hidden, generator=gen)
    x[5] = math.nan
    x[60:] = math.nan
    weights, ids = _routing(num_tokens, top_k, num_experts, gen)
    tiles = GemmTiles(block_n=32, block_k=64, group_m=2, num_warps=4, num_stages=1, tma=tma, swap_ab=True)
    out = _run(x, w13, w2, weights, ids, config=ExpertsConfig(block_m, tiles, tiles),
               num_valid=NumValid(60, None), out=poisoned(x.shape, torch.float32))
    expected = experts_reference(x, w13, w2, weights, ids, num_valid=NumValid(60, None))
    rows = torch.ones(num_tokens, dtype=torch.bool)
    rows[5] = False
    assert_close(out[rows], expected[rows])
    assert_equal(out[60:], torch.zeros_like(out[60:]))
    assert bool(torch.isnan(out[5]).all())


@interpreter_only(INTERPRETER_ONLY)
@pytest.mark.parametrize("num_valid", [0, 1, 4, 5, 8, 9, 299])
def test_small_batch_tiles_in_a_large_batch(num_valid: int) -> None:
    """num_valid <= 8 in a batch whose own tiles differ: the small-batch layout and GEMMs run (the
    main ones find no M-block), chosen on the device; num_valid * K <= FEW_SLOTS: the few-slot path,
    no layout at all; results match in every regime."""
    from safemoe.kernels.experts import FEW_SLOTS, SMALL_BATCH_TOKENS

    gen = torch.Generator().manual_seed(num_valid)
    num_tokens, num_experts, top_k, hidden, inter = 300, 8, 4, 32, 32
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
    few = num_valid * top_k <= FEW_SLOTS
    small = num_valid <= SMALL_BATCH_TOKENS and not few
    assert (int(blocks[1]) > 0) == small and (int(blocks[0]) > 0) == (not small and not few)


def test_experts_config_rejects_bad_fields() -> None:
    """A config a caller builds (config=, small_config=) is checked when it is made."""
    tiles = GemmTiles(block_n=32, block_k=32)
    with pytest.raises(ValueError, match="block_m must be one of"):
        ExpertsConfig(24, tiles, tiles)
    with pytest.raises(ValueError, match=r"gemm2.block_k must be a power of two >= 16, got 48"):
        ExpertsConfig(16, tiles, GemmTiles(block_n=32, block_k=48))
    with pytest.raises(TypeError, match="one_launch must be a bool, got str"):
        ExpertsConfig(16, tiles, tiles, one_launch="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"gemm1\.interleave must be a bool, got int"):
        ExpertsConfig(16, GemmTiles(block_n=32, block_k=32, interleave=1), tiles)  # type: ignore[arg-type]
    assert ExpertsConfig.from_json(ExpertsConfig(16, tiles, tiles, one_launch=True).to_json()).one_launch
    with pytest.raises(ValueError, match=r"gemm1\.swap_ab is for the Triton tile loop without interleave"):
        ExpertsConfig(16, GemmTiles(block_n=32, block_k=32, interleave=True, swap_ab=True), tiles)
    with pytest.raises(TypeError, match=r"gemm2\.swap_ab must be a bool, got int"):
        ExpertsConfig(16, tiles, GemmTiles(block_n=32, block_k=32, swap_ab=1))  # type: ignore[arg-type]
    # written to JSON only when set (tables written before the field stay as they were)
    assert "swap_ab" not in ExpertsConfig(16, tiles, tiles).to_json()["gemm1"]
    swapped = ExpertsConfig(16, tiles, GemmTiles(block_n=64, block_k=32, swap_ab=True))
    assert ExpertsConfig.from_json(swapped.to_json()) == swapped


def test_gemm2_engine_config_and_interpreter_fallback() -> None:
    """GemmTiles.engine: refused with the field named where the Gluon GEMM2 cannot run the tiles,
    written to JSON only when set, and on the CPU interpreter (no Gluon there) the same bits as
    the Triton engine with the same tiles."""
    import dataclasses

    plain = GemmTiles(block_n=256, block_k=64, group_m=2, num_warps=8, num_stages=2)
    gemm1 = GemmTiles(block_n=32, block_k=32, group_m=2, num_stages=1)
    with pytest.raises(ValueError, match=r"gemm1\.engine must be 'triton'"):
        ExpertsConfig(128, dataclasses.replace(gemm1, engine="ws"), plain)
    with pytest.raises(ValueError, match=r"gemm2\.engine must be one of"):
        ExpertsConfig(128, gemm1, dataclasses.replace(plain, engine="cutlass"))
    with pytest.raises(ValueError, match="runs block_m 128, 8 warps"):
        ExpertsConfig(64, gemm1, dataclasses.replace(plain, engine="ws"))
    with pytest.raises(ValueError, match="runs block_m 128, 8 warps"):
        ExpertsConfig(128, gemm1, dataclasses.replace(plain, engine="ws", num_warps=4))
    with pytest.raises(ValueError, match=r"do not fit an SM's shared memory"):
        ExpertsConfig(128, gemm1, dataclasses.replace(plain, engine="ws_store", num_stages=4))
    gluon = ExpertsConfig(128, gemm1, dataclasses.replace(plain, engine="ws_store"))
    assert ExpertsConfig.from_json(gluon.to_json()) == gluon
    triton_cfg = ExpertsConfig(128, gemm1, plain)
    assert "engine" not in triton_cfg.to_json()["gemm2"]
    if not INTERPRETER:
        return
    gen = torch.Generator().manual_seed(67)
    num_tokens, num_experts, top_k, hidden, inter = 40, 4, 2, 48, 40
    w13, w2 = _weights(num_experts, hidden, inter, torch.float16, gen)
    x = torch.randn(num_tokens, hidden, generator=gen).half()
    weights, ids = _routing(num_tokens, top_k, num_experts, gen)
    got, expected = (_run(x, w13, w2, weights, ids, num_valid=30, config=cfg) for cfg in (gluon, triton_cfg))
    assert_equal(got, expected, what="engine ws_store on the interpreter")


@interpreter_only(INTERPRETER_ONLY)
@pytest.mark.parametrize("fused", [False, True], ids=["few-in-gemms", "fused-few-launch"])
def test_gemm2_engine_split_of_the_regimes(monkeypatch: pytest.MonkeyPatch, fused: bool) -> None:
    """How experts_triton runs a bucket whose GEMM2 is the Gluon engine, checked on the CPU with
    the engine stood in by a torch implementation of its contract (kernels/experts_ws.py: y[slot]
    = weight * row @ w2[expert].T for the used positions of the main layout's num_blocks[0]
    M-blocks, padding never stored): the engine over layout 0 and a Triton launch over layout 1
    for the small-batch and few-slot regimes give the Triton engine's results for num_valid 0 and
    1-4 (few-slot path), 5-8 (small-batch tiles), 9 and T (main layout), with NaN padding rows and
    a NaN-poisoned workspace; the engine ran once a call, finding no block outside the main layout.
    Also with `fused` few-slot tiles, whose launch then runs before the GEMMs (the bucket's tiles
    exceed 16 rows), as DeepSeek-V3 T = 8192 runs on the H200."""
    import dataclasses

    import safemoe.kernels.experts as experts_module

    blocks_seen: list[int] = []

    def contract(w2, weights, views, num_tokens, top_k, cfg) -> None:
        blocks = int(views.num_blocks[0])
        blocks_seen.append(blocks)
        for m_block in range(blocks):
            expert = int((views.block_end <= m_block).sum())
            positions = torch.arange(m_block * 128, (m_block + 1) * 128)
            slots = views.sorted_slots[positions].long()
            used = slots >= 0
            rows = views.intermediate[positions[used]].float() @ w2[expert].float().T
            views.y[slots[used]] = (rows * weights.flatten()[slots[used], None]).to(views.y.dtype)

    monkeypatch.setattr(experts_module, "ws_usable", lambda w2, views: True)
    monkeypatch.setattr(experts_module, "gemm2_ws_into", contract)
    fused_launches = _spy_fused_launches(monkeypatch)
    gen = torch.Generator().manual_seed(71)
    num_tokens, num_experts, top_k, hidden, inter = 40, 4, 4, 32, 48
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32, gen)
    x = torch.randn(num_tokens, hidden, generator=gen)
    weights, ids = _routing(num_tokens, top_k, num_experts, gen)
    main = ExpertsConfig(128, GemmTiles(block_n=32, block_k=32, group_m=2, num_stages=1),
                         GemmTiles(block_n=128, block_k=32, group_m=2, num_warps=8, num_stages=2))
    gluon = dataclasses.replace(main, gemm2=dataclasses.replace(main.gemm2, engine="ws"))
    small = _config(16)
    ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.float32, "cpu")
    views = ws.views(num_tokens, num_experts, top_k, hidden, inter)
    for count in (0, 1, 4, 5, 8, 9, num_tokens):
        padded = x.clone()
        padded[count:] = math.nan
        results = []
        for cfg in (main, gluon):
            views.intermediate.fill_(math.nan)
            views.y.fill_(math.nan)
            results.append(experts_triton(padded, w13, w2, weights, ids, activation="silu",
                                          num_valid=_nv(torch.tensor(count), num_tokens, "cpu"), health=None,
                                          workspace=ws, config=cfg, small_config=small,
                                          few_config=dataclasses.replace(small, fused=fused),
                                          out=poisoned(x.shape, torch.float32)))
        assert_close(results[1], results[0], what=f"Gluon engine stand-in, num_valid={count}")
        assert_equal(results[1][count:], torch.zeros_like(results[1][count:]))
        assert blocks_seen[-1] == (0 if count <= 8 else int(views.block_end[-1])), f"num_valid={count}"
    assert len(blocks_seen) == 7
    assert len(fused_launches) == (14 if fused else 0), "the fused few-slot launch before the GEMMs"


def _compile_gemm2_ws_for_sm90(engine: str) -> str:
    """PTX of the Gluon GEMM2 compiled for sm_90 with this Triton (no GPU needed; run outside the
    interpreter, which replaces Gluon functions)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from safemoe.kernels import experts_ws as ws

    inter_rows = torch.empty(1024, 768, dtype=torch.bfloat16)
    w2_rows = torch.empty(4 * 2048, 768, dtype=torch.bfloat16)
    layout = ws.gl.NVMMASharedLayout.get_default_for
    a_desc = ws.TensorDescriptor.from_tensor(inter_rows, [128, 64], layout([128, 64], ws.gl.bfloat16))
    b_desc = ws.TensorDescriptor.from_tensor(w2_rows, [256, 64], layout([256, 64], ws.gl.bfloat16))
    kernel = ws._gemm2_ws_kernel
    types = {"a_desc": mangle_type(a_desc), "b_desc": mangle_type(b_desc), "weights_ptr": "*fp32",
             "sorted_slots_ptr": "*i32", "block_end_ptr": "*i32", "num_blocks_ptr": "*i32",
             "y_ptr": "*bf16", "hidden": "i32", "inter": "i32", "num_experts": "i32"}
    constants = {"NUM_BINS": 8, "GROUP_M": 8, "STAGES": 3, "STORE_PARTITION": engine == "ws_store",
                 "PRODUCER_REGS": ws.PRODUCER_REGS, "STORE_WARPS": ws.STORE_WARPS,
                 "STORE_REGS": ws.STORE_REGS, "STORE_ROWS": ws.STORE_ROWS, "num_warps": ws.NUM_WARPS}
    signature = {**types, **dict.fromkeys(constants, "constexpr")}
    positions = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
    compiled = triton.compile(GluonASTSource(kernel, signature, positions), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": ws.NUM_WARPS, "maxnreg": ws.MAX_NREG})
    return compiled.asm["ptx"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the kernel (its own test)")
@pytest.mark.parametrize("engine", ["ws", "ws_store"])
def test_gemm2_gluon_kernel_compiles_for_sm90(engine: str) -> None:
    """The Gluon GEMM2 compiles for sm_90 with this Triton (PTX and ptxas, no GPU), so a change in
    Gluon's API shows on a CPU machine too (the GPU machine has another Triton): wgmma and the
    partitions' register hand-over (setmaxnreg) in the PTX."""
    try:
        import triton.experimental.gluon._runtime  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"this Triton has no Gluon compile entry point: {exc}")
    counts = "*(lambda ptx: (ptx.count('wgmma.mma_async'), ptx.count('setmaxnreg')))"
    stdout = run_compiled("test_experts", f"{counts}(m._compile_gemm2_ws_for_sm90({engine!r}))", timeout=600)
    wgmma, setmaxnreg = (int(v) for v in stdout.split()[-2:])
    assert wgmma >= 4 and setmaxnreg >= 2, stdout


def test_nearest_bucket_serves_within_one_octave() -> None:
    """A tuned table serves T from the nearest bucket to T's within one octave (ties to the
    smaller), else the heuristic does: the fp8 table of 2026-11-26 served T = 2048 with T = 1024's
    tiles and T = 4096 with T = 8192's until those buckets were tuned."""
    from safemoe.configs import nearest_bucket

    table = (1, 8, 64, 256, 1024, 8192)
    tokens = (1, 2, 3, 4, 5, 8, 100, 128, 2000, 2048, 4096, 16384, 40000)
    assert [nearest_bucket(t, table) for t in tokens] == [
        1, 1, 8, 8, 8, 8, 64, 64, 1024, 1024, 8192, 8192, None]
    assert nearest_bucket(512, (8, 8192)) is None and nearest_bucket(8, ()) is None
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="num_tokens must be an int >= 1"):
            nearest_bucket(bad, table)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"powers of two >= 1 \(token buckets\), got \[24, 0\]"):
        nearest_bucket(8, (8, 24, 0))
    # the answers are cached per (T's bucket, buckets): True == 1 and 8.0 == 8 must not hit them
    assert nearest_bucket(1, (1, 8)) == 1
    for aliased in ((True, 8), (1, 8.0)):
        with pytest.raises(ValueError, match="powers of two"):
            nearest_bucket(1, aliased)  # type: ignore[arg-type]


def test_heuristic_block_m_follows_the_tuned_tables() -> None:
    """The heuristic's BLOCK_M is the smallest block above the expected rows an expert, as the
    tuner found on both device tables: it matches the tuned BLOCK_M of at least 95% of the bf16
    entries and is never more than one step off (a shape without a table entry gets it)."""
    import json
    from pathlib import Path

    from safemoe.configs import heuristic_config

    tokens = (128, 256, 512, 1024, 2048)
    qwen3 = [heuristic_config(t, 128, 2048, 768, 8, torch.bfloat16).block_m for t in tokens]
    assert qwen3 == [16, 32, 64, 128, 128]  # 8, 16, 32, 64, 128 rows an expert
    assert heuristic_config(1024, 128, 2048, 768, 8, torch.bfloat16).few  # a decode bucket's padded steps
    assert not heuristic_config(2048, 128, 2048, 768, 8, torch.bfloat16).few
    tables = Path(safemoe.__file__).parent / "configs"
    pairs = []
    for path in sorted(tables.glob("NVIDIA_*.json")):
        for key, entries in json.loads(path.read_text())["configs"].items():
            if "fp8" in key or not key.endswith("bfloat16"):
                continue
            fields = key.split("_")
            num_experts, hidden, inter, top_k = (int(f[1:]) for f in fields[:4])
            for bucket, entry in entries.items():
                heuristic = heuristic_config(int(bucket), num_experts, hidden, inter, top_k, torch.bfloat16)
                pairs.append((path.name, key, bucket, entry["block_m"], heuristic.block_m))
    assert len(pairs) > 50
    off = [p for p in pairs if p[3] != p[4]]
    assert len(off) <= 0.05 * len(pairs), off
    assert all(max(t, h) == 2 * min(t, h) for *_, t, h in off), off


def test_shipped_small_batch_entries_serve_a_larger_bucket_and_differ_from_their_source() -> None:
    """Every top-level "small_batch" entry of a shipped device table is for a tabled shape, holds
    decode tiles that at least one of the shape's larger buckets runs as its small-batch tiles
    (BLOCK_M below that bucket's), and differs from the SMALL_BATCH_TOKENS bucket's entry it
    replaces as their source (else it pins nothing). The H200 table has one since 2026-12-02:
    gpt-oss, whose T = 8 entry took faster tiles that slowed T = 1024's 8-row step."""
    from pathlib import Path

    from safemoe.configs import load_device_configs, load_small_batch_configs, nearest_bucket
    from safemoe.kernels.experts import SMALL_BATCH_TOKENS

    pins = {}
    for path in sorted((Path(safemoe.__file__).parent / "configs").glob("NVIDIA_*.json")):
        device_name = path.stem.replace("_", " ")
        table = load_device_configs(device_name)
        for key, pin in load_small_batch_configs(device_name).items():
            pins[(device_name, key)] = pin
            assert key in table, (device_name, key)
            buckets = table[key]
            served = [b for b, cfg in buckets.items() if b > SMALL_BATCH_TOKENS and pin.block_m < cfg.block_m]
            assert served, (device_name, key, pin)
            source = buckets[nearest_bucket(SMALL_BATCH_TOKENS, buckets)]
            assert pin != source, (device_name, key)
    assert ("NVIDIA H200", "E128_H2880_I2880_K4_bfloat16") in pins


def test_heuristic_launch_flags_follow_the_tuned_tables() -> None:
    """PDL exactly where every tuned bf16 entry has it (buckets up to PDL_MAX_TOKENS, whose graphs
    replay padded decode steps), never on a device without it; TMA and the interleaved GEMM1 tile on
    the prefill tiles, as the tuned prefill entries carry them (the launchers fall back to pointer
    loads off Hopper)."""
    import json
    from pathlib import Path

    from safemoe.configs import PDL_MAX_TOKENS, heuristic_config
    from safemoe.kernels.launch import hopper_or_newer, pdl_usable

    tables = Path(safemoe.__file__).parent / "configs"
    checked = 0
    for path in sorted(tables.glob("NVIDIA_*.json")):
        for key, entries in json.loads(path.read_text())["configs"].items():
            if "fp8" in key or not key.endswith("bfloat16"):
                continue
            num_experts, hidden, inter, top_k = (int(f[1:]) for f in key.split("_")[:4])
            for bucket, entry in entries.items():
                heuristic = heuristic_config(int(bucket), num_experts, hidden, inter, top_k, torch.bfloat16)
                assert heuristic.pdl == entry.get("pdl", False), (path.name, key, bucket)
                assert heuristic.pdl == (int(bucket) <= PDL_MAX_TOKENS)
                checked += 1
    assert checked > 50
    prefill = heuristic_config(8192, 128, 2048, 768, 8, torch.bfloat16)
    assert prefill.gemm1.tma and prefill.gemm1.interleave and prefill.gemm2.tma and not prefill.few
    cpu = torch.device("cpu")
    assert not pdl_usable(cpu) and not hopper_or_newer(cpu)


def test_fp8_heuristic_follows_the_fp8_tables() -> None:
    """heuristic_fp8_config's BLOCK_M is the smallest block above the expected rows (128 from 96
    rows on), as the tuned fp8 entries of both device tables found (H200 tuned at every bucket
    from 8 to 8192 on 2026-12-01): it matches at least 90% of them and is never more than one step
    off. PDL up to PDL_MAX_TOKENS; decode and 32-row tiles take the swapped product; block mode's
    K steps stay inside one 128-wide scale group."""
    import json
    from pathlib import Path

    from safemoe.configs import PDL_MAX_TOKENS, heuristic_fp8_config

    qwen3 = [heuristic_fp8_config(t, 128, 2048, 768, 8, "block").block_m for t in (128, 256, 512, 1024, 2048)]
    assert qwen3 == [16, 32, 64, 64, 128]  # 8, 16, 32, 64, 128 rows an expert
    pairs = []
    tables = Path(safemoe.__file__).parent / "configs"
    for path in sorted(tables.glob("NVIDIA_*.json")):
        for key, entries in json.loads(path.read_text())["configs"].items():
            if "fp8" not in key:
                continue
            num_experts, hidden, inter, top_k = (int(f[1:]) for f in key.split("_")[:4])
            quant = key.split("_fp8-")[1]
            for bucket, entry in entries.items():
                cfg = heuristic_fp8_config(int(bucket), num_experts, hidden, inter, top_k, quant)
                pairs.append((path.name, key, bucket, entry["block_m"], cfg.block_m))
                assert cfg.pdl == (int(bucket) <= PDL_MAX_TOKENS)
                assert (cfg.gemm1.swap_ab, cfg.gemm2.swap_ab) == (cfg.block_m <= 32, cfg.block_m <= 32)
                if quant == "block":
                    assert max(cfg.gemm1.block_k, cfg.gemm2.block_k) <= 128, (key, bucket)
    assert len(pairs) >= 64
    off = [p for p in pairs if p[3] != p[4]]
    assert len(off) <= 0.1 * len(pairs), off
    assert all(max(t, h) == 2 * min(t, h) for *_, t, h in off), off


def test_few_slot_tiles_of_an_untabled_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """For a shape without a table, few-slot tiles compiled into a larger bucket's launch never
    raise its shared memory (a launch holds both paths' buffers: the heuristic's 64-row GEMM2,
    96 KB, would keep the decode tiles' 256-wide K steps at 2 stages instead of 3), and a 64-row
    bucket compiles lighter ones (LIGHT_FEW_BLOCK_M: `light_few_tiles`, 128-wide K steps).
    A tabled shape keeps the few-slot tiles it was tuned with; a bucket whose every batch takes the
    path runs its own tiles."""
    import dataclasses

    from safemoe.configs import few_tiles_within, gemm_shared_memory, heuristic_config
    from safemoe.kernels import experts as ex

    shape = (64, 2048, 1024, 8)  # OLMoE: 32 rows an expert at T = 256
    main = heuristic_config(256, *shape[:3], shape[3], torch.bfloat16)
    decode = heuristic_config(ex.few_slots_bucket(8), *shape[:3], shape[3], torch.bfloat16)
    assert main.block_m == 64 and decode.block_m == 16
    fitted = few_tiles_within(decode, main)
    assert fitted.gemm1 == decode.gemm1  # GEMM1's decode tiles already fit the main tiles' 160 KB
    assert (fitted.gemm2.num_stages, fitted.gemm2.block_k, fitted.gemm2.block_n) == (2, 256, 64)
    for gemm1, name in ((True, "gemm1"), (False, "gemm2")):
        own = gemm_shared_memory(getattr(main, name), main.block_m, 2, 2, gemm1)
        assert gemm_shared_memory(getattr(fitted, name), 16, 2, 2, gemm1) <= own
    assert few_tiles_within(fitted, main) is fitted  # already inside: the same object back
    assert few_tiles_within(decode, heuristic_config(8192, *shape[:3], shape[3], torch.bfloat16)) is decode

    monkeypatch.setattr(ex, "get_config", lambda *args, **kwargs: decode)
    cpu = torch.device("cpu")
    assert ex.LIGHT_FEW_BLOCK_M == 64
    light = ex.light_few_tiles(decode)
    assert (light.gemm1.block_k, light.gemm2.block_k, light.gemm1.num_stages, light.gemm2.num_stages) == (
        128, 128, 4, 4)
    assert (light.gemm1.block_n, light.gemm2.block_n) == (decode.gemm1.block_n, decode.gemm2.block_n)
    assert ex.light_few_tiles(light) is light  # already light: the same object back
    with pytest.raises(TypeError, match="few must be a safemoe ExpertsConfig"):
        ex.light_few_tiles(decode.gemm1)  # type: ignore[arg-type]
    narrow = dataclasses.replace(main, block_m=32)  # a 32-row bucket with the 64-row bucket's pipelines
    for tabled, in_64_rows, in_32_rows in ((False, few_tiles_within(light, main), fitted),
                                           (True, decode, decode)):
        monkeypatch.setattr(ex, "has_table", lambda *args, tabled=tabled, **kwargs: tabled)
        assert ex.few_slots_config(256, *shape[:3], shape[3], torch.bfloat16, cpu, main) == in_64_rows
        assert ex.few_slots_config(128, *shape[:3], shape[3], torch.bfloat16, cpu, narrow) == in_32_rows
        assert ex.few_slots_config(2, *shape[:3], shape[3], torch.bfloat16, cpu, decode) is decode


def test_fp8_heuristic_has_table_and_few_fit_reject_bad_arguments() -> None:
    """The configs helpers this change added name the bad argument before any lookup: an unknown
    fp8 mode, a non-device, a non-dtype, a size below 1, a non-config, an element size below 1."""
    from safemoe.configs import few_tiles_within, has_table, heuristic_config, heuristic_fp8_config

    with pytest.raises(ValueError, match="quant"):
        heuristic_fp8_config(64, 128, 2048, 768, 8, "int8")
    cpu = torch.device("cpu")
    assert has_table(128, 2048, 768, 8, torch.bfloat16, cpu) is False  # no table off CUDA
    with pytest.raises(TypeError, match="device"):
        has_table(128, 2048, 768, 8, torch.bfloat16, "cuda")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dtype"):
        has_table(128, 2048, 768, 8, "bfloat16", cpu)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="top_k"):
        has_table(128, 2048, 768, 0, torch.bfloat16, cpu)
    with pytest.raises(ValueError, match="quant"):
        has_table(128, 2048, 768, 8, torch.bfloat16, cpu, "int8")
    cfg = heuristic_config(256, 64, 2048, 1024, 8, torch.bfloat16)
    with pytest.raises(TypeError, match="few"):
        few_tiles_within({"block_m": 16}, cfg)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="main"):
        few_tiles_within(cfg, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="element_bytes"):
        few_tiles_within(cfg, cfg, 0)


HOPPER_SHARED = 232448  # opt-in shared memory a block: H100 / H200
A100_SHARED = 166912
ADA_SHARED = 101376  # L40S, RTX 4090


def test_heuristic_tiles_fit_the_shared_memory_of_smaller_cards() -> None:
    """The heuristic's tiles are Hopper-sized: fit_shared_memory leaves them alone at Hopper's limit
    (what heuristic_eval.py timed) and on an A100 or an Ada card lowers stages, then block_k, until
    the estimate fits, never touching block_m / block_n. Every tuned entry (which ran on its card)
    fits Hopper's budget under the same estimate, so the estimate does not over-trim."""
    import json
    from pathlib import Path

    from safemoe.configs import (
        SHARED_MEMORY_RESERVE,
        ExpertsConfig,
        fit_shared_memory,
        gemm_shared_memory,
        heuristic_config,
        heuristic_fp8_config,
    )

    def fits(cfg: ExpertsConfig, limit: int, element: int) -> bool:  # fp8: A tiles fp8 too
        return all(gemm_shared_memory(t, cfg.block_m, element, element, g1) <= limit - SHARED_MEMORY_RESERVE
                   for t, g1 in ((cfg.gemm1, True), (cfg.gemm2, False)))

    shapes = [(128, 2048, 768, 8), (8, 4096, 14336, 2), (256, 7168, 2048, 8), (60, 2048, 1408, 4)]
    trimmed = 0
    for num_experts, hidden, inter, top_k in shapes:
        for tokens in (1, 8, 64, 256, 512, 1024, 2048, 8192):
            heuristics = [(heuristic_config(tokens, num_experts, hidden, inter, top_k, torch.bfloat16), 2)]
            heuristics += [(heuristic_fp8_config(tokens, num_experts, hidden, inter, top_k, q), 1)
                           for q in ("per_tensor", "block")]
            for cfg, element in heuristics:
                assert fit_shared_memory(cfg, HOPPER_SHARED, element, element) == cfg
                for limit in (A100_SHARED, ADA_SHARED):
                    fitted = fit_shared_memory(cfg, limit, element, element)
                    assert fits(fitted, limit, element), (tokens, cfg, limit)
                    for old, new in ((cfg.gemm1, fitted.gemm1), (cfg.gemm2, fitted.gemm2)):
                        assert (new.block_n, fitted.block_m) == (old.block_n, cfg.block_m)
                        assert 2 <= new.num_stages <= old.num_stages and old.block_k % new.block_k == 0
                        assert new.block_k == old.block_k or new.num_stages == 2  # stages first
                    trimmed += fitted != cfg
    assert trimmed > 10
    prefill = heuristic_config(8192, 128, 2048, 768, 8, torch.bfloat16)
    assert fit_shared_memory(prefill, A100_SHARED).gemm1.num_stages == 3  # 196,608 -> 147,456 bytes
    tables = Path(safemoe.__file__).parent / "configs"
    for path in sorted(tables.glob("NVIDIA_*.json")):
        for key, entries in json.loads(path.read_text())["configs"].items():
            for bucket, entry in entries.items():
                element = 1 if "fp8" in key else 2
                assert fits(ExpertsConfig.from_json(entry), HOPPER_SHARED, element), (key, bucket)


def test_shared_memory_fit_rejects_bad_arguments() -> None:
    """Limits and element sizes are checked before any arithmetic; devices must be torch.devices."""
    from safemoe.configs import SHARED_MEMORY_RESERVE, fit_shared_memory, gemm_shared_memory, heuristic_config
    from safemoe.kernels.launch import hopper_or_newer, pdl_usable

    cfg = heuristic_config(8192, 128, 2048, 768, 8, torch.bfloat16)
    for limit in (0, -1, SHARED_MEMORY_RESERVE, 1.5e5, True, "227KB"):
        with pytest.raises(ValueError, match="limit"):
            fit_shared_memory(cfg, limit)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="x_bytes"):
        fit_shared_memory(cfg, HOPPER_SHARED, x_bytes=0)
    with pytest.raises(ValueError, match="weight_bytes"):
        gemm_shared_memory(cfg.gemm1, 128, 2, 0.5, True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_m"):
        gemm_shared_memory(cfg.gemm1, 0, 2, 2, True)
    for check in (hopper_or_newer, pdl_usable):
        with pytest.raises(TypeError, match=r"torch\.device"):
            check("cuda")  # type: ignore[arg-type]


def _main_and_small_tiles(one_launch: bool) -> tuple[ExpertsConfig, ExpertsConfig]:
    """Main and small-batch tiles for T = 24, H = 48, I = 40 that differ in every constexpr
    (BLOCK_M/N/K, GROUP_M, EVEN_K, TMA on one side only): block_k 16 divides H (EVEN_K), 32 does
    not; I = 40 is no multiple of any block_n."""
    main = ExpertsConfig(32, GemmTiles(block_n=32, block_k=16, group_m=2, num_stages=1),
                         GemmTiles(block_n=16, block_k=32, group_m=2, num_stages=1, tma=True),
                         one_launch=one_launch)
    small = ExpertsConfig(16, GemmTiles(block_n=16, block_k=32, group_m=1, num_stages=1, tma=True),
                          GemmTiles(block_n=64, block_k=16, group_m=1, num_stages=1))
    return main, small


@interpreter_only(INTERPRETER_ONLY)
@pytest.mark.parametrize("one_launch", [True, False], ids=["one-launch", "two-launches"])
def test_one_launch_serves_both_tile_regimes(one_launch: bool) -> None:
    """Main and small-batch tiles that differ in every constexpr (BLOCK_M/N/K, GROUP_M, EVEN_K, TMA
    on one side only), in ONE launch per GEMM (config.one_launch) or two: for num_valid = 0..T (a
    device tensor, one reused workspace, poisoned outputs) the result equals the reference and,
    bit for bit, a run with the tiles of the regime num_valid picks alone."""
    from safemoe.kernels.experts import SMALL_BATCH_TOKENS

    gen = torch.Generator().manual_seed(24)
    num_tokens, num_experts, top_k, hidden, inter = 24, 6, 2, 48, 40
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32, gen)
    x = torch.randn(num_tokens, hidden, generator=gen)
    weights, ids = _routing(num_tokens, top_k, num_experts, gen)
    main, small = _main_and_small_tiles(one_launch)
    ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.float32, "cpu")
    views = ws.views(num_tokens, num_experts, top_k, hidden, inter)
    nv = torch.tensor(0)
    for num_valid in range(num_tokens + 1):
        nv.fill_(num_valid)
        padded_x = x.clone()
        padded_x[num_valid:] = math.nan
        padded_ids = ids.clone()
        padded_ids[num_valid:] = STALE_ID
        out = experts_triton(padded_x, w13, w2, weights, padded_ids, activation="silu",
                             num_valid=NumValid(None, nv), health=None, workspace=ws,
                             out=poisoned(x.shape, torch.float32), config=main, small_config=small)
        is_small = num_valid <= SMALL_BATCH_TOKENS
        blocks = [int(b) for b in views.num_blocks]
        assert (blocks[1] > 0) == (is_small and num_valid > 0) and (blocks[0] > 0) == (not is_small), blocks
        alone = _run(padded_x, w13, w2, weights, padded_ids, num_valid=NumValid(None, nv),
                     out=poisoned(x.shape, torch.float32), config=small if is_small else main)
        assert_equal(out, alone, what=f"num_valid={num_valid}: one launch vs the regime's tiles alone")
        assert_close(out, experts_reference(x, w13, w2, weights, ids, num_valid=NumValid(num_valid, None)))
        assert_equal(out[num_valid:], torch.zeros_like(out[num_valid:]))


@interpreter_only(INTERPRETER_ONLY)
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


@interpreter_only(INTERPRETER_ONLY)
@pytest.mark.parametrize("num_tokens,top_k", [(1, 8), (2, 8), (4, 4), (8, 2), (1, 16), (3, 5)])
def test_few_slot_path_alone(num_tokens: int, top_k: int) -> None:
    """T*K <= FEW_SLOTS: every call takes the few-slot path, no dispatch launch (the workspace's
    block counts are left as they were). Garbage ids (duplicates served, -1, negative, >= E and
    stale dropped and counted once by GEMM1), every num_valid 0..T as a device tensor, NaN
    padding, poisoned outputs: equal to the reference, padded rows exact zeros."""
    from safemoe.kernels.experts import FEW_SLOTS

    assert num_tokens * top_k <= FEW_SLOTS
    gen = torch.Generator().manual_seed(num_tokens * 100 + top_k)
    num_experts, hidden, inter = 6, 48, 40
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32, gen)
    clean_x = torch.randn(num_tokens, hidden, generator=gen)
    ids = garbage_ids(num_tokens, top_k, num_experts, generator=gen)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.float32, "cpu")
    views = ws.views(num_tokens, num_experts, top_k, hidden, inter)
    views.num_blocks.fill_(7)
    nv = torch.tensor(0)
    for num_valid in range(num_tokens + 1):
        nv.fill_(num_valid)
        x = clean_x.clone()
        x[num_valid:] = math.nan
        health = new_health_tensor()
        out = _run(x, w13, w2, weights, ids, num_valid=NumValid(None, nv), health=health, workspace=ws,
                   out=poisoned(x.shape, torch.float32))
        expected = experts_reference(clean_x, w13, w2, weights, ids, num_valid=NumValid(num_valid, None))
        assert_close(out, expected, what=f"num_valid={num_valid}")
        assert_equal(out[num_valid:], torch.zeros_like(out[num_valid:]))
        dropped = dispatch_reference(ids, num_experts, NumValid(num_valid, None)).dropped
        assert int(health[DROPPED_SLOTS]) == dropped, f"num_valid={num_valid}"
    assert views.num_blocks.tolist() == [7, 7], "a few-slot bucket launched dispatch"


@interpreter_only(INTERPRETER_ONLY)
@pytest.mark.parametrize("one_launch", [True, False], ids=["one-launch", "two-launches"])
def test_few_slot_path_in_a_large_batch(one_launch: bool) -> None:
    """A batch of T = 24 (K = 2) with its own, small-batch and few-slot tiles, all different: for
    num_valid = 0..T (a device tensor, one reused workspace, duplicate and stale ids, NaN padding)
    the few-slot path runs exactly when num_valid * K <= FEW_SLOTS (no M-block in either layout),
    counts the dropped ids once, and equals, bit for bit, the same rows run as a batch of
    num_valid tokens with the few-slot tiles alone."""
    from safemoe.kernels.experts import FEW_SLOTS, SMALL_BATCH_TOKENS

    gen = torch.Generator().manual_seed(31)
    num_tokens, num_experts, top_k, hidden, inter = 24, 6, 2, 48, 40
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32, gen)
    clean_x = torch.randn(num_tokens, hidden, generator=gen)
    weights, ids = _routing(num_tokens, top_k, num_experts, gen)
    ids[1, 1] = ids[1, 0]  # a duplicate: both slots served
    ids[2, 0] = -1
    ids[3, 1] = num_experts
    main, small = _main_and_small_tiles(one_launch)
    few = ExpertsConfig(16, GemmTiles(block_n=64, block_k=32, group_m=1, num_stages=1),
                        GemmTiles(block_n=32, block_k=16, group_m=1, num_stages=1, tma=True))
    ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.float32, "cpu")
    views = ws.views(num_tokens, num_experts, top_k, hidden, inter)
    nv = torch.tensor(0)
    for num_valid in range(num_tokens + 1):
        nv.fill_(num_valid)
        x = clean_x.clone()
        x[num_valid:] = math.nan
        padded_ids = ids.clone()
        padded_ids[num_valid:] = STALE_ID
        health = new_health_tensor()
        out = experts_triton(x, w13, w2, weights, padded_ids, activation="silu", num_valid=NumValid(None, nv),
                             health=health, workspace=ws, out=poisoned(x.shape, torch.float32), config=main,
                             small_config=small, few_config=few)
        nv_ref = NumValid(num_valid, None)
        assert_close(out, experts_reference(clean_x, w13, w2, weights, ids, num_valid=nv_ref))
        assert_equal(out[num_valid:], torch.zeros_like(out[num_valid:]))
        assert int(health[DROPPED_SLOTS]) == dispatch_reference(ids, num_experts, nv_ref).dropped
        is_few = num_valid * top_k <= FEW_SLOTS
        is_small = num_valid <= SMALL_BATCH_TOKENS and not is_few
        blocks = [int(b) for b in views.num_blocks]
        assert (blocks[1] > 0) == is_small and (blocks[0] > 0) == (not is_small and not is_few), blocks
        if is_few and num_valid:
            rows = slice(0, num_valid)
            alone = experts_triton(x[rows].contiguous(), w13, w2, weights[rows].contiguous(),
                                   padded_ids[rows].contiguous(), activation="silu",
                                   num_valid=NumValid(None, nv), health=None, config=few, few_config=few,
                                   out=poisoned((num_valid, hidden), torch.float32))
            assert_equal(out[rows], alone, what=f"num_valid={num_valid}: in T=24 vs a batch of {num_valid}")


# (E, H, I) of the small few-slot cases below
FEW_CASE = (6, 48, 40)


class _FewInputs(NamedTuple):
    w13: torch.Tensor
    w2: torch.Tensor
    x: torch.Tensor  # clean; each num_valid poisons a copy's padding rows
    weights: torch.Tensor
    ids: torch.Tensor  # garbage_ids: duplicates, -1, >= E, stale


def _few_slot_inputs(device: str, num_tokens: int, top_k: int, seed: int) -> _FewInputs:
    gen = torch.Generator().manual_seed(seed)
    num_experts, hidden, inter = FEW_CASE
    w13, w2 = (w.to(device) for w in _weights(num_experts, hidden, inter, torch.float32, gen))
    x = torch.randn(num_tokens, hidden, generator=gen).to(device)
    ids = garbage_ids(num_tokens, top_k, num_experts, generator=gen).to(device)
    weights = torch.rand(num_tokens, top_k, generator=gen).to(device)
    return _FewInputs(w13, w2, x, weights, ids)


def _same_bits_every_num_valid(device: str, inputs: _FewInputs,
                               run: Callable[[bool, torch.Tensor, NumValid, torch.Tensor], torch.Tensor],
                               what: str) -> None:
    """For every num_valid 0..T (a device tensor; NaN in the padding rows of x, poisoned outputs):
    run(False, ...) and run(True, ...) give the same bits and the same dropped-slot count, padded
    rows are exact zeros, and the result matches the reference."""
    num_tokens = inputs.x.shape[0]
    nv = torch.tensor(0, device=device)
    for num_valid in range(num_tokens + 1):
        nv.fill_(num_valid)
        x = inputs.x.clone()
        x[num_valid:] = math.nan
        outs, dropped = [], []
        for variant in (False, True):
            health = new_health_tensor(device)
            outs.append(run(variant, x, NumValid(None, nv), health))
            dropped.append(int(health[DROPPED_SLOTS]))
        assert_equal(outs[1], outs[0], what=f"num_valid={num_valid}: {what}")
        assert_equal(outs[1][num_valid:], torch.zeros_like(outs[1][num_valid:]))
        nv_ref = NumValid(num_valid, None)
        expected = experts_reference(inputs.x, inputs.w13, inputs.w2, inputs.weights, inputs.ids,
                                     num_valid=nv_ref)
        _assert_matches(device, outs[1], expected, what=f"num_valid={num_valid}")
        expected_dropped = dispatch_reference(inputs.ids, FEW_CASE[0], nv_ref).dropped
        assert dropped[0] == dropped[1] == expected_dropped, f"num_valid={num_valid}: dropped {dropped}"


def _spy_fused_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts calls of the fused few-slot launcher (kernels/experts.py few_gemms_into)."""
    import safemoe.kernels.experts as experts_module

    calls: list[int] = []
    real = experts_module.few_gemms_into

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(experts_module, "few_gemms_into", counted)
    return calls


@pytest.mark.memcheck
@pytest.mark.parametrize("num_tokens,top_k", [(1, 8), (2, 8), (4, 4), (1, 16), (3, 5)])
def test_fused_few_gemms_bitwise_as_two_launches(device: str, num_tokens: int, top_k: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`fused` on a bucket whose every call takes the few-slot path: GEMM1 and GEMM2 in one launch
    give the same bits as the two launches with the same tiles, for every num_valid 0..T (a device
    tensor), garbage ids (duplicates served, -1, >= E, stale: dropped and counted once), NaN
    padding and poisoned outputs; its counters are zero again after every call (one workspace for
    every call), and dispatch never runs."""
    import dataclasses

    calls = _spy_fused_launches(monkeypatch)
    inputs = _few_slot_inputs(device, num_tokens, top_k, seed=num_tokens * 10 + top_k)
    # GEMM1 and GEMM2 tiles of other widths, N and K tails, TMA on one of them
    two = ExpertsConfig(16, GemmTiles(block_n=16, block_k=32, group_m=1, num_stages=1),
                        GemmTiles(block_n=32, block_k=16, group_m=1, num_stages=1, tma=True))
    ws = Workspace(num_tokens, FEW_CASE[0], top_k, FEW_CASE[1], FEW_CASE[2], torch.float32, device)
    views = ws.views(num_tokens, FEW_CASE[0], top_k, FEW_CASE[1], FEW_CASE[2])
    views.num_blocks.fill_(7)

    def run(fused: bool, x: torch.Tensor, nv: NumValid, health: torch.Tensor) -> torch.Tensor:
        cfg = dataclasses.replace(two, fused=fused)
        out = experts_triton(x, inputs.w13, inputs.w2, inputs.weights, inputs.ids, activation="silu",
                             num_valid=nv, health=health, workspace=ws,
                             out=poisoned(x.shape, torch.float32, device), config=cfg, few_config=cfg)
        assert int(views.few_sync.count_nonzero()) == 0, "counters left set"
        return out

    _same_bits_every_num_valid(device, inputs, run, "fused vs two launches")
    assert len(calls) == num_tokens + 1
    assert views.num_blocks.tolist() == [7, 7], "a few-slot bucket launched dispatch"


@pytest.mark.memcheck
@pytest.mark.parametrize("num_tokens,top_k,fused",
                         [(1, 8, False), (2, 8, True), (4, 4, False), (24, 2, False)])
def test_ids_complete_gives_the_same_bits(device: str, num_tokens: int, top_k: int, fused: bool) -> None:
    """`ids_complete` (the router's ids, every row written this call: moe() and MoE pass it) loads
    the few-slot path's ids together with a device num_valid: the same bits as without it for every
    num_valid, whatever the padding rows' ids hold (here garbage, discarded unused), on the
    few-slot bucket, fused or not, and inside a larger bucket (T = 24, K = 2)."""
    import dataclasses

    inputs = _few_slot_inputs(device, num_tokens, top_k, seed=num_tokens * 100 + top_k)
    tiles = ExpertsConfig(16, GemmTiles(block_n=16, block_k=32, group_m=1, num_stages=1),
                          GemmTiles(block_n=32, block_k=16, group_m=1, num_stages=1), fused=fused)
    big = dataclasses.replace(tiles, block_m=32) if num_tokens * top_k > 16 else None
    ws = Workspace(num_tokens, FEW_CASE[0], top_k, FEW_CASE[1], FEW_CASE[2], torch.float32, device)

    def run(complete: bool, x: torch.Tensor, nv: NumValid, health: torch.Tensor) -> torch.Tensor:
        return experts_triton(x, inputs.w13, inputs.w2, inputs.weights, inputs.ids, activation="silu",
                              num_valid=nv, health=health, workspace=ws,
                              out=poisoned(x.shape, torch.float32, device), config=big or tiles,
                              few_config=tiles, ids_complete=complete)

    _same_bits_every_num_valid(device, inputs, run, "ids_complete vs not")


@pytest.mark.memcheck
def test_interleaved_gate_up_tile_matches(device: str) -> None:
    """GEMM1's `interleave` (gate and up rows as the even and odd columns of one weight tile, one
    MMA a K step) matches the two-accumulator tiles and the reference (the wider product may sum a
    K step in another order: not bitwise), K and N tails included
    (H not a multiple of BLOCK_K, I of BLOCK_N), for a device num_valid of 0, 1, some and all
    rows with NaN padding rows; padded rows are exact zeros. Weights through pointers and through
    a TMA descriptor over w13 seen as [E, I, 2, H] (zero-filled past I and H)."""
    import dataclasses

    cpu = device == "cpu"
    num_tokens, num_experts, top_k, hidden, inter = (70, 4, 2, 80, 40) if cpu else (300, 8, 2, 200, 176)
    dtype = torch.float32 if cpu else torch.bfloat16
    x, w13, w2, weights, ids = _draw(device, num_tokens, num_experts, top_k, hidden, inter, dtype, seed=41)
    block_m, stages = (16, 1) if cpu else (64, 3)
    plain = ExpertsConfig(block_m, GemmTiles(block_n=32, block_k=64, group_m=2, num_stages=stages),
                          GemmTiles(block_n=32, block_k=32, group_m=2, num_stages=stages))
    variants = [dataclasses.replace(plain, gemm1=dataclasses.replace(plain.gemm1, interleave=True, tma=tma))
                for tma in (False, True)]
    ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, dtype, device)
    for count in (0, 1, 37, num_tokens):
        padded = x.clone()
        padded[count:] = math.nan
        nv = _nv(torch.tensor(count, device=device), num_tokens, device)
        results = [_run(padded, w13, w2, weights, ids, num_valid=nv, workspace=ws, config=cfg,
                        out=poisoned(x.shape, dtype, device)) for cfg in (plain, *variants)]
        for got in results[1:]:
            _assert_matches(device, got, results[0], f"interleave vs two accumulators, num_valid={count}")
            assert_equal(got[count:], torch.zeros_like(got[count:]))
        _assert_matches(device, results[1], _reference(padded, w13, w2, weights, ids, num_valid=count),
                        f"interleave, num_valid={count}")


@interpreter_only(INTERPRETER_ONLY)
@pytest.mark.parametrize("num_tokens,own_few", [(9, False), (33, True)])
def test_fused_is_ignored_above_the_few_slot_buckets(monkeypatch: pytest.MonkeyPatch, num_tokens: int,
                                                     own_few: bool) -> None:
    """A bucket with T*K > 16 runs its GEMMs apart whatever its own `fused` says (a batch there may
    need the dispatch layout) unless it is a fused bucket of <= FUSED_SLOTS slots running its own
    tiles as the few-slot tiles (test below): here with other few-slot tiles (18 slots) or above
    fused_slots() (66 slots, its own tiles). It still matches the reference; only fused few-slot
    tiles (the few_config's `fused`, tests below) bring the fused launch into it."""
    import dataclasses

    from safemoe.kernels.experts import fused_bucket

    calls = _spy_fused_launches(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    num_experts, top_k, hidden, inter = 6, 2, 32, 32
    assert not fused_bucket(num_tokens, top_k) or not own_few
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32, gen)
    x = torch.randn(num_tokens, hidden, generator=gen)
    weights, ids = _routing(num_tokens, top_k, num_experts, gen)
    cfg = dataclasses.replace(_config(16), fused=True)
    for num_valid in (1, num_tokens):
        out = experts_triton(x, w13, w2, weights, ids, activation="silu", num_valid=NumValid(num_valid, None),
                             health=None, config=cfg, few_config=cfg if own_few else _config(16))
        assert_close(out, _reference(x, w13, w2, weights, ids, num_valid=num_valid))
    assert not calls


def test_fused_bucket_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The buckets that can run every batch fused: K <= 16 and T*K <= 32 with 32-row tiles, 64
    with the packed tiles (the default); the tuner and few_tiles_from ask the same rule."""
    import safemoe.kernels.experts as experts_module
    from safemoe.kernels.experts import fused_bucket

    assert fused_bucket(8, 8) and not fused_bucket(9, 8)  # the default: packed
    monkeypatch.setattr(experts_module, "PACK_FUSED_ROWS", False)
    assert fused_bucket(8, 4) and fused_bucket(2, 16) and fused_bucket(1, 1)
    assert not fused_bucket(9, 4) and not fused_bucket(8, 8) and not fused_bucket(1, 17)
    monkeypatch.setattr(experts_module, "PACK_FUSED_ROWS", True)
    assert fused_bucket(8, 8) and not fused_bucket(9, 8) and not fused_bucket(2, 17)


_UP_TO_32_SLOTS = [(8, 4, False), (3, 8, False), (16, 2, False), (5, 5, False), (5, 5, True)]
_WIDE_FUSED_CASES = [(num_tokens, top_k, crowded, packed) for packed in (False, True)
                     for num_tokens, top_k, crowded in _UP_TO_32_SLOTS]
# 33..64 slots: only with the packed tiles
_WIDE_FUSED_CASES += [(8, 8, False, True), (12, 5, True, True)]


@pytest.mark.memcheck
@pytest.mark.parametrize("num_tokens,top_k,crowded,packed", _WIDE_FUSED_CASES)
def test_fused_bucket_of_up_to_64_slots(device: str, num_tokens: int, top_k: int, crowded: bool, packed: bool,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A `fused` bucket of 16 < T*K <= fused_slots() (32; 64 with PACK_FUSED_ROWS) slots with its
    own tiles as few-slot tiles runs every batch as the fused launch, with 32-row tiles or
    (PACK_FUSED_ROWS) each expert's slots packed into 16-row tiles: no dispatch launch. For every
    num_valid 0..T (a device tensor), garbage ids (duplicates served, -1, >= E, stale: dropped and
    counted once; `crowded`: most slots on one expert, more than a 16-row tile holds), NaN padding
    rows, poisoned outputs and a workspace whose intermediate and y are poisoned before every
    call: equal to the reference and to the same bucket unfused (dispatch layout, same tiles)
    within its tolerance, padded rows exact zeros, counters zero again after every call (one
    workspace), the same bits run to run."""
    import dataclasses

    import safemoe.kernels.experts as experts_module
    from safemoe.kernels.experts import FEW_SLOTS, fused_slots

    monkeypatch.setattr(experts_module, "PACK_FUSED_ROWS", packed)
    assert FEW_SLOTS < num_tokens * top_k <= fused_slots()
    calls = _spy_fused_launches(monkeypatch)
    inputs = _few_slot_inputs(device, num_tokens, top_k, seed=num_tokens * 10 + top_k + 7)
    if crowded:  # most slots on expert 2 (duplicates in a row are each served): 21 of the first 25
        ids = torch.full((num_tokens, top_k), 2, dtype=torch.int32)
        ids[0, 1], ids[1, 3], ids[3, 0], ids[4, 4] = -1, 7, 0, 5
        inputs = inputs._replace(ids=ids.to(device))
    num_experts, hidden, inter = FEW_CASE
    fused = ExpertsConfig(16, GemmTiles(block_n=16, block_k=32, group_m=1, num_stages=1),
                          GemmTiles(block_n=32, block_k=16, group_m=1, num_stages=1, tma=True), fused=True)
    apart = dataclasses.replace(fused, fused=False)
    ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.float32, device)
    views = ws.views(num_tokens, num_experts, top_k, hidden, inter)
    nv = torch.tensor(0, device=device)
    for num_valid in range(num_tokens + 1):
        nv.fill_(num_valid)
        x = inputs.x.clone()
        x[num_valid:] = math.nan
        nv_ref = NumValid(num_valid, None)
        expected = experts_reference(inputs.x, inputs.w13, inputs.w2, inputs.weights, inputs.ids,
                                     num_valid=nv_ref)
        outs = {}
        for name, cfg in (("apart", apart), ("fused", fused), ("fused again", fused)):
            views.num_blocks.fill_(7)
            views.intermediate.fill_(math.nan)  # nothing read that this call did not write
            views.y.fill_(math.nan)
            health = new_health_tensor(device)
            outs[name] = experts_triton(
                x, inputs.w13, inputs.w2, inputs.weights, inputs.ids, activation="silu",
                num_valid=NumValid(None, nv), health=health, workspace=ws,
                out=poisoned(x.shape, torch.float32, device), config=cfg, few_config=cfg)
            assert int(health[DROPPED_SLOTS]) == dispatch_reference(inputs.ids, num_experts, nv_ref).dropped
            assert int(views.few_sync.count_nonzero()) == 0, "counters left set"
            _assert_matches(device, outs[name], expected, what=f"{name}, num_valid={num_valid}")
            assert_equal(outs[name][num_valid:], torch.zeros_like(outs[name][num_valid:]))
            launched_dispatch = views.num_blocks.tolist() != [7, 7]
            assert launched_dispatch == (name == "apart"), name
        _assert_matches(device, outs["fused"], outs["apart"], what=f"fused vs apart, num_valid={num_valid}")
        assert_equal(outs["fused again"], outs["fused"], what=f"run to run, num_valid={num_valid}")
    assert len(calls) == 2 * (num_tokens + 1)


@pytest.mark.memcheck
@pytest.mark.parametrize("num_tokens,top_k", [(24, 2), (9, 8), (40, 4)])
def test_fused_few_tiles_in_a_larger_bucket(device: str, num_tokens: int, top_k: int,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A bucket above the few-slot size with tiles of more than 16 rows, whose few-slot tiles are
    `fused`, runs a padded step (<= 16 valid slots) as the fused launch, placed before its GEMM launches (then
    compiled without the path), which returns at once on a larger batch: the same bits as the
    few-slot path inside the GEMM launches for every num_valid 0..T (a device tensor, so one call
    may take either path), garbage ids dropped and counted once, NaN padding rows, poisoned
    outputs, the counters zero after every call."""
    import dataclasses

    calls = _spy_fused_launches(monkeypatch)
    inputs = _few_slot_inputs(device, num_tokens, top_k, seed=num_tokens * 7 + top_k)
    few = ExpertsConfig(16, GemmTiles(block_n=16, block_k=32, group_m=1, num_stages=1),
                        GemmTiles(block_n=32, block_k=16, group_m=1, num_stages=1, tma=True))
    big = ExpertsConfig(32, GemmTiles(block_n=32, block_k=32, group_m=2, num_stages=1),
                        GemmTiles(block_n=32, block_k=32, group_m=2, num_stages=1))
    ws = Workspace(num_tokens, FEW_CASE[0], top_k, FEW_CASE[1], FEW_CASE[2], torch.float32, device)
    views = ws.views(num_tokens, FEW_CASE[0], top_k, FEW_CASE[1], FEW_CASE[2])

    def run(fused: bool, x: torch.Tensor, nv: NumValid, health: torch.Tensor) -> torch.Tensor:
        out = experts_triton(x, inputs.w13, inputs.w2, inputs.weights, inputs.ids, activation="silu",
                             num_valid=nv, health=health, workspace=ws,
                             out=poisoned(x.shape, torch.float32, device), config=big,
                             few_config=dataclasses.replace(few, fused=fused))
        assert int(views.few_sync.count_nonzero()) == 0, "counters left set"
        return out

    _same_bits_every_num_valid(device, inputs, run, "fused launch in a larger bucket vs the few-slot GEMMs")
    assert len(calls) == num_tokens + 1, "the fused launch ran once per fused call"
    # A bucket of 16-row (decode) tiles keeps the path inside its GEMM launches.
    calls.clear()
    same = dataclasses.replace(few, fused=False)
    out = experts_triton(inputs.x, inputs.w13, inputs.w2, inputs.weights, inputs.ids, activation="silu",
                         num_valid=NumValid(1, None), health=None, workspace=ws, config=same,
                         few_config=dataclasses.replace(few, fused=True))
    assert not calls, "the fused launch ran in a bucket of 16-row tiles"
    expected = experts_reference(inputs.x, inputs.w13, inputs.w2, inputs.weights, inputs.ids,
                                 num_valid=NumValid(1, None))
    _assert_matches(device, out, expected, what="one row, same tiles")


@pytest.mark.memcheck
@pytest.mark.parametrize("block_m,tabled", [(64, False), (64, True), (32, False)])
def test_untabled_64_row_bucket_compiles_light_few_slot_tiles(device: str, block_m: int, tabled: bool,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """With the configs chosen by experts_triton itself (config None), a shape without a table
    compiles lighter few-slot tiles (`light_few_tiles`: 128-wide K steps) into a 64-row bucket's
    launches than its decode bucket runs; a tabled shape and a 32-row bucket keep the decode
    tiles (fitted for an untabled shape). Every num_valid 0..T (a device tensor; NaN padding rows,
    poisoned outputs, garbage ids) matches the reference with exact-zero padding rows and the
    reference's dropped count, and no fused launch runs."""
    import dataclasses

    from safemoe.configs import few_tiles_within
    from safemoe.kernels import experts as ex

    num_tokens, top_k = 24, 2
    inputs = _few_slot_inputs(device, num_tokens, top_k, seed=block_m + tabled)
    if device == "cuda":  # bf16: the main tiles' pipeline in fp32 outgrows an SM's shared memory
        inputs = inputs._replace(**{name: getattr(inputs, name).to(torch.bfloat16)
                                    for name in ("w13", "w2", "x")})
    element_bytes = inputs.x.element_size()
    # main tiles with more shared memory than the decode tiles, so the fit leaves both as they are
    tiles = GemmTiles(block_n=64, block_k=128, group_m=2, num_stages=4)
    few = ExpertsConfig(16, GemmTiles(block_n=16, block_k=256, group_m=1, num_stages=3),
                        GemmTiles(block_n=32, block_k=256, group_m=1, num_stages=3))
    big = ExpertsConfig(block_m, tiles, tiles)
    bucket = ex.few_slots_bucket(top_k)
    monkeypatch.setattr(ex, "get_config", lambda t, *args, **kwargs: few if t <= bucket else big)
    monkeypatch.setattr(ex, "has_table", lambda *args, **kwargs: tabled)
    fused_calls = _spy_fused_launches(monkeypatch)
    compiled: list[ExpertsConfig] = []
    real_few_slots = ex.FewSlots

    def recording(config: ExpertsConfig, *args, **kwargs):
        compiled.append(config)
        return real_few_slots(config, *args, **kwargs)

    monkeypatch.setattr(ex, "FewSlots", recording)
    light = ex.light_few_tiles(few)
    assert (light.gemm1.block_k, light.gemm1.num_stages, light.gemm2.block_k) == (128, 4, 128)
    expected_tiles = light if block_m == 64 and not tabled else few
    assert few_tiles_within(few, big, element_bytes) == few
    assert few_tiles_within(light, big, element_bytes) == light
    ws = Workspace(num_tokens, FEW_CASE[0], top_k, FEW_CASE[1], FEW_CASE[2], inputs.x.dtype, device)
    nv = torch.tensor(0, device=device)
    for num_valid in range(num_tokens + 1):
        nv.fill_(num_valid)
        x = inputs.x.clone()
        x[num_valid:] = math.nan
        health = new_health_tensor(device)
        out = experts_triton(x, inputs.w13, inputs.w2, inputs.weights, inputs.ids, activation="silu",
                             num_valid=NumValid(None, nv), health=health, workspace=ws,
                             out=poisoned(x.shape, x.dtype, device))
        assert_equal(out[num_valid:], torch.zeros_like(out[num_valid:]))
        nv_ref = NumValid(num_valid, None)
        expected = experts_reference(inputs.x, inputs.w13, inputs.w2, inputs.weights, inputs.ids,
                                     num_valid=nv_ref)
        _assert_matches(device, out, expected, what=f"num_valid={num_valid}")
        assert int(health[DROPPED_SLOTS]) == dispatch_reference(inputs.ids, FEW_CASE[0], nv_ref).dropped
    assert compiled and all(c == expected_tiles for c in compiled), (compiled[0], expected_tiles)
    assert not fused_calls, "no fused launch: the few-slot tiles run inside the bucket's GEMM launches"
    assert not expected_tiles.fused and dataclasses.replace(expected_tiles, fused=False) == expected_tiles


def test_few_config_errors() -> None:
    """The few-slot path is refused, with its argument named, where it cannot run."""
    tiles = GemmTiles(block_n=32, block_k=32)
    cfg = ExpertsConfig(16, tiles, tiles)
    x = torch.zeros(2, 32)
    w13, w2 = torch.zeros(4, 64, 32), torch.zeros(4, 32, 32)
    weights, ids = torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.int32)
    nv = NumValid(2, None)
    with pytest.raises(ValueError, match="small_config and few_config switch tiles by num_valid"):
        experts_triton(x, w13, w2, weights, ids, activation="silu", num_valid=nv, health=None, config=cfg,
                       few_config=cfg, batch_invariant=True)
    wide_ids = torch.zeros(2, 17, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"few_config: .*K <= 16, got K=17"):
        experts_triton(x, w13, w2, torch.ones(2, 17), wide_ids, activation="silu", num_valid=nv, health=None,
                       config=cfg, few_config=cfg)
    with pytest.raises(TypeError, match="few_config must be a safemoe ExpertsConfig or None, got dict"):
        experts_triton(x, w13, w2, weights, ids, activation="silu", num_valid=nv, health=None, config=cfg,
                       few_config=cfg.to_json())  # type: ignore[arg-type]
    from safemoe.kernels.experts import few_slots_bucket

    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="top_k must be an int >= 1"):
            few_slots_bucket(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="few must be a bool, got int"):
        ExpertsConfig(16, tiles, tiles, few=1)  # type: ignore[arg-type]
    assert not ExpertsConfig.from_json(ExpertsConfig(16, tiles, tiles, few=False).to_json()).few
    assert ExpertsConfig.from_json(ExpertsConfig(16, tiles, tiles, fused=True).to_json()).fused
    with pytest.raises(TypeError, match="fused must be a bool, got str"):
        ExpertsConfig(16, tiles, tiles, fused="yes")  # type: ignore[arg-type]
    assert ExpertsConfig.from_json({"block_m": 16, "gemm1": {"block_n": 32, "block_k": 32},
                                    "gemm2": {"block_n": 32, "block_k": 32}}).few


def test_few_slots_config_choice() -> None:
    """Which tiles the few-slot path runs: a bucket with T*K <= 16 its own, a larger one those of
    the largest such bucket; none with K > 16 or a config that turns it off."""
    import dataclasses

    from safemoe.configs import get_config
    from safemoe.kernels.experts import few_slots_bucket, few_slots_config

    assert [few_slots_bucket(k) for k in (1, 2, 3, 4, 5, 8, 10, 16, 17)] == [16, 8, 4, 4, 2, 2, 1, 1, 1]
    dev = torch.device("cpu")
    shape = (128, 2048, 768, 8, torch.bfloat16, dev)
    num_experts, hidden, inter, _, dtype, _ = shape
    own = get_config(2, *shape[:5], dev)
    assert few_slots_config(2, *shape, own) is own
    big = get_config(1024, *shape[:5], dev)
    assert few_slots_config(1024, *shape, big) == get_config(2, *shape[:5], dev)
    assert few_slots_config(1024, *shape, dataclasses.replace(big, few=False)) is None
    assert few_slots_config(1, num_experts, hidden, inter, 17, dtype, dev, own) is None


def test_small_batch_config_reads_the_device_files_small_batch_entry(monkeypatch) -> None:
    """A bucket above SMALL_BATCH_TOKENS runs its small-batch steps with the device file's
    "small_batch" entry for the shape when it has one (block_k capped at 128 in fp8 block mode),
    else with the SMALL_BATCH_TOKENS bucket's entry, which keeps serving its own batches."""
    import safemoe.configs as configs
    from safemoe.kernels.experts import SMALL_BATCH_TOKENS, small_batch_config

    def tiles(n: int, k: int) -> dict:
        return {"block_n": n, "block_k": k, "group_m": 1, "num_warps": 4, "num_stages": 3, "tma": False}

    own = {"block_m": 16, "gemm1": tiles(32, 128), "gemm2": tiles(64, 128)}
    pinned = {"block_m": 16, "gemm1": tiles(64, 256), "gemm2": tiles(128, 256), "source": "kept"}
    big = {"block_m": 64, "gemm1": tiles(128, 64), "gemm2": tiles(128, 64)}
    shape = (128, 2048, 768, 8, torch.bfloat16)
    key, fp8_key = configs.shape_key(*shape), configs.shape_key(*shape, "block")
    entries = {str(SMALL_BATCH_TOKENS): own, "1024": big}
    device_file = {"configs": {key: entries, fp8_key: entries}, "small_batch": {key: pinned, fp8_key: pinned}}
    monkeypatch.setattr(configs, "_device_json", lambda name: device_file)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU small_batch")
    caches = (configs.load_device_configs, configs.load_small_batch_configs, configs._small_batch_entry)
    for cached in caches:
        cached.cache_clear()
    cuda = torch.device("cuda")
    try:
        main = configs.get_config(1024, *shape, cuda)
        small = small_batch_config(1024, *shape, cuda, main)
        assert small == configs.ExpertsConfig.from_json(pinned)
        assert configs.get_config(SMALL_BATCH_TOKENS, *shape, cuda) == configs.ExpertsConfig.from_json(own)
        assert small_batch_config(SMALL_BATCH_TOKENS, *shape, cuda, main) is None
        fp8 = small_batch_config(1024, *shape, cuda, main, "block")
        assert fp8 is not None and (fp8.gemm1.block_k, fp8.gemm2.block_k) == (128, 128)
        del device_file["small_batch"]
        for cached in caches:
            cached.cache_clear()
        assert small_batch_config(1024, *shape, cuda, main) == configs.ExpertsConfig.from_json(own)
        assert configs.small_batch_entry(*shape, torch.device("cpu")) is None
    finally:
        for cached in caches:
            cached.cache_clear()


def test_small_batch_entry_rejects_bad_arguments() -> None:
    """The "small_batch" lookup names the argument it cannot use, before any table is read."""
    from safemoe.configs import small_batch_entry

    cpu = torch.device("cpu")
    with pytest.raises(TypeError, match=r"device must be a torch\.device"):
        small_batch_entry(128, 2048, 768, 8, torch.bfloat16, "cuda")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"dtype must be a torch\.dtype"):
        small_batch_entry(128, 2048, 768, 8, "bf16", cpu)  # type: ignore[arg-type]
    for bad in ({"num_experts": 0}, {"hidden": 2.0}, {"top_k": True}):
        args = {"num_experts": 128, "hidden": 2048, "inter": 768, "top_k": 8, **bad}
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be an int >= 1"):
            small_batch_entry(**args, dtype=torch.bfloat16, device=cpu)
    with pytest.raises(ValueError, match="quant must be None or one of"):
        small_batch_entry(128, 2048, 768, 8, torch.bfloat16, cpu, "int4")
    assert small_batch_entry(128, 2048, 768, 8, torch.bfloat16, cpu) is None


@interpreter_only(INTERPRETER_ONLY)
def test_all_tokens_to_one_expert() -> None:
    gen = torch.Generator().manual_seed(12)
    num_tokens, num_experts, hidden, inter = 150, 8, 32, 32
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32, gen)
    x = torch.randn(num_tokens, hidden, generator=gen)
    ids = torch.full((num_tokens, 1), 3, dtype=torch.int32)
    weights = torch.rand(num_tokens, 1, generator=gen)
    out = _run(x, w13, w2, weights, ids, config=_config(64))
    assert_close(out, experts_reference(x, w13, w2, weights, ids))


@interpreter_only("bitwise against T = num_valid alone with the same config, measured on the interpreter")
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


@interpreter_only(INTERPRETER_ONLY)
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


@interpreter_only(INTERPRETER_ONLY)
def test_fresh_workspace_zeroes_only_its_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new Workspace zeroes its index segment and leaves the data segment as the allocator gave it
    (a ~70 MB memset per workspace-less call at T = 1024 otherwise); on memory that comes back full
    of garbage it still gives the fresh result's bits."""
    real_empty = torch.empty

    def garbage_empty(*args, **kwargs):
        return real_empty(*args, **kwargs).fill_(0xFF)  # as uint8: NaN in every float view of it

    with monkeypatch.context() as patch:
        patch.setattr(torch, "empty", garbage_empty)
        ws = Workspace(48, 8, 2, 64, 64, torch.float32, "cpu")
    views = ws.views(48, 8, 2, 64, 64)
    assert views.intermediate.isnan().all() and views.y.isnan().all()
    assert (views.counts == 0).all() and (views.ticket == 0).all() and (views.num_blocks == 0).all()
    gen = torch.Generator().manual_seed(17)
    w13, w2 = _weights(8, 64, 64, torch.float32, gen)
    x = torch.randn(48, 64, generator=gen)
    weights, ids = _routing(48, 2, 8, gen)
    for num_valid in (48, 5, 0):
        assert_equal(_run(x, w13, w2, weights, ids, workspace=ws, num_valid=num_valid),
                     _run(x, w13, w2, weights, ids, num_valid=num_valid))


@interpreter_only("argument checks; CPU tensors")
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


def test_workspace_views_cached_per_dims() -> None:
    """views() hands every call of the same dims one frozen object, equal to a fresh carve (same
    storage, offsets, shapes), and keeps at most _MAX_CACHED_VIEWS entries."""
    import dataclasses

    from safemoe import workspace as workspace_module

    ws = Workspace(64, 8, 2, 64, 64, torch.float32, "cpu")
    first = ws.views(20, 6, 2, 32, 48)
    assert ws.views(20, 6, 2, 32, 48) is first
    fresh = ws._carve(20, 6, 2, 32, 48)
    for field in dataclasses.fields(first):
        got, want = getattr(first, field.name), getattr(fresh, field.name)
        assert (got.data_ptr(), got.shape, got.stride()) == (want.data_ptr(), want.shape, want.stride()), (
            field.name)
    assert ws.views(64, 8, 2, 64, 64) is not first
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.y = fresh.y  # type: ignore[misc]
    for num_experts in (8, 6, 4):  # 192 distinct dims
        for num_tokens in range(1, 65):
            ws.views(num_tokens, num_experts, 2, 64, 64)
    assert len(ws._views) <= workspace_module._MAX_CACHED_VIEWS


def test_host_grid_helpers_match_triton() -> None:
    """The launchers' plain-int cdiv / next_power_of_2 give triton's values (theirs cost microseconds
    a host call since Triton 3.5)."""
    import triton

    from safemoe.kernels.launch import cdiv, next_power_of_2

    for n in range(0, 4200):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64, 128, 1000):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


# ---------------------------------------------------------------------------------------------
# CUDA only: small shapes (memcheck), CUDA graphs, PDL
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.memcheck
def test_garbage_ids_and_padding_bitwise_bf16() -> None:
    """Stale/duplicate/-1/out-of-range ids dropped and counted exactly; padding rows with NaN and
    garbage leave real rows bitwise identical; padded rows exact zeros; workspace poisoned."""
    num_tokens, valid, num_experts, top_k, hidden, inter = 300, 211, 12, 4, 128, 64
    w13, w2 = _gpu_weights(num_experts, hidden, inter)
    gen = torch.Generator().manual_seed(5)
    ids = garbage_ids(num_tokens, top_k, num_experts, generator=gen).to("cuda")
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weights = torch.rand(num_tokens, top_k, device="cuda")
    ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16, "cuda")
    views = ws.views(num_tokens, num_experts, top_k, hidden, inter)
    views.intermediate.fill_(math.nan)
    views.y.fill_(math.nan)
    views.sorted_slots.fill_(STALE_ID)
    health = new_health_tensor("cuda")
    clean_x, clean_w, clean_ids = x.clone(), weights.clone(), ids.clone()
    clean_x[valid:], clean_w[valid:], clean_ids[valid:] = 0, 0, -1
    nv = torch.tensor(valid, device="cuda")
    clean = safemoe.experts(clean_x, w13, w2, safemoe.Routing(clean_w, clean_ids), num_valid=nv,
                            backend="triton", health=health, workspace=ws)
    dropped = dispatch_reference(ids, num_experts, _nv(valid, num_tokens, "cuda")).dropped
    assert int(health[DROPPED_SLOTS]) == dropped > 0
    dirty_x, dirty_w, dirty_ids = x.clone(), weights.clone(), ids.clone()
    dirty_x[valid:], dirty_w[valid:], dirty_ids[valid:] = math.nan, math.nan, STALE_ID
    dirty = _run(dirty_x, w13, w2, dirty_w, dirty_ids, num_valid=nv, workspace=ws,
                 out=poisoned(x.shape, torch.bfloat16, "cuda"))
    assert_equal(dirty[:valid], clean[:valid], what="real rows")
    assert_equal(dirty[valid:], torch.zeros_like(dirty[valid:]), what="padded rows")
    _check_rel(clean[:valid], _reference(x, w13, w2, weights, ids, num_valid=valid)[:valid], "garbage ids")
    assert int(views.counts.abs().sum()) == 0 and int(views.ticket.item()) == 0, "counters not reset"


@pytest.mark.gpu
@pytest.mark.memcheck
def test_graph_replay_with_num_valid_changed() -> None:
    """Route + experts captured in one CUDA graph; replays with the device num_valid changed."""
    num_tokens, num_experts, top_k, hidden, inter = 96, 16, 4, 128, 64
    w13, w2 = _gpu_weights(num_experts, hidden, inter)
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(num_tokens, num_experts, device="cuda", dtype=torch.bfloat16)
    nv = torch.tensor(num_tokens, device="cuda", dtype=torch.int32)
    ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16, "cuda")
    health = new_health_tensor("cuda")
    out = torch.empty_like(x)
    route_backend = "triton"
    try:
        safemoe.route(logits, top_k, num_valid=nv, backend="triton")
    except (RuntimeError, NotImplementedError, ImportError):
        route_backend = "reference"  # the router kernel is another issue; the graph still holds both

    def layer() -> None:
        routing = safemoe.route(logits, top_k, num_valid=nv, backend=route_backend, health=health)
        out.copy_(safemoe.experts(x, w13, w2, routing, num_valid=nv, backend="triton", health=health,
                                  workspace=ws))

    graph, _ = capture_graph(layer)
    for count in (num_tokens, 1, 0, 37, num_tokens - 1):
        nv.fill_(count)
        x[count:] = math.nan
        logits[count:] = math.nan
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        ref = moe_reference(x, logits, w13, w2, top_k, num_valid=_nv(count, num_tokens, "cuda"))
        if count:
            _check_rel(out[:count], ref[:count], f"graph num_valid={count}")
        assert_equal(out[count:], torch.zeros_like(out[count:]), what=f"padded rows num_valid={count}")
        x[count:] = torch.randn(num_tokens - count, hidden, device="cuda", dtype=torch.bfloat16)
        logits[count:] = torch.randn(num_tokens - count, num_experts, device="cuda", dtype=torch.bfloat16)
    assert int(health[DROPPED_SLOTS]) == 0


@pytest.mark.gpu
@pytest.mark.memcheck
def test_pdl_and_tma_configs_in_graph() -> None:
    """Programmatic dependent launch and TMA weight loads, captured in a graph and replayed with a
    changed num_valid: the same bits as plain launches (PDL) and close to pointer loads (TMA)."""
    num_tokens, num_experts, top_k, hidden, inter = 200, 16, 4, 256, 192
    w13, w2 = _gpu_weights(num_experts, hidden, inter)
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weights, ids = _gpu_routing(num_tokens, top_k, num_experts)
    nv = torch.tensor(num_tokens, device="cuda", dtype=torch.int32)
    plain = ExpertsConfig(32, GemmTiles(64, 64, 4, 4, 3), GemmTiles(64, 64, 4, 4, 3))
    variants = {
        "plain": plain,
        "pdl": ExpertsConfig(32, plain.gemm1, plain.gemm2, pdl=True),
        "tma": ExpertsConfig(32, GemmTiles(64, 64, 4, 4, 3, tma=True), GemmTiles(64, 64, 4, 4, 3, tma=True),
                             pdl=True),
    }
    for count in (num_tokens, 3):
        nv.fill_(count)
        results = {}
        for name, cfg in variants.items():
            ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16, "cuda")
            out = torch.empty_like(x)

            def step(cfg=cfg, ws=ws, out=out) -> None:
                _run(x, w13, w2, weights, ids, num_valid=nv, workspace=ws, out=out, config=cfg)

            step()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            out.fill_(math.nan)
            graph.replay()
            torch.cuda.synchronize()
            results[name] = out.clone()
        assert_equal(results["pdl"], results["plain"], what=f"pdl vs plain, num_valid={count}")
        _check_rel(results["tma"][:count], results["plain"][:count], f"tma vs pointers, num_valid={count}",
                   tol=1e-3)
        ref = _reference(x, w13, w2, weights, ids, num_valid=count)
        _check_rel(results["plain"][:count], ref[:count], f"plain num_valid={count}")


# ---------------------------------------------------------------------------------------------
# CUDA only: real model shapes and large token counts
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(MODEL_SHAPES))
def test_model_shapes_bf16(model: str) -> None:
    num_experts, top_k, hidden, inter, activation = MODEL_SHAPES[model]
    w13, w2 = _gpu_weights(num_experts, hidden, inter)
    for num_tokens in (1, 64, 1000) if num_experts > 8 else (3, 300):
        x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
        weights, ids = _gpu_routing(num_tokens, top_k, num_experts, seed=num_tokens)
        out = _run(x, w13, w2, weights, ids, activation=activation)
        ref = _reference(x, w13, w2, weights, ids, activation=activation)
        _check_rel(out, ref, f"{model} T={num_tokens}")
    del w13, w2
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.memcheck
@pytest.mark.parametrize("engine", ["ws", "ws_store"])
def test_gemm2_gluon_engine_in_graph(engine: str) -> None:
    """GemmTiles.engine "ws" / "ws_store" (the warp-specialised Gluon GEMM2 of experts_ws.py) in a
    CUDA graph replayed with a device num_valid of 0, 1 and 3 (few-slot path), 6 (small-batch
    tiles: the Triton launch beside the Gluon one), 37 and T (main layout), garbage ids, NaN
    padding rows and a NaN-poisoned workspace: the Triton engine's result within bf16 rounding,
    the reference, exact zeros past num_valid. H is no multiple of the 256-column tile (boxes read
    the next expert's rows, columns never stored) and I no multiple of block_k (zero-filled K)."""
    import dataclasses

    from safemoe.kernels.experts_ws import ws_usable

    num_tokens, num_experts, top_k, hidden, inter = 300, 8, 4, 200, 176
    x, w13, w2, weights, ids = _draw("cuda", num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16,
                                     seed=61)
    gen = torch.Generator().manual_seed(61)
    garbage = garbage_ids(num_tokens, top_k, num_experts, generator=gen).cuda()
    ids = torch.where(torch.rand(num_tokens, top_k, generator=gen).cuda() < 0.1, garbage, ids)
    ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16, "cuda")
    views = ws.views(num_tokens, num_experts, top_k, hidden, inter)
    if not ws_usable(w2, views):
        pytest.skip("the Gluon GEMM2 runs on sm_90 only")
    triton_cfg = ExpertsConfig(128, GemmTiles(block_n=128, block_k=64, group_m=4, num_warps=8, num_stages=3),
                               GemmTiles(block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3))
    gluon_cfg = dataclasses.replace(triton_cfg, gemm2=dataclasses.replace(triton_cfg.gemm2, engine=engine))
    small = ExpertsConfig(16, GemmTiles(block_n=64, block_k=64), GemmTiles(block_n=64, block_k=64))
    nv = torch.tensor(num_tokens, device="cuda", dtype=torch.int32)
    padded = x.clone()
    out = torch.empty_like(x)

    def run(cfg: ExpertsConfig) -> None:
        out.copy_(experts_triton(padded, w13, w2, weights, ids, activation="silu",
                                 num_valid=_nv(nv, num_tokens, "cuda"), health=None, workspace=ws, config=cfg,
                                 small_config=small, few_config=small))

    graph, _ = capture_graph(lambda: run(gluon_cfg))
    for count in (num_tokens, 0, 1, 3, 6, 37, num_tokens - 1):
        nv.fill_(count)
        padded.copy_(x)
        padded[count:] = math.nan
        run(triton_cfg)
        torch.cuda.synchronize()
        expected = out.clone()
        views.intermediate.fill_(math.nan)
        views.y.fill_(math.nan)
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        what = f"{engine}, num_valid={count}"
        assert_equal(out[count:], torch.zeros_like(out[count:]), what=f"padded rows, {what}")
        if count:
            _check_rel(out[:count], expected[:count], f"{what} vs the Triton GEMM2", tol=2e-3)
            ref = experts_reference(padded, w13, w2, weights, ids, num_valid=_nv(count, num_tokens, "cuda"))
            _check_rel(out[:count], ref[:count], what)


@pytest.mark.gpu
def test_int64_addressing_past_2_31() -> None:
    """T*K*H > 2^31: y offsets and out offsets need int64; the last rows are where int32 would wrap."""
    num_experts, top_k, hidden, inter = 16, 8, 2048, 64
    num_tokens = 2**31 // (top_k * hidden) + 1000  # 132072 tokens, T*K*H = 2.16e9
    assert num_tokens * top_k * hidden > 2**31
    w13, w2 = _gpu_weights(num_experts, hidden, inter)
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weights, ids = _gpu_routing(num_tokens, top_k, num_experts)
    out = _run(x, w13, w2, weights, ids)
    tail = slice(num_tokens - 3000, num_tokens)
    ref = _reference(x[tail].contiguous(), w13, w2, weights[tail].contiguous(), ids[tail].contiguous())
    _check_rel(out[tail], ref, "last rows past 2^31")
    head = slice(0, 500)
    ref = _reference(x[head].contiguous(), w13, w2, weights[head].contiguous(), ids[head].contiguous())
    _check_rel(out[head], ref, "first rows")


@pytest.mark.gpu
def test_padding_same_config_bitwise_and_t1_vs_t1024(record_property) -> None:
    """Same T: real rows bitwise equal with or without padding (asserted). T=1024 with num_valid=1
    against T=1 (different token buckets, possibly different tiles): recorded, not asserted."""
    num_experts, top_k, hidden, inter, _ = MODEL_SHAPES["qwen3-30b-a3b"]
    w13, w2 = _gpu_weights(num_experts, hidden, inter)
    x = torch.randn(1024, hidden, device="cuda", dtype=torch.bfloat16)
    weights, ids = _gpu_routing(1024, top_k, num_experts)
    full = _run(x, w13, w2, weights, ids, num_valid=torch.tensor(1, device="cuda"))
    dirty_x = x.clone()
    dirty_x[1:] = math.nan
    dirty_ids = ids.clone()
    dirty_ids[1:] = STALE_ID
    dirty = _run(dirty_x, w13, w2, weights, dirty_ids, num_valid=1)
    assert_equal(dirty[:1], full[:1], what="same T, padding NaN vs random")
    single = _run(x[:1].contiguous(), w13, w2, weights[:1].contiguous(), ids[:1].contiguous())
    same = bool(torch.equal(single.view(torch.int16), full[:1].view(torch.int16)))
    record_property("t1_vs_t1024_bitwise", same)
    print(f"T=1 vs T=1024,num_valid=1 bitwise equal: {same}")
    _check_rel(single, full[:1], "T=1 vs T=1024 num_valid=1")


@pytest.mark.gpu
@pytest.mark.parametrize("one_launch", [True, False], ids=["one-launch", "two-launches"])
def test_both_tile_regimes_in_one_graph_qwen3(one_launch: bool, record_property) -> None:
    """Qwen3 shape, T = 1024 with the device's tuned configs, one CUDA graph replayed with the
    device num_valid crossing SMALL_BATCH_TOKENS both ways (one workspace, NaN and stale ids in
    the padding): each GEMM one launch holding both tile sets, or two launches. Valid rows match
    the reference; against an eager run with the picked regime's tiles alone they are bitwise equal
    with two launches, and close with one (bitwise recorded: the merged launch runs the small tiles
    with the main config's num_warps/num_stages)."""
    import dataclasses

    from safemoe.configs import get_config
    from safemoe.kernels.experts import SMALL_BATCH_TOKENS, small_batch_config

    num_tokens = 1024
    num_experts, top_k, hidden, inter, _ = MODEL_SHAPES["qwen3-30b-a3b"]
    device = torch.device("cuda", torch.cuda.current_device())
    main = get_config(num_tokens, num_experts, hidden, inter, top_k, torch.bfloat16, device)
    main = dataclasses.replace(main, one_launch=one_launch)
    small = small_batch_config(num_tokens, num_experts, hidden, inter, top_k, torch.bfloat16, device, main)
    if small is None:
        pytest.skip("this device's configs have no separate small-batch regime at T=1024")
    w13, w2 = _gpu_weights(num_experts, hidden, inter)
    clean_x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weights, clean_ids = _gpu_routing(num_tokens, top_k, num_experts)
    x, ids = clean_x.clone(), clean_ids.clone()
    nv = torch.tensor(num_tokens, device="cuda", dtype=torch.int32)
    ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16, "cuda")
    out = torch.empty_like(x)

    def step() -> None:
        _run(x, w13, w2, weights, ids, num_valid=NumValid(None, nv), workspace=ws, out=out, config=main,
             small_config=small)

    graph, _ = capture_graph(step)
    bitwise = {}
    for count in (1, num_tokens, 8, 9, 0, 3, SMALL_BATCH_TOKENS + 100):
        x.copy_(clean_x)
        ids.copy_(clean_ids)
        x[count:] = math.nan
        ids[count:] = STALE_ID
        nv.fill_(count)
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        assert_equal(out[count:], torch.zeros_like(out[count:]), what=f"padded rows num_valid={count}")
        if not count:
            continue
        ref = _reference(clean_x, w13, w2, weights, clean_ids, num_valid=count)
        _check_rel(out[:count], ref[:count], f"graph num_valid={count}")
        alone = _run(x, w13, w2, weights, ids, num_valid=NumValid(None, nv),
                     config=small if count <= SMALL_BATCH_TOKENS else main)
        _check_rel(out[:count], alone[:count], f"num_valid={count}: one launch vs the regime alone")
        bitwise[count] = bool(torch.equal(out[:count].view(torch.int16), alone[:count].view(torch.int16)))
        assert bitwise[count] or one_launch, f"num_valid={count}: two launches differ from the regime alone"
    record_property("bitwise_vs_regime_alone", bitwise)
    print(f"one launch vs the picked regime's tiles alone, bitwise equal per num_valid: {bitwise}")


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_few_slot_path_in_one_graph(model: str, record_property) -> None:
    """The default configs of a real shape at T = 1024, one CUDA graph replayed with the device
    num_valid in and out of the few-slot path (num_valid * K <= 16) and the small-batch regime,
    with NaN rows, stale ids and a dropped id in the padding and real rows: valid rows match the
    reference, padded rows are exact zeros, the dropped id is counted once per replay; the same
    rows run as their own few-slot batch (T = num_valid, no dispatch launch) are recorded bitwise."""
    from safemoe.kernels.experts import FEW_SLOTS

    num_tokens = 1024
    num_experts, top_k, hidden, inter, activation = MODEL_SHAPES[model]
    w13, w2 = _gpu_weights(num_experts, hidden, inter)
    clean_x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weights, clean_ids = _gpu_routing(num_tokens, top_k, num_experts)
    clean_ids[0, top_k - 1] = -1  # dropped in every replay with num_valid >= 1
    x, ids = clean_x.clone(), clean_ids.clone()
    nv = torch.tensor(num_tokens, device="cuda", dtype=torch.int32)
    ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16, "cuda")
    out = torch.empty_like(x)
    health = new_health_tensor("cuda")

    def step() -> None:
        _run(x, w13, w2, weights, ids, activation=activation, num_valid=NumValid(None, nv), workspace=ws,
             out=out, health=health)

    graph, _ = capture_graph(step)
    bitwise = {}
    few_tokens = FEW_SLOTS // top_k
    for count in (1, few_tokens, few_tokens + 1, 8, 9, num_tokens, 0, 2):
        x.copy_(clean_x)
        ids.copy_(clean_ids)
        x[count:] = math.nan
        ids[count:] = STALE_ID
        nv.fill_(count)
        out.fill_(math.nan)
        health.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert_equal(out[count:], torch.zeros_like(out[count:]), what=f"padded rows num_valid={count}")
        assert int(health[DROPPED_SLOTS]) == (1 if count else 0), f"num_valid={count}"
        if not count:
            continue
        ref = _reference(clean_x, w13, w2, weights, clean_ids, activation=activation, num_valid=count)
        _check_rel(out[:count], ref[:count], f"graph num_valid={count}")
        if count * top_k <= FEW_SLOTS:
            rows = slice(0, count)
            alone = _run(x[rows].contiguous(), w13, w2, weights[rows].contiguous(), ids[rows].contiguous(),
                         activation=activation)
            _check_rel(out[rows], alone, f"num_valid={count}: in T=1024 vs alone")
            bitwise[count] = bool(torch.equal(out[rows].view(torch.int16), alone.view(torch.int16)))
    record_property("few_slot_bitwise_vs_alone", bitwise)
    print(f"{model}: few-slot rows in T=1024 vs a batch of their own, bitwise equal: {bitwise}")


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(MODEL_SHAPES))
def test_fused_few_gemms_in_graph(model: str) -> None:
    """`fused` at the largest bucket whose every call takes the few-slot path, on a real shape: two
    CUDA graphs (fused and two launches, the device table's tiles otherwise) replayed 30 times
    over num_valid T, 1, 0 with a dropped id and NaN padding: bitwise equal every replay (the
    tiles' K loops are the same; only when GEMM2 starts differs), padded rows exact zeros, the
    dropped id counted once per replay, the counters zero after every replay."""
    import dataclasses

    from safemoe.configs import get_config
    from safemoe.kernels.experts import few_slots_bucket

    num_experts, top_k, hidden, inter, activation = MODEL_SHAPES[model]
    num_tokens = few_slots_bucket(top_k)
    w13, w2 = _gpu_weights(num_experts, hidden, inter)
    clean_x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weights, ids = _gpu_routing(num_tokens, top_k, num_experts)
    ids[0, top_k - 1] = -1
    x = clean_x.clone()
    nv = torch.tensor(num_tokens, device="cuda", dtype=torch.int32)
    base = get_config(num_tokens, num_experts, hidden, inter, top_k, torch.bfloat16, torch.device("cuda"))
    graphs, outs, healths, workspaces = [], [], [], []
    for fused in (False, True):
        cfg = dataclasses.replace(base, fused=fused)
        ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16, "cuda")
        out = torch.empty_like(x)
        health = new_health_tensor("cuda")

        def step(cfg=cfg, ws=ws, out=out, health=health) -> None:
            experts_triton(x, w13, w2, weights, ids, activation=activation, num_valid=NumValid(None, nv),
                           health=health, workspace=ws, out=out, config=cfg, few_config=cfg)

        graphs.append(capture_graph(step)[0])
        outs.append(out)
        healths.append(health)
        workspaces.append(ws)
    ref = _reference(clean_x, w13, w2, weights, ids, activation=activation, num_valid=num_tokens)
    for replay in range(30):
        count = (num_tokens, 1, 0)[replay % 3]
        x.copy_(clean_x)
        x[count:] = math.nan
        nv.fill_(count)
        for graph, out, health in zip(graphs, outs, healths, strict=True):
            out.fill_(math.nan)
            health.zero_()
            graph.replay()
        torch.cuda.synchronize()
        what = f"{model} T={num_tokens} num_valid={count} replay {replay}"
        assert torch.equal(outs[1].view(torch.int16), outs[0].view(torch.int16)), f"{what}: fused differs"
        assert_equal(outs[1][count:], torch.zeros_like(outs[1][count:]), what=what)
        assert int(healths[1][DROPPED_SLOTS]) == int(healths[0][DROPPED_SLOTS]) == (1 if count else 0), what
        sync = workspaces[1].views(num_tokens, num_experts, top_k, hidden, inter).few_sync
        assert int(sync.count_nonzero()) == 0, what
        if count == num_tokens:
            _check_rel(outs[1], ref, what)
