"""A padded decode step's cost with the small-batch tiles in the GEMMs' own launch (one_launch)
or in a launch of their own, on a GPU (issue 13's padding target: T = 1024 with one valid row
<= 1.1x T = 1).

    PYTHONPATH=src python scripts/debug/padded_step.py [--shapes qwen3,mixtral,gptoss,deepseek]
                                                       [--tokens 1024] [--out FILE.json]
                                                       [--pps 1,2,4,8]

For each shape: `experts_triton` at T = 1 (its own config), then at each bucket T with the device
table's tiles, one_launch off and on, at num_valid = 1 (the few-slot path: a separate small-tile
launch still runs, empty), 8 (the small-batch tiles) and T (a full batch). Workspace, device
num_valid, CUDA-graph replay over 8 rotating routings. With --pps, instead: the table's config
(one_launch as tuned) at each of these programs per SM (the grid of a merged launch is the largest
regime's, so a one-row step launches the main tiles' whole persistent grid, mostly idle programs).
A measurement script, not a test.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from safemoe._checks import NumValid
from safemoe.bench.harness import time_graph
from safemoe.configs import get_config
from safemoe.kernels import experts as ex
from safemoe.workspace import Workspace

SHAPES = {  # E, K, H, I, activation
    "qwen3": (128, 8, 2048, 768, "silu"),
    "mixtral": (8, 2, 4096, 14336, "silu"),
    "gptoss": (128, 4, 2880, 2880, "swigluoai"),
    "deepseek": (256, 8, 7168, 2048, "silu"),
}
VARIANTS = 8


def _timer(shape, num_tokens: int):
    num_experts, top_k, hidden, inter, activation = shape
    dev = torch.device("cuda")
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=dev, dtype=torch.bfloat16) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, device=dev, dtype=torch.bfloat16) * inter**-0.5
    xs = [torch.randn(num_tokens, hidden, device=dev, dtype=torch.bfloat16) for _ in range(VARIANTS)]
    ids = [torch.topk(torch.rand(num_tokens, num_experts, device=dev), top_k).indices.to(torch.int32)
           for _ in range(VARIANTS)]
    weights = [torch.rand(num_tokens, top_k, device=dev) for _ in range(VARIANTS)]
    outs = [torch.empty_like(x) for x in xs]
    ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16, dev)

    def time_it(num_valid: int, one_launch: bool | None, few_bucket: int | None = None,
                pps: int | None = None, few_pps: int | None = None, few_tiles: dict | None = None) -> float:
        nv = NumValid(None, torch.tensor(num_valid, device=dev, dtype=torch.int32))
        kwargs = {}
        if one_launch is not None:
            cfg = replace(get_config(num_tokens, num_experts, hidden, inter, top_k, torch.bfloat16, dev),
                          one_launch=one_launch)
            if pps is not None:
                cfg = replace(cfg, programs_per_sm=pps)
            few = ex.few_slots_config(num_tokens, num_experts, hidden, inter, top_k, torch.bfloat16, dev, cfg)
            if few_bucket is not None:  # another bucket's tiles for the few-slot path
                few = get_config(few_bucket, num_experts, hidden, inter, top_k, torch.bfloat16, dev)
            if few_tiles is not None and few is not None:  # the few-slot tiles with these GemmTiles fields
                few = replace(few, gemm1=replace(few.gemm1, **few_tiles.get("gemm1", {})),
                              gemm2=replace(few.gemm2, **few_tiles.get("gemm2", {})))
            small = ex.small_batch_config(num_tokens, num_experts, hidden, inter, top_k, torch.bfloat16, dev,
                                          cfg)
            if few_pps is not None:  # the few-slot and small tiles' grids at this many programs per SM
                few = few if few is None else replace(few, programs_per_sm=few_pps)
                small = small if small is None else replace(small, programs_per_sm=few_pps)
            kwargs = {"config": cfg, "small_config": small, "few_config": few}

        def step(j: int) -> None:
            ex.experts_triton(xs[j], w13, w2, weights[j], ids[j], activation=activation, num_valid=nv,
                              health=None, workspace=ws, out=outs[j], **kwargs)

        return time_graph(step, n_variants=VARIANTS)

    return time_it


def occupancy_report() -> None:
    """Each compiled GEMM kernel's warps, stages, shared memory, registers and the programs one SM
    holds at once by those (Hopper: 228 KiB shared, 64K registers, 64 warps per SM)."""
    for kernel in (ex._gemm1_kernel, ex._gemm2_kernel, ex._few_gemms_kernel):
        for caches in getattr(kernel, "device_caches", {}).values():
            for compiled in caches[0].values():
                meta = compiled.metadata
                shared, regs, warps = meta.shared, compiled.n_regs, meta.num_warps
                per_sm = min(233472 // max(shared + 1024, 1), 65536 // max(regs * 32 * warps, 1), 64 // warps)
                print(f"{kernel.fn.__name__}: warps {warps} stages {meta.num_stages} shared {shared} "
                      f"regs {regs} -> {per_sm} per SM", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3,mixtral,gptoss,deepseek")
    parser.add_argument("--tokens", default="1024")
    parser.add_argument("--out", default=None)
    parser.add_argument("--pps", default="",
                        help="comma-separated programs per SM to time the table's config at")
    parser.add_argument("--few-bucket", default="",
                        help="also time one valid row with these buckets' tiles on the few-slot path "
                             "(comma-separated), one_launch off and on")
    parser.add_argument("--few-pps", default="",
                        help="also time one valid row with the few-slot and small tiles' grids at these "
                             "programs per SM (comma-separated), one_launch off and on")
    parser.add_argument("--few-tiles", default="",
                        help="also time one valid row with the few-slot tiles' GemmTiles fields replaced, "
                             "';'-separated JSON objects {\"gemm1\": {...}, \"gemm2\": {...}}")
    args = parser.parse_args()
    rows = []
    print(f"{torch.cuda.get_device_name()}; us per experts_triton call (median, graph replay)", flush=True)
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        one = _timer(shape, 1)(1, None)
        print(f"{name:9} T=1: {one:8.2f} us", flush=True)
        for num_tokens in (int(t) for t in args.tokens.split(",")):
            time_it = _timer(shape, num_tokens)
            if args.pps:
                num_experts, top_k, hidden, inter, _ = shape
                tuned = get_config(num_tokens, num_experts, hidden, inter, top_k, torch.bfloat16,
                                   torch.device("cuda"))
                for pps in (int(p) for p in args.pps.split(",")):
                    row = {"shape": name, "tokens": num_tokens, "pps": pps,
                           "tuned_pps": tuned.programs_per_sm, "one_launch": tuned.one_launch,
                           "t1_us": round(one, 2)}
                    for num_valid in (1, 8, num_tokens):
                        row[f"valid_{num_valid}"] = round(time_it(num_valid, tuned.one_launch, pps=pps), 2)
                    rows.append(row)
                    print(f"{name:9} T={num_tokens} pps={pps} (tuned {tuned.programs_per_sm}): 1 valid "
                          f"{row['valid_1']:8.2f} ({row['valid_1'] / one:.2f}x T=1)  "
                          f"8 valid {row['valid_8']:8.2f}  full {row[f'valid_{num_tokens}']:9.2f}",
                          flush=True)
                continue
            for one_launch in (False, True):
                row = {"shape": name, "tokens": num_tokens, "one_launch": one_launch, "t1_us": round(one, 2)}
                for num_valid in (1, 8, num_tokens):
                    row[f"valid_{num_valid}"] = round(time_it(num_valid, one_launch), 2)
                rows.append(row)
                print(f"{name:9} T={num_tokens} one_launch={one_launch!s:5}: 1 valid {row['valid_1']:8.2f} "
                      f"({row['valid_1'] / one:.2f}x T=1)  8 valid {row['valid_8']:8.2f}  full "
                      f"{row[f'valid_{num_tokens}']:9.2f}", flush=True)
            few_buckets = [int(b) for b in args.few_bucket.split(",") if b] or [None]
            few_pps_list = [None] + [int(p) for p in args.few_pps.split(",") if p]
            few_variants = [(b, p, None) for b in few_buckets for p in few_pps_list if (b, p) != (None, None)]
            few_variants += [(None, None, json.loads(t)) for t in args.few_tiles.split(";") if t]
            for one_launch in (False, True):
                for few_bucket, few_pps, few_tiles in few_variants:
                    us = time_it(1, one_launch, few_bucket, few_pps=few_pps, few_tiles=few_tiles)
                    rows.append({"shape": name, "tokens": num_tokens, "one_launch": one_launch,
                                 "few_bucket": few_bucket, "few_pps": few_pps, "few_tiles": few_tiles,
                                 "valid_1": round(us, 2)})
                    if few_tiles is not None:
                        print(f"{name:9} T={num_tokens} one_launch={one_launch!s:5} few-slot tiles "
                              f"{few_tiles}: 1 valid {us:8.2f} ({us / one:.2f}x T=1)", flush=True)
                        continue
                    print(f"{name:9} T={num_tokens} one_launch={one_launch!s:5} few-slot tiles of "
                          f"T={few_bucket} few/small pps={few_pps}: 1 valid {us:8.2f} ({us / one:.2f}x T=1)",
                          flush=True)
            torch.cuda.empty_cache()
    occupancy_report()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
