"""The whole MoE layer: `safemoe.moe()` (route, then experts, one call) and `safemoe.MoE`, the same as
an `nn.Module` built on the registered ops.

Data path of one forward, x [T, H] (leading dimensions are flattened into T):

    logits = gate(x)                      # [T, E], a bias-free Linear unless the model has one
    weights, ids = safemoe::route(...)    # [T, K] f32 / [T, K] i32, contract of safemoe.route
    out = safemoe::experts(x, w13, w2, weights, ids)
    out += shared_expert(x) (* sigmoid(shared_expert_gate(x)))   # optional, padded rows zeroed

With `input_weighted` (Llama 4) the weight scales the expert's input instead: out = sum over k of
experts(x * weights[:, k], ids[:, k], weight 1), one experts call per k.

Rows at or past `num_valid` are never read by the routed path and come out as exact zeros; the
optional shared expert is a dense MLP that does see them, so its padded rows are zeroed
(`safemoe::zero_padding_`) before the sum. Nothing here synchronises with the host, so a forward
can be captured in a CUDA graph with a device `num_valid` and compiled with
`torch.compile(fullgraph=True)`.

With `batch_invariant=True` every step is computed so that a valid row's output is bitwise the
same whatever T, num_valid and the other rows hold: the router and expert kernels run one config
for every T, and the gate logits, the shared expert (a `GatedMLP`), its gate and the down bias use
`kernels/linear.py` (fixed tiles) instead of torch matmuls, whose cuBLAS algorithm follows T.

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
from safemoe._checks import Fp8Weights, NumValid
from safemoe._triton import require_triton
from safemoe.fp8 import QUANT_MODES, quantize_experts
from safemoe.health import Health, check_health
from safemoe.route_config import RouteConfig
from safemoe.workspace import Workspace

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
    """The gate: logits = x @ weight.T (+ bias), then `safemoe::route` with `config`.

    weight: [E, H]. bias: optional [E] Linear bias (gpt-oss), part of the logits.
    selection_bias: optional [E] float32 buffer (DeepSeek-V3's e_score_correction_bias), added to
        the scores for selection only.
    logits_fp32: compute the logits in fp32 from fp32 copies (DeepSeek-V3 does).
    batch_invariant: logits from `kernels/linear.py` (fixed tiles, not cuBLAS) and the router's
        one config of every T: a row's (weights, ids) do not depend on T or the other rows.
    forward(x [T, H], num_valid) -> (weights [T, K] f32, ids [T, K] i32); forward hooks see them.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        config: RouteConfig,
        *,
        bias: bool = False,
        selection_bias: bool = False,
        logits_fp32: bool = False,
        backend: str = "auto",
        batch_invariant: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.batch_invariant = _checks.check_flag("batch_invariant", batch_invariant)
        if not isinstance(config, RouteConfig):
            raise TypeError(f"config must be a safemoe.RouteConfig, got {type(config).__name__}")
        self.config = config.check(num_experts)
        self.num_experts = num_experts
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

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            from safemoe.kernels.linear import linear_rows

            return linear_rows(x, self.weight, self.bias, fp32=self.logits_fp32)  # [T, E]
        if self.logits_fp32:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias)  # [T, E] float32
        return F.linear(x, self.weight, self.bias)  # [T, E]

    def forward(
        self, x: torch.Tensor, num_valid: int | torch.Tensor | NumValid | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        nv = num_valid if isinstance(num_valid, NumValid) else _checks.check_num_valid(
            num_valid, x.shape[0], x.device
        )
        backend = _resolve(self.backend, x.device)
        _checks.check_batch_invariant(self.batch_invariant, backend, "MoE")
        return ops.route(self.logits(x), self.config, bias=self.selection_bias, num_valid=nv,
                         backend=backend, health=self.health, batch_invariant=self.batch_invariant)

    def extra_repr(self) -> str:
        return f"E={self.num_experts}, {self.config}"


def _resolve(backend: str, device: torch.device) -> str:
    backend = _checks.resolve_backend(backend, device)
    if backend == "triton":
        require_triton(device, "MoE")
    return backend


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

    def forward_batch_invariant(self, x: torch.Tensor) -> torch.Tensor:
        """forward with the three Linears on `kernels/linear.py` (fixed tiles; the activation and
        product are elementwise): row t of the result depends on row t of x alone, bitwise."""
        from safemoe.kernels.linear import linear_rows

        gate = linear_rows(x, self.gate_proj.weight)
        act = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return linear_rows(act * linear_rows(x, self.up_proj.weight), self.down_proj.weight)


def moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int | RouteConfig,
    *,
    bias: torch.Tensor | None = None,
    activation: str = "silu",
    num_valid: int | torch.Tensor | None = None,
    backend: str = "auto",
    health: torch.Tensor | None = None,
    workspace: Workspace | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    batch_invariant: bool = False,
    **route_options: Any,
) -> torch.Tensor:
    """`route(router_logits, top_k, bias=bias)` then `experts(x, w13, w2, routing)`.

    top_k: K, or a whole `RouteConfig`; with K, the routing options as keywords (scoring,
        renormalize, n_group, topk_group, routed_scaling_factor, group_score).
    workspace, w13_scale, w2_scale: as in `safemoe.experts` (fp8 weights with their scales).
    batch_invariant: as in `safemoe.route` and `safemoe.experts` (backend "triton" only): a valid
        row's output is bitwise the same whatever T, num_valid and the other rows hold, given its
        logits row (computing the logits invariantly is the caller's part; `safemoe.MoE` does).
    Every argument is checked before any kernel launches.
    """
    num_tokens, num_experts, _, _, fp8 = _checks.check_expert_weights(
        x, w13, w2, activation, w13_scale, w2_scale
    )
    # Tie the router's E to the weights' E: a router wider than w13 would route to ids >= E that
    # experts() silently drops.
    logits = _checks.check_tensor("router_logits", router_logits, dims=2, dtypes=_checks.FLOAT_DTYPES)
    if tuple(logits.shape) != (num_tokens, num_experts):
        raise ValueError(
            f"router_logits must have shape [T={num_tokens}, E={num_experts}] to match x and w13, "
            f"got {tuple(logits.shape)}"
        )
    _checks.check_same_device("router_logits", logits, x.device)
    config = _checks.check_route_args(logits, top_k, bias=bias, **route_options)
    backend = _checks.resolve_backend(_checks.check_backend(backend), x.device)
    _checks.check_batch_invariant(batch_invariant, backend, "moe")
    nv = _checks.check_num_valid(num_valid, num_tokens, x.device)
    check_health(health, x.device)
    workspace = _checks.check_workspace(workspace, x, w13, config.top_k, fp8=fp8 is not None)
    if backend == "triton":
        require_triton(x.device, "moe")
    weights, ids = ops.route(logits, config, bias=bias, num_valid=nv, backend=backend, health=health,
                             batch_invariant=batch_invariant)
    # ids_complete: the router above wrote every row's ids in this call (padding rows' as -1)
    return ops.experts(x, w13, w2, weights, ids, activation=activation, num_valid=nv, backend=backend,
                       health=health, workspace=workspace, fp8=fp8, batch_invariant=batch_invariant,
                       ids_complete=True)


class MoE(nn.Module):
    """A Mixture-of-Experts layer that keeps the safemoe contract (see the module docstring).

    top_k: K, or a whole `RouteConfig`; with K, its options as keywords (scoring,
        renormalize, n_group, topk_group, routed_scaling_factor, group_score); `self.route_config` holds it.
    Parameters: `gate.weight` [E, H] (+ `gate.bias` [E] with router_bias), `w13` [E, 2I, H] (gate
    rows then up rows), `w2` [E, H, I]; with `expert_bias` the folded `w13` [E, 2I, Hf] / `w2`
    [E, Hf, I] and `w2_bias` [E, H]; with `shared_intermediate_size` a `shared_expert` (GatedMLP,
    or any module mapping [T, H] -> [T, H] assigned later) and with `shared_expert_gate` its
    sigmoid gate Linear(H, 1). After `quantize_(mode)`: float8_e4m3fn `w13` / `w2` and float32
    buffers `w13_scale` / `w2_scale` (see `safemoe.quantize_experts`).

    input_weighted: the routing weight scales the expert's input instead of its output (Llama 4:
        out = sum over k of expert_k(x * w_k), x * w_k rounded to x's dtype as the model does;
        for a gated MLP this differs from w_k * expert_k(x)). Runs the experts once per k.
    local_experts: how many experts this layer holds (expert parallelism: E / world size, see
        `safemoe.distributed.EPMoE`); None: all E.
    workspace: a `safemoe.Workspace` shared by every layer (scratch is allocated once); an fp8
        layer needs one made with `fp8=True`. None: each forward allocates its own.
    health: a `safemoe.Health` (or its int64 tensor) every op of this layer adds to.
    backend: "auto", "triton" or "reference" (see safemoe.route).
    batch_invariant: a valid row's output is bitwise the same whatever T, num_valid and the other
        rows hold (see the module docstring); needs the "triton" backend at forward, and a shared
        expert, if any, that is a `GatedMLP`. Costs speed: see the README.
    """

    # EPMoE's all-to-all experts path has no batch-invariant mode (yet).
    _supports_batch_invariant = True

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int | RouteConfig,
        *,
        activation: str = "silu",
        router_bias: bool = False,
        selection_bias: bool = False,
        router_logits_fp32: bool = False,
        expert_bias: bool = False,
        shared_intermediate_size: int | None = None,
        shared_expert_gate: bool = False,
        shared_activation: str = "silu",
        input_weighted: bool = False,
        local_experts: int | None = None,
        workspace: Workspace | None = None,
        health: Health | torch.Tensor | None = None,
        backend: str = "auto",
        batch_invariant: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        **route_options: Any,
    ) -> None:
        super().__init__()
        config = RouteConfig.of(top_k, route_options)
        if _checks.check_flag("batch_invariant", batch_invariant) and not self._supports_batch_invariant:
            raise ValueError(f"batch_invariant=True is not supported by {type(self).__name__}")
        self.batch_invariant = batch_invariant
        if activation not in _checks.ACTIVATIONS:
            raise ValueError(f"activation must be one of {_checks.ACTIVATIONS}, got {activation!r}")
        if shared_expert_gate and shared_intermediate_size is None:
            raise ValueError("shared_expert_gate=True needs a shared expert (shared_intermediate_size)")
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts
        self.route_config = config
        self.activation = activation
        self.expert_bias = expert_bias
        if input_weighted and expert_bias:
            raise ValueError("input_weighted=True with expert_bias=True: no model routes that way (Llama 4 "
                             "has no expert biases)")
        self.input_weighted = input_weighted
        self.backend = _checks.check_backend(backend)
        factory: dict[str, Any] = {"dtype": dtype, "device": device}
        self.gate = Gate(
            hidden_size,
            num_experts,
            config,
            bias=router_bias,
            selection_bias=selection_bias,
            logits_fp32=router_logits_fp32,
            backend=backend,
            batch_invariant=batch_invariant,
            **factory,
        )
        local = num_experts if local_experts is None else local_experts
        width = folded_hidden(hidden_size) if expert_bias else hidden_size
        self.w13 = nn.Parameter(torch.empty(local, 2 * intermediate_size, width, **factory))
        self.w2 = nn.Parameter(torch.empty(local, width, intermediate_size, **factory))
        self.w2_bias = nn.Parameter(torch.zeros(num_experts, hidden_size, **factory)) if expert_bias else None
        _init_normal(self.w13, self.w2)
        if expert_bias and self.w13.device.type != "meta":
            with torch.no_grad():
                self.w13[:, :, hidden_size:].zero_()
                self.w2[:, hidden_size:, :].zero_()
        # fp8 experts (quantize_ or a checkpoint's fp8 weights): the mode and the scale buffers.
        self.quant: str | None = None
        self._gate_up_split = False
        self.w13_scale: torch.Tensor | None
        self.w2_scale: torch.Tensor | None
        self.register_buffer("w13_scale", None)
        self.register_buffer("w2_scale", None)
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_intermediate_size is not None:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, shared_activation, **factory)
            if shared_expert_gate:
                self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False, **factory)
                _init_normal(self.shared_expert_gate.weight)
        self._workspace: Workspace | None = None
        self.set_workspace(workspace)
        self._health: torch.Tensor | None = None
        self.set_health(health)

    @property
    def top_k(self) -> int:
        return self.route_config.top_k

    # -- shared state -------------------------------------------------------------------------
    @property
    def workspace(self) -> Workspace | None:
        return self._workspace

    def set_workspace(self, workspace: Workspace | None) -> None:
        """Use `workspace` (shared by all layers) for the expert kernels' scratch; None: none."""
        if workspace is not None and not isinstance(workspace, Workspace):
            raise TypeError(f"workspace must be a safemoe.Workspace or None, got {type(workspace).__name__}")
        if workspace is not None and self.quant is not None and not workspace.fp8:
            raise ValueError(f"this MoE has fp8 experts ({self.quant}); its workspace needs fp8=True")
        self._workspace = workspace

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

    # -- expert weights -----------------------------------------------------------------------
    @property
    def w13_bias(self) -> torch.Tensor | None:
        """[E, 2I] view of the folded gate/up bias (column H of w13), or None."""
        if not self.expert_bias:
            return None
        if self.quant is not None:
            raise ValueError("fp8 experts hold their gate/up bias quantised (dequantise them)")
        return self.w13[:, :, self.hidden_size]

    def load_experts(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
    ) -> None:
        """Copy expert weights given in the plain layout (w13 [E, 2I, H], w2 [E, H, I]) in."""
        if self.quant is not None:
            raise ValueError("load_experts copies bf16/fp16/fp32 weights; this MoE holds fp8 experts")
        local, hidden, inter = self.w13.shape[0], self.hidden_size, self.intermediate_size
        for name, t, trailing in (("w13", w13, (2 * inter, hidden)), ("w2", w2, (hidden, inter))):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (local, *trailing):
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must be [{local}, {trailing[0]}, {trailing[1]}] (trailing dims "
                                 f"{trailing}), got {got}")
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

    def quantize_(self, mode: str = "per_tensor") -> MoE:
        """Convert the expert weights to fp8 (e4m3) in place: "per_tensor" or "block" (DeepSeek-V3
        128x128 blocks), as `safemoe.quantize_experts` does; forward then runs the fp8 kernels
        (activations quantised at run time). Needs bf16/fp16 activations. Returns self."""
        if mode not in QUANT_MODES:
            raise ValueError(f"mode must be one of {QUANT_MODES}, got {mode!r}")
        if self.quant is not None:
            raise ValueError(f"the experts are fp8 already ({self.quant})")
        if self.w13.dtype not in _checks.FP8_ACTIVATION_DTYPES:
            raise TypeError(
                f"fp8 experts need bfloat16 or float16 activations; this MoE is {self.w13.dtype} "
                "(build it with dtype=torch.bfloat16)"
            )
        if self._workspace is not None and not self._workspace.fp8:
            raise ValueError("the workspace has no fp8 buffers: set_workspace(Workspace(..., fp8=True))")
        w13, w2, w13_scale, w2_scale = quantize_experts(self.w13.detach(), self.w2.detach(), mode)
        self.set_fp8_experts(w13, w2, w13_scale, w2_scale)
        return self

    def set_fp8_experts(self, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                        w2_scale: torch.Tensor) -> None:
        """Hold float8_e4m3fn experts (this layer's shapes) with their scales, "weight_scale_inv"
        convention (dequantised = fp8 * scale); the scale shapes choose the mode (see
        `safemoe.experts`). The tensors are kept, not copied."""
        spec = _checks.check_fp8_weights(w13, w2, w13_scale, w2_scale)
        for name, new, old in (("w13", w13, self.w13), ("w2", w2, self.w2)):
            if new.shape != old.shape:
                raise ValueError(
                    f"{name} must have this layer's shape {tuple(old.shape)}, got {tuple(new.shape)}"
                )
        self.w13 = nn.Parameter(w13, requires_grad=False)
        self.w2 = nn.Parameter(w2, requires_grad=False)
        self.w13_scale, self.w2_scale = w13_scale, w2_scale  # registered buffers (None until now)
        self.quant, self._gate_up_split = spec.mode, spec.gate_up_split

    def _fp8(self) -> Fp8Weights | None:
        if self.quant is None:
            return None
        assert self.w13_scale is not None and self.w2_scale is not None
        return Fp8Weights(self.quant, self.w13_scale, self.w2_scale, self._gate_up_split)

    # -- forward ------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, num_valid: int | torch.Tensor | None = None) -> torch.Tensor:
        """x [..., H] -> [..., H]; rows (of the flattened x) at or past num_valid come out as zeros."""
        self._check_input(x)
        shape = x.shape
        x2 = x.reshape(-1, self.hidden_size)  # [T, H]
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        nv = _checks.check_num_valid(num_valid, x2.shape[0], x2.device)
        weights, ids = self.gate(x2, nv)  # [T, K] f32, [T, K] i32

        x_in = self._fold_input(x2) if self.expert_bias else x2
        if self.input_weighted:
            out = self._input_weighted_experts(x_in, weights, ids, nv)
        else:
            out = self._experts(x_in, weights, ids, nv)  # [T, H] (or [T, Hf] folded)
        if self.expert_bias:
            out = self._add_down_bias(out[:, : self.hidden_size], weights, ids)

        if self.shared_expert is not None:
            shared = self._shared(x2)  # [T, H], dense: padded rows hold whatever x held
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self._shared_gate(x2)) * shared
            if num_valid is not None:
                ops.zero_padding_(shared, nv)
            out = out + shared
        return out.view(shape)

    def _shared_gate(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's gate logit [T, 1]: its Linear, or with batch_invariant the same
        weights on the fixed-tile kernel."""
        gate = self.shared_expert_gate
        assert gate is not None
        if not self.batch_invariant:
            return gate(x)
        from safemoe.kernels.linear import linear_rows

        return linear_rows(x, gate.weight, gate.bias)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        assert self.shared_expert is not None
        if not self.batch_invariant:
            return self.shared_expert(x)
        if not isinstance(self.shared_expert, GatedMLP):
            raise TypeError(
                "batch_invariant=True computes the shared expert with safemoe's fixed-tile kernels, which "
                f"needs a safemoe GatedMLP, got {type(self.shared_expert).__name__}"
            )
        return self.shared_expert.forward_batch_invariant(x)

    def _check_input(self, x: object) -> None:
        """x must be a tensor [..., H] on the layer's device, in the dtype its weights compute in: a
        TypeError/ValueError naming x, rather than a matmul's RuntimeError from inside."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must end with H={self.hidden_size}, got shape {tuple(x.shape)}")
        device = self.gate.weight.device
        if x.device != device:
            raise ValueError(f"x must be on this layer's device {device}, got {x.device}")
        if self.quant is not None:  # fp8 experts: activations bf16/fp16, quantised per row at run time
            usable: tuple[torch.dtype, ...] = _checks.FP8_ACTIVATION_DTYPES
            # an fp32 gate (fp32 logits) says nothing of the activations: name bf16 then
            wanted = self.gate.weight.dtype if self.gate.weight.dtype in usable else usable[0]
            ok = x.dtype in usable and (self.gate.logits_fp32 or x.dtype == wanted)
        else:
            wanted = self.w13.dtype
            usable = _checks.FLOAT_DTYPES
            ok = x.dtype == wanted and (self.gate.logits_fp32 or x.dtype == self.gate.weight.dtype)
        if not ok:
            rebuild = f" or build the layer with dtype={x.dtype}" if x.dtype in usable else ""
            raise TypeError(
                f"x must have this layer's dtype {wanted} (its weights'), got {x.dtype}: convert it with "
                f"x.to({wanted}){rebuild}"
            )

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 nv: NumValid) -> torch.Tensor:
        """The routed experts of this layer's rows (ids in [0, E)); `EPMoE` runs them across ranks.
        The ids are this layer's gate's, every row written in this call (ids_complete)."""
        return ops.experts(x, self.w13, self.w2, weights, ids, activation=self.activation, num_valid=nv,
                           backend=_resolve(self.backend, x.device), health=self._health,
                           workspace=self._workspace, fp8=self._fp8(), batch_invariant=self.batch_invariant,
                           ids_complete=True)

    def _input_weighted_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                                nv: NumValid) -> torch.Tensor:
        """sum over k of expert_{ids[:, k]}(x * weights[:, k]): one experts call per k, each with
        weight 1 (padded rows: ids -1, never read; x * 0 there may be NaN, unread too)."""
        ones = torch.ones_like(weights[:, :1])
        out: torch.Tensor | None = None
        for k in range(weights.shape[1]):
            scaled = x * weights[:, k : k + 1].to(x.dtype)  # Llama 4 scales its input in the model dtype
            part = self._experts(scaled, ones, ids[:, k : k + 1].contiguous(), nv)
            out = part if out is None else out + part
        assert out is not None
        return out

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
        if self.batch_invariant:
            from safemoe.kernels.linear import linear_rows

            return (out.float() + linear_rows(coef, self.w2_bias.float().t())).to(out.dtype)
        return (out.float() + coef @ self.w2_bias.float()).to(out.dtype)

    def extra_repr(self) -> str:
        quant = f", quant={self.quant}" if self.quant else ""
        return (
            f"H={self.hidden_size}, I={self.intermediate_size}, E={self.num_experts}, K={self.top_k}, "
            f"activation={self.activation}, expert_bias={self.expert_bias}{quant}, backend={self.backend}"
            + (", batch_invariant=True" if self.batch_invariant else "")
        )
