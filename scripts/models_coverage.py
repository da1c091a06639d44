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

    python3 scripts/models_coverage.py                       # print the table
    python3 scripts/models_coverage.py --out docs/models.md  # and write it (with a header)
    python3 scripts/models_coverage.py --only mixtral,gpt_oss -v

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
from dataclasses import asdict, dataclass
from typing import Any

if __name__ == "__main__":  # the Triton interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
from torch import nn

RTOL = ATOL = 1e-4
NEW_TOKENS = 4
VOCAB = 128
MAX_PARAMS = 60_000_000  # a "tiny" model larger than this is not built (named as the reason)

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
        return Row(family, names, reason, reason, time.perf_counter() - start)
    want, tokens = logits(stock), generate(stock)

    try:
        patched = patch(copy.deepcopy(stock))
        patch_result = _mode(want, tokens, patched)
    except ValueError as exc:  # patch names the block class it does not support
        patch_result = f"no: {str(exc).split(': supported MoE blocks are')[0]}"
    except Exception as exc:
        patch_result = f"no: {type(exc).__name__}: {exc}"

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
    return Row(family, names, patch_result, result, time.perf_counter() - start)


# -- the table ---------------------------------------------------------------------------------


def _cell(text: str) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= 240 else text[:237] + "..."


def table(rows: list[Row]) -> str:
    lines = ["| family | experts class | patch | experts_implementation | fp8 | tested on GPU |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.family} | {_cell(r.classes)} | {_cell(r.patch)} | "
                     f"{_cell(r.experts_implementation)} | — | — |")
    n = len(rows)
    ok_patch = sum(r.patch == "yes" for r in rows)
    ok_impl = sum(r.experts_implementation == "yes" for r in rows)
    lines.append("")
    lines.append(f"{n} families; patch: {ok_patch} pass; experts_implementation=\"safemoe\": {ok_impl} pass.")
    return "\n".join(lines)


def _run_isolated(family: str, classes: list[str], timeout: float) -> Row:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", family, "--classes", ",".join(classes)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        reason = f"no: not finished in {timeout:.0f} s on this CPU"
        return Row(family, ", ".join(classes), reason, reason, timeout)
    for line in proc.stdout.splitlines()[::-1]:
        if line.startswith("ROW "):
            return Row(**json.loads(line[4:]))
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    reason = f"no: the check process died (exit {proc.returncode}: {tail})"
    return Row(family, ", ".join(classes), reason, reason)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="also write the table, with a header, to this file")
    parser.add_argument("--only", help="comma-separated families")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per family")
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("-v", "--verbose", action="store_true")
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

    families = moe_families()
    if args.only:
        wanted = args.only.split(",")
        families = {f: families.get(f, []) for f in wanted}
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {f: pool.submit(_run_isolated, f, c, args.timeout) for f, c in families.items()}
        rows = []
        for family, fut in futures.items():
            row = fut.result()
            rows.append(row)
            if args.verbose:
                print(f"{family}: patch={row.patch} | experts_implementation={row.experts_implementation} "
                      f"({row.seconds:.1f} s)", file=sys.stderr, flush=True)
    text = table(rows)
    print(text)
    if args.out:
        header = (
            "# Model coverage\n\n"
            f"Generated by `python3 scripts/models_coverage.py --out {args.out}` on {args.date}, "
            f"transformers {transformers.__version__}, torch {torch.__version__}, CPU (fp32). Every family "
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
            "- **fp8**: this column is not filled yet. fp8 checkpoints (transformers' `FP8Experts`, "
            "128x128 blocks) through `patch()` are tested for Qwen3-MoE, DeepSeek-V3 and Qwen3-Next "
            "in `tests/test_fp8_checkpoints.py` (see docs/fp8.md). **tested on GPU**: not yet (CPU only)."
            "\n\n"
        )
        with open(args.out, "w") as f:
            f.write(header + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
