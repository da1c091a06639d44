"""gpt-oss-120b T = 1 through the layer bench's own harness (`safemoe.bench.layer._case_rows`), the H100/H200
table entry with `fused` off and on, alternated: does the bench see what scripts/debug/fused_decode.py
sees? A measurement script, not a test.

    PYTHONPATH=src python scripts/debug/layer_bench_fused_probe.py
"""
import dataclasses
import statistics

import torch

import safemoe.configs as C
from safemoe.bench import layer as L
from safemoe.bench.harness import measure_ceilings

dev = torch.device("cuda", 0)
ceil = measure_ceilings(dev)
t = C.load_device_configs(torch.cuda.get_device_name(dev))
key = "E128_H2880_I2880_K4_bfloat16"
base = t[key][1]
g = torch.Generator(device=dev).manual_seed(0)
w13 = torch.randn(128, 5760, 2880, dtype=torch.bfloat16, device=dev, generator=g) * 2880**-0.5
w2 = torch.randn(128, 2880, 2880, dtype=torch.bfloat16, device=dev, generator=g) * 2880**-0.5
res = {False: [], True: []}
for _ in range(4):
    for fused in (False, True):
        t[key][1] = dataclasses.replace(base, fused=fused)
        rows = L._case_rows("gpt-oss-120b", (128, 4, 2880, 2880), 1, w13, w2, ceil, False)
        row = next(r for r in rows if r.impl == "safemoe-triton")
        res[fused].append((round(row.median_us, 2), round(100 * row.floor_us / row.median_us, 1)))
print("layer-bench harness, gpt-oss T=1, (us, % of read floor) per round; two launches:", res[False],
      "fused:", res[True])
print("medians us:", statistics.median(u for u, _ in res[False]), statistics.median(u for u, _ in res[True]))
