"""Every bad input of route / experts / moe raises TypeError or ValueError naming the argument,
before any computation runs (the compute functions are replaced by tripwires here)."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import safemoe

# `safemoe.experts` the attribute is the function; these are the modules.
experts_module = importlib.import_module("safemoe.experts")
layer_module = importlib.import_module("safemoe.layer")
routing_module = importlib.import_module("safemoe.routing")
ops_module = importlib.import_module("safemoe.ops")

T, E, K, H, I = 5, 8, 2, 16, 4  # noqa: E741  (the project vocabulary: I is the intermediate size)
META = torch.device("meta")


def _tripwire(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a compute function ran before the inputs were checked")


@pytest.fixture(autouse=True)
def no_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every compute path (either backend) goes through the registered ops' wrappers.
    for name in ("route", "experts", "zero_padding_"):
        monkeypatch.setattr(ops_module, name, _tripwire)


def logits(**over: Any) -> torch.Tensor:
    return over.get("t", torch.randn(T, E))


def good_routing() -> safemoe.Routing:
    return safemoe.Routing(weights=torch.rand(T, K), ids=torch.randint(0, E, (T, K), dtype=torch.int32))


def weights(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(E, 2 * I, H, dtype=dtype), torch.randn(E, H, I, dtype=dtype)


def call_route(**over: Any) -> Callable[[], Any]:
    args = {"logits": torch.randn(T, E), "top_k": K}
    args.update(over)
    return lambda: safemoe.route(args.pop("logits"), args.pop("top_k"), **args)


def call_experts(**over: Any) -> Callable[[], Any]:
    w13, w2 = weights()
    args = {"x": torch.randn(T, H), "w13": w13, "w2": w2, "routing": good_routing()}
    args.update(over)
    return lambda: safemoe.experts(
        args.pop("x"), args.pop("w13"), args.pop("w2"), args.pop("routing"), **args
    )


def call_moe(**over: Any) -> Callable[[], Any]:
    w13, w2 = weights()
    args = {"x": torch.randn(T, H), "router_logits": torch.randn(T, E), "w13": w13, "w2": w2, "top_k": K}
    args.update(over)
    return lambda: safemoe.moe(
        args.pop("x"), args.pop("router_logits"), args.pop("w13"), args.pop("w2"), args.pop("top_k"), **args
    )


BAD_NUM_VALID = [
    (-1, ValueError, "num_valid"),
    (T + 1, ValueError, "num_valid"),
    (True, TypeError, "num_valid"),
    (2.0, TypeError, "num_valid"),
    ("3", TypeError, "num_valid"),
    (torch.tensor(2.0), TypeError, "num_valid"),
    (torch.tensor(2, dtype=torch.int16), TypeError, "num_valid"),
    (torch.tensor([2]), ValueError, "num_valid"),
    (torch.tensor(2, device=META), ValueError, "num_valid"),
]
BAD_HEALTH = [
    (torch.zeros(8, dtype=torch.int32), ValueError, "health"),
    (torch.zeros(3, dtype=torch.int64), ValueError, "health"),
    (torch.zeros(2, 8, dtype=torch.int64), ValueError, "health"),
    (torch.zeros(8, dtype=torch.int64, device=META), ValueError, "health"),
    (torch.zeros(16, dtype=torch.int64)[::2], ValueError, "health"),
    ([0] * 8, TypeError, "health"),
]
BAD_BACKEND = [
    ("cuda", ValueError, "backend"),
    ("Triton", ValueError, "backend"),
    (None, ValueError, "backend"),
]

ROUTE_CASES = [
    ({"logits": [[0.0] * E] * T}, TypeError, "logits"),
    ({"logits": torch.randn(T, E, dtype=torch.float64)}, TypeError, "logits"),
    ({"logits": torch.randint(0, 3, (T, E))}, TypeError, "logits"),
    ({"logits": torch.randn(T * E)}, ValueError, "logits"),
    ({"logits": torch.randn(1, T, E)}, ValueError, "logits"),
    ({"logits": torch.randn(E, T).t()}, ValueError, "logits.*contiguous"),
    ({"logits": torch.randn(T, 0)}, ValueError, "logits"),
    ({"top_k": 0}, ValueError, "top_k"),
    ({"top_k": -1}, ValueError, "top_k"),
    ({"top_k": E + 1}, ValueError, "top_k.*9"),
    ({"top_k": 2.0}, TypeError, "top_k"),
    ({"top_k": True}, TypeError, "top_k"),
    ({"scoring": "softplus"}, ValueError, "scoring.*softplus"),
    ({"renormalize": 1}, TypeError, "renormalize"),
    ({"bias": torch.randn(E + 1)}, ValueError, "bias"),
    ({"bias": torch.randn(1, E)}, ValueError, "bias"),
    ({"bias": torch.zeros(E, dtype=torch.int64)}, TypeError, "bias"),
    ({"bias": torch.randn(E, device=META)}, ValueError, "bias.*meta"),
    ({"bias": torch.randn(2 * E)[::2]}, ValueError, "bias.*contiguous"),
    ({"bias": [0.0] * E}, TypeError, "bias"),
    ({"n_group": 2}, ValueError, "n_group"),
    ({"topk_group": 1}, ValueError, "topk_group"),
    ({"n_group": 3, "topk_group": 1}, ValueError, "n_group=3"),
    ({"n_group": 4, "topk_group": 5}, ValueError, "topk_group=5"),
    ({"n_group": 0, "topk_group": 1}, ValueError, "n_group"),
    ({"n_group": 4, "topk_group": 0}, ValueError, "topk_group"),
    ({"n_group": 8, "topk_group": 1, "top_k": 2}, ValueError, "top_k"),
    ({"routed_scaling_factor": math.nan}, ValueError, "routed_scaling_factor"),
    ({"routed_scaling_factor": math.inf}, ValueError, "routed_scaling_factor"),
    ({"routed_scaling_factor": -1.0}, ValueError, "routed_scaling_factor"),
    ({"routed_scaling_factor": 1e39}, ValueError, "routed_scaling_factor"),
    ({"routed_scaling_factor": "2"}, TypeError, "routed_scaling_factor"),
    *[({"num_valid": v}, err, name) for v, err, name in BAD_NUM_VALID],
    *[({"health": v}, err, name) for v, err, name in BAD_HEALTH],
    *[({"backend": v}, err, name) for v, err, name in BAD_BACKEND],
]

EXPERTS_CASES = [
    ({"x": torch.randn(T, H, dtype=torch.float64)}, TypeError, "x"),
    ({"x": torch.randn(T, H).to(torch.float16)}, TypeError, "share a dtype"),
    ({"x": torch.randn(T, H, 1)}, ValueError, "x"),
    ({"x": torch.randn(H, T).t()}, ValueError, "x.*contiguous"),
    ({"x": torch.randn(T, H, device=META)}, ValueError, "w13"),
    ({"x": torch.randn(T, H + 1)}, ValueError, "w13"),
    ({"x": [[0.0] * H] * T}, TypeError, "x"),
    ({"w13": torch.randn(E, 2 * I + 1, H)}, ValueError, "w13"),
    ({"w13": torch.randn(2 * I, H)}, ValueError, "w13"),
    ({"w13": torch.randn(E, 0, H)}, ValueError, "w13"),
    ({"w13": torch.randn(E, 2 * I, H, device=META)}, ValueError, "w13.*meta"),
    ({"w13": torch.randn(E, H, 2 * I).transpose(1, 2)}, ValueError, "w13.*contiguous"),
    ({"w2": torch.randn(E, I, H)}, ValueError, "w2"),
    ({"w2": torch.randn(E + 1, H, I)}, ValueError, "w2"),
    ({"w2": torch.randn(E, I, H).transpose(1, 2)}, ValueError, "w2.*contiguous"),
    ({"w2": torch.randn(E, H, I, dtype=torch.bfloat16)}, TypeError, "share a dtype"),
    ({"w2": torch.randn(E, H, I, device=META)}, ValueError, "w2.*meta"),
    ({"routing": (torch.rand(T, K), torch.zeros(T, K, dtype=torch.int32))}, TypeError, "routing"),
    (
        {"routing": safemoe.Routing(torch.rand(T, K), torch.zeros(T, K, dtype=torch.int64))},
        TypeError,
        "routing.ids",
    ),
    (
        {"routing": safemoe.Routing(torch.rand(T, K).half(), torch.zeros(T, K, dtype=torch.int32))},
        TypeError,
        "routing.weights",
    ),
    (
        {"routing": safemoe.Routing(torch.rand(T, K), torch.zeros(T, K + 1, dtype=torch.int32))},
        ValueError,
        "same shape",
    ),
    (
        {"routing": safemoe.Routing(torch.rand(T + 1, K), torch.zeros(T + 1, K, dtype=torch.int32))},
        ValueError,
        "rows",
    ),
    (
        {"routing": safemoe.Routing(torch.rand(T, K), torch.zeros(T, K, dtype=torch.int32, device=META))},
        ValueError,
        "routing.ids",
    ),
    (
        {"routing": safemoe.Routing(torch.rand(K, T).t(), torch.zeros(T, K, dtype=torch.int32))},
        ValueError,
        "routing.weights.*contiguous",
    ),
    (
        {"routing": safemoe.Routing(torch.rand(T, 0), torch.zeros(T, 0, dtype=torch.int32))},
        ValueError,
        "K >= 1",
    ),
    ({"activation": "relu"}, ValueError, "activation.*relu"),
    ({"activation": None}, ValueError, "activation"),
    *[({"num_valid": v}, err, name) for v, err, name in BAD_NUM_VALID],
    *[({"health": v}, err, name) for v, err, name in BAD_HEALTH],
    *[({"backend": v}, err, name) for v, err, name in BAD_BACKEND],
]

MOE_CASES = [
    ({"router_logits": torch.randn(T, E + 1)}, ValueError, "router_logits"),
    ({"router_logits": torch.randn(T + 1, E)}, ValueError, "router_logits"),
    ({"router_logits": torch.randn(T, E, device=META)}, ValueError, "router_logits.*meta"),
    ({"router_logits": torch.randn(T, E, dtype=torch.float64)}, TypeError, "router_logits"),
    ({"x": torch.randn(T, H, dtype=torch.float64)}, TypeError, "x"),
    ({"w2": torch.randn(E, I, H)}, ValueError, "w2"),
    ({"activation": "relu"}, ValueError, "activation"),
    ({"top_k": E + 1}, ValueError, "top_k"),
    ({"scoring": "softplus"}, ValueError, "scoring"),
    ({"n_group": 3, "topk_group": 1}, ValueError, "n_group"),
    ({"num_valid": T + 1}, ValueError, "num_valid"),
    ({"health": torch.zeros(8, dtype=torch.int32)}, ValueError, "health"),
    ({"backend": "cuda"}, ValueError, "backend"),
    ({"scorng": "sigmoid"}, TypeError, "scorng"),
]


def _ids(cases: list[tuple[dict[str, Any], type, str]]) -> list[str]:
    return [f"{next(iter(over))}-{i}" for i, (over, _, _) in enumerate(cases)]


@pytest.mark.parametrize(("over", "error", "match"), ROUTE_CASES, ids=_ids(ROUTE_CASES))
def test_route_rejects(over: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        call_route(**over)()


@pytest.mark.parametrize(("over", "error", "match"), EXPERTS_CASES, ids=_ids(EXPERTS_CASES))
def test_experts_rejects(over: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        call_experts(**over)()


@pytest.mark.parametrize(("over", "error", "match"), MOE_CASES, ids=_ids(MOE_CASES))
def test_moe_rejects_before_routing(
    monkeypatch: pytest.MonkeyPatch, over: dict[str, Any], error: type, match: str
) -> None:
    # moe() checks every argument (expert side and router side) before its first op: the autouse
    # fixture trips on the router op as on the expert op.
    with pytest.raises(error, match=match):
        call_moe(**over)()


@pytest.mark.parametrize(
    "over", [{"top_k": 0}, {"num_valid": -1}, {"logits": torch.randn(T, E, dtype=torch.float64)}]
)
def test_triton_backend_checks_inputs_first(over: dict[str, Any]) -> None:
    """The triton backend validates on the host before touching any kernel module."""
    with pytest.raises((TypeError, ValueError)):
        call_route(backend="triton", **over)()
    with pytest.raises((TypeError, ValueError)):
        call_experts(backend="triton", activation="relu")()


def test_good_inputs_reach_the_compute() -> None:
    """The tripwires fire for good inputs, so the tests above really test the checks."""
    with pytest.raises(AssertionError, match="compute"):
        call_route()()
    with pytest.raises(AssertionError, match="compute"):
        call_experts()()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_every_backend_refuses_alike(backend: str) -> None:
    """The same bad argument is refused the same way whichever backend would run the call (the
    reference ignores a workspace, but still checks it)."""
    too_small = safemoe.Workspace(T - 1, E, K, H, I, torch.float32, "cpu")
    for call in (call_experts, call_moe):
        with pytest.raises(TypeError, match=r"^workspace must be a safemoe\.Workspace or None, got str"):
            call(backend=backend, workspace="x")()
        with pytest.raises(TypeError, match=r"^workspace must be a safemoe\.Workspace"):
            call(backend=backend, workspace=object())()
        with pytest.raises(ValueError, match=r"workspace|max_tokens"):
            call(backend=backend, workspace=too_small)()
    with pytest.raises(TypeError, match=r"unknown routing option\(s\) \['foo'\]"):
        call_moe(backend=backend, foo=1)()
    with pytest.raises(TypeError, match=r"unknown routing option\(s\) \['foo'\]"):
        call_route(backend=backend, foo=1)()
    with pytest.raises(TypeError, match=r"unknown routing option\(s\) \['foo'\]"):
        safemoe.MoE(H, I, E, K, backend=backend, foo=1)
    with pytest.raises(TypeError, match=r"^workspace must be a safemoe\.Workspace"):
        safemoe.MoE(H, I, E, K, backend=backend, workspace="x")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_moe_layer_names_x(backend: str) -> None:
    """`safemoe.MoE(..., dtype=float32)(x_fp16)`: an error naming x and both dtypes, before the
    gate's matmul (which would raise a RuntimeError about m1 and m2)."""
    layer = safemoe.MoE(H, I, E, K, backend=backend, dtype=torch.float32)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        with pytest.raises(TypeError, match=rf"^x must have this layer's dtype torch.float32.*got {dtype}"):
            layer(torch.randn(T, H, dtype=dtype))
    with pytest.raises(TypeError, match=r"build the layer with dtype=torch.float16"):
        layer(torch.randn(T, H, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"^x must be on this layer's device cpu, got meta"):
        layer(torch.randn(T, H, device=META))
    with pytest.raises(TypeError, match=r"^x must be a torch\.Tensor, got list"):
        layer([[0.0] * H] * T)
    with pytest.raises(ValueError, match=r"^x must end with H=16"):
        layer(torch.randn(T, H + 1))
    fp8 = safemoe.MoE(H, I, E, K, backend=backend, dtype=torch.bfloat16).quantize_("per_tensor")
    for dtype in (torch.float32, torch.float16):
        with pytest.raises(TypeError, match=rf"^x must have this layer's dtype torch.bfloat16.*got {dtype}"):
            fp8(torch.randn(T, H, dtype=dtype))
