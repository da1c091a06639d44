"""Shared pieces of the case families: sizes, num_valid forms, batches with padded rows."""

from __future__ import annotations

import torch

from safemoe.check.inputs import MODES_BY_NAME, ROUTE_MODES, RouteMode, padding_rows, router_rows
from safemoe.check.registry import CaseContext

# E values that cross every boundary a router kernel has: tiny, non-power-of-two, one warp (32 is
# under 60 < 64), multiples of 64 and the lane counts of real models (Qwen3 128, DeepSeek 256,
# gpt-oss 128/32, Qwen2-57B 64, Qwen1.5-MoE 60, DeepSeek-V2-Lite 64, Llama-4 16/128, GLM 160),
# and one past a power of two.
EXPERT_COUNTS = (6, 8, 60, 64, 128, 160, 256, 257)
FLOAT_DTYPES_CPU = (torch.float32, torch.float16)
FLOAT_DTYPES_CUDA = (torch.float32, torch.float16, torch.bfloat16)
NUM_VALID_FORMS = ("int", "int32_tensor", "int64_tensor")


def dtypes(ctx: CaseContext) -> tuple[torch.dtype, ...]:
    return ctx.choose((torch.float32, torch.float16), FLOAT_DTYPES_CPU, FLOAT_DTYPES_CUDA)


# --quick: four modes that still cover both scorings, renormalize off, bias, groups and scaling.
QUICK_MODES = tuple(
    MODES_BY_NAME[n] for n in ("softmax_raw", "sigmoid_bias", "softmax_groups", "deepseek_v3")
)


def route_modes(ctx: CaseContext) -> tuple[RouteMode, ...]:
    return ctx.choose(QUICK_MODES, ROUTE_MODES, ROUTE_MODES)


def expert_counts(ctx: CaseContext) -> tuple[int, ...]:
    return ctx.choose((8, 60, 257), EXPERT_COUNTS, EXPERT_COUNTS)


def num_valid_arg(form: str, count: int, device: torch.device) -> int | torch.Tensor:
    """`count` as the public API accepts it: a host int or a 0-dim device tensor."""
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
