"""Family 3, dispatch robustness: the expert ids `experts` receives may be anything. A slot whose id
is -1, negative, >= E or garbage (123456789 left in a torch.empty buffer, vLLM #41834; int32
extremes) contributes nothing and is never used as an address (its NaN weight is never read);
duplicate ids in a row are each served; experts with no token are normal (pytorch #154557); every
token on one expert works; and every activation equals the reference."""

from __future__ import annotations

import math
from typing import Any

import torch

from safemoe._checks import NumValid
from safemoe.check.cases.common import (
    ACTIVATIONS,
    NUM_VALID_FORMS,
    dtypes,
    expect_padding_zeros,
    experts_problem,
    num_valid_arg,
)
from safemoe.check.inputs import BAD_IDS, random_weights, router_rows, tokens, top_k_for
from safemoe.check.invariants import expect_finite
from safemoe.check.registry import CaseContext, CheckFailure, Plan, case
from safemoe.health import DROPPED_SLOTS, new_health_tensor
from safemoe.reference import experts_reference, route_reference, valid_slot_mask
from safemoe.routing import Routing


def _bad_params(plan: Plan) -> list[dict[str, Any]]:
    # E = 6 with K = 8: more slots than experts, each duplicate served (legal input).
    rows = plan.pairs(
        dtype=dtypes(plan),
        E=plan.choose((8,), (6, 8, 64), (6, 8, 64, 160, 257)),
        K=(1, 2, 4, 8),
        num_valid=NUM_VALID_FORMS,
    )
    return plan.cross(rows, bad=(*BAD_IDS, "mixed"))


def _run_and_compare(
    ctx: CaseContext,
    prob: dict[str, Any],
    x: torch.Tensor,
    routing: Routing,
    n: int,
    what: str,
    **kwargs: Any,
) -> torch.Tensor:
    """experts on (x, routing) with n valid rows: finite real rows equal to the reference, zeros after."""
    out = ctx.api.experts(x, prob["w13"], prob["w2"], routing, **kwargs)
    expected = experts_reference(
        x,
        prob["w13"],
        prob["w2"],
        routing.weights,
        routing.ids,
        activation=kwargs.get("activation", "silu"),
        num_valid=NumValid(n, None),
    )
    expect_finite(out, n, what)
    expect_padding_zeros(ctx, out, n, what)
    ctx.close(out[:n], expected[:n], f"{what} vs reference")
    return out


@case("dispatch.bad_ids", ops=("experts",), params=_bad_params)
def bad_ids(ctx: CaseContext, **p: Any) -> None:
    """ids -1, -7, E, E+1, 123456789, int32 min/max are dropped (NaN weights never read), duplicates served"""
    num_experts, top_k, dtype = p["E"], p["K"], p["dtype"]
    prob = experts_problem(ctx, dtype, num_experts=num_experts, top_k=top_k)
    num_rows = ctx.choose(5, 6, 41)
    n = num_rows - 2
    ids = torch.randint(0, num_experts, (num_rows, top_k), generator=ctx.generator, dtype=torch.int32)
    kinds = list(BAD_IDS) if p["bad"] == "mixed" else [p["bad"]]
    values = torch.tensor([BAD_IDS[k](num_experts) for k in kinds], dtype=torch.int64)
    bad = torch.rand(num_rows, top_k, generator=ctx.generator) < 0.4
    bad[0, -1] = True  # at least one dropped slot on a valid row
    pick = values[torch.randint(0, len(values), (num_rows, top_k), generator=ctx.generator)]
    ids = torch.where(bad, pick, ids.long()).to(torch.int32)
    if top_k > 1:  # every third row repeats its first slot in its last
        ids[1::3, -1] = ids[1::3, 0]
    dropped = ~valid_slot_mask(ids, num_experts)
    weights = torch.where(dropped, math.nan, random_weights(num_rows, top_k, ctx.generator))
    x = tokens(num_rows, prob["H"], ctx.generator)
    x[n:] = math.nan
    routing = Routing(weights=weights.to(ctx.device), ids=ids.to(ctx.device))
    kwargs: dict[str, Any] = {"num_valid": num_valid_arg(p["num_valid"], n, ctx.device)}
    counter = new_health_tensor(ctx.device) if ctx.api.counts_health else None
    if counter is not None:
        kwargs["health"] = counter
    _run_and_compare(ctx, prob, x.to(dtype).to(ctx.device), routing, n, "experts with bad ids", **kwargs)
    if counter is not None:
        want, got = int(dropped[:n].sum()), int(counter[DROPPED_SLOTS])
        if got != want:
            raise CheckFailure(f"health[DROPPED_SLOTS] is {got}, expected {want} dropped slots on valid rows")


def _dup_params(plan: Plan) -> list[dict[str, Any]]:
    rows = plan.pairs(dtype=dtypes(plan), K=(2, 4, 8), E=plan.choose((8,), (8,), (8, 64)))
    return plan.cross(rows, pattern=("all_same", "pairs"))


@case("dispatch.duplicates", ops=("experts",), params=_dup_params)
def duplicates(ctx: CaseContext, **p: Any) -> None:
    """duplicate ids in a row each count: K copies of one expert, or ids in pairs, vs merged slots"""
    top_k, dtype = p["K"], p["dtype"]
    prob = experts_problem(ctx, dtype, num_experts=p["E"], top_k=top_k)
    num_rows = ctx.choose(3, 4, 33)
    copies = top_k if p["pattern"] == "all_same" else 2
    distinct = top_k // copies
    base = torch.stack(
        [torch.randperm(prob["E"], generator=ctx.generator)[:distinct] for _ in range(num_rows)]
    ).to(torch.int32)  # [T, K / copies]
    ids = base.repeat_interleave(copies, dim=1).contiguous()  # [T, K]
    base_weights = random_weights(num_rows, distinct, ctx.generator)
    weights = (base_weights / copies).repeat_interleave(copies, dim=1).contiguous()
    x = tokens(num_rows, prob["H"], ctx.generator).to(dtype).to(ctx.device)
    dup = _run_and_compare(
        ctx, prob, x, Routing(weights.to(ctx.device), ids.to(ctx.device)), num_rows, "duplicate ids"
    )
    merged = ctx.api.experts(
        x, prob["w13"], prob["w2"], Routing(base_weights.to(ctx.device), base.contiguous().to(ctx.device))
    )
    ctx.close(dup, merged, f"{copies} duplicate slots of weight w/{copies} vs one slot of weight w")


def _empty_params(plan: Plan) -> list[dict[str, Any]]:
    rows = plan.pairs(dtype=dtypes(plan), E=plan.choose((64,), (64, 257), (64, 128, 256, 257, 512)))
    return plan.cross(rows, T=(1, 2, 7), used=("two", "last"))


@case("dispatch.empty_experts", ops=("experts",), params=_empty_params)
def empty_experts(ctx: CaseContext, **p: Any) -> None:
    """almost every expert empty: a few tokens on two experts, or on the last expert only"""
    num_experts, num_rows = p["E"], p["T"]
    prob = experts_problem(ctx, p["dtype"], num_experts=num_experts, hidden=64, inter=32, top_k=2)
    if p["used"] == "two":
        pair = torch.randperm(num_experts, generator=ctx.generator)[:2].to(torch.int32)
        ids = pair.expand(num_rows, 2).contiguous()
    else:  # the last expert and the one before it: the tail of every per-expert table
        ids = (
            torch.tensor([num_experts - 1, num_experts - 2], dtype=torch.int32)
            .expand(num_rows, 2)
            .contiguous()
        )
    weights = random_weights(num_rows, 2, ctx.generator)
    x = tokens(num_rows, prob["H"], ctx.generator).to(p["dtype"]).to(ctx.device)
    routing = Routing(weights.to(ctx.device), ids.to(ctx.device))
    _run_and_compare(ctx, prob, x, routing, num_rows, "experts with empty experts")


def _one_params(plan: Plan) -> list[dict[str, Any]]:
    rows = plan.pairs(dtype=dtypes(plan), K=(1, 2), expert=("first", "middle", "last"))
    return plan.cross(rows, T=plan.choose((5,), (5, 129), (5, 129, 4097)))


@case("dispatch.one_expert", ops=("experts",), params=_one_params)
def one_expert(ctx: CaseContext, **p: Any) -> None:
    """every token on one expert (slot 0), other slots spread: one expert holds T rows"""
    num_rows, top_k = p["T"], p["K"]
    prob = experts_problem(ctx, p["dtype"], hidden=64, inter=32, top_k=top_k)
    num_experts = prob["E"]
    hot = {"first": 0, "middle": num_experts // 2, "last": num_experts - 1}[p["expert"]]
    ids = torch.full((num_rows, top_k), hot, dtype=torch.int32)
    if top_k > 1:
        others = torch.randint(0, num_experts - 1, (num_rows, top_k - 1), generator=ctx.generator)
        ids[:, 1:] = (others + (others >= hot).long()).to(torch.int32)  # anything but the hot expert
    weights = random_weights(num_rows, top_k, ctx.generator)
    x = tokens(num_rows, prob["H"], ctx.generator).to(p["dtype"]).to(ctx.device)
    routing = Routing(weights.to(ctx.device), ids.to(ctx.device))
    _run_and_compare(ctx, prob, x, routing, num_rows, f"all tokens on expert {hot}")


def _act_params(plan: Plan) -> list[dict[str, Any]]:
    rows = plan.pairs(dtype=dtypes(plan), activation=ACTIVATIONS, E=plan.choose((8,), (8,), (8, 64, 128)))
    return plan.cross(rows, T=plan.choose((4,), (1, 6), (1, 7, 67)))


@case("dispatch.activations", ops=("experts",), params=_act_params)
def activations(ctx: CaseContext, **p: Any) -> None:
    """experts equal the reference for silu, gelu and swigluoai (inputs reaching swigluoai's clamps)"""
    dtype, num_experts = p["dtype"], p["E"]
    hidden, inter = ctx.choose((32, 16), (32, 16), (512, 256))
    prob = experts_problem(ctx, dtype, num_experts=num_experts, hidden=hidden, inter=inter)
    num_rows = p["T"]
    # Larger inputs than tokens() so swigluoai's clamps at +-7 are reached.
    x = (3 * tokens(num_rows, hidden, ctx.generator)).to(dtype).to(ctx.device)
    weights, ids = route_reference(
        router_rows(["tie_free"] * num_rows, num_experts, ctx.generator), top_k_for(num_experts)
    )
    routing = Routing(weights.to(ctx.device), ids.to(ctx.device))
    _run_and_compare(ctx, prob, x, routing, num_rows, "experts", activation=p["activation"])
