"""Routing contract on adversarial router rows: K distinct ids in [0, E) and finite weights >= 0 on
every valid row whatever its logits, ids -1 / weights 0 on padded rows, and the reference's exact
choice (sanitise, then a total order with ties to the lowest index) wherever it is unambiguous."""

from __future__ import annotations

import torch

from safemoe.check.cases.common import (
    NUM_VALID_FORMS,
    dtypes,
    expert_counts,
    num_valid_arg,
    padded_logits,
    route_modes,
)
from safemoe.check.inputs import ROUTE_MODES, RouteMode, interleave_with_tie_free, top_k_for
from safemoe.check.invariants import expect_route_matches_reference, expect_routing_contract
from safemoe.check.registry import CaseContext, CheckFailure, case
from safemoe.health import DROPPED_SLOTS, NONFINITE_ROWS, PADDED_ROWS, new_health_tensor


def _route_rows(ctx: CaseContext, kinds: list[str], *, k_kinds: tuple[str, ...] = ("typical",)) -> None:
    """Route rows of `kinds` (each followed by a tie-free row, then NaN padded rows) for E values x
    routing modes x dtypes x num_valid forms, and check the contract and the reference."""
    row_kinds = interleave_with_tie_free(kinds)
    num_padded = ctx.choose(2, 2, 5)
    for p in ctx.grid(
        E=expert_counts(ctx), mode=route_modes(ctx), dtype=dtypes(ctx), num_valid=NUM_VALID_FORMS, k=k_kinds
    ):
        num_experts: int = p["E"]
        mode: RouteMode = p["mode"]
        top_k = top_k_for(num_experts, p["k"])
        with ctx.sub(E=num_experts, K=top_k, mode=mode.name, dtype=p["dtype"], num_valid=p["num_valid"]):
            logits = padded_logits(row_kinds, num_padded, num_experts, p["dtype"], ctx)
            kwargs = mode.kwargs(num_experts, top_k, ctx.generator, ctx.device)
            n = len(row_kinds)
            routing = ctx.api.route(
                logits, top_k, num_valid=num_valid_arg(p["num_valid"], n, ctx.device), **kwargs
            )
            expect_routing_contract(
                routing,
                num_rows=logits.shape[0],
                top_k=top_k,
                num_experts=num_experts,
                num_valid=n,
                device=ctx.device,
                row_names=row_kinds,
            )
            expect_route_matches_reference(routing, logits, top_k, kwargs, n, row_kinds)


@case("routing.nan_rows", ops=("route",))
def nan_rows(ctx: CaseContext) -> None:
    """all-NaN and mixed NaN/+Inf/-Inf rows: K distinct ids, finite weights"""
    _route_rows(ctx, ["all_nan", "mixed_nonfinite"])


@case("routing.inf_rows", ops=("route",))
def inf_rows(ctx: CaseContext) -> None:
    """all +Inf and all -Inf rows"""
    _route_rows(ctx, ["all_pos_inf", "all_neg_inf"])


@case("routing.odd_offset", ops=("route",))
def odd_offset(ctx: CaseContext) -> None:
    """one NaN / +Inf / -Inf at an odd offset of an otherwise good row"""
    _route_rows(ctx, ["one_nan_odd", "one_pos_inf_odd", "one_neg_inf_odd"])


@case("routing.all_equal", ops=("route",))
def all_equal(ctx: CaseContext) -> None:
    """all-equal rows (ties to the lowest index) and huge finite rows"""
    _route_rows(ctx, ["all_equal", "huge_finite"])


@case("routing.tie_free", ops=("route",))
def tie_free(ctx: CaseContext) -> None:
    """tie-free rows equal the reference exactly, for K = 1, typical and E"""
    _route_rows(ctx, ["tie_free"], k_kinds=("one", "typical", "all"))


@case("routing.health", ops=("route",))
def health(ctx: CaseContext) -> None:
    """health counts valid non-finite rows and padded rows, accumulating over calls"""
    kinds = ["all_nan", "tie_free", "one_pos_inf_odd", "tie_free", "mixed_nonfinite", "huge_finite"]
    nonfinite, num_padded = 3, 3
    for p in ctx.grid(
        E=ctx.choose((60,), (8, 257), (8, 64, 257)), mode=ROUTE_MODES[:4], num_valid=NUM_VALID_FORMS
    ):
        num_experts, mode = p["E"], p["mode"]
        top_k = top_k_for(num_experts)
        with ctx.sub(E=num_experts, mode=mode.name, num_valid=p["num_valid"]):
            logits = padded_logits(kinds, num_padded, num_experts, torch.float32, ctx)
            counter = new_health_tensor(ctx.device)
            kwargs = mode.kwargs(num_experts, top_k, ctx.generator, ctx.device)
            for _ in range(2):
                ctx.api.route(
                    logits,
                    top_k,
                    num_valid=num_valid_arg(p["num_valid"], len(kinds), ctx.device),
                    health=counter,
                    **kwargs,
                )
            got = counter.cpu().tolist()
            want = [0] * len(got)
            want[NONFINITE_ROWS], want[PADDED_ROWS], want[DROPPED_SLOTS] = 2 * nonfinite, 2 * num_padded, 0
            if got != want:
                raise CheckFailure(f"health after two calls is {got}, expected {want}")
