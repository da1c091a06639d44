"""Debug (issue 13): the router's launch configs for a shape without a tuned entry, on full batches
and on a padded step with one valid row, then the whole layer with the pick against the heuristic.

    PYTHONPATH=src python3 scripts/debug/router_candidates.py [E:K ...] [--tokens 1,8,...]

H200 2026-11-27: a Qwen3-Next (E = 512, K = 10) layer step of T = 1024 with one valid row spent
10.7 us in the router against 4.8 us at T = 1 (scripts/debug/decode_timeline.py): the heuristic's
8-row programs put two rows on each warp, and program 0 routes all of its block whatever
num_valid is. For every T this times each `routing.candidate_configs` config (bf16 logits, graph
replay, num_valid as a device tensor) with all rows valid and, from T = 64, with one valid row;
suggests per T the fastest full batch among those within PADDED_TOLERANCE of it whose padded step
is fastest; then times `safemoe.moe` (route + experts, heuristic expert tiles or the device
table's) with the heuristic router configs and with the suggestion (in place of the shipped
configs/router.json entry, if any),
interleaved. A measurement script, not a test.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import safemoe
from safemoe.bench.harness import time_graph
from safemoe.bench.router import Case, Inputs, _safemoe_step, make_inputs
from safemoe.kernels import routing
from safemoe.route_config import RouteConfig

PADDED_TOLERANCE = 0.03  # a full batch may cost this much more for a faster padded step
LAYER = {512: (2048, 512)}  # E -> (H, I) of the layer check (Qwen3-Next)


def time_config(case: Case, inputs: Inputs, config: routing.RouterConfig) -> float:
    return time_graph(_safemoe_step(case, inputs, impl="safemoe", config=config),
                      n_variants=len(inputs.logits), calls_per_graph=20, replays=30)


def tune(num_experts: int, top_k: int, tokens: list[int],
         device: torch.device) -> list[tuple[int, int, int]]:
    case = Case(num_experts, RouteConfig(top_k))
    entry: list[tuple[int, int, int]] = []
    for num_tokens in tokens:
        full = make_inputs(case, num_tokens, "clean", device)
        one = Inputs(full.logits, None, torch.tensor(1, dtype=torch.int32, device=device), 1)
        timings = []
        for config in routing.candidate_configs(num_tokens, num_experts, top_k, 2):
            us_full = time_config(case, full, config)
            us_one = time_config(case, one, config) if num_tokens >= 64 else None
            timings.append((config, us_full, us_one))
        heuristic = timings[0]
        best_full = min(t[1] for t in timings)
        near = [t for t in timings if t[1] <= best_full * (1 + PADDED_TOLERANCE)]
        pick = min(near, key=lambda t: (t[2] if t[2] is not None else t[1], t[1]))
        for config, us_full, us_one in timings:
            mark = " <- pick" if config == pick[0] else (" (heuristic)" if config == heuristic[0] else "")
            one_text = f"{us_one:7.2f}" if us_one is not None else "      -"
            print(f"E={num_experts} K={top_k} T={num_tokens:6d} block_t={config.block_t:3d} "
                  f"warps={config.num_warps}: full {us_full:7.2f} us, one valid row {one_text} us"
                  f"{mark}", flush=True)
        entry.append((num_tokens, pick[0].block_t, pick[0].num_warps))
    return entry


def layer_check(num_experts: int, top_k: int, entry: list[tuple[int, int, int]],
                device: torch.device) -> None:
    if num_experts not in LAYER:
        return
    hidden, inter = LAYER[num_experts]
    g = torch.Generator(device=device).manual_seed(0)
    bf16 = torch.bfloat16
    w13 = torch.randn(num_experts, 2 * inter, hidden, dtype=bf16, device=device, generator=g) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, dtype=bf16, device=device, generator=g) * inter**-0.5
    key = (routing.next_power_of_2(num_experts), top_k, False)
    shipped = routing.tuned_router_table()
    without = {k: v for k, v in shipped.items() if k != key}
    tables = {"heuristic": without, "pick": {**without, key: tuple(entry)}}
    points = [(1, None), (1024, 1), (1024, None), (64, None), (8192, None)]
    results: dict[tuple[str, int, int | None], list[float]] = {}
    for _ in range(3):
        for label, table in tables.items():
            routing.tuned_router_table = lambda table=table: table  # _pick_config reads it per call
            for num_tokens, num_valid in points:
                x = torch.randn(num_tokens, hidden, dtype=torch.bfloat16, device=device, generator=g)
                logits = torch.randn(num_tokens, num_experts, dtype=bf16, device=device, generator=g)
                ws = safemoe.Workspace(num_tokens, num_experts, top_k, hidden, inter, bf16, device)
                nv = None if num_valid is None else torch.tensor(num_valid, dtype=torch.int32, device=device)

                def step(_: int, x=x, logits=logits, nv=nv, ws=ws) -> torch.Tensor:
                    return safemoe.moe(x, logits, w13, w2, top_k, num_valid=nv, workspace=ws,
                                       backend="triton")

                us = time_graph(step, calls_per_graph=10, replays=20)
                results.setdefault((label, num_tokens, num_valid), []).append(us)
    routing.tuned_router_table = lambda: shipped
    for num_tokens, num_valid in points:
        base = statistics.median(results[("heuristic", num_tokens, num_valid)])
        new = statistics.median(results[("pick", num_tokens, num_valid)])
        print(f"layer E={num_experts} K={top_k} T={num_tokens} num_valid={num_valid}: heuristic router "
              f"{base:.2f} us, pick {new:.2f} us ({100 * (new / base - 1):+.1f}%)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("shapes", nargs="*", default=["512:10"])
    parser.add_argument("--tokens", default="1,8,64,128,1024,4096,8192,16384")
    args = parser.parse_args()
    device = torch.device("cuda")
    print(torch.cuda.get_device_name())
    tokens = [int(t) for t in args.tokens.split(",")]
    for spec in args.shapes:
        num_experts, top_k = (int(v) for v in spec.split(":"))
        entry = tune(num_experts, top_k, tokens, device)
        key = (routing.next_power_of_2(num_experts), top_k, False)
        print(f"suggested configs/router.json entry {key}: buckets {[list(b) for b in entry]}", flush=True)
        layer_check(num_experts, top_k, entry, device)


if __name__ == "__main__":
    main()
