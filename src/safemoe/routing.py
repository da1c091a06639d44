"""Routing: router logits [T, E] -> K distinct experts and their weights per token.

The contract (docs/contract.md) in short: NaN/+-Inf logits are sanitised, every valid row gets K
distinct ids in [0, E) and finite weights >= 0, rows at or past `num_valid` get ids -1 and
weights 0 and their logits are never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from safemoe import _checks
from safemoe._triton import require_triton
from safemoe.health import check_health
from safemoe.reference import route_reference


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
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    bias: torch.Tensor | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
    num_valid: int | torch.Tensor | None = None,
    backend: str = "auto",
    health: torch.Tensor | None = None,
) -> Routing:
    """Pick `top_k` experts per token from router `logits` [T, E] (bf16, fp16 or fp32).

    scoring: "softmax" (softmax over E, pick the largest) or "sigmoid".
    bias: [E] selection bias (DeepSeek-V3's e_score_correction_bias): added for selection only.
    n_group / topk_group: group-limited routing (keep the best topk_group of n_group groups).
    renormalize: divide the K weights by their sum (a zero sum stays zero).
    routed_scaling_factor: final multiplier of the weights.
    num_valid: rows at or past it are padding (int, or 0-dim int tensor on the logits' device).
    backend: "auto" (triton on CUDA, reference elsewhere), "triton" or "reference".
    health: optional int64 counter tensor (see safemoe.health); slot NONFINITE_ROWS counts valid
        rows with a non-finite logit and PADDED_ROWS the padded rows seen.
    """
    args = _checks.check_route_args(
        logits,
        top_k,
        scoring=scoring,
        renormalize=renormalize,
        bias=bias,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor,
    )
    backend = _checks.check_backend(backend)
    nv = _checks.check_num_valid(num_valid, logits.shape[0], logits.device)
    check_health(health, logits.device)
    backend = _checks.resolve_backend(backend, logits.device)

    if backend == "triton":
        require_triton(logits.device, "route")
        from safemoe.kernels.routing import route_triton

        weights, ids = route_triton(logits, args, bias=bias, num_valid=nv, health=health)
        return Routing(weights=weights, ids=ids)

    weights, ids = route_reference(
        logits,
        args.top_k,
        scoring=args.scoring,
        renormalize=args.renormalize,
        bias=bias,
        n_group=args.n_group,
        topk_group=args.topk_group,
        routed_scaling_factor=args.routed_scaling_factor,
        num_valid=nv,
    )
    if health is not None:
        _count_route_health(logits, nv, health)
    return Routing(weights=weights, ids=ids)


def _count_route_health(logits: torch.Tensor, nv: _checks.NumValid, health: torch.Tensor) -> None:
    from safemoe.health import NONFINITE_ROWS, PADDED_ROWS

    valid = nv.row_mask(logits.shape[0], logits.device)
    nonfinite = (~torch.isfinite(logits)).any(dim=1) & valid
    health[NONFINITE_ROWS] += nonfinite.sum()
    health[PADDED_ROWS] += (~valid).sum()
