"""fp8 checkpoints as they ship: `patch()` on models whose experts are transformers' `FP8Experts`
(FineGrainedFP8Config: float8_e4m3fn weights, float32 `*_scale_inv` per 128x128 block) runs them on
safemoe's fp8 kernels with the checkpoint's own tensors, no dequantisation.

CPU: transformers' own module swap (`replace_with_fp8_linear`, what the quantizer runs before
loading) turns the experts into FP8Experts; their weights are quantised (`safemoe.testing`) as
DeepSeek-V3 ships them (per 128x128 block, scale_inv = amax / 448, edge blocks partial) and put in.
The quantizer itself refuses to run without a GPU, and FP8Experts' own forward needs the `kernels`
hub package (not installed here), so the reference is the same model with the experts dequantised
(fp8 * scale_inv, in bf16) run stock. The fp8 path quantises activations per 1x128 group on top:
measured relative Frobenius error of the logits ~0.024-0.043 (bf16, H=256, 2 layers), asserted <=
0.08; scales applied to the wrong rows (a checked negative control) give > 0.3 since the gate rows
are made 4x larger than the up rows.

GPU (`@pytest.mark.gpu`): a tiny bf16 model saved and reloaded with `FineGrainedFP8Config()`
(transformers' quantizer on the GPU), patched, against the dequantised model; and against the
stock fp8 model where transformers' fp8 kernel can load.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from helpers import assert_equal, interpreter_only

transformers = pytest.importorskip("transformers")
fp8_integration = pytest.importorskip("transformers.integrations.finegrained_fp8")

from safemoe.integrations.transformers import SafeMoEBlock, patch, set_num_valid  # noqa: E402
from safemoe.testing import dequantize_blocks, fill_fp8_experts, quantize_blocks, rel_error  # noqa: E402

FP8 = torch.float8_e4m3fn
BLOCK = 128
HIDDEN = 256  # two 128-wide column blocks: the scales' column index is exercised
BLOCK_TOL = 0.08  # each MoE block vs the dequantised one, same input (see the module docstring)
LOGITS_TOL = 0.3  # the whole model's logits: fp8 noise in one layer can flip a later layer's routing
# Kept in bf16 (the CPU cannot run transformers' FP8Linear): attention, shared experts, routers,
# dense MLPs (DeepSeek-V3's first layer), the head.
NOT_CONVERTED = ["lm_head", r".*self_attn", r".*linear_attn", r".*shared_experts?", r".*shared_expert_gate",
                 r".*mlp\.gate", r".*mlp\.(gate|up|down)_proj"]


def _family(name: str, inter: int):
    if name == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            vocab_size=64, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=inter,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=True, pad_token_id=0)
        return config, transformers.Qwen3MoeForCausalLM
    if name == "deepseek_v3":  # layer 0 dense, layer 1 MoE with a shared expert, groups, scaling
        config = transformers.DeepseekV3Config(
            vocab_size=64, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=inter,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
            num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=16,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_shared_experts=1,
            routed_scaling_factor=2.5, pad_token_id=0)
        return config, transformers.DeepseekV3ForCausalLM
    if name == "qwen3_next":  # shared expert with a sigmoid gate; linear-attention layer 0
        config = transformers.Qwen3NextConfig(
            vocab_size=64, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=inter,
            shared_expert_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
            layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
            linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32, pad_token_id=0)
        return config, transformers.Qwen3NextForCausalLM
    raise AssertionError(name)


def random_bf16_model(family: str, inter: int) -> nn.Module:
    config, model_cls = _family(family, inter)
    torch.manual_seed(0)
    model = model_cls._from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:
                continue
            p.normal_(0, 0.05 if p.dim() > 1 else 0.1)
            if name.endswith("gate_up_proj"):  # gate rows 4x the up rows: wrong gate/up scales show
                p[:, :inter] *= 4
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0, 0.1)
    return model


def fp8_checkpoint(family: str, inter: int, *, split: bool = False, ue8m0: bool = False,
                   per_tensor: bool = False):
    """(fp8 model, dequantised bf16 model, {experts name: FP8Experts}). The experts become
    transformers' FP8Experts (its own module swap) holding e4m3 weights quantised per 128x128
    block; split: gate_proj and up_proj quantised as two matrices (as DeepSeek-style checkpoints
    ship them: 2 * ceil(I/128) scale rows), else gate_up as one (ceil(2I/128) rows, the shape
    transformers' quantizer makes). ue8m0: power-of-two scales stored as float8_e8m0fnu.
    per_tensor: weight_block_size=None, one scale per expert and projection ([E, 2, 1] gate and
    up, [E, 1, 1] down)."""
    model = random_bf16_model(family, inter)
    dequantized = copy.deepcopy(model)
    stock = {n: (m.gate_up_proj.detach().clone(), m.down_proj.detach().clone())
             for n, m in model.named_modules() if n.endswith("mlp.experts") and hasattr(m, "gate_up_proj")}
    quant_config = transformers.FineGrainedFP8Config(weight_block_size=None if per_tensor else (BLOCK, BLOCK))
    fp8_integration.replace_with_fp8_linear(model, modules_to_not_convert=NOT_CONVERTED,
                                            quantization_config=quant_config)
    converted = {}
    for name, module in model.named_modules():
        if isinstance(module, fp8_integration.FP8Linear):
            raise AssertionError(f"{name} became an FP8Linear, which this CPU cannot run")
        if not isinstance(module, fp8_integration.FP8Experts):
            continue
        assert (module.block_size is None) == per_tensor
        w13, w2 = fill_fp8_experts(module, *stock[name], split=split, ue8m0=ue8m0)
        reference = dequantized.get_submodule(name)
        with torch.no_grad():
            reference.gate_up_proj.copy_(w13)
            reference.down_proj.copy_(w2)
        converted[name] = module
    assert converted, f"{family}: no experts module became FP8Experts"
    return model, dequantized, converted


CASES = [
    ("qwen3_moe", 128, False),
    ("qwen3_moe", 192, False),  # I % 128 != 0: gate and up share the middle 128-row scale block
    ("qwen3_moe", 64, True),  # I <= 64: transformers' [E, 2, H/128] holds gate's and up's scales
    ("deepseek_v3", 128, False),
    ("deepseek_v3", 192, False),
    ("qwen3_next", 128, False),
]


def block_errors(model: nn.Module, dequantized: nn.Module,
                 ids: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    """(logits, per block relative error): each patched block against the dequantised model's
    stock block on the very input the block saw inside the patched model (so that routing flips in
    later layers, which fp8 noise in earlier ones can cause, do not enter the comparison)."""
    seen: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    handles = [m.register_forward_hook(lambda mod, args, out, n=n: seen.append((n, args[0], out)))
               for n, m in model.named_modules() if isinstance(m, SafeMoEBlock)]
    logits = model(ids).logits
    for h in handles:
        h.remove()
    assert seen, "no patched block ran"
    return logits, [rel_error(out, dequantized.get_submodule(n)(x)) for n, x, out in seen]


@pytest.mark.parametrize(("family", "inter", "split"), CASES, ids=[f"{f}-I{i}{'-split' if s else ''}"
                                                                   for f, i, s in CASES])
@torch.no_grad()
def test_fp8_checkpoint_runs_on_safemoe_fp8_kernels(family, inter, split):
    model, dequantized, experts = fp8_checkpoint(family, inter, split=split)
    torch.manual_seed(1)
    ids = torch.randint(3, 64, (2, 6))
    want = dequantized(ids).logits
    held = {n: (m.gate_up_proj, m.down_proj, m.gate_up_proj_scale_inv) for n, m in experts.items()}
    # patch() keeps the router's dtype as transformers built it: bf16 up to transformers 5.23, fp32
    # for DeepSeek-V3's router under 5.24.
    gate_dtypes = {n: model.get_submodule(n.rpartition(".")[0]).gate.weight.dtype for n in experts}
    patch(model, backend="reference")
    for name, (w13, w2, s13) in held.items():
        block = model.get_submodule(name.rpartition(".")[0])
        assert isinstance(block, SafeMoEBlock)
        moe = block.moe
        # the checkpoint's tensors themselves: no dequantisation, no copy
        assert moe.quant == "block" and moe.w13 is w13 and moe.w2 is w2
        assert moe.w13_scale.data_ptr() == s13.data_ptr()
        stacked_rows, split_rows = -(-2 * inter // BLOCK), 2 * -(-inter // BLOCK)
        assert moe._gate_up_split == (split and split_rows != stacked_rows)
        assert moe.gate.weight.dtype == gate_dtypes[name]
    got, errors = block_errors(model, dequantized, ids)
    assert torch.isfinite(got).all()
    assert max(errors) <= BLOCK_TOL, f"{family} I={inter}: blocks' relative errors {errors}"
    err = rel_error(got, want)
    assert err <= LOGITS_TOL, f"{family} I={inter}: logits relative error {err:.3f} vs the dequantised model"

    # Negative control: the same weights read with each expert's gate/up scale rows reversed.
    moe = next(b.moe for b in model.modules() if isinstance(b, SafeMoEBlock))
    right = moe.w13_scale
    moe.w13_scale = right.flip(1).contiguous()
    wrong = max(block_errors(model, dequantized, ids)[1])
    moe.w13_scale = right
    assert wrong > 3 * BLOCK_TOL, f"scales on the wrong rows went unnoticed ({wrong:.3f})"


@torch.no_grad()
def test_per_tensor_scales():
    """weight_block_size=None: FP8Experts' [E, 2, 1] / [E, 1, 1] scales as safemoe's per-tensor
    [E, 2] / [E] (views), activations quantised per token."""
    model, dequantized, _ = fp8_checkpoint("qwen3_moe", 128, per_tensor=True)
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    patch(model, backend="reference")
    moe = next(b.moe for b in model.modules() if isinstance(b, SafeMoEBlock))
    assert moe.quant == "per_tensor" and tuple(moe.w13_scale.shape) == (8, 2)
    _, errors = block_errors(model, dequantized, ids)
    assert max(errors) <= BLOCK_TOL, errors


@torch.no_grad()
def test_padded_batch_keeps_real_rows():
    """Two prompts, the second left-padded (attention mask), then a whole padding sequence past
    num_valid whose hidden states are NaN at every layer's input: the real rows are those of the
    two prompts alone and the padded MoE rows are exact zeros. A NaN row inside the batch (a
    left-pad position poisoned at the MoE block) stays in its row."""
    model, _, experts = fp8_checkpoint("deepseek_v3", 128)
    patch(model, backend="reference")
    seq = 6
    ids = torch.randint(3, 64, (3, seq), generator=torch.Generator().manual_seed(2))
    ids[1, :2] = 0
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    want = model(ids[:2], attention_mask=mask[:2]).logits

    layers = model.model.layers
    num_valid = 2 * seq

    def poison(module, args, kwargs):
        hidden = (args[0] if args else kwargs["hidden_states"]).clone()
        hidden.view(-1, hidden.shape[-1])[num_valid:] = math.nan
        return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})

    handles = [layer.register_forward_pre_hook(poison, with_kwargs=True) for layer in layers]
    block = model.get_submodule(next(iter(experts)).rpartition(".")[0])
    seen = []
    handles.append(block.register_forward_hook(lambda m, a, out: seen.append(out)))
    set_num_valid(model, num_valid)
    got = model(ids, attention_mask=mask).logits
    set_num_valid(model, None)
    for h in handles:
        h.remove()
    assert torch.isfinite(got[:2]).all()
    assert rel_error(got[:2], want) <= 1e-2  # same computation, other batch shape: bf16 rounding only
    out = seen[0].reshape(-1, seen[0].shape[-1])
    assert_equal(out[num_valid:], torch.zeros_like(out[num_valid:]), what="padded MoE rows")

    x = torch.randn(2, seq, HIDDEN, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
    clean = block(x)
    x[1, :2] = math.nan  # the left-pad positions of prompt 2
    poisoned = block(x)
    assert_equal(poisoned[0], clean[0], what="prompt 1 rows")
    assert_equal(poisoned[1, 2:], clean[1, 2:], what="prompt 2 real rows")


@torch.no_grad()
def test_ue8m0_scales_are_widened_exactly():
    """Power-of-two scales stored as float8_e8m0fnu (scale_fmt="ue8m0") are taken as float32,
    exactly: the same output as the same scales given as float32."""
    if not hasattr(torch, "float8_e8m0fnu"):
        pytest.skip("this torch has no float8_e8m0fnu")
    model, dequantized, experts = fp8_checkpoint("qwen3_moe", 128, ue8m0=True)
    as_f32 = copy.deepcopy(model)
    for name in experts:
        m = as_f32.get_submodule(name)
        for attr in ("gate_up_proj_scale_inv", "down_proj_scale_inv"):
            setattr(m, attr, nn.Parameter(getattr(m, attr).float(), requires_grad=False))
    ids = torch.randint(3, 64, (2, 5), generator=torch.Generator().manual_seed(4))
    want = dequantized(ids).logits
    patch(model, backend="reference")
    patch(as_f32, backend="reference")
    got = model(ids).logits
    assert_equal(got, as_f32(ids).logits, what="ue8m0 vs float32 scales")
    assert rel_error(got, want) <= LOGITS_TOL


@torch.no_grad()
@interpreter_only("safemoe's Triton fp8 kernels on CPU tensors")
def test_triton_backend_under_the_interpreter():
    """One block on safemoe's Triton fp8 kernels (interpreted here), with an fp8 workspace."""
    import safemoe

    model, dequantized, experts = fp8_checkpoint("qwen3_moe", 128)
    name = next(iter(experts)).rpartition(".")[0]
    stock_block = dequantized.get_submodule(name)
    x = torch.randn(6, HIDDEN, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(5))
    want = stock_block(x[None])[0]
    with pytest.raises(ValueError, match="fp8=True"):
        patch(copy.deepcopy(model), workspace=safemoe.Workspace(8, 8, 2, HIDDEN, 128, torch.bfloat16, "cpu"))
    workspace = safemoe.Workspace(8, 8, 2, HIDDEN, 128, torch.bfloat16, "cpu", fp8=True)
    patch(model, backend="triton", workspace=workspace)
    block = model.get_submodule(name)
    got = block(x[None])[0]
    assert rel_error(got, want) <= 0.12  # vs the dequantised experts: activation quantisation (fp8)
    ref = copy.deepcopy(block)
    ref.moe.backend = ref.moe.gate.backend = "reference"
    ref.moe.set_workspace(None)
    assert rel_error(got, ref(x[None])[0]) <= 6e-2  # interpreter vs fp8 reference (test_experts_fp8)


@torch.no_grad()
def test_fp8_router_is_dequantised_once():
    """A router stored in fp8 (Hunyuan's `gate.wg` is an nn.Linear, which the quantizer makes an
    FP8Linear; [E, H] = one partial 128-row block) is dequantised to float32 at patch time and
    computes fp32 logits, as the stock fp32 `wg` holding the same dequantised weight does."""
    config = transformers.HunYuanMoEV1Config(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_experts=8, moe_topk=2, pad_token_id=0)
    torch.manual_seed(0)
    stock = transformers.HunYuanMoEV1ForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    for p in stock.parameters():
        if p.dim() > 1:
            p.normal_(0, 0.05)
    model = copy.deepcopy(stock)
    routers = [(n, m) for n, m in stock.named_modules() if type(m).__name__ == "HunYuanMoEV1Gate"]
    assert routers and routers[0][1].wg.weight.dtype == torch.float32
    for name, router in routers:
        q, s = quantize_blocks(router.wg.weight)
        router.wg.weight.copy_(dequantize_blocks(q, s))  # the stock reference: the dequantised weight
        fp8_wg = fp8_integration.FP8Linear(HIDDEN, 8, block_size=(BLOCK, BLOCK))
        fp8_wg.weight = nn.Parameter(q, requires_grad=False)
        fp8_wg.weight_scale_inv = nn.Parameter(s, requires_grad=False)
        model.get_submodule(name).wg = fp8_wg
    ids = torch.randint(3, 64, (2, 5), generator=torch.Generator().manual_seed(6))
    want = stock(ids).logits
    patch(model, backend="reference")
    moe = next(m.moe for m in model.modules() if isinstance(m, SafeMoEBlock))
    assert moe.gate.weight.dtype == torch.float32 and moe.gate.logits_fp32
    assert torch.equal(moe.gate.weight, routers[0][1].wg.weight)
    assert rel_error(model(ids).logits, want) <= 2e-2  # bf16 experts: rounding only


def _set(module: nn.Module, **attrs) -> nn.Module:
    for k, v in attrs.items():
        setattr(module, k, v)
    return module


@pytest.mark.parametrize(("change", "match"), [
    (lambda m: _set(m, activation_scheme="static"), "activation_scheme='static'"),
    (lambda m: _set(m, block_size=(64, 64)), r"block_size=\(64, 64\)"),
    (lambda m: _set(m, down_proj=nn.Parameter(m.down_proj.to(torch.bfloat16), requires_grad=False)),
     "gate_up_proj torch.float8_e4m3fn and down_proj torch.bfloat16"),
    (lambda m: _set(m, gate_up_proj_scale_inv=nn.Parameter(m.gate_up_proj_scale_inv[:, :1].contiguous(),
                                                           requires_grad=False)), "w13_scale has shape"),
    (lambda m: _set(m, down_proj_scale_inv=nn.Parameter(m.down_proj_scale_inv.half(), requires_grad=False)),
     "down_proj_scale_inv of dtype torch.float16"),
    (lambda m: _set(m, limit=7.0), "clamped SiLU"),
], ids=["static", "block64", "mixed", "scale_rows", "fp16_scales", "clamped"])
def test_layouts_safemoe_cannot_take_raise_naming_them(change, match):
    model, _, experts = fp8_checkpoint("qwen3_moe", 128)
    change(next(iter(experts.values())))
    with pytest.raises(ValueError, match=match) as info:
        patch(model)
    assert "Qwen3MoeSparseMoeBlock at model.layers.0.mlp" in str(info.value)


def test_ambiguous_gate_up_scale_rows_are_refused():
    """I = 96: ceil(2I/128) = 2 * ceil(I/128) = 2 scale rows, one matrix or gate and up apart."""
    model, _, _ = fp8_checkpoint("qwen3_moe", 96)
    with pytest.raises(ValueError, match=r"moe_intermediate_size=96 \(64 < I % 128\)"):
        patch(model)


def test_quant_on_an_fp8_checkpoint_is_refused():
    model, _, _ = fp8_checkpoint("qwen3_moe", 128)
    with pytest.raises(ValueError, match="fp8 already"):
        patch(model, quant="block")


def test_unquantised_experts_of_an_fp8_model_run_dense():
    """The quantizer leaves a matrix whose sides are not block multiples in bf16 (FP8Experts then
    runs a plain matmul): with both gate_up and down unquantised the block runs safemoe's bf16 path."""
    model, dequantized, experts = fp8_checkpoint("qwen3_moe", 128)
    for name, module in experts.items():
        ref = dequantized.get_submodule(name)
        module.gate_up_proj, module.down_proj = ref.gate_up_proj, ref.down_proj
    ids = torch.randint(3, 64, (2, 5), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        patch(model, backend="reference")
        _, errors = block_errors(model, dequantized, ids)
    assert all(b.moe.quant is None for b in model.modules() if isinstance(b, SafeMoEBlock))
    assert max(errors) <= 1e-2, errors  # bf16 rounding only


# -- GPU: transformers' quantizer ---------------------------------------------------------------


def _fp8_kernel_unavailable() -> str | None:
    """Why transformers' own fp8 forward (FP8Linear, FP8Experts) cannot run here, or None."""
    try:
        fp8_integration.load_finegrained_fp8_kernel()
    except Exception as exc:  # ImportError without the `kernels` package or the hub
        return f"transformers' finegrained-fp8 kernel cannot load: {type(exc).__name__}: {exc}"
    return None


def _quantized_on_gpu(family: str, tmp_path, **config_kwargs):
    """(fp8 model, dequantised model, {name: FP8Experts}) on cuda: a random bf16 model saved and
    reloaded with FineGrainedFP8Config (transformers' quantizer, on the GPU); the dequantised model
    is the bf16 one with every quantised weight replaced by fp8 * scale_inv."""
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        pytest.skip(f"fp8 quantization needs compute capability >= 8.9, this GPU is {major}.{minor}")
    model = random_bf16_model(family, 128)
    model.save_pretrained(tmp_path)
    quant_config = transformers.FineGrainedFP8Config(**config_kwargs)
    cls = type(model)
    try:
        fp8_model = cls.from_pretrained(tmp_path, quantization_config=quant_config, dtype=torch.bfloat16,
                                        device_map="cuda").eval()
    except ImportError as exc:  # the quantizer needs accelerate
        pytest.skip(f"transformers' fp8 quantizer cannot run here: {exc}")
    fp8_model.generation_config.eos_token_id = None  # random tiny models: decode the full length
    experts = {n: m for n, m in fp8_model.named_modules() if isinstance(m, fp8_integration.FP8Experts)}
    if not experts or any(m.gate_up_proj.dtype != FP8 for m in experts.values()):
        pytest.skip("transformers' quantizer did not make fp8 experts here (it dequantises on this setup)")
    dequantized = cls.from_pretrained(tmp_path, dtype=torch.bfloat16).to("cuda").eval()
    with torch.no_grad():
        for name, module in experts.items():
            ref = dequantized.get_submodule(name)
            assert tuple(module.gate_up_proj_scale_inv.shape[1:]) == (2, HIDDEN // BLOCK)
            ref.gate_up_proj.copy_(dequantize_blocks(module.gate_up_proj,
                                                     module.gate_up_proj_scale_inv.float()))
            ref.down_proj.copy_(dequantize_blocks(module.down_proj, module.down_proj_scale_inv.float()))
        for name, module in fp8_model.named_modules():  # quantised Linears: dequantised in the reference
            if isinstance(module, fp8_integration.FP8Linear) and module.weight.dtype == FP8:
                ref = dequantized.get_submodule(name)
                ref.weight.copy_(dequantize_blocks(module.weight, module.weight_scale_inv.float()))
    return fp8_model, dequantized, experts


def _compare(model: nn.Module, reference: nn.Module, ids: torch.Tensor, what: str) -> torch.Tensor:
    """The patched `model` against `reference` (unpatched): every block on the input it saw within
    BLOCK_TOL; per sequence, logits within 0.1 for at least half of them (fp8 noise: 0.04-0.07 on
    CPU) and 0.5 for all (one whose later routing flipped on that noise: 0.215 on CPU); the
    reference's greedy token wherever its top-2 margin is wider than 4x the largest logit
    difference. Returns the patched logits."""
    got, errors = block_errors(model, reference, ids)
    assert max(errors) <= BLOCK_TOL, f"{what}: blocks' relative errors {errors}"
    want = reference(ids).logits
    assert torch.isfinite(got).all(), what
    per_seq = [rel_error(got[b], want[b]) for b in range(ids.shape[0])]
    assert 2 * sum(e <= 0.1 for e in per_seq) >= len(per_seq) and max(per_seq) <= 0.5, (
        f"{what}: per-sequence logits relative errors {per_seq}")
    g, w = got.float().reshape(-1, got.shape[-1]), want.float().reshape(-1, want.shape[-1])
    top2 = w.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 4 * float((g - w).abs().max())
    assert_equal(g.argmax(-1)[clear], w.argmax(-1)[clear], what=f"{what}: greedy tokens")
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@torch.inference_mode()
def test_quantizer_fp8_model_patched_matches_dequantized(family, tmp_path):
    """Only the experts quantised (attention, shared experts, routers, dense MLPs kept bf16): the
    patched model runs without transformers' fp8 kernels, greedy decoding included."""
    import safemoe

    fp8_model, dequantized, experts = _quantized_on_gpu(family, tmp_path,
                                                        modules_to_not_convert=NOT_CONVERTED)
    linears = [n for n, m in fp8_model.named_modules()
               if isinstance(m, fp8_integration.FP8Linear) and m.weight.dtype == FP8]
    reason = _fp8_kernel_unavailable() if linears else None
    if reason:
        pytest.skip(f"{linears} were quantised despite modules_to_not_convert and {reason}")
    held = {n: m.gate_up_proj for n, m in experts.items()}
    ids = torch.randint(3, 64, (4, 12), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    workspace = safemoe.Workspace(64, 8, 2, HIDDEN, 128, torch.bfloat16, "cuda", fp8=True)
    patch(fp8_model, backend="triton", workspace=workspace)
    for name, w13 in held.items():
        moe = fp8_model.get_submodule(name.rpartition(".")[0]).moe
        assert moe.quant == "block" and moe.w13 is w13
    _compare(fp8_model, dequantized, ids, f"{family} patched vs dequantised")

    # Greedy decoding on the patched model: each token it picks is the dequantised model's pick
    # (teacher-forced on the same sequence) or within the fp8 noise of it.
    prompt = ids[:2, :6]
    out = fp8_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8,
                             do_sample=False, pad_token_id=0)
    assert out.shape == (2, 14)
    ref_logits = dequantized(out).logits[:, 5:-1].float()
    got_logits = fp8_model(out).logits[:, 5:-1].float()
    noise = 4 * float((got_logits - ref_logits).abs().max())
    picked = ref_logits.gather(-1, out[:, 6:, None])[..., 0]
    assert (picked >= ref_logits.max(-1).values - noise).all(), f"{family}: a greedy token off the reference"

    # Padding: two whole sequences past a device num_valid; NaN at every MoE block's input there
    # changes no bit of the real sequences.
    num_valid = 2 * ids.shape[1]
    set_num_valid(fp8_model, torch.tensor(num_valid, device="cuda"))
    clean = fp8_model(ids).logits

    def poison(module, args):
        hidden = args[0].clone()
        hidden.view(-1, hidden.shape[-1])[num_valid:] = math.nan
        return (hidden, *args[1:])

    blocks = [m for m in fp8_model.modules() if isinstance(m, SafeMoEBlock)]
    handles = [m.register_forward_pre_hook(poison) for m in blocks]
    padded = fp8_model(ids).logits
    set_num_valid(fp8_model, None)
    for h in handles:
        h.remove()
    assert torch.isfinite(padded[:2]).all()
    assert_equal(padded[:2], clean[:2], what=f"{family} real sequences with NaN padding")


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@torch.inference_mode()
def test_quantizer_fp8_model_patched_matches_stock_fp8(family, tmp_path):
    """Everything transformers quantises (attention and shared experts as FP8Linear, run by their
    own forward), against the stock fp8 model (its FP8Experts forward) and the dequantised one."""
    reason = _fp8_kernel_unavailable()
    if reason:
        pytest.skip(reason)
    fp8_model, dequantized, _ = _quantized_on_gpu(family, tmp_path)
    stock = copy.deepcopy(fp8_model)
    ids = torch.randint(3, 64, (4, 12), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    patch(fp8_model, backend="triton")
    _compare(fp8_model, stock, ids, f"{family} patched vs stock fp8")
    _compare(fp8_model, dequantized, ids, f"{family} patched vs dequantised")
