"""Which transformers MoE families run on safemoe, in which mode: a markdown coverage table.

For every model family of the installed transformers whose experts class carries
`@use_experts_implementation`, build a tiny random model (fp32, CPU: hidden 64, 2 layers, 8
experts, top-2; multimodal families with tiny towers, run on text only) and check both modes
against the stock model (`experts_implementation="eager"`, the same weights):

- patch: `safemoe.integrations.transformers.patch(model)` (router and experts replaced);
- experts_implementation: `experts_implementation="safemoe"` (the model's router, safemoe's
  experts; a module that falls back to transformers' grouped_mm is a miss, with its reason).

Checks: logits of a left-padded batch of two prompts equal to fp32 rounding on the real tokens
(rtol = atol = 1e-4, relative to the logits' scale), and greedy `generate` giving identical tokens.

fp8: the same tiny model in bf16 with its experts turned into transformers' `FP8Experts` (as its
fp8 quantizer's module swap makes them; e4m3 weights, one float32 scale_inv per expert and
projection: the tiny hidden size 64 is below one 128x128 block), run both ways, each MoE block
(patch) or experts module (experts_implementation) against the bf16 model with the experts
dequantised run stock, on the input it saw: relative error <= FP8_TOL, logits finite.

tested on GPU: from a committed `pytest -rA -m gpu` log of the per-family GPU tests (--gpu-log).

    python3 scripts/models_coverage.py                       # print the table
    python3 scripts/models_coverage.py --out docs/models.md  # and write it (with a header)
    python3 scripts/models_coverage.py --only mixtral,gpt_oss -v
    python3 scripts/models_coverage.py --out docs/models.md --json bench/results/models_coverage_cpu.json
    # a new GPU log, the CPU rows of the last run (no checks run):
    python3 scripts/models_coverage.py --from-json bench/results/models_coverage_cpu.json \
        --gpu-log bench/results/logs/hf_models_gpu_<device>_<date>.txt --out docs/models.md

Each family runs in its own subprocess (a family that crashes or runs out of memory is a miss
of its own, not the end of the run). `tests/test_hf_experts.py` imports the builders from here.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import glob
import importlib
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # the Triton interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
from torch import nn

RTOL = ATOL = 1e-4
NEW_TOKENS = 4
VOCAB = 128
MAX_PARAMS = 60_000_000  # a "tiny" model larger than this is not built (named as the reason)
# fp8 vs the dequantised experts, per MoE block on the same input: the noise of quantising the
# activations to e4m3 (measured 0.039-0.047 on these tiny models; tests/test_fp8_checkpoints.py
# asserts the same bound at H=256).
FP8_TOL = 0.08
CPU_ROWS = Path(__file__).resolve().parents[1] / "bench/results/models_coverage_cpu.json"
GPU_LOG = Path(__file__).resolve().parents[1] / "bench/results/logs/hf_models_gpu_NVIDIA-H100_2026-11-24.txt"

# Applied to a family's (text) config where the config has the field.
TINY = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, shared_experts_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    num_experts=8, num_local_experts=8, n_routed_experts=8, moe_num_experts=8,
    num_experts_per_tok=2, moe_k=2, moe_topk=2, n_group=2, topk_group=1, first_k_dense_replace=0,
    num_dense_layers=0, decoder_sparse_step=1, moe_layer_freq=1, mlp_only_layers=[],
    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    n_shared_experts=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, enable_moe_block=True,
    top_k_experts=2,
)  # fmt: skip
# Applied to the other sub-configs of a multimodal family (vision/audio towers).
TINY_TOWER = dict(depth=1, num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  num_attention_heads=2, embed_dim=32, num_key_value_heads=2, head_dim=16)  # fmt: skip
# Per-family fields (layer patterns the generic fields cannot express).
EXTRA: dict[str, dict[str, Any]] = {
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "granitemoehybrid": dict(layer_types=["linear_attention", "attention"]),
    "zaya": dict(num_experts_per_tok=1),
    "ernie4_5_vl_moe": dict(moe_intermediate_size=[32, 32]),
    "qwen4_exp": dict(indexer_budget=16, indexer_compress_ratio=4, indexer_n_heads=2, indexer_kv_heads=1,
                      indexer_head_dim=16),
    "glm4v_moe": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                           mrope_section=[2, 1, 1])),
}

# Prompts: token ids in [3, VOCAB), the second left-padded with pad id 0.
PROMPTS = [[5, 17, 42, 9, 77, 31], [64, 8, 23, 101]]


class Unbuildable(Exception):
    """A family that cannot be built as a tiny causal LM here; the message is the reason."""


# -- families ----------------------------------------------------------------------------------


def moe_families() -> dict[str, list[str]]:
    """{family (models/ folder name): [its @use_experts_implementation classes]} of the installed
    transformers, sorted by family."""
    import transformers

    root = os.path.dirname(transformers.__file__)
    out: dict[str, list[str]] = {}
    for path in sorted(glob.glob(os.path.join(root, "models", "*", "modeling_*.py"))):
        with open(path) as f:
            src = f.read()
        classes = re.findall(r"^@use_experts_implementation[^\n]*\nclass (\w+)", src, re.M)
        if classes:
            out.setdefault(path.split(os.sep)[-2], []).extend(classes)
    return out


def _mappings() -> list[tuple[str, dict[str, str]]]:
    from transformers.models.auto import modeling_auto as ma

    names = ["MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
             "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES"]
    return [(n, getattr(ma, n)) for n in names if isinstance(getattr(ma, n, None), dict)]


def _config_classes(family: str) -> list[type]:
    try:
        mod = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    except ImportError as exc:
        raise Unbuildable(f"no configuration module ({exc})") from exc
    return [c for c in vars(mod).values() if isinstance(c, type) and c.__module__ == mod.__name__
            and getattr(c, "model_type", "")]


def _pick_model(family: str) -> tuple[type, type]:
    """(config class, model class): a causal LM of the family's text model if there is one, else
    its image-text-to-text / multimodal LM (run on text only)."""
    import transformers

    classes = _config_classes(family)
    by_type = {c.model_type: c for c in classes}
    order = sorted(by_type, key=lambda t: (not t.endswith("_text"), t != family))
    for _, mapping in _mappings():
        for model_type in order:
            name = mapping.get(model_type)
            if name and hasattr(transformers, name):
                return by_type[model_type], getattr(transformers, name)
    raise Unbuildable(f"no causal-LM or multimodal-LM class for the config types {sorted(by_type)}")


def _fields(config_cls: type) -> set[str]:
    try:
        default = config_cls()
    except Exception as exc:
        raise Unbuildable(f"{config_cls.__name__}() fails: {type(exc).__name__}: {exc}") from exc
    return set(default.to_dict()) | {k for k in dir(default) if not k.startswith("_")}


def _tiny_kwargs(config_cls: type, family: str, *, tower: bool = False) -> dict[str, Any]:
    fields = _fields(config_cls)
    base = TINY_TOWER if tower else TINY
    kw = {k: v for k, v in base.items() if k in fields}
    if not tower:
        if "qk_rope_head_dim" in fields:  # MLA: head_dim is derived, every head has its own KV
            kw.pop("head_dim", None)
            kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)
        default = config_cls()
        layer_types = getattr(default, "layer_types", None)
        settable = not isinstance(getattr(config_cls, "layer_types", None), property)
        if settable and isinstance(layer_types, (list, tuple)) and layer_types:
            # one layer of each kind the full model has (at least two layers)
            distinct = list(dict.fromkeys(layer_types))
            kw["layer_types"] = distinct if len(distinct) > 1 else distinct * 2
            kw["num_hidden_layers"] = len(kw["layer_types"])
        mlp_types = getattr(default, "mlp_layer_types", None)
        if isinstance(mlp_types, (list, tuple)) and "sparse" in mlp_types:
            kw["mlp_layer_types"] = ["sparse"] * kw.get("num_hidden_layers", 2)
        kw.update(EXTRA.get(family, {}))
    return kw


def tiny_config(family: str) -> tuple[Any, type]:
    """A tiny config of `family` and the model class to build from it; raises Unbuildable."""
    config_cls, model_cls = _pick_model(family)
    sub = dict(getattr(config_cls, "sub_configs", {}) or {})
    try:
        if not sub:
            return config_cls(**_tiny_kwargs(config_cls, family)), model_cls
        kw: dict[str, Any] = {}
        text_kw: dict[str, Any] = {}
        for key, sub_cls in sub.items():
            if not isinstance(sub_cls, type):
                continue
            is_text = key == "text_config"
            kw[key] = _tiny_kwargs(sub_cls, family, tower=not is_text)
            if is_text:
                text_kw = kw[key]
        for key, value in kw.items():
            if key != "text_config" and "out_hidden_size" in _fields(sub[key]):
                value["out_hidden_size"] = text_kw.get("hidden_size", 64)
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if key in _fields(config_cls):
                kw[key] = TINY[key]
        return config_cls(**kw), model_cls
    except Unbuildable:
        raise
    except Exception as exc:
        raise Unbuildable(f"tiny {config_cls.__name__} rejected: {type(exc).__name__}: {exc}") from exc


def randomize_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Weights large enough that every expert matters: N(0, 1/fan_in) matrices, N(0, 0.1) biases;
    norms keep their init."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or not p.dtype.is_floating_point:
                continue
            std = p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name or name.endswith("expert_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return model


def build(family: str, experts_implementation: str = "eager", seed: int = 0) -> nn.Module:
    """A tiny random fp32 model of `family` (eval mode); the same seed gives the same weights in
    every experts implementation. Raises Unbuildable with the reason."""
    import safemoe.integrations.transformers  # noqa: F401  registers "safemoe"

    config, model_cls = tiny_config(family)
    try:
        with torch.device("meta"):
            meta = model_cls._from_config(config)
        count = sum(p.numel() for p in meta.parameters())
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"
        raise Unbuildable(f"{model_cls.__name__} fails on a tiny config: {why}") from exc
    if count > MAX_PARAMS:
        raise Unbuildable(f"the tiny {model_cls.__name__} still has {count / 1e6:.0f}M parameters")
    torch.manual_seed(seed)
    try:
        model = model_cls._from_config(config, experts_implementation=experts_implementation)
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"
        raise Unbuildable(f"{model_cls.__name__} fails on a tiny config: {why}") from exc
    return randomize_(model.float().eval(), seed)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of the two prompts, left-padded."""
    width = max(len(p) for p in PROMPTS)
    ids = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(PROMPTS):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def logits(model: nn.Module) -> torch.Tensor:
    ids, mask = batch()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).logits.float()
    return out[mask.bool()]  # [real tokens, V]


def generate(model: nn.Module) -> torch.Tensor:
    ids, mask = batch()
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=0, eos_token_id=None)  # type: ignore[no-any-return]


def compare(want: torch.Tensor, got: torch.Tensor) -> str | None:
    """None when equal to fp32 rounding, else what differs."""
    if not torch.isfinite(want).all():
        return "the stock model's logits are not finite"
    if not torch.isfinite(got).all():
        return "non-finite logits"
    scale = max(1.0, want.abs().max().item())
    err = (want - got).abs().max().item()
    if not torch.allclose(got, want, rtol=RTOL, atol=ATOL * scale):
        return f"logits differ by {err:.2e} (scale {scale:.2f})"
    return None


# -- one family --------------------------------------------------------------------------------


@dataclass
class Row:
    family: str
    classes: str
    patch: str  # "yes" or "no: reason"
    experts_implementation: str
    seconds: float = 0.0
    fp8: str = ""  # "yes (patch, experts)", "patch only: reason", "experts only: reason", "no: reason"
    gpu: str = ""  # filled from the GPU log by the parent process


def _mode(stock_logits: torch.Tensor, stock_tokens: torch.Tensor, model: nn.Module) -> str:
    why = compare(stock_logits, logits(model))
    if why is None and not torch.equal(generate(model), stock_tokens):
        why = f"greedy generation differs within {NEW_TOKENS} tokens"
    return "yes" if why is None else f"no: {why}"


def check_family(family: str, classes: list[str] | None = None) -> Row:
    from safemoe.integrations import hf_experts
    from safemoe.integrations.transformers import patch

    start = time.perf_counter()
    names = ", ".join(classes or [])
    try:
        stock = build(family, "eager")
    except Unbuildable as exc:
        reason = f"no: not built ({exc})"
        return Row(family, names, reason, reason, time.perf_counter() - start, fp8="no: not built")
    want, tokens = logits(stock), generate(stock)

    try:
        patched = patch(copy.deepcopy(stock))
        patch_result = _mode(want, tokens, patched)
    except ValueError as exc:  # patch names the block class it does not support
        patch_result = f"no: {_patch_refusal(exc)}"
    except Exception as exc:
        patch_result = f"no: {type(exc).__name__}: {exc}"

    model = None
    try:
        model = build(family, "safemoe")
        model.load_state_dict(stock.state_dict())
        misses = hf_experts.prepare(model)
        total = len(hf_experts.experts_modules(model))
        result = _mode(want, tokens, model)
        if not total:
            result = "no: no experts module found"
        elif misses:
            reasons = sorted(set(misses.values()))
            result = (f"no: {len(misses)}/{total} experts modules fall back to grouped_mm: "
                      + "; ".join(reasons) + ("" if result == "yes" else f" ({result[4:]})"))
    except Exception as exc:
        result = f"no: {type(exc).__name__}: {exc}"
    try:
        fp8 = check_fp8(stock, model) if model is not None else "no: the safemoe model was not built"
    except Exception as exc:
        fp8 = f"no: {type(exc).__name__}: {exc}"
    return Row(family, names, patch_result, result, time.perf_counter() - start, fp8=fp8)


def _patch_refusal(exc: BaseException) -> str:
    return str(exc).split(": supported MoE blocks are")[0]


# -- fp8 ---------------------------------------------------------------------------------------


def _canonical(experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """An experts module's (w13 [E, 2I, H] gate rows then up rows, w2 [E, H, I]) in float32."""
    w13, w2 = experts.gate_up_proj.detach().float(), experts.down_proj.detach().float()
    if getattr(experts, "is_transposed", False):
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
    if not getattr(experts, "is_concatenated", True):
        w13 = torch.cat([w13[:, 0::2], w13[:, 1::2]], dim=1)
    return w13.contiguous(), w2.contiguous()


def _set_canonical(experts: nn.Module, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """Write canonical (w13, w2) into an experts module in its own layout (the inverse of _canonical)."""
    if not getattr(experts, "is_concatenated", True):
        inter = w13.shape[1] // 2
        w13 = torch.stack([w13[:, :inter], w13[:, inter:]], dim=2).flatten(1, 2)  # gate, up alternating
    if getattr(experts, "is_transposed", False):
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
    with torch.no_grad():
        experts.gate_up_proj.copy_(w13)
        experts.down_proj.copy_(w2)


def _fp8_convert(model: nn.Module, reference: nn.Module | None = None) -> list[str]:
    """Turn every experts module of the bf16 `model` into transformers' FP8Experts (per-tensor
    scales) holding its weights quantised; with `reference` (the same bf16 model), put the
    dequantised weights in the reference's experts. Returns the converted names; raises
    ValueError with the reason where a module cannot be converted."""
    from safemoe.integrations import hf_experts
    from safemoe.testing import fill_fp8_experts, fp8_experts_like

    names = [n for n, _ in hf_experts.experts_modules(model)]
    if not names:
        raise ValueError("no experts module found")
    for name in names:
        experts = model.get_submodule(name)
        what = type(experts).__name__
        if not name.endswith(".experts"):  # replace_with_fp8_linear's test
            raise ValueError(f"transformers' fp8 quantizer swaps modules named *.experts only, not {name}")
        if not getattr(experts, "has_gate", True):
            raise ValueError(f"{what}: non-gated experts (transformers' FP8Experts holds them as up_proj; "
                             "safemoe's experts are gated)")
        if getattr(experts, "has_bias", False):
            raise ValueError(f"{what} has biases: transformers' FP8Experts has none")
        try:
            fp8 = fp8_experts_like(experts, model.config)
        except Exception as exc:
            raise ValueError(f"transformers' FP8Experts cannot be made for {what}: {type(exc).__name__}: "
                             f"{exc}") from exc
        w13, w2 = _canonical(experts)
        for attr, want in (("gate_up_proj", w13), ("down_proj", w2)):
            held = tuple(getattr(fp8, attr).shape)
            if held != tuple(want.shape):
                raise ValueError(f"transformers' FP8Experts for {what} allocates {attr} {held} from the "
                                 f"config, the experts hold {tuple(want.shape)}")
        probe = torch.randn(4, w13.shape[1], generator=torch.Generator().manual_seed(0)) * 3
        source = probe if getattr(experts, "is_concatenated", True) else torch.stack(
            probe.chunk(2, dim=-1), dim=-1).flatten(-2)
        with torch.no_grad():
            if not torch.allclose(fp8._apply_gate(probe), experts._apply_gate(source), rtol=1e-3, atol=1e-3):
                raise ValueError(f"transformers' FP8Experts gate function differs from {what}'s")
        d13, d2 = fill_fp8_experts(fp8, w13, w2)
        model.set_submodule(name, fp8)
        if reference is not None:
            _set_canonical(reference.get_submodule(name), d13, d2)
    return names


def _first_tensor(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out  # type: ignore[no-any-return]


def _ids_hook(store: dict[str, torch.Tensor], key: str, pick: Any) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        store[key] = pick(args, out).detach().reshape(-1, pick(args, out).shape[-1])

    return hook


def _errors(model: nn.Module, reference: nn.Module, names: list[str],
            patched: bool = False) -> tuple[torch.Tensor, list[float], int]:
    """(logits of the padded batch, relative error of each named module's output against the
    reference's module of the same name on the very input it saw, rows left out).

    patched: the names are SafeMoEBlocks, whose router is safemoe's: a row whose expert set
    differs from the one the reference's router picked on the same input (a bf16 near-tie: the
    two routers round the scores apart, or break an exact tie apart) is left out of its block's
    error (the fp32 check above compares the routing exactly); at most max(2, rows / 30) of them
    over the model (the GPU test's rule)."""
    from safemoe.testing import rel_error

    seen: list[tuple[str, tuple[Any, ...], dict[str, Any], torch.Tensor, torch.Tensor | None]] = []
    ours: dict[str, torch.Tensor] = {}
    handles = []
    for n in names:
        module = model.get_submodule(n)
        if patched:  # MoE.gate(x, num_valid) -> (weights [T, K], ids [T, K])
            handles.append(module.moe.gate.register_forward_hook(_ids_hook(ours, n, lambda a, o: o[1])))
        handles.append(module.register_forward_hook(
            lambda mod, args, kwargs, out, n=n: seen.append(
                (n, args, kwargs, _first_tensor(out), ours.pop(n, None))), with_kwargs=True))
    try:
        ids, mask = batch()
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask).logits.float()
    finally:
        for h in handles:
            h.remove()
    if not seen:
        raise ValueError(f"none of {names} ran")
    errors, left_out, rows = [], 0, 0
    theirs: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for n, args, kwargs, got, our_ids in seen:
            block = reference.get_submodule(n)
            inner = [m for m in block.modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed")]
            hooks = [m.register_forward_hook(_ids_hook(theirs, n, lambda a, o: a[1])) for m in inner[:1]]
            want = _first_tensor(block(*args, **kwargs))
            for h in hooks:
                h.remove()
            got, want = got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1])
            hf_ids = theirs.pop(n, None)
            if our_ids is not None and hf_ids is not None and our_ids.shape == hf_ids.shape == (
                    got.shape[0], our_ids.shape[1]):
                same = (our_ids.long().sort(dim=-1).values == hf_ids.long().sort(dim=-1).values).all(dim=-1)
                left_out += int((~same).sum())
                got, want = got[same], want[same]
            rows += got.shape[0]
            errors.append(rel_error(got, want))
    if left_out > max(2, rows // 30):
        raise ValueError(f"{left_out} rows routed differently from the stock router on the same input "
                         "(more than bf16 near-ties explain)")
    return out[mask.bool()], errors, left_out


def _fp8_verdict(logits: torch.Tensor, errors: list[float]) -> str | None:
    if not torch.isfinite(logits).all():
        return "non-finite logits"
    if max(errors) > FP8_TOL:
        return f"relative error {max(errors):.3f} > {FP8_TOL} vs the dequantised experts"
    return None


def check_fp8(stock: nn.Module, safemoe_model: nn.Module) -> str:
    """The fp8 cell of a built family: both modes on its experts made FP8Experts (see the module
    docstring), e.g. "yes (patch, experts; max error 0.041)"."""
    from safemoe.integrations import hf_experts
    from safemoe.integrations.transformers import SafeMoEBlock, patch

    reference = copy.deepcopy(stock).to(torch.bfloat16)
    patched = copy.deepcopy(reference)
    by_experts = copy.deepcopy(safemoe_model).to(torch.bfloat16)
    try:
        names = _fp8_convert(patched, reference)
        _fp8_convert(by_experts)
    except ValueError as exc:
        return f"no: {exc}"
    ids, mask = batch()
    try:
        with torch.no_grad():
            finite = bool(torch.isfinite(reference(input_ids=ids, attention_mask=mask).logits).all())
    except Exception as exc:  # e.g. a router kept in fp32 by transformers, cast to bf16 here
        return f"no: not checked: the stock model cast to bf16 fails on CPU ({type(exc).__name__}: {exc})"
    if not finite:
        return "no: the bf16 model with dequantised experts gives non-finite logits"

    errors: dict[str, list[float]] = {}
    why: dict[str, str] = {}
    notes: list[str] = []
    try:
        patch(patched)
        blocks = [n for n, m in patched.named_modules() if isinstance(m, SafeMoEBlock)]
        unquantised = [n for n in blocks if patched.get_submodule(n).moe.quant is None]
        if unquantised:
            raise ValueError(f"{unquantised} run unquantised")
        got, errors["patch"], left_out = _errors(patched, reference, blocks, patched=True)
        why["patch"] = _fp8_verdict(got, errors["patch"]) or ""
        if left_out:
            rows = f"{left_out} row{'s' if left_out > 1 else ''}"
            notes.append(f"{rows} routed apart on a bf16 near-tie left out")
    except ValueError as exc:
        why["patch"] = _patch_refusal(exc)
    except Exception as exc:
        why["patch"] = f"{type(exc).__name__}: {exc}"
    try:
        misses = hf_experts.prepare(by_experts)
        if misses:
            raise ValueError(f"{len(misses)}/{len(names)} fp8 experts modules fall back to transformers' fp8 "
                             "grouped_mm: " + "; ".join(sorted(set(misses.values()))))
        got, errors["experts"], _ = _errors(by_experts, reference, names)
        misses = hf_experts.fallbacks(by_experts)  # the activations' dtype is checked at run time
        if misses:
            raise ValueError("fell back at run time: " + "; ".join(sorted(set(misses.values()))))
        why["experts"] = _fp8_verdict(got, errors["experts"]) or ""
    except Exception as exc:
        why["experts"] = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
    ok = [m for m in ("patch", "experts") if not why[m]]
    worst = max((e for m in ok for e in errors[m]), default=0.0)
    note = "".join(f"; {x}" for x in notes if "patch" in ok)
    if len(ok) == 2:
        return f"yes (patch, experts; max error {worst:.3f}{note})"
    if ok:
        other = "experts" if ok == ["patch"] else "patch"
        return f"{ok[0]} only (max error {worst:.3f}{note}); {other}: {why[other]}"
    if why["patch"] == why["experts"]:
        return f"no: {why['patch']}"
    return f"no: patch: {why['patch']}; experts: {why['experts']}"


# -- the GPU log -------------------------------------------------------------------------------

# The per-family GPU tests: test function -> what the cell calls it. tests/test_hf_experts.py has
# no GPU test (experts_implementation="safemoe" is tested per family on CPU only).
GPU_TESTS = {"test_patched_models_bf16": "bf16 patch"}
# A skip line carries no test id: it is the per-family test of its file.
GPU_TEST_OF_FILE = {"tests/test_integrations_transformers.py": "test_patched_models_bf16"}
# tests/test_integrations_transformers.py's FAMILIES ids that are not a models/ folder name: the
# variant -> its folder (tests/test_models_coverage.py checks every id against its model class).
GPU_ALIASES = {
    "qwen3_omni_thinker": "qwen3_omni_moe", "qwen3_omni_talker": "qwen3_omni_moe", "kimi_k2": "deepseek_v3",
    "cohere2_moe_sigmoid": "cohere2_moe", "deepseek_v2_grouped": "deepseek_v2", "minimax_m3": "minimax_m3_vl",
    "llama4_top2": "llama4",
}  # fmt: skip

_OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR) (\S+?)::(\w+)\[([^\]]+)\]")
_SKIPPED = re.compile(r"^SKIPPED \[\d+\] (\S+?):\d+: (.*)$")
_SECTION = re.compile(r"^_+ (\w+)\[([^\]]+)\] _+$")


@dataclass
class GpuResult:
    test: str  # e.g. "test_patched_models_bf16"
    test_id: str  # the parametrize id, e.g. "kimi_k2"
    outcome: str  # "passed", "failed", "error", "skipped"
    reason: str = ""


@dataclass
class GpuLog:
    device: str
    date: str
    results: dict[str, list[GpuResult]] = field(default_factory=dict)  # family -> its results
    versions: str = ""  # e.g. "transformers 5.17.0", where the log names it


def _class_family(name: str) -> str | None:
    """The models/ folder of the installed transformers that defines class `name`."""
    import transformers

    root = os.path.dirname(transformers.__file__)
    for path in sorted(glob.glob(os.path.join(root, "models", "*", "*_*.py"))):
        with open(path) as f:
            if re.search(rf"^class {re.escape(name)}\b", f.read(), re.M):
                return path.split(os.sep)[-2]
    return None


def parse_gpu_log(text: str, name: str = "") -> GpuLog:
    """Per-family outcomes of the GPU_TESTS in a `pytest -rA` log: PASSED/FAILED/ERROR lines by
    their test id (mapped to the family by GPU_ALIASES), a failure's reason from the first `E`
    line of its section, SKIPPED lines by the class their reason names ("transformers X has no
    <Class>"). Device and date come from the file name (..._NVIDIA-H100_2026-11-24.txt)."""
    found = re.search(r"_(?:NVIDIA-)?([A-Za-z0-9-]+?)_(\d{4}-\d{2}-\d{2})\.\w+$", name)
    log = GpuLog(*(found.groups() if found else ("GPU", "date unknown")))
    named = re.search(r"transformers (\d+\.\d+\.\d+)", text)
    log.versions = f"transformers {named.group(1)}" if named else ""
    first_error: dict[tuple[str, str], str] = {}
    section: tuple[str, str] | None = None
    for line in text.splitlines():
        if head := _SECTION.match(line):
            section = (head.group(1), head.group(2))
        elif section and line.startswith("E ") and section not in first_error:
            first_error[section] = re.sub(r";?\s*worst:?$", "", line[1:].strip())
    for line in text.splitlines():
        if hit := _OUTCOME.match(line):
            outcome, _, test, test_id = hit.groups()
            if test in GPU_TESTS:
                result = GpuResult(test, test_id, outcome.lower(), first_error.get((test, test_id), ""))
                log.results.setdefault(GPU_ALIASES.get(test_id, test_id), []).append(result)
        elif (hit := _SKIPPED.match(line)) and hit.group(1) in GPU_TEST_OF_FILE:
            cls = re.search(r"has no (\w+)", hit.group(2))
            family = _class_family(cls.group(1)) if cls else None
            if family is not None:
                result = GpuResult(GPU_TEST_OF_FILE[hit.group(1)], family, "skipped", hit.group(2))
                log.results.setdefault(family, []).append(result)
    return log


def _log_versions(log: GpuLog) -> str:
    return f"Device {log.device}, {log.date}" + (f", {log.versions}." if log.versions else ".")


def gpu_cell(log: GpuLog | None, family: str) -> str:
    """The "tested on GPU" cell of a family, e.g. "bf16 patch: passed (H100, 2026-11-24)"."""
    results = log.results.get(family, []) if log else []
    if not results or log is None:
        return "not in the GPU tests"
    where = f"{log.device}, {log.date}"
    parts = []
    for test, label in GPU_TESTS.items():
        mine = [r for r in results if r.test == test]
        if not mine:
            continue
        outcomes = {r.outcome for r in mine}
        named = [r.test_id for r in mine] != [family]  # variants, or an id other than the family's
        plural = "s" if len(mine) > 1 else ""
        ids = f"; test id{plural} {', '.join(r.test_id for r in mine)}" if named else ""
        if outcomes == {"passed"}:
            parts.append(f"{label}: passed ({where}{ids})")
        else:
            worst = next(o for o in ("failed", "error", "skipped", "passed") if o in outcomes)
            detail = "; ".join((f"{r.test_id} {r.outcome}" + (": " if r.reason else "") if named else "")
                               + r.reason for r in mine)
            parts.append(f"{label}: {worst} ({where}): {detail}")
    return "; ".join(parts) or "not in the GPU tests"


# -- the table ---------------------------------------------------------------------------------


def _cell(text: str) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= 240 else text[:237] + "..."


def table(rows: list[Row], gpu_log: GpuLog | None = None) -> str:
    lines = ["| family | experts class | patch | experts_implementation | fp8 | tested on GPU |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        gpu = r.gpu or gpu_cell(gpu_log, r.family)
        lines.append(f"| {r.family} | {_cell(r.classes)} | {_cell(r.patch)} | "
                     f"{_cell(r.experts_implementation)} | {_cell(r.fp8)} | {_cell(gpu)} |")
    n = len(rows)
    ok_patch = sum(r.patch == "yes" for r in rows)
    ok_impl = sum(r.experts_implementation == "yes" for r in rows)
    fp8_both = sum(r.fp8.startswith("yes") for r in rows)
    fp8_patch = sum(r.fp8.startswith(("yes", "patch only")) for r in rows)
    fp8_impl = sum(r.fp8.startswith(("yes", "experts only")) for r in rows)
    gpu_passed = sum((r.gpu or gpu_cell(gpu_log, r.family)).startswith("bf16 patch: passed") for r in rows)
    lines.append("")
    lines.append(f"{n} families; patch: {ok_patch} pass; experts_implementation=\"safemoe\": {ok_impl} pass; "
                 f"fp8: patch {fp8_patch}, experts_implementation {fp8_impl}, both {fp8_both}; "
                 f"bf16 patch passed on GPU: {gpu_passed}.")
    listed = {r.family for r in rows}
    others = sorted(set(gpu_log.results) - listed - set(moe_families())) if gpu_log else []
    if others:
        lines.append("")
        lines.append("In the GPU log, not rows of this table (no `@use_experts_implementation` experts "
                     "class in this transformers): "
                     + "; ".join(f"{f}: {_cell(gpu_cell(gpu_log, f))}" for f in others) + ".")
    return "\n".join(lines)


def _run_isolated(family: str, classes: list[str], timeout: float) -> Row:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", family, "--classes", ",".join(classes)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        reason = f"no: not finished in {timeout:.0f} s on this CPU"
        return Row(family, ", ".join(classes), reason, reason, timeout, fp8=reason)
    for line in proc.stdout.splitlines()[::-1]:
        if line.startswith("ROW "):
            return Row(**json.loads(line[4:]))
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    reason = f"no: the check process died (exit {proc.returncode}: {tail})"
    return Row(family, ", ".join(classes), reason, reason, fp8=reason)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="also write the table, with a header, to this file")
    parser.add_argument("--only", help="comma-separated families")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per family")
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--gpu-log", default=str(GPU_LOG),
                        help="a `pytest -rA -m gpu` log of the per-family GPU tests (default: %(default)s); "
                             "'' for none")
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    parser.add_argument("--from-json", help="render the rows of an earlier --json run (no checks run)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--classes", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.one:
        import logging

        logging.disable(logging.WARNING)
        row = check_family(args.one, [c for c in args.classes.split(",") if c])
        print("ROW " + json.dumps(asdict(row)))
        return 0

    from concurrent.futures import ThreadPoolExecutor

    import transformers

    gpu_log = None
    if args.gpu_log:
        gpu_log = parse_gpu_log(Path(args.gpu_log).read_text(), os.path.basename(args.gpu_log))
    started = time.perf_counter()
    families = moe_families()
    if args.only:
        wanted = args.only.split(",")
        families = {f: families.get(f, []) for f in wanted}
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        rows = [Row(**r) for r in saved["rows"]]
        minutes, args.jobs, args.date = saved["minutes"], saved["jobs"], saved["date"]
        versions = saved["versions"]
    else:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = {f: pool.submit(_run_isolated, f, c, args.timeout) for f, c in families.items()}
            rows = []
            for family, fut in futures.items():
                row = fut.result()
                rows.append(row)
                if args.verbose:
                    print(f"{family}: patch={row.patch} | experts_implementation="
                          f"{row.experts_implementation} | fp8={row.fp8} ({row.seconds:.1f} s)",
                          file=sys.stderr, flush=True)
        minutes = (time.perf_counter() - started) / 60
        versions = f"transformers {transformers.__version__}, torch {torch.__version__}"
    if args.json:
        Path(args.json).write_text(json.dumps({"date": args.date, "versions": versions, "minutes": minutes,
                                               "jobs": args.jobs, "rows": [asdict(r) for r in rows]},
                                              indent=1) + "\n")
    text = table(rows, gpu_log)
    print(text)
    if args.out:
        header = (
            "# Model coverage\n\n"
            "How to use each mode (three lines each):\n\n"
            "```python\n"
            "from safemoe.integrations.transformers import patch      # mode 1: the whole MoE block\n"
            "model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, device_map=\"cuda\")\n"
            "patch(model)                                               # router + experts + shared experts\n"
            "```\n\n"
            "```python\n"
            "import safemoe.integrations.transformers                    # mode 2: registers \"safemoe\"\n"
            "model = AutoModelForCausalLM.from_pretrained(name, experts_implementation=\"safemoe\")\n"
            "safemoe.integrations.hf_experts.prepare(model)             # plan every layer before capture\n"
            "```\n\n"
            "fp8 checkpoints (`FineGrainedFP8Config`, DeepSeek-V3 / Qwen3 FP8 releases) take the same three "
            "lines: `patch()` and the experts interface run their `FP8Experts` on safemoe's fp8 kernels.\n\n"
            "The seed models at their real MoE dimensions on a GPU (patched, every CUDA-graph bucket to 8192 "
            "replayed with NaN padding, MoE block decode time against transformers' `grouped_mm`): "
            "`scripts/seed_models_gpu.py`, results in `bench/results/seed_models_*.md`.\n\n"
            f"Generated by `python3 scripts/models_coverage.py --out {args.out}` on {args.date}, "
            f"{versions}, CPU (fp32); the rows are also in `{CPU_ROWS.relative_to(CPU_ROWS.parents[2])}` "
            "(re-render with a new GPU log: `--from-json` that file, `--gpu-log` the log). Every family "
            "whose experts class carries `@use_experts_implementation` is built as a tiny random model "
            "(hidden 64, 2 layers, 8 experts, top-2; multimodal families with tiny towers, text only) "
            "and checked against the stock model (`experts_implementation=\"eager\"`, same weights): "
            "logits of a left-padded batch of two prompts within rtol = atol = 1e-4 (relative to the "
            f"logits' scale) on the real tokens, and {NEW_TOKENS} identical greedy tokens.\n\n"
            "- **patch**: `safemoe.integrations.transformers.patch(model)` (the MoE block, router "
            "included, replaced by `safemoe.MoE`).\n"
            "- **experts_implementation**: `experts_implementation=\"safemoe\"` (the model's router, "
            "safemoe's experts); a family whose experts modules fall back to transformers' grouped_mm "
            "is a miss, with the reason.\n"
            "- **fp8**: the same model in bf16 with its experts made transformers' `FP8Experts` as its fp8 "
            "quantizer's module swap makes them (e4m3 weights, float32 `scale_inv`, one scale per expert and "
            "projection: `weight_block_size=None`, since hidden 64 is below one 128x128 block), run with "
            "`patch()` and with `experts_implementation=\"safemoe\"` (transformers' `FP8ExpertsInterface`). "
            "Each patched MoE block, or each fp8 experts module, is compared with the bf16 model whose "
            "experts hold the dequantised weights (fp8 * scale_inv) run stock, on the very input it saw: "
            f"relative Frobenius error <= {FP8_TOL} (the e4m3 activations' noise), logits finite. "
            "\"yes (patch, experts)\", \"patch only\" / \"experts only\" with the other mode's reason, "
            "or \"no\" with the reason. 128x128-block checkpoints through `patch()` are tested for "
            "Qwen3-MoE, DeepSeek-V3 and Qwen3-Next in `tests/test_fp8_checkpoints.py` (see docs/fp8.md).\n"
            + (f"- **tested on GPU**: from `{os.path.relpath(args.gpu_log)}` (`pytest -rA -m gpu` of "
               "tests/test_integrations_transformers.py and tests/test_hf_experts.py): the per-family GPU "
               "test `test_patched_models_bf16` (bf16, `patch()` on the Triton kernels against the unpatched "
               "model; its ids that are variants of a family, e.g. kimi_k2 of deepseek_v3, are listed in the "
               "cell). tests/test_hf_experts.py has no GPU test: `experts_implementation` is checked per "
               f"family on CPU only. {_log_versions(gpu_log)}\n" if gpu_log else
               "- **tested on GPU**: no GPU log given.\n")
            + f"\nThis run took {minutes:.0f} min on {len(os.sched_getaffinity(0))} CPU cores "
            f"({args.jobs} families at a time, each in its own process).\n\n"
        )
        with open(args.out, "w") as f:
            f.write(header + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
