"""Expert kernels compiled on a CUDA GPU: bf16 at real model shapes, CUDA-graph replay with a
changed device num_valid, int64 addressing past 2^31, token-count boundaries, determinism.

Tests named `test_small_*` use small shapes only, so they also run under compute-sanitizer:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \\
        python3 -m pytest tests/gpu/test_experts_gpu.py -k small -q
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
# (E, K, H, I, activation)
MODEL_SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768, "silu"),
    "mixtral-8x7b": (8, 2, 4096, 14336, "silu"),
    "gpt-oss-120b": (128, 4, 2880, 2880, "swigluoai"),
    "deepseek-v3": (256, 8, 7168, 2048, "silu"),
}


def _nv(value: int | torch.Tensor | None, num_tokens: int):
    from safemoe._checks import check_num_valid

    return check_num_valid(value, num_tokens, torch.device(DEVICE, torch.cuda.current_device()))


def _weights(num_experts: int, hidden: int, inter: int, dtype=torch.bfloat16, seed: int = 0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=DEVICE, dtype=dtype, generator=gen)
    w13.mul_(1.0 / math.sqrt(hidden))
    w2 = torch.randn(num_experts, hidden, inter, device=DEVICE, dtype=dtype, generator=gen)
    w2.mul_(1.0 / math.sqrt(inter))
    return w13, w2


def _routing(num_tokens: int, top_k: int, num_experts: int, seed: int = 1):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, device=DEVICE, generator=gen)
    ids = torch.topk(scores, top_k, dim=1).indices.to(torch.int32)
    weights = torch.rand(num_tokens, top_k, device=DEVICE, generator=gen)
    return weights, ids


def _run(x, w13, w2, weights, ids, *, activation="silu", num_valid=None, health=None, workspace=None,
         out=None, config=None):
    from safemoe.kernels.experts import experts_triton

    return experts_triton(x, w13, w2, weights, ids, activation=activation,
                          num_valid=_nv(num_valid, x.shape[0]), health=health, workspace=workspace,
                          out=out, config=config)


def _reference(x, w13, w2, weights, ids, *, activation="silu", num_valid=None):
    from safemoe.reference import experts_reference

    return experts_reference(x, w13, w2, weights, ids, activation=activation,
                             num_valid=_nv(num_valid, x.shape[0]))


def _check_rel(out: torch.Tensor, ref: torch.Tensor, what: str, tol: float = 1e-2) -> float:
    """Frobenius-relative error below tol, nothing non-finite, worst element within 4 tol of max|ref|."""
    assert bool(torch.isfinite(out).all()), f"{what}: non-finite output"
    diff = out.float() - ref.float()
    rel = float(diff.norm() / ref.float().norm().clamp_min(1e-30))
    worst = float(diff.abs().max() / ref.float().abs().max().clamp_min(1e-30))
    assert rel < tol and worst < 4 * tol, f"{what}: rel error {rel:.3g}, worst {worst:.3g} of max|ref|"
    return rel


# ---------------------------------------------------------------------------------------------
# Small shapes (also run under compute-sanitizer)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 7, 17, 127, 128, 129, 255, 256, 257])
def test_small_boundaries_bf16(num_tokens: int) -> None:
    num_experts, top_k, hidden, inter = 16, 4, 128, 64
    w13, w2 = _weights(num_experts, hidden, inter)
    x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = _routing(num_tokens, top_k, num_experts)
    out = _run(x, w13, w2, weights, ids, out=poisoned(x.shape, torch.bfloat16, DEVICE))
    _check_rel(out, _reference(x, w13, w2, weights, ids), f"T={num_tokens}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_small_fp32_fp16_all_activations(dtype: torch.dtype) -> None:
    num_experts, top_k, hidden, inter, num_tokens = 8, 2, 96, 80, 50  # K tails and N tails
    w13, w2 = _weights(num_experts, hidden, inter, dtype)
    x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=dtype)
    weights, ids = _routing(num_tokens, top_k, num_experts)
    for activation in ("silu", "gelu", "swigluoai"):
        out = _run(x, w13, w2, weights, ids, activation=activation)
        ref = _reference(x, w13, w2, weights, ids, activation=activation)
        _check_rel(out, ref, f"{activation} {dtype}", tol=1e-5 if dtype == torch.float32 else 2e-3)


def test_small_garbage_ids_and_padding_bitwise() -> None:
    """Stale/duplicate/-1/out-of-range ids dropped and counted exactly; padding rows with NaN and
    garbage leave real rows bitwise identical; padded rows exact zeros; workspace poisoned."""
    import safemoe
    from safemoe.health import DROPPED_SLOTS, new_health_tensor
    from safemoe.reference import dispatch_reference
    from safemoe.workspace import Workspace

    num_tokens, valid, num_experts, top_k, hidden, inter = 300, 211, 12, 4, 128, 64
    w13, w2 = _weights(num_experts, hidden, inter)
    gen = torch.Generator().manual_seed(5)
    ids = garbage_ids(num_tokens, top_k, num_experts, generator=gen).to(DEVICE)
    x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    weights = torch.rand(num_tokens, top_k, device=DEVICE)
    ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16, DEVICE)
    views = ws.views(num_tokens, num_experts, top_k, hidden, inter)
    views.intermediate.fill_(math.nan)
    views.y.fill_(math.nan)
    views.sorted_slots.fill_(STALE_ID)
    health = new_health_tensor(DEVICE)
    clean_x, clean_w, clean_ids = x.clone(), weights.clone(), ids.clone()
    clean_x[valid:], clean_w[valid:], clean_ids[valid:] = 0, 0, -1
    nv = torch.tensor(valid, device=DEVICE)
    clean = safemoe.experts(clean_x, w13, w2, safemoe.Routing(clean_w, clean_ids), num_valid=nv,
                            backend="triton", health=health, workspace=ws)
    dropped = dispatch_reference(ids, num_experts, _nv(valid, num_tokens)).dropped
    assert int(health[DROPPED_SLOTS]) == dropped > 0
    dirty_x, dirty_w, dirty_ids = x.clone(), weights.clone(), ids.clone()
    dirty_x[valid:], dirty_w[valid:], dirty_ids[valid:] = math.nan, math.nan, STALE_ID
    dirty = _run(dirty_x, w13, w2, dirty_w, dirty_ids, num_valid=nv, workspace=ws,
                 out=poisoned(x.shape, torch.bfloat16, DEVICE))
    assert_equal(dirty[:valid], clean[:valid], what="real rows")
    assert_equal(dirty[valid:], torch.zeros_like(dirty[valid:]), what="padded rows")
    _check_rel(clean[:valid], _reference(x, w13, w2, weights, ids, num_valid=valid)[:valid], "garbage ids")
    assert int(views.counts.abs().sum()) == 0 and int(views.ticket.item()) == 0, "counters not reset"


def test_small_dispatch_multi_chunk_against_reference() -> None:
    """Several count programs race for the ticket (only visible compiled): layout still exact."""
    from safemoe.kernels.dispatch import dispatch_triton
    from safemoe.reference import dispatch_reference

    gen = torch.Generator().manual_seed(9)
    for num_tokens, num_experts, top_k, block_m in ((5000, 8, 2, 16), (3000, 128, 8, 64),
                                                    (1200, 256, 8, 128)):
        ids = garbage_ids(num_tokens, top_k, num_experts, generator=gen).to(DEVICE)
        nv = _nv(num_tokens - 3, num_tokens)
        for _ in range(3):
            got = dispatch_triton(ids, num_experts, nv, block_m)
            ref = dispatch_reference(ids, num_experts, nv)
            for expert in range(num_experts):
                part = ref.sorted_slots[ref.offsets[expert] : ref.offsets[expert + 1]]
                expected = torch.sort(part).values.cpu()
                assert torch.equal(got.expert_slots(expert), expected), f"expert {expert}"
            blocks = (ref.counts.long().cpu() + block_m - 1) // block_m
            assert torch.equal(got.block_end, torch.cumsum(blocks, 0))


def test_small_zero_tokens_and_zero_valid() -> None:
    w13, w2 = _weights(8, 64, 32)
    x = torch.empty(0, 64, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = _routing(0, 2, 8)
    assert _run(x, w13, w2, weights, ids).shape == (0, 64)
    x = torch.full((5, 64), math.nan, device=DEVICE, dtype=torch.bfloat16)
    ids = torch.full((5, 2), STALE_ID, device=DEVICE, dtype=torch.int32)
    out = _run(x, w13, w2, torch.full((5, 2), math.nan, device=DEVICE), ids,
               num_valid=torch.tensor(0, device=DEVICE), out=poisoned((5, 64), torch.bfloat16, DEVICE))
    assert_equal(out, torch.zeros_like(out))


def test_small_deterministic_run_to_run() -> None:
    w13, w2 = _weights(32, 256, 128)
    x = torch.randn(700, 256, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = _routing(700, 4, 32)
    first = _run(x, w13, w2, weights, ids)
    for _ in range(4):
        assert_equal(_run(x, w13, w2, weights, ids), first, what="run to run")


def test_small_graph_replay_with_num_valid_changed() -> None:
    """Route + experts captured in one CUDA graph; replays with the device num_valid changed."""
    import safemoe
    from safemoe.health import DROPPED_SLOTS, new_health_tensor
    from safemoe.reference import moe_reference
    from safemoe.workspace import Workspace

    num_tokens, num_experts, top_k, hidden, inter = 96, 16, 4, 128, 64
    w13, w2 = _weights(num_experts, hidden, inter)
    x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    logits = torch.randn(num_tokens, num_experts, device=DEVICE, dtype=torch.bfloat16)
    nv = torch.tensor(num_tokens, device=DEVICE, dtype=torch.int32)
    ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16, DEVICE)
    health = new_health_tensor(DEVICE)
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

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer()
    for count in (num_tokens, 1, 0, 37, num_tokens - 1):
        nv.fill_(count)
        x[count:] = math.nan
        logits[count:] = math.nan
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        ref = moe_reference(x, logits, w13, w2, top_k, num_valid=_nv(count, num_tokens))
        if count:
            _check_rel(out[:count], ref[:count], f"graph num_valid={count}")
        assert_equal(out[count:], torch.zeros_like(out[count:]), what=f"padded rows num_valid={count}")
        x[count:] = torch.randn(num_tokens - count, hidden, device=DEVICE, dtype=torch.bfloat16)
        logits[count:] = torch.randn(num_tokens - count, num_experts, device=DEVICE, dtype=torch.bfloat16)
    assert int(health[DROPPED_SLOTS]) == 0


def test_small_pdl_and_tma_configs_in_graph() -> None:
    """Programmatic dependent launch and TMA weight loads, captured in a graph and replayed with a
    changed num_valid: the same bits as plain launches (PDL) and close to pointer loads (TMA)."""
    from safemoe.configs import ExpertsConfig, GemmTiles
    from safemoe.workspace import Workspace

    num_tokens, num_experts, top_k, hidden, inter = 200, 16, 4, 256, 192
    w13, w2 = _weights(num_experts, hidden, inter)
    x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = _routing(num_tokens, top_k, num_experts)
    nv = torch.tensor(num_tokens, device=DEVICE, dtype=torch.int32)
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
            ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16, DEVICE)
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
# Real model shapes and large token counts
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", list(MODEL_SHAPES))
def test_model_shapes_bf16(model: str) -> None:
    num_experts, top_k, hidden, inter, activation = MODEL_SHAPES[model]
    w13, w2 = _weights(num_experts, hidden, inter)
    for num_tokens in (1, 64, 1000) if num_experts > 8 else (3, 300):
        x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
        weights, ids = _routing(num_tokens, top_k, num_experts, seed=num_tokens)
        out = _run(x, w13, w2, weights, ids, activation=activation)
        ref = _reference(x, w13, w2, weights, ids, activation=activation)
        _check_rel(out, ref, f"{model} T={num_tokens}")
    del w13, w2
    torch.cuda.empty_cache()


@pytest.mark.parametrize("num_tokens", [4095, 4096, 4097, 65535, 65536, 65537])
def test_token_boundaries(num_tokens: int) -> None:
    num_experts, top_k, hidden, inter = 64, 4, 256, 128
    w13, w2 = _weights(num_experts, hidden, inter)
    x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = _routing(num_tokens, top_k, num_experts, seed=num_tokens)
    valid = num_tokens - 2
    x[valid:] = math.nan
    out = _run(x, w13, w2, weights, ids, num_valid=torch.tensor(valid, device=DEVICE))
    ref = _reference(x, w13, w2, weights, ids, num_valid=valid)
    _check_rel(out[:valid], ref[:valid], f"T={num_tokens}")
    assert_equal(out[valid:], torch.zeros_like(out[valid:]))


def test_int64_addressing_past_2_31() -> None:
    """T*K*H > 2^31: y offsets and out offsets need int64; the last rows are where int32 would wrap."""
    num_experts, top_k, hidden, inter = 16, 8, 2048, 64
    num_tokens = 2**31 // (top_k * hidden) + 1000  # 132072 tokens, T*K*H = 2.16e9
    assert num_tokens * top_k * hidden > 2**31
    w13, w2 = _weights(num_experts, hidden, inter)
    x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = _routing(num_tokens, top_k, num_experts)
    out = _run(x, w13, w2, weights, ids)
    tail = slice(num_tokens - 3000, num_tokens)
    ref = _reference(x[tail].contiguous(), w13, w2, weights[tail].contiguous(), ids[tail].contiguous())
    _check_rel(out[tail], ref, "last rows past 2^31")
    head = slice(0, 500)
    ref = _reference(x[head].contiguous(), w13, w2, weights[head].contiguous(), ids[head].contiguous())
    _check_rel(out[head], ref, "first rows")


def test_padding_same_config_bitwise_and_t1_vs_t1024(record_property) -> None:
    """Same T: real rows bitwise equal with or without padding (asserted). T=1024 with num_valid=1
    against T=1 (different token buckets, possibly different tiles): recorded, not asserted."""
    num_experts, top_k, hidden, inter, _ = MODEL_SHAPES["qwen3-30b-a3b"]
    w13, w2 = _weights(num_experts, hidden, inter)
    x = torch.randn(1024, hidden, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = _routing(1024, top_k, num_experts)
    full = _run(x, w13, w2, weights, ids, num_valid=torch.tensor(1, device=DEVICE))
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
