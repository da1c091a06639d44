"""Family 2, padding isolation: rows at or past `num_valid` are never read and come out as exact
zeros (routing: ids -1, weights 0), so real rows do not depend on what padded rows hold (NaN, +-Inf,
1e4, stale ids that look real or are garbage). The CUDA-graph padding bug class (vLLM #37442,
#41834, #39244). Real rows are bitwise identical to an unpadded run where that is promised (route:
rows are independent; experts/moe: against a clean padding at the same T, since tile choices
depend on T) and close to the unpadded run otherwise. A device `num_valid` is clamped to [0, T].

A peer takes no num_valid: it runs the whole padded batch as an engine without it would, and is
held to real rows unaffected, padded routing still in range, and no crash."""

from __future__ import annotations

from typing import Any

import torch

from safemoe.check.cases.common import (
    ACTIVATIONS,
    NUM_VALID_FORMS,
    dtypes,
    expect_padding_zeros,
    experts_problem,
    num_valid_arg,
    padded_logits,
    require,
    route_modes,
    router_variants,
)
from safemoe.check.inputs import (
    STALE_ID,
    interleave_with_tie_free,
    padding_rows,
    router_rows,
    tokens,
    top_k_for,
)
from safemoe.check.invariants import (
    expect_bitwise,
    expect_finite,
    expect_routing_contract,
)
from safemoe.check.registry import CaseContext, Plan, case
from safemoe.reference import route_reference
from safemoe.routing import Routing

REAL_KINDS = interleave_with_tie_free(["all_nan", "one_neg_inf_odd"])
ROUTE_FILLS = ("nan", "inf", "neg_inf", "1e4", "zero")
# experts: what padded (x, ids, weights) hold; "stale" keeps x finite and only the ids wild.
EXPERT_FILLS = ("nan", "inf", "1e4", "stale", "zero")


def _num_padded(at: CaseContext) -> int:
    return at.choose(3, 3, 29)


def _route_params(plan: Plan) -> list[dict[str, Any]]:
    return plan.cross(router_variants(plan, num_valid=NUM_VALID_FORMS), fill=ROUTE_FILLS)


@case("padding.route", ops=("route",), params=_route_params)
def route_padding(ctx: CaseContext, **p: Any) -> None:
    """route: real rows bitwise identical whatever the padded rows hold; vs no padding: same ids"""
    num_experts, mode = p["E"], p["mode"]
    top_k = top_k_for(num_experts)
    config, bias = mode.routing(num_experts, top_k, ctx.generator, ctx.device)
    real = router_rows(REAL_KINDS, num_experts, ctx.generator)
    n, num_padded = real.shape[0], _num_padded(ctx)
    plain = ctx.api.route(real.to(p["dtype"]).to(ctx.device), config, bias=bias)
    logits = torch.cat([real, padding_rows(p["fill"], num_padded, num_experts)]).to(p["dtype"]).to(ctx.device)
    routing = ctx.api.route(logits, config, bias=bias, num_valid=num_valid_arg(p["num_valid"], n, ctx.device))
    expect_routing_contract(
        routing,
        num_rows=n + num_padded,
        top_k=top_k,
        num_experts=num_experts,
        num_valid=n if ctx.api.native_num_valid else n + num_padded,
        device=ctx.device,
        row_names=REAL_KINDS + ["padding"] * num_padded,
    )
    expect_bitwise(routing.ids[:n], plain.ids, f"ids of real rows, padded with {p['fill']} vs unpadded")
    # Another T may take another tile config and so another fp32 summation order: weights agree
    # within rounding there (1 ulp on the H200, 2026-11-21), and bitwise at the same T below.
    what = f"weights of real rows, padded with {p['fill']} vs unpadded"
    ctx.close(routing.weights[:n], plain.weights, what)
    clean = torch.cat([real, padding_rows("zero", num_padded, num_experts)]).to(p["dtype"]).to(ctx.device)
    same_t = ctx.api.route(clean, config, bias=bias, num_valid=num_valid_arg(p["num_valid"], n, ctx.device))
    for name in ("ids", "weights"):
        expect_bitwise(
            getattr(routing, name)[:n],
            getattr(same_t, name)[:n],
            f"{name} of real rows, padded with {p['fill']} vs zeros at the same T",
        )


def _padded_routing(ctx: CaseContext, real: Routing, num_padded: int, num_experts: int, fill: str) -> Routing:
    """Padded rows carry ids that look real, or stale garbage, or zeros (a clean, zeroed buffer:
    what any backend can take); weights by fill."""
    top_k = real.ids.shape[1]
    if fill == "zero":
        pad_ids = torch.zeros((num_padded, top_k), dtype=torch.int32)
    elif fill in ("nan", "stale"):
        garbage = torch.tensor([STALE_ID, -1, num_experts, -(2**31)], dtype=torch.int32)
        pad_ids = garbage[torch.randint(0, 4, (num_padded, top_k), generator=ctx.generator)]
    else:  # valid-looking ids, as a reused buffer holds (vLLM #41834)
        pad_ids = torch.randint(
            0, num_experts, (num_padded, top_k), generator=ctx.generator, dtype=torch.int32
        )
    weight_fill = {"stale": "1e4"}.get(fill, fill)
    pad_weights = padding_rows(weight_fill, num_padded, top_k)
    return Routing(
        weights=torch.cat([real.weights.cpu(), pad_weights]).to(ctx.device),
        ids=torch.cat([real.ids.cpu(), pad_ids]).to(ctx.device),
    )


def _pad_x(fill: str, num_padded: int, hidden: int, ctx: CaseContext) -> torch.Tensor:
    if fill == "stale":
        return tokens(num_padded, hidden, ctx.generator)
    return padding_rows(fill, num_padded, hidden)


def _isolation(
    ctx: CaseContext, unpadded: torch.Tensor, padded: torch.Tensor, clean: torch.Tensor, n: int, what: str
) -> None:
    """Padded rows zeros; real rows finite, close to the unpadded run, and bitwise equal to a clean
    padding at the same T (where the backend takes num_valid; a peer's real rows only close)."""
    expect_finite(unpadded, n, f"{what} unpadded")
    expect_padding_zeros(ctx, padded, n, what)
    expect_finite(padded, n, what)
    ctx.close(padded[:n], unpadded, f"{what}: real rows vs unpadded")
    if ctx.api.native_num_valid:
        expect_bitwise(padded[:n], clean[:n], f"{what}: real rows vs a clean (zero) padding at the same T")
    else:
        ctx.close(padded[:n], clean[:n], f"{what}: real rows vs a clean (zero) padding at the same T")


def _experts_params(plan: Plan) -> list[dict[str, Any]]:
    rows = plan.pairs(
        dtype=dtypes(plan),
        activation=ACTIVATIONS,
        num_valid=NUM_VALID_FORMS,
        E=plan.choose((8,), (8, 60), (8, 60, 128, 257)),
    )
    return plan.cross(rows, fill=EXPERT_FILLS)


@case("padding.experts", ops=("experts",), params=_experts_params)
def experts_padding(ctx: CaseContext, **p: Any) -> None:
    """experts: padded rows (NaN/Inf x, stale or real-looking ids, NaN weights) are zeros, real rows kept"""
    dtype, fill = p["dtype"], p["fill"]
    prob = experts_problem(ctx, dtype, num_experts=p["E"])
    n, num_padded = ctx.choose(3, 5, 37), _num_padded(ctx)
    x_real = tokens(n, prob["H"], ctx.generator).to(dtype).to(ctx.device)
    weights, ids = route_reference(router_rows(["tie_free"] * n, prob["E"], ctx.generator), prob["K"])
    real = Routing(weights=weights.to(ctx.device), ids=ids.to(ctx.device))
    nv = num_valid_arg(p["num_valid"], n, ctx.device)

    def run(kind: str) -> torch.Tensor:
        pad = _pad_x(kind, num_padded, prob["H"], ctx).to(dtype).to(ctx.device)
        routing = _padded_routing(ctx, real, num_padded, prob["E"], kind)
        return ctx.api.experts(
            torch.cat([x_real, pad]),
            prob["w13"],
            prob["w2"],
            routing,
            activation=p["activation"],
            num_valid=nv,
        )

    unpadded = ctx.api.experts(x_real, prob["w13"], prob["w2"], real, activation=p["activation"])
    _isolation(ctx, unpadded, run(fill), run("zero"), n, f"experts padded with {fill}")


def _moe_params(plan: Plan) -> list[dict[str, Any]]:
    rows = plan.pairs(dtype=dtypes(plan), mode=route_modes(plan), num_valid=NUM_VALID_FORMS)
    return plan.cross(rows, fill=("nan", "inf", "neg_inf", "1e4"))


@case("padding.moe", ops=("moe",), params=_moe_params)
def moe_padding(ctx: CaseContext, **p: Any) -> None:
    """moe: poisoned router logits and tokens on padded rows leave real rows untouched"""
    dtype, mode, fill = p["dtype"], p["mode"], p["fill"]
    prob = experts_problem(ctx, dtype)
    config, bias = mode.routing(prob["E"], prob["K"], ctx.generator, ctx.device)
    real_logits = router_rows(REAL_KINDS, prob["E"], ctx.generator)
    n, num_padded = real_logits.shape[0], _num_padded(ctx)
    x_real = tokens(n, prob["H"], ctx.generator).to(dtype).to(ctx.device)
    nv = num_valid_arg(p["num_valid"], n, ctx.device)
    # A peer routes padded rows: keep its real rows' inputs finite (the real NaN row is the
    # routing family's business), so only the padding is under test here.
    if not ctx.api.native_num_valid:
        real_logits = router_rows(["tie_free"] * n, prob["E"], ctx.generator)

    def run(kind: str | None) -> torch.Tensor:
        if kind is None:
            logits = real_logits.to(dtype).to(ctx.device)
            return ctx.api.moe(x_real, logits, prob["w13"], prob["w2"], config, bias=bias)
        pad_logits = padding_rows(kind, num_padded, prob["E"])
        logits = torch.cat([real_logits, pad_logits]).to(dtype).to(ctx.device)
        x = torch.cat([x_real, padding_rows(kind, num_padded, prob["H"]).to(dtype).to(ctx.device)])
        return ctx.api.moe(x, logits, prob["w13"], prob["w2"], config, bias=bias, num_valid=nv)

    _isolation(ctx, run(None), run(fill), run("zero"), n, f"moe padded with {fill}")


# (num_valid form, value passed, effective count): 0, 1 and T, and device values outside [0, T]
# that kernels clamp (a host int outside raises instead). "T" stands for the row count.
COUNTS = (
    ("int", "0"),
    ("int32_tensor", "0"),
    ("int", "1"),
    ("int64_tensor", "1"),
    ("int32_tensor", "T"),
    ("int64_tensor", "T+3"),
    ("int32_tensor", "-2"),
    ("int64_tensor", "2^40"),
)


def _count(text: str, num_rows: int) -> tuple[int, int]:
    """(value passed, effective count)."""
    value = {"T": num_rows, "T+3": num_rows + 3, "2^40": 2**40}.get(text)
    value = int(text) if value is None else value
    return value, min(max(value, 0), num_rows)


def _counts_params(plan: Plan) -> list[dict[str, Any]]:
    return plan.cross(plan.pairs(dtype=dtypes(plan)), count=[f"{f}:{v}" for f, v in COUNTS])


@case("padding.num_valid", ops=("route", "experts", "moe"), params=_counts_params)
def num_valid_counts(ctx: CaseContext, **p: Any) -> None:
    """num_valid 0, 1, T, and device values clamped to [0, T], on route, experts and moe"""
    require(ctx, "takes no num_valid", ctx.api.native_num_valid)
    dtype = p["dtype"]
    prob = experts_problem(ctx, dtype)
    num_rows = ctx.choose(4, 4, 33)
    form, text = p["count"].split(":")
    value, count = _count(text, num_rows)
    logits = padded_logits(["tie_free"] * num_rows, 0, prob["E"], dtype, ctx)
    x = tokens(num_rows, prob["H"], ctx.generator).to(dtype).to(ctx.device)
    full_routing = ctx.api.route(logits, prob["K"])
    full_out = ctx.api.experts(x, prob["w13"], prob["w2"], full_routing)
    nv = num_valid_arg(form, value, ctx.device)
    routing = ctx.api.route(logits, prob["K"], num_valid=nv)
    expect_routing_contract(
        routing, num_rows=num_rows, top_k=prob["K"], num_experts=prob["E"], num_valid=count, device=ctx.device
    )
    expect_bitwise(routing.ids[:count], full_routing.ids[:count], "ids of valid rows vs all rows valid")
    out = ctx.api.experts(x, prob["w13"], prob["w2"], full_routing, num_valid=nv)
    expect_padding_zeros(ctx, out, count, "experts")
    # Close, not bitwise: fewer valid rows change the GEMM shapes, even in the reference.
    ctx.close(out[:count], full_out[:count], "experts valid rows vs all rows valid")
    moe_out = ctx.api.moe(x, logits, prob["w13"], prob["w2"], prob["K"], num_valid=nv)
    expect_padding_zeros(ctx, moe_out, count, "moe")
    ctx.close(moe_out[:count], full_out[:count], "moe valid rows vs route + experts")
