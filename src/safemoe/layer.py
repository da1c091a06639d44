"""The whole MoE layer: `safemoe.moe()` (route, then experts, one call) and `safemoe.MoE`, the same as
an `nn.Module` built on the registered ops.

Data path of one forward, x [T, H] (leading dimensions are flattened into T):

    logits = gate(x)                      # [T, E], a bias-free Linear unless the model has one
    weights, ids = safemoe::route(...)    # [T, K] f32 / [T, K] i32, contract of safemoe.route
    out = safemoe::experts(x, w13, w2, weights, ids)
    out += shared_expert(x) (* sigmoid(shared_expert_gate(x)))   # optional, padded rows zeroed

Rows at or past `num_valid` are never read by the routed path and come out as exact zeros; the
optional shared expert is a dense MLP that does see them, so its padded rows are zeroed
(`safemoe::zero_padding_`) before the sum. Nothing here synchronises with the host, so a forward
can be captured in a CUDA graph with a device `num_valid` and compiled with
`torch.compile(fullgraph=True)`.

Expert biases (gpt-oss): the expert kernels compute `w13 @ x` without a bias. The gate/up bias is
folded into the GEMM instead: w13 gets one extra input column holding the bias and x one extra
column holding 1.0 (both padded with zeros to a multiple of 16 columns to keep rows aligned), and
w2 gets matching zero output rows that are sliced away. So `w13` is [E, 2I, Hf] and `w2` is
[E, Hf, I] with Hf = round_up(H + 1, 16) when `expert_bias=True`; the bias is `w13[:, :, H]`.
The down-projection bias is added in torch outside the kernel: sum over served slots of
weights[t, k] * b2[ids[t, k]], as a dense [T, E] coefficient matrix times b2 [E, H] (graph safe).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from safemoe import _checks, ops
from safemoe.experts import experts
from safemoe.health import Health, check_health
from safemoe.routing import route

# Row alignment of the folded w13/x (elements): 16 keeps bf16 rows 32-byte aligned for vector loads.
_FOLD_ALIGN = 16


def folded_hidden(hidden: int) -> int:
    """Hf: the input width of w13 once the gate/up bias is folded in as column H."""
    return -(-(hidden + 1) // _FOLD_ALIGN) * _FOLD_ALIGN


def fold_expert_biases(
    w13: torch.Tensor, w13_bias: torch.Tensor, w2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, 2I, H], bias [E, 2I], w2 [E, H, I]) -> (w13f [E, 2I, Hf], w2f [E, Hf, I]) (copies)."""
    num_experts, two_inter, hidden = w13.shape
    width = folded_hidden(hidden)
    w13f = w13.new_zeros(num_experts, two_inter, width)
    w13f[:, :, :hidden] = w13
    w13f[:, :, hidden] = w13_bias.to(w13.dtype)
    w2f = w2.new_zeros(num_experts, width, w2.shape[2])
    w2f[:, :hidden, :] = w2
    return w13f, w2f


def _health_tensor(health: Health | torch.Tensor | None) -> torch.Tensor | None:
    if isinstance(health, Health):
        return health.tensor
    return health


def _init_normal(*tensors: torch.Tensor | None, std: float = 0.02) -> None:
    with torch.no_grad():
        for t in tensors:
            if t is not None and t.device.type != "meta":
                t.normal_(0.0, std)


class Gate(nn.Module):
    """The gate: logits = x @ weight.T (+ bias), then `safemoe::route`.

    weight: [E, H]. bias: optional [E] Linear bias (gpt-oss), part of the logits.
    selection_bias: optional [E] float32 buffer (DeepSeek-V3's e_score_correction_bias), added to
        the scores for selection only.
    logits_fp32: compute the logits in fp32 from fp32 copies (DeepSeek-V3 does).
    forward(x [T, H], num_valid) -> (weights [T, K] f32, ids [T, K] i32); forward hooks see them.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        scoring: str = "softmax",
        renormalize: bool = True,
        n_group: int | None = None,
        topk_group: int | None = None,
        routed_scaling_factor: float = 1.0,
        bias: bool = False,
        selection_bias: bool = False,
        logits_fp32: bool = False,
        backend: str = "auto",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.scoring = scoring
        self.renormalize = renormalize
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.logits_fp32 = logits_fp32
        self.backend = _checks.check_backend(backend)
        self.health: torch.Tensor | None = None
        factory: dict[str, Any] = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, **factory))
        self.bias = nn.Parameter(torch.zeros(num_experts, **factory)) if bias else None
        self.selection_bias: torch.Tensor | None
        if selection_bias:
            self.register_buffer(
                "selection_bias", torch.zeros(num_experts, dtype=torch.float32, device=device)
            )
        else:
            self.selection_bias = None
        _init_normal(self.weight)
        # Validate the routing options once, at construction, with a dummy row.
        _checks.check_route_args(
            torch.zeros(1, num_experts),
            top_k,
            scoring=scoring,
            renormalize=renormalize,
            bias=None,
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=routed_scaling_factor,
        )

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.logits_fp32:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias)  # [T, E] float32
        return F.linear(x, self.weight, self.bias)  # [T, E]

    def forward(
        self, x: torch.Tensor, num_valid: int | torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.route(
            self.logits(x),
            self.top_k,
            scoring=self.scoring,
            renormalize=self.renormalize,
            bias=self.selection_bias,
            n_group=self.n_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
            num_valid=num_valid,
            backend=self.backend,
            health=self.health,
        )

    def extra_repr(self) -> str:
        group = f", n_group={self.n_group}, topk_group={self.topk_group}" if self.n_group else ""
        return (
            f"E={self.num_experts}, top_k={self.top_k}, scoring={self.scoring}, "
            f"renormalize={self.renormalize}{group}, routed_scaling_factor={self.routed_scaling_factor}"
        )


class GatedMLP(nn.Module):
    """The shared expert: down(act(gate(x)) * up(x)), three bias-free Linears."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "silu",
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        factory: dict[str, Any] = {"dtype": dtype, "device": device}
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, **factory)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, **factory)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, **factory)
        if activation not in ("silu", "gelu"):
            raise ValueError(f"shared expert activation must be 'silu' or 'gelu', got {activation!r}")
        self.activation = activation
        _init_normal(self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        act = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return self.down_proj(act * self.up_proj(x))


def moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    *,
    activation: str = "silu",
    num_valid: int | torch.Tensor | None = None,
    backend: str = "auto",
    health: torch.Tensor | None = None,
    **route_kwargs: Any,
) -> torch.Tensor:
    """`route(router_logits, top_k, **route_kwargs)` then `experts(x, w13, w2, routing)`.

    route_kwargs: scoring, renormalize, bias, n_group, topk_group, routed_scaling_factor.
    """
    # Check the expert inputs before the router runs (no kernel may launch on bad input), and tie
    # the router's E to the weights' E: a router wider than w13 would route to ids >= E that
    # experts() silently drops.
    num_tokens, num_experts, _, _ = _checks.check_experts_args(x, w13, w2, activation)
    logits = _checks.check_tensor("router_logits", router_logits, dims=2, dtypes=_checks.FLOAT_DTYPES)
    if tuple(logits.shape) != (num_tokens, num_experts):
        raise ValueError(
            f"router_logits must have shape [T={num_tokens}, E={num_experts}] to match x and w13, "
            f"got {tuple(logits.shape)}"
        )
    _checks.check_same_device("router_logits", logits, x.device)
    routing = route(
        router_logits, top_k, num_valid=num_valid, backend=backend, health=health, **route_kwargs
    )
    return experts(
        x, w13, w2, routing, activation=activation, num_valid=num_valid, backend=backend, health=health
    )


class MoE(nn.Module):
    """A Mixture-of-Experts layer that keeps the safemoe contract (see the module docstring).

    Parameters: `gate.weight` [E, H] (+ `gate.bias` [E] with router_bias), `w13` [E, 2I, H] (gate
    rows then up rows), `w2` [E, H, I]; with `expert_bias` the folded `w13` [E, 2I, Hf] / `w2`
    [E, Hf, I] and `w2_bias` [E, H]; with `shared_intermediate_size` a `shared_expert` (GatedMLP,
    or any module mapping [T, H] -> [T, H] assigned later) and with `shared_expert_gate` its
    sigmoid gate Linear(H, 1).

    workspace: a `safemoe.Workspace` shared by every layer (scratch is allocated once); passed to
        the expert kernels when they accept it.
    health: a `safemoe.Health` (or its int64 tensor) every op of this layer adds to.
    backend: "auto", "triton" or "reference" (see safemoe.route).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        scoring: str = "softmax",
        renormalize: bool = True,
        n_group: int | None = None,
        topk_group: int | None = None,
        routed_scaling_factor: float = 1.0,
        activation: str = "silu",
        router_bias: bool = False,
        selection_bias: bool = False,
        router_logits_fp32: bool = False,
        expert_bias: bool = False,
        shared_intermediate_size: int | None = None,
        shared_expert_gate: bool = False,
        shared_activation: str = "silu",
        workspace: Any = None,
        health: Health | torch.Tensor | None = None,
        backend: str = "auto",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if activation not in _checks.ACTIVATIONS:
            raise ValueError(f"activation must be one of {_checks.ACTIVATIONS}, got {activation!r}")
        if shared_expert_gate and shared_intermediate_size is None:
            raise ValueError("shared_expert_gate=True needs a shared expert (shared_intermediate_size)")
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.activation = activation
        self.expert_bias = expert_bias
        self.backend = _checks.check_backend(backend)
        factory: dict[str, Any] = {"dtype": dtype, "device": device}
        self.gate = Gate(
            hidden_size,
            num_experts,
            top_k,
            scoring=scoring,
            renormalize=renormalize,
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=routed_scaling_factor,
            bias=router_bias,
            selection_bias=selection_bias,
            logits_fp32=router_logits_fp32,
            backend=backend,
            **factory,
        )
        width = folded_hidden(hidden_size) if expert_bias else hidden_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, width, **factory))
        self.w2 = nn.Parameter(torch.empty(num_experts, width, intermediate_size, **factory))
        self.w2_bias = nn.Parameter(torch.zeros(num_experts, hidden_size, **factory)) if expert_bias else None
        _init_normal(self.w13, self.w2)
        if expert_bias and self.w13.device.type != "meta":
            with torch.no_grad():
                self.w13[:, :, hidden_size:].zero_()
                self.w2[:, hidden_size:, :].zero_()
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_intermediate_size is not None:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, shared_activation, **factory)
            if shared_expert_gate:
                self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False, **factory)
                _init_normal(self.shared_expert_gate.weight)
        self._workspace_id = -1
        self._workspace: Any = None
        self.set_workspace(workspace)
        self._health: torch.Tensor | None = None
        self.set_health(health)

    # -- shared state -------------------------------------------------------------------------
    @property
    def workspace(self) -> Any:
        return self._workspace

    def set_workspace(self, workspace: Any) -> None:
        """Use `workspace` (shared by all layers) for the expert kernels' scratch; None: none."""
        self._workspace = workspace
        self._workspace_id = ops.register_workspace(workspace)

    @property
    def health(self) -> torch.Tensor | None:
        return self._health

    def set_health(self, health: Health | torch.Tensor | None) -> None:
        """Make every op of this layer add to `health` (a Health or its int64 tensor); None: off."""
        tensor = _health_tensor(health)
        if tensor is not None:
            check_health(tensor, tensor.device)
        self._health = tensor
        self.gate.health = tensor

    # -- expert biases ------------------------------------------------------------------------
    @property
    def w13_bias(self) -> torch.Tensor | None:
        """[E, 2I] view of the folded gate/up bias (column H of w13), or None."""
        return self.w13[:, :, self.hidden_size] if self.expert_bias else None

    def load_experts(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
    ) -> None:
        """Copy expert weights given in the plain layout (w13 [E, 2I, H], w2 [E, H, I]) in."""
        with torch.no_grad():
            if self.expert_bias:
                if w13_bias is None:
                    w13_bias = w13.new_zeros(w13.shape[0], w13.shape[1])
                w13, w2 = fold_expert_biases(w13, w13_bias, w2)
                assert self.w2_bias is not None
                self.w2_bias.copy_(w2_bias if w2_bias is not None else torch.zeros_like(self.w2_bias))
            elif w13_bias is not None or w2_bias is not None:
                raise ValueError("expert biases given to a MoE built with expert_bias=False")
            self.w13.copy_(w13)
            self.w2.copy_(w2)

    # -- forward ------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, num_valid: int | torch.Tensor | None = None) -> torch.Tensor:
        """x [..., H] -> [..., H]; rows (of the flattened x) at or past num_valid come out as zeros."""
        shape = x.shape
        if shape[-1] != self.hidden_size:
            raise ValueError(f"x must end with H={self.hidden_size}, got shape {tuple(shape)}")
        x2 = x.reshape(-1, self.hidden_size)  # [T, H]
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        weights, ids = self.gate(x2, num_valid)  # [T, K] f32, [T, K] i32

        x_in = self._fold_input(x2) if self.expert_bias else x2
        out = ops.experts(
            x_in,
            self.w13,
            self.w2,
            weights,
            ids,
            activation=self.activation,
            num_valid=num_valid,
            backend=self.backend,
            health=self._health,
            workspace_id=self._workspace_id,
        )  # [T, H] (or [T, Hf] folded)
        if self.expert_bias:
            out = self._add_down_bias(out[:, : self.hidden_size], weights, ids)

        if self.shared_expert is not None:
            shared = self.shared_expert(x2)  # [T, H], dense: padded rows hold whatever x held
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x2)) * shared
            ops.zero_padding_(shared, num_valid)
            out = out + shared
        return out.view(shape)

    def _fold_input(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, Hf]: x, then a 1.0 column that multiplies the folded gate/up bias."""
        folded = F.pad(x, (0, self.w13.shape[2] - self.hidden_size))
        folded[:, self.hidden_size] = 1.0
        return folded

    def _add_down_bias(self, out: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """out + sum over served slots of weights[t, k] * w2_bias[ids[t, k]] (padded rows stay 0)."""
        assert self.w2_bias is not None
        served = (ids >= 0) & (ids < self.num_experts)  # padded rows: ids -1, never an address
        coef = torch.zeros(ids.shape[0], self.num_experts, dtype=torch.float32, device=ids.device)
        coef.scatter_add_(1, ids.clamp(0, self.num_experts - 1).long(), torch.where(served, weights, 0.0))
        return (out.float() + coef @ self.w2_bias.float()).to(out.dtype)

    def extra_repr(self) -> str:
        return (
            f"H={self.hidden_size}, I={self.intermediate_size}, E={self.num_experts}, K={self.top_k}, "
            f"activation={self.activation}, expert_bias={self.expert_bias}, backend={self.backend}"
        )
