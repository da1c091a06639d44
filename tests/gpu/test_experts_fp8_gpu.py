"""fp8 (e4m3) expert kernels compiled on a CUDA GPU: both modes at real model shapes against the
dequantised fp32 reference, row isolation with NaN/Inf rows, padding isolation, CUDA-graph replay
with a changed device num_valid, determinism.

Tolerances: against `experts_fp8_reference` (same quantisation rules, bit-identical activation
codes) the kernels differ by accumulation order, Hopper's fp8 MMA accumulation (per-tensor mode
accumulates the whole K in the tensor cores' accumulator, as torch's use_fast_accum does; block
mode promotes every 128-wide K step to fp32) and the bf16 rounding of the intermediate before it
is re-quantised (a value can land one fp8 step away): relative Frobenius error <= 3e-2 and every
element within 0.1 of max|ref|. Against the unquantised bf16 experts the fp8 error itself is
~6.5% (e4m3 keeps 3 mantissa bits): <= 12%.

Tests named `test_small_*` use small shapes only, so they also run under compute-sanitizer:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \\
        python3 -m pytest tests/gpu/test_experts_fp8_gpu.py -k "small and not graph" -q
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers import STALE_ID, assert_equal, garbage_ids, poisoned

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda"
MODES = ("block", "per_tensor")
REL_TOL, MAX_TOL, FP8_ERROR_TOL = 3e-2, 1e-1, 0.12
# (E, K, H, I, activation, T)
MODEL_SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768, "silu", 200),
    "deepseek-v3": (256, 8, 7168, 2048, "silu", 96),
    "mixtral-8x7b": (8, 2, 4096, 14336, "silu", 64),
    "gpt-oss-120b": (128, 4, 2880, 2880, "swigluoai", 80),  # H, I not multiples of 128
}


def _nv(value, num_tokens: int):
    from safemoe._checks import check_num_valid

    return check_num_valid(value, num_tokens, torch.device(DEVICE, torch.cuda.current_device()))


def _fp8_weights(num_experts: int, hidden: int, inter: int, mode: str, seed: int = 0):
    """(bf16 w13, bf16 w2, (fp8 w13, fp8 w2, Fp8Weights))."""
    from safemoe._checks import check_fp8_weights
    from safemoe.fp8 import quantize_experts

    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    w13.mul_(1.0 / math.sqrt(hidden))
    w2 = torch.randn(num_experts, hidden, inter, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    w2.mul_(1.0 / math.sqrt(inter))
    q13, q2, s13, s2 = quantize_experts(w13, w2, mode)
    return w13, w2, (q13, q2, check_fp8_weights(q13, q2, s13, s2))


def _routing(num_tokens: int, top_k: int, num_experts: int, seed: int = 1):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, device=DEVICE, generator=gen)
    ids = torch.topk(scores, top_k, dim=1).indices.to(torch.int32)
    return torch.rand(num_tokens, top_k, device=DEVICE, generator=gen), ids


def _run(x, fp8w, weights, ids, *, activation="silu", num_valid=None, workspace=None, out=None, config=None):
    from safemoe.kernels.experts import experts_triton

    q13, q2, spec = fp8w
    return experts_triton(x, q13, q2, weights, ids, activation=activation,
                          num_valid=_nv(num_valid, x.shape[0]), health=None, workspace=workspace, out=out,
                          config=config, fp8=spec)


def _reference(x, fp8w, weights, ids, *, activation="silu", num_valid=None):
    from safemoe.reference import experts_fp8_reference

    q13, q2, spec = fp8w
    return experts_fp8_reference(x, q13, q2, spec.w13_scale, spec.w2_scale, weights, ids,
                                 activation=activation, num_valid=_nv(num_valid, x.shape[0]))


def _check(out: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    assert bool(torch.isfinite(out).all()), f"{what}: non-finite output"
    diff = out.float() - ref.float()
    rel = float(diff.norm() / ref.float().norm().clamp_min(1e-30))
    worst = float(diff.abs().max() / ref.float().abs().max().clamp_min(1e-30))
    assert rel <= REL_TOL and worst <= MAX_TOL, f"{what}: rel error {rel:.3g}, worst {worst:.3g} of max|ref|"
    return rel


def _workspace(num_tokens, num_experts, top_k, hidden, inter):
    from safemoe.workspace import Workspace

    return Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16, DEVICE, fp8=True)


# ---------------------------------------------------------------------------------------------
# Small shapes (also run under compute-sanitizer)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_tokens", [1, 7, 129, 300])
def test_small_matches_reference(mode: str, num_tokens: int) -> None:
    """H and I not multiples of 128; decode tiles (T <= 8), mid tiles, and the small-batch switch."""
    num_experts, top_k, hidden, inter = 16, 4, 320, 200
    _, _, fp8w = _fp8_weights(num_experts, hidden, inter, mode)
    x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = _routing(num_tokens, top_k, num_experts)
    out = _run(x, fp8w, weights, ids, out=poisoned(x.shape, torch.bfloat16, DEVICE))
    _check(out, _reference(x, fp8w, weights, ids), f"{mode} T={num_tokens}")


@pytest.mark.parametrize("mode", MODES)
def test_small_tma_weights_and_pdl(mode: str) -> None:
    """fp8 weight tiles through TMA descriptors, every launch with programmatic dependent launch."""
    from safemoe.configs import ExpertsConfig, GemmTiles

    num_experts, top_k, hidden, inter, num_tokens = 16, 4, 384, 256, 129
    _, _, fp8w = _fp8_weights(num_experts, hidden, inter, mode)
    x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = _routing(num_tokens, top_k, num_experts)
    tiles = GemmTiles(block_n=64, block_k=128, group_m=4, num_warps=4, num_stages=4, tma=True)
    cfg = ExpertsConfig(block_m=32, gemm1=tiles, gemm2=tiles, pdl=True)
    out = _run(x, fp8w, weights, ids, config=cfg)
    _check(out, _reference(x, fp8w, weights, ids), f"{mode} TMA + PDL")


@pytest.mark.parametrize("mode", MODES)
def test_small_nonfinite_rows_and_padding_isolation(mode: str) -> None:
    """NaN/+Inf/-Inf in single real rows: those rows all NaN, every other real row bitwise what it
    is without the poison; NaN/Inf/garbage padding rows: real rows bitwise unchanged, padded rows
    exact zeros; the workspace poisoned beforehand."""
    num_tokens, valid, num_experts, top_k, hidden, inter = 260, 190, 16, 4, 256, 128
    _, _, fp8w = _fp8_weights(num_experts, hidden, inter, mode)
    x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = _routing(num_tokens, top_k, num_experts)
    ws = _workspace(num_tokens, num_experts, top_k, hidden, inter)
    f8 = ws.fp8_views(num_tokens, num_experts, top_k, hidden, inter, 128)
    for buffer in (f8.x, f8.inter):
        buffer.view(torch.uint8).fill_(0x7F)
    f8.x_scale.fill_(math.nan)
    f8.inter_scale.fill_(math.nan)
    nv = torch.tensor(valid, device=DEVICE)
    clean_x, clean_ids, clean_w = x.clone(), ids.clone(), weights.clone()
    clean_x[valid:], clean_ids[valid:], clean_w[valid:] = 0, -1, 0
    clean = _run(clean_x, fp8w, clean_w, clean_ids, num_valid=nv, workspace=ws)
    dirty_x, dirty_ids, dirty_w = x.clone(), ids.clone(), weights.clone()
    bad_rows = {3: math.nan, 50: math.inf, 120: -math.inf}
    for row, value in bad_rows.items():
        dirty_x[row, row % hidden] = value
    dirty_x[valid:] = math.nan
    dirty_x[valid::5] = math.inf
    dirty_w[valid:] = math.nan
    dirty_ids[valid:] = garbage_ids(num_tokens - valid, top_k, num_experts,
                                    generator=torch.Generator().manual_seed(3)).to(DEVICE)
    dirty_ids[valid::3] = STALE_ID
    dirty = _run(dirty_x, fp8w, dirty_w, dirty_ids, num_valid=nv, workspace=ws,
                 out=poisoned(x.shape, torch.bfloat16, DEVICE))
    others = [r for r in range(valid) if r not in bad_rows]
    assert_equal(dirty[others], clean[others], what="rows without poison")
    assert bool(dirty[list(bad_rows)].isnan().all()), "a poisoned row must come out NaN"
    assert_equal(dirty[valid:], torch.zeros_like(dirty[valid:]), what="padded rows")
    _check(clean[:valid], _reference(x, fp8w, weights, ids, num_valid=valid)[:valid], f"{mode} clean rows")


@pytest.mark.parametrize("mode", MODES)
def test_small_deterministic_and_public_api(mode: str) -> None:
    """Five runs bitwise equal; safemoe.experts(..., w13_scale, w2_scale) is the same call."""
    import safemoe

    _, _, fp8w = _fp8_weights(32, 256, 128, mode)
    x = torch.randn(700, 256, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = _routing(700, 4, 32)
    first = _run(x, fp8w, weights, ids)
    for _ in range(4):
        assert_equal(_run(x, fp8w, weights, ids), first, what="run to run")
    q13, q2, spec = fp8w
    public = safemoe.experts(x, q13, q2, safemoe.Routing(weights, ids), w13_scale=spec.w13_scale,
                             w2_scale=spec.w2_scale)
    assert_equal(public, first, what="public API")


@pytest.mark.parametrize("mode", MODES)
def test_small_graph_replay_with_num_valid_changed(mode: str) -> None:
    """fp8 experts captured in one CUDA graph, replayed with the device num_valid changed in place:
    each replay bitwise equals an eager call with that num_valid; padded rows exact zeros."""
    num_tokens, num_experts, top_k, hidden, inter = 96, 16, 4, 256, 128
    _, _, fp8w = _fp8_weights(num_experts, hidden, inter, mode)
    x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = _routing(num_tokens, top_k, num_experts)
    ws = _workspace(num_tokens, num_experts, top_k, hidden, inter)
    nv = torch.tensor(num_tokens, device=DEVICE, dtype=torch.int32)
    out = torch.empty_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _run(x, fp8w, weights, ids, num_valid=nv, workspace=ws, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run(x, fp8w, weights, ids, num_valid=nv, workspace=ws, out=out)
    eager_ws = _workspace(num_tokens, num_experts, top_k, hidden, inter)
    for valid in (96, 1, 0, 37, 95):
        nv.fill_(valid)
        out.fill_(math.nan)
        graph.replay()
        eager = _run(x, fp8w, weights, ids, num_valid=torch.tensor(valid, device=DEVICE), workspace=eager_ws)
        assert_equal(out, eager, what=f"replay num_valid={valid}")
        assert_equal(out[valid:], torch.zeros_like(out[valid:]), what=f"padded rows at {valid}")


# ---------------------------------------------------------------------------------------------
# Real model shapes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(MODEL_SHAPES))
def test_model_shapes(case: str, mode: str) -> None:
    from safemoe.reference import experts_reference

    num_experts, top_k, hidden, inter, activation, num_tokens = MODEL_SHAPES[case]
    w13, w2, fp8w = _fp8_weights(num_experts, hidden, inter, mode)
    x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = _routing(num_tokens, top_k, num_experts)
    out = _run(x, fp8w, weights, ids, activation=activation, num_valid=num_tokens - 5,
               out=poisoned(x.shape, torch.bfloat16, DEVICE))
    ref = _reference(x, fp8w, weights, ids, activation=activation, num_valid=num_tokens - 5)
    rel = _check(out, ref, f"{case} {mode}")
    assert_equal(out[num_tokens - 5 :], torch.zeros_like(out[num_tokens - 5 :]), what="padded rows")
    unquantised = experts_reference(x, w13, w2, weights, ids, activation=activation,
                                    num_valid=_nv(num_tokens - 5, num_tokens))
    error = float((out.float() - unquantised.float()).norm() / unquantised.float().norm())
    print(f"{case} {mode}: rel error vs fp8 reference {rel:.2e}, vs bf16 experts {error:.3f}")
    assert error <= FP8_ERROR_TOL, f"{case} {mode}: fp8 error vs the bf16 experts {error:.3f}"


@pytest.mark.parametrize("mode", MODES)
def test_prefill_tiles_qwen3(mode: str) -> None:
    """T = 4096 on the Qwen3 shape: the 128-row prefill tiles (and their dequantisation) at scale."""
    num_experts, top_k, hidden, inter, activation, _ = MODEL_SHAPES["qwen3-30b-a3b"]
    _, _, fp8w = _fp8_weights(num_experts, hidden, inter, mode)
    x = torch.randn(4096, hidden, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = _routing(4096, top_k, num_experts)
    out = _run(x, fp8w, weights, ids, activation=activation)
    _check(out, _reference(x, fp8w, weights, ids, activation=activation), f"qwen3 T=4096 {mode}")
