"""Backend adapters: how `safemoe check` calls one backend, and what of it exists on this machine.

An adapter exposes `route`, `experts` and `moe` with the public API's signatures (minus
`backend=`) and reports, per op, whether it is built. The built-in adapters call the public API
(`safemoe.route(..., backend=name)`), looked up at call time so a test can swap it; an adapter for
another implementation (a peer library, a graph-replayed runtime) subclasses `Adapter`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import torch

import safemoe
from safemoe._triton import require_triton, triton_importable

BUILT, NOT_BUILT, BROKEN = "built", "not built", "broken"

# The kernel modules each public op needs on the triton backend.
TRITON_MODULES = {
    "route": ("safemoe.kernels.router",),
    "experts": ("safemoe.kernels.experts",),
    "moe": ("safemoe.kernels.router", "safemoe.kernels.experts"),
}


@dataclass
class OpStatus:
    state: str  # BUILT, NOT_BUILT (its module does not exist yet) or BROKEN (it fails to import)
    detail: str = ""


@dataclass
class Adapter:
    name: str
    device: torch.device
    available: bool = True
    reason: str = ""  # why the backend cannot run here, when not available
    ops: dict[str, OpStatus] = field(default_factory=dict)

    def route(self, logits: torch.Tensor, top_k: int, **kwargs: Any) -> safemoe.Routing:
        return safemoe.route(logits, top_k, backend=self.name, **kwargs)

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
        top_k: int,
        **kwargs: Any,
    ) -> torch.Tensor:
        return safemoe.moe(x, router_logits, w13, w2, top_k, backend=self.name, **kwargs)

    def status_of(self, ops: tuple[str, ...]) -> OpStatus:
        """The status of the ops a case needs, together."""
        return combine([self.ops.get(op, OpStatus(NOT_BUILT, f"{op} has no implementation")) for op in ops])


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


def reference_adapter(device: torch.device) -> Adapter:
    return Adapter("reference", device, ops={op: OpStatus(BUILT) for op in TRITON_MODULES})


def triton_adapter(device: torch.device) -> Adapter:
    adapter = Adapter("triton", device)
    if not triton_importable():
        adapter.available, adapter.reason = False, "the triton package is not installed"
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


ADAPTERS = {"reference": reference_adapter, "triton": triton_adapter}


def make_adapters(names: list[str], device: torch.device) -> list[Adapter]:
    unknown = [n for n in names if n not in ADAPTERS]
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}; known: {sorted(ADAPTERS)}")
    return [ADAPTERS[n](device) for n in names]
