"""safemoe.integrations.transformers.patch on tiny random models of every supported family.

fp32 on CPU, tight tolerance: the full model's logits and each MoE block's output match the
unpatched model; with NaN-poisoned padding rows the real rows still match and padded MoE rows are
exact zeros. Inputs are random and finite (HF routers treat NaN and ties their own way). On a GPU
the same families in bf16 on the Triton backend (test_patched_models_bf16).
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

import safemoe
from helpers import assert_close, assert_equal

transformers = pytest.importorskip("transformers")

from safemoe.health import Health  # noqa: E402
from safemoe.integrations.transformers import (  # noqa: E402
    SUPPORTED_BLOCKS,
    SafeMoEBlock,
    patch,
    patched_blocks,
    set_num_valid,
)

# Applied to a family's config where the config has the field (tiny: hidden 32, 2 layers, 8 experts,
# top-2, groups of 2 where the family has groups).
TINY = dict(
    vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
    shared_expert_intermediate_size=24, shared_experts_intermediate_size=24, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    num_experts=8, num_local_experts=8, n_routed_experts=8, moe_num_experts=8, num_experts_per_tok=2,
    moe_k=2, moe_topk=2, n_group=4, topk_group=2, first_k_dense_replace=0, num_dense_layers=0,
    decoder_sparse_step=1, mlp_only_layers=[], q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=8, n_shared_experts=1, routed_scaling_factor=2.5, pad_token_id=0,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip
_LINEAR = dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
               linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)  # fmt: skip
_MROPE = dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1]))


def _dbrx_rope(config):
    """transformers 5.23's DBRX attention reads attn_config.rope_theta, which its config lacks."""
    config.attn_config.rope_theta = 10000.0


@dataclass(frozen=True)
class Family:
    """How to build one family tiny: its config and model classes (by name; the family is skipped
    where the installed transformers lacks them), fields beyond TINY, a fix-up of the built
    config, and whether the model takes inputs_embeds only (Qwen3-Omni's talker)."""

    config: str
    model: str
    fields: dict = field(default_factory=dict)
    post: Callable | None = None
    embeds: bool = False
    module: str | None = None  # transformers.models.<module> when the classes are not exported


SPECS: dict[str, Family] = {
    # softmax over E, top-k (renormalised or not), Qwen2-style shared expert with a sigmoid gate
    "qwen3_moe": Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(norm_topk_prob=True)),
    "qwen2_moe": Family("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_next": Family("Qwen3NextConfig", "Qwen3NextForCausalLM", _LINEAR),
    "qwen3_5_moe": Family("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", _LINEAR),
    "qwen3_vl_moe": Family("Qwen3VLMoeTextConfig", "Qwen3VLMoeTextModel"),
    "qwen3_omni_thinker": Family("Qwen3OmniMoeTextConfig", "Qwen3OmniMoeThinkerTextModel", _MROPE,
                                 module="qwen3_omni_moe"),
    "qwen3_omni_talker": Family("Qwen3OmniMoeTalkerTextConfig", "Qwen3OmniMoeTalkerModel",
                                dict(_MROPE, shared_expert_intermediate_size=24), embeds=True,
                                module="qwen3_omni_moe"),
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=16)),
    "minimax": Family("MiniMaxConfig", "MiniMaxForCausalLM",
                      dict(layer_types=["linear_attention", "full_attention"])),
    "olmoe": Family("OlmoeConfig", "OlmoeForCausalLM", dict(intermediate_size=16)),
    "flex_olmo": Family("FlexOlmoConfig", "FlexOlmoForCausalLM"),
    "mellum": Family("MellumConfig", "MellumForCausalLM", dict(mlp_layer_types=["sparse", "sparse"],
                                                               layer_types=["full_attention"] * 2)),
    "qwen4_exp": Family("Qwen4ExpTextConfig", "Qwen4ExpTextModel", dict(
        _LINEAR, layer_types=["linear_attention", "indexed_attention"], indexer_budget=16,
        indexer_compress_ratio=4, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16)),
    "hunyuan_v1_moe": Family("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM"),
    "ernie4_5_moe": Family("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
                           dict(moe_layer_start_index=0, moe_num_shared_experts=1)),
    "jamba": Family("JambaConfig", "JambaForCausalLM", dict(attn_layer_period=2, attn_layer_offset=1,
                                                            expert_layer_period=1, expert_layer_offset=0)),
    "dbrx": Family("DbrxConfig", "DbrxForCausalLM", dict(
        d_model=32, n_heads=4, n_layers=2, max_seq_len=64, attn_config=dict(kv_n_heads=2, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=16, moe_num_experts=8, moe_top_k=2)), post=_dbrx_rope),
    # top-k of the logits, softmax over those k
    "granitemoe": Family("GraniteMoeConfig", "GraniteMoeForCausalLM"),
    "granitemoeshared": Family("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM",
                               dict(shared_intermediate_size=24)),
    "granitemoehybrid": Family("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        layer_types=["mamba", "attention"], shared_intermediate_size=24, mamba_n_heads=4, mamba_d_head=16,
        mamba_d_state=8, mamba_n_groups=1)),
    "granitemoe_swa": Family("GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM"),
    "jetmoe": Family("JetMoeConfig", "JetMoeForCausalLM", dict(kv_channels=8)),
    "aria": Family("AriaTextConfig", "AriaTextForCausalLM"),
    "cohere2_moe": Family("Cohere2MoeConfig", "Cohere2MoeForCausalLM",
                          dict(num_shared_experts=1, shared_expert_combination_strategy="sum")),
    "cohere2_moe_sigmoid": Family("Cohere2MoeConfig", "Cohere2MoeForCausalLM", dict(
        num_shared_experts=1, expert_selection_fn="sigmoid", shared_expert_combination_strategy="average")),
    # sigmoid, selection bias, groups (sum of the top two), scaling
    "deepseek_v3": Family("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(first_k_dense_replace=1)),
    "kimi_k2": Family("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(  # E=384, one group, K=8
        n_routed_experts=384, num_experts_per_tok=8, n_group=1, topk_group=1, routed_scaling_factor=2.827)),
    "deepseek_v32": Family("DeepseekV32Config", "DeepseekV32ForCausalLM"),
    "glm4_moe": Family("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "glm4_moe_lite": Family("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM"),
    "glm4v_moe": Family("Glm4vMoeTextConfig", "Glm4vMoeTextModel", dict(rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=1.0, mrope_section=[2, 1, 1]))),
    "glm_moe_dsa": Family("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
    "dots1": Family("Dots1Config", "Dots1ForCausalLM"),
    "exaone_moe": Family("ExaoneMoeConfig", "ExaoneMoeForCausalLM"),
    "kimi_linear": Family("KimiLinearConfig", "KimiLinearForCausalLM", dict(
        layer_types=["linear_attention", "full_attention"], mlp_layer_types=["sparse", "sparse"],
        linear_head_dim=8, linear_num_heads=4, num_expert_group=4, topk_group=2, num_experts_per_token=2)),
    "solar_open": Family("SolarOpenConfig", "SolarOpenForCausalLM"),
    "mimo_v2_flash": Family("MiMoV2FlashConfig", "MiMoV2FlashForCausalLM"),
    "bailing_hybrid": Family("BailingHybridConfig", "BailingHybridForCausalLM", dict(
        layer_types=["linear_attention", "full_attention"], mlp_layer_types=["sparse", "sparse"],
        num_expert_group=4, layer_group_size=2)),
    "dots3_note": Family("Dots3NoteTextConfig", "Dots3NoteTextModel", dict(
        layer_types=["sliding_attention", "sliding_attention"], mlp_layer_types=["sparse", "sparse"])),
    "beam": Family("BeamConfig", "BeamForCausalLM", dict(
        layer_types=["sliding_attention", "full_attention"], mlp_layer_types=["sparse", "sparse"])),
    "hy_v3": Family("HYV3Config", "HYV3ForCausalLM", dict(mlp_layer_types=["sparse", "sparse"],
                                                          router_scaling_factor=2.5)),
    "minimax_m3": Family("MiniMaxM3VLTextConfig", "MiniMaxM3VLTextModel", dict(
        mlp_layer_types=["sparse", "sparse"], layer_types=["full_attention"] * 2,
        shared_intermediate_size=24)),
    "laguna": Family("LagunaConfig", "LagunaForCausalLM", dict(
        mlp_layer_types=["sparse", "sparse"], layer_types=["full_attention"] * 2,
        moe_routed_scaling_factor=2.0)),
    "flint": Family("FlintConfig", "FlintForCausalLM",
                    dict(layer_types=["full_attention", "sliding_attention"])),
    # softmax, no renormalisation, scaling; groups scored by their best expert
    "deepseek_v2": Family("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(topk_method="greedy")),
    "deepseek_v2_grouped": Family("DeepseekV2Config", "DeepseekV2ForCausalLM",
                                  dict(topk_method="group_limited_greedy", mlp_layer_types=["sparse"] * 2)),
    "unlimited_ocr": Family("UnlimitedOcrTextConfig", "UnlimitedOcrTextModel", dict(
        topk_method="group_limited_greedy", mlp_layer_types=["sparse"] * 2,
        layer_types=["reference_sliding_attention"] * 2)),
    "deepseek_ocr2": Family("DeepseekOcr2TextConfig", "DeepseekOcr2TextModel",
                            dict(topk_method="group_limited_greedy", mlp_layer_types=["sparse"] * 2)),
    "mistral4": Family("Mistral4Config", "Mistral4ForCausalLM"),
    "mistral_large4": Family("MistralLarge4TextConfig", "MistralLarge4TextModel"),
    "minimax_m2": Family("MiniMaxM2Config", "MiniMaxM2ForCausalLM"),
    "afmoe": Family("AfmoeConfig", "AfmoeForCausalLM", dict(route_scale=2.0)),
    "lfm2_moe": Family("Lfm2MoeConfig", "Lfm2MoeForCausalLM", dict(layer_types=["conv", "full_attention"],
                                                                   routed_scaling_factor=1.5)),
    # sigmoid of the top-k logits, applied to the experts' input (top-1 in the released models)
    "llama4": Family("Llama4TextConfig", "Llama4ForCausalLM", dict(
        num_experts_per_tok=1, interleave_moe_layer_step=1, intermediate_size_mlp=48)),
    "llama4_top2": Family("Llama4TextConfig", "Llama4ForCausalLM", dict(
        num_experts_per_tok=2, interleave_moe_layer_step=1, intermediate_size_mlp=48)),
    # router bias, softmax of the top-k logits, swigluoai, expert biases
    "gpt_oss": Family("GptOssConfig", "GptOssForCausalLM", dict(intermediate_size=16,
                                                                layer_types=["full_attention"] * 2)),
}  # fmt: skip
FAMILIES = list(SPECS)
# Families whose MoE block safemoe leaves alone (the reasons: integrations/transformers.py).
UNSUPPORTED = {
    "phimoe": (Family("PhimoeConfig", "PhimoeForCausalLM"), "PhimoeSparseMoeBlock"),
    "nemotron_h": (Family("NemotronHConfig", "NemotronHForCausalLM", dict(
        layers_block_type=["moe", "attention"], mamba_num_heads=4, mamba_head_dim=8, n_groups=1,
        ssm_state_size=8)), "NemotronHMoE"),
}


def _class(spec: Family, name: str):
    found = getattr(transformers, name, None)
    if found is None and spec.module is not None:
        for kind in ("configuration", "modeling"):
            module = importlib.import_module(f"transformers.models.{spec.module}.{kind}_{spec.module}")
            found = found or getattr(module, name, None)
    if found is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return found


def _fields(config_cls) -> set[str]:
    default = config_cls()
    return set(default.to_dict()) | {k for k in dir(default) if not k.startswith("_")}


def config(family: str):
    spec = SPECS[family] if family in SPECS else UNSUPPORTED[family][0]
    config_cls = _class(spec, spec.config)
    fields = _fields(config_cls)
    kwargs = {k: v for k, v in TINY.items() if k in fields}
    if "qk_rope_head_dim" in fields:  # MLA: head_dim is derived, every head has its own KV
        kwargs.pop("head_dim", None)
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    kwargs.update(spec.fields)
    try:
        built = config_cls(**kwargs)
    except (ValueError, TypeError) as exc:  # StrictDataclass validation errors are ValueErrors
        if "layer type" in str(exc):
            # e.g. Qwen4-Exp's "indexed_attention" layers, which transformers 5.17 does not know
            pytest.skip(f"transformers {transformers.__version__} rejects {family}'s tiny config: {exc}")
        raise
    if spec.post is not None:
        spec.post(built)
    return built


def build(family: str) -> nn.Module:
    spec = SPECS[family] if family in SPECS else UNSUPPORTED[family][0]
    model_cls = _class(spec, spec.model)
    conf = config(family)
    torch.manual_seed(0)
    model = model_cls._from_config(conf).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and "e_score_correction_bias" not in name:
                continue
            p.normal_(0, 0.2 if p.dim() > 1 and "e_score_correction_bias" not in name else 0.1)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name or name.endswith("expert_bias"):
                b.normal_(0, 0.1)
    return model


def hidden_size(model: nn.Module) -> int:
    return int(model.get_input_embeddings().weight.shape[1])


def run(model: nn.Module, family: str, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits (or last hidden state for a bare text model)."""
    if SPECS[family].embeds:
        out = model(inputs_embeds=model.get_input_embeddings()(ids))
    else:
        out = model(ids)
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ in SUPPORTED_BLOCKS]


def block_out(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The block's hidden output, flattened to [T, H] (Llama 4's stock block returns it flat)."""
    out = block(x)
    out = out[0] if isinstance(out, tuple) else out
    return out.reshape(-1, out.shape[-1])


def poison_layers(model: nn.Module, num_valid: int):
    """Pre-hooks writing NaN into rows >= num_valid (of the flattened batch*seq) of every decoder
    layer's input hidden states: every layer's MoE block sees NaN padding rows."""

    def poison(hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1]).clone()
        flat[num_valid:] = math.nan
        return flat.view_as(hidden)

    def hook(module, args, kwargs):
        if args:
            return (poison(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": poison(kwargs["hidden_states"])}

    layers = [m for n, m in model.named_modules() if re.fullmatch(r"(.*\.)?(layers|blocks)\.\d+", n)]
    assert layers, "no decoder layers found"
    return [m.register_forward_pre_hook(hook, with_kwargs=True) for m in layers]


# Families whose experts are copied at patch time (transposed or de-interleaved layouts).
COPIED = {"gpt_oss", "dbrx", "aria", "llama4", "llama4_top2"}


def stock_w13(block: nn.Module) -> torch.Tensor | None:
    experts = getattr(block, "experts", None)
    if experts is not None:
        return getattr(experts, "gate_up_proj", None)
    return block.input_linear.weight  # JetMoE


@pytest.mark.parametrize("family", FAMILIES)
def test_patch_matches_unpatched(family):
    model = build(family)
    blocks = moe_blocks(model)
    assert blocks, f"{family}: no MoE block found"
    hidden = hidden_size(model)
    torch.manual_seed(1)
    ids = torch.randint(3, 64, (3, 5))
    x = torch.randn(3, 4, hidden)
    real_seqs, padded_seqs, seq = 2, 4, 3
    pad_ids = torch.randint(3, 64, (padded_seqs, seq))
    xp = torch.randn(6, 1, hidden)
    with torch.no_grad():
        want_logits = run(model, family, ids)
        want_blocks = [block_out(b, x) for _, b in blocks]
        want_padded_blocks = [block_out(b, xp[:4]) for _, b in blocks]
        want_real_logits = run(model, family, pad_ids[:real_seqs])
    shared_before = {n: stock_w13(b) for n, b in blocks}

    health = Health()
    assert patch(model, backend="reference", health=health) is model
    new_blocks = [model.get_submodule(n) for n, _ in blocks]
    assert all(isinstance(b, SafeMoEBlock) for b in new_blocks)
    if family not in COPIED:  # the same Parameter objects: no copy
        assert all(b.moe.w13 is shared_before[n] for (n, _), b in zip(blocks, new_blocks, strict=True))

    with torch.no_grad():
        assert_close(run(model, family, ids), want_logits, what=f"{family} logits")
        for (name, _), block, want in zip(blocks, new_blocks, want_blocks, strict=True):
            assert_close(block_out(block, x), want, what=f"{family} {name}")

        # Block level: rows >= 4 of the flattened input are NaN padding.
        xp[4:] = math.nan
        set_num_valid(model, torch.tensor(4))
        for (name, _), block, want in zip(blocks, new_blocks, want_padded_blocks, strict=True):
            got = block_out(block, xp)
            assert_close(got[:4], want, what=f"{family} {name} padded")
            assert_equal(got[4:], torch.zeros_like(got[4:]), what=f"{family} {name} padding rows")

        # Model level: the padding sequences' hidden states are NaN at the input of every layer.
        set_num_valid(model, real_seqs * seq)
        handles = poison_layers(model, real_seqs * seq)
        got = run(model, family, pad_ids)
        for h in handles:
            h.remove()
        set_num_valid(model, None)
    assert_close(got[:real_seqs], want_real_logits, what=f"{family} real rows with NaN padding")
    assert torch.isnan(got[real_seqs:]).all(), "padding sequences carry the poison to the end"
    assert health.read()["nonfinite_rows"] == 0 and health.read()["padded_rows"] > 0


def test_patch_shares_workspace_health_and_is_idempotent():
    model = build("qwen3_moe")
    workspace, health = safemoe.Workspace(64, 8, 2, 64, 32, torch.float32, "cpu"), Health()
    patch(model, workspace=workspace, health=health)
    blocks = patched_blocks(model)
    assert len(blocks) == 2
    assert all(b.moe.workspace is workspace and b.moe.health is health.tensor for b in blocks)
    assert all(b.state is blocks[0].state for b in blocks)
    patch(model)  # already patched: nothing left to replace, no error
    assert patched_blocks(model)[0] is blocks[0]
    assert "Qwen3MoeSparseMoeBlock" in repr(blocks[0])


class FancyMoeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(4, 2)
        self.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])


def test_unsupported_blocks_raise_naming_the_class():
    model = nn.Sequential(nn.Linear(4, 4), FancyMoeBlock())
    with pytest.raises(ValueError, match="FancyMoeBlock"):
        patch(model)
    with pytest.raises(ValueError, match="no MoE block"):
        patch(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="not patched"):
        set_num_valid(nn.Linear(2, 2), 1)
    with pytest.raises(ValueError, match="backend"):
        patch(build("mixtral"), backend="gpu")


@pytest.mark.parametrize("family", list(UNSUPPORTED))
def test_unsupported_families_raise_naming_the_block(family):
    model = build(family)
    with pytest.raises(ValueError, match=f"cannot patch {UNSUPPORTED[family][1]}"):
        patch(model)


def _set(path: str, value):
    def mutate(model: nn.Module) -> None:
        owner, _, attr = path.rpartition(".")
        block = moe_blocks(model)[0][1]
        setattr(block.get_submodule(owner) if owner else block, attr, value)

    return mutate


@pytest.mark.parametrize(("family", "mutate", "match"), [
    ("gpt_oss", _set("experts.alpha", 1.5), "alpha"),
    ("minimax_m3", _set("experts.swiglu_limit", 10.0), "limit"),
    ("laguna", _set("gate.router_logit_softcapping", 30.0), "softcapping"),
    ("dbrx", _set("moe_normalize_expert_weights", 2.0), "p=1"),
    ("deepseek_v2", _set("gate.topk_method", "noaux_tc"), "topk_method"),
    ("cohere2_moe", _set("shared_expert_combination_strategy", "max"), "strategy"),
    ("cohere2_moe", _set("gate.expert_selection_fn", "relu"), "expert_selection_fn"),
])
def test_routing_safemoe_cannot_express_is_refused(family, mutate, match):
    """A block whose routing or experts differ from what its builder maps raises, naming why."""
    model = build(family)
    mutate(model)
    with pytest.raises(ValueError, match=match):
        patch(model)


def _ids(output, top_k: int) -> torch.Tensor:
    """A router's ids [T, K] from its output: the integer [T, K] tensor among its outputs, else (a
    router returning only logits: DBRX, Llama 4, JetMoE) the top-k of its last [T, E] float output,
    which its softmax / sigmoid scoring keeps in order."""
    items = output if isinstance(output, tuple) else (output,)
    tensors = [t for t in items if isinstance(t, torch.Tensor) and t.dim() == 2]
    for t in tensors:
        if not t.is_floating_point() and t.shape[-1] == top_k:
            return t
    return torch.topk(tensors[-1].float(), top_k, dim=-1).indices


def _sorted_ids(output, top_k: int) -> torch.Tensor:
    return torch.sort(_ids(output, top_k).long(), dim=-1).values


def _record_routing(routers: list[torch.nn.Module]) -> tuple[list, list]:
    """Forward hooks keeping each router call's output (see _ids), in call order."""
    seen: list = []

    def hook(module, args, output):
        seen.append(output)

    return seen, [r.register_forward_hook(hook) for r in routers]


def _hf_router(block: torch.nn.Module) -> torch.nn.Module:
    return block.router if hasattr(block, "router") else block.gate


def _other_routers(model: nn.Module, blocks: list) -> list[nn.Module]:
    """Top-k routers outside the MoE blocks (JetMoE's mixture-of-attention heads): patch() leaves
    them alone, but bf16 noise from the MoE blocks upstream can flip their top-k on near-ties."""
    inside = {id(m) for _, b in blocks for m in b.modules()}
    return [m for m in model.modules() if type(m).__name__.endswith("TopKGating") and id(m) not in inside]


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_patched_models_bf16(family):
    """bf16, Triton backend, against the unpatched model. bf16 logits can tie exactly at the top-k
    boundary, where transformers' torch.topk and safemoe's lowest-index rule pick differently: rows
    (tokens) whose expert sets differ are excluded from the block comparison, and their sequences
    from the logits comparison; they must stay rare, every other row must match."""
    model = build(family).to(device="cuda", dtype=torch.bfloat16)
    blocks = moe_blocks(model)
    torch.manual_seed(1)
    ids = torch.randint(3, 64, (4, 6), device="cuda")
    x = torch.randn(4, 8, hidden_size(model), device="cuda", dtype=torch.bfloat16)

    attention_routers = _other_routers(model, blocks)
    hf_attn, attn_handles = _record_routing(attention_routers)
    hf_seen, handles = _record_routing([_hf_router(b) for _, b in blocks])
    want_logits = run(model, family, ids).float()
    for h in attn_handles:
        h.remove()
    want_blocks = [block_out(b, x).float() for _, b in blocks]
    for h in handles:
        h.remove()
    patch(model, backend="triton")
    new_blocks = [model.get_submodule(n) for n, _ in blocks]
    sm_seen, handles = _record_routing([b.moe.gate for b in new_blocks])
    sm_attn, attn_handles = _record_routing(attention_routers)
    got_logits = run(model, family, ids).float()
    for h in attn_handles:
        h.remove()
    got_blocks = [block_out(b, x).float() for b in new_blocks]
    for h in handles:
        h.remove()

    layers = len(blocks)
    top_k = [new_blocks[i % layers].moe.top_k for i in range(len(sm_seen))]  # calls go block 0, 1, ...
    hf_ids = [torch.sort(_ids(o, k).long(), dim=-1).values for o, k in zip(hf_seen, top_k, strict=True)]
    sm_ids = [torch.sort(_ids(o, k).long(), dim=-1).values for o, k in zip(sm_seen, top_k, strict=True)]
    same = [(a == b).all(dim=-1) for a, b in zip(hf_ids, sm_ids, strict=True)]  # per call, [T]
    # Sequences whose tokens were all routed alike in every layer (a token routed differently
    # reaches the later tokens of its sequence through attention).
    assert len(hf_attn) == len(sm_attn), (len(hf_attn), len(sm_attn))
    attn_k = [attention_routers[i % len(attention_routers)].top_k for i in range(len(hf_attn))]
    attn_same = [_sorted_ids(a, k).eq(_sorted_ids(b, k)).all(dim=-1)
                 for a, b, k in zip(hf_attn, sm_attn, attn_k, strict=True)]  # fmt: skip
    model_rows = torch.stack(same[:layers] + attn_same).all(dim=0).view(ids.shape).all(dim=1, keepdim=True)
    model_rows = model_rows.expand(ids.shape).reshape(-1)
    rows = torch.cat(same)
    flips = int((~rows).sum())
    assert flips <= max(2, rows.numel() // 30), (
        f"{family}: {flips} of {rows.numel()} rows routed differently (more than bf16 top-k ties explain)"
    )
    for i, ((name, _), got, want) in enumerate(zip(blocks, got_blocks, want_blocks, strict=True)):
        rows = same[layers + i]
        got, want = got.reshape(-1, got.shape[-1])[rows], want.reshape(-1, want.shape[-1])[rows]
        assert_close(got, want, atol=0.03 * float(want.abs().max()), rtol=0.03, what=f"{family} {name}")
    got, want = got_logits.reshape(-1, got_logits.shape[-1]), want_logits.reshape(-1, want_logits.shape[-1])
    got, want = got[model_rows], want[model_rows]
    assert_close(got, want, atol=0.03 * float(want.abs().max()), rtol=0.03, what=f"{family} logits")
