"""Patch Hugging Face transformers (v5) MoE models to run their MoE blocks on safemoe.

    model = AutoModelForCausalLM.from_config(config)        # or from_pretrained(...)
    safemoe.integrations.transformers.patch(model)            # in place; returns the model
    safemoe.integrations.transformers.set_num_valid(model, n) # padded batches: rows >= n are padding

Supported blocks: each one's routing as its transformers modeling file computes it (5.17 and 5.23;
where they differ, both layouts), with safemoe's sanitising, total order and padding contract.
Routing kinds:
- softmax-topk: softmax over the E logits in fp32, top-k, renormalised when norm_topk_prob
  (always where the router has no such flag);
- topk-softmax: top-k of the logits, softmax over those k (= softmax over E, renormalised);
- deepseek: fp32 logits, sigmoid, + selection bias (e_score_correction_bias) for selection only,
  groups (a group scores the sum of its top two), renorm = norm_topk_prob, routed_scaling_factor.

| family | block class | routing | extras |
|---|---|---|---|
| Qwen3-MoE | `Qwen3MoeSparseMoeBlock` | softmax-topk | |
| Qwen2-MoE | `Qwen2MoeSparseMoeBlock` | softmax-topk | shared expert, sigmoid gate |
| Qwen3-Next | `Qwen3NextSparseMoeBlock` | softmax-topk | shared expert, sigmoid gate |
| Qwen3.5-MoE | `Qwen3_5MoeSparseMoeBlock` | softmax-topk (always renorm) | shared expert, sigmoid gate |
| Qwen3-VL-MoE | `Qwen3VLMoeTextSparseMoeBlock` | softmax-topk (always renorm) | |
| Qwen3-Omni | `Qwen3OmniMoeThinkerTextSparseMoeBlock` | softmax-topk | |
| Qwen3-Omni | `Qwen3OmniMoeTalkerTextSparseMoeBlock` | softmax-topk | shared expert, sigmoid gate |
| Mixtral | `MixtralSparseMoeBlock` | softmax-topk (always renorm) | |
| MiniMax-01 | `MiniMaxSparseMoeBlock` | softmax-topk (always renorm) | |
| OLMoE | `OlmoeSparseMoeBlock` | softmax-topk | |
| FlexOlmo | `FlexOlmoSparseMoeBlock` | softmax-topk | |
| Mellum | `MellumSparseMoeBlock` | softmax-topk | |
| Qwen4-Exp | `Qwen4ExpTextSparseMoeBlock` | softmax-topk | shared expert, sigmoid gate |
| Hunyuan-A13B | `HunYuanMoEV1Moe` | softmax-topk (always renorm; fp32 logits if `wg` is fp32) | shared MLP |
| ERNIE-4.5 | `Ernie4_5_MoeSparseMoeBlock` | softmax-topk, fp32 logits, selection bias (*) | shared experts |
| Jamba | `JambaSparseMoeBlock` | softmax-topk, no renorm | |
| DBRX | `DbrxFFN` | softmax-topk, renorm iff p-norm p = 1 (None: none) | experts copied |
| Granite-MoE | `GraniteMoeMoE`, `GraniteMoeSharedMoE` | topk-softmax | |
| Granite-4 | `GraniteMoeHybridMoE`, `GraniteMoeSWAMoE` | topk-softmax | |
| JetMoE | `JetMoeMoE` | topk-softmax | output bias |
| Aria | `AriaTextMoELayer` | topk-softmax | shared experts; experts copied |
| Cohere2-MoE | `Cohere2MoeSparseMoeBlock` | topk-softmax, or sigmoid (renorm flag) | shared, sum or average |
| DeepSeek-V3, Kimi-K2 | `DeepseekV3MoE` | deepseek | shared experts |
| DeepSeek-V3.2 | `DeepseekV32MoE` | deepseek | shared experts |
| GLM-4.5, 4.6, 4.7 | `Glm4MoeMoE` | deepseek | shared experts |
| GLM-4.7-Flash | `Glm4MoeLiteMoE` | deepseek | shared experts |
| GLM-4.5V | `Glm4vMoeTextMoE` | deepseek | shared experts |
| GLM-5 | `GlmMoeDsaMoE` | deepseek | shared experts |
| dots.llm1 | `Dots1MoE` | deepseek | shared experts |
| EXAONE-MoE | `ExaoneMoeSparseMoEBlock` | deepseek | shared experts |
| Kimi-Linear | `KimiLinearMoE` | deepseek | shared experts |
| Solar-Open | `SolarOpenMoE` | deepseek | shared experts |
| MiMo-V2-Flash | `MiMoV2FlashMoE` | deepseek | |
| Ling hybrid | `BailingHybridMoE` | deepseek | shared experts |
| dots3 | `Dots3NoteTextMoE` | deepseek | shared experts |
| Beam | `BeamMoE` | deepseek (scaling on the block output) | |
| Mistral-4 | `Mistral4MoE`, `MistralLarge4TextMoE` | softmax, groups, renorm, scaling (**) | shared experts |
| DeepSeek-V2 | `DeepseekV2Moe` | fp32 logits, softmax, [groups by max (**)], scaling | shared experts |
| DeepSeek-OCR-2 | `DeepseekOcr2TextMoe`, `UnlimitedOcrTextMoe` | as DeepSeek-V2 | shared experts |
| MiniMax-M2 | `MiniMaxM2SparseMoeBlock` | sigmoid + selection bias, renorm | |
| AFMoE | `AfmoeSparseMoeBlock` | sigmoid + selection bias, renorm, route_scale | shared experts |
| LFM2-MoE | `Lfm2MoeSparseMoeBlock` | sigmoid (+ selection bias), renorm (***), scaling | |
| HY-V3 | `HYV3MoE` | fp32 logits, sigmoid + selection bias, renorm, scaling | shared experts |
| MiniMax-M3 | `MiniMaxM3VLSparseMoeBlock` | sigmoid + selection bias, renorm, scaling | swigluoai, shared |
| Laguna | `LagunaSparseMoeBlock` | sigmoid + selection bias, renorm, scaling (no softcap) | shared experts |
| Flint | `FlintSparseMoeBlock` | fp32 logits, sigmoid, renorm = norm_topk_prob | shared expert |
| Llama 4 | `Llama4TextMoe` | sigmoid of the top-k logits, on the expert input (****) | shared expert |
| gpt-oss | `GptOssMLP` | router bias, topk-softmax | swigluoai, biases |

(*) ERNIE floors the renormalising sum at moe_norm_min (1e-12): different only when the k picked
probabilities sum below it. (**) The stock router masks dropped groups with 0.0, not -inf: the
same picks while the kept experts' probabilities are > 0. DeepSeek-V2's group_limited_greedy
scores a group by its best expert (`RouteConfig.group_score="max"`); its "greedy" is plain
top-k. (***) LFM2 divides by sum + 1e-6: its weights are within 1e-6 relative of safemoe's.
DeepSeek-style routers add 1e-20 to the sum (below fp32 resolution). (****) Llama 4 multiplies
the expert's input by the weight (`MoE(input_weighted=True)`: out = shared(x) + sum over k of
expert_k(x * w_k), in the model's dtype as the model does), which for a gated MLP is not the
output-weighted sum; top-1 in the released models, any k here. Selection on the sigmoid scores,
where the stock router and Cohere2's sigmoid mode compare the logits, differs only when logits
above ~16.6 saturate to 1.0 in fp32 (then the lower index wins). Everywhere, ties (exactly equal
scores) go to the lowest expert index, where torch.topk promises no order.

Not supported (patch raises, naming the class): Phi-3.5-MoE (`PhimoeSparseMoeBlock`: sparsemixer
routing, a second pick masked by a threshold relative to the first), NLLB-MoE and Switch
Transformers (capacity-limited routing that drops tokens, encoder-decoder), LongCat-Flash
(zero-computation identity experts), NemotronH (non-gated relu^2 experts and a latent
projection), Gemma-4 (router RMSNorm and per-expert output scales), Laguna with tanh softcapping
of the logits, Kolibri (selection bias on the logits, not the scores), AXK1 / AXK2 (a norm after
the block; groups masked with 0.0 under a signed bias), GLM-5-Next, HY-V4 and Step-3.7 (clamped
SwiGLU, on some layers in Step-3.7), Inkling (routed and shared weights normalised together in
log-sigmoid space, a learned global scale), Inkling-2 (softcapped SwiGLU), Muse-Spark (a logit
multiplier, projections and a norm around the experts), DeepSeek-V4 (hash routing, clamped SiLU
experts), Zaya (an MLP router), Doge (product-key experts), JetMoE's attention experts
(`JetMoeMoA`, not an MLP).

Weights: the router weight, `gate_up_proj` [E, 2I, H] (gate rows then up rows, exactly safemoe's
w13) and `down_proj` [E, H, I] (safemoe's w2) are reused as the same Parameter objects, no copy
(JetMoE's `input_linear` / `output_linear` too); shared experts are the model's own modules.
gpt-oss stores `gate_up_proj` transposed [E, H, 2I] with gate and up interleaved column by
column, and `down_proj` transposed: those are de-interleaved and transposed once, at patch time (a
copy of the expert weights; the original tensors are released with the old block), and the
gate/up bias is folded into w13 (see `safemoe.layer`). DBRX ([E * I, H] w1 / v1 / w2) and Aria
([E, H, 2I] / [E, I, H]) are likewise copied once into safemoe's layout.

fp8 checkpoints (a model loaded with transformers' `FineGrainedFP8Config`, e.g. DeepSeek-V3's or
Qwen3's FP8 releases): the experts module is transformers' `FP8Experts`, whose float8_e4m3fn
`gate_up_proj` / `down_proj` and float32 `*_scale_inv` (128x128 blocks, or one scale per expert and
projection) become the MoE's fp8 experts as they are (the same storage: no copy, no
dequantisation; `MoE.set_fp8_experts`), run on safemoe's fp8 kernels with activations quantised
per 1x128 group at run time (so `patch(workspace=)` needs `Workspace(..., fp8=True)`, and `quant=`
is refused). The gate/up scale rows: ceil(2I/128) (gate and up quantised as one matrix, what the
quantizer makes) or 2 * ceil(I/128) (apart, as checkpoints ship gate_proj / up_proj; transformers
can hold that only when I <= 64); when 64 < I % 128 both counts are equal and patch refuses rather
than guess. ue8m0 scales (float8_e8m0fnu, powers of two) are widened to float32 exactly (a copy of
the scales only). Refused, naming what: static activation scales, block sizes other than 128x128,
fp4 (int8) experts, biases, non-gated or clamped/softcapped experts, fp8 gate_up with a bf16
down_proj (the quantizer leaves a matrix unquantised when a side is not a multiple of 128; both
unquantised run safemoe's bf16 path). A router stored in fp8 (an `FP8Linear`, e.g. Hunyuan's
`gate.wg`) is dequantised once to fp32 (a copy of [E, H]) and computes fp32 logits. Shared experts
and their gates keep their own modules and forward (an `FP8Linear` runs transformers' fp8 kernel).

Padding: every patched block reads the model's shared `num_valid` (None, an int or a 0-dim device
tensor) set with `set_num_valid`; rows of the flattened [batch * seq] tokens at or past it are
padding (the MoE never reads them and writes zeros there). For a CUDA graph, set it once to the
graph's device scalar before capture.

Not carried over: `output_router_logits` (the router-logit recorder hooks the model's router
class, which is gone) and the second output of gpt-oss's and Llama 4's blocks (router scores or
logits, which their decoder layers discard) is None. Inference only: safemoe's ops have no backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from safemoe import _checks
from safemoe.fp8 import QUANT_MODES
from safemoe.health import Health
from safemoe.integrations.serving import track_real_tokens
from safemoe.layer import MoE, fold_expert_biases
from safemoe.numerics import FP8_BLOCK, SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT
from safemoe.route_config import RouteConfig
from safemoe.workspace import Workspace

# transformers' hidden_act names -> safemoe activations (the gated form: act(gate) * up).
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu"}
# The classes (and functions) transformers' ACT2FN gives for those names, across versions.
_ACTIVATION_CLASSES = {
    "SiLUActivation": "silu", "SiLU": "silu", "GELUTanh": "gelu", "PytorchGELUTanh": "gelu",
    "NewGELUActivation": "gelu",
}  # fmt: skip


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


def _activation(fn: Any, where: str, config: Any = None) -> str:
    """The safemoe activation of an expert activation `fn` (an ACT2FN module, F.silu, or None:
    then `config.hidden_act`, default silu). Raises ValueError for one safemoe has not got."""
    if fn is None:
        name = getattr(config, "hidden_act", "silu")
        if name not in _ACTIVATIONS:
            raise ValueError(
                f"{where}: hidden_act={name!r} has no safemoe activation (supported: {sorted(_ACTIVATIONS)})"
            )
        return _ACTIVATIONS[name]
    if fn is F.silu:
        return "silu"
    name = type(fn).__name__
    if name not in _ACTIVATION_CLASSES:
        raise ValueError(
            f"{where}: the expert activation {name} has no safemoe activation (supported: silu, gelu with "
            "the tanh approximation)"
        )
    return _ACTIVATION_CLASSES[name]


def _experts_activation(experts: Any, where: str, block: Any = None) -> str:
    fn = getattr(experts, "act_fn", None)
    config = getattr(experts, "config", None) or getattr(block, "config", None)
    return _activation(fn, where, config)


def _need(obj: Any, name: str, where: str) -> Any:
    """obj.name, or a ValueError saying this transformers version lays the block out otherwise."""
    value = getattr(obj, name, None)
    if value is None:
        raise ValueError(
            f"{where}: {type(obj).__name__} has no {name!r} (a layout of this block safemoe does not know)"
        )
    return value


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


def _fused_experts(experts: Any, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, 2I, H], w2 [E, H, I]) of the fused layout most v5 models share: `gate_up_proj`
    (gate rows, then up rows) and `down_proj`, as they are (no copy)."""
    return _need(experts, "gate_up_proj", where), _need(experts, "down_proj", where)


# -- fine-grained fp8 checkpoints (transformers' FineGrainedFP8Config: FP8Experts, FP8Linear) ----

Fp8Scales = tuple[torch.Tensor, torch.Tensor]  # (w13_scale, w2_scale), float32, weight_scale_inv


def _is_fp8_experts(experts: Any) -> bool:
    return any(c.__name__ == "FP8Experts" for c in type(experts).__mro__)


def _float32_scale(scale: Any, name: str, where: str) -> torch.Tensor:
    """A weight_scale_inv as float32: as it is, or ue8m0 (float8_e8m0fnu, powers of two) widened
    exactly (a copy of the scales only, [E, 2I/128, H/128]: small)."""
    if not isinstance(scale, torch.Tensor):
        raise ValueError(f"{where}: fp8 weights without their {name} tensor")
    if scale.dtype == torch.float32:
        return scale.detach()
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return scale.detach().float()
    raise ValueError(f"{where}: {name} of dtype {scale.dtype} (safemoe takes float32 or ue8m0 scales)")


def _expert_weights(experts: Any, where: str,
                    swigluoai: bool = False) -> tuple[torch.Tensor, torch.Tensor, Fp8Scales | None]:
    """(w13, w2, fp8 scales or None) of a fused experts module. transformers' FP8Experts (models
    loaded with FineGrainedFP8Config, e.g. DeepSeek-V3's and Qwen3's FP8 checkpoints): its e4m3
    `gate_up_proj` / `down_proj` and their `*_scale_inv` as they are (no copy, no dequantisation),
    128x128 blocks or one scale per expert and projection; the scales' row count says whether gate
    and up were quantised as one [2I, H] matrix (ceil(2I/128) rows) or as two (2 * ceil(I/128): a
    checkpoint shipping gate_proj and up_proj apart, which transformers can hold only when I <= 64).
    A layout safemoe's fp8 kernels cannot run raises ValueError naming it."""
    w13, w2 = _fused_experts(experts, where)
    if not _is_fp8_experts(experts):
        return w13, w2, None
    what = f"{where}: transformers' FP8Experts with"
    if not getattr(experts, "has_gate", True):
        raise ValueError(f"{what} non-gated experts (up_proj): safemoe's experts are gated")
    if getattr(experts, "has_bias", False):
        raise ValueError(f"{what} biases: safemoe's fp8 experts have none")
    scheme = getattr(experts, "activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"{what} activation_scheme={scheme!r}: safemoe quantises activations per "
                         "1x128 group at run time (dynamic) and has no static activation scales")
    for name in ("gate_softcap", "up_softcap"):
        if getattr(experts, name, None) is not None:
            raise ValueError(f"{what} {name}={getattr(experts, name)}: safemoe has no softcapped SwiGLU")
    if getattr(experts, "swiglu_alpha", None) is not None and not swigluoai:
        raise ValueError(f"{what} swiglu_alpha set (clamped SwiGLU) in a block whose experts safemoe runs "
                         "as a plain gated activation")
    if getattr(experts, "limit", None) is not None and getattr(experts, "swiglu_alpha", None) is None:
        raise ValueError(f"{what} limit={experts.limit} (clamped SiLU): safemoe has no clamped SiLU")
    fp8 = [t.dtype in _checks.FP8_WEIGHT_DTYPES for t in (w13, w2)]
    if not any(fp8) and w13.dtype in _checks.FLOAT_DTYPES and w2.dtype == w13.dtype:
        # transformers' quantizer leaves a matrix whose sides are not multiples of the block
        # unquantised, and FP8Experts then runs it as a plain matmul: so does safemoe.
        return w13, w2, None
    if not all(fp8):
        raise ValueError(
            f"{what} gate_up_proj {w13.dtype} and down_proj {w2.dtype}: safemoe's fp8 experts need both "
            "float8_e4m3fn (transformers' quantizer leaves a matrix unquantised when its sides are not "
            "multiples of the 128x128 block, e.g. down_proj when moe_intermediate_size % 128 != 0; int8 "
            "is packed fp4)"
        )
    s13 = _float32_scale(getattr(experts, "gate_up_proj_scale_inv", None), "gate_up_proj_scale_inv", where)
    s2 = _float32_scale(getattr(experts, "down_proj_scale_inv", None), "down_proj_scale_inv", where)
    block = getattr(experts, "block_size", None)
    if block is None:  # one scale per expert and projection: [E, 2, 1] (gate, up) and [E, 1, 1]
        s13 = s13.reshape(s13.shape[0], -1)
        s13 = s13.reshape(-1) if s13.shape[1] == 1 else s13
        s2 = s2.reshape(-1)
    elif tuple(block) != (FP8_BLOCK, FP8_BLOCK):
        raise ValueError(f"{what} block_size={tuple(block)}: safemoe's fp8 blocks are "
                         f"{FP8_BLOCK}x{FP8_BLOCK}")
    inter = w13.shape[1] // 2
    if block is not None and inter % FP8_BLOCK > FP8_BLOCK // 2:
        # ceil(2I/128) == 2 * ceil(I/128): the scale rows read two ways (one [2I, H] matrix, or gate
        # and up quantised apart), and nothing in the module says which (see docs/fp8.md, "Trap").
        raise ValueError(f"{what} moe_intermediate_size={inter} (64 < I % 128): its gate_up_proj_scale_inv "
                         "rows fit both gate and up quantised as one matrix and as two; safemoe cannot tell "
                         "which (re-quantise the experts, or pad I to a multiple of 128)")
    scales = (s13.contiguous(), s2.contiguous())
    try:
        spec = _checks.check_fp8_weights(w13, w2, *scales)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} weights safemoe cannot take: {exc}") from exc
    if (spec.mode == "block") != (block is not None):
        raise ValueError(f"{what} block_size={block} but scales of {spec.mode} shape "
                         f"{tuple(s13.shape)} / {tuple(s2.shape)}")
    return w13, w2, scales


def _dequantize_fp8_linear(weight: torch.Tensor, scale: Any, block: Any, where: str) -> torch.Tensor:
    """An fp8 [N, K] Linear weight (transformers' FP8Linear) -> float32: weight * weight_scale_inv,
    per tensor (block None or one scale) or per (bn, bk) block, partial edge blocks included."""
    scale = _float32_scale(scale, "weight_scale_inv", where)
    rows, cols = weight.shape
    with torch.no_grad():
        if block is None or scale.numel() == 1:
            return weight.float() * scale.reshape(())
        bn, bk = (int(b) for b in block)
        if tuple(scale.shape) != (-(-rows // bn), -(-cols // bk)):
            raise ValueError(f"{where}: router weight_scale_inv {tuple(scale.shape)} does not tile the "
                             f"[{rows}, {cols}] weight in {bn}x{bk} blocks")
        full = scale.repeat_interleave(bn, dim=0)[:rows].repeat_interleave(bk, dim=1)[:, :cols]
        return weight.float() * full


def _router_weight(router: Any, where: str) -> torch.Tensor:
    """The router's [E, H] weight; an fp8 one (the router quantised as an FP8Linear) dequantised
    once to float32 (a small copy): the gate then computes fp32 logits."""
    weight = _need(router, "weight", where)
    if weight.dtype not in _checks.FP8_WEIGHT_DTYPES:
        return weight  # type: ignore[no-any-return]
    return _dequantize_fp8_linear(weight, getattr(router, "weight_scale_inv", None),
                                  getattr(router, "block_size", None), f"{where} router")


def _make_moe(where: str, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              config: RouteConfig, activation: str, *, fp8: Fp8Scales | None = None,
              **layer_flags: Any) -> MoE:
    """A MoE holding `router_weight` [E, H], `w13` [E, 2I, H] and `w2` [E, H, I] (adopted: the
    same storage where they are contiguous). fp8: the scales of float8_e4m3fn w13 / w2 (the MoE
    runs safemoe's fp8 kernels on them, its gate in the router's dtype)."""
    num_experts, two_inter, hidden = w13.shape
    if tuple(w2.shape) != (num_experts, hidden, two_inter // 2) or two_inter % 2:
        raise ValueError(f"{where}: unexpected expert layout {tuple(w13.shape)=} {tuple(w2.shape)=}")
    if tuple(router_weight.shape) != (num_experts, hidden):
        raise ValueError(
            f"{where}: router weight {tuple(router_weight.shape)} does not match E={num_experts}, H={hidden}"
        )
    for name, t in (("router weight", router_weight), ("w13", w13), ("w2", w2)):
        if t.dtype in _checks.FP8_WEIGHT_DTYPES and (fp8 is None or name == "router weight"):
            raise ValueError(f"{where}: {name} is {t.dtype} in a layout safemoe takes no fp8 from (fp8 "
                             "checkpoints: transformers' FP8Experts in the fused gate_up_proj layout)")
    dtype = w13.dtype
    if fp8 is not None:  # the activations' dtype: the router's where it is bf16/fp16
        activations = _checks.FP8_ACTIVATION_DTYPES
        dtype = router_weight.dtype if router_weight.dtype in activations else torch.bfloat16
    if router_weight.dtype == torch.float32 and dtype != torch.float32:
        # A router kept in fp32 (_keep_in_fp32_modules) computes fp32 logits: the stock routers that
        # allow it cast the input up (an F.linear of mixed dtypes would fail).
        layer_flags["router_logits_fp32"] = True
    moe = MoE(hidden, two_inter // 2, num_experts, config, activation=activation, dtype=dtype,
              device="meta", **layer_flags)
    _adopt(moe.gate, "weight", router_weight)
    if fp8 is not None:
        moe.set_fp8_experts(w13.detach(), w2.detach(), *fp8)
    _adopt(moe, "w13", _contiguous(w13))
    _adopt(moe, "w2", _contiguous(w2))
    return moe


def _standard(block: Any, router: Any, config: RouteConfig, where: str, **layer_flags: Any) -> MoE:
    """A MoE over `block.experts` in the fused layout (fp8 or not) with `router.weight` as its gate."""
    w13, w2, fp8 = _expert_weights(block.experts, where)
    return _make_moe(where, _router_weight(router, where), w13, w2, config,
                     _experts_activation(block.experts, where, block), fp8=fp8, **layer_flags)


def _renormalize(router: Any) -> bool:
    """norm_topk_prob where the router has it; routers without it (Mixtral, Qwen3.5, Qwen3-VL)
    renormalise unconditionally."""
    return bool(getattr(router, "norm_topk_prob", True))


class _Scaled(nn.Module):
    """module(x) * factor (Cohere2-MoE's "average": (routed + shared) / 2)."""

    def __init__(self, module: nn.Module, factor: float) -> None:
        super().__init__()
        self.module, self.factor = module, factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x) * self.factor


class _RowBias(nn.Module):
    """The output bias [H] every row gets (JetMoE), as a "shared expert" so that padded rows
    stay zero (MoE zeroes its shared expert's padded rows)."""

    def __init__(self, bias: torch.Tensor) -> None:
        super().__init__()
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bias.to(x.dtype).expand_as(x).clone()


# -- softmax over E, top-k, optional renormalisation ---------------------------------------------


def _softmax_topk(block: Any, where: str) -> MoE:
    """Qwen2/3-MoE, Qwen3-Next, Qwen3.5, Qwen3-VL, Qwen3-Omni, OLMoE, FlexOlmo, Mixtral, MiniMax:
    softmax over E in fp32, top-k, renormalised (norm_topk_prob); a Qwen2-style shared expert
    with its sigmoid gate where the block has one."""
    router = block.gate
    moe = _standard(block, router, RouteConfig(int(router.top_k), renormalize=_renormalize(router)), where)
    shared = getattr(block, "shared_expert", None)
    if shared is not None:
        moe.shared_expert = shared
        moe.shared_expert_gate = getattr(block, "shared_expert_gate", None)
    return moe


def _hunyuan(block: Any, where: str) -> MoE:
    """Hunyuan-MoE: `gate.wg` (fp32 logits when wg is fp32), softmax, top-k, renormalised; a
    shared MLP on every token, ungated."""
    router = block.gate
    wg = _need(router, "wg", where)
    moe = _standard(block, wg, RouteConfig(int(router.top_k), renormalize=True), where,
                    router_logits_fp32=wg.weight.dtype == torch.float32)
    moe.shared_expert = _need(block, "shared_mlp", where)
    return moe


def _ernie(block: Any, where: str) -> MoE:
    """ERNIE-4.5-MoE: fp32 logits, softmax, selection bias (moe_statics.e_score_correction_bias,
    [1, E]), renormalised (stock floors the sum at moe_norm_min = 1e-12: it only differs when the
    K picked probabilities sum below that); optional shared experts."""
    router = block.gate
    bias = _need(_need(router, "moe_statics", where), "e_score_correction_bias", where)
    if bias.dim() != 2 or bias.shape[0] != 1:
        raise ValueError(f"{where}: e_score_correction_bias of shape {tuple(bias.shape)}; expected [1, E] "
                         "(one expert group)")
    moe = _standard(block, router, RouteConfig(int(router.top_k), renormalize=True), where,
                    selection_bias=True, router_logits_fp32=True)
    _adopt(moe.gate, "selection_bias", bias.view(-1))
    moe.shared_expert = getattr(block, "shared_experts", None)
    return moe


def _jamba(block: Any, where: str) -> MoE:
    """Jamba: softmax over E, top-k, not renormalised. transformers 5.17's router is an
    nn.Linear with top_k on the block; 5.23's a router module with its own top_k."""
    router = block.router
    top_k = int(getattr(router, "top_k", None) or _need(block, "top_k", where))
    return _standard(block, router, RouteConfig(top_k, renormalize=False), where)


def _dbrx(block: Any, where: str) -> MoE:
    """DBRX (DbrxFFN): softmax over E, top-k, divided by their p-norm (p =
    moe_normalize_expert_weights: 1 is renormalisation, None none; other p: unsupported). The
    experts are stored [E * I, H] (w1 gate, v1 up, w2 down transposed): copied once into w13/w2."""
    p = getattr(block, "moe_normalize_expert_weights", None)
    if p is not None and float(p) != 1.0:
        raise ValueError(f"{where}: moe_normalize_expert_weights={p}: safemoe renormalises with p=1 only")
    mlp = _need(block.experts, "mlp", where)
    w1, v1, w2 = _need(mlp, "w1", where), _need(mlp, "v1", where), _need(mlp, "w2", where)
    layer = _need(block.router, "layer", where)
    num_experts, hidden = layer.weight.shape
    inter = w1.shape[0] // num_experts
    with torch.no_grad():
        w13 = torch.cat([w1.view(num_experts, inter, hidden), v1.view(num_experts, inter, hidden)], dim=1)
        w2t = w2.view(num_experts, inter, hidden).transpose(1, 2).contiguous()  # [E, H, I]
    config = RouteConfig(int(_need(block, "top_k", where)), renormalize=p is not None)
    return _make_moe(where, layer.weight, w13, w2t, config,
                     _activation(getattr(mlp, "activation_fn", None), where))


# -- top-k of the logits, softmax over those k (== softmax over E, renormalised) -----------------


def _topk_softmax(block: Any, where: str) -> MoE:
    """GraniteMoe (and its Shared / Hybrid / SWA variants), JetMoE: top-k of the logits, softmax
    over those k logits, which is softmax over E renormalised over the k. Experts fused
    (`experts`) or, in JetMoE, as `input_linear` [E, 2I, H] / `output_linear` [E, H, I] plus an
    output bias [H] on every row."""
    router = block.router
    weight = _router_weight(router if getattr(router, "weight", None) is not None
                            else _need(router, "layer", where), where)
    config = RouteConfig(int(router.top_k), renormalize=True)
    if getattr(block, "experts", None) is not None:
        w13, w2, fp8 = _expert_weights(block.experts, where)
        return _make_moe(where, weight, w13, w2, config, _experts_activation(block.experts, where, block),
                         fp8=fp8)
    w13 = _need(_need(block, "input_linear", where), "weight", where)
    w2 = _need(_need(block, "output_linear", where), "weight", where)
    moe = _make_moe(where, weight, w13, w2, config, _activation(getattr(block, "activation", None), where))
    bias = getattr(block, "bias", None)
    if bias is not None:
        moe.shared_expert = _RowBias(bias)
    return moe


def _aria(block: Any, where: str) -> MoE:
    """Aria: top-k of the logits, softmax over them; experts stored [E, H, 2I] / [E, I, H] (5.23:
    `gate_up_proj` / `down_proj`; 5.17: `fc1.weight` / `fc2.weight`), transposed once (a copy);
    routed experts always SiLU; shared experts on every token."""
    router, experts = block.router, block.experts
    if getattr(experts, "gate_up_proj", None) is not None:
        gate_up, down = experts.gate_up_proj, experts.down_proj
        top_k = int(router.top_k)
    else:
        gate_up = _need(_need(experts, "fc1", where), "weight", where)
        down = _need(_need(experts, "fc2", where), "weight", where)
        top_k = int(_need(_need(experts, "config", where), "moe_topk", where))
    with torch.no_grad():
        w13 = gate_up.transpose(1, 2).contiguous()  # [E, 2I, H]
        w2 = down.transpose(1, 2).contiguous()  # [E, H, I]
    moe = _make_moe(where, router.weight, w13, w2, RouteConfig(top_k, renormalize=True), "silu")
    moe.shared_expert = _need(block, "shared_experts", where)
    return moe


def _cohere2(block: Any, where: str) -> MoE:
    """Cohere2-MoE: top-k of the logits, then softmax over those k (== renormalised softmax) or
    sigmoid of them (renormalised when norm_topk_prob); shared experts summed, or averaged with
    the routed output (both halved: exact in floating point)."""
    router = block.gate
    fn = getattr(router, "expert_selection_fn", "softmax")
    if fn not in ("softmax", "sigmoid"):
        raise ValueError(f"{where}: expert_selection_fn={fn!r} (softmax or sigmoid)")
    strategy = getattr(block, "shared_expert_combination_strategy", "sum")
    if strategy not in ("sum", "average"):
        raise ValueError(f"{where}: shared_expert_combination_strategy={strategy!r} (sum or average)")
    shared = getattr(block, "shared_experts", None) if getattr(block, "num_shared_experts", 0) > 0 else None
    half = strategy == "average" and shared is not None
    renormalize = fn == "softmax" or bool(getattr(router, "norm_topk_prob", False))
    config = RouteConfig(int(router.top_k), scoring=fn, renormalize=renormalize,
                         routed_scaling_factor=0.5 if half else 1.0)
    moe = _standard(block, router, config, where)
    if shared is not None:
        moe.shared_expert = _Scaled(shared, 0.5) if half else shared
    return moe


# -- sigmoid scoring, selection bias, groups, scaling --------------------------------------------


def _deepseek_v3(block: Any, where: str) -> MoE:
    """DeepSeek-V3 and the families sharing its router (Kimi-K2, GLM-4.5/4.6/4.7, GLM-4.5V,
    GLM-4.7-Flash, GLM-5, DeepSeek-V3.2, dots.llm1, dots3, EXAONE-MoE, Kimi-Linear, Ling/Bailing
    hybrid, Solar-Open, MiMo-V2-Flash, Beam): fp32 logits, sigmoid, selection bias, group-limited
    (sum of each group's top two), renormalised (norm_topk_prob), routed_scaling_factor (Beam's
    block scales its output by it: the same up to rounding); shared experts where the block has
    them."""
    router = block.gate
    scale = getattr(router, "routed_scaling_factor", None)  # Beam scales the block's output instead
    if scale is None:
        scale = _need(block, "routed_scaling_factor", where)
    config = RouteConfig(
        int(router.top_k),
        scoring="sigmoid",
        renormalize=bool(router.norm_topk_prob),
        n_group=int(router.num_group),
        topk_group=int(router.topk_group),
        routed_scaling_factor=float(scale),
    )
    moe = _standard(block, router, config, where, selection_bias=True, router_logits_fp32=True)
    _adopt(moe.gate, "selection_bias", _need(router, "e_score_correction_bias", where))
    moe.shared_expert = getattr(block, "shared_experts", None)
    return moe


def _deepseek_v2(block: Any, where: str) -> MoE:
    """DeepSeek-V2 (and DeepSeek-OCR-2's text model): fp32 logits, softmax over E, top-k, not
    renormalised, routed_scaling_factor. topk_method "greedy": plain top-k; "group_limited_greedy":
    a group scores its best expert (group_score="max"), the best topk_group groups kept (the
    stock router masks the others with 0.0: the same picks while the kept experts' probabilities
    are > 0); shared experts."""
    router = block.gate
    method = getattr(router, "topk_method", "greedy")
    if method == "greedy":
        groups: dict[str, Any] = {}
    elif method == "group_limited_greedy":
        groups = dict(n_group=int(router.num_group), topk_group=int(router.topk_group), group_score="max")
    else:
        raise ValueError(f"{where}: topk_method={method!r} (greedy or group_limited_greedy)")
    config = RouteConfig(int(router.top_k), renormalize=False,
                         routed_scaling_factor=float(router.routed_scaling_factor), **groups)
    moe = _standard(block, router, config, where, router_logits_fp32=True)
    moe.shared_expert = getattr(block, "shared_experts", None)
    return moe


def _mistral4(block: Any, where: str) -> MoE:
    """Mistral-4 / Mistral-Large-3 (4): softmax over E, group-limited (sum of each group's top
    two) with no bias, renormalised (norm_topk_prob; always in Large), routed_scaling_factor. The
    stock router masks dropped groups with 0.0 rather than -inf: the same picks, since the kept
    experts' probabilities are > 0 (unless one underflows to exactly 0). Large computes its
    logits in fp32."""
    router = block.gate
    config = RouteConfig(
        int(router.top_k),
        renormalize=_renormalize(router),
        n_group=int(router.num_group),
        topk_group=int(router.topk_group),
        routed_scaling_factor=float(router.routed_scaling_factor),
    )
    moe = _standard(block, router, config, where,
                    router_logits_fp32=type(block).__name__ == "MistralLarge4TextMoE")
    moe.shared_expert = getattr(block, "shared_experts", None)
    return moe


def _minimax_m2(block: Any, where: str) -> MoE:
    """MiniMax-M2: sigmoid (of logits in the router's dtype), selection bias on the block,
    renormalised."""
    moe = _standard(block, block.gate, RouteConfig(int(block.gate.top_k), scoring="sigmoid"), where,
                    selection_bias=True)
    _adopt(moe.gate, "selection_bias", _need(block, "e_score_correction_bias", where))
    return moe


def _afmoe(block: Any, where: str) -> MoE:
    """AFMoE (Arcee Trinity): sigmoid, selection bias (the block's expert_bias), renormalised,
    times route_scale; shared experts on every token."""
    router = block.router
    config = RouteConfig(int(router.top_k), scoring="sigmoid",
                         routed_scaling_factor=float(router.route_scale))
    moe = _standard(block, _need(router, "gate", where), config, where, selection_bias=True)
    _adopt(moe.gate, "selection_bias", _need(block, "expert_bias", where))
    moe.shared_expert = _need(block, "shared_experts", where)
    return moe


def _flint(block: Any, where: str) -> MoE:
    """Flint: fp32 logits, sigmoid, top-k, renormalised when norm_topk_prob; an ungated shared
    expert."""
    router = block.gate
    config = RouteConfig(int(router.top_k), scoring="sigmoid", renormalize=_renormalize(router))
    moe = _standard(block, router, config, where, router_logits_fp32=True)
    moe.shared_expert = _need(block, "shared_expert", where)
    return moe


def _sigmoid_biased_scaled(block: Any, where: str) -> MoE:
    """HY-V3, MiniMax-M3 and Laguna: sigmoid + selection bias, renormalised, times a scale (HY-V3's
    router_scaling_factor in the router; the others' routed_scaling_factor on the block's routed
    output: the same up to rounding); shared experts. HY-V3 computes its logits in fp32 (its fp32
    combine of routed and shared outputs rounds the same as adding them in bf16/fp16);
    MiniMax-M3's experts are gpt-oss's clamped SwiGLU (swigluoai) in the plain gate/up layout.
    Laguna's optional tanh softcapping of the logits is not supported (0, its default, is)."""
    router, experts = block.gate, block.experts
    softcap = float(getattr(router, "router_logit_softcapping", 0.0) or 0.0)
    if softcap > 0.0:
        raise ValueError(f"{where}: router_logit_softcapping={softcap}: safemoe has no logit softcapping")
    bias = getattr(block, "e_score_correction_bias", None)
    if bias is None:
        bias = _need(router, "e_score_correction_bias", where)
    scale = getattr(router, "router_scaling_factor", None)
    if scale is None:
        scale = _need(block, "routed_scaling_factor", where)
    config = RouteConfig(int(router.top_k), scoring="sigmoid", routed_scaling_factor=float(scale))
    if getattr(experts, "swiglu_alpha", None) is not None:
        alpha, limit = float(experts.swiglu_alpha), float(experts.swiglu_limit)
        if (alpha, limit) != (SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT):
            raise ValueError(
                f"{where}: safemoe's swigluoai uses alpha={SWIGLUOAI_ALPHA}, limit={SWIGLUOAI_LIMIT}; "
                f"this model has alpha={alpha}, limit={limit}"
            )
        activation = "swigluoai"
    else:
        activation = _experts_activation(experts, where, block)
    w13, w2, fp8 = _expert_weights(experts, where, swigluoai=activation == "swigluoai")
    moe = _make_moe(where, _router_weight(router, where), w13, w2, config, activation, fp8=fp8,
                    selection_bias=True, router_logits_fp32=type(block).__name__ == "HYV3MoE")
    _adopt(moe.gate, "selection_bias", bias)
    moe.shared_expert = _need(block, "shared_experts", where)
    return moe


def _lfm2_moe(block: Any, where: str) -> MoE:
    """LFM2-MoE: sigmoid (of logits in the model's dtype), optional selection bias (the block's
    expert_bias, when use_expert_bias), renormalised (norm_topk_prob), routed_scaling_factor. The
    stock router divides by (sum + 1e-6): its weights are smaller by a factor sum / (sum + 1e-6),
    i.e. within 1e-6 relative of safemoe's (below bf16 rounding)."""
    router = block.gate
    use_bias = bool(getattr(router, "use_expert_bias", False))
    config = RouteConfig(int(router.top_k), scoring="sigmoid", renormalize=bool(router.norm_topk_prob),
                         routed_scaling_factor=float(getattr(router, "routed_scaling_factor", 1.0)))
    moe = _standard(block, router, config, where, selection_bias=use_bias)
    if use_bias:
        _adopt(moe.gate, "selection_bias", _need(block, "expert_bias", where))
    return moe


def _llama4(block: Any, where: str) -> MoE:
    """Llama 4 (Llama4TextMoe): top-k of the logits, each picked expert's weight sigmoid(logit)
    (not renormalised), applied to the expert's INPUT: out = shared(x) + sum over k of
    expert_k(x * w_k) (MoE input_weighted; the stock block runs every expert on x * 0 for the
    others, which gives 0: its experts are bias-free gated MLPs). Experts are stored [E, H, 2I] /
    [E, I, H]: transposed once (a copy). Selection is on the sigmoid scores, where the stock router
    compares logits: they differ only when two logits above ~16.6 both saturate to 1.0 in fp32
    (then the lower index wins)."""
    router, experts = block.router, block.experts
    with torch.no_grad():
        w13 = _need(experts, "gate_up_proj", where).transpose(1, 2).contiguous()  # [E, 2I, H]
        w2 = _need(experts, "down_proj", where).transpose(1, 2).contiguous()  # [E, H, I]
    if getattr(router, "bias", None) is not None:
        raise ValueError(f"{where}: a router with a bias (Llama 4's has none)")
    config = RouteConfig(int(router.top_k), scoring="sigmoid", renormalize=False)
    moe = _make_moe(where, router.weight, w13, w2, config, _experts_activation(experts, where, block),
                    input_weighted=True)
    moe.shared_expert = _need(block, "shared_expert", where)
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
    "Qwen3MoeSparseMoeBlock": (_softmax_topk, False),
    "Qwen2MoeSparseMoeBlock": (_softmax_topk, False),
    "Qwen3NextSparseMoeBlock": (_softmax_topk, False),
    "Qwen3_5MoeSparseMoeBlock": (_softmax_topk, False),
    "Qwen3VLMoeTextSparseMoeBlock": (_softmax_topk, False),
    "Qwen3OmniMoeThinkerTextSparseMoeBlock": (_softmax_topk, False),
    "Qwen3OmniMoeTalkerTextSparseMoeBlock": (_softmax_topk, False),
    "Qwen4ExpTextSparseMoeBlock": (_softmax_topk, False),
    "MellumSparseMoeBlock": (_softmax_topk, False),
    "MixtralSparseMoeBlock": (_softmax_topk, False),
    "MiniMaxSparseMoeBlock": (_softmax_topk, False),
    "OlmoeSparseMoeBlock": (_softmax_topk, False),
    "FlexOlmoSparseMoeBlock": (_softmax_topk, False),
    "HunYuanMoEV1Moe": (_hunyuan, False),
    "Ernie4_5_MoeSparseMoeBlock": (_ernie, False),
    "JambaSparseMoeBlock": (_jamba, False),
    "DbrxFFN": (_dbrx, False),
    "GraniteMoeMoE": (_topk_softmax, False),
    "GraniteMoeSharedMoE": (_topk_softmax, False),
    "GraniteMoeHybridMoE": (_topk_softmax, False),
    "GraniteMoeSWAMoE": (_topk_softmax, False),
    "JetMoeMoE": (_topk_softmax, False),
    "AriaTextMoELayer": (_aria, False),
    "Cohere2MoeSparseMoeBlock": (_cohere2, False),
    "DeepseekV3MoE": (_deepseek_v3, False),
    "DeepseekV32MoE": (_deepseek_v3, False),
    "Glm4MoeMoE": (_deepseek_v3, False),
    "Glm4MoeLiteMoE": (_deepseek_v3, False),
    "Glm4vMoeTextMoE": (_deepseek_v3, False),
    "GlmMoeDsaMoE": (_deepseek_v3, False),
    "Dots1MoE": (_deepseek_v3, False),
    "ExaoneMoeSparseMoEBlock": (_deepseek_v3, False),
    "KimiLinearMoE": (_deepseek_v3, False),
    "SolarOpenMoE": (_deepseek_v3, False),
    "MiMoV2FlashMoE": (_deepseek_v3, False),
    "BailingHybridMoE": (_deepseek_v3, False),
    "Dots3NoteTextMoE": (_deepseek_v3, False),
    "BeamMoE": (_deepseek_v3, False),
    "DeepseekV2Moe": (_deepseek_v2, False),
    "DeepseekOcr2TextMoe": (_deepseek_v2, False),
    "UnlimitedOcrTextMoe": (_deepseek_v2, False),
    "Mistral4MoE": (_mistral4, False),
    "MistralLarge4TextMoE": (_mistral4, False),
    "MiniMaxM2SparseMoeBlock": (_minimax_m2, False),
    "AfmoeSparseMoeBlock": (_afmoe, False),
    "Lfm2MoeSparseMoeBlock": (_lfm2_moe, False),
    "FlintSparseMoeBlock": (_flint, False),
    "HYV3MoE": (_sigmoid_biased_scaled, False),
    "MiniMaxM3VLSparseMoeBlock": (_sigmoid_biased_scaled, False),
    "LagunaSparseMoeBlock": (_sigmoid_biased_scaled, False),
    "Llama4TextMoe": (_llama4, True),
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
    must be bf16 or fp16. An fp8 checkpoint's experts (transformers' FP8Experts) run on the fp8
    kernels with their own weights and scales (see the module docstring); quant must be None.
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
        if quant is not None and moe.quant is not None:
            raise ValueError(f"{cls} at {name}: quant={quant!r}, but its experts are fp8 already (an fp8 "
                             f"checkpoint, {moe.quant} scales): patch it without quant")
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
