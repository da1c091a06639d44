"""A/B one config-table entry inside the whole layer, interleaved, on a GPU.

    PYTHONPATH=src python scripts/debug/ab_entry.py SHAPE T[:NUM_VALID] BUCKET OTHER_TABLE.json
        [--rounds 5] [--out FILE.json] [--quant block|per_tensor]

Times `safemoe.moe` (route + experts, bf16, a workspace, num_valid as a device tensor, CUDA-graph
replay over 8 seeded routings) at T tokens with NUM_VALID valid rows (default T), once with the
device table as it is ("table") and once with the entry of BUCKET for SHAPE taken from
OTHER_TABLE (a device JSON of another commit or tuning run; "other"), alternating for --rounds
rounds; prints each side's median. The entry need not be the bucket T runs: the few-slot tiles
of a larger bucket come from a smaller bucket's entry (`few_slots_config`), so a T = 1024 padded
step can depend on the T = 8 entry. --quant: fp8 weights of that mode and the shape's fp8 entries
(`E.._fp8-{quant}`). A measurement script, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

import safemoe
from safemoe.bench.experts import SHAPES
from safemoe.bench.harness import time_graph
from safemoe.bench.layer import SHAPES as LAYER_SHAPES
from safemoe.configs import ExpertsConfig, load_device_configs, shape_key
from safemoe.fp8 import quantize_experts
from safemoe.workspace import Workspace

VARIANTS = 8


def shape_named(prefix: str) -> tuple[int, int, int, int, str]:
    """(E, K, H, I, activation) of the bench shape whose name starts with `prefix` ("qwen3",
    "mixtral", "gpt" or "gptoss", "deepseek"; "qwen3next" for the layer suite's Qwen3-Next, silu)."""
    shapes = {**{name: (*eki, "silu") for name, eki in LAYER_SHAPES.items()}, **SHAPES}
    # the experts suite's names first, so "qwen3" stays Qwen3-30B-A3B
    for table in (SHAPES, shapes):
        names = [n for n in table if n.replace("-", "").startswith(prefix.replace("-", ""))]
        if len(names) == 1:
            return shapes[names[0]]
    raise SystemExit(f"shape {prefix!r}: one of {', '.join(shapes)} (a prefix will do)")


def stand_ins(prefix: str, num_tokens: int, input_sets: int, device: torch.device,
              gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(w13, w2, `input_sets` x tensors [T, H]) of the bench shape `prefix`, bf16, drawn from `gen`
    (weights scaled by 1/sqrt of their reduction): what the debug A/B scripts time."""
    num_experts, _, hidden, inter, _ = shape_named(prefix)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=device, dtype=torch.bfloat16, generator=gen)
    w2 = torch.randn(num_experts, hidden, inter, device=device, dtype=torch.bfloat16, generator=gen)
    w13.mul_(hidden**-0.5)
    w2.mul_(inter**-0.5)
    xs = [torch.randn(num_tokens, hidden, device=device, dtype=torch.bfloat16, generator=gen)
          for _ in range(input_sets)]  # fmt: skip
    return w13, w2, xs


def layer_step(prefix: str, num_tokens: int, num_valid: int,
               device: torch.device, quant: str | None = None) -> Callable[[int], torch.Tensor]:
    """`safemoe.moe` of the bench shape `prefix` (seeded bf16 weights scaled by 1/sqrt of their
    reduction, VARIANTS seeded inputs and gate logits, num_valid as a device tensor, one
    workspace) on input set j: the step both A/B scripts time under graph replay. quant
    ("per_tensor" / "block"): the weights quantised to fp8 (`safemoe.fp8.quantize_experts`)."""
    num_experts, top_k, hidden, inter, activation = shape_named(prefix)
    gen = torch.Generator(device=device).manual_seed(0)
    w13, w2, xs = stand_ins(prefix, num_tokens, VARIANTS, device, gen)
    logits = [torch.randn(num_tokens, num_experts, device=device, dtype=torch.bfloat16, generator=gen)
              for _ in range(VARIANTS)]  # fmt: skip
    nv = torch.tensor(num_valid, dtype=torch.int32, device=device)
    scales: dict[str, torch.Tensor] = {}
    if quant is not None:
        w13, w2, w13_scale, w2_scale = quantize_experts(w13, w2, quant)
        scales = {"w13_scale": w13_scale, "w2_scale": w2_scale}
    ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16, device,
                   fp8=quant is not None)

    def step(j: int) -> torch.Tensor:
        return safemoe.moe(xs[j], logits[j], w13, w2, top_k, activation=activation, num_valid=nv,
                           workspace=ws, **scales)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", help="a bench shape or its prefix: qwen3, mixtral, gptoss, deepseek")
    parser.add_argument("tokens", help="T or T:NUM_VALID")
    parser.add_argument("bucket", type=int)
    parser.add_argument("other_table", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quant", choices=("block", "per_tensor"))
    args = parser.parse_args()
    num_experts, top_k, hidden, inter, _ = shape_named(args.shape)
    num_tokens, _, valid = args.tokens.partition(":")
    num_tokens, num_valid = int(num_tokens), int(valid or num_tokens)
    device = torch.device("cuda")
    key = shape_key(num_experts, hidden, inter, top_k, torch.bfloat16, args.quant)
    table = load_device_configs(torch.cuda.get_device_name(device))  # cached: edits below apply
    other_entries = json.loads(args.other_table.read_text()).get("configs", {}).get(key, {})
    if str(args.bucket) not in other_entries:
        raise SystemExit(f"{args.other_table} has no entry {key} T = {args.bucket}")
    if key not in table:
        raise SystemExit(f"this device's table has no entries for {key}")
    # absent from this device's table: its side runs what the nearest bucket's entry gives T
    ours = table[key].get(args.bucket)
    other = ExpertsConfig.from_json(other_entries[str(args.bucket)])

    step = layer_step(args.shape, num_tokens, num_valid, device, args.quant)

    times: dict[str, list[float]] = {"table": [], "other": []}
    def put(cfg: ExpertsConfig | None) -> None:
        if cfg is None:
            table[key].pop(args.bucket, None)
        else:
            table[key][args.bucket] = cfg

    for _ in range(args.rounds):
        for side, cfg in (("table", ours), ("other", other)):
            put(cfg)
            times[side].append(time_graph(step, n_variants=VARIANTS, calls_per_graph=10, replays=20))
    put(ours)
    med = {side: statistics.median(v) for side, v in times.items()}
    result = {
        "device": torch.cuda.get_device_name(device), "shape": args.shape, "quant": args.quant,
        "T": num_tokens,
        "num_valid": num_valid, "bucket": args.bucket, "table": ours.to_json() if ours else None,
        "other": other.to_json(),
        "us": times, "median_us": med, "other_over_table": med["other"] / med["table"],
    }
    print(f"{args.shape} {args.quant or 'bf16'} T={num_tokens} num_valid={num_valid}, entry {args.bucket}: "
          f"table {med['table']:.2f} us, "
          f"other {med['other']:.2f} us ({med['other'] / med['table'] - 1:+.1%}); rounds: table "
          f"{[round(t, 2) for t in times['table']]}, other {[round(t, 2) for t in times['other']]}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
