"""Family 1, the routing contract on adversarial router rows: K distinct ids in [0, E) and finite
weights >= 0 on every valid row whatever its logits (NaN, +Inf, -Inf, mixed; whole rows and single
values at odd offsets; all-equal rows; huge finite rows), ids -1 / weights 0 on padded rows, and
the reference's exact choice (sanitise, then a total order with ties to the lowest index) wherever
it is unambiguous. Every E in EXPERT_COUNTS, every scoring and grouping mode, every dtype."""

from __future__ import annotations

from typing import Any

import torch

from safemoe.check.cases.common import (
    NUM_VALID_FORMS,
    NUM_VALID_FORMS_AND_NONE,
    num_valid_arg,
    padded_logits,
    require,
    router_variants,
)
from safemoe.check.inputs import ROUTE_MODES, RouteMode, interleave_with_tie_free, top_k_for
from safemoe.check.invariants import expect_route_matches_reference, expect_routing_contract
from safemoe.check.registry import CaseContext, CheckFailure, Plan, case
from safemoe.health import DROPPED_SLOTS, NONFINITE_ROWS, PADDED_ROWS, new_health_tensor

NUM_PADDED = 3


def _params(plan: Plan, k_kinds: tuple[str, ...] = ("typical",)) -> list[dict[str, Any]]:
    # num_valid forms and where the bad rows sit are runtime values: crossed, not paired.
    extra = {"k": k_kinds} if len(k_kinds) > 1 else {}
    rows = router_variants(plan, **extra)
    return plan.cross(rows, num_valid=NUM_VALID_FORMS_AND_NONE, bad_at=("even", "odd"))


def _route_rows(ctx: CaseContext, kinds: list[str], p: dict[str, Any]) -> None:
    """Route rows of `kinds` (each followed by a tie-free row, or rotated by one), then
    NaN padded rows unless num_valid is `none`; check the contract and the reference."""
    row_kinds = interleave_with_tie_free(kinds)
    if p["bad_at"] == "odd":  # rotate by one: bad rows move to odd positions, the last row is bad
        row_kinds = row_kinds[1:] + row_kinds[:1]
    num_experts: int = p["E"]
    mode: RouteMode = p["mode"]
    top_k = top_k_for(num_experts, p.get("k", "typical"))
    num_padded = 0 if p["num_valid"] == "none" else NUM_PADDED
    # A backend without num_valid routes the padded rows too; give it clean (zero) ones here, so
    # each check measures its own row kinds (NaN padding is the padding family's business).
    fill = "nan" if ctx.api.native_num_valid else "zero"
    logits = padded_logits(row_kinds, num_padded, num_experts, p["dtype"], ctx, fill=fill)
    config, bias = mode.routing(num_experts, top_k, ctx.generator, ctx.device)
    n, total = len(row_kinds), logits.shape[0]
    routing = ctx.api.route(logits, config, bias=bias, num_valid=num_valid_arg(p["num_valid"], n, ctx.device))
    # A peer routes the padded rows like real ones: the contract is held on every row there.
    held = n if ctx.api.native_num_valid else total
    names = row_kinds + ["padding"] * num_padded
    expect_routing_contract(
        routing,
        num_rows=total,
        top_k=top_k,
        num_experts=num_experts,
        num_valid=held,
        device=ctx.device,
        row_names=names,
    )
    expect_route_matches_reference(
        routing,
        logits,
        config,
        bias,
        n,
        names,
        exact_ties=ctx.api.exact_ties,
        ordered=ctx.api.ordered_ids,
        tolerance=ctx.api.weight_tolerance(p["dtype"]),
    )


@case("routing.nan_rows", ops=("route",), params=_params)
def nan_rows(ctx: CaseContext, **p: Any) -> None:
    """all-NaN and mixed NaN/+Inf/-Inf rows: K distinct ids, finite weights"""
    _route_rows(ctx, ["all_nan", "mixed_nonfinite"], p)


@case("routing.inf_rows", ops=("route",), params=_params)
def inf_rows(ctx: CaseContext, **p: Any) -> None:
    """all +Inf and all -Inf rows"""
    _route_rows(ctx, ["all_pos_inf", "all_neg_inf"], p)


@case("routing.odd_offset", ops=("route",), params=_params)
def odd_offset(ctx: CaseContext, **p: Any) -> None:
    """one NaN / +Inf / -Inf at an odd offset of an otherwise good row"""
    _route_rows(ctx, ["one_nan_odd", "one_pos_inf_odd", "one_neg_inf_odd"], p)


@case("routing.all_equal", ops=("route",), params=_params)
def all_equal(ctx: CaseContext, **p: Any) -> None:
    """all-equal rows (ties to the lowest index) and huge finite rows"""
    _route_rows(ctx, ["all_equal", "huge_finite"], p)


@case("routing.tie_free", ops=("route",), params=lambda plan: _params(plan, ("one", "typical", "all")))
def tie_free(ctx: CaseContext, **p: Any) -> None:
    """tie-free rows equal the reference exactly, for K = 1, typical and E"""
    _route_rows(ctx, ["tie_free"], p)


def _health_params(plan: Plan) -> list[dict[str, Any]]:
    rows = plan.pairs(E=plan.choose((60,), (8, 257), (8, 64, 257, 512)), mode=ROUTE_MODES[:4])
    return plan.cross(rows, num_valid=NUM_VALID_FORMS)


@case("routing.health", ops=("route",), params=_health_params)
def health(ctx: CaseContext, **p: Any) -> None:
    """health counts valid non-finite rows and padded rows, accumulating over calls"""
    require(ctx, "has no health counter", ctx.api.counts_health)
    kinds = ["all_nan", "tie_free", "one_pos_inf_odd", "tie_free", "mixed_nonfinite", "huge_finite"]
    nonfinite, num_padded = 3, 3
    num_experts, mode = p["E"], p["mode"]
    top_k = top_k_for(num_experts)
    logits = padded_logits(kinds, num_padded, num_experts, torch.float32, ctx)
    counter = new_health_tensor(ctx.device)
    config, bias = mode.routing(num_experts, top_k, ctx.generator, ctx.device)
    for _ in range(2):
        ctx.api.route(
            logits,
            config,
            bias=bias,
            num_valid=num_valid_arg(p["num_valid"], len(kinds), ctx.device),
            health=counter,
        )
    got = counter.cpu().tolist()
    want = [0] * len(got)
    want[NONFINITE_ROWS], want[PADDED_ROWS], want[DROPPED_SLOTS] = 2 * nonfinite, 2 * num_padded, 0
    if got != want:
        raise CheckFailure(f"health after two calls is {got}, expected {want}")
