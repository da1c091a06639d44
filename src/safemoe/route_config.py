"""`RouteConfig`: the routing options, written out once.

Every layer above the router (`safemoe.route`, `moe`, `MoE`, `EPMoE`, `patch`, the check, the
bench and the registered op's schema) takes and passes the config whole. A new routing rule adds
a field here (validated in `__post_init__`, or in `check` when it depends on E), a step in
`reference.route_reference`, and the same step in the router kernel.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from safemoe.numerics import FLT_MAX

SCORINGS = ("softmax", "sigmoid")
# How a group of experts is scored for group-limited routing: the sum of its two best selection
# scores (DeepSeek-V3 and its followers) or its best one (DeepSeek-V2's group_limited_greedy).
GROUP_SCORES = ("top2_sum", "max")

# Field type -> torch.library schema type, for the op schema generated from the fields.
_SCHEMA_TYPES = {"int": "SymInt", "str": "str", "bool": "bool", "int | None": "SymInt?", "float": "float"}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class RouteConfig:
    """How a router picks experts. Validated on construction (messages name the field).

    top_k: experts per token (K).
    scoring: "softmax" (softmax over E, pick the largest) or "sigmoid".
    renormalize: divide the K weights by their sum (a zero sum stays zero).
    n_group / topk_group: group-limited routing (DeepSeek-V3): keep the best `topk_group` of
        `n_group` expert groups (a group's score is the sum of its two best selection scores).
    routed_scaling_factor: final multiplier of the weights (finite, >= 0).
    group_score: how a group is scored with n_group set: "top2_sum" (the sum of its two best
        selection scores, its one score in a single-expert group; DeepSeek-V3) or "max" (its best
        selection score; DeepSeek-V2).
    """

    top_k: int
    scoring: str = "softmax"
    renormalize: bool = True
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    group_score: str = "top2_sum"

    def __post_init__(self) -> None:
        if not _is_int(self.top_k):
            raise TypeError(f"top_k must be an int, got {type(self.top_k).__name__}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, got {self.scoring!r}")
        if not isinstance(self.renormalize, bool):
            raise TypeError(f"renormalize must be a bool, got {type(self.renormalize).__name__}")
        n_group, topk_group = self.n_group, self.topk_group
        if (n_group is None) != (topk_group is None):
            raise ValueError(
                f"n_group and topk_group go together (group-limited routing), got {n_group=} {topk_group=}"
            )
        if n_group is not None:
            if not _is_int(n_group) or n_group < 1:
                raise ValueError(f"n_group must be a positive int, got {n_group!r}")
            if not _is_int(topk_group) or topk_group < 1:  # type: ignore[operator]
                raise ValueError(f"topk_group must be a positive int, got {topk_group!r}")
            if topk_group > n_group:  # type: ignore[operator]
                raise ValueError(f"topk_group={topk_group} must be <= n_group={n_group}")
        scale = self.routed_scaling_factor
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"routed_scaling_factor must be a float, got {type(scale).__name__}")
        # Weights are finite and >= 0 by contract; routed weights are <= 1 before scaling, so a
        # factor in [0, FLT_MAX] keeps them so.
        if not (math.isfinite(scale) and 0.0 <= scale <= FLT_MAX):
            raise ValueError(
                f"routed_scaling_factor must be finite, >= 0 and within float32 range, got {scale}"
            )
        object.__setattr__(self, "routed_scaling_factor", float(scale))
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"group_score must be one of {GROUP_SCORES}, got {self.group_score!r}")
        if self.group_score != "top2_sum" and n_group is None:
            raise ValueError(
                f"group_score={self.group_score!r} scores groups: it needs n_group and topk_group"
            )

    @property
    def grouped(self) -> bool:
        """Group-limited routing with more than one group (one group is plain routing)."""
        return self.n_group is not None and self.n_group > 1

    def check(self, num_experts: int) -> RouteConfig:
        """Raise ValueError when this config cannot route over `num_experts` experts; returns self."""
        top_k = self.top_k
        if top_k > num_experts:
            raise ValueError(f"top_k must be in [1, E={num_experts}], got {top_k}")
        if self.n_group is not None and self.topk_group is not None:
            if num_experts % self.n_group != 0:
                raise ValueError(f"n_group={self.n_group} must divide E={num_experts}")
            group_size = num_experts // self.n_group
            if self.topk_group * group_size < top_k:
                raise ValueError(
                    f"top_k={top_k} needs at least that many experts in the kept groups, but "
                    f"topk_group={self.topk_group} groups of {group_size} experts hold "
                    f"{self.topk_group * group_size}"
                )
        return self

    def replace(self, **changes: Any) -> RouteConfig:
        return dataclasses.replace(self, **changes)

    # -- the op boundary: the fields as schema arguments, in order -------------------------------
    @classmethod
    def op_schema(cls) -> str:
        """The fields as torch.library schema arguments ("SymInt top_k, str scoring, ...")."""
        return ", ".join(f"{_SCHEMA_TYPES[str(f.type)]} {f.name}" for f in dataclasses.fields(cls))

    def op_args(self) -> tuple[Any, ...]:
        return dataclasses.astuple(self)

    @classmethod
    def of(cls, top_k: int | RouteConfig, options: dict[str, Any] | None = None) -> RouteConfig:
        """A config from either form the public functions accept: a RouteConfig (then no options),
        or top_k plus keyword options (`route(logits, 8, scoring="sigmoid")`)."""
        options = options or {}
        if isinstance(top_k, RouteConfig):
            if options:
                raise TypeError(
                    f"routing options {sorted(options)} given with a RouteConfig: put them in the config "
                    "(config.replace(...))"
                )
            return top_k
        fields = {f.name for f in dataclasses.fields(cls)} - {"top_k"}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise TypeError(
                f"unknown routing option(s) {unknown}; RouteConfig takes top_k and {sorted(fields)}"
            )
        return cls(top_k, **options)
