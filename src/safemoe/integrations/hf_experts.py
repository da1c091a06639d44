"""`experts_implementation="safemoe"`: safemoe's expert kernels behind transformers' experts interface.

Importing `safemoe.integrations.transformers` (which imports this module) registers "safemoe" in
transformers' `ExpertsInterface` and, where the installed version has one, in its
`FP8ExpertsInterface`, so that every model family whose experts class carries
`@use_experts_implementation` can run its routed experts on safemoe:

    import safemoe.integrations.transformers  # registers "safemoe"
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="safemoe")
    model.set_experts_implementation("safemoe")   # or switch an existing model

The model stays the model: its router, its shared experts, its modules and Parameters are
untouched; only the experts module's forward(hidden_states, top_k_index, top_k_weights) runs
`safemoe.experts` on the ids and weights the model's own router chose (ids -> int32, weights ->
float32, both contiguous).

What this mode guarantees:
- No illegal address from any id the router emits: an id outside [0, E) (-1, E, a negative, a
  huge or stale id; int64 ids are mapped to -1 before the int32 cast, so none can wrap into
  range) is dropped, never used as an address, and counted in a health tensor when one is set
  (`configure`); duplicate ids are each served.
- NaN stays in its row: a NaN/Inf hidden state or routing weight makes that row's output NaN
  and touches no other row (safemoe computes row by row; padded rows included).
- The model's own numerics otherwise: the same router decisions, and expert outputs equal to the
  stock experts within the dtype's rounding (fp32: ~1e-6).

What only `patch()` (`safemoe.integrations.transformers.patch`, which replaces the whole MoE
block, router included) guarantees:
- NaN-proof routing: here the model's router runs as it is; a NaN row may get any ids it picks
  (safemoe drops the out-of-range ones) and NaN weights.
- Padded rows skipped: no device `num_valid` reaches the experts forward in this mode, so
  padding rows of a CUDA-graph bucket are computed like real ones (their outputs are whatever
  their inputs give, NaN included, in their own rows). Only `patch()` + `set_num_valid` skips
  them; wiring a real-token count into this mode is a separate issue.

Layouts: the decorator's flags are read from the module as transformers sets them
(`is_transposed`, `is_concatenated`, `has_bias`, `has_gate`, `has_post_expert_norm`; flags an
older transformers lacks take their defaults). `gate_up_proj` [E, 2I, H] (gate rows then up
rows) and `down_proj` [E, H, I] are exactly safemoe's w13/w2 and are used as they are, the
module's own Parameters, no copy. Other layouts are prepared once and cached on the module:
transposed weights are transposed, interleaved gate/up de-interleaved, a gate/up bias folded
into w13 as an extra input column (see `safemoe.layer`), the down bias added outside the kernel.
The cache is keyed on each source tensor's data_ptr, version counter, shape, dtype and device, so
it is rebuilt when the parameters are replaced, moved or written in place (a write through
`.data` bypasses the version counter: call `prepare(model)` again after one). Such prepared
layouts hold a second copy of the expert weights (the model keeps its own Parameters).

The gate function (the module's `_apply_gate`; by default `act_fn(gate) * up` on the chunked
[gate; up]) is identified once, in fp32, on a fixed probe tensor, against safemoe's activations
("silu", "gelu" (tanh), "swigluoai") on the layout the flags give, then the other one. A module
safemoe cannot run (no gate, a post-expert norm, an activation safemoe lacks such as exact-erf
GELU, a softcapped or clamped SiLU, non-float weights) falls back explicitly to transformers'
"grouped_mm" forward for that module; `fallbacks(model)` says which and why, and a warning is
logged once per class and reason.

Before CUDA-graph capture or `torch.compile`, call `prepare(model)` (the probe and the layout
copies are host work that must not run inside a capture). Inference only: safemoe's ops have no
backward.

fp8 (`FP8ExpertsInterface`, transformers' fine-grained fp8 experts): e4m3 weights with float32
per-expert or 128x128 block scales, dynamic activation scales and a gated activation run on
safemoe's fp8 kernels (`safemoe.experts(..., w13_scale=, w2_scale=)`); anything else (fp4, static
activation scales, ue8m0 scales, other block sizes) falls back to transformers' fp8 "grouped_mm".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import safemoe
from safemoe import _checks
from safemoe.health import Health
from safemoe.layer import fold_expert_biases
from safemoe.numerics import FP8_BLOCK, FP8_DTYPE
from safemoe.reference import activation_reference
from safemoe.routing import Routing
from safemoe.workspace import Workspace

logger = logging.getLogger(__name__)

NAME = "safemoe"
ACTIVATIONS = ("silu", "gelu", "swigluoai")
_PLAN_ATTR = "_safemoe_plan"
_OPTIONS_ATTR = "_safemoe_options"

# The probe: fixed fp32 values spread over [-~25, ~25], wide enough to expose clamps at 7-10.
_PROBE_ROWS = 16
_PROBE_SCALE = 6.0
_PROBE_RTOL = 1e-4
_PROBE_ATOL = 1e-4


@dataclass
class Options:
    """Per-module run options (set with `configure`)."""

    backend: str = "auto"
    health: torch.Tensor | None = None
    workspace: Workspace | None = None


@dataclass
class Plan:
    """What one experts module runs: safemoe (w13, w2, ...) or a fallback with its reason."""

    key: tuple[Any, ...]
    fallback: str | None = None
    w13: torch.Tensor | None = None  # [E, 2I, H] (or [E, 2I, Hf] with a folded bias), fp8 or not
    w2: torch.Tensor | None = None  # [E, H, I] (or [E, Hf, I])
    activation: str = "silu"
    hidden: int = 0
    folded: bool = False  # x gets the 1.0 bias column, the output is sliced back to H
    w2_bias: torch.Tensor | None = None  # [E, H]
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    copied: bool = False  # w13/w2 are prepared copies, not the module's Parameters


# -- layout ------------------------------------------------------------------------------------


def _flag(module: nn.Module, name: str, default: bool) -> bool:
    return bool(getattr(module, name, default))


def _key(tensors: dict[str, torch.Tensor | None]) -> tuple[Any, ...]:
    out: list[Any] = []
    for name, t in tensors.items():
        if t is None:
            out.append((name, None))
        else:
            out.append((name, t.data_ptr(), t._version, tuple(t.shape), t.dtype, t.device))
    return tuple(out)


def _split(t: torch.Tensor, concatenated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 2I] -> (gate, up) as the layout stores them."""
    if concatenated:
        half = t.shape[-1] // 2
        return t[..., :half], t[..., half:]
    return t[..., 0::2], t[..., 1::2]


def _identify_gate(module: nn.Module, inter: int, device: torch.device,
                   concatenated: bool) -> tuple[bool, str] | str:
    """(concatenated, activation) of the module's `_apply_gate`, or the reason none matches."""
    apply_gate = getattr(module, "_apply_gate", None)
    if apply_gate is None:
        return "the experts module has no _apply_gate"
    gen = torch.Generator().manual_seed(0)
    probe = (torch.randn(_PROBE_ROWS, 2 * inter, generator=gen) * _PROBE_SCALE).to(device)
    try:
        with torch.no_grad():
            got = apply_gate(probe.clone())
    except Exception as exc:  # a gate function that cannot run on an fp32 probe
        return f"its _apply_gate failed on an fp32 probe ({type(exc).__name__}: {exc})"
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != (_PROBE_ROWS, inter):
        return "its _apply_gate does not map [S, 2I] to [S, I]"
    got = got.float()
    for layout in (concatenated, not concatenated):
        gate, up = _split(probe, layout)
        for activation in ACTIVATIONS:
            want = activation_reference(gate, up, activation)
            if torch.allclose(got, want, rtol=_PROBE_RTOL, atol=_PROBE_ATOL):
                return layout, activation
    act = getattr(module, "act_fn", None)
    what = f"act_fn={type(act).__name__}" if act is not None else "a custom _apply_gate"
    limits = [f"{n}={v}" for n in ("limit", "swiglu_limit", "alpha", "swiglu_alpha")
              if isinstance(v := getattr(module, n, None), (int, float))]
    what += "".join(f", {x}" for x in limits)
    return (f"gate function ({type(module).__name__}._apply_gate, {what}) is none of safemoe's "
            f"activations {ACTIVATIONS}")


def _deinterleave_rows(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] with gate/up alternating along dim 1 -> gate rows then up rows."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)


def _source_tensors(module: nn.Module) -> dict[str, torch.Tensor | None]:
    names = ["gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias", "up_proj",
             "gate_up_proj_scale_inv", "down_proj_scale_inv"]
    return {n: t for n in names if isinstance(t := getattr(module, n, None), torch.Tensor)}


def _plan_dense(module: nn.Module, key: tuple[Any, ...]) -> Plan:
    """Plan a bf16/fp16/fp32 experts module (ExpertsInterface)."""
    if not _flag(module, "has_gate", True):
        return Plan(key, fallback="non-gated experts (up_proj, then an activation): safemoe's experts "
                                  "are gated")
    if _flag(module, "has_post_expert_norm", False):
        return Plan(key, fallback="a norm between each expert's down_proj and its routing weight "
                                  "(has_post_expert_norm)")
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        return Plan(key, fallback="no gate_up_proj/down_proj tensors")
    if gate_up.dim() != 3 or down.dim() != 3:
        return Plan(key, fallback=f"expert weights are not 3-D ({tuple(gate_up.shape)}, {tuple(down.shape)})")
    if gate_up.dtype not in _checks.FLOAT_DTYPES or down.dtype != gate_up.dtype:
        return Plan(key, fallback=f"expert weights of dtype {gate_up.dtype}/{down.dtype} "
                                  "(safemoe's dense kernels take bf16/fp16/fp32)")
    if gate_up.device.type == "meta":
        return Plan(key, fallback="expert weights are on the meta device")
    transposed = _flag(module, "is_transposed", False)
    w13 = gate_up.transpose(1, 2) if transposed else gate_up  # [E, 2I, H]
    w2 = down.transpose(1, 2) if transposed else down  # [E, H, I]
    num_experts, two_inter, hidden = w13.shape
    if two_inter % 2 or tuple(w2.shape) != (num_experts, hidden, two_inter // 2):
        return Plan(key, fallback=f"unexpected expert shapes gate_up_proj {tuple(gate_up.shape)}, "
                                  f"down_proj {tuple(down.shape)} (is_transposed={transposed})")
    found = _identify_gate(module, two_inter // 2, gate_up.device, _flag(module, "is_concatenated", True))
    if isinstance(found, str):
        return Plan(key, fallback=found)
    concatenated, activation = found
    has_bias = _flag(module, "has_bias", False)
    b13 = getattr(module, "gate_up_proj_bias", None) if has_bias else None
    b2 = getattr(module, "down_proj_bias", None) if has_bias else None
    copied = transposed or not concatenated or b13 is not None or not w13.is_contiguous() \
        or not w2.is_contiguous()
    with torch.no_grad():
        if not concatenated:
            w13 = _deinterleave_rows(w13)
            if b13 is not None:
                b13 = _deinterleave_rows(b13[..., None])[..., 0]
        folded = b13 is not None
        if folded:
            assert b13 is not None
            w13, w2 = fold_expert_biases(w13, b13, w2)
        w13 = w13.detach().contiguous() if copied else w13
        w2 = w2.detach().contiguous() if copied else w2
    if b2 is not None and b2.dtype != gate_up.dtype:
        b2 = b2.to(gate_up.dtype)
    return Plan(key, w13=w13, w2=w2, activation=activation, hidden=hidden, folded=folded,
                w2_bias=b2, copied=copied)


def _plan_fp8(module: nn.Module, key: tuple[Any, ...]) -> Plan:
    """Plan transformers' FP8Experts (FP8ExpertsInterface)."""
    if not _flag(module, "has_gate", True):
        return Plan(key, fallback="non-gated fp8 experts")
    if _flag(module, "has_bias", False) or _flag(module, "has_post_expert_norm", False):
        return Plan(key, fallback="fp8 experts with biases or a post-expert norm")
    if getattr(module, "activation_scheme", "dynamic") != "dynamic":
        return Plan(key, fallback=f"activation_scheme={module.activation_scheme!r} (safemoe quantises "
                                  "activations per row at run time)")
    w13, w2 = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    s13, s2 = getattr(module, "gate_up_proj_scale_inv", None), getattr(module, "down_proj_scale_inv", None)
    if not all(isinstance(t, torch.Tensor) for t in (w13, w2, s13, s2)):
        return Plan(key, fallback="fp8 experts without gate_up_proj/down_proj and their scale_inv")
    assert isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)
    assert isinstance(s13, torch.Tensor) and isinstance(s2, torch.Tensor)
    if w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        return Plan(key, fallback=f"fp8 expert weights of dtype {w13.dtype} (safemoe runs float8_e4m3fn)")
    if s13.dtype != torch.float32 or s2.dtype != torch.float32:
        return Plan(key, fallback=f"weight scales of dtype {s13.dtype} (safemoe takes float32)")
    block = getattr(module, "block_size", None)
    if block is None:  # one scale per expert and projection: [E, 2, 1] (gate, up) and [E, 1, 1]
        s13 = s13.reshape(s13.shape[0], -1)
        s2 = s2.reshape(s2.shape[0])
        if s13.shape[1] == 1:
            s13 = s13.reshape(s13.shape[0])
    elif tuple(block) != (FP8_BLOCK, FP8_BLOCK):
        return Plan(key, fallback=f"fp8 block size {tuple(block)} (safemoe's blocks are "
                                  f"{FP8_BLOCK}x{FP8_BLOCK})")
    try:
        _checks.check_fp8_weights(w13, w2, s13.contiguous(), s2.contiguous())
    except (TypeError, ValueError) as exc:
        return Plan(key, fallback=f"fp8 weights safemoe cannot take: {exc}")
    found = _identify_gate(module, w13.shape[1] // 2, w13.device, True)
    if isinstance(found, str):
        return Plan(key, fallback=found)
    concatenated, activation = found
    if not concatenated:
        return Plan(key, fallback="interleaved gate/up fp8 weights")
    return Plan(key, w13=w13, w2=w2, activation=activation, hidden=int(w13.shape[2]),
                w13_scale=s13.contiguous(), w2_scale=s2.contiguous())


def _plan(module: nn.Module, fp8: bool) -> Plan:
    plan: Plan | None = getattr(module, _PLAN_ATTR, None)
    if plan is not None and _compiling():
        return plan  # data_ptr/_version cannot be traced; prepare(model) before compiling
    key = _key(_source_tensors(module))
    if plan is not None and plan.key == key:
        return plan
    plan = _plan_fp8(module, key) if fp8 else _plan_dense(module, key)
    object.__setattr__(module, _PLAN_ATTR, plan)
    if plan.fallback is not None:
        _warn_once(type(module).__name__, plan.fallback)
    return plan


_WARNED: set[tuple[str, str]] = set()


def _warn_once(cls: str, reason: str) -> None:
    if (cls, reason) not in _WARNED:
        _WARNED.add((cls, reason))
        logger.warning("safemoe experts: %s falls back to transformers' grouped_mm: %s", cls, reason)


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    is_compiling = getattr(compiler, "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False


# -- forward -----------------------------------------------------------------------------------


def routing_of(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int) -> Routing:
    """A model router's (top_k_index, top_k_weights) as safemoe's Routing: ids int32 with every id
    outside [0, E) made -1 first (an int64 id cannot wrap into range), weights float32."""
    ids = top_k_index.reshape(top_k_index.shape[0], -1) if top_k_index.dim() != 2 else top_k_index
    if ids.dtype != torch.int32:
        ids = torch.where((ids >= 0) & (ids < num_experts), ids, -1).to(torch.int32)
    weights = top_k_weights.reshape(ids.shape).to(torch.float32)
    return Routing(weights=weights.contiguous(), ids=ids.contiguous())


def _add_down_bias(out: torch.Tensor, routing: Routing, bias: torch.Tensor) -> torch.Tensor:
    """out + sum over served slots of weights[t, k] * bias[ids[t, k]] (dropped slots add nothing)."""
    num_experts = bias.shape[0]
    ids, weights = routing.ids, routing.weights
    served = (ids >= 0) & (ids < num_experts)
    coef = torch.zeros(ids.shape[0], num_experts, dtype=torch.float32, device=ids.device)
    coef.scatter_add_(1, ids.clamp(0, num_experts - 1).long(), torch.where(served, weights, 0.0))
    return (out.float() + coef @ bias.float()).to(out.dtype)


def _options(module: nn.Module) -> Options:
    opts = getattr(module, _OPTIONS_ATTR, None)
    return opts if isinstance(opts, Options) else Options()


def _run(module: nn.Module, plan: Plan, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
         top_k_weights: torch.Tensor) -> torch.Tensor:
    assert plan.w13 is not None and plan.w2 is not None
    opts = _options(module)
    shape, dtype = hidden_states.shape, hidden_states.dtype
    x = hidden_states.reshape(-1, shape[-1])
    run_dtype = plan.w13.dtype if plan.w13_scale is None else dtype
    x = x.to(run_dtype).contiguous()
    routing = routing_of(top_k_index, top_k_weights, plan.w13.shape[0])
    if plan.folded:
        folded = torch.nn.functional.pad(x, (0, plan.w13.shape[2] - plan.hidden))
        folded[:, plan.hidden] = 1.0
        x = folded
    out = safemoe.experts(x, plan.w13, plan.w2, routing, activation=plan.activation, backend=opts.backend,
                          health=opts.health, workspace=opts.workspace, w13_scale=plan.w13_scale,
                          w2_scale=plan.w2_scale)
    if plan.folded:
        out = out[:, : plan.hidden]
    if plan.w2_bias is not None:
        out = _add_down_bias(out, routing, plan.w2_bias)
    return out.to(dtype).reshape(shape)


def _grouped_mm() -> Callable[..., torch.Tensor]:
    from transformers.integrations.moe import grouped_mm_experts_forward

    return grouped_mm_experts_forward  # type: ignore[no-any-return]


def _fp8_grouped_mm() -> Callable[..., torch.Tensor]:
    from transformers.integrations import finegrained_fp8

    interface = finegrained_fp8.ALL_FP8_EXPERTS_FUNCTIONS
    return interface["grouped_mm"]  # type: ignore[no-any-return]


def safemoe_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """The "safemoe" entry of transformers' ExpertsInterface (see the module docstring).

    hidden_states [T, H], top_k_index [T, K] (any integer dtype, any values), top_k_weights [T, K]
    -> [T, H] in hidden_states' dtype. No `num_valid`: padding rows are computed like real ones.
    """
    plan = _plan(self, fp8=False)
    if plan.fallback is not None:
        return _grouped_mm()(self, hidden_states, top_k_index, top_k_weights)
    return _run(self, plan, hidden_states, top_k_index, top_k_weights)


def safemoe_fp8_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                top_k_weights: torch.Tensor) -> torch.Tensor:
    """The "safemoe" entry of transformers' FP8ExpertsInterface (fine-grained fp8 experts)."""
    plan = _plan(self, fp8=True)
    if plan.fallback is None and hidden_states.dtype not in _checks.FP8_ACTIVATION_DTYPES:
        plan = Plan(plan.key, fallback=f"fp8 experts need bf16/fp16 activations, got {hidden_states.dtype}")
        object.__setattr__(self, _PLAN_ATTR, plan)
        _warn_once(type(self).__name__, plan.fallback)  # type: ignore[arg-type]
    if plan.fallback is not None:
        return _fp8_grouped_mm()(self, hidden_states, top_k_index, top_k_weights)
    return _run(self, plan, hidden_states, top_k_index, top_k_weights)


# -- model-level helpers -----------------------------------------------------------------------


def _is_fp8_experts(module: nn.Module) -> bool:
    return any(c.__name__ == "FP8Experts" for c in type(module).__mro__)


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The `@use_experts_implementation` experts modules of `model` (name, module)."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed")
            and hasattr(m, "config")]


def prepare(model: nn.Module) -> dict[str, str]:
    """Plan every experts module of `model` now (identify the gate, build cached layouts), e.g.
    before CUDA-graph capture or torch.compile; returns `fallbacks(model)`."""
    for _, module in experts_modules(model):
        _plan(module, fp8=_is_fp8_experts(module))
    return fallbacks(model)


def fallbacks(model: nn.Module) -> dict[str, str]:
    """{module name: reason} for each planned experts module that runs transformers' grouped_mm."""
    out = {}
    for name, module in experts_modules(model):
        plan = getattr(module, _PLAN_ATTR, None)
        if isinstance(plan, Plan) and plan.fallback is not None:
            out[name] = plan.fallback
    return out


def configure(model: nn.Module, *, backend: str = "auto", health: Health | torch.Tensor | None = None,
              workspace: Workspace | None = None) -> nn.Module:
    """Set safemoe's backend ("auto", "triton", "reference"), a health tensor (dropped slots are
    counted there) and a shared `Workspace` for every experts module of `model`; returns it."""
    backend = _checks.check_backend(backend)
    tensor = health.tensor if isinstance(health, Health) else health
    if workspace is not None and not isinstance(workspace, Workspace):
        raise TypeError(f"workspace must be a safemoe.Workspace or None, got {type(workspace).__name__}")
    for _, module in experts_modules(model):
        object.__setattr__(module, _OPTIONS_ATTR, Options(backend, tensor, workspace))
    return model


def register() -> None:
    """Register "safemoe" in transformers' experts interfaces (idempotent)."""
    from transformers.integrations import moe

    type(moe.ALL_EXPERTS_FUNCTIONS).register(NAME, safemoe_experts_forward)
    try:
        from transformers.integrations import finegrained_fp8
    except ImportError:  # pragma: no cover - versions without fine-grained fp8
        return
    fp8_interface = getattr(finegrained_fp8, "ALL_FP8_EXPERTS_FUNCTIONS", None)
    if fp8_interface is not None:
        type(fp8_interface).register(NAME, safemoe_fp8_experts_forward)


register()
