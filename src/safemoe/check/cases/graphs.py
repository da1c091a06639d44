"""Family 6, CUDA graphs: the op is captured once on static buffers with a device `num_valid`, then
replayed with the count changed in place (T, 1, 0, T/2, T-1, T) and, between replays, new real
rows written and NaN (stale ids, NaN weights) injected into the padded rows. Every replay must equal
an eager call on the same buffers bit for bit, with padded rows exact zeros: the production
pattern of vLLM #39244 / #37442, and capture itself must work (no host sync, no allocation that
depends on data: failure class 10).

A backend without num_valid runs the whole bucket in the graph, padded rows included, as an engine
without it does. CUDA only; `Replayable` runs the same sequence eagerly elsewhere (tests)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch

import safemoe
from safemoe.check.cases.common import (
    ACTIVATIONS,
    dtypes,
    expect_padding_zeros,
    experts_problem,
    route_modes,
    rows_held_valid,
)
from safemoe.check.inputs import STALE_ID, router_rows, tokens, top_k_for
from safemoe.check.invariants import expect_bitwise, expect_finite, expect_routing_contract
from safemoe.check.registry import CaseContext, CheckFailure, NotApplicable, Plan, case
from safemoe.graphs import warm_up
from safemoe.reference import route_reference
from safemoe.routing import Routing

Outputs = tuple[torch.Tensor, ...]


class Replayable:
    """`fn() -> tensors` captured in a CUDA graph (after one eager warm-up on a side stream, which
    compiles kernels outside capture); `replay()` returns the static outputs. Off CUDA, `replay()`
    calls fn again (the same sequence, without a graph)."""

    def __init__(self, fn: Callable[[], Outputs], device: torch.device) -> None:
        self.fn = fn
        self.graph: Any = None
        if device.type != "cuda":
            self.outputs = fn()
            return
        warm_up(fn, device)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.outputs = fn()
        except Exception as error:
            with contextlib.suppress(RuntimeError):  # drain what the failed capture left
                torch.cuda.synchronize(device)
            first = (str(error).strip().splitlines() or [""])[0][:300]
            raise CheckFailure(f"CUDA graph capture failed: {type(error).__name__}: {first}") from error
        self.graph = graph

    def replay(self) -> Outputs:
        if self.graph is None:
            self.outputs = self.fn()
        else:
            self.graph.replay()
        return self.outputs


def require_graph(ctx: CaseContext, op: str) -> None:
    """n/a where the backend documents the op as not capturable (safemoe's reference experts use
    host syncs); every other backend is tried, and a failed capture is a failure."""
    if op not in ctx.api.graph_ops:
        raise NotApplicable(f"{ctx.api.name}'s {op} is documented as not CUDA-graph capturable")


def _counts(num_rows: int) -> tuple[int, ...]:
    return (num_rows, 1, 0, num_rows // 2, num_rows - 1, num_rows)


def _route_params(plan: Plan) -> list[dict[str, Any]]:
    return plan.pairs(
        E=plan.choose((8, 60), (8, 64, 257), (8, 64, 128, 256, 257, 512)),
        mode=route_modes(plan),
        dtype=dtypes(plan),
    )


@case("graphs.route", ops=("route",), params=_route_params, cuda_only=True)
def route_graph(ctx: CaseContext, **p: Any) -> None:
    """route captured once, replayed with num_valid changed in place and NaN padded rows"""
    require_graph(ctx, "route")
    num_experts, mode, dtype = p["E"], p["mode"], p["dtype"]
    top_k = top_k_for(num_experts)
    num_rows = ctx.choose(8, 8, 33)
    config, bias = mode.routing(num_experts, top_k, ctx.generator, ctx.device)
    logits = torch.zeros(num_rows, num_experts, dtype=dtype, device=ctx.device)
    nv = torch.tensor(num_rows, dtype=torch.int32, device=ctx.device)

    def fn() -> Outputs:
        routing = ctx.api.route(logits, config, bias=bias, num_valid=nv)
        return routing.weights, routing.ids

    graph = Replayable(fn, ctx.device)
    for step, count in enumerate(_counts(num_rows)):
        kinds = (["tie_free", "all_nan", "one_pos_inf_odd"] * num_rows)[:count]
        logits[:count] = router_rows(kinds, num_experts, ctx.generator).to(dtype).to(ctx.device)
        logits[count:] = math.nan
        nv.fill_(count)
        weights, ids = graph.replay()
        what = f"replay {step} (num_valid {count})"
        routing = Routing(weights=weights.clone(), ids=ids.clone())
        expect_routing_contract(
            routing,
            num_rows=num_rows,
            top_k=top_k,
            num_experts=num_experts,
            num_valid=rows_held_valid(ctx, count, num_rows),
            device=ctx.device,
        )
        eager = ctx.api.route(logits, config, bias=bias, num_valid=nv)
        expect_bitwise(routing.ids, eager.ids, f"{what}: ids vs eager")
        expect_bitwise(routing.weights, eager.weights, f"{what}: weights vs eager")


def _write_experts_inputs(
    ctx: CaseContext,
    prob: dict[str, Any],
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    count: int,
) -> None:
    """New real rows [0, count); padded rows NaN tokens, stale ids, NaN weights."""
    num_rows = x.shape[0]
    x[:count] = tokens(count, prob["H"], ctx.generator).to(x.dtype).to(ctx.device)
    x[count:] = math.nan
    w, i = route_reference(router_rows(["tie_free"] * num_rows, prob["E"], ctx.generator), prob["K"])
    weights.copy_(w)
    ids.copy_(i)
    ids[count:] = STALE_ID
    weights[count:] = math.nan


def _experts_params(plan: Plan) -> list[dict[str, Any]]:
    return plan.pairs(dtype=dtypes(plan), activation=ACTIVATIONS, E=plan.choose((8,), (8,), (8, 64, 128)))


def _check_replay(ctx: CaseContext, out: torch.Tensor, eager: torch.Tensor, count: int, what: str) -> None:
    expect_padding_zeros(ctx, out, count, what)
    expect_finite(out, count, what)
    if ctx.api.native_num_valid:
        expect_bitwise(out, eager, f"{what} vs eager")
    else:  # a peer's padded rows hold whatever it made of the poison, in both runs
        expect_bitwise(out[:count], eager[:count], f"{what}: real rows vs eager")


@case("graphs.experts", ops=("experts",), params=_experts_params, cuda_only=True)
def experts_graph(ctx: CaseContext, **p: Any) -> None:
    """experts captured once (with a Workspace where used), replayed with num_valid changed, NaN/stale pads"""
    require_graph(ctx, "experts")
    dtype = p["dtype"]
    prob = experts_problem(ctx, dtype, num_experts=p["E"])
    num_rows = ctx.choose(8, 8, 40)
    x = torch.zeros(num_rows, prob["H"], dtype=dtype, device=ctx.device)
    weights = torch.zeros(num_rows, prob["K"], dtype=torch.float32, device=ctx.device)
    ids = torch.zeros(num_rows, prob["K"], dtype=torch.int32, device=ctx.device)
    nv = torch.tensor(num_rows, dtype=torch.int32, device=ctx.device)
    _write_experts_inputs(ctx, prob, x, weights, ids, num_rows)
    kwargs: dict[str, Any] = {"activation": p["activation"], "num_valid": nv}
    if ctx.api.uses_workspace:
        kwargs["workspace"] = safemoe.Workspace(
            num_rows, prob["E"], prob["K"], prob["H"], prob["I"], dtype, ctx.device
        )

    def fn() -> Outputs:
        return (ctx.api.experts(x, prob["w13"], prob["w2"], Routing(weights, ids), **kwargs),)

    graph = Replayable(fn, ctx.device)
    for step, count in enumerate(_counts(num_rows)):
        _write_experts_inputs(ctx, prob, x, weights, ids, count)
        nv.fill_(count)
        (out,) = graph.replay()
        out = out.clone()
        eager = ctx.api.experts(x, prob["w13"], prob["w2"], Routing(weights, ids), **kwargs)
        _check_replay(ctx, out, eager, count, f"replay {step} (num_valid {count})")


def _moe_params(plan: Plan) -> list[dict[str, Any]]:
    return plan.pairs(dtype=dtypes(plan), mode=route_modes(plan))


@case("graphs.moe", ops=("moe",), params=_moe_params, cuda_only=True)
def moe_graph(ctx: CaseContext, **p: Any) -> None:
    """moe captured once, replayed with num_valid changed in place and NaN logits/tokens in padded rows"""
    require_graph(ctx, "moe")
    dtype, mode = p["dtype"], p["mode"]
    prob = experts_problem(ctx, dtype)
    num_rows = ctx.choose(8, 8, 40)
    config, bias = mode.routing(prob["E"], prob["K"], ctx.generator, ctx.device)
    x = torch.zeros(num_rows, prob["H"], dtype=dtype, device=ctx.device)
    logits = torch.zeros(num_rows, prob["E"], dtype=dtype, device=ctx.device)
    nv = torch.tensor(num_rows, dtype=torch.int32, device=ctx.device)

    def fn() -> Outputs:
        return (ctx.api.moe(x, logits, prob["w13"], prob["w2"], config, bias=bias, num_valid=nv),)

    graph = Replayable(fn, ctx.device)
    for step, count in enumerate(_counts(num_rows)):
        x[:count] = tokens(count, prob["H"], ctx.generator).to(dtype).to(ctx.device)
        x[count:] = math.nan
        logits[:count] = router_rows(["tie_free"] * count, prob["E"], ctx.generator).to(dtype).to(ctx.device)
        logits[count:] = math.nan
        nv.fill_(count)
        (out,) = graph.replay()
        out = out.clone()
        eager = ctx.api.moe(x, logits, prob["w13"], prob["w2"], config, bias=bias, num_valid=nv)
        _check_replay(ctx, out, eager, count, f"replay {step} (num_valid {count})")
