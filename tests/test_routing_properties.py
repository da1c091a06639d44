"""Property tests of the routing contract (hypothesis), through the public API on the reference
backend: for any logits, NaN and Inf included, any E <= 64, K <= E, num_valid, scoring, bias and
group configuration."""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import safemoe
from helpers import assert_equal

SPECIALS = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e4, -1e4, 65504.0, 3.4e38, -3.4e38, 1e-30]


def _value(width: int) -> st.SearchStrategy[float]:
    return st.one_of(st.floats(width=width, allow_nan=True, allow_infinity=True), st.sampled_from(SPECIALS))


@st.composite
def routing_problems(draw: st.DrawFn) -> dict[str, Any]:
    num_experts = draw(st.integers(1, 64))
    top_k = draw(st.integers(1, num_experts))
    num_rows = draw(st.integers(0, 6))
    dtype = draw(st.sampled_from([torch.float32, torch.float16]))
    width = 32 if dtype == torch.float32 else 16
    # Rows are drawn from a few patterns so that non-finite and tied rows are common.
    rows = []
    for _ in range(num_rows):
        pattern = draw(st.sampled_from(["free", "constant", "sparse"]))
        if pattern == "free":
            rows.append(draw(st.lists(_value(width), min_size=num_experts, max_size=num_experts)))
        elif pattern == "constant":
            rows.append([draw(_value(width))] * num_experts)
        else:
            row = [draw(st.floats(-4, 4, width=width))] * num_experts
            for i in draw(st.lists(st.integers(0, num_experts - 1), max_size=3)):
                row[i] = draw(st.sampled_from(SPECIALS))
            rows.append(row)
    logits = torch.tensor(rows, dtype=torch.float32).reshape(num_rows, num_experts).to(dtype)
    kwargs: dict[str, Any] = {
        "scoring": draw(st.sampled_from(["softmax", "sigmoid"])),
        "renormalize": draw(st.booleans()),
        "routed_scaling_factor": draw(st.sampled_from([1.0, 2.5, 0.5, 0.0])),
    }
    if draw(st.booleans()):
        kwargs["bias"] = torch.tensor(
            draw(st.lists(_value(32), min_size=num_experts, max_size=num_experts)), dtype=torch.float32
        )
    divisors = [g for g in range(1, num_experts + 1) if num_experts % g == 0]
    n_group = draw(st.sampled_from(divisors))
    group_size = num_experts // n_group
    smallest = math.ceil(top_k / group_size)
    if draw(st.booleans()) and smallest <= n_group:
        kwargs["n_group"] = n_group
        kwargs["topk_group"] = draw(st.integers(smallest, n_group))
    num_valid_value = draw(st.integers(0, num_rows))
    form = draw(st.sampled_from(["none", "int", "tensor"]))
    return {"logits": logits, "top_k": top_k, "kwargs": kwargs, "form": form, "num_valid": num_valid_value}


def _num_valid(problem: dict[str, Any]) -> tuple[int | torch.Tensor | None, int]:
    """(what to pass, the effective count)."""
    if problem["form"] == "none":
        return None, problem["logits"].shape[0]
    if problem["form"] == "int":
        return problem["num_valid"], problem["num_valid"]
    return torch.tensor(problem["num_valid"]), problem["num_valid"]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(routing_problems())
def test_routing_contract_holds_for_any_logits(problem: dict[str, Any]) -> None:
    logits, top_k, kwargs = problem["logits"], problem["top_k"], problem["kwargs"]
    num_rows, num_experts = logits.shape
    num_valid, count = _num_valid(problem)
    routing = safemoe.route(logits, top_k, num_valid=num_valid, backend="reference", **kwargs)
    ids, weights = routing.ids, routing.weights
    assert ids.shape == weights.shape == (num_rows, top_k)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32

    valid_ids = ids[:count].long()
    assert bool(((valid_ids >= 0) & (valid_ids < num_experts)).all())
    ordered = valid_ids.sort(dim=1).values
    assert not bool((ordered[:, 1:] == ordered[:, :-1]).any()), "duplicate ids"
    valid_w = weights[:count]
    assert bool(torch.isfinite(valid_w).all()) and bool((valid_w >= 0).all())
    assert bool((ids[count:] == -1).all()) and bool((weights[count:] == 0).all())

    if kwargs["renormalize"]:
        scale = kwargs["routed_scaling_factor"]
        sums = valid_w.sum(dim=1)
        ok = ((sums - scale).abs() <= 1e-5 * max(scale, 1.0)) | (sums == 0)
        assert bool(ok.all()), sums
    if "bias" not in kwargs and "n_group" not in kwargs:
        # Ids come out in descending score order, so unbiased weights never increase along K.
        assert bool((valid_w[:, 1:] <= valid_w[:, :-1]).all())

    # Whatever padded rows hold, real rows stay bit-identical.
    if count < num_rows:
        garbage = logits.clone()
        garbage[count:] = torch.where(torch.isnan(garbage[count:]), 0.0, math.nan).to(logits.dtype)
        again = safemoe.route(garbage, top_k, num_valid=num_valid, backend="reference", **kwargs)
        assert_equal(again.ids[:count], ids[:count])
        assert_equal(again.weights[:count], weights[:count])


@settings(max_examples=50, deadline=None)
@given(routing_problems())
def test_num_valid_forms_agree(problem: dict[str, Any]) -> None:
    """An int and a device tensor num_valid give the same answer."""
    logits, top_k, kwargs = problem["logits"], problem["top_k"], problem["kwargs"]
    count = problem["num_valid"]
    as_int = safemoe.route(logits, top_k, num_valid=count, backend="reference", **kwargs)
    for dtype in (torch.int32, torch.int64):
        as_tensor = safemoe.route(
            logits, top_k, num_valid=torch.tensor(count, dtype=dtype), backend="reference", **kwargs
        )
        assert_equal(as_tensor.ids, as_int.ids)
        assert_equal(as_tensor.weights, as_int.weights)
