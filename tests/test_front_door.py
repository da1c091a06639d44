"""One front door: `RouteConfig` travels whole through every entry point, and every entry point
(`moe()`, `MoE`, `patch`, `EPMoE`) takes fp8 expert weights and a workspace, compared with the
reference. Every case takes the `device` fixture: the Triton interpreter on CPU, compiled on CUDA."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import safemoe
from helpers import assert_close, assert_equal
from safemoe import RouteConfig
from safemoe._checks import NumValid
from safemoe.reference import experts_fp8_reference, route_reference

T, E, K, H, I = 12, 8, 2, 64, 64  # noqa: E741 (the project's shape names)
FP8_TOL = (3e-2, 6e-2)  # bf16 x fp8 vs the fp8 reference: relative Frobenius error, worst / max |ref|


def _fp8_close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert bool(torch.isfinite(out).all()), f"{what}: non-finite output"
    diff = out.double() - ref.double()
    rel = float(diff.norm() / ref.double().norm().clamp_min(1e-30))
    worst = float(diff.abs().max() / ref.double().abs().max().clamp_min(1e-30))
    assert rel <= FP8_TOL[0] and worst <= FP8_TOL[1], f"{what}: relative {rel:.2e}, worst {worst:.2e}"


# -- RouteConfig ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"top_k": 0}, ValueError, "top_k"),
        ({"top_k": 2.0}, TypeError, "top_k"),
        ({"top_k": True}, TypeError, "top_k"),
        ({"top_k": 2, "scoring": "relu"}, ValueError, "scoring"),
        ({"top_k": 2, "renormalize": 1}, TypeError, "renormalize"),
        ({"top_k": 2, "n_group": 4}, ValueError, "n_group and topk_group"),
        ({"top_k": 2, "n_group": 0, "topk_group": 1}, ValueError, "n_group"),
        ({"top_k": 2, "n_group": 2, "topk_group": 3}, ValueError, "topk_group"),
        ({"top_k": 2, "routed_scaling_factor": math.inf}, ValueError, "routed_scaling_factor"),
        ({"top_k": 2, "routed_scaling_factor": -1.0}, ValueError, "routed_scaling_factor"),
        ({"top_k": 2, "routed_scaling_factor": "2"}, TypeError, "routed_scaling_factor"),
        ({"top_k": 2, "n_group": 2, "topk_group": 1, "group_score": "sum"}, ValueError, "group_score"),
        ({"top_k": 2, "group_score": "max"}, ValueError, "needs n_group"),
    ],
)
def test_route_config_rejects(fields, error, match):
    with pytest.raises(error, match=match):
        RouteConfig(**fields)


def test_route_config_is_frozen_and_checks_e():
    config = RouteConfig(4, scoring="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2)
    assert config.routed_scaling_factor == 2.0 and isinstance(config.routed_scaling_factor, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.top_k = 3  # type: ignore[misc]
    assert config.check(8) is config
    with pytest.raises(ValueError, match="must divide"):
        config.check(6)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, E=3\]"):
        RouteConfig(4).check(3)
    with pytest.raises(ValueError, match="kept groups"):
        RouteConfig(5, n_group=4, topk_group=2).check(8)
    assert config.replace(top_k=2).top_k == 2
    # The op schema is generated from the fields: one argument per field, in order.
    names = [arg.split()[-1] for arg in RouteConfig.op_schema().split(", ")]
    assert names == [f.name for f in dataclasses.fields(RouteConfig)]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_route_takes_the_config_whole_or_as_options(device, backend):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(T, E, generator=gen).to(device)
    bias = (torch.randn(E, generator=gen) / 8).to(device)
    options = dict(scoring="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5, renormalize=True)
    whole = safemoe.route(logits, RouteConfig(3, **options), bias=bias, num_valid=9, backend=backend)
    split = safemoe.route(logits, 3, bias=bias, num_valid=9, backend=backend, **options)
    nv = NumValid(9, None)
    want_w, want_ids = route_reference(logits, RouteConfig(3, **options), bias=bias, num_valid=nv)
    assert_equal(whole.ids, split.ids)
    assert_equal(whole.weights, split.weights)
    assert_equal(whole.ids, want_ids)
    assert_close(whole.weights, want_w, what="RouteConfig route vs reference")
    with pytest.raises(TypeError, match="given with a RouteConfig"):
        safemoe.route(logits, RouteConfig(3), scoring="sigmoid")
    with pytest.raises(TypeError, match=r"unknown routing option\(s\) \['foo'\]"):
        safemoe.route(logits, 3, foo=1)
    with pytest.raises(TypeError, match="foo"):
        safemoe.moe(logits.new_zeros(T, H), logits, *_weights(torch.float32, device), 2, foo=1)


def test_modules_hold_the_config_whole():
    config = RouteConfig(2, scoring="sigmoid", renormalize=False, routed_scaling_factor=1.5)
    moe = safemoe.MoE(H, I, E, config, backend="reference")
    assert moe.route_config is config and moe.gate.config is config and moe.top_k == 2
    by_options = safemoe.MoE(H, I, E, 2, scoring="sigmoid", renormalize=False, routed_scaling_factor=1.5)
    assert by_options.route_config == config
    assert safemoe.MoE(H, I, E, top_k=2).route_config == RouteConfig(2)  # the old keyword form
    with pytest.raises(ValueError, match=r"top_k must be in \[1, E=8\]"):
        safemoe.MoE(H, I, E, 9)


# -- fp8 and workspaces through every entry point -------------------------------------------------


def _weights(dtype: torch.dtype, device: str = "cpu", seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=gen) / math.sqrt(H)
    w2 = torch.randn(E, H, I, generator=gen) / math.sqrt(I)
    return w13.to(dtype).to(device), w2.to(dtype).to(device)


def _padded_x(num_valid: int, device: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    x[num_valid:] = math.nan
    return x.to(device)


@pytest.mark.parametrize("mode", ["per_tensor", "block"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_moe_function_takes_fp8_and_a_workspace(device, mode, backend):
    w13, w2 = _weights(torch.float32, device)
    q13, q2, s13, s2 = safemoe.quantize_experts(w13, w2, mode)
    x = _padded_x(9, device)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(3)).to(device)
    config = RouteConfig(K, scoring="sigmoid")
    ws = safemoe.Workspace(T, E, K, H, I, torch.bfloat16, device, fp8=True)
    health = safemoe.new_health_tensor(device)
    out = safemoe.moe(x, logits, q13, q2, config, num_valid=9, backend=backend, workspace=ws,
                      w13_scale=s13, w2_scale=s2, health=health)  # fmt: skip
    weights, ids = route_reference(logits, config, num_valid=NumValid(9, None))
    want = experts_fp8_reference(x, q13, q2, s13, s2, weights, ids, num_valid=NumValid(9, None))
    _fp8_close(out[:9], want[:9], f"moe() fp8 {mode} {backend}")
    assert_equal(out[9:], torch.zeros_like(out[9:]), what="padded rows")
    assert int(health[safemoe.health.PADDED_ROWS]) == T - 9
    # The workspace is checked on every backend: one without fp8 buffers is refused up front.
    plain = safemoe.Workspace(T, E, K, H, I, torch.bfloat16, device)
    with pytest.raises(ValueError, match="fp8=True"):
        safemoe.moe(x, logits, q13, q2, config, backend=backend, workspace=plain, w13_scale=s13, w2_scale=s2)
    with pytest.raises(TypeError, match="workspace"):
        safemoe.moe(x, logits, q13, q2, config, backend=backend, workspace="x", w13_scale=s13, w2_scale=s2)


@pytest.mark.parametrize("mode", ["per_tensor", "block"])
def test_module_quantize_runs_the_fp8_kernels(device, mode):
    moe = safemoe.MoE(H, I, E, RouteConfig(K), shared_intermediate_size=32, shared_expert_gate=True,
                      dtype=torch.bfloat16, device=device, backend="triton")  # fmt: skip
    x = _padded_x(7, device)
    with torch.no_grad():
        dense = moe(x, num_valid=7)
        w13, w2 = moe.w13.detach().clone(), moe.w2.detach().clone()
        assert moe.quantize_(mode) is moe and moe.quant == mode
        assert moe.w13.dtype == torch.float8_e4m3fn and moe.w13_scale is not None
        q13, q2, s13, s2 = safemoe.quantize_experts(w13, w2, mode)
        for have, want in ((moe.w13, q13), (moe.w2, q2), (moe.w13_scale, s13), (moe.w2_scale, s2)):
            assert_equal(have.view(torch.uint8), want.view(torch.uint8), what="quantize_ = quantize_experts")
        got = moe(x, num_valid=7)
        moe.backend = moe.gate.backend = "reference"
        want = moe(x, num_valid=7)
    _fp8_close(got[:7], want[:7], f"MoE.quantize_({mode}) triton vs reference")
    # fp8 against the unquantised layer: the quantisation error only.
    assert float((got[:7].float() - dense[:7].float()).norm() / dense[:7].float().norm()) < 0.12
    assert_equal(got[7:], torch.zeros_like(got[7:]), what="padded rows")
    with pytest.raises(ValueError, match="fp8 already"):
        moe.quantize_(mode)
    with pytest.raises(ValueError, match="fp8=True"):
        moe.set_workspace(safemoe.Workspace(T, E, K, H, I, torch.bfloat16, device))
    moe.set_workspace(safemoe.Workspace(T, E, K, H, I, torch.bfloat16, device, fp8=True))
    moe.backend = moe.gate.backend = "triton"
    with torch.no_grad():
        assert_equal(moe(x, num_valid=7), got, what="with a shared fp8 workspace")


def test_module_quantize_rejects():
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        safemoe.MoE(H, I, E, K).quantize_("block")  # fp32 activations
    moe = safemoe.MoE(H, I, E, K, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="mode"):
        moe.quantize_("int4")
    moe.set_workspace(safemoe.Workspace(T, E, K, H, I, torch.bfloat16, "cpu"))
    with pytest.raises(ValueError, match="fp8 buffers"):
        moe.quantize_("block")


def test_patch_quantizes_every_block(device):
    transformers = pytest.importorskip("transformers")
    from safemoe.integrations.transformers import patch, patched_blocks

    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=H, intermediate_size=64, moe_intermediate_size=I, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=E, num_experts_per_tok=K,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).to(device).eval()
    ids = torch.randint(0, 64, (2, 6), device=device)
    with torch.no_grad():
        stock = model(ids).logits.float()
    with pytest.raises(ValueError, match="quant"):
        patch(model, quant="int4")
    with pytest.raises(ValueError, match="fp8=True"):
        patch(model, quant="block", workspace=safemoe.Workspace(12, E, K, H, I, torch.bfloat16, device))
    patch(model, quant="block", backend="triton")
    blocks = patched_blocks(model)
    assert len(blocks) == 2 and all(b.moe.quant == "block" for b in blocks)
    with torch.no_grad():
        got = model(ids).logits.float()
    assert bool(torch.isfinite(got).all())
    assert float((got - stock).norm() / stock.norm()) < 0.05, "fp8 block model vs the bf16 model"
    fp32 = transformers.AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        patch(fp32, quant="per_tensor")
