"""Tune the router's launch configs for bf16 logits; write them into src/safemoe/configs/router.json.

Run from the repository root on a CUDA machine:

    PYTHONPATH=src python3 scripts/tune_router.py [E:K ...] [--tokens 1,8,...] [--write] [--layer-check]
        [--out tune_router.json]

(Until 2026-11-27 this was scripts/debug/router_candidates.py, which found Qwen3-Next's entry.)
Why the padded step counts: on an H200 a Qwen3-Next (E = 512, K = 10) layer step of T = 1024 with
one valid row spent 10.7 us in the router against 4.8 us at T = 1
(scripts/debug/decode_timeline.py): the heuristic's 8-row programs put two rows on each warp, and
program 0 routes its whole block whatever num_valid is.

For every T this times each `routing.candidate_configs` config (bf16 logits, graph replay,
num_valid as a device tensor) with all rows valid and, from T = PADDED_FROM, with one valid row
(`time_candidates`), then picks per T the config whose padded step is fastest among those within
PADDED_TOLERANCE of the fastest full batch (`pick`), and folds the picks into the table's buckets
(`buckets_of`: a run of equal picks becomes one bucket ending at its largest T; the table
reuses the last bucket past it). --layer-check then times `safemoe.moe` (route + experts) on the
shape's layer (LAYER: E -> H, I) with the table without the shape's entry (the heuristic) and with
the new buckets, interleaved. --write merges the entry into configs/router.json (`merge_entry`:
replaced if the shape has one, else appended), with where and how it was measured. Other shapes'
entries and the file's top-level keys are kept.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from safemoe.kernels import routing  # noqa: E402

PADDED_TOLERANCE = 0.03  # a full batch may cost this much more for a faster padded step
PADDED_FROM = 64  # below this T a padded step is a small batch anyway: full batches decide
LAYER = {512: (2048, 512), 128: (2048, 768), 256: (7168, 2048)}  # E -> (H, I) of --layer-check
DEFAULT_TOKENS = (1, 8, 64, 128, 1024, 4096, 8192, 16384)


class Timing(NamedTuple):
    config: routing.RouterConfig
    full_us: float
    one_row_us: float | None  # one valid row of T (None below PADDED_FROM)


def pick(timings: list[Timing], tolerance: float = PADDED_TOLERANCE) -> routing.RouterConfig:
    """The config with the fastest padded step (then full batch) among those within `tolerance`
    of the fastest full batch; full batches alone where no padded step was timed."""
    best_full = min(t.full_us for t in timings)
    near = [t for t in timings if t.full_us <= best_full * (1 + tolerance)]
    return min(near, key=lambda t: (t.full_us if t.one_row_us is None else t.one_row_us, t.full_us)).config


def buckets_of(picks: list[tuple[int, routing.RouterConfig]]) -> list[tuple[int, int, int]]:
    """(largest T, block_t, num_warps) buckets of per-T picks given by rising T: each run of equal
    configs becomes one bucket ending at the run's largest T."""
    out: list[tuple[int, int, int]] = []
    for num_tokens, config in sorted(picks, key=lambda p: p[0]):
        if out and out[-1][1:] == (config.block_t, config.num_warps):
            out[-1] = (num_tokens, config.block_t, config.num_warps)
        else:
            out.append((num_tokens, config.block_t, config.num_warps))
    return out


def merge_entry(doc: dict[str, Any], key: tuple[int, int, bool], buckets: list[tuple[int, int, int]],
                source: str) -> dict[str, Any]:
    """`doc` (a router.json document) with the entry of `key` replaced or appended."""
    e_pad, top_k, grouped = key
    entry = {"experts_padded": e_pad, "top_k": top_k, "grouped": grouped, "source": source,
             "buckets": [list(b) for b in buckets]}  # fmt: skip
    entries = [e for e in doc.get("entries", [])
               if (e["experts_padded"], e["top_k"], e["grouped"]) != (e_pad, top_k, grouped)]  # fmt: skip
    return {**doc, "entries": [*entries, entry]}


def write_table(doc: dict[str, Any], path: Path) -> None:
    """router.json as the repository keeps it: one bucket a line; checked by loading it back."""
    text = re.sub(r"\[\n\s+(\d+),\n\s+(\d+),\n\s+(\d+)\n\s+\]", r"[\1, \2, \3]", json.dumps(doc, indent=1))
    staged = path.with_name(path.name + ".new")
    staged.write_text(text + "\n")
    try:
        routing.load_router_table(staged)  # a table that does not load never replaces the file
    except ValueError:
        staged.unlink()
        raise
    staged.replace(path)


def time_candidates(num_experts: int, top_k: int, num_tokens: int, device: torch.device) -> list[Timing]:
    from safemoe.bench.harness import time_graph
    from safemoe.bench.router import Case, Inputs, _safemoe_step, make_inputs
    from safemoe.route_config import RouteConfig

    case = Case(num_experts, RouteConfig(top_k))
    full = make_inputs(case, num_tokens, "clean", device)
    one = Inputs(full.logits, None, torch.tensor(1, dtype=torch.int32, device=device), 1)

    def timed(inputs: Inputs, config: routing.RouterConfig) -> float:
        return time_graph(_safemoe_step(case, inputs, impl="safemoe", config=config),
                          n_variants=len(inputs.logits), calls_per_graph=20, replays=30)

    return [Timing(config, timed(full, config), timed(one, config) if num_tokens >= PADDED_FROM else None)
            for config in routing.candidate_configs(num_tokens, num_experts, top_k, 2)]  # fmt: skip


def layer_check(num_experts: int, top_k: int, buckets: list[tuple[int, int, int]], device: torch.device,
                rounds: int = 3) -> list[dict[str, Any]]:
    """The layer (`safemoe.moe`, bf16, a workspace, graph replay) with the shape's entry left out
    of the table (heuristic) and with `buckets`, `rounds` interleaved rounds, medians."""
    import safemoe
    from safemoe.bench.harness import time_graph

    hidden, inter = LAYER[num_experts]
    g = torch.Generator(device=device).manual_seed(0)
    bf16 = torch.bfloat16
    w13 = torch.randn(num_experts, 2 * inter, hidden, dtype=bf16, device=device, generator=g) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, dtype=bf16, device=device, generator=g) * inter**-0.5
    key = (routing.next_power_of_2(num_experts), top_k, False)
    shipped = routing.tuned_router_table()
    without = {k: v for k, v in shipped.items() if k != key}
    tables = {"heuristic": without, "tuned": {**without, key: tuple(buckets)}}
    points = [(1, None), (1024, 1), (1024, None), (64, None), (8192, None)]
    results: dict[tuple[str, int, int | None], list[float]] = {}
    try:
        for _ in range(rounds):
            for label, table in tables.items():
                routing.tuned_router_table = lambda table=table: table  # _pick_config reads it per call
                for num_tokens, num_valid in points:
                    x = torch.randn(num_tokens, hidden, dtype=bf16, device=device, generator=g)
                    logits = torch.randn(num_tokens, num_experts, dtype=bf16, device=device, generator=g)
                    ws = safemoe.Workspace(num_tokens, num_experts, top_k, hidden, inter, bf16, device)
                    nv = None if num_valid is None else torch.tensor(num_valid, dtype=torch.int32,
                                                                     device=device)

                    def step(_: int, x=x, logits=logits, nv=nv, ws=ws) -> torch.Tensor:
                        return safemoe.moe(x, logits, w13, w2, top_k, num_valid=nv, workspace=ws,
                                           backend="triton")

                    us = time_graph(step, calls_per_graph=10, replays=20)
                    results.setdefault((label, num_tokens, num_valid), []).append(us)
    finally:
        routing.tuned_router_table = lambda: shipped
    rows = []
    for num_tokens, num_valid in points:
        base = statistics.median(results[("heuristic", num_tokens, num_valid)])
        new = statistics.median(results[("tuned", num_tokens, num_valid)])
        rows.append({"T": num_tokens, "num_valid": num_valid, "heuristic_us": round(base, 2),
                     "tuned_us": round(new, 2)})  # fmt: skip
        print(f"layer E={num_experts} K={top_k} T={num_tokens} num_valid={num_valid}: heuristic router "
              f"{base:.2f} us, tuned {new:.2f} us ({100 * (new / base - 1):+.1f}%)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="*", default=["512:10"], help="E:K of softmax routers (ungrouped)")
    parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)))
    parser.add_argument("--write", action="store_true", help="merge the entries into configs/router.json")
    parser.add_argument("--layer-check", action="store_true",
                        help="time the layer both ways (shapes of LAYER)")
    parser.add_argument("--out", type=Path, default=Path("tune_router.json"), help="every timing, as JSON")
    args = parser.parse_args(argv)
    tokens = sorted({int(t) for t in args.tokens.split(",")})
    shapes = []
    for spec in args.shapes:
        try:
            num_experts, top_k = (int(v) for v in spec.split(":"))
        except ValueError:
            parser.error(f"a shape is E:K (two ints), got {spec!r}")
        if not 1 <= top_k <= num_experts:
            parser.error(f"a shape needs 1 <= K <= E, got {spec!r}")
        if args.layer_check and num_experts not in LAYER:
            parser.error(f"--layer-check knows E in {sorted(LAYER)}, got {spec}")
        shapes.append((num_experts, top_k))
    if not torch.cuda.is_available():
        print("tune_router.py times the router on a CUDA GPU; none here")
        return 1
    device = torch.device("cuda")
    name = torch.cuda.get_device_name()
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    print(name, flush=True)
    log: dict[str, Any] = {"device": name, "date": date, "shapes": []}
    doc = json.loads(routing.ROUTER_TABLE.read_text())
    for num_experts, top_k in shapes:
        picks = []
        timings_log = []
        for num_tokens in tokens:
            timings = time_candidates(num_experts, top_k, num_tokens, device)
            chosen = pick(timings)
            picks.append((num_tokens, chosen))
            for t in timings:
                mark = " <- pick" if t.config == chosen else (" (heuristic)" if t is timings[0] else "")
                one = f"{t.one_row_us:7.2f}" if t.one_row_us is not None else "      -"
                print(f"E={num_experts} K={top_k} T={num_tokens:6d} block_t={t.config.block_t:3d} "
                      f"warps={t.config.num_warps}: full {t.full_us:7.2f} us, one valid row {one} us{mark}",
                      flush=True)
                timings_log.append({"T": num_tokens, "block_t": t.config.block_t,
                                    "num_warps": t.config.num_warps,
                                    "full_us": round(t.full_us, 3), "one_row_us": t.one_row_us,
                                    "pick": t.config == chosen})  # fmt: skip
        key = (routing.next_power_of_2(num_experts), top_k, False)
        buckets = buckets_of(picks)
        print(f"router.json entry {key}: buckets {[list(b) for b in buckets]}", flush=True)
        shape_log: dict[str, Any] = {"key": list(key), "buckets": buckets, "timings": timings_log}
        if args.layer_check:
            shape_log["layer"] = layer_check(num_experts, top_k, buckets, device)
        log["shapes"].append(shape_log)
        source = (f"{name} {date[:10]}, scripts/tune_router.py (T = {', '.join(map(str, tokens))}; the "
                  f"fastest one-valid-row step within {PADDED_TOLERANCE:.0%} of the fastest full batch)")
        doc = merge_entry(doc, key, buckets, source)
    args.out.write_text(json.dumps(log, indent=1) + "\n")
    if args.write:
        write_table(doc, routing.ROUTER_TABLE)
        print(f"wrote {routing.ROUTER_TABLE}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
