"""Seeded inputs for the checks: adversarial router rows, routing modes, expert weights, stale ids.

Everything is generated on the CPU from the case's generator (so a seed reproduces the same
tensors on any device) and moved to the device under test afterwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from safemoe.route_config import RouteConfig

STALE_ID = 123456789  # left in a torch.empty ids buffer in vLLM #41834
INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)

# Ids that must be dropped (never an address), by kind; `stale` is the garbage of vLLM #41834.
BAD_IDS = {
    "neg1": lambda e: -1,
    "neg7": lambda e: -7,
    "eq_E": lambda e: e,
    "E_plus_1": lambda e: e + 1,
    "stale": lambda e: STALE_ID,
    "int32_max": lambda e: INT32_MAX,
    "int32_min": lambda e: INT32_MIN,
}

# Router row kinds. Non-finite kinds are what padded rows of a CUDA-graph batch carry into the
# router in production (vLLM #39244, #37758): attention over empty slots yields NaN.
ROW_KINDS = (
    "all_nan",
    "all_pos_inf",
    "all_neg_inf",
    "mixed_nonfinite",
    "one_nan_odd",
    "one_pos_inf_odd",
    "one_neg_inf_odd",
    "all_equal",
    "huge_finite",
    "tie_free",
)


def tie_free_rows(num_rows: int, num_experts: int, generator: torch.Generator) -> torch.Tensor:
    """[T, E] fp32 rows of distinct values, steps of min(1/8, 16/E) in [-8, 8): far enough apart
    that any correct fp32 softmax/sigmoid keeps their order (sigmoid(8) still differs from its
    neighbour by 4e-5, against an ulp of 6e-8)."""
    ranks = torch.argsort(torch.rand(num_rows, num_experts, generator=generator), dim=1)
    step = min(1.0 / 8.0, 16.0 / num_experts)
    return (ranks.float() - num_experts / 2) * step


# Kinds that fill the whole row with one value, and kinds that put one value at an odd offset.
_WHOLE_ROW = {"all_nan": math.nan, "all_pos_inf": math.inf, "all_neg_inf": -math.inf, "all_equal": 0.5}
_ONE_AT_ODD = {"one_nan_odd": math.nan, "one_pos_inf_odd": math.inf, "one_neg_inf_odd": -math.inf}


def router_rows(kinds: list[str], num_experts: int, generator: torch.Generator) -> torch.Tensor:
    """One fp32 row per kind, [len(kinds), E]."""
    rows = tie_free_rows(len(kinds), num_experts, generator)
    for i, kind in enumerate(kinds):
        if kind in _WHOLE_ROW:
            rows[i] = _WHOLE_ROW[kind]
        elif kind in _ONE_AT_ODD:
            # An odd offset that moves with the row, so bad values land in different lanes/blocks.
            rows[i, min(num_experts - 1, (2 * i + 1 + 2 * (num_experts // 3)) | 1)] = _ONE_AT_ODD[kind]
        elif kind == "mixed_nonfinite":
            pattern = torch.tensor([math.nan, math.inf, -math.inf, 1.0]).roll(i % 4)
            rows[i] = pattern.repeat(num_experts // 4 + 1)[:num_experts]
        elif kind == "huge_finite":
            rows[i] = torch.where(rows[i] > 0, 3e4, -3e4)  # finite in fp16 too
        elif kind != "tie_free":
            raise ValueError(f"unknown row kind {kind!r}")
    return rows


def interleave_with_tie_free(kinds: list[str]) -> list[str]:
    """The kinds with a tie-free row after each, so a bad row sits between good ones."""
    out: list[str] = []
    for kind in kinds:
        out += [kind, "tie_free"]
    return out


# What padded rows hold: NaN (the production case: attention over empty slots), +-Inf, values
# large enough to win any softmax (1e4; 6e4 still finite in fp16), or zeros (a clean padding).
PAD_VALUES = {"nan": math.nan, "inf": math.inf, "neg_inf": -math.inf, "1e4": 1e4, "huge": 6e4, "zero": 0.0}


def padding_rows(kind: str, num_rows: int, width: int) -> torch.Tensor:
    """[num_rows, width] fp32 rows of the padding kind (see PAD_VALUES)."""
    return torch.full((num_rows, width), PAD_VALUES[kind])


@dataclass(frozen=True)
class RouteMode:
    """A routing mode: its `RouteConfig` (top_k there is a placeholder: `routing` sets K, and the
    groups for E when `groups`), and whether a selection bias goes with it."""

    name: str
    config: RouteConfig
    bias: bool = False
    groups: bool = False

    def routing(
        self, num_experts: int, top_k: int, generator: torch.Generator, device: torch.device
    ) -> tuple[RouteConfig, torch.Tensor | None]:
        """(the config for E and K, the [E] selection bias or None), as `route()` takes them."""
        bias = selection_bias(num_experts, generator).to(device) if self.bias else None
        groups: dict[str, Any] = {}
        if self.groups:
            groups["n_group"], groups["topk_group"] = group_config(num_experts, top_k)
        return self.config.replace(top_k=top_k, **groups), bias


ROUTE_MODES = (
    RouteMode("softmax", RouteConfig(1)),
    RouteMode("softmax_raw", RouteConfig(1, renormalize=False)),
    RouteMode("sigmoid", RouteConfig(1, "sigmoid")),
    RouteMode("sigmoid_bias", RouteConfig(1, "sigmoid"), bias=True),
    RouteMode("softmax_groups", RouteConfig(1), groups=True),
    # DeepSeek-V3: sigmoid, correction bias, 8 groups keep 4, scaled weights.
    RouteMode("deepseek_v3", RouteConfig(1, "sigmoid", routed_scaling_factor=2.5), bias=True, groups=True),
    RouteMode("sigmoid_raw_scaled", RouteConfig(1, "sigmoid", renormalize=False, routed_scaling_factor=0.5)),
)
MODES_BY_NAME = {m.name: m for m in ROUTE_MODES}


def selection_bias(num_experts: int, generator: torch.Generator) -> torch.Tensor:
    """[E] fp32 distinct values in [-1/8, 1/8): big enough to change selections."""
    ranks = torch.randperm(num_experts, generator=generator).float()
    return (ranks - num_experts / 2) / (4 * num_experts)


def group_config(num_experts: int, top_k: int) -> tuple[int, int]:
    """(n_group, topk_group) for E: as many groups (<= 8) as divide E, keeping half of them, more
    if the kept groups would hold fewer than K experts."""
    n_group = next(g for g in (8, 4, 2, 1) if num_experts % g == 0)
    group_size = num_experts // n_group
    topk_group = max(1, n_group // 2)
    while topk_group * group_size < top_k:
        topk_group += 1
    return n_group, topk_group


# The router unrolls one max-then-mask pass per k: K = E = 512 would be a compile of minutes, so
# `all` means every expert up to E = 64 and 16 of them beyond (no model routes to more).
MAX_ALL_K = 64


def top_k_for(num_experts: int, kind: str = "typical") -> int:
    """K for E: `typical` (8 for big E as in Qwen3/DeepSeek, 2 for Mixtral-sized), `one`, `all`
    (K = E up to E = MAX_ALL_K, else 16)."""
    if kind == "one":
        return 1
    if kind == "all":
        return num_experts if num_experts <= MAX_ALL_K else 16
    return max(1, min(8, num_experts // 3))


def expert_weights(
    num_experts: int, hidden: int, inter: int, dtype: torch.dtype, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, 2I, H], w2 [E, H, I]) scaled so activations and outputs stay O(1)."""
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=generator) / math.sqrt(hidden)
    w2 = torch.randn(num_experts, hidden, inter, generator=generator) / math.sqrt(inter)
    return w13.to(dtype), w2.to(dtype)


def tokens(num_rows: int, hidden: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(num_rows, hidden, generator=generator)


def stale_ids(num_rows: int, top_k: int, num_experts: int, generator: torch.Generator) -> torch.Tensor:
    """[T, K] int32 mixing valid ids with -1, -7, E, the stale 123456789, and duplicates."""
    ids = torch.randint(0, num_experts, (num_rows, top_k), generator=generator, dtype=torch.int32)
    bad_values = torch.tensor([-1, -7, num_experts, STALE_ID], dtype=torch.int32)
    pick = torch.randint(0, 2 * len(bad_values), (num_rows, top_k), generator=generator)
    ids = torch.where(pick < len(bad_values), bad_values[pick.clamp(max=len(bad_values) - 1)], ids)
    if top_k > 1:  # every third row repeats its first slot in its last
        ids[::3, -1] = ids[::3, 0]
    return ids


def random_weights(num_rows: int, top_k: int, generator: torch.Generator) -> torch.Tensor:
    return torch.rand(num_rows, top_k, generator=generator)
