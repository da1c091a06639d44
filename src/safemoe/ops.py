"""safemoe's ops registered with `torch.library`, at the launchers: `torch.compile(fullgraph=True)`
treats them as opaque calls (no graph break, no tracing into Triton launchers) and CUDA-graph
capture records the kernels they launch.

Each op writes into outputs its caller allocated, and takes every buffer as an explicit tensor (the
way quack registers its `cute_op`s): the workspace is its one byte buffer plus the dims that lay it
out, `num_valid` is the kernels' own pair (an optional 0-dim device tensor, else a host count),
fp8 weights bring their scales and mode. The bodies call the Triton launchers (or, for the
reference backend, the spec in `reference.py`) without checking anything again: the public
functions (`safemoe.route`, `safemoe.experts`, `safemoe.moe`, `safemoe.zero_padding_`) and the
layers (`safemoe.MoE`, validated at construction) check once and call the wrappers below. In plain
eager mode the wrappers call the op bodies directly (`_eager`): torch.library's dispatch wrappers
cost as much host time as the launches at decode sizes; anything traced still sees the ops.

| op | arguments (short) |
|---|---|
| `safemoe::route` | logits, bias?, the `RouteConfig` fields, num_valid?, count, backend, |
| | batch_invariant, weights_out!, ids_out! |
| `safemoe::experts` | x, w13, w2, w13_scale?, w2_scale?, quant, gate_up_split, weights, ids, activation, |
| | num_valid?, count, backend, batch_invariant, workspace!, workspace_dims, out! |
| `safemoe::zero_padding_` | t!, num_valid?, count |

`route` and `experts` come in two flavours, without and with a mutated `health` tensor (`_counted`):
inductor (torch 2.13) fails to lower an op whose Optional mutated argument is None ("getitem is not
an OpOverload"), so no mutated argument is ever Optional.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from safemoe._checks import Fp8Weights, NumValid
from safemoe.route_config import RouteConfig
from safemoe.workspace import Workspace

_ROUTE_ARGS = (
    f"Tensor logits, Tensor? bias, {RouteConfig.op_schema()}, Tensor? num_valid, SymInt num_valid_count, "
    "str backend, bool batch_invariant, Tensor(a!) weights_out, Tensor(b!) ids_out"
)
_EXPERTS_ARGS = (
    "Tensor x, Tensor w13, Tensor w2, Tensor? w13_scale, Tensor? w2_scale, str quant, bool gate_up_split, "
    "Tensor weights, Tensor ids, str activation, Tensor? num_valid, SymInt num_valid_count, str backend, "
    "bool batch_invariant, bool ids_complete, Tensor(a!) workspace, int[] workspace_dims, Tensor(b!) out"
)
_NUM_ROUTE_FIELDS = len(RouteConfig.op_schema().split(", "))


def _num_valid(tensor: torch.Tensor | None, count: int) -> NumValid:
    return NumValid(count=None, tensor=tensor) if tensor is not None else NumValid(count=count, tensor=None)


def _route_body(
    logits: torch.Tensor,
    config: RouteConfig,
    bias: torch.Tensor | None,
    nv: NumValid,
    backend: str,
    batch_invariant: bool,
    weights_out: torch.Tensor,
    ids_out: torch.Tensor,
    counter: torch.Tensor | None,
) -> None:
    if backend == "triton":
        from safemoe.kernels.routing import route_into

        route_into(logits, config, bias=bias, num_valid=nv, health=counter, weights_out=weights_out,
                   ids_out=ids_out, batch_invariant=bool(batch_invariant))
        return
    from safemoe.reference import route_reference

    weights, ids = route_reference(logits, config, bias=bias, num_valid=nv)
    weights_out.copy_(weights)
    ids_out.copy_(ids)
    if counter is not None:
        from safemoe.health import NONFINITE_ROWS, PADDED_ROWS

        valid = nv.row_mask(logits.shape[0], logits.device)
        counter[NONFINITE_ROWS] += ((~torch.isfinite(logits)).any(dim=1) & valid).sum()
        counter[PADDED_ROWS] += (~valid).sum()


def _route_impl(
    logits: torch.Tensor, bias: torch.Tensor | None, *rest: object
) -> None:
    """The registered op's body: the schema's flat arguments back into `_route_body`'s."""
    fields, (nv_tensor, nv_count, backend, batch_invariant, weights_out, ids_out, *health) = (
        rest[:_NUM_ROUTE_FIELDS], rest[_NUM_ROUTE_FIELDS:]
    )
    assert isinstance(weights_out, torch.Tensor) and isinstance(ids_out, torch.Tensor)
    _route_body(logits, RouteConfig(*fields), bias, _num_valid(nv_tensor, nv_count),  # type: ignore[arg-type]
                str(backend), bool(batch_invariant), weights_out, ids_out,
                health[0] if health else None)  # type: ignore[arg-type]


def _experts_body(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    fp8: Fp8Weights | None,
    weights: torch.Tensor,
    ids: torch.Tensor,
    activation: str,
    nv: NumValid,
    backend: str,
    batch_invariant: bool,
    ids_complete: bool,
    workspace: Workspace | None,
    out: torch.Tensor,
    health: torch.Tensor | None,
) -> None:
    if backend == "triton":
        from safemoe.kernels.experts import experts_triton

        assert workspace is not None
        experts_triton(x, w13, w2, weights, ids, activation=activation, num_valid=nv, health=health,
                       workspace=workspace, out=out, fp8=fp8, batch_invariant=batch_invariant,
                       ids_complete=ids_complete)
        return
    from safemoe import reference
    from safemoe.health import DROPPED_SLOTS

    if fp8 is not None:
        result = reference.experts_fp8_reference(x, w13, w2, fp8.w13_scale, fp8.w2_scale, weights, ids,
                                                 activation=activation, num_valid=nv)
    else:
        result = reference.experts_reference(x, w13, w2, weights, ids, activation=activation, num_valid=nv)
    out.copy_(result)
    if health is not None:
        rows = nv.row_mask(x.shape[0], x.device)
        served = reference.valid_slot_mask(ids, w13.shape[0], nv)
        health[DROPPED_SLOTS] += (rows[:, None] & ~served).sum()


def _experts_impl(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    quant: str,
    gate_up_split: bool,
    weights: torch.Tensor,
    ids: torch.Tensor,
    activation: str,
    num_valid: torch.Tensor | None,
    num_valid_count: int,
    backend: str,
    batch_invariant: bool,
    ids_complete: bool,
    workspace: torch.Tensor,
    workspace_dims: list[int],
    out: torch.Tensor,
    health: torch.Tensor | None = None,
) -> None:
    """The registered op's body: the schema's flat arguments back into `_experts_body`'s."""
    fp8 = None
    if quant:
        assert w13_scale is not None and w2_scale is not None
        fp8 = Fp8Weights(quant, w13_scale, w2_scale, gate_up_split)
    views = Workspace.over(workspace, workspace_dims, x.dtype) if backend == "triton" else None
    _experts_body(x, w13, w2, fp8, weights, ids, activation, _num_valid(num_valid, num_valid_count), backend,
                  batch_invariant, ids_complete, views, out, health)


def _no_output(*args: object) -> None:
    return None


for _name, _impl, _args, _mutated in (
    ("route", _route_impl, _ROUTE_ARGS, ("weights_out", "ids_out")),
    ("experts", _experts_impl, _EXPERTS_ARGS, ("workspace", "out")),
):
    for _suffix, _extra in (("", ""), ("_counted", ", Tensor(z!) health")):
        torch.library.custom_op(
            f"safemoe::{_name}{_suffix}",
            _impl,
            mutates_args=(*_mutated, *(("health",) if _extra else ())),
            schema=f"({_args}{_extra}) -> ()",
        ).register_fake(_no_output)


def _zero_padding_impl(t: torch.Tensor, num_valid: torch.Tensor | None, num_valid_count: int) -> None:
    from safemoe.padding import zero_padding_rows

    zero_padding_rows(t, _num_valid(num_valid, num_valid_count))


torch.library.custom_op(
    "safemoe::zero_padding_",
    _zero_padding_impl,
    mutates_args=("t",),
    schema="(Tensor(a!) t, Tensor? num_valid, SymInt num_valid_count) -> ()",
).register_fake(_no_output)


# -- what the public functions and the layers call, arguments already checked --------------------

def _eager(first: torch.Tensor) -> bool:
    """Whether a call may run the op's body directly instead of through `torch.ops.safemoe`.

    In plain eager mode the registered op adds only host time: torch.library's autograd,
    ADInplaceOrView and backend wrappers and its schema-defaults pass cost about as much as the
    body itself at decode sizes (H200, torch 2.11: 670 us a Qwen3-30B-A3B T = 1 layer call, of
    which the two ops' wrappers were ~250 us; bench/results/logs/eager_host_overhead_*). Under
    torch.compile / export, inside a dispatch mode (fake tensors, make_fx) or for a tensor
    subclass, the op keeps the call opaque and traceable, so those go through it. Skipping the
    wrappers skips the version-counter bump of the written outputs, which inference never reads."""
    return (
        type(first) is torch.Tensor
        and not torch.compiler.is_compiling()
        and _get_current_dispatch_mode() is None
    )


def _nv_args(nv: NumValid, num_rows: int) -> tuple[torch.Tensor | None, int]:
    return nv.tensor, (nv.count if nv.count is not None else num_rows)


def route(
    logits: torch.Tensor,
    config: RouteConfig,
    *,
    bias: torch.Tensor | None,
    num_valid: NumValid,
    backend: str,
    health: torch.Tensor | None,
    batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The route (the `safemoe::route` op when traced, its body when eager) into new outputs:
    (weights [T, K] float32, ids [T, K] int32). `backend` is resolved ("triton" or "reference";
    batch_invariant needs "triton")."""
    num_tokens = logits.shape[0]
    weights = torch.empty(num_tokens, config.top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, config.top_k, dtype=torch.int32, device=logits.device)
    if _eager(logits):
        _route_body(logits, config, bias, num_valid, backend, batch_invariant, weights, ids, health)
        return weights, ids
    args = (logits, bias, *config.op_args(), *_nv_args(num_valid, num_tokens), backend, batch_invariant,
            weights, ids)
    if health is None:
        torch.ops.safemoe.route(*args)
    else:
        torch.ops.safemoe.route_counted(*args, health)
    return weights, ids


# The reference backend takes no workspace; it gets this empty stand-in.
_NO_DIMS = [0, 0, 0, 0, 0, 0]


def experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    *,
    activation: str,
    num_valid: NumValid,
    backend: str,
    health: torch.Tensor | None,
    workspace: Workspace | None,
    fp8: Fp8Weights | None = None,
    batch_invariant: bool = False,
    ids_complete: bool = False,
) -> torch.Tensor:
    """The experts (the `safemoe::experts` op when traced, its body when eager) into a new output
    [T, H] (x's dtype). `backend` is resolved; on "triton" without a workspace a temporary one is
    allocated for the call. `ids_complete`: the ids come from this call's router, every row written
    (`kernels.experts.experts_triton`)."""
    num_tokens = x.shape[0]
    if backend == "triton" and workspace is None:
        num_experts, two_inter, hidden = w13.shape
        workspace = Workspace(max(num_tokens, 1), num_experts, ids.shape[1], hidden, two_inter // 2,
                              x.dtype, x.device, fp8=fp8 is not None)
    out = torch.empty_like(x)
    if _eager(x):
        _experts_body(x, w13, w2, fp8, weights, ids, activation, num_valid, backend, batch_invariant,
                      ids_complete, workspace if backend == "triton" else None, out, health)
        return out
    if workspace is not None and backend == "triton":
        buffer, dims = workspace.op_args()
    else:
        buffer, dims = x.new_empty(0, dtype=torch.uint8), _NO_DIMS
    scales = (
        (None, None, "", False) if fp8 is None else (fp8.w13_scale, fp8.w2_scale, fp8.mode, fp8.gate_up_split)
    )
    args = (x, w13, w2, *scales, weights, ids, activation, *_nv_args(num_valid, num_tokens), backend,
            batch_invariant, ids_complete, buffer, dims, out)
    if health is None:
        torch.ops.safemoe.experts(*args)
    else:
        torch.ops.safemoe.experts_counted(*args, health)
    return out


def zero_padding_(t: torch.Tensor, num_valid: NumValid) -> torch.Tensor:
    """The `safemoe::zero_padding_` op (for use inside compiled code); returns t."""
    torch.ops.safemoe.zero_padding_(t, *_nv_args(num_valid, t.shape[0]))
    return t
