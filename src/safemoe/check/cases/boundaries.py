"""Family 4, token-count boundaries: T = 0, 1, 2, 3, 7, 17 and around 128, 256, 4096 and 65536
(block and warp edges, vLLM #5938 past 65,536 tokens, SGLang #4727), with and without one padded
row, on route, experts and moe. Big T runs with small H and I (the row count is under test)."""

from __future__ import annotations

import math
from typing import Any

import torch

from safemoe._checks import NumValid
from safemoe.check.cases.common import (
    dtypes,
    expect_padding_zeros,
    experts_problem,
    num_valid_arg,
    rows_held_valid,
)
from safemoe.check.inputs import tokens, top_k_for
from safemoe.check.invariants import (
    clear_rows,
    expect_finite,
    expect_route_matches_reference,
    expect_routing_contract,
)
from safemoe.check.registry import CaseContext, NotApplicable, Plan, case
from safemoe.reference import experts_reference, moe_reference, route_reference
from safemoe.routing import Routing

SMALL_T = (0, 1, 2, 3, 7, 17, 127, 128, 129, 255, 256, 257)
LARGE_T = (4095, 4096, 4097, 65535, 65536, 65537)
# Past this, the Triton interpreter (CPU) takes 15 s to minutes per call; those cases run on CUDA.
INTERPRETER_MAX_T = 257
FORMS = ("none", "int", "int32_tensor")


def _params(plan: Plan) -> list[dict[str, Any]]:
    # The row count is under test: small T meet every E; large T run at one E (64 on CUDA, 8 on
    # CPU, where torch's one-hot dispatch of 65k tokens over 128 experts alone takes seconds).
    small = plan.pairs(
        T=SMALL_T, E=plan.choose((8,), (8,), (8, 128, 257)), dtype=dtypes(plan), num_valid=FORMS
    )
    if plan.scale == 0:
        return small
    large = plan.pairs(T=LARGE_T, dtype=dtypes(plan), num_valid=FORMS)
    return small + [
        {"T": p["T"], "E": plan.choose(8, 8, 64), "dtype": p["dtype"], "num_valid": p["num_valid"]}
        for p in large
    ]


def _setup(ctx: CaseContext, p: dict[str, Any]) -> tuple[int, int, Any]:
    """(T, valid rows, num_valid argument): one padded row unless the form is `none`."""
    num_rows = p["T"]
    if num_rows > INTERPRETER_MAX_T and ctx.api.name == "triton" and not ctx.cuda:
        raise NotApplicable(f"T={num_rows} under the Triton interpreter takes minutes; it runs on CUDA")
    n = num_rows if p["num_valid"] == "none" else max(num_rows - 1, 0)
    return num_rows, n, num_valid_arg(p["num_valid"], n, ctx.device)


def _logits(ctx: CaseContext, num_rows: int, num_experts: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows; the first valid row all-equal and the last huge (+-3e4: the edges of a block
    are where a kernel's masks go wrong; both are ties, so only for a backend that promises the
    tie order); padded rows NaN (zeros for a backend without num_valid, which routes them: NaN
    rows are the routing family's business)."""
    logits = torch.randn(num_rows, num_experts, generator=ctx.generator)
    if n > 2 and ctx.api.exact_ties:
        logits[0] = 0.5
        logits[n - 1] = torch.where(logits[n - 1] > 0, 3e4, -3e4)
    logits[n:] = math.nan if ctx.api.native_num_valid else 0.0
    return logits.to(dtype).to(ctx.device)


def _dims(ctx: CaseContext, num_rows: int) -> tuple[int, int]:
    """(H, I): small for big T (the row count is under test, not the GEMM)."""
    if num_rows > 1024:
        return ctx.choose((16, 8), (16, 8), (64, 32))
    return ctx.choose((32, 16), (32, 16), (128, 64))


@case("boundaries.route", ops=("route",), params=_params)
def route_boundaries(ctx: CaseContext, **p: Any) -> None:
    """route at every boundary T, all-equal first and huge last valid row, one NaN padded row"""
    num_rows, n, nv = _setup(ctx, p)
    num_experts, dtype = p["E"], p["dtype"]
    top_k = top_k_for(num_experts)
    logits = _logits(ctx, num_rows, num_experts, n, dtype)
    routing = ctx.api.route(logits, top_k, num_valid=nv)
    expect_routing_contract(
        routing,
        num_rows=num_rows,
        top_k=top_k,
        num_experts=num_experts,
        num_valid=rows_held_valid(ctx, n, num_rows),
        device=ctx.device,
    )
    expect_route_matches_reference(
        routing,
        logits,
        top_k,
        None,
        n,
        exact_ties=ctx.api.exact_ties,
        ordered=ctx.api.ordered_ids,
        tolerance=ctx.api.weight_tolerance(dtype),
    )


@case("boundaries.experts", ops=("experts",), params=_params)
def experts_boundaries(ctx: CaseContext, **p: Any) -> None:
    """experts at every boundary T (reference routing), NaN tokens on the padded row"""
    num_rows, n, nv = _setup(ctx, p)
    dtype = p["dtype"]
    hidden, inter = _dims(ctx, num_rows)
    prob = experts_problem(ctx, dtype, num_experts=p["E"], hidden=hidden, inter=inter)
    weights, ids = route_reference(torch.randn(num_rows, prob["E"], generator=ctx.generator), prob["K"])
    routing = Routing(weights.to(ctx.device), ids.to(ctx.device))
    x = tokens(num_rows, hidden, ctx.generator)
    x[n:] = math.nan
    x = x.to(dtype).to(ctx.device)
    out = ctx.api.experts(x, prob["w13"], prob["w2"], routing, num_valid=nv)
    expected = experts_reference(
        x, prob["w13"], prob["w2"], routing.weights, routing.ids, num_valid=NumValid(n, None)
    )
    expect_finite(out, n, f"experts at T={num_rows}")
    expect_padding_zeros(ctx, out, n, f"experts at T={num_rows}")
    ctx.close(out[:n], expected[:n], f"experts at T={num_rows} vs reference")


@case("boundaries.moe", ops=("moe",), params=_params)
def moe_boundaries(ctx: CaseContext, **p: Any) -> None:
    """moe at every boundary T, all-equal first and huge last router row, NaN padded row"""
    num_rows, n, nv = _setup(ctx, p)
    dtype = p["dtype"]
    hidden, inter = _dims(ctx, num_rows)
    prob = experts_problem(ctx, dtype, num_experts=p["E"], hidden=hidden, inter=inter)
    logits = _logits(ctx, num_rows, prob["E"], n, dtype)
    x = tokens(num_rows, hidden, ctx.generator)
    x[n:] = math.nan
    x = x.to(dtype).to(ctx.device)
    out = ctx.api.moe(x, logits, prob["w13"], prob["w2"], prob["K"], num_valid=nv)
    expected = moe_reference(x, logits, prob["w13"], prob["w2"], prob["K"], num_valid=NumValid(n, None))
    expect_finite(out, n, f"moe at T={num_rows}")
    expect_padding_zeros(ctx, out, n, f"moe at T={num_rows}")
    # Rows whose choice of experts is a near-tie (random fp32 rows at 65k tokens have some; fp16
    # rows have exact ties, ordered differently by a backend without the tie rule) may pick
    # another expert correctly: compared where the choice is clear.
    clear, _ = clear_rows(logits[:n], prob["K"], None, ctx.api.exact_ties)
    ctx.close(out[:n], expected[:n], f"moe at T={num_rows} vs reference", rows=clear)
