"""safemoe's ops registered with `torch.library`, so `torch.compile(fullgraph=True)` treats them as
opaque calls (no graph break, no tracing into Triton launchers) and CUDA-graph capture records the
kernels they launch.

| op | schema (short) |
|---|---|
| `safemoe::route` | (logits, top_k, scoring, renormalize, bias?, n_group?, topk_group?, scale, |
| | num_valid?, count?, backend) -> (weights, ids) |
| `safemoe::route_counted` | the same, then `health!` (int64 [8], mutated) |
| `safemoe::experts` | (x, w13, w2, weights, ids, activation, num_valid?, count?, backend, |
| | workspace_id) -> out |
| `safemoe::experts_counted` | the same, then `health!` |
| `safemoe::zero_padding_` | (t!, num_valid?, count?) -> () |

`num_valid` reaches an op as two arguments: a 0-dim device tensor (`num_valid`) or a host int
(`num_valid_count`), at most one set; `split_num_valid` converts the public form. A Python object
cannot cross a custom-op boundary, so a `Workspace` is passed as the integer id under which
`register_workspace` filed it (-1: none). The health tensor is a mutated argument of the
`_counted` flavour. Each op returns new tensors (never an alias of an input), so
functionalization has nothing to undo. Schemas are written out, not inferred from annotations.

The bodies call the public ops (`safemoe.route`, `safemoe.experts`): every argument check and the
backend choice live there, once.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any

import torch

from safemoe.experts import experts as _experts_public
from safemoe.padding import zero_padding_ as _zero_padding_public
from safemoe.routing import Routing
from safemoe.routing import route as _route_public

_WORKSPACES: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_STRONG_WORKSPACES: dict[int, Any] = {}


def register_workspace(workspace: Any) -> int:
    """File `workspace` under an integer id that the `safemoe::experts` op can carry.

    Held weakly when the object allows it: a workspace dropped by every module is freed.
    """
    if workspace is None:
        return -1
    key = id(workspace)
    try:
        _WORKSPACES[key] = workspace
    except TypeError:  # no __weakref__ slot: keep it alive for the process
        _STRONG_WORKSPACES[key] = workspace
    return key


def lookup_workspace(workspace_id: int) -> Any:
    if workspace_id < 0:
        return None
    found = _WORKSPACES.get(workspace_id, _STRONG_WORKSPACES.get(workspace_id))
    if found is None:
        raise RuntimeError(f"safemoe workspace id {workspace_id} is not registered (was it freed?)")
    return found


@functools.cache
def _accepts_workspace(fn: Any) -> bool:
    """Whether the public `experts()` takes `workspace=` (added by the expert-kernel work)."""
    try:
        return "workspace" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def experts_supports_workspace() -> bool:
    return _accepts_workspace(_experts_public)


def split_num_valid(num_valid: int | torch.Tensor | None) -> tuple[torch.Tensor | None, int | None]:
    """Public `num_valid` -> (tensor, count) for the ops: at most one is not None."""
    if num_valid is None:
        return None, None
    if isinstance(num_valid, torch.Tensor):
        return num_valid, None
    if isinstance(num_valid, bool) or not isinstance(num_valid, int):
        raise TypeError(
            f"num_valid must be None, an int or a 0-dim integer tensor, got {type(num_valid).__name__}"
        )
    return None, num_valid


def _join_num_valid(tensor: torch.Tensor | None, count: int | None) -> int | torch.Tensor | None:
    return tensor if tensor is not None else count


# Argument lists of the ops (schemas written out: each op comes in two flavours sharing them).
_ROUTE_ARGS = (
    "Tensor logits, SymInt top_k, str scoring, bool renormalize, Tensor? bias, SymInt? n_group, "
    "SymInt? topk_group, float routed_scaling_factor, Tensor? num_valid, SymInt? num_valid_count, str backend"
)
_EXPERTS_ARGS = (
    "Tensor x, Tensor w13, Tensor w2, Tensor weights, Tensor ids, str activation, Tensor? num_valid, "
    "SymInt? num_valid_count, str backend, SymInt workspace_id"
)


def _route_impl(
    logits: torch.Tensor,
    top_k: int,
    scoring: str,
    renormalize: bool,
    bias: torch.Tensor | None,
    n_group: int | None,
    topk_group: int | None,
    routed_scaling_factor: float,
    num_valid: torch.Tensor | None,
    num_valid_count: int | None,
    backend: str,
    health: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    routing = _route_public(
        logits,
        top_k,
        scoring=scoring,
        renormalize=renormalize,
        bias=bias,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor,
        num_valid=_join_num_valid(num_valid, num_valid_count),
        backend=backend,
        health=health,
    )
    return routing.weights, routing.ids


def _experts_impl(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    activation: str,
    num_valid: torch.Tensor | None,
    num_valid_count: int | None,
    backend: str,
    workspace_id: int,
    health: torch.Tensor | None = None,
) -> torch.Tensor:
    kwargs: dict[str, Any] = {}
    workspace = lookup_workspace(workspace_id)
    if workspace is not None and experts_supports_workspace():
        kwargs["workspace"] = workspace
    return _experts_public(
        x,
        w13,
        w2,
        Routing(weights=weights, ids=ids),
        activation=activation,
        num_valid=_join_num_valid(num_valid, num_valid_count),
        backend=backend,
        health=health,
        **kwargs,
    )


def _route_fake(logits, top_k, *args):  # type: ignore[no-untyped-def]
    num_tokens = logits.shape[0]
    weights = logits.new_empty((num_tokens, top_k), dtype=torch.float32)  # [T, K] float32
    ids = logits.new_empty((num_tokens, top_k), dtype=torch.int32)  # [T, K] int32
    return weights, ids


def _experts_fake(x, *args):  # type: ignore[no-untyped-def]
    return torch.empty_like(x)  # [T, H] in x's dtype


# Each op comes in two flavours, without and with a (required, mutated) health tensor: inductor
# (torch 2.13) fails to lower a single-output op whose Optional mutated argument is None
# ("getitem is not an OpOverload"), so the counter is never an Optional mutated argument.
for _name, _impl, _fake, _args, _returns in (
    ("route", _route_impl, _route_fake, _ROUTE_ARGS, "(Tensor, Tensor)"),
    ("experts", _experts_impl, _experts_fake, _EXPERTS_ARGS, "Tensor"),
):
    for _suffix, _mutates, _extra in (("", (), ""), ("_counted", ("health",), ", Tensor(a!) health")):
        _op = torch.library.custom_op(
            f"safemoe::{_name}{_suffix}",
            _impl,
            mutates_args=_mutates,
            schema=f"({_args}{_extra}) -> {_returns}",
        )
        _op.register_fake(_fake)


def _zero_padding_impl(t: torch.Tensor, num_valid: torch.Tensor | None, num_valid_count: int | None) -> None:
    _zero_padding_public(t, _join_num_valid(num_valid, num_valid_count))


torch.library.custom_op(
    "safemoe::zero_padding_",
    _zero_padding_impl,
    mutates_args=("t",),
    schema="(Tensor(a!) t, Tensor? num_valid, SymInt? num_valid_count) -> ()",
).register_fake(lambda t, num_valid, num_valid_count: None)


def route(
    logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    bias: torch.Tensor | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
    num_valid: int | torch.Tensor | None = None,
    backend: str = "auto",
    health: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`safemoe.route` through the registered op: returns (weights [T, K] f32, ids [T, K] i32)."""
    nv_tensor, nv_count = split_num_valid(num_valid)
    args = (
        logits, top_k, scoring, renormalize, bias, n_group, topk_group, float(routed_scaling_factor),
        nv_tensor, nv_count, backend,
    )  # fmt: skip
    if health is None:
        return torch.ops.safemoe.route(*args)
    return torch.ops.safemoe.route_counted(*args, health)


def experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    *,
    activation: str = "silu",
    num_valid: int | torch.Tensor | None = None,
    backend: str = "auto",
    health: torch.Tensor | None = None,
    workspace_id: int = -1,
) -> torch.Tensor:
    """`safemoe.experts` through the registered op: returns [T, H] in x's dtype."""
    nv_tensor, nv_count = split_num_valid(num_valid)
    args = (x, w13, w2, weights, ids, activation, nv_tensor, nv_count, backend, workspace_id)
    if health is None:
        return torch.ops.safemoe.experts(*args)
    return torch.ops.safemoe.experts_counted(*args, health)


def zero_padding_(t: torch.Tensor, num_valid: int | torch.Tensor | None) -> torch.Tensor:
    """`safemoe.zero_padding_` through the registered op (for use inside compiled code)."""
    if num_valid is None:
        return t
    nv_tensor, nv_count = split_num_valid(num_valid)
    torch.ops.safemoe.zero_padding_(t, nv_tensor, nv_count)
    return t
