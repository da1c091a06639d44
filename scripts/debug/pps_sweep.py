"""Debug (issue 13): the decode buckets' persistent-grid size inside the whole layer.

    PYTHONPATH=src:scripts/debug python3 scripts/debug/pps_sweep.py qwen3:8 mixtral:256 ...
        [--pps 4,8,16,64 | --variants "pps=4;pps=8,stages=2,warps=8"] [--rounds 3] [--out FILE.json]

The tuner never varies `programs_per_sm` below T = 1024 (every decode entry has 4). For each
SHAPE:T[:num_valid] case (num_valid T unless given) this times `safemoe.moe` (ab_entry.layer_step:
route + experts, bf16, CUDA-graph replay over 8 seeded routings) with the bucket's own entry at each
programs_per_sm, the values alternating for --rounds rounds. Only the grid changes (no recompile): a
large value is one program per tile, scheduled by the hardware instead of a static stride.
--variants instead times the entry changed as each `;`-separated spec says (pps, block_m, tiles,
stages, warps: `changed`); the first variant is the baseline of the printed ratios. A measurement
script, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

import torch
from ab_entry import VARIANTS, layer_step, shape_named

from safemoe.bench.harness import time_graph
from safemoe.configs import GEMM2_ENGINES, ExpertsConfig, get_config, load_device_configs, shape_key


def changed(cfg: ExpertsConfig, spec: str) -> ExpertsConfig:
    """cfg with the fields of `spec`, e.g. "pps=8,stages=2,warps=8" (stages and warps of both
    GEMMs) or "bm=64,gm=8,bn1=128,bk1=64,il=1,bn2=256,bk2=64,tma1=1,tma2=0" (block_m, both GEMMs'
    group_m, one GEMM's block_n / block_k / tma, GEMM1's interleave, "eng2=1": GEMM2's engine as an
    index into GEMM2_ENGINES)."""
    fields = {name: int(value) for name, value in (item.split("=") for item in spec.split(",") if item)}

    def gemm(tiles, which: str):
        renames = {"stages": "num_stages", "warps": "num_warps", "gm": "group_m", f"bn{which}": "block_n",
                   f"bk{which}": "block_k", f"tma{which}": "tma", f"w{which}": "num_warps",
                   f"s{which}": "num_stages"}
        if which == "1":
            renames["il"] = "interleave"
        new = {field: fields[name] for name, field in renames.items() if name in fields}
        new = {k: bool(v) if k in ("tma", "interleave") else v for k, v in new.items()}
        if which == "2" and "eng2" in fields:
            new["engine"] = GEMM2_ENGINES[fields["eng2"]]
        return replace(tiles, **new)

    return replace(cfg, programs_per_sm=fields.get("pps", cfg.programs_per_sm),
                   block_m=fields.get("bm", cfg.block_m), gemm1=gemm(cfg.gemm1, "1"),
                   gemm2=gemm(cfg.gemm2, "2"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+", help="SHAPE:T[:num_valid], e.g. qwen3:8 or mixtral:1024:1")
    parser.add_argument("--pps", default="4,8,16,64")
    parser.add_argument("--variants", default="", help='e.g. "pps=4;pps=8,stages=2,warps=8"')
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    table = load_device_configs(torch.cuda.get_device_name(device))  # cached: edits below apply
    specs = args.variants.split(";") if args.variants else [f"pps={v}" for v in args.pps.split(",")]
    results = []
    for case in args.cases:
        prefix, tokens, *valid = case.split(":")
        num_experts, top_k, hidden, inter, _ = shape_named(prefix)
        num_tokens = int(tokens)
        num_valid = int(valid[0]) if valid else num_tokens
        key = shape_key(num_experts, hidden, inter, top_k, torch.bfloat16)
        own = get_config(num_tokens, num_experts, hidden, inter, top_k, torch.bfloat16, device)
        had_entry = num_tokens in table.get(key, {})
        table.setdefault(key, {})
        step = layer_step(prefix, num_tokens, num_valid, device)
        variants = {spec: changed(own, spec) for spec in specs}
        times: dict[str, list[float]] = {spec: [] for spec in specs}
        for _ in range(args.rounds):
            for spec, cfg in variants.items():
                table[key][num_tokens] = cfg
                times[spec].append(time_graph(step, n_variants=VARIANTS, calls_per_graph=10, replays=20))
        if had_entry:
            table[key][num_tokens] = own
        else:
            del table[key][num_tokens]
        med = {v: statistics.median(t) for v, t in times.items()}
        base = med[specs[0]]
        print(f"{case} (entry pps {own.programs_per_sm}): " + ", ".join(
            f"{v}: {m:.2f} us ({m / base - 1:+.1%})" for v, m in med.items()), flush=True)
        results.append({"case": case, "entry": own.to_json(), "us": times, "median_us": med})
        del step
        torch.cuda.empty_cache()
        if args.out:  # after every case: a run cut short keeps what it measured
            args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(device),
                                            "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
