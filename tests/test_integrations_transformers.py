"""safemoe.integrations.transformers.patch on tiny random models of every supported family.

fp32 on CPU, tight tolerance: the full model's logits and each MoE block's output match the
unpatched model; with NaN-poisoned padding rows the real rows still match and padded MoE rows are
exact zeros. Inputs are random and finite (HF routers treat NaN and ties their own way). On a GPU
the same families in bf16 on the Triton backend (test_patched_models_bf16).
"""

from __future__ import annotations

import math

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

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip


def config(family: str):
    tf = transformers
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**COMMON, head_dim=8, intermediate_size=48, moe_intermediate_size=16,
                                 num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)  # fmt: skip
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **COMMON, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
            num_experts=8, num_experts_per_tok=2,
        )  # fmt: skip
    if family == "mixtral":
        return tf.MixtralConfig(
            **COMMON, head_dim=8, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2
        )
    if family == "olmoe":
        return tf.OlmoeConfig(**COMMON, intermediate_size=16, num_experts=8, num_experts_per_tok=2)
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
            n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=16,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5,
            max_position_embeddings=64,
        )  # fmt: skip
    if family == "gpt_oss":
        return tf.GptOssConfig(**COMMON, head_dim=8, intermediate_size=16, num_local_experts=8,
                               num_experts_per_tok=2, layer_types=["full_attention"] * 2)  # fmt: skip
    raise AssertionError(family)


FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss"]


def build(family: str) -> nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(family)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                continue
            p.normal_(0, 0.2 if p.dim() > 1 else 0.1)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0, 0.1)
    return model


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ in SUPPORTED_BLOCKS]


def block_out(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = block(x)
    return out[0] if isinstance(out, tuple) else out


def poison_attention(model: nn.Module, num_valid: int):
    """Forward hooks writing NaN into attention-output rows >= num_valid (flattened batch*seq)."""

    def hook(module, args, output):
        attn, *rest = output
        flat = attn.reshape(-1, attn.shape[-1]).clone()
        flat[num_valid:] = math.nan
        return (flat.view_as(attn), *rest)

    return [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith("self_attn")]


@pytest.mark.parametrize("family", FAMILIES)
def test_patch_matches_unpatched(family):
    model = build(family)
    blocks = moe_blocks(model)
    assert blocks, f"{family}: no MoE block found"
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (3, 5))
    x = torch.randn(3, 4, 32)
    real_seqs, padded_seqs, seq = 2, 4, 3
    pad_ids = torch.randint(0, 64, (padded_seqs, seq))
    xp = torch.randn(6, 1, 32)
    with torch.no_grad():
        want_logits = model(ids).logits
        want_blocks = [block_out(b, x) for _, b in blocks]
        want_padded_blocks = [block_out(b, xp[:4]) for _, b in blocks]
        want_real_logits = model(pad_ids[:real_seqs]).logits
    shared_before = {n: b.experts.gate_up_proj for n, b in blocks}

    health = Health()
    assert patch(model, backend="reference", health=health) is model
    new_blocks = [model.get_submodule(n) for n, _ in blocks]
    assert all(isinstance(b, SafeMoEBlock) for b in new_blocks)
    if family != "gpt_oss":  # the same Parameter objects: no copy
        assert all(b.moe.w13 is shared_before[n] for (n, _), b in zip(blocks, new_blocks, strict=True))

    with torch.no_grad():
        assert_close(model(ids).logits, want_logits, what=f"{family} logits")
        for (name, _), block, want in zip(blocks, new_blocks, want_blocks, strict=True):
            assert_close(block_out(block, x), want, what=f"{family} {name}")

        # Block level: rows >= 4 of the flattened input are NaN padding.
        xp[4:] = math.nan
        set_num_valid(model, torch.tensor(4))
        for (name, _), block, want in zip(blocks, new_blocks, want_padded_blocks, strict=True):
            got = block_out(block, xp)
            assert_close(got[:4], want, what=f"{family} {name} padded")
            assert_equal(got[4:], torch.zeros_like(got[4:]), what=f"{family} {name} padding rows")

        # Model level: attention outputs of the padding sequences are NaN in every layer.
        set_num_valid(model, real_seqs * seq)
        handles = poison_attention(model, real_seqs * seq)
        got = model(pad_ids).logits
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


def test_gpt_oss_rejects_other_swiglu_constants():
    model = build("gpt_oss")
    model.model.layers[0].mlp.experts.alpha = 1.5
    with pytest.raises(ValueError, match="alpha"):
        patch(model)


def _record_routing(routers: list[torch.nn.Module]) -> tuple[list[torch.Tensor], list]:
    """Forward hooks keeping each router's ids (the last output, [T, K]) as sorted sets."""
    seen: list[torch.Tensor] = []

    def hook(module, args, output):
        seen.append(torch.sort(output[-1].long(), dim=-1).values)

    return seen, [r.register_forward_hook(hook) for r in routers]


def _hf_router(block: torch.nn.Module) -> torch.nn.Module:
    return block.router if hasattr(block, "router") else block.gate


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_patched_models_bf16(family):
    """bf16, Triton backend, against the unpatched model. bf16 logits can tie exactly at the top-k
    boundary, where transformers' torch.topk and safemoe's lowest-index rule pick differently: rows
    (tokens) whose expert sets differ in any layer are excluded from the value comparison, and
    must stay rare; every other row must match."""
    model = build(family).to(device="cuda", dtype=torch.bfloat16)
    blocks = moe_blocks(model)
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (4, 6), device="cuda")
    x = torch.randn(4, 8, 32, device="cuda", dtype=torch.bfloat16)

    hf_seen, handles = _record_routing([_hf_router(b) for _, b in blocks])
    want_logits = model(ids).logits.float()
    want_blocks = [block_out(b, x).float() for _, b in blocks]
    for h in handles:
        h.remove()
    patch(model, backend="triton")
    new_blocks = [model.get_submodule(n) for n, _ in blocks]
    sm_seen, handles = _record_routing([b.moe.gate for b in new_blocks])
    got_logits = model(ids).logits.float()
    got_blocks = [block_out(b, x).float() for b in new_blocks]
    for h in handles:
        h.remove()

    layers = len(blocks)
    same = [(a == b).all(dim=-1) for a, b in zip(hf_seen, sm_seen, strict=True)]  # per call, [T]
    model_rows = torch.stack(same[:layers]).all(dim=0)  # tokens routed alike in every layer
    flips = int((~torch.cat(same)).sum())
    assert flips <= 2, f"{family}: {flips} rows routed differently (more than bf16 top-k ties explain)"
    for i, ((name, _), got, want) in enumerate(zip(blocks, got_blocks, want_blocks, strict=True)):
        rows = same[layers + i]
        got, want = got.reshape(-1, got.shape[-1])[rows], want.reshape(-1, want.shape[-1])[rows]
        assert_close(got, want, atol=0.03 * float(want.abs().max()), rtol=0.03, what=f"{family} {name}")
    got, want = got_logits.reshape(-1, got_logits.shape[-1]), want_logits.reshape(-1, want_logits.shape[-1])
    got, want = got[model_rows], want[model_rows]
    assert_close(got, want, atol=0.03 * float(want.abs().max()), rtol=0.03, what=f"{family} logits")
