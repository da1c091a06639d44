"""Family 5, buffer hygiene: every output element is written, and nothing left in a buffer from
before the call is read. Caller-owned outputs (`route_into`, `experts_triton(out=)`) and the
shared `safemoe.Workspace` are pre-filled with NaN/+-Inf/stale ids; for every backend, the memory
the next allocations will get is poisoned first (freed NaN/Inf blocks of every size class: on
CUDA the caching allocator hands them out again), so an unwritten element or an uninitialised
read shows as NaN (FlashInfer #3840 #1469, pytorch #154557)."""

from __future__ import annotations

import math
from typing import Any

import torch

import safemoe
from safemoe._checks import NumValid
from safemoe.check.cases.common import (
    ACTIVATIONS,
    dtypes,
    expect_padding_zeros,
    experts_problem,
    num_valid_arg,
    padded_logits,
    require,
    route_modes,
    rows_held_valid,
)
from safemoe.check.inputs import (
    PAD_VALUES,
    STALE_ID,
    interleave_with_tie_free,
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
from safemoe.reference import experts_reference, moe_reference, route_reference
from safemoe.routing import Routing

FILLS = ("nan", "inf", "neg_inf")
KINDS = interleave_with_tie_free(["all_nan", "one_pos_inf_odd"])


def _fill(t: torch.Tensor, fill: str) -> torch.Tensor:
    """Fill a buffer with poison: the fill value, or STALE_ID / -7 for integer buffers."""
    if t.is_floating_point():
        return t.fill_(PAD_VALUES[fill])
    return t.fill_(STALE_ID if fill != "neg_inf" else -7)


def poison_allocator(device: torch.device, fill: str) -> None:
    """Allocate blocks of every size class from 512 B to 4 MiB, fill them, free them: the next
    allocations of those sizes get poisoned memory (deterministically so with CUDA's caching
    allocator; on CPU whatever malloc reuses)."""
    blocks = []
    size = 512
    while size <= 4 << 20:
        blocks += [torch.empty(size // 4, dtype=torch.float32, device=device) for _ in range(4)]
        size *= 2
    value = PAD_VALUES[fill]
    for block in blocks:
        block.fill_(value)
    del blocks


def _route_out_params(plan: Plan) -> list[dict[str, Any]]:
    rows = plan.pairs(
        E=plan.choose((8, 60), (8, 64, 257), (8, 64, 257, 512)), mode=route_modes(plan), dtype=dtypes(plan)
    )
    return plan.cross(rows, fill=(*FILLS, "stale"))


@case("buffers.route_out", ops=("route",), params=_route_out_params)
def route_out(ctx: CaseContext, **p: Any) -> None:
    """route_into writes every element of NaN/Inf/stale-filled weights and ids buffers"""
    require(ctx, "writes no caller-owned routing buffers", ctx.api.out_buffers)
    num_experts, mode, dtype = p["E"], p["mode"], p["dtype"]
    top_k = top_k_for(num_experts)
    num_padded = 3
    logits = padded_logits(KINDS, num_padded, num_experts, dtype, ctx)
    n, total = len(KINDS), logits.shape[0]
    config, bias = mode.routing(num_experts, top_k, ctx.generator, ctx.device)
    nv = num_valid_arg("int32_tensor", n, ctx.device)
    weights_out = torch.empty(total, top_k, dtype=torch.float32, device=ctx.device)
    ids_out = torch.empty(total, top_k, dtype=torch.int32, device=ctx.device)
    _fill(weights_out, "nan" if p["fill"] == "stale" else p["fill"])
    _fill(ids_out, p["fill"])
    ctx.api.route_into(logits, config, weights_out, ids_out, bias=bias, num_valid=nv)
    routing = Routing(weights=weights_out, ids=ids_out)
    expect_routing_contract(
        routing,
        num_rows=total,
        top_k=top_k,
        num_experts=num_experts,
        num_valid=n,
        device=ctx.device,
        row_names=KINDS,
    )
    fresh = ctx.api.route(logits, config, bias=bias, num_valid=nv)
    expect_bitwise(ids_out, fresh.ids, "route_into ids vs route")
    expect_bitwise(weights_out, fresh.weights, "route_into weights vs route")


def _experts_out_params(plan: Plan) -> list[dict[str, Any]]:
    rows = plan.pairs(dtype=dtypes(plan), activation=ACTIVATIONS, num_valid=("int", "int32_tensor"))
    return plan.cross(rows, fill=FILLS)


def _experts_inputs(ctx: CaseContext, dtype: torch.dtype, prob: dict[str, Any], n: int, total: int):
    x = tokens(total, prob["H"], ctx.generator)
    x[n:] = math.nan
    weights, ids = route_reference(router_rows(["tie_free"] * total, prob["E"], ctx.generator), prob["K"])
    return x.to(dtype).to(ctx.device), Routing(weights.to(ctx.device), ids.to(ctx.device))


@case("buffers.experts_out", ops=("experts",), params=_experts_out_params)
def experts_out(ctx: CaseContext, **p: Any) -> None:
    """experts into a NaN/Inf-filled out buffer: every row written, padded rows exact zeros"""
    require(ctx, "writes no caller-owned output buffer", ctx.api.out_buffers)
    dtype = p["dtype"]
    prob = experts_problem(ctx, dtype)
    n, total = ctx.choose(5, 5, 37), ctx.choose(7, 7, 64)
    x, routing = _experts_inputs(ctx, dtype, prob, n, total)
    nv = num_valid_arg(p["num_valid"], n, ctx.device)
    out = _fill(torch.empty_like(x), p["fill"])
    ctx.api.experts_into(x, prob["w13"], prob["w2"], routing, out, activation=p["activation"], num_valid=nv)
    expect_padding_zeros(ctx, out, n, "experts_into")
    expect_finite(out, n, "experts_into")
    fresh = ctx.api.experts(x, prob["w13"], prob["w2"], routing, activation=p["activation"], num_valid=nv)
    expect_bitwise(out, fresh, "experts_into vs experts")


def _workspace_params(plan: Plan) -> list[dict[str, Any]]:
    rows = plan.pairs(dtype=dtypes(plan), activation=ACTIVATIONS, E=plan.choose((8,), (8, 60), (8, 60, 64)))
    return plan.cross(rows, fill=FILLS, order=("big_first", "small_first"))


def _poison_workspace(
    workspace: Any, num_experts: int, top_k: int, hidden: int, inter: int, fill: str
) -> None:
    """Fill what a call writes before it reads (sorted slots, intermediate, y) with poison. The
    dispatch counters are left alone: they are zero between calls by contract."""
    views = workspace.views(workspace.max_tokens, num_experts, top_k, hidden, inter)
    views.sorted_slots.fill_(STALE_ID)
    views.intermediate.fill_(PAD_VALUES[fill])
    views.y.fill_(PAD_VALUES[fill])


@case("buffers.workspace", ops=("experts",), params=_workspace_params)
def workspace(ctx: CaseContext, **p: Any) -> None:
    """a poisoned shared Workspace reused by calls of different T gives the no-workspace result"""
    require(ctx, "keeps no workspace", ctx.api.uses_workspace)
    dtype = p["dtype"]
    prob = experts_problem(ctx, dtype, num_experts=p["E"])
    big, small = ctx.choose((9, 3), (9, 3), (97, 5))
    ws = safemoe.Workspace(big, prob["E"], prob["K"], prob["H"], prob["I"], dtype, ctx.device)
    _poison_workspace(ws, prob["E"], prob["K"], prob["H"], prob["I"], p["fill"])
    sizes = (big, small) if p["order"] == "big_first" else (small, big)
    for total in sizes:
        n = total - 1
        x, routing = _experts_inputs(ctx, dtype, prob, n, total)
        nv = num_valid_arg("int32_tensor", n, ctx.device)
        kwargs = {"activation": p["activation"], "num_valid": nv}
        out = ctx.api.experts(x, prob["w13"], prob["w2"], routing, workspace=ws, **kwargs)
        fresh = ctx.api.experts(x, prob["w13"], prob["w2"], routing, **kwargs)
        expect_padding_zeros(ctx, out, n, f"experts at T={total} in a poisoned workspace")
        expect_bitwise(out, fresh, f"experts at T={total} in a poisoned workspace vs without")


def _allocator_params(plan: Plan) -> list[dict[str, Any]]:
    rows = plan.pairs(dtype=dtypes(plan), num_valid=("none", "int", "int32_tensor"))
    return plan.cross(rows, fill=FILLS)


def _allocator_problem(ctx: CaseContext, p: dict[str, Any]) -> tuple[dict[str, Any], int, int, Any]:
    prob = experts_problem(ctx, p["dtype"])
    total = ctx.choose(7, 7, 67)
    n = total if p["num_valid"] == "none" else total - 2
    return prob, n, total, num_valid_arg(p["num_valid"], n, ctx.device)


@case("buffers.allocator_route", ops=("route",), params=_allocator_params)
def allocator_route(ctx: CaseContext, **p: Any) -> None:
    """route after the allocator's free blocks were filled with NaN/Inf: every output written"""
    prob, n, total, nv = _allocator_problem(ctx, p)
    logits = router_rows(["tie_free"] * total, prob["E"], ctx.generator).to(p["dtype"]).to(ctx.device)
    poison_allocator(ctx.device, p["fill"])
    routing = ctx.api.route(logits, prob["K"], num_valid=nv)
    expect_routing_contract(
        routing,
        num_rows=total,
        top_k=prob["K"],
        num_experts=prob["E"],
        num_valid=rows_held_valid(ctx, n, total),
        device=ctx.device,
    )


@case("buffers.allocator_experts", ops=("experts",), params=_allocator_params)
def allocator_experts(ctx: CaseContext, **p: Any) -> None:
    """experts after the allocator's free blocks were filled with NaN/Inf: every output written"""
    prob, n, total, nv = _allocator_problem(ctx, p)
    x, routing = _experts_inputs(ctx, p["dtype"], prob, n, total)
    poison_allocator(ctx.device, p["fill"])
    out = ctx.api.experts(x, prob["w13"], prob["w2"], routing, num_valid=nv)
    expect_padding_zeros(ctx, out, n, "experts on poisoned memory")
    expected = experts_reference(
        x, prob["w13"], prob["w2"], routing.weights, routing.ids, num_valid=NumValid(n, None)
    )
    expect_finite(out, n, "experts on poisoned memory")
    ctx.close(out[:n], expected[:n], "experts on poisoned memory vs reference")


@case("buffers.allocator_moe", ops=("moe",), params=_allocator_params)
def allocator_moe(ctx: CaseContext, **p: Any) -> None:
    """moe after the allocator's free blocks were filled with NaN/Inf: every output written"""
    prob, n, total, nv = _allocator_problem(ctx, p)
    logits = router_rows(["tie_free"] * total, prob["E"], ctx.generator).to(p["dtype"]).to(ctx.device)
    x = tokens(total, prob["H"], ctx.generator).to(p["dtype"]).to(ctx.device)
    poison_allocator(ctx.device, p["fill"])
    out = ctx.api.moe(x, logits, prob["w13"], prob["w2"], prob["K"], num_valid=nv)
    expect_padding_zeros(ctx, out, n, "moe on poisoned memory")
    expected = moe_reference(x, logits, prob["w13"], prob["w2"], prob["K"], num_valid=NumValid(n, None))
    expect_finite(out, n, "moe on poisoned memory")
    ctx.close(out[:n], expected[:n], "moe on poisoned memory vs reference")
