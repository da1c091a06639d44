"""The whole MoE step as one call: route, then experts."""

from __future__ import annotations

from typing import Any

import torch

from safemoe import _checks
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
    # Check the expert inputs before the router runs (no kernel may launch on bad input), and tie
    # the router's E to the weights' E: a router wider than w13 would route to ids >= E that
    # experts() silently drops.
    num_tokens, num_experts, _, _ = _checks.check_experts_args(x, w13, w2, activation)
    logits = _checks.check_tensor("router_logits", router_logits, dims=2, dtypes=_checks.FLOAT_DTYPES)
    if tuple(logits.shape) != (num_tokens, num_experts):
        raise ValueError(
            f"router_logits must have shape [T={num_tokens}, E={num_experts}] to match x and w13, "
            f"got {tuple(logits.shape)}"
        )
    _checks.check_same_device("router_logits", logits, x.device)
    routing = route(
        router_logits, top_k, num_valid=num_valid, backend=backend, health=health, **route_kwargs
    )
    return experts(
        x, w13, w2, routing, activation=activation, num_valid=num_valid, backend=backend, health=health
    )
