"""Experts: the gated expert MLPs of the routed tokens, combined with the routing weights.

out[t] = sum_k weights[t,k] * w2[e] @ act(w13[e] @ x[t]), e = ids[t,k], for rows t < num_valid;
rows at or past num_valid are exact zeros. Slots with an id outside [0, E) are dropped (counted
in `health`), never used as an address; duplicate ids in a row are each served.

fp8 (e4m3) expert weights: pass float8_e4m3fn w13/w2 with `w13_scale` and `w2_scale`
(dequantised = fp8 * scale); the scale shapes choose per-tensor or DeepSeek-V3 128x128 block mode
(see `safemoe.quantize_experts` and docs/fp8.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from safemoe import _checks, ops
from safemoe._triton import require_triton
from safemoe.health import check_health
from safemoe.routing import Routing

if TYPE_CHECKING:
    from safemoe.workspace import Workspace


def experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    routing: Routing,
    *,
    activation: str = "silu",
    num_valid: int | torch.Tensor | None = None,
    backend: str = "auto",
    health: torch.Tensor | None = None,
    workspace: Workspace | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Run the routed expert MLPs.

    x: [T, H] bf16/fp16/fp32. w13: [E, 2I, H], gate rows [0, I) then up rows [I, 2I).
    w2: [E, H, I]. routing: from `safemoe.route` (or any ids int32 / weights float32 [T, K]).
    activation: "silu", "gelu" (tanh approximation) or "swigluoai" (gpt-oss's clamped SwiGLU,
        alpha 1.702, limit 7, on the same gate-then-up layout; de-interleave gpt-oss weights first).
    workspace: a `safemoe.workspace.Workspace` holding the Triton backend's scratch buffers,
        allocated once (e.g. for the largest batch) and shared by every layer with the same or
        smaller dims; without it each triton call allocates and zeroes a temporary one. Ignored
        by the reference backend. fp8 weights need one made with `fp8=True`.
    w13_scale, w2_scale: float32 scales of float8_e4m3fn w13/w2 (x then bf16 or fp16), in the
        "weight_scale_inv" convention (dequantised = fp8 * scale). Per-tensor: w13_scale [E] (or
        [E, 2]: gate, up), w2_scale [E]; activations are quantised per token at run time.
        DeepSeek-V3 block: w13_scale [E, ceil(2I/128), ceil(H/128)] (or [E, 2*ceil(I/128),
        ceil(H/128)] for gate and up quantised separately), w2_scale [E, ceil(H/128),
        ceil(I/128)]; activations in 1x128 groups. Each row's activation scales depend on that
        row only; a NaN/Inf in a valid row of x makes that row's output NaN and nothing else.
    batch_invariant: a valid row's output is bitwise the same whatever T, num_valid and the other
        rows hold (one tile config for every T, no small-batch switch; backend "triton" only;
        bf16/fp16/fp32 and fp8). Costs speed: see the README.
    Returns [T, H] in x's dtype.
    """
    num_tokens, _, _, _, fp8 = _checks.check_expert_weights(
        x, w13, w2, activation, w13_scale, w2_scale
    )
    if not isinstance(routing, Routing):
        raise TypeError(f"routing must be a safemoe.Routing, got {type(routing).__name__}")
    _checks.check_routing_tensors(routing.ids, routing.weights, num_tokens, x.device)
    backend = _checks.check_backend(backend)
    nv = _checks.check_num_valid(num_valid, num_tokens, x.device)
    check_health(health, x.device)
    backend = _checks.resolve_backend(backend, x.device)
    _checks.check_batch_invariant(batch_invariant, backend, "experts")
    workspace = _checks.check_workspace(workspace, x, w13, routing.ids.shape[1], fp8=fp8 is not None)
    if backend == "triton":
        require_triton(x.device, "experts")
    return ops.experts(x, w13, w2, routing.weights, routing.ids, activation=activation, num_valid=nv,
                       backend=backend, health=health, workspace=workspace, fp8=fp8,
                       batch_invariant=batch_invariant)
