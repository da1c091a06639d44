"""Family 8, batch invariance: with `batch_invariant=True` a valid row's output is bitwise the same
whatever T, num_valid and the other rows hold (vLLM #46639, FlashInfer #2059 ask for it; no MoE
library offers it). The same row (router logits, tokens, routing) is placed among random, NaN or
huge rows in batches of T = 1 .. 8192 (CUDA; fewer and smaller on CPU), with num_valid in every
form, and compared bit for bit with the row computed alone.

Only safemoe's Triton backend makes the promise; the reference backend (torch matmuls pick their
algorithm by shape) and peers (no such option) are n/a.
"""

from __future__ import annotations

from typing import Any

import torch

import safemoe
from safemoe.check.cases.common import NUM_VALID_FORMS, dtypes, num_valid_arg
from safemoe.check.inputs import expert_weights, router_rows, tokens, top_k_for
from safemoe.check.invariants import expect_bitwise
from safemoe.check.registry import CaseContext, Plan, case

FILLS = ("random", "nan", "huge")


def _token_counts(ctx: CaseContext) -> tuple[int, ...]:
    return ctx.choose((1, 3, 17), (1, 3, 17, 64, 200), (1, 2, 7, 8, 9, 64, 256, 1024, 8192))


def _require_invariant_backend(ctx: CaseContext) -> None:
    if ctx.api.kind != "safemoe" or ctx.api.name != "triton":
        ctx.not_applicable("batch_invariant=True is a guarantee of safemoe's Triton kernels only")


def _params(plan: Plan) -> list[dict[str, Any]]:
    return plan.pairs(dtype=dtypes(plan), num_valid=NUM_VALID_FORMS)


def _placements(ctx: CaseContext, form: str) -> list[tuple[int, int, int | torch.Tensor | None, str]]:
    """(T, position of the row, num_valid, fill of the other rows): the row first, in the middle
    or last in turn, num_valid just past it (the given form) or every row, the fills in turn."""
    out = []
    for i, t in enumerate(_token_counts(ctx)):
        position = (0, t // 2, t - 1)[i % 3]
        count = position + 1 if i % 2 else t
        out.append((t, position, num_valid_arg(form, count, ctx.device), FILLS[i % len(FILLS)]))
    return out


def _batch(ctx: CaseContext, row: torch.Tensor, t: int, position: int, fill: str) -> torch.Tensor:
    """[T, width] in row's dtype: `row` at `position`, the other rows random, NaN or huge."""
    width = row.shape[0]
    if fill == "nan":
        batch = torch.full((t, width), float("nan"))
    elif fill == "huge":
        batch = torch.full((t, width), 6.0e4 if row.dtype == torch.float16 else 3.0e38)
    else:
        batch = tokens(t, width, ctx.generator)
    batch = batch.to(device=ctx.device, dtype=row.dtype)
    batch[position] = row
    return batch


def _problem(ctx: CaseContext, dtype: torch.dtype) -> dict[str, Any]:
    num_experts = ctx.choose(8, 8, 64)
    hidden, inter = ctx.choose((32, 16), (32, 16), (256, 128))
    w13, w2 = (w.to(ctx.device) for w in expert_weights(num_experts, hidden, inter, dtype, ctx.generator))
    return {"E": num_experts, "K": top_k_for(num_experts), "H": hidden, "I": inter, "w13": w13, "w2": w2,
            "x": tokens(1, hidden, ctx.generator)[0].to(device=ctx.device, dtype=dtype),
            "logits": router_rows(["tie_free"], num_experts, ctx.generator)[0].to(device=ctx.device,
                                                                                   dtype=dtype)}


@case("invariance.route", ops=("route",), params=_params)
def route_invariance(ctx: CaseContext, **p: Any) -> None:
    """route, batch_invariant: a row's ids and weights bitwise the same in batches of every T"""
    _require_invariant_backend(ctx)
    prob = _problem(ctx, p["dtype"])
    alone = ctx.api.route(prob["logits"][None], prob["K"], batch_invariant=True)
    for t, position, nv, fill in _placements(ctx, p["num_valid"]):
        got = ctx.api.route(_batch(ctx, prob["logits"], t, position, fill), prob["K"], num_valid=nv,
                            batch_invariant=True)
        what = f"route row {position} of T={t} among {fill} rows"
        expect_bitwise(got.ids[position], alone.ids[0], f"{what}: ids")
        expect_bitwise(got.weights[position], alone.weights[0], f"{what}: weights")


@case("invariance.experts", ops=("experts",), params=_params)
def experts_invariance(ctx: CaseContext, **p: Any) -> None:
    """experts, batch_invariant: a row's output bitwise the same in batches of every T"""
    _require_invariant_backend(ctx)
    prob = _problem(ctx, p["dtype"])
    row_routing = safemoe.route(prob["logits"][None].float(), prob["K"])
    alone = ctx.api.experts(prob["x"][None], prob["w13"], prob["w2"], row_routing, batch_invariant=True)
    for t, position, nv, fill in _placements(ctx, p["num_valid"]):
        others = router_rows(["tie_free"] * t, prob["E"], ctx.generator).to(ctx.device)
        routing = safemoe.route(others, prob["K"])
        routing.ids[position], routing.weights[position] = row_routing.ids[0], row_routing.weights[0]
        got = ctx.api.experts(_batch(ctx, prob["x"], t, position, fill), prob["w13"], prob["w2"], routing,
                              num_valid=nv, batch_invariant=True)
        expect_bitwise(got[position], alone[0], f"experts row {position} of T={t} among {fill} rows")


@case("invariance.moe", ops=("moe",), params=_params)
def moe_invariance(ctx: CaseContext, **p: Any) -> None:
    """moe, batch_invariant: same row in batches of 1..8192 (CPU: 1..200), bitwise"""
    _require_invariant_backend(ctx)
    prob = _problem(ctx, p["dtype"])
    args = (prob["w13"], prob["w2"], prob["K"])
    alone = ctx.api.moe(prob["x"][None], prob["logits"][None], *args, batch_invariant=True)
    for t, position, nv, fill in _placements(ctx, p["num_valid"]):
        x = _batch(ctx, prob["x"], t, position, fill)
        logits = _batch(ctx, prob["logits"], t, position, fill)
        got = ctx.api.moe(x, logits, *args, num_valid=nv, batch_invariant=True)
        expect_bitwise(got[position], alone[0], f"moe row {position} of T={t} among {fill} rows")


@case("invariance.layer", ops=("moe",), params=_params)
def layer_invariance(ctx: CaseContext, **p: Any) -> None:
    """safemoe.MoE(batch_invariant=True) with a gated shared expert: a row bitwise the same at every T"""
    _require_invariant_backend(ctx)
    dtype = p["dtype"]
    prob = _problem(ctx, dtype)
    layer = safemoe.MoE(prob["H"], prob["I"], prob["E"], prob["K"], shared_intermediate_size=prob["I"],
                        shared_expert_gate=True, backend="triton", batch_invariant=True, dtype=dtype,
                        device=ctx.device)
    with torch.no_grad():
        for param in layer.parameters():  # drawn from the case's generator, not the global RNG
            param.copy_(0.1 * torch.randn(param.shape, generator=ctx.generator))
        alone = layer(prob["x"][None])
        for t, position, nv, fill in _placements(ctx, p["num_valid"]):
            got = layer(_batch(ctx, prob["x"], t, position, fill), num_valid=nv)
            expect_bitwise(got[position], alone[0], f"MoE layer row {position} of T={t} among {fill} rows")
