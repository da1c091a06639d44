"""Padding isolation: rows at or past `num_valid` are never read and come out as exact zeros
(routing: ids -1, weights 0), so real rows are bit-identical whatever the padded rows hold (NaN, Inf,
huge values, stale ids that look real). This is the CUDA-graph padding bug class (vLLM #37442,
#41834, #39244). Also: a device `num_valid` is clamped to [0, T], and 0 or 1 valid rows work."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from safemoe.check.cases.common import (
    NUM_VALID_FORMS,
    dtypes,
    expert_counts,
    num_valid_arg,
    padded_logits,
    route_modes,
)
from safemoe.check.inputs import (
    STALE_ID,
    expert_weights,
    interleave_with_tie_free,
    padding_rows,
    router_rows,
    tokens,
    top_k_for,
)
from safemoe.check.invariants import (
    expect_bitwise,
    expect_close,
    expect_finite,
    expect_routing_contract,
    expect_zero_rows,
)
from safemoe.check.registry import CaseContext, case
from safemoe.reference import route_reference
from safemoe.routing import Routing

FILLS_CPU = ("nan", "huge")
FILLS_CUDA = ("nan", "inf", "huge", "zero")
REAL_KINDS = interleave_with_tie_free(["all_nan", "one_neg_inf_odd"])


def _fills(ctx: CaseContext) -> tuple[str, ...]:
    return ctx.choose(FILLS_CPU, FILLS_CPU, FILLS_CUDA)


@case("padding.route", ops=("route",))
def route_padding(ctx: CaseContext) -> None:
    """route: real rows bit-identical with NaN/Inf/huge padded rows and without any"""
    num_padded = ctx.choose(3, 3, 29)
    for p in ctx.grid(
        E=expert_counts(ctx), mode=route_modes(ctx), dtype=dtypes(ctx), num_valid=NUM_VALID_FORMS
    ):
        num_experts, mode = p["E"], p["mode"]
        top_k = top_k_for(num_experts)
        with ctx.sub(E=num_experts, mode=mode.name, dtype=p["dtype"], num_valid=p["num_valid"]):
            kwargs = mode.kwargs(num_experts, top_k, ctx.generator, ctx.device)
            real = router_rows(REAL_KINDS, num_experts, ctx.generator)
            n = real.shape[0]
            plain = ctx.api.route(real.to(p["dtype"]).to(ctx.device), top_k, **kwargs)
            for fill in _fills(ctx):
                logits = (
                    torch.cat([real, padding_rows(fill, num_padded, num_experts)])
                    .to(p["dtype"])
                    .to(ctx.device)
                )
                routing = ctx.api.route(
                    logits, top_k, num_valid=num_valid_arg(p["num_valid"], n, ctx.device), **kwargs
                )
                expect_routing_contract(
                    routing,
                    num_rows=n + num_padded,
                    top_k=top_k,
                    num_experts=num_experts,
                    num_valid=n,
                    device=ctx.device,
                    row_names=REAL_KINDS,
                )
                expect_bitwise(
                    routing.ids[:n], plain.ids, f"ids of real rows, padded with {fill} vs unpadded"
                )
                expect_bitwise(
                    routing.weights[:n],
                    plain.weights,
                    f"weights of real rows, padded with {fill} vs unpadded",
                )


def _experts_problem(ctx: CaseContext, dtype: torch.dtype) -> dict[str, Any]:
    num_experts = ctx.choose(8, 8, 64)
    hidden, inter = ctx.choose((32, 16), (32, 16), (256, 128))
    top_k = top_k_for(num_experts)
    w13, w2 = expert_weights(num_experts, hidden, inter, dtype, ctx.generator)
    return {
        "E": num_experts,
        "K": top_k,
        "H": hidden,
        "I": inter,
        "w13": w13.to(ctx.device),
        "w2": w2.to(ctx.device),
    }


def _padded_routing(ctx: CaseContext, real: Routing, num_padded: int, num_experts: int, fill: str) -> Routing:
    """Padded rows carry ids that look real (or stale garbage) and NaN / huge weights."""
    top_k = real.ids.shape[1]
    if fill == "nan":
        pad_ids = torch.full((num_padded, top_k), STALE_ID, dtype=torch.int32)
    else:  # valid-looking ids, as a reused buffer holds (vLLM #41834)
        pad_ids = torch.randint(
            0, num_experts, (num_padded, top_k), generator=ctx.generator, dtype=torch.int32
        )
    pad_weights = padding_rows(fill, num_padded, top_k)
    return Routing(
        weights=torch.cat([real.weights.cpu(), pad_weights]).to(ctx.device),
        ids=torch.cat([real.ids.cpu(), pad_ids]).to(ctx.device),
    )


def _isolation(ctx: CaseContext, run: Callable[[str | None], torch.Tensor], num_rows: int, what: str) -> None:
    """`run(fill)` pads with `fill` rows; `run(None)` does not pad. Every fill must give the same real
    rows bit for bit and zeros on padded rows; unpadded must match within tolerance (tile configs
    may depend on T, which moves fp32 rounding; see docs/contract.md)."""
    unpadded = run(None)
    expect_finite(unpadded, num_rows, f"{what} unpadded")
    first: torch.Tensor | None = None
    for fill in _fills(ctx):
        out = run(fill)
        expect_zero_rows(out, num_rows, f"{what} padded with {fill}")
        expect_finite(out, num_rows, f"{what} padded with {fill}")
        expect_close(out[:num_rows], unpadded, f"{what}: real rows padded with {fill} vs unpadded")
        if first is None:
            first = out
        else:
            expect_bitwise(out[:num_rows], first[:num_rows], f"{what}: real rows padded with {fill} vs nan")


def _run_experts(
    ctx: CaseContext,
    prob: dict[str, Any],
    x_real: torch.Tensor,
    real: Routing,
    num_valid: Any,
    activation: str,
    num_padded: int,
    fill: str | None,
) -> torch.Tensor:
    if fill is None:
        return ctx.api.experts(x_real, prob["w13"], prob["w2"], real, activation=activation)
    pad = padding_rows(fill, num_padded, prob["H"]).to(x_real.dtype).to(ctx.device)
    routing = _padded_routing(ctx, real, num_padded, prob["E"], fill)
    return ctx.api.experts(
        torch.cat([x_real, pad]), prob["w13"], prob["w2"], routing, activation=activation, num_valid=num_valid
    )


@case("padding.experts", ops=("experts",))
def experts_padding(ctx: CaseContext) -> None:
    """experts: padded rows (NaN x, stale or real-looking ids, NaN weights) are zeros, real rows untouched"""
    num_padded = ctx.choose(2, 3, 29)
    for p in ctx.grid(dtype=dtypes(ctx), activation=("silu", "gelu", "swigluoai"), num_valid=NUM_VALID_FORMS):
        with ctx.sub(**p):
            prob = _experts_problem(ctx, p["dtype"])
            n = ctx.choose(3, 5, 37)
            x_real = tokens(n, prob["H"], ctx.generator).to(p["dtype"]).to(ctx.device)
            weights, ids = route_reference(router_rows(["tie_free"] * n, prob["E"], ctx.generator), prob["K"])
            real = Routing(weights=weights.to(ctx.device), ids=ids.to(ctx.device))
            nv = num_valid_arg(p["num_valid"], n, ctx.device)
            run = partial(_run_experts, ctx, prob, x_real, real, nv, p["activation"], num_padded)
            _isolation(ctx, run, n, "experts")


def _run_moe(
    ctx: CaseContext,
    prob: dict[str, Any],
    x_real: torch.Tensor,
    real_logits: torch.Tensor,
    num_valid: Any,
    kwargs: dict[str, Any],
    num_padded: int,
    fill: str | None,
) -> torch.Tensor:
    dtype = x_real.dtype
    if fill is None:
        logits = real_logits.to(dtype).to(ctx.device)
        return ctx.api.moe(x_real, logits, prob["w13"], prob["w2"], prob["K"], **kwargs)
    logits = torch.cat([real_logits, padding_rows(fill, num_padded, prob["E"])]).to(dtype).to(ctx.device)
    x = torch.cat([x_real, padding_rows(fill, num_padded, prob["H"]).to(dtype).to(ctx.device)])
    return ctx.api.moe(x, logits, prob["w13"], prob["w2"], prob["K"], num_valid=num_valid, **kwargs)


@case("padding.moe", ops=("moe",))
def moe_padding(ctx: CaseContext) -> None:
    """moe: NaN router logits and NaN tokens on padded rows leave real rows untouched"""
    num_padded = ctx.choose(2, 3, 29)
    for p in ctx.grid(dtype=dtypes(ctx), mode=route_modes(ctx), num_valid=NUM_VALID_FORMS):
        mode = p["mode"]
        with ctx.sub(dtype=p["dtype"], mode=mode.name, num_valid=p["num_valid"]):
            prob = _experts_problem(ctx, p["dtype"])
            kwargs = mode.kwargs(prob["E"], prob["K"], ctx.generator, ctx.device)
            real_logits = router_rows(REAL_KINDS, prob["E"], ctx.generator)
            n = real_logits.shape[0]
            x_real = tokens(n, prob["H"], ctx.generator).to(p["dtype"]).to(ctx.device)
            nv = num_valid_arg(p["num_valid"], n, ctx.device)
            run = partial(_run_moe, ctx, prob, x_real, real_logits, nv, kwargs, num_padded)
            _isolation(ctx, run, n, "moe")


def _counts(num_rows: int) -> list[tuple[str, int, int]]:
    """(num_valid form, value passed, effective count): 0, 1 and T, and device values outside
    [0, T] that kernels clamp (a host int outside raises instead)."""
    return [
        ("int", 0, 0),
        ("int32_tensor", 0, 0),
        ("int", 1, 1),
        ("int64_tensor", 1, 1),
        ("int32_tensor", num_rows, num_rows),
        ("int64_tensor", num_rows + 3, num_rows),
        ("int32_tensor", -2, 0),
        ("int64_tensor", 2**40, num_rows),
    ]


@case("padding.num_valid", ops=("route", "experts", "moe"))
def num_valid_counts(ctx: CaseContext) -> None:
    """num_valid 0, 1, T, and device values clamped to [0, T], on route, experts and moe"""
    dtype = torch.float32
    prob = _experts_problem(ctx, dtype)
    num_rows = ctx.choose(4, 4, 33)
    logits = padded_logits(["tie_free"] * num_rows, 0, prob["E"], dtype, ctx)
    x = tokens(num_rows, prob["H"], ctx.generator).to(dtype).to(ctx.device)
    full_routing = ctx.api.route(logits, prob["K"])
    full_out = ctx.api.experts(x, prob["w13"], prob["w2"], full_routing)
    for form, value, count in _counts(num_rows):
        with ctx.sub(num_valid=form, value=value):
            nv = num_valid_arg(form, value, ctx.device)
            routing = ctx.api.route(logits, prob["K"], num_valid=nv)
            expect_routing_contract(
                routing,
                num_rows=num_rows,
                top_k=prob["K"],
                num_experts=prob["E"],
                num_valid=count,
                device=ctx.device,
            )
            expect_bitwise(
                routing.ids[:count], full_routing.ids[:count], "ids of valid rows vs all rows valid"
            )
            out = ctx.api.experts(x, prob["w13"], prob["w2"], full_routing, num_valid=nv)
            expect_zero_rows(out, count, "experts")
            # Close, not bitwise: fewer valid rows change the GEMM shapes, even in the reference.
            expect_close(out[:count], full_out[:count], "experts valid rows vs all rows valid")
            moe_out = ctx.api.moe(x, logits, prob["w13"], prob["w2"], prob["K"], num_valid=nv)
            expect_zero_rows(moe_out, count, "moe")
            expect_close(moe_out[:count], full_out[:count], "moe valid rows vs route + experts")
