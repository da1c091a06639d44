"""Backend adapters: how `safemoe check` calls one MoE implementation, and what of it exists here.

An adapter exposes `route`, `experts` and `moe` with the public API's signatures (minus
`backend=`), returning what the public API returns (`safemoe.Routing`, a [T, H] tensor). The
checks pass the routing whole, a `RouteConfig` where the API takes top_k, and the selection bias
as `bias=`. The two safemoe adapters call the public API (looked up at call time, so a test can
swap it); a peer adapter maps the call onto its library and converts the result (ids to int32,
weights to fp32).
What a peer cannot express it refuses with `NotApplicable` (reported n/a, with the reason): no
health counter, no workspace, an activation or dtype its library lacks.

Padding on peers: no peer takes `num_valid`, so a peer adapter runs the whole padded batch, the way
an engine without it does (`native_num_valid = False`); checks then hold it to what an engine
needs from that: real rows unaffected, every row's routing still in range and finite (a padded
row's ids feed the same dispatch), no crash. Padded rows need not be zeros there.

Registered backends (`BACKENDS`): the safemoe ones (`reference`, `triton`) and the peers (`torch`:
eager HF-style routing and per-expert loop from `safemoe.peers`; `hf-eager`,
`hf-grouped_mm`, `hf-batched_mm`: the installed transformers' experts implementations; `vllm`,
`sglang`, `flashinfer`: their ops when importable). A plugin (`--plugin FILE.py`) can register
more with `register_backend`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import safemoe
from safemoe._checks import check_num_valid, check_route_args
from safemoe._triton import require_triton, triton_importable
from safemoe.check.registry import NotApplicable
from safemoe.route_config import RouteConfig

BUILT, NOT_BUILT, BROKEN = "built", "not built", "broken"
SAFEMOE, PEER = "safemoe", "peer"

# The kernel modules each public op needs on the triton backend.
TRITON_MODULES = {
    "route": ("safemoe.kernels.routing",),
    "experts": ("safemoe.kernels.experts",),
    "moe": ("safemoe.kernels.routing", "safemoe.kernels.experts"),
}


@dataclass
class OpStatus:
    state: str  # BUILT, NOT_BUILT (no implementation) or BROKEN (it fails to import)
    detail: str = ""


@dataclass
class Adapter:
    """One backend under test. Subclasses override the ops they implement."""

    name: str
    device: torch.device
    kind: str = SAFEMOE
    description: str = ""
    installed: bool = True  # False: the library is missing ("not installed", never "passed")
    available: bool = True  # False: installed but cannot run here (no CUDA, ...)
    reason: str = ""  # why not installed / not available
    ops: dict[str, OpStatus] = field(default_factory=dict)
    native_num_valid: bool = True  # takes num_valid; else runs the whole padded batch
    exact_ties: bool = True  # ties go to the lowest expert index (the safemoe contract)
    ordered_ids: bool = True  # a row's ids come in descending score order (else compared as a set)
    counts_health: bool = True  # accepts `health=` and counts into it
    uses_workspace: bool = True  # accepts `workspace=` and uses it (not just ignores it)
    out_buffers: bool = False  # has route_into / experts_into writing caller buffers
    fp8_experts: bool = True  # experts takes float8_e4m3fn w13/w2 with w13_scale=/w2_scale=
    # Output tolerance vs the reference, as a multiple of the dtype's (see invariants): peers
    # round gate/up, the activation and the product to the input dtype, the reference once.
    tolerance_scale: float = 1.0
    module_backend: str | None = None  # backend= for safemoe.MoE / the transformers patch
    graph_ops: tuple[str, ...] = ("route", "experts", "moe")  # ops to try under CUDA-graph capture
    hf_implementation: str | None = None  # transformers experts_implementation it stands for

    # -- ops (the public API's signatures without backend=) -----------------------------------
    # `config` is the routing whole: a RouteConfig (what the checks pass), or K alone.
    def route(self, logits: torch.Tensor, config: RouteConfig | int, **kwargs: Any) -> safemoe.Routing:
        return safemoe.route(logits, config, backend=self.name, **kwargs)

    def experts(
        self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: safemoe.Routing, **kwargs: Any
    ) -> torch.Tensor:
        return safemoe.experts(x, w13, w2, routing, backend=self.name, **kwargs)

    def moe(
        self,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        config: RouteConfig | int,
        **kwargs: Any,
    ) -> torch.Tensor:
        return safemoe.moe(x, router_logits, w13, w2, config, backend=self.name, **kwargs)

    # -- caller-owned outputs (buffer hygiene) --------------------------------------------------
    def route_into(
        self,
        logits: torch.Tensor,
        config: RouteConfig | int,
        weights_out: torch.Tensor,
        ids_out: torch.Tensor,
        **kwargs: Any,
    ) -> None:
        raise NotApplicable(f"{self.name} writes no caller-owned routing buffers")

    def experts_into(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        routing: safemoe.Routing,
        out: torch.Tensor,
        **kwargs: Any,
    ) -> None:
        raise NotApplicable(f"{self.name} writes no caller-owned output buffer")

    # -- what the case may expect -----------------------------------------------------------------
    def weight_tolerance(self, logits_dtype: torch.dtype) -> tuple[float, float]:
        """(atol, rtol) of routing weights against the reference."""
        return 1e-5, 1.3e-5

    def status_of(self, ops: tuple[str, ...]) -> OpStatus:
        """The status of the ops a check needs, together."""
        return combine([self.ops.get(op, OpStatus(NOT_BUILT, f"{self.name} has no {op}")) for op in ops])

    @property
    def state(self) -> str:
        if not self.installed:
            return "not installed"
        return "available" if self.available else "unavailable"


def combine(statuses: list[OpStatus]) -> OpStatus:
    """Broken beats not built beats built."""
    for wanted in (BROKEN, NOT_BUILT):
        hits = [s for s in statuses if s.state == wanted]
        if hits:
            return OpStatus(wanted, "; ".join(dict.fromkeys(s.detail for s in hits)))
    return OpStatus(BUILT)


def _module_status(module: str) -> OpStatus:
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name is not None and module.startswith(error.name):
            return OpStatus(NOT_BUILT, f"{module} does not exist yet")
        return OpStatus(BROKEN, f"importing {module} failed: {error}")
    except Exception as error:  # a kernel module that exists but cannot load is a failure
        return OpStatus(BROKEN, f"importing {module} failed: {type(error).__name__}: {error}")
    return OpStatus(BUILT)


# ----------------------------------------------------------------------------------------------
# safemoe
# ----------------------------------------------------------------------------------------------


def reference_adapter(device: torch.device) -> Adapter:
    return Adapter(
        "reference",
        device,
        description="safemoe's plain-torch reference (the spec)",
        ops={op: OpStatus(BUILT) for op in TRITON_MODULES},
        uses_workspace=False,
        module_backend="reference",
        graph_ops=("route",),  # reference experts find the used experts with host syncs
    )


class TritonAdapter(Adapter):
    """safemoe's Triton kernels; also their allocation-free entry points (caller-owned outputs)."""

    def route_into(
        self,
        logits: torch.Tensor,
        config: RouteConfig | int,
        weights_out: torch.Tensor,
        ids_out: torch.Tensor,
        *,
        bias: torch.Tensor | None = None,
        num_valid: int | torch.Tensor | None = None,
        health: torch.Tensor | None = None,
        **options: Any,
    ) -> None:
        from safemoe.kernels.routing import route_into

        # The checks `safemoe.route` makes, then the allocation-free kernel entry.
        checked = check_route_args(logits, config, bias=bias, **options)
        nv = check_num_valid(num_valid, logits.shape[0], logits.device)
        route_into(
            logits, checked, bias=bias, num_valid=nv, health=health, weights_out=weights_out, ids_out=ids_out
        )

    def experts_into(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        routing: safemoe.Routing,
        out: torch.Tensor,
        **kwargs: Any,
    ) -> None:
        from safemoe.kernels.experts import experts_triton

        if "out" not in inspect.signature(experts_triton).parameters:
            raise NotApplicable("safemoe.kernels.experts.experts_triton takes no out= buffer")
        nv = check_num_valid(kwargs.get("num_valid"), x.shape[0], x.device)
        experts_triton(
            x,
            w13,
            w2,
            routing.weights,
            routing.ids,
            activation=kwargs.get("activation", "silu"),
            num_valid=nv,
            health=kwargs.get("health"),
            workspace=kwargs.get("workspace"),
            out=out,
        )


def triton_adapter(device: torch.device) -> Adapter:
    adapter = TritonAdapter(
        "triton",
        device,
        description="safemoe's Triton kernels" + (" (interpreted on CPU)" if device.type == "cpu" else ""),
        out_buffers=True,
        module_backend="triton",
    )
    if not triton_importable():
        adapter.installed, adapter.reason = False, "the triton package is not installed"
        return adapter
    try:
        require_triton(device, "safemoe check")
    except RuntimeError as error:
        adapter.available, adapter.reason = False, str(error)
        return adapter
    modules = {m: _module_status(m) for mods in TRITON_MODULES.values() for m in mods}
    for op, needed in TRITON_MODULES.items():
        adapter.ops[op] = combine([modules[m] for m in needed])
    return adapter


# ----------------------------------------------------------------------------------------------
# Peers
# ----------------------------------------------------------------------------------------------


def _peer_kwargs(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Drop num_valid (the peer runs the whole padded batch); refuse what it cannot express."""
    kwargs = dict(kwargs)
    kwargs.pop("num_valid", None)
    if kwargs.pop("health", None) is not None:
        raise NotApplicable(f"{name} has no health counter")
    if kwargs.pop("workspace", None) is not None:
        raise NotApplicable(f"{name} takes no workspace")
    return kwargs


def _as_routing(weights: torch.Tensor, ids: torch.Tensor) -> safemoe.Routing:
    """A peer's (weights, ids) in the public API's dtypes. int64 ids outside int32 become -1 (never
    a valid id), so a wild id is never mistaken for a real one by the conversion."""
    ids = ids.to(torch.int64)
    in_range = (ids >= -(2**31)) & (ids < 2**31)
    ids32 = torch.where(in_range, ids, -1).to(torch.int32).contiguous()
    return safemoe.Routing(weights=weights.float().contiguous(), ids=ids32)


class PeerAdapter(Adapter):
    """A peer: its `route_fn(logits, config, bias=...) -> (weights, ids)` and
    `experts_fn(x, w13, w2, weights, ids, activation) -> out`, either of which may be None."""

    route_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    experts_fn: Callable[..., torch.Tensor] | None = None
    activations: tuple[str, ...] = ("silu", "gelu", "swigluoai")
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

    def _check_dtype(self, dtype: torch.dtype) -> None:
        if dtype not in self.dtypes:
            raise NotApplicable(f"{self.name} does not take {str(dtype).removeprefix('torch.')}")

    def route(self, logits: torch.Tensor, config: RouteConfig | int, **kwargs: Any) -> safemoe.Routing:
        if self.route_fn is None:
            raise NotApplicable(f"{self.name} has no routing op")
        kwargs = _peer_kwargs(self.name, kwargs)
        weights, ids = self.route_fn(logits, config, **kwargs)
        return _as_routing(weights, ids)

    def experts(
        self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: safemoe.Routing, **kwargs: Any
    ) -> torch.Tensor:
        if self.experts_fn is None:
            raise NotApplicable(f"{self.name} has no experts op")
        kwargs = _peer_kwargs(self.name, kwargs)
        activation = kwargs.pop("activation", "silu")
        if kwargs:
            raise TypeError(f"{self.name}.experts: unexpected arguments {sorted(kwargs)}")
        if activation not in self.activations:
            raise NotApplicable(f"{self.name} has no {activation} activation wired up")
        self._check_dtype(x.dtype)
        return self.experts_fn(x, w13, w2, routing.weights, routing.ids, activation)

    def moe(
        self,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        config: RouteConfig | int,
        **kwargs: Any,
    ) -> torch.Tensor:
        kwargs = _peer_kwargs(self.name, kwargs)
        activation = kwargs.pop("activation", "silu")
        routing = self.route(router_logits, config, **kwargs)
        return self.experts(x, w13, w2, routing, activation=activation)

    def weight_tolerance(self, logits_dtype: torch.dtype) -> tuple[float, float]:
        return 1e-5, 2e-5


def _not_installed(adapter: Adapter, reason: str) -> Adapter:
    adapter.installed, adapter.reason = False, reason
    return adapter


def _peer(name: str, device: torch.device, description: str, **fields: Any) -> PeerAdapter:
    adapter = PeerAdapter(
        name,
        device,
        kind=PEER,
        description=description,
        native_num_valid=False,
        exact_ties=False,
        ordered_ids=False,
        tolerance_scale=4.0,
        counts_health=False,
        uses_workspace=False,
        fp8_experts=False,
    )
    for key, value in fields.items():
        setattr(adapter, key, value)
    return adapter


def _ops(route: bool, experts: bool) -> dict[str, OpStatus]:
    none = OpStatus(NOT_BUILT, "no such op in this library")
    return {
        "route": OpStatus(BUILT) if route else none,
        "experts": OpStatus(BUILT) if experts else none,
        "moe": OpStatus(BUILT) if route and experts else none,
    }


def torch_adapter(device: torch.device) -> Adapter:
    from safemoe import peers

    return _peer(
        "torch",
        device,
        "eager torch the way HF MoE blocks run: softmax/sigmoid + topk routing, per-expert loop",
        route_fn=peers.torch_route,
        experts_fn=peers.hf_experts_loop,
        ops=_ops(True, True),
    )


# transformers' experts implementations we can drive (others need extra libraries or hardware).
HF_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
_HF_ACTIVATIONS = {"silu": "silu", "gelu": "gelu_pytorch_tanh"}


class _HFExperts:
    """Runs transformers' `Qwen3MoeExperts` (decorated with `use_experts_implementation`) with a
    chosen `experts_implementation` on our w13 [E, 2I, H] / w2 [E, H, I] (its own layout)."""

    def __init__(self, implementation: str) -> None:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

        self.implementation = implementation
        self.config_class = Qwen3MoeConfig
        self.module_class = Qwen3MoeExperts

    def __call__(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        activation: str,
    ) -> torch.Tensor:
        from torch import nn

        num_experts, two_inter, hidden = w13.shape
        config = self.config_class(
            hidden_size=hidden,
            moe_intermediate_size=two_inter // 2,
            num_experts=num_experts,
            hidden_act=_HF_ACTIVATIONS[activation],
        )
        config._experts_implementation = self.implementation
        with torch.device("meta"):
            module = self.module_class(config)
        module.gate_up_proj = nn.Parameter(w13, requires_grad=False)
        module.down_proj = nn.Parameter(w2, requires_grad=False)
        # As the HF blocks call it: int64 top-k indices, weights in the hidden states' dtype.
        with torch.no_grad():
            return module(x, ids.long(), weights.to(x.dtype))


def hf_adapter(device: torch.device, implementation: str) -> Adapter:
    from safemoe import peers

    name = f"hf-{implementation}"
    description = f"transformers' {implementation} experts implementation (Qwen3MoeExperts), torch routing"
    adapter = _peer(name, device, description, ops=_ops(False, True))
    try:
        import transformers
        from transformers.integrations import moe as hf_moe

        runner = _HFExperts(implementation)
    except Exception as error:  # missing, or a transformers without experts implementations
        return _not_installed(
            adapter, f"transformers experts implementations: {type(error).__name__}: {error}"
        )
    known = getattr(getattr(hf_moe, "ALL_EXPERTS_FUNCTIONS", None), "_global_mapping", {})
    if not hasattr(runner.module_class, "_apply_gate"):  # added by @use_experts_implementation
        return _not_installed(adapter, f"transformers {transformers.__version__}: Qwen3MoeExperts has no "
                                       "experts implementations")  # fmt: skip
    if implementation != "eager" and implementation not in known:
        return _not_installed(adapter, f"transformers {transformers.__version__} has no {implementation!r}")
    adapter.description += f" (transformers {transformers.__version__})"
    adapter.hf_implementation = implementation
    adapter.experts_fn = runner
    adapter.activations = tuple(_HF_ACTIVATIONS)
    # The whole step as the HF block runs it: its routing (torch_route is that code), then experts.
    adapter.route_fn = None
    adapter.ops = {
        "route": OpStatus(NOT_BUILT, "HF routers take hidden states, not logits (see torch)"),
        "experts": OpStatus(BUILT),
        "moe": OpStatus(BUILT),
    }

    def moe(
        x: torch.Tensor,
        router_logits: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        config: RouteConfig | int,
        **kwargs: Any,
    ) -> torch.Tensor:
        kwargs = _peer_kwargs(name, kwargs)
        activation = kwargs.pop("activation", "silu")
        weights, ids = peers.torch_route(router_logits, config, **kwargs)
        return adapter.experts(x, w13, w2, _as_routing(weights, ids), activation=activation)

    adapter.moe = moe  # type: ignore[method-assign]
    return adapter


def _library_adapter(
    name: str, device: torch.device, module: str, description: str, route: Any, experts: Any
) -> Adapter:
    adapter = _peer(name, device, description, ops=_ops(route is not None, experts is not None))
    try:
        importlib.import_module(module)
    except Exception as error:
        return _not_installed(adapter, f"{module} cannot be imported ({type(error).__name__}: {error})")
    if device.type != "cuda":
        adapter.available, adapter.reason = False, f"{name}'s MoE ops need CUDA tensors"
        return adapter
    from safemoe.peers import PeerUnavailable

    def guard(fn: Any) -> Any:
        if fn is None:
            return None

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except PeerUnavailable as error:  # an API this adapter does not know
                raise NotApplicable(str(error)) from error

        return call

    adapter.route_fn, adapter.experts_fn = guard(route), guard(experts)
    adapter.activations = ("silu",) if name == "flashinfer" else ("silu", "gelu")
    if name == "flashinfer":
        adapter.dtypes = (torch.float16, torch.bfloat16)
    return adapter


# name -> (module whose import decides "installed", description, route and experts functions
# of safemoe.peers, None where the library has no such op).
LIBRARY_PEERS: dict[str, tuple[str, str, str | None, str]] = {
    "vllm": ("vllm.model_executor.layers.fused_moe",
             "vLLM fused_topk / grouped_topk routing, Triton fused_experts",
             "vllm_route", "vllm_fused_experts"),
    "sglang": ("sglang.srt.layers.moe.topk",
               "SGLang fused_topk / (biased_)grouped_topk routing, Triton fused_experts",
               "sglang_route", "sglang_fused_experts"),
    "flashinfer": ("flashinfer.fused_moe", "FlashInfer cutlass_fused_moe (experts only)", None,
                   "flashinfer_fused_experts"),
}  # fmt: skip


def library_adapter(device: torch.device, name: str) -> Adapter:
    from safemoe import peers

    module, description, route, experts = LIBRARY_PEERS[name]
    route_fn = getattr(peers, route) if route is not None else None
    return _library_adapter(name, device, module, description, route_fn, getattr(peers, experts))


AdapterFactory = Callable[[torch.device], Adapter]

# name -> factory; the safemoe backends first, then the peers, then plugins.
BACKENDS: dict[str, AdapterFactory] = {
    "reference": reference_adapter,
    "triton": triton_adapter,
    "torch": torch_adapter,
    **{f"hf-{impl}": functools.partial(hf_adapter, implementation=impl) for impl in HF_IMPLEMENTATIONS},
    **{name: functools.partial(library_adapter, name=name) for name in LIBRARY_PEERS},
}
SAFEMOE_BACKENDS = ("reference", "triton")
# Kept for callers of the first `safemoe check`: the safemoe backends only.
ADAPTERS = {name: BACKENDS[name] for name in SAFEMOE_BACKENDS}


def register_backend(name: str, factory: AdapterFactory) -> None:
    """Add a backend (from a `--plugin` file): `factory(device) -> Adapter`."""
    if name in BACKENDS:
        raise ValueError(f"backend {name!r} is already registered")
    BACKENDS[name] = factory


def make_adapter(name: str, device: torch.device) -> Adapter:
    """The adapter of `name`; a factory that raises gives an unavailable adapter saying why."""
    try:
        adapter = BACKENDS[name](device)
    except Exception as error:
        adapter = Adapter(name, device, kind=PEER, available=False)
        adapter.reason = f"its adapter failed to build: {type(error).__name__}: {error}"
    adapter.name = name
    return adapter


def make_adapters(names: list[str], device: torch.device) -> list[Adapter]:
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}; known: {', '.join(BACKENDS)}")
    return [make_adapter(n, device) for n in names]
