"""Routing: router logits [T, E] -> K distinct experts and their weights per token.

The contract (docs/contract.md) in short: NaN/+-Inf logits are sanitised, every valid row gets K
distinct ids in [0, E) and finite weights >= 0, rows at or past `num_valid` get ids -1 and
weights 0 and their logits are never read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from safemoe import _checks, ops
from safemoe._triton import require_triton
from safemoe.health import check_health
from safemoe.route_config import RouteConfig


@dataclass(frozen=True)
class Routing:
    """The router's decision for T tokens.

    weights: [T, K] float32, finite and >= 0 on valid rows, 0 on padded rows.
    ids: [T, K] int32, K distinct experts in [0, E) on valid rows, -1 on padded rows.
    """

    weights: torch.Tensor
    ids: torch.Tensor

    @property
    def top_k(self) -> int:
        return int(self.ids.shape[1])


def route(
    logits: torch.Tensor,
    top_k: int | RouteConfig,
    *,
    bias: torch.Tensor | None = None,
    num_valid: int | torch.Tensor | None = None,
    backend: str = "auto",
    health: torch.Tensor | None = None,
    batch_invariant: bool = False,
    **options: Any,
) -> Routing:
    """Pick experts per token from router `logits` [T, E] (bf16, fp16 or fp32).

    top_k: K, or a whole `RouteConfig` (top_k, scoring, renormalize, n_group, topk_group,
        routed_scaling_factor, group_score), or top_k with those options as keywords
        (`route(logits, 8, scoring="sigmoid")` is `route(logits, RouteConfig(8, scoring="sigmoid"))`).
    bias: [E] selection bias (DeepSeek-V3's e_score_correction_bias): added for selection only.
    num_valid: rows at or past it are padding (int, or 0-dim int tensor on the logits' device).
    backend: "auto" (triton on CUDA, reference elsewhere), "triton" or "reference".
    health: optional int64 counter tensor (see safemoe.health); slot NONFINITE_ROWS counts valid
        rows with a non-finite logit and PADDED_ROWS the padded rows seen.
    batch_invariant: a valid row's weights and ids are bitwise the same whatever T, num_valid and
        the other rows hold (one launch config for every T; backend "triton" only).
    """
    config = _checks.check_route_args(logits, top_k, bias=bias, **options)
    backend = _checks.check_backend(backend)
    nv = _checks.check_num_valid(num_valid, logits.shape[0], logits.device)
    check_health(health, logits.device)
    backend = _checks.resolve_backend(backend, logits.device)
    _checks.check_batch_invariant(batch_invariant, backend, "route")
    if backend == "triton":
        require_triton(logits.device, "route")
    weights, ids = ops.route(logits, config, bias=bias, num_valid=nv, backend=backend, health=health,
                             batch_invariant=batch_invariant)
    return Routing(weights=weights, ids=ids)
