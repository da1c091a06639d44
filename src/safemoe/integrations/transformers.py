"""Patch Hugging Face transformers (v5) MoE models to run their MoE blocks on safemoe.

    model = AutoModelForCausalLM.from_config(config)        # or from_pretrained(...)
    safemoe.integrations.transformers.patch(model)            # in place; returns the model
    safemoe.integrations.transformers.set_num_valid(model, n) # padded batches: rows >= n are padding

Supported blocks (transformers 5.17 and 5.23 store experts fused the same way):

| family | block class | routing | extras |
|---|---|---|---|
| Qwen3-MoE | `Qwen3MoeSparseMoeBlock` | softmax, renormalize = norm_topk_prob | |
| Qwen2-MoE | `Qwen2MoeSparseMoeBlock` | softmax, renormalize = norm_topk_prob | shared expert + gate |
| Mixtral | `MixtralSparseMoeBlock` | softmax, renormalize | |
| OLMoE | `OlmoeSparseMoeBlock` | softmax, renormalize = norm_topk_prob | |
| DeepSeek-V3 | `DeepseekV3MoE` | sigmoid + selection bias, groups, scaling, fp32 logits | shared experts |
| gpt-oss | `GptOssMLP` | router bias, softmax of the top-k logits (renormalized) | swigluoai, biases |

Weights: the router weight, `gate_up_proj` [E, 2I, H] (gate rows then up rows, exactly safemoe's
w13) and `down_proj` [E, H, I] (safemoe's w2) are reused as the same Parameter objects, no copy;
shared experts are the model's own modules. gpt-oss stores `gate_up_proj` transposed
[E, H, 2I] with gate and up interleaved column by column, and `down_proj` transposed: those are
de-interleaved and transposed once, at patch time (a copy of the expert weights; the original
tensors are released with the old block), and the gate/up bias is folded into w13 (see
`safemoe.layer`).

Padding: every patched block reads the model's shared `num_valid` (None, an int or a 0-dim device
tensor) set with `set_num_valid`; rows of the flattened [batch * seq] tokens at or past it are
padding (the MoE never reads them and writes zeros there). For a CUDA graph, set it once to the
graph's device scalar before capture.

Not carried over: `output_router_logits` (the router-logit recorder hooks the model's router
class, which is gone) and gpt-oss's second output (router scores, which its decoder layer discards)
is None. Inference only: safemoe's ops have no backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from safemoe import _checks
from safemoe.fp8 import QUANT_MODES
from safemoe.health import Health
from safemoe.integrations.serving import track_real_tokens
from safemoe.layer import MoE, fold_expert_biases
from safemoe.numerics import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT
from safemoe.route_config import RouteConfig
from safemoe.workspace import Workspace

# transformers' hidden_act names -> safemoe activations (the gated form: act(gate) * up).
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu"}


@dataclass
class PaddingState:
    """The real-token count every patched block of one model reads (None: no padding)."""

    num_valid: int | torch.Tensor | None = None


class SafeMoEBlock(nn.Module):
    """Stands where the model's MoE block stood: same input, same output, safemoe inside.

    moe: the `safemoe.MoE` holding (the model's) weights. state: shared by all blocks of a model.
    source_class: the class name it replaced. returns_pair: gpt-oss's block returns a pair.
    """

    def __init__(self, moe: MoE, state: PaddingState, source_class: str, returns_pair: bool = False) -> None:
        super().__init__()
        self.moe = moe
        self.state = state
        self.source_class = source_class
        self.returns_pair = returns_pair

    def forward(self, hidden_states: torch.Tensor) -> Any:
        out = self.moe(hidden_states, num_valid=self.state.num_valid)
        return (out, None) if self.returns_pair else out

    def extra_repr(self) -> str:
        return f"replaces={self.source_class}"


def _activation(module: Any, where: str) -> str:
    config = getattr(module, "config", None)
    name = getattr(config, "hidden_act", "silu")
    if name not in _ACTIVATIONS:
        raise ValueError(
            f"{where}: hidden_act={name!r} has no safemoe activation (supported: {sorted(_ACTIVATIONS)})"
        )
    return _ACTIVATIONS[name]


def _adopt(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Make `tensor` the module's parameter/buffer `name` (the same storage, no copy)."""
    if name in module._buffers:
        module._buffers[name] = tensor
        return
    if not isinstance(tensor, nn.Parameter):
        tensor = nn.Parameter(tensor, requires_grad=False)
    module._parameters[name] = tensor


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else nn.Parameter(t.detach().contiguous(), requires_grad=False)


def _build_standard(block: Any, router: Any, experts: Any, config: RouteConfig, *, where: str,
                    **layer_flags: Any) -> MoE:
    """A MoE over the fused [E, 2I, H] / [E, H, I] experts most v5 models share."""
    w13, w2 = experts.gate_up_proj, experts.down_proj
    num_experts, two_inter, hidden = w13.shape
    if tuple(w2.shape) != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"{where}: unexpected expert layout {tuple(w13.shape)=} {tuple(w2.shape)=}")
    moe = MoE(
        hidden,
        two_inter // 2,
        num_experts,
        config,
        activation=_activation(experts, where),
        dtype=w13.dtype,
        device="meta",
        **layer_flags,
    )
    _adopt(moe.gate, "weight", router.weight)
    _adopt(moe, "w13", _contiguous(w13))
    _adopt(moe, "w2", _contiguous(w2))
    return moe


def _qwen3(block: Any, where: str) -> MoE:
    config = RouteConfig(int(block.gate.top_k), renormalize=bool(block.gate.norm_topk_prob))
    return _build_standard(block, block.gate, block.experts, config, where=where)


def _olmoe(block: Any, where: str) -> MoE:
    return _qwen3(block, where)


def _mixtral(block: Any, where: str) -> MoE:
    config = RouteConfig(int(block.gate.top_k), renormalize=True)
    return _build_standard(block, block.gate, block.experts, config, where=where)


def _qwen2(block: Any, where: str) -> MoE:
    moe = _qwen3(block, where)
    moe.shared_expert = block.shared_expert
    moe.shared_expert_gate = block.shared_expert_gate
    return moe


def _deepseek_v3(block: Any, where: str) -> MoE:
    router = block.gate
    config = RouteConfig(
        int(router.top_k),
        scoring="sigmoid",
        renormalize=bool(router.norm_topk_prob),
        n_group=int(router.num_group),
        topk_group=int(router.topk_group),
        routed_scaling_factor=float(router.routed_scaling_factor),
    )
    moe = _build_standard(
        block, router, block.experts, config, where=where, selection_bias=True, router_logits_fp32=True
    )
    _adopt(moe.gate, "selection_bias", router.e_score_correction_bias)
    moe.shared_expert = block.shared_experts
    return moe


def _gpt_oss(block: Any, where: str) -> MoE:
    router, experts = block.router, block.experts
    alpha, limit = (
        float(getattr(experts, "alpha", SWIGLUOAI_ALPHA)),
        float(getattr(experts, "limit", SWIGLUOAI_LIMIT)),
    )
    if (alpha, limit) != (SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT):
        raise ValueError(
            f"{where}: safemoe's swigluoai uses alpha={SWIGLUOAI_ALPHA}, limit={SWIGLUOAI_LIMIT}; "
            f"this model has alpha={alpha}, limit={limit}"
        )
    gate_up = experts.gate_up_proj  # [E, H, 2I], gate and up interleaved by column
    num_experts, hidden, two_inter = gate_up.shape
    with torch.no_grad():
        # De-interleave once: gate columns 0, 2, 4, ... then up columns 1, 3, 5, ...
        w13 = torch.cat([gate_up[:, :, 0::2], gate_up[:, :, 1::2]], dim=2).transpose(1, 2)  # [E, 2I, H]
        b13 = torch.cat([experts.gate_up_proj_bias[:, 0::2], experts.gate_up_proj_bias[:, 1::2]], dim=1)
        w2 = experts.down_proj.transpose(1, 2)  # [E, I, H] -> [E, H, I]
        w13f, w2f = fold_expert_biases(w13, b13, w2)
    moe = MoE(
        hidden,
        two_inter // 2,
        num_experts,
        # softmax over the top-k logits == full softmax renormalized over top-k
        RouteConfig(int(router.top_k), scoring="softmax", renormalize=True),
        activation="swigluoai",
        router_bias=True,
        expert_bias=True,
        dtype=gate_up.dtype,
        device="meta",
    )
    _adopt(moe.gate, "weight", router.weight)
    _adopt(moe.gate, "bias", router.bias)
    _adopt(moe, "w13", w13f)
    _adopt(moe, "w2", w2f)
    _adopt(moe, "w2_bias", experts.down_proj_bias)
    return moe


# block class name -> (builder, returns a (hidden, scores) pair)
_BUILDERS = {
    "Qwen3MoeSparseMoeBlock": (_qwen3, False),
    "Qwen2MoeSparseMoeBlock": (_qwen2, False),
    "MixtralSparseMoeBlock": (_mixtral, False),
    "OlmoeSparseMoeBlock": (_olmoe, False),
    "DeepseekV3MoE": (_deepseek_v3, False),
    "GptOssMLP": (_gpt_oss, True),
}

SUPPORTED_BLOCKS = tuple(_BUILDERS)


def _looks_like_moe(module: nn.Module) -> bool:
    children = dict(module.named_children())
    return "experts" in children and ("gate" in children or "router" in children)


def _parent_and_attr(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, attr = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), attr


def patch(
    model: nn.Module,
    *,
    backend: str = "auto",
    workspace: Workspace | None = None,
    health: Health | torch.Tensor | None = None,
    quant: str | None = None,
) -> nn.Module:
    """Replace every supported MoE block of `model` by a `SafeMoEBlock`, in place; returns `model`.

    backend: "auto", "triton" or "reference" for every block. workspace: one `safemoe.Workspace`
    shared by all blocks (with `fp8=True` when quant is set). health: one `safemoe.Health` (or
    tensor) all blocks add to. quant: None (the model's dtype), "per_tensor" or "block": each
    block's experts are quantised to fp8 (`MoE.quantize_`) and run on the fp8 kernels; the model
    must be bf16 or fp16.
    Raises ValueError naming the class when the model has an MoE block safemoe does not support,
    or no MoE block at all.
    """
    backend = _checks.check_backend(backend)
    if quant is not None and quant not in QUANT_MODES:
        raise ValueError(f"quant must be None or one of {QUANT_MODES}, got {quant!r}")
    if workspace is not None and not isinstance(workspace, Workspace):
        raise TypeError(f"workspace must be a safemoe.Workspace or None, got {type(workspace).__name__}")
    if quant is not None and workspace is not None and not workspace.fp8:
        raise ValueError(f"quant={quant!r} needs a workspace made with fp8=True, got {workspace!r}")
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, SafeMoEBlock):
            continue
        cls = type(module).__name__
        if cls in _BUILDERS:
            found.append((name, module))
        elif _looks_like_moe(module) and not any(name.startswith(f + ".") for f, _ in found):
            raise ValueError(
                f"safemoe cannot patch {cls} (at {name or 'the model'}): supported MoE blocks are "
                f"{', '.join(SUPPORTED_BLOCKS)}"
            )
    already = any(isinstance(m, SafeMoEBlock) for m in model.modules())
    if not found and not already:
        raise ValueError(
            f"{type(model).__name__} has no MoE block safemoe can patch "
            f"(looked for {', '.join(SUPPORTED_BLOCKS)})"
        )
    state = getattr(model, "_safemoe_state", None)
    if state is None:
        state = PaddingState()
        model._safemoe_state = state  # type: ignore[assignment]
    for name, block in found:
        cls = type(block).__name__
        builder, returns_pair = _BUILDERS[cls]
        moe = builder(block, f"{cls} at {name}")
        moe.backend = moe.gate.backend = backend
        if quant is not None:
            moe.quantize_(quant)
        moe.set_workspace(workspace)
        moe.set_health(health)
        parent, attr = _parent_and_attr(model, name)
        setattr(parent, attr, SafeMoEBlock(moe, state, cls, returns_pair))
    track_real_tokens(model)  # serving engines' real-token count -> num_valid (see serving.py)
    return model


def set_num_valid(model: nn.Module, num_valid: int | torch.Tensor | None) -> None:
    """Tell every patched block of `model` how many leading tokens are real (None: all)."""
    state = getattr(model, "_safemoe_state", None)
    if state is None:
        raise ValueError(f"{type(model).__name__} is not patched by safemoe (call patch(model) first)")
    state.num_valid = num_valid


def patched_blocks(model: nn.Module) -> list[SafeMoEBlock]:
    return [m for m in model.modules() if isinstance(m, SafeMoEBlock)]


from safemoe.integrations import hf_experts as hf_experts  # noqa: E402  registers experts_implementation="safemoe"
