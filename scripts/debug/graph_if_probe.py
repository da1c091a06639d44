"""Probe: CUDA-graph conditional (IF) nodes as a way to make a large bucket's padded step cost a
small bucket's step (issue 13's padding target: T = 1024 with one valid row <= 1.1x T = 1).

A graph captured for T rows today runs the T-row launches whatever num_valid is; every kernel
branches on num_valid on the device, but the launches (and the large bucket's tiles) stay. With
conditional nodes (CUDA 12.4+, torch's CUDAGraph.begin_capture_to_if_node, what torch.cond uses
under capture) the graph can hold two bodies: IF num_valid <= S, the whole layer on the first S
rows (S's own tiles, the padding rows S..T zeroed) ELSE the T-row layer. This times, under graph
replay (time_graph, several calls a graph):

- `overhead`: N tiny kernels, plain or each inside an IF node (the set-condition kernel and the
  child graph launch are the cost), and the IF/IF-NOT pair torch.cond uses before CUDA 12.8;
- per shape: the T-row layer with num_valid 1 and T (`plain`), the S-row layer (`small`), and the
  conditional step with num_valid 1 and T (`if`). Each step copies the layer's output into one
  fixed [T, H] buffer (the conditional step needs one output for both bodies), so all pay the copy.

Usage: PYTHONPATH=src python scripts/debug/graph_if_probe.py [--shapes qwen3,gptoss] [--T 1024]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

import safemoe
from safemoe.bench.harness import time_graph
from safemoe.workspace import Workspace

sys.path.insert(0, str(Path(__file__).parent))
from ab_entry import shape_named, stand_ins

VARIANTS = 4


def if_node_api() -> str | None:
    """None when this torch can capture IF nodes, else why not."""
    graph_cls = torch.cuda.CUDAGraph
    names = ("get_currently_capturing_graph", "begin_capture_to_if_node", "end_capture_to_conditional_node")
    for name in names:
        if not hasattr(graph_cls, name):
            return f"torch {torch.__version__}: CUDAGraph has no {name}"
    return None


def capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def if_body(pred: torch.Tensor, body) -> None:
    """`body()` inside an IF node on `pred` when capturing; eagerly (both warm-up paths) if not."""
    if not capturing():
        body()
        return
    graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
    graph.begin_capture_to_if_node(pred)
    try:
        body()
    finally:
        graph.end_capture_to_conditional_node()


def overhead(n: int) -> dict[str, float]:
    x = torch.zeros(1024, device="cuda")
    pred = torch.ones((), dtype=torch.bool, device="cuda")

    def plain(j: int) -> None:
        for _ in range(n):
            x.add_(1.0)

    def in_if(j: int) -> None:
        for _ in range(n):
            if_body(pred, lambda: x.add_(1.0))

    def if_pair(j: int) -> None:  # torch.cond's form: IF pred {..} IF !pred {..}
        for _ in range(n):
            if_body(pred, lambda: x.add_(1.0))
            if_body(torch.logical_not(pred), lambda: x.add_(2.0))

    res = {}
    for name, step in (("plain", plain), ("in_if", in_if), ("if_pair", if_pair)):
        res[name] = time_graph(step, calls_per_graph=10, replays=30) / n
    return res


def shape_case(prefix: str, num_tokens: int, small: int, rounds: int) -> dict:
    device = torch.device("cuda")
    num_experts, top_k, hidden, inter, activation = shape_named(prefix)
    gen = torch.Generator(device=device).manual_seed(0)
    w13, w2, xs = stand_ins(prefix, num_tokens, VARIANTS, device, gen)
    logits = [torch.randn(num_tokens, num_experts, device=device, dtype=torch.bfloat16, generator=gen)
              for _ in range(VARIANTS)]  # fmt: skip
    ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16, device)
    out = torch.empty(num_tokens, hidden, device=device, dtype=torch.bfloat16)
    nvs = {n: torch.tensor(n, dtype=torch.int32, device=device) for n in (1, small, num_tokens)}

    def layer(j: int, rows: int, nv: torch.Tensor) -> None:
        res = safemoe.moe(xs[j][:rows], logits[j][:rows], w13, w2, top_k, activation=activation,
                          num_valid=nv, workspace=ws)
        out[:rows].copy_(res)

    def plain(nv: torch.Tensor):
        return lambda j: layer(j, num_tokens, nv)

    def small_only(nv: torch.Tensor):
        return lambda j: layer(j, small, nv)

    def conditional(nv: torch.Tensor):
        def step(j: int) -> None:
            pred = nv <= small

            def small_body() -> None:
                out[small:].zero_()
                layer(j, small, nv)

            if_body(pred, small_body)
            if_body(torch.logical_not(pred), lambda: layer(j, num_tokens, nv))
        return step

    # correctness: the conditional step's output against the plain one, both num_valid kinds
    for n in (1, num_tokens):
        for make in (plain, conditional):
            out.fill_(float("nan"))
            graph = torch.cuda.CUDAGraph()
            make(nvs[n])(0)  # warm-up (both bodies eagerly for the conditional step)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                make(nvs[n])(0)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            if make is plain:
                ref = out.clone()
            else:
                same = torch.equal(out, ref)
                if n < num_tokens:
                    # small bucket's tiles: same math, possibly other fp32 order; padding exact zeros
                    err = ((out[:n].float() - ref[:n].float()).norm() / ref[:n].float().norm()).item()
                    zeros = bool((out[n:] == 0).all())
                    print(f"  {prefix} T={num_tokens} nv={n}: conditional vs plain bitwise {same}, "
                          f"rel err {err:.2e}, padding zeros {zeros}", flush=True)
                else:
                    print(f"  {prefix} T={num_tokens} nv={n}: conditional vs plain bitwise {same}",
                          flush=True)
            del graph

    steps = {
        "plain nv=1": plain(nvs[1]),
        f"small T={small} nv=1": small_only(nvs[1]),
        "if nv=1": conditional(nvs[1]),
        f"plain nv={num_tokens}": plain(nvs[num_tokens]),
        f"if nv={num_tokens}": conditional(nvs[num_tokens]),
    }
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(time_graph(step, n_variants=VARIANTS, calls_per_graph=10, replays=20))
    med = {k: round(statistics.median(v), 2) for k, v in times.items()}
    print(f"{prefix} T={num_tokens} S={small}: " + json.dumps(med), flush=True)
    return {"shape": prefix, "T": num_tokens, "S": small, "median_us": med, "rounds": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3,gptoss")
    parser.add_argument("--T", type=int, default=1024)
    parser.add_argument("--S", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    why = if_node_api()
    if why:
        raise SystemExit(why)
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    result["overhead_us_per_kernel"] = {n: overhead(n) for n in (1, 8)}
    print("overhead (us per tiny kernel):", json.dumps(result["overhead_us_per_kernel"]), flush=True)
    result["cases"] = []
    for prefix in args.shapes.split(","):
        try:
            result["cases"].append(shape_case(prefix, args.T, args.S, args.rounds))
        except Exception as exc:  # keep the other shapes
            print(f"{prefix}: {type(exc).__name__}: {exc}", flush=True)
            result["cases"].append({"shape": prefix, "error": f"{type(exc).__name__}: {exc}"})
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
