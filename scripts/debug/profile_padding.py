"""Debug (issue 13): where a padded batch's time goes. Per-kernel device time of safemoe.moe at
T=1 and at T=1024 with one valid row (Qwen3 and Mixtral shapes), and graph-replay totals.

    PYTHONPATH=src python3 scripts/debug/profile_padding.py [shape:T[:num_valid] ...]

With arguments, only those cases (e.g. `mixtral:256 qwen3:1024:1 gptoss:1`); without, the padding
cases below.
"""
from __future__ import annotations

import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import safemoe
from safemoe.bench.harness import time_graph

SHAPES = {"qwen3": (128, 8, 2048, 768), "mixtral": (8, 2, 4096, 14336), "gptoss": (128, 4, 2880, 2880),
          "deepseek": (256, 8, 7168, 2048), "router256": (256, 8, 7168, 2048)}
dev = "cuda"


def case(name, t, nv, only_route=False):
    e, k, h, i = SHAPES[name]
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(t, h, dtype=torch.bfloat16, device=dev, generator=g)
    logits = torch.randn(t, e, dtype=torch.float32, device=dev, generator=g)
    nvt = None if nv is None else torch.tensor(nv, dtype=torch.int32, device=dev)
    if only_route:
        out = torch.empty(1)

        def step(j):
            return safemoe.route(logits, k, num_valid=nvt)
    else:
        w13 = torch.randn(e, 2 * i, h, dtype=torch.bfloat16, device=dev, generator=g) * h**-0.5
        w2 = torch.randn(e, h, i, dtype=torch.bfloat16, device=dev, generator=g) * i**-0.5
        ws = safemoe.Workspace(t, e, k, h, i, torch.bfloat16, dev)
        out = None

        def step(j):
            return safemoe.moe(x, logits, w13, w2, k, num_valid=nvt, workspace=ws, backend="triton")
    us = time_graph(step, calls_per_graph=20, replays=30)
    for _ in range(3):
        step(0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            step(0)
        torch.cuda.synchronize()
    per = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name[:70]] += ev.device_time / 20
    print(f"== {name} T={t} num_valid={nv} route_only={only_route}: graph replay {us:.2f} us/call; "
          f"kernels sum {sum(per.values()):.2f} us")
    for n, v in sorted(per.items(), key=lambda kv: -kv[1]):
        print(f"   {v:8.2f}  {n}")
    del out


if len(sys.argv) > 1:
    for spec in sys.argv[1:]:
        name, tokens, *valid = spec.split(":")
        case(name, int(tokens), int(valid[0]) if valid else None)
else:
    for name in ("qwen3", "mixtral"):
        case(name, 1, None)
        case(name, 1024, 1)
        case(name, 1024, None)
    for t in (1024, 4096):
        case("router256", t, None, only_route=True)
