"""Suite `runtime`: a decode step of a transformers model patched with safemoe, against the stock
model, and the MoE layers' share of the step against the bandwidth floor.

Model: the demo's `gpu` model of `safemoe.demo_models` (Qwen3-30B-A3B dimensions: E=128, K=8,
H=2048, I=768, 151936-token vocabulary; 4 layers, 2 with --quick), random weights, bf16. The
decode step is `safemoe.demo_models.decode_logits`: T one-token sequences, no KV cache, embedding
-> layers -> norm -> lm_head (what the MoE layers see in decode). T = 1 .. 256.

Variants and impls (same model, same weights; the stock rows are measured first, then the model is
patched in place, sharing one `Workspace`):
- `decode-step`: `hf-eager` (transformers' per-expert loop, host syncs: timed eagerly),
  `hf-grouped_mm` (transformers' grouped_mm experts, captured when it can be, else eager) and
  `safemoe` (the patched model under CUDA-graph replay).
- `moe-layers`: the L MoE blocks alone, one after another, on the same inputs: the MoE share of
  the step; `extra.share_of_step` = moe-layers / decode-step of the same impl.

Floors (bytes / streaming-read bandwidth of this run):
- moe-layers: sum over layers of (D_l x 3*H*I + E*H) x 2 bytes, D_l = distinct experts the layer's
  router actually picked for these inputs (counted from safemoe's routing, outside the timing).
- decode-step: the moe-layers bytes + every other parameter read once (attention, norms,
  lm_head) + T embedding rows.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from safemoe.bench.harness import (
    BenchRow,
    DeviceCeilings,
    bytes_floor_us,
    plot_pct_of_floor,
    progress,
    time_auto,
    time_eager,
    time_graph,
)

SUITE = "runtime"
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
QUICK_TOKENS = (1, 8, 64, 256)
N_VARIANTS = 2  # the weights (GBs) dwarf L2 already; two input sets keep activations honest


def _set_experts_implementation(model: Any, name: str) -> None:
    """transformers reads config._experts_implementation at every experts forward."""
    model.config._experts_implementation = name
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_experts_implementation"):
            config._experts_implementation = name


def _moe_blocks(model: Any) -> list[Any]:
    return [layer.mlp for layer in model.model.layers]


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _dense_bytes(model: Any, num_tokens: int) -> int:
    """Bytes of every non-expert parameter a decode step reads (embedding: T rows only)."""
    total = 0
    embed = model.model.embed_tokens.weight
    for name, p in model.named_parameters():
        if ".mlp." in name or p is embed:
            continue
        total += _bytes(p)
    return total + num_tokens * embed.shape[1] * embed.element_size()


def _moe_bytes(model: Any, xs: list[torch.Tensor]) -> int:
    """Bytes the MoE layers must read for input x (variant 0): distinct experts + router, per layer."""
    import safemoe

    config = model.config
    num_experts, top_k = config.num_experts, config.num_experts_per_tok
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    total = 0
    for block in _moe_blocks(model):
        weight = block.gate.weight if hasattr(block, "gate") else block.moe.gate.weight
        logits = xs[0] @ weight.t()
        ids = safemoe.route(logits, top_k, backend="reference").ids  # the experts each token picks
        distinct = int(torch.unique(ids).numel())
        total += (distinct * 3 * hidden * inter + num_experts * hidden) * 2
    return total


def _rows_for(
    impl: str,
    model: Any,
    num_tokens: int,
    ids: list[torch.Tensor],
    xs: list[torch.Tensor],
    floors: dict[str, float],
    timer: Callable[[Callable[[int], object]], tuple[float, str]],
) -> list[BenchRow]:
    from safemoe.demo_models import decode_logits

    positions = torch.zeros(num_tokens, dtype=torch.long, device=ids[0].device)
    blocks = _moe_blocks(model)

    def step(j: int) -> torch.Tensor:
        return decode_logits(model, ids[j], positions)

    def moe_step(j: int) -> torch.Tensor:
        x = xs[j][:, None, :]  # [T, 1, H], what the blocks get in decode
        out = x
        for block in blocks:
            y = block(x)
            out = y[0] if isinstance(y, tuple) else y
        return out

    rows = []
    for variant, fn in (("decode-step", step), ("moe-layers", moe_step)):
        row = BenchRow(SUITE, "qwen3-30b-a3b-dims", num_tokens, variant, impl, None, floors[variant])
        try:
            row.median_us, row.note = timer(fn)
        except Exception as exc:  # keep going: record what went wrong
            text = str(exc).strip().splitlines()
            row.note = f"error: {type(exc).__name__}: {text[0][:160] if text else ''}"
            torch.cuda.synchronize()
        rows.append(row)
    step_us, moe_us = rows[0].median_us, rows[1].median_us
    if step_us and moe_us:
        rows[1].extra["share_of_step"] = round(moe_us / step_us, 3)
    return rows


def _graph_timer(fn: Callable[[int], object]) -> tuple[float, str]:
    return time_graph(fn, n_variants=N_VARIANTS, calls_per_graph=5, replays=20), "graph"


def _auto_timer(fn: Callable[[int], object]) -> tuple[float, str]:
    return time_auto(fn, n_variants=N_VARIANTS, calls_per_graph=5, replays=20, iters=10)


def _eager_timer(fn: Callable[[int], object]) -> tuple[float, str]:
    return time_eager(fn, n_variants=N_VARIANTS, iters=10), "eager (host syncs)"


def run(ceilings: DeviceCeilings, *, quick: bool) -> list[BenchRow]:
    from safemoe.demo_models import build_model, load_config
    from safemoe.integrations.transformers import patch
    from safemoe.workspace import Workspace

    device = torch.device("cuda", torch.cuda.current_device())
    tokens = QUICK_TOKENS if quick else TOKENS
    config = load_config("gpu", num_layers=2 if quick else None)
    model = build_model(config, device, torch.bfloat16)
    generator = torch.Generator(device=device).manual_seed(0)
    inputs: dict[int, tuple[list[torch.Tensor], list[torch.Tensor], dict[str, float]]] = {}
    for num_tokens in tokens:
        ids = [
            torch.randint(0, config.vocab_size, (num_tokens,), device=device, generator=generator)
            for _ in range(N_VARIANTS)
        ]
        xs = [
            torch.randn(
                num_tokens, config.hidden_size, device=device, dtype=torch.bfloat16, generator=generator
            )
            for _ in range(N_VARIANTS)
        ]
        moe_bytes = _moe_bytes(model, xs)
        floors = {
            "moe-layers": bytes_floor_us(moe_bytes, ceilings.read_gbps),
            "decode-step": bytes_floor_us(moe_bytes + _dense_bytes(model, num_tokens), ceilings.read_gbps),
        }
        inputs[num_tokens] = (ids, xs, floors)

    rows: list[BenchRow] = []
    with torch.inference_mode():
        stock: list[tuple[str, str, Any]] = [
            ("hf-eager", "eager", _eager_timer),
            ("hf-grouped_mm", "grouped_mm", _auto_timer),
        ]
        for impl, implementation, timer in stock:
            _set_experts_implementation(model, implementation)
            for num_tokens in progress(tokens, f"runtime suite: {impl}"):
                ids, xs, floors = inputs[num_tokens]
                rows.extend(_rows_for(impl, model, num_tokens, ids, xs, floors, timer))

        workspace = Workspace(
            max(tokens), config.num_experts, config.num_experts_per_tok, config.hidden_size,
            config.moe_intermediate_size, torch.bfloat16, device,
        )  # fmt: skip
        patch(model, workspace=workspace)
        for num_tokens in progress(tokens, "runtime suite: safemoe"):
            ids, xs, floors = inputs[num_tokens]
            rows.extend(_rows_for("safemoe", model, num_tokens, ids, xs, floors, _graph_timer))
    _add_speedups(rows)
    return rows


def _add_speedups(rows: list[BenchRow]) -> None:
    """extra.x_vs_<impl>: that impl's time / safemoe's time, same variant and T."""
    times = {(r.variant, r.tokens, r.impl): r.median_us for r in rows}
    for row in rows:
        if row.impl != "safemoe" or not row.median_us:
            continue
        for peer in ("hf-eager", "hf-grouped_mm"):
            base = times.get((row.variant, row.tokens, peer))
            if base:
                row.extra[f"x_vs_{peer}"] = round(base / row.median_us, 2)


def plot(rows: list[BenchRow], out_dir: Path) -> None:
    plot_pct_of_floor(
        rows, Path(out_dir) / "runtime.png", title="runtime: decode step and MoE layers (% of floor)"
    )
