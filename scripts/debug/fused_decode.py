"""A/B the fused few-slot launch (`ExpertsConfig.fused`) inside the whole layer, interleaved, on a GPU.

    PYTHONPATH=src python scripts/debug/fused_decode.py [--shapes qwen3 gptoss mixtral deepseek]
        [--rounds 5] [--out FILE.json]

For every shape and every bucket whose calls all take the few-slot path (T = 1 and
`few_slots_bucket(K)`), times `safemoe.moe` (route + experts, bf16, a workspace, num_valid as a
device tensor, CUDA-graph replay over 8 seeded routings) with the device table's entry as it is
("two": GEMM1 and GEMM2 in two launches) and with `fused` on in a few variants (`_variants`),
alternating for --rounds rounds; prints each variant's median, and checks the fused
outputs bitwise against the two launches'. --variants also takes "fused:g1n=64,g2n=128,..."
(`_fused_with`) and any variant with "+pack" or "-pack" appended (`_use`: the packed 16-row
tiles of kernels/experts.py PACK_FUSED_ROWS on or off for it). A measurement script, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

import torch
import triton

import safemoe.kernels.experts as experts_module
from safemoe.bench.harness import time_graph
from safemoe.configs import ExpertsConfig, get_config, load_device_configs, shape_key
from safemoe.kernels.experts import few_slots_bucket


def _variants(cfg: ExpertsConfig, names: list[str] | None = None) -> dict[str, ExpertsConfig]:
    """The entry as it is ("two"), fused, fused with GEMM2's K step cut to 128 / 64 (its shared
    memory per stage then no larger than GEMM1's on the tuned decode tiles: the fused launch
    has one num_stages, gemm1's, and the larger footprint sets its occupancy), fused with
    gemm2's num_warps/num_stages for both, and fused with 1, 2 or 3 programs per SM (the grid
    beyond the resident programs only claims nothing and exits); `names` picks some."""
    two, fused = dataclasses.replace(cfg, fused=False), dataclasses.replace(cfg, fused=True)
    variants = {"two": two, "fused": fused}
    for block_k in (128, 64):
        if cfg.gemm2.block_k > block_k:
            variants[f"fused_k{block_k}"] = dataclasses.replace(
                fused, gemm2=dataclasses.replace(cfg.gemm2, block_k=block_k))
    variants["fused_g2stages"] = dataclasses.replace(fused, gemm1=dataclasses.replace(
        cfg.gemm1, num_warps=cfg.gemm2.num_warps, num_stages=cfg.gemm2.num_stages))
    for programs in (1, 2, 3):
        variants[f"fused_pps{programs}"] = dataclasses.replace(fused, programs_per_sm=programs)
    # shallower pipelines (more programs an SM) and wider GEMM1 tiles for the fused launch
    for stages in (2, 3, 4):
        variants[f"fused_s{stages}"] = dataclasses.replace(fused, gemm1=dataclasses.replace(
            cfg.gemm1, num_stages=stages))
    variants["fused_n64"] = dataclasses.replace(fused, gemm1=dataclasses.replace(cfg.gemm1, block_n=64))
    if names:
        for name in names:
            base = _without_pack_suffix(name)
            if base.startswith("fused:"):
                variants[name] = _fused_with(fused, base)
            elif base != name and base in variants:
                variants[name] = variants[base]
        variants = {"two": two, **{name: variants[name] for name in names if name in variants}}
    return variants


PACK_SUFFIXES = ("+pack", "-pack")


def _without_pack_suffix(name: str) -> str:
    for suffix in PACK_SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


_OVERRIDES = {"g1n": ("gemm1", "block_n"), "g1k": ("gemm1", "block_k"), "g1s": ("gemm1", "num_stages"),
              "g1w": ("gemm1", "num_warps"), "g2n": ("gemm2", "block_n"), "g2k": ("gemm2", "block_k")}


def _fused_with(fused: ExpertsConfig, name: str) -> ExpertsConfig:
    """A variant named "fused:g1n=64,g1s=4,pps=2": the fused config with those fields changed
    (g1n/g1k/g1s/g1w: gemm1's block_n/block_k/num_stages/num_warps; g2n/g2k: gemm2's block_n/block_k;
    pps: programs_per_sm)."""
    cfg = fused
    for item in name.split(":", 1)[1].split(","):
        key, value = item.split("=")
        if key == "pps":
            cfg = dataclasses.replace(cfg, programs_per_sm=int(value))
        else:
            gemm, field = _OVERRIDES[key]
            tiles = dataclasses.replace(getattr(cfg, gemm), **{field: int(value)})
            cfg = dataclasses.replace(cfg, **{gemm: tiles})
    return cfg


def kernel_times(step, calls: int = 8) -> dict[str, float]:
    """Mean device microseconds a call of each kernel `step(j)` launches (torch.profiler, eager)."""
    from torch.profiler import ProfilerActivity, profile

    for j in range(2):
        step(j)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for j in range(calls):
            step(j % VARIANTS_FOR_PROFILE)
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            totals[event.name] = totals.get(event.name, 0.0) + event.device_time_total / calls
    return {name[:40]: round(us, 1) for name, us in sorted(totals.items(), key=lambda kv: -kv[1])}


VARIANTS_FOR_PROFILE = 8
DEFAULT_PACK = experts_module.PACK_FUSED_ROWS


def _use(entries: dict, num_tokens: int, side: str, variant: ExpertsConfig) -> None:
    """Serve T with `variant`; a side named "...+pack" runs with kernels/experts.py PACK_FUSED_ROWS
    on (each expert's slots packed into 16-row tiles in a fused bucket of up to 64 slots), "...-pack"
    with it off (32-row tiles, up to 32 slots); other sides run the module's defaults. (Packed
    buckets of 65-128 slots, PACKED_FUSED_SLOTS raised to 128 with a 256-counter few_sync, were
    12-53% slower than two launches on an H200, 2026-12-02: bench/results/logs/
    packed_on_ab_NVIDIA-H200_2026-12-02.txt.)"""
    entries[num_tokens] = variant
    experts_module.PACK_FUSED_ROWS = DEFAULT_PACK
    if side.endswith("+pack"):
        experts_module.PACK_FUSED_ROWS = True
    elif side.endswith("-pack"):
        experts_module.PACK_FUSED_ROWS = False


def measure(table: dict, name: str, num_tokens: int, rounds: int, names: list[str] | None = None,
            profile_kernels: bool = False) -> dict:
    """Median layer us per variant at T = num_tokens, the table's entry restored after."""
    from ab_entry import VARIANTS, layer_step, shape_named  # scripts/debug, beside this file

    device = torch.device("cuda")
    num_experts, top_k, hidden, inter, _ = shape_named(name)
    key = shape_key(num_experts, hidden, inter, top_k, torch.bfloat16)
    cfg = get_config(num_tokens, num_experts, hidden, inter, top_k, torch.bfloat16, device)
    entries = table.setdefault(key, {})
    had = entries.get(num_tokens)
    step = layer_step(name, num_tokens, num_tokens, device)

    variants = _variants(cfg, names)
    bits = {}
    for side, variant in list(variants.items()):
        _use(entries, num_tokens, side, variant)
        try:
            bits[side] = step(0).view(torch.int16).clone()
        except triton.runtime.errors.OutOfResources as exc:  # a variant past the SM's shared memory
            print(f"  {side}: {exc}", flush=True)
            del variants[side]
    bitwise = {side: bool(torch.equal(b, bits["two"])) for side, b in bits.items()}
    times: dict[str, list[float]] = {side: [] for side in variants}
    for _ in range(rounds):
        for side, variant in variants.items():
            _use(entries, num_tokens, side, variant)
            times[side].append(time_graph(step, n_variants=VARIANTS, calls_per_graph=10, replays=20))
    kernels = {}
    if profile_kernels:
        for side, variant in variants.items():
            _use(entries, num_tokens, side, variant)
            kernels[side] = kernel_times(step)
            print(f"  {side} kernels (us a call, eager): {kernels[side]}", flush=True)
    _use(entries, num_tokens, "", cfg)
    if had is None:
        del entries[num_tokens]
    else:
        entries[num_tokens] = had
    med = {side: statistics.median(v) for side, v in times.items()}
    print(f"{name} T={num_tokens}: " + ", ".join(
        f"{side} {m:.2f} us ({m / med['two'] - 1:+.1%})" for side, m in med.items())
        + f"; bitwise {bitwise}; rounds {({s: [round(t, 2) for t in v] for s, v in times.items()})}",
        flush=True)
    return {"shape": name, "T": num_tokens, "config": cfg.to_json(), "us": times, "median_us": med,
            "bitwise_vs_two": bitwise, "kernels_us": kernels}


def main() -> None:
    from ab_entry import shape_named  # scripts/debug, beside this file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3", "gptoss", "mixtral", "deepseek"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, nargs="+", help="buckets (default: 1 and few_slots_bucket(K))")
    parser.add_argument("--variants", nargs="+", help="of _variants' names (default: all)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--profile", action="store_true", help="also each variant's kernels (torch.profiler)")
    args = parser.parse_args()
    device_name = torch.cuda.get_device_name(torch.device("cuda"))
    table = load_device_configs(device_name)  # cached: the edits in measure() apply
    results = []
    for name in args.shapes:
        top_k = shape_named(name)[1]
        for num_tokens in args.tokens or sorted({1, few_slots_bucket(top_k)}):
            results.append(measure(table, name, num_tokens, args.rounds, args.variants, args.profile))
    if args.out:
        args.out.write_text(json.dumps({"device": device_name, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
