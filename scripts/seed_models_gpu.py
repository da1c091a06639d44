"""The seed models on one GPU (issue 12): Qwen3-Next and Qwen3.5-MoE with their real MoE dimensions,
patched by safemoe, captured in CUDA graphs for every token bucket up to 8192 with NaN in the padded
rows, and the MoE block's decode-step time per layer against the same model's transformers
`grouped_mm` experts, in the same run.

    PYTHONPATH=src python3 scripts/seed_models_gpu.py OUT_DIR [--models qwen3_next,qwen3_5_moe]

What is built: `AutoModelForCausalLM.from_config` with the family's real hidden size, experts, top-k,
expert and shared-expert widths and attention heads, random weights (bf16), a reduced vocabulary
(32,000: the lm head is not what is measured) and few layers (the whole model does not fit one GPU):
Qwen3-Next-80B-A3B with 4 layers (3 linear-attention + 1 full-attention, its repeating unit),
Qwen3.5-397B-A17B with 2 (1 + 1; one layer's experts hold 12.9 GB in bf16).

1. Decode-step time of one MoE block (router + routed experts + shared expert, what patch()
   replaces) at T = 1..256, timed under CUDA-graph replay (eager where a side cannot be captured:
   the table says which), stock `grouped_mm` experts first, then the same block patched.
2. The whole patched model (`inputs_embeds` -> logits) captured by `safemoe.CUDAGraphRunner` for
   every bucket 1, 2, 4, ..., 8192, one 0-dim device count shared by every graph (set_num_valid).
   Each patched MoE block's input gets NaN in its rows at or past the count (a captured pre-hook:
   attention leaves NaN there in the reported bugs) and the padded embedding rows hold large
   garbage. Per bucket, replays with several real counts: real rows' logits finite, bitwise equal
   to the same replay with zero padding, padded rows never routed (health: non-finite rows 0,
   padded rows = layers x (bucket - count)).

Writes OUT_DIR/seed_models.json and seed_models.md (device, date, every number) and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from safemoe import Health, Workspace
from safemoe.bench.harness import run_info, time_auto
from safemoe.graphs import CUDAGraphRunner, token_buckets
from safemoe.integrations.transformers import patch, patched_blocks, set_num_valid

VOCAB = 32000
DECODE_TOKENS = (1, 8, 32, 64, 128, 256)
# Real MoE dimensions: Qwen3-Next-80B-A3B as transformers' Qwen3NextConfig defaults;
# Qwen3.5-397B-A17B as its published config (H 4096, 512 experts, top-10, expert and shared widths 1024,
# 32 query heads, 2 KV heads; linear attention 16 key heads, 64 value heads).
MODELS: dict[str, dict] = {
    "qwen3_next": dict(
        config="Qwen3NextConfig",
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        dims=dict(
            hidden_size=2048,
            num_experts=512,
            num_experts_per_tok=10,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
        ),
    ),
    "qwen3_5_moe": dict(
        config="Qwen3_5MoeTextConfig",
        layer_types=["linear_attention", "full_attention"],
        dims=dict(
            hidden_size=4096,
            num_experts=512,
            num_experts_per_tok=10,
            moe_intermediate_size=1024,
            shared_expert_intermediate_size=1024,
            num_attention_heads=32,
            num_key_value_heads=2,
            linear_num_key_heads=16,
            linear_num_value_heads=64,
        ),
    ),
}


def build(name: str, full_attention_only: bool = False) -> torch.nn.Module:
    import transformers

    spec = dict(MODELS[name])
    if full_attention_only:
        spec["layer_types"] = ["full_attention"] * len(spec["layer_types"])
    cls = getattr(transformers, spec["config"], None)
    if cls is None:
        raise RuntimeError(f"transformers {transformers.__version__} has no {spec['config']}")
    cfg = cls(vocab_size=VOCAB, num_hidden_layers=len(spec["layer_types"]), layer_types=spec["layer_types"],
              **spec["dims"])  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    return model


def moe_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer.mlp for layer in model.model.layers]


def decode_times(model: torch.nn.Module, hidden: int) -> dict[int, tuple[float, str]]:
    block = moe_blocks(model)[0]
    out = {}
    for t in DECODE_TOKENS:
        xs = [torch.randn(1, t, hidden, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
        us, how = time_auto(lambda j: block(xs[j]), n_variants=len(xs), calls_per_graph=10, replays=20)  # noqa: B023
        out[t] = (us, how)
    return out


def nan_hooks(model: torch.nn.Module, count: torch.Tensor) -> list:
    """NaN into the rows at or past `count` of every patched block's input (device ops: captured)."""

    def before(block, args):
        (x,) = args
        rows = torch.arange(x.shape[-2], device=x.device).view(*([1] * (x.dim() - 2)), -1, 1)
        return (torch.where(rows >= count, torch.full_like(x, math.nan), x),)

    return [b.register_forward_pre_hook(before) for b in patched_blocks(model)]


def bucket_checks(model: torch.nn.Module, hidden: int, max_tokens: int, health: Health) -> list[dict]:
    count = torch.zeros((), dtype=torch.int32, device="cuda")
    set_num_valid(model, count)
    handles = nan_hooks(model, count)
    layers = len(patched_blocks(model))

    def forward(x: torch.Tensor, num_valid: torch.Tensor) -> torch.Tensor:
        return model(inputs_embeds=x[None], use_cache=False).logits[0]

    started = time.perf_counter()
    runner = CUDAGraphRunner(forward, max_tokens, torch.zeros(1, hidden, dtype=torch.bfloat16, device="cuda"),
                             num_valid=count)  # fmt: skip
    capture_s = time.perf_counter() - started
    rows = []
    generator = torch.Generator(device="cuda").manual_seed(1)
    static_x, static_out = runner.static_inputs[0], runner.static_outputs[0]

    def replay(bucket: int, x: torch.Tensor, padding: float) -> torch.Tensor:
        """The bucket's own graph with len(x) real rows (not the smallest bucket that fits)."""
        real = x.shape[0]
        static_x[:real].copy_(x)
        static_x[real:bucket].fill_(padding)
        count.fill_(real)
        runner.graphs[bucket].replay()
        return static_out[:real].clone()

    for bucket in runner.buckets:
        for real in sorted({bucket, max(1, bucket // 2 + 1), 1}):
            x = torch.randn(real, hidden, dtype=torch.bfloat16, device="cuda", generator=generator)
            clean = replay(bucket, x, 0.0)
            torch.cuda.synchronize()
            health.reset()
            poisoned = replay(bucket, x, 3e4)  # large finite garbage in the padded embeddings
            counts = health.read()
            rows.append(
                dict(
                    bucket=bucket,
                    real=real,
                    real_rows_finite=bool(torch.isfinite(poisoned.float()).all()),
                    bitwise_equal_to_clean_padding=bool(torch.equal(poisoned, clean)),
                    nonfinite_rows=counts["nonfinite_rows"],
                    dropped_slots=counts["dropped_slots"],
                    padded_rows=counts["padded_rows"],
                    expected_padded_rows=layers * (bucket - real),
                )
            )
    for h in handles:
        h.remove()
    set_num_valid(model, None)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return [dict(capture_all_buckets_s=round(capture_s, 1)), *rows]


def run_model(name: str, max_tokens: int, full_attention_only: bool = False) -> dict:
    model = build(name, full_attention_only)
    hidden = model.config.hidden_size
    result: dict = {
        "model": name,
        "config": {k: getattr(model.config, k) for k in MODELS[name]["dims"]},
        "layers": model.config.num_hidden_layers,
        "layer_types": list(model.config.layer_types),
    }
    model.set_experts_implementation("grouped_mm")
    with torch.inference_mode():
        stock = decode_times(model, hidden)
        health = Health("cuda")
        cfg = model.config
        workspace = Workspace(max_tokens, cfg.num_experts, cfg.num_experts_per_tok, hidden,
                              cfg.moe_intermediate_size, torch.bfloat16, "cuda")  # fmt: skip
        patch(model, backend="triton", workspace=workspace, health=health)
        ours = decode_times(model, hidden)
        result["decode"] = [
            dict(T=t, stock_us=round(stock[t][0], 1), stock_timed=stock[t][1],
                 safemoe_us=round(ours[t][0], 1), safemoe_timed=ours[t][1],
                 speedup=round(stock[t][0] / ours[t][0], 2))
            for t in DECODE_TOKENS
        ]  # fmt: skip
        result["workspace_bytes"] = workspace.nbytes
        checks = bucket_checks(model, hidden, max_tokens, health)
    result["capture_all_buckets_s"] = checks[0]["capture_all_buckets_s"]
    result["buckets"] = checks[1:]
    del model
    torch.cuda.empty_cache()
    return result


def markdown(info: dict, results: list[dict]) -> str:
    lines = [f"# Seed models on {info.get('device')} ({info.get('date')})", "",
             f"torch {info.get('torch')}, triton {info.get('triton')}; bf16, random weights, real MoE dims; "
             "generated by `scripts/seed_models_gpu.py`.", ""]  # fmt: skip
    for r in results:
        if "error" in r:
            lines += [f"## {r['model']}: FAILED", "", "```", r["error"], "```", ""]
            continue
        lines += [f"## {r['model']} ({r['layers']} layers: {', '.join(r['layer_types'])}; {r['config']})", "",
                  *([f"Hybrid layers failed ({r['hybrid_error']}); this run uses full attention only.", ""]
                    if r.get("hybrid_error") else []),
                  "MoE block decode step, per layer (router + experts + shared expert), µs:", "",
                  "| T | transformers grouped_mm | safemoe | speedup |", "|---|---|---|---|"]  # fmt: skip
        for d in r["decode"]:
            note = "" if d["stock_timed"] == "graph" else " (eager: not capturable)"
            lines.append(f"| {d['T']} | {d['stock_us']}{note} | {d['safemoe_us']} | {d['speedup']}x |")
        bad = [
            b
            for b in r["buckets"]
            if not (
                b["real_rows_finite"]
                and b["bitwise_equal_to_clean_padding"]
                and b["nonfinite_rows"] == 0
                and b["padded_rows"] == b["expected_padded_rows"]
            )
        ]
        lines += ["", f"CUDA graphs: {len(token_buckets(max(b['bucket'] for b in r['buckets'])))} buckets "
                  f"captured in {r['capture_all_buckets_s']} s; {len(r['buckets'])} replays with NaN-filled "
                  f"padding: {len(r['buckets']) - len(bad)} clean, {len(bad)} violating.", "",
                  "| bucket | real rows | real logits finite | bitwise = zero padding | non-finite routed | "
                  "padded rows (expected) |", "|---|---|---|---|---|---|"]  # fmt: skip
        for b in r["buckets"]:
            lines.append(f"| {b['bucket']} | {b['real']} | {b['real_rows_finite']} | "
                         f"{b['bitwise_equal_to_clean_padding']} | {b['nonfinite_rows']} | "
                         f"{b['padded_rows']} ({b['expected_padded_rows']}) |")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--max-tokens", type=int, default=8192)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    info = run_info()
    info["date"] = time.strftime("%Y-%m-%d", time.gmtime())
    results = []
    for name in args.models.split(","):
        import traceback

        try:
            results.append(run_model(name, args.max_tokens))
        except Exception as exc:  # the linear-attention fallback may not capture: retry without it
            first = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            print(f"{name}: {first}\n{traceback.format_exc()[-2000:]}", file=sys.stderr)
            torch.cuda.empty_cache()
            try:
                result = run_model(name, args.max_tokens, full_attention_only=True)
                result["hybrid_error"] = first
                results.append(result)
            except Exception:
                results.append({"model": name, "error": traceback.format_exc()[-3000:]})
        torch.cuda.empty_cache()
        (args.out / "seed_models.json").write_text(json.dumps({"info": info, "results": results}, indent=1))
    text = markdown(info, results)
    (args.out / "seed_models.md").write_text(text)
    print(text)
    failed = any("error" in r for r in results) or any(
        not (b["real_rows_finite"] and b["bitwise_equal_to_clean_padding"] and b["nonfinite_rows"] == 0
             and b["padded_rows"] == b["expected_padded_rows"])
        for r in results if "buckets" in r for b in r["buckets"])  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
