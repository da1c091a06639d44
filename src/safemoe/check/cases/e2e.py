"""Family 7, end to end: the production chain (NaN router logits -> routing -> experts) through
`moe`; `safemoe.MoE` layers shaped like real models (Qwen3, DeepSeek-V3 with groups, bias and a
shared expert, gpt-oss with biases and swigluoai, Qwen2 with a gated shared expert); and a tiny
transformers MoE block of every family safemoe patches, run patched (safemoe backends) or as
transformers runs it with each experts implementation (hf-* peers), on NaN-poisoned padding.
The transformers cases need transformers (n/a without it)."""

from __future__ import annotations

import copy
import importlib
import math
from typing import Any

import torch
from torch import nn

import safemoe
from safemoe._checks import NumValid
from safemoe.check.cases.common import (
    NUM_VALID_FORMS,
    dtypes,
    expect_padding_zeros,
    num_valid_arg,
    padded_logits,
    route_modes,
)
from safemoe.check.inputs import expert_weights, interleave_with_tie_free, tokens, top_k_for
from safemoe.check.invariants import clear_rows, expect_bitwise, expect_close, expect_finite
from safemoe.check.registry import CaseContext, CheckFailure, NotApplicable, Plan, case
from safemoe.health import NONFINITE_ROWS, new_health_tensor
from safemoe.reference import moe_reference
from safemoe.route_config import RouteConfig

# transformers' blocks round every intermediate to the hidden dtype: the tolerance against them is
# that of a peer (see Adapter.tolerance_scale).
HF_SCALE = 4.0
CHAIN_KINDS = interleave_with_tie_free(["all_nan", "mixed_nonfinite", "all_pos_inf", "one_nan_odd"])


def _chain_params(plan: Plan) -> list[dict[str, Any]]:
    return plan.pairs(dtype=dtypes(plan), mode=route_modes(plan))


@case("e2e.nan_router_chain", ops=("moe",), params=_chain_params)
def nan_router_chain(ctx: CaseContext, **p: Any) -> None:
    """moe with NaN/Inf router rows: finite outputs, reference values, non-finite rows counted"""
    dtype, mode = p["dtype"], p["mode"]
    num_experts = ctx.choose(8, 8, 64)
    top_k = top_k_for(num_experts)
    hidden, inter = ctx.choose((32, 16), (32, 16), (256, 128))
    w13, w2 = (w.to(ctx.device) for w in expert_weights(num_experts, hidden, inter, dtype, ctx.generator))
    n, num_padded = len(CHAIN_KINDS), 2
    logits = padded_logits(CHAIN_KINDS, num_padded, num_experts, dtype, ctx)
    x = tokens(n + num_padded, hidden, ctx.generator).to(dtype).to(ctx.device)
    config, bias = mode.routing(num_experts, top_k, ctx.generator, ctx.device)
    counter = new_health_tensor(ctx.device) if ctx.api.counts_health else None
    out = ctx.api.moe(x, logits, w13, w2, config, bias=bias, num_valid=n, health=counter)
    expect_finite(out, n, "moe on NaN router rows")
    expect_padding_zeros(ctx, out, n, "moe on NaN router rows")
    expected = moe_reference(x, logits, w13, w2, config, bias=bias, num_valid=NumValid(n, None))
    ctx.close(out[:n], expected[:n], "moe vs reference")
    if counter is not None and int(counter[NONFINITE_ROWS]) != 4:
        raise CheckFailure(f"health[NONFINITE_ROWS] is {int(counter[NONFINITE_ROWS])}, expected 4")


# safemoe.MoE layers shaped like real models (tiny): E, the routing config, the other constructor
# arguments by name.
MODULE_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3": {"num_experts": 8, "route": RouteConfig(2)},
    "deepseek_v3": {
        "num_experts": 16,
        "route": RouteConfig(4, "sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5),
        "selection_bias": True,
        "router_logits_fp32": True,
        "shared_intermediate_size": 32,
    },
    "gpt_oss": {
        "num_experts": 8,
        "route": RouteConfig(2),
        "activation": "swigluoai",
        "router_bias": True,
        "expert_bias": True,
    },
    "qwen2": {
        "num_experts": 8,
        "route": RouteConfig(2),
        "shared_intermediate_size": 24,
        "shared_expert_gate": True,
    },
}


def _module_params(plan: Plan) -> list[dict[str, Any]]:
    return plan.cross(plan.pairs(model=tuple(MODULE_CONFIGS), dtype=dtypes(plan)), num_valid=NUM_VALID_FORMS)


def _randomize(module: nn.Module, generator: torch.Generator, std: float = 0.2) -> None:
    """Every parameter and float buffer drawn from `generator` (reproducible on any device)."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=generator) * (std if t.dim() > 1 else std / 2))


def _backend(ctx: CaseContext) -> str:
    if ctx.api.module_backend is None:
        raise NotApplicable(f"{ctx.api.name} is not a safemoe backend (safemoe.MoE runs safemoe's ops)")
    return str(ctx.api.module_backend)


def _padded_batch(ctx: CaseContext, hidden: int, n: int, num_padded: int, dtype: torch.dtype, fill: float):
    x = torch.cat([tokens(n, hidden, ctx.generator), torch.full((num_padded, hidden), fill)])
    return x.to(dtype).to(ctx.device)


@case("e2e.module", ops=("moe",), params=_module_params)
def module(ctx: CaseContext, **p: Any) -> None:
    """safemoe.MoE (Qwen3, DeepSeek-V3, gpt-oss, Qwen2 shapes) on NaN padding vs the reference layer"""
    backend = _backend(ctx)
    dtype, hidden, inter = p["dtype"], 32, 16
    kwargs = dict(MODULE_CONFIGS[p["model"]])
    num_experts, route = kwargs.pop("num_experts"), kwargs.pop("route")
    layer = safemoe.MoE(
        hidden, inter, num_experts, route, backend=backend, dtype=dtype, device=ctx.device, **kwargs
    ).eval()
    _randomize(layer, ctx.generator)
    if layer.expert_bias:  # keep the folded layout's padding columns zero (see safemoe.layer)
        with torch.no_grad():
            layer.w13[:, :, hidden + 1 :].zero_()
            layer.w13[:, :, hidden] *= 0.5
            layer.w2[:, hidden:, :].zero_()
    reference = copy.deepcopy(layer)
    reference.backend = reference.gate.backend = "reference"
    n, num_padded = ctx.choose(5, 5, 29), 3
    x = _padded_batch(ctx, hidden, n, num_padded, dtype, math.nan)
    clean = x.clone()
    clean[n:] = 0
    nv = num_valid_arg(p["num_valid"], n, ctx.device)
    with torch.no_grad():
        out = layer(x, num_valid=nv)
        out_clean = layer(clean, num_valid=nv)
        want = reference(x[:n])
    expect_padding_zeros(ctx, out, n, f"{p['model']} layer")
    expect_finite(out, n, f"{p['model']} layer")
    expect_bitwise(out[:n], out_clean[:n], f"{p['model']} layer: real rows, NaN vs zero padding")
    ctx.close(out[:n], want, f"{p['model']} layer vs the reference layer, unpadded")


# The transformers MoE blocks safemoe patches: (module, class, config class, config).
_COMMON = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2}
HF_BLOCKS: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "qwen3_moe": (
        "qwen3_moe",
        "Qwen3MoeSparseMoeBlock",
        "Qwen3MoeConfig",
        {
            **_COMMON,
            "moe_intermediate_size": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
        },
    ),
    "qwen2_moe": (
        "qwen2_moe",
        "Qwen2MoeSparseMoeBlock",
        "Qwen2MoeConfig",
        {
            **_COMMON,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 24,
            "num_experts": 8,
            "num_experts_per_tok": 2,
        },
    ),
    "mixtral": (
        "mixtral",
        "MixtralSparseMoeBlock",
        "MixtralConfig",
        {**_COMMON, "intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "olmoe": (
        "olmoe",
        "OlmoeSparseMoeBlock",
        "OlmoeConfig",
        {**_COMMON, "intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2},
    ),
    "deepseek_v3": (
        "deepseek_v3",
        "DeepseekV3MoE",
        "DeepseekV3Config",
        {
            **_COMMON,
            "num_key_value_heads": 4,
            "moe_intermediate_size": 16,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_group": 4,
            "topk_group": 2,
            "n_shared_experts": 1,
            "routed_scaling_factor": 2.5,
        },
    ),
    "gpt_oss": (
        "gpt_oss",
        "GptOssMLP",
        "GptOssConfig",
        {**_COMMON, "intermediate_size": 16, "num_local_experts": 8, "num_experts_per_tok": 2},
    ),
}


def _hf_params(plan: Plan) -> list[dict[str, Any]]:
    rows = plan.pairs(
        block=tuple(HF_BLOCKS),
        dtype=plan.choose((torch.float32,), (torch.float32,), (torch.float32, torch.bfloat16)),
    )
    return plan.cross(rows, num_valid=("int", "int32_tensor"))


def _hf_block(ctx: CaseContext, family: str, dtype: torch.dtype) -> tuple[nn.Module, Any]:
    try:
        transformers = importlib.import_module("transformers")
        module_name, class_name, config_name, config_kwargs = HF_BLOCKS[family]
        modeling = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
        config = getattr(transformers, config_name)(**config_kwargs)
        block_class = getattr(modeling, class_name)
    except (ImportError, AttributeError) as error:
        raise NotApplicable(
            f"transformers {family} block unavailable: {type(error).__name__}: {error}"
        ) from error
    config._experts_implementation = "eager"
    block = block_class(config).eval()
    _randomize(block, ctx.generator)
    return block.to(dtype=dtype, device=ctx.device), config


def _eager_reference(
    block: nn.Module, family: str, config: Any, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(transformers' own block output on x, [T] bool rows whose expert choice is no tie). Exact
    ties are common in bf16 router logits and transformers orders them its own way (torch.topk),
    so those rows may rightly pick other experts than safemoe's lowest-index rule."""
    router: Any = block.gate if hasattr(block, "gate") else block.router
    captured: list[torch.Tensor] = []
    handle = router.register_forward_hook(lambda module, args, out: captured.append(out[0].detach()))
    try:
        want = _block_out(block, x)
    finally:
        handle.remove()
    route, bias = RouteConfig(int(config.num_experts_per_tok)), None
    if family == "deepseek_v3":
        route = route.replace(scoring="sigmoid", n_group=router.num_group, topk_group=router.topk_group)
        bias = router.e_score_correction_bias.float()
    clear, _ = clear_rows(captured[0].float(), route, bias, exact_ties=False)
    return want, clear


def _block_out(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = block(x[None])  # [1, T, H]: one sequence of T tokens
    return (out[0] if isinstance(out, tuple) else out)[0]


@case("e2e.transformers", ops=("moe",), params=_hf_params)
def transformers_block(ctx: CaseContext, **p: Any) -> None:
    """a transformers MoE block (patched by safemoe, or with an HF experts implementation) on NaN padding"""
    if ctx.api.module_backend is None and ctx.api.hf_implementation is None:
        raise NotApplicable(f"{ctx.api.name} has no transformers integration")
    family, dtype = p["block"], p["dtype"]
    block, config = _hf_block(ctx, family, dtype)
    hidden = config.hidden_size
    n, num_padded = ctx.choose(5, 5, 29), 3
    x = _padded_batch(ctx, hidden, n, num_padded, dtype, math.nan)
    want, clear = _eager_reference(block, family, config, x[:n])
    what = f"{family} block"
    if ctx.api.hf_implementation is not None:
        # transformers itself, with this experts implementation, on the padded batch as an engine
        # without num_valid runs it.
        config._experts_implementation = ctx.api.hf_implementation
        out = _block_out(block, x)
        expect_finite(out, n, what)
        expect_close(
            out[:n], want, f"{what} ({ctx.api.hf_implementation}) vs eager unpadded", clear, HF_SCALE
        )
        return
    from safemoe.integrations.transformers import patch, set_num_valid

    holder = nn.Module()
    holder.block = copy.deepcopy(block)
    patch(holder, backend=_backend(ctx))
    set_num_valid(holder, num_valid_arg(p["num_valid"], n, ctx.device))
    out = _block_out(holder.block, x)
    clean = x.clone()
    clean[n:] = 0
    out_clean = _block_out(holder.block, clean)
    expect_padding_zeros(ctx, out, n, what)
    expect_finite(out, n, what)
    expect_bitwise(out[:n], out_clean[:n], f"{what}: real rows, NaN vs zero padding")
    expect_close(out[:n], want, f"{what} patched vs transformers unpadded", clear, HF_SCALE)
