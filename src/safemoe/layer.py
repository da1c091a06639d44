"""The whole MoE step as one call: route, then experts."""

from __future__ import annotations

from typing import Any

import torch

from safemoe.experts import experts
from safemoe.routing import route


def moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    *,
    activation: str = "silu",
    num_valid: int | torch.Tensor | None = None,
    backend: str = "auto",
    health: torch.Tensor | None = None,
    **route_kwargs: Any,
) -> torch.Tensor:
    """`route(router_logits, top_k, **route_kwargs)` then `experts(x, w13, w2, routing)`.

    route_kwargs: scoring, renormalize, bias, n_group, topk_group, routed_scaling_factor.
    """
    routing = route(
        router_logits, top_k, num_valid=num_valid, backend=backend, health=health, **route_kwargs
    )
    return experts(
        x, w13, w2, routing, activation=activation, num_valid=num_valid, backend=backend, health=health
    )
