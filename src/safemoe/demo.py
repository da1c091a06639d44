"""`safemoe demo`: the stock transformers MoE and safemoe side by side on padded decode batches.

A Qwen3-MoE model with random weights is built from a config of `safemoe.demo_models` (tiny on
CPU; on a GPU a few layers at Qwen3-30B-A3B dimensions). A stream of decode-shaped batches (one
new token per sequence, batch sizes drawn at random) is padded up to the CUDA-graph buckets 1, 2, 4,
... and, in every layer, the padding rows of the attention output are overwritten with NaN (what a
stale attention buffer holds in a real engine). The same stream runs through the stock model and
through the safemoe-patched model (bucketed CUDA graphs on a GPU, the same bucketing eagerly on
CPU); each step is also run without padding, and the real rows' next tokens compared.

The step is a decode step without a KV cache (each sequence is one token long): the MoE layers
see exactly the [batch, 1, H] activations they see in decode, and the attention of a one-token
sequence cannot mix rows, so any difference between padded and unpadded runs comes from the MoE.

Probes are forward hooks that only do device work (captured into the graphs with the model):
duplicate expert ids per row from the router's output, non-finite rows of each MoE block's output.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from safemoe.cli import UsageError, int_in, output_file, prepare_output, reports_usage_errors
from safemoe.demo_models import CONFIGS, build_model, decode_logits, load_config
from safemoe.graphs import CUDAGraphRunner
from safemoe.health import Health


# -- probes -----------------------------------------------------------------------------------
class Probes:
    """Forward hooks that poison attention padding rows and record what the MoE layers did.

    `num_valid` is the step's real-row count (a 0-dim tensor; None: no padding, hooks idle).
    Buffers are [layers, max_rows] flags written with device copies, so a graph replays them.
    """

    def __init__(self, model: Any, max_rows: int, device: torch.device) -> None:
        self.num_valid: torch.Tensor | None = None
        layers = model.model.layers
        self.duplicate = torch.zeros(len(layers), max_rows, dtype=torch.bool, device=device)
        self.moe_nonfinite = torch.zeros(len(layers), max_rows, dtype=torch.bool, device=device)
        self.handles = []
        for index, layer in enumerate(layers):
            self.handles.append(layer.self_attn.register_forward_hook(self._poison))
            self.handles.append(layer.mlp.register_forward_hook(self._moe_output(index)))
            router = layer.mlp.moe.gate if hasattr(layer.mlp, "moe") else layer.mlp.gate
            self.handles.append(router.register_forward_hook(self._router_output(index)))

    def _padding_rows(self, rows: int, device: torch.device) -> torch.Tensor:
        assert self.num_valid is not None
        return torch.arange(rows, device=device) >= self.num_valid  # [rows] bool

    def _poison(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.num_valid is None:
            return output
        attn, *rest = output  # attn [B, 1, H]
        pad = self._padding_rows(attn.shape[0], attn.device)
        return (attn.masked_fill(pad[:, None, None], math.nan), *rest)

    def _router_output(self, index: int):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            # stock router: (logits, scores, ids [T, K] int64); safemoe Gate: (weights, ids)
            ids = output[-1]
            ordered = torch.sort(ids, dim=-1).values
            same = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)  # -1 is padding
            self.duplicate[index, : ids.shape[0]].copy_(same.any(dim=-1))

        return hook

    def _moe_output(self, index: int):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            rows = out.reshape(-1, out.shape[-1])
            self.moe_nonfinite[index, : rows.shape[0]].copy_(~torch.isfinite(rows).all(dim=-1))

        return hook

    def clear(self) -> None:
        self.duplicate.zero_()
        self.moe_nonfinite.zero_()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


# -- the stream -------------------------------------------------------------------------------
@dataclass
class SideResult:
    side: str
    mode: str
    steps: int = 0
    steps_with_padding: int = 0
    padding_rows_nan_filled: int = 0
    moe_nonfinite_padding_rows: int = 0
    nan_leaked_real_rows: int = 0
    duplicate_id_rows: int = 0
    crashes: int = 0
    tokens_differ: int = 0
    real_rows: int = 0
    step_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    health: dict[str, int] | None = None

    @property
    def median_ms(self) -> float | None:
        return statistics.median(self.step_ms) if self.step_ms else None


def make_stream(steps: int, max_batch: int, vocab: int, seed: int) -> list[torch.Tensor]:
    """Token batches of random sizes in [1, max_batch]; every fourth one a power of two (no padding)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for step in range(steps):
        size = int(torch.randint(1, max_batch + 1, (1,), generator=generator))
        if step % 4 == 3:
            size = 1 << (size.bit_length() - 1)
        batches.append(torch.randint(0, vocab, (size,), generator=generator))
    return batches


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_side(
    side: str,
    model: Any,
    stream: list[torch.Tensor],
    max_batch: int,
    device: torch.device,
    *,
    set_model_num_valid: Any = None,
    health: Health | None = None,
) -> SideResult:
    """Run the stream through `model`: padded (graphs on CUDA) with NaN-poisoned padding, and
    unpadded eagerly for the token comparison."""
    probes = Probes(model, max_batch, device)
    positions = torch.zeros(max_batch, dtype=torch.long, device=device)

    def step(input_ids: torch.Tensor, num_valid: torch.Tensor) -> torch.Tensor:
        return decode_logits(model, input_ids, positions[: input_ids.shape[0]])

    example = torch.zeros(max_batch, dtype=torch.long, device=device)
    result = SideResult(side=side, mode="")
    # One device scalar for the whole side: the runner sets it, the hooks and the patched blocks
    # read it (captured graphs keep reading the same storage).
    num_valid = torch.zeros((), dtype=torch.int32, device=device)
    probes.num_valid = num_valid
    if set_model_num_valid is not None:
        set_model_num_valid(num_valid)
    with torch.inference_mode():
        runner: CUDAGraphRunner | None = None
        if device.type == "cuda":
            try:
                runner = CUDAGraphRunner(step, max_batch, example, num_valid=num_valid)
                result.mode = "CUDA graphs"
            except RuntimeError as error:
                result.errors.append(f"capture: {error}"[:300])
        if runner is None:
            runner = CUDAGraphRunner(
                step, max_batch, example, num_valid=num_valid, allow_eager=True, force_eager=True
            )
            result.mode = "eager" if not result.errors else "eager (graph capture failed)"
        for input_ids in stream:
            batch = input_ids.shape[0]
            bucket = runner.bucket_for(batch)
            result.steps += 1
            result.real_rows += batch
            if bucket > batch:
                result.steps_with_padding += 1
                result.padding_rows_nan_filled += bucket - batch
            try:
                probes.clear()
                input_ids = input_ids.to(device)
                _sync(device)
                start = time.perf_counter()
                logits = runner(input_ids).clone()  # [B, V]
                _sync(device)
                result.step_ms.append((time.perf_counter() - start) * 1e3)
                duplicate = probes.duplicate[:, :bucket].cpu()
                nonfinite = probes.moe_nonfinite[:, :bucket].cpu()
                real_bad = ~torch.isfinite(logits).all(dim=-1).cpu() | nonfinite[:, :batch].any(dim=0)
                result.duplicate_id_rows += int(duplicate.sum())
                result.moe_nonfinite_padding_rows += int(nonfinite[:, batch:].sum())
                result.nan_leaked_real_rows += int(real_bad.sum())
                result.tokens_differ += _tokens_differ(
                    model, probes, input_ids, positions, logits, runner, set_model_num_valid
                )
            except Exception as error:  # a crash is a result: record it, keep streaming
                result.crashes += 1
                result.errors.append(f"step {result.steps}: {type(error).__name__}: {error}"[:300])
                if device.type == "cuda" and "illegal memory access" in str(error):
                    break  # the CUDA context is gone; nothing after this can run
    probes.remove()
    if health is not None:
        result.health = health.read()
    return result


def _tokens_differ(
    model: Any,
    probes: Probes,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    padded_logits: torch.Tensor,
    runner: CUDAGraphRunner,
    set_model_num_valid: Any,
) -> int:
    """Real rows whose next token differs from an eager run of exactly those rows, no padding."""
    probes.num_valid = None
    if set_model_num_valid is not None:
        set_model_num_valid(None)
    try:
        plain = decode_logits(model, input_ids, positions[: input_ids.shape[0]])
    finally:
        probes.num_valid = runner.num_valid
        if set_model_num_valid is not None:
            set_model_num_valid(runner.num_valid)
    return int((plain.argmax(dim=-1) != padded_logits.argmax(dim=-1)).sum())


# -- report -----------------------------------------------------------------------------------
ROWS = (
    ("steps", "steps"),
    ("steps with padding", "steps_with_padding"),
    ("padding rows NaN-filled (per layer)", "padding_rows_nan_filled"),
    ("MoE outputs non-finite in padding rows (row x layer)", "moe_nonfinite_padding_rows"),
    ("NaN leaked into real rows", "nan_leaked_real_rows"),
    ("rows with duplicate expert ids (row x layer)", "duplicate_id_rows"),
    ("crashes", "crashes"),
    ("tokens that differ from the unpadded run", "tokens_differ"),
)


def print_report(results: list[SideResult], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("")
    for r in results:
        table.add_column(f"{r.side}\n({r.mode})", justify="right")
    for label, key in ROWS:
        table.add_row(label, *(str(getattr(r, key)) for r in results))
    table.add_row("real rows", *(str(r.real_rows) for r in results))
    table.add_row(
        "time per step (median ms)",
        *(f"{r.median_ms:.2f}" if r.median_ms is not None else "-" for r in results),
    )
    console = Console()
    console.print(table)
    for r in results:
        if r.health is not None:
            console.print(f"{r.side} health counters: {r.health}")
        for error in r.errors[:5]:
            console.print(f"[yellow]{r.side}: {error}[/yellow]")


# -- CLI --------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "The stock transformers Qwen3-MoE and the same model patched by safemoe, on a stream of padded "
        "decode batches whose padding rows hold NaN. Exit status: 1 if safemoe crashed, leaked NaN into real "
        "rows or produced duplicate ids (the stock side is reported, never judged); 2 for a usage error; "
        "0 otherwise."
    )
    parser.add_argument(
        "--quick", action="store_true", help="a few steps on the tiny model (seconds, for CI)"
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the model runs: cuda if available (auto), else cpu",
    )
    parser.add_argument(
        "--config",
        default=None,
        help=f"{' or '.join(CONFIGS)} (shipped), or the path of a Qwen3-MoE config JSON (default: gpu on "
        "CUDA, tiny otherwise)",
    )
    parser.add_argument("--layers", type=int_in(1), default=None, help="override the number of layers (>= 1)")
    parser.add_argument(
        "--steps", type=int_in(1), default=None, help="decode steps, >= 1 (default 48, 8 with --quick)"
    )
    parser.add_argument(
        "--max-batch",
        type=int_in(1),
        default=None,
        help="largest batch, >= 1 (default 256 on CUDA, 24 on CPU, 8 with --quick)",
    )
    parser.add_argument("--seed", type=int_in(0), default=0, help="seed of the weights and the stream, >= 0")
    parser.add_argument(
        "--json",
        type=output_file,
        default=None,
        help="also write the results as JSON (checked before the run; a missing parent directory is "
        "created, with a line saying so)",
    )


# Qwen3-MoE config fields the demo's model needs, each an integer >= 1.
_CONFIG_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "num_experts",
    "num_experts_per_tok",
)


def _load_config(name: str, layers: int | None) -> Any:
    """The model config, or a UsageError naming --config: a name that is neither shipped nor a file,
    a file that is not a JSON object of a Qwen3-MoE config, or sizes the model cannot have."""
    if name not in CONFIGS:
        path = Path(name)
        if not path.is_file():
            shipped = ", ".join(CONFIGS)
            what = "is not a file" if path.exists() else "does not exist"
            raise UsageError("--config", f"{name!r} {what}; give {shipped} or the path of a config JSON")
    try:
        config = load_config(name, layers)
    except Exception as error:  # JSON syntax, not an object, fields transformers refuses
        reason = f"{type(error).__name__}: {error}"
        raise UsageError("--config", f"{name!r}: not a Qwen3-MoE config: {reason}") from None

    def size_ok(field: str) -> bool:
        value = getattr(config, field, None)
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    bad = [f for f in _CONFIG_SIZES if not size_ok(f)]
    if bad:
        values = ", ".join(f"{f}={getattr(config, f, None)!r}" for f in bad)
        raise UsageError("--config", f"{name!r}: these must be integers >= 1: {values}")
    if config.num_experts_per_tok > config.num_experts:
        raise UsageError(
            "--config",
            f"{name!r}: num_experts_per_tok={config.num_experts_per_tok} > num_experts={config.num_experts}",
        )
    return config


@reports_usage_errors("demo")
def run(args: argparse.Namespace) -> int:
    """Every argument is checked (UsageError) before the model is built."""
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device", "cuda: no CUDA device is available here (use --device cpu or auto)")
    else:
        device = torch.device(args.device)
    if importlib.util.find_spec("transformers") is None:
        print("safemoe demo: error: needs transformers: pip install 'safemoe[hf]'", file=sys.stderr)
        return 2
    from safemoe.integrations.transformers import patch, set_num_valid
    on_gpu = device.type == "cuda"
    quick = bool(args.quick)
    config_name = args.config if args.config is not None else ("gpu" if on_gpu and not quick else "tiny")
    steps = args.steps if args.steps is not None else (8 if quick else 48)
    max_batch = args.max_batch if args.max_batch is not None else (8 if quick else (256 if on_gpu else 24))
    dtype = torch.bfloat16 if on_gpu else torch.float32
    config = _load_config(config_name, args.layers)
    if args.json is not None:
        prepare_output(args.json, "demo", "--json")
    stream = make_stream(steps, max_batch, config.vocab_size, args.seed)

    try:
        model = build_model(config, device, dtype, args.seed)
    except (torch.OutOfMemoryError, MemoryError) as error:
        model_name = f"{config.num_hidden_layers} layers of {config_name}"
        raise UsageError(
            "--config" if args.layers is None else "--layers",
            f"the model ({model_name}) does not fit on {device}: {error}",
        ) from None
    except Exception as error:
        if config_name in CONFIGS:
            raise  # a shipped config that does not build is safemoe's bug: show it whole
        reason = f"{type(error).__name__}: {error}"
        raise UsageError("--config", f"{config_name!r}: no model can be built from it: {reason}") from None
    stock_impl = getattr(model.config, "_experts_implementation", None) or "eager"
    stock = run_side(f"stock transformers (experts: {stock_impl})", model, stream, max_batch, device)

    # Patching reuses the same weights (no copy): the two sides compute the same function.
    health = Health(device)
    patch(model, health=health)
    patched = run_side(
        "safemoe",
        model,
        stream,
        max_batch,
        device,
        set_model_num_valid=lambda nv: set_num_valid(model, nv),
        health=health,
    )
    results = [stock, patched]
    title = (
        f"safemoe demo: {config_name} Qwen3-MoE ({config.num_hidden_layers} layers, "
        f"E={config.num_experts}, K={config.num_experts_per_tok}, H={config.hidden_size}) on "
        f"{_device_name(device)}, {str(dtype)[6:]}, {steps} steps, batches 1..{max_batch}"
    )
    print_report(results, title)
    if args.json is not None:
        payload = {"title": title, "results": [asdict(r) | {"median_ms": r.median_ms} for r in results]}
        args.json.write_text(json.dumps(payload, indent=2))
    # The demo fails only if safemoe itself misbehaved; the stock side is recorded, not judged.
    ok = patched.crashes == 0 and patched.nan_leaked_real_rows == 0 and patched.duplicate_id_rows == 0
    return 0 if ok else 1


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
