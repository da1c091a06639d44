"""Shared pieces of the check families: sizes, parameter axes, num_valid forms, padded batches, and
how a check reads a backend's promises (a peer runs the whole padded batch)."""

from __future__ import annotations

from typing import Any

import torch

from safemoe.check.inputs import (
    MODES_BY_NAME,
    ROUTE_MODES,
    RouteMode,
    expert_weights,
    padding_rows,
    router_rows,
    top_k_for,
)
from safemoe.check.invariants import expect_zero_rows
from safemoe.check.registry import CaseContext, NotApplicable, Plan

# E values that cross every boundary a router kernel has: tiny, non-power-of-two, one warp (32 is
# under 60 < 64), multiples of 64 and the lane counts of real models (Qwen3 128, DeepSeek 256,
# gpt-oss 128/32, Qwen2-57B 64, Qwen1.5-MoE 60, DeepSeek-V2-Lite 64, Llama-4 16/128, GLM 160),
# one past a power of two, and 512 (wider than any shipped router row).
EXPERT_COUNTS = (6, 8, 60, 64, 128, 160, 256, 257, 512)
QUICK_EXPERT_COUNTS = (8, 60, 257)
# The Triton interpreter has no bf16 arithmetic (kernels upcast after loading; fp16 covers it).
FLOAT_DTYPES_CPU = (torch.float32, torch.float16)
FLOAT_DTYPES_CUDA = (torch.float32, torch.float16, torch.bfloat16)
NUM_VALID_FORMS = ("int", "int32_tensor", "int64_tensor")
# "none": no num_valid at all (every row valid, nothing padded).
NUM_VALID_FORMS_AND_NONE = ("none", *NUM_VALID_FORMS)
ACTIVATIONS = ("silu", "gelu", "swigluoai")

Scaled = Plan | CaseContext


def dtypes(at: Scaled) -> tuple[torch.dtype, ...]:
    """fp32 and fp16 on CPU; on CUDA bf16 too (--quick: fp32 and bf16, the production dtype)."""
    if at.device.type != "cuda":
        return FLOAT_DTYPES_CPU
    return at.choose((torch.float32, torch.bfloat16), FLOAT_DTYPES_CUDA, FLOAT_DTYPES_CUDA)


# --quick: four modes that still cover both scorings, renormalize off, bias, groups and scaling.
QUICK_MODES = tuple(
    MODES_BY_NAME[n] for n in ("softmax_raw", "sigmoid_bias", "softmax_groups", "deepseek_v3")
)


def route_modes(at: Scaled) -> tuple[RouteMode, ...]:
    return at.choose(QUICK_MODES, ROUTE_MODES, ROUTE_MODES)


def expert_counts(at: Scaled) -> tuple[int, ...]:
    return at.choose(QUICK_EXPERT_COUNTS, EXPERT_COUNTS, EXPERT_COUNTS)


def router_variants(plan: Plan, **more: Any) -> list[dict[str, Any]]:
    """(E, mode, dtype) sets covering every pair: each compiles its own router specialisation, so
    every routing check shares these (the Triton cache then serves the others)."""
    return plan.pairs(E=expert_counts(plan), mode=route_modes(plan), dtype=dtypes(plan), **more)


def num_valid_arg(form: str, count: int, device: torch.device) -> int | torch.Tensor | None:
    """`count` as the public API accepts it: nothing, a host int or a 0-dim device tensor."""
    if form == "none":
        return None
    if form == "int":
        return count
    dtype = torch.int32 if form == "int32_tensor" else torch.int64
    return torch.tensor(count, dtype=dtype, device=device)


def padded_logits(
    kinds: list[str],
    num_padded: int,
    num_experts: int,
    dtype: torch.dtype,
    ctx: CaseContext,
    fill: str = "nan",
) -> torch.Tensor:
    """[len(kinds) + num_padded, E] router logits: one row per kind, then padded rows."""
    real = router_rows(kinds, num_experts, ctx.generator)
    return torch.cat([real, padding_rows(fill, num_padded, num_experts)]).to(dtype).to(ctx.device)


def rows_held_valid(ctx: CaseContext, num_valid: int, num_rows: int) -> int:
    """Rows the backend treats as real: `num_valid`, or every row for a backend without num_valid
    (an engine without it routes and runs the padded rows like real ones)."""
    return num_valid if ctx.api.native_num_valid else num_rows


def expect_padding_zeros(ctx: CaseContext, out: torch.Tensor, num_valid: int, what: str) -> None:
    """Padded output rows are exact zeros, where the backend takes num_valid at all."""
    if ctx.api.native_num_valid:
        expect_zero_rows(out, num_valid, what)


def require(ctx: CaseContext, what: str, supported: bool) -> None:
    if not supported:
        raise NotApplicable(f"{ctx.api.name} {what}")


def experts_problem(
    ctx: CaseContext,
    dtype: torch.dtype,
    num_experts: int | None = None,
    hidden: int | None = None,
    inter: int | None = None,
    top_k: int | None = None,
) -> dict[str, Any]:
    """Expert weights on the device and their dims: E (8 on CPU, 64 on CUDA), K, H, I."""
    num_experts = num_experts or ctx.choose(8, 8, 64)
    default_h, default_i = ctx.choose((32, 16), (32, 16), (256, 128))
    hidden, inter = hidden or default_h, inter or default_i
    top_k = top_k or top_k_for(num_experts)
    w13, w2 = expert_weights(num_experts, hidden, inter, dtype, ctx.generator)
    return {
        "E": num_experts,
        "K": top_k,
        "H": hidden,
        "I": inter,
        "w13": w13.to(ctx.device),
        "w2": w2.to(ctx.device),
    }
