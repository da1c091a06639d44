"""Debug (issue 13, T = 1..8 decode): what does the router launch cost inside the layer? Times, on
the same seeded inputs (bf16, num_valid as a device tensor, CUDA-graph replay, interleaved
rounds): the whole layer `safemoe.moe` (router kernel, then the experts), the experts alone on the
routing that layer computes (`experts_triton` with ids_complete, as moe() runs them), and the
router alone. layer - experts is what the router's launch and its boundary add. A measurement
script, not a test.

    PYTHONPATH=src python3 scripts/debug/router_share.py [--shapes qwen3,gptoss] [--tokens 1,2,4,8]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from ab_entry import shape_named, stand_ins  # scripts/debug is on sys.path when run as a script

import safemoe
from safemoe._checks import check_num_valid
from safemoe.bench.harness import time_graph
from safemoe.kernels.experts import experts_triton
from safemoe.workspace import Workspace

INPUT_SETS = 8


def measure(prefix: str, num_tokens: int, rounds: int) -> None:
    num_experts, top_k, hidden, inter, activation = shape_named(prefix)
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(0)
    w13, w2, xs = stand_ins(prefix, num_tokens, INPUT_SETS, device, gen)
    logits = [torch.randn(num_tokens, num_experts, device=device, dtype=torch.bfloat16, generator=gen)
              for _ in range(INPUT_SETS)]  # fmt: skip
    nv_tensor = torch.tensor(num_tokens, dtype=torch.int32, device=device)
    nv = check_num_valid(nv_tensor, num_tokens, device)
    routings = [safemoe.route(lg, top_k, num_valid=nv_tensor) for lg in logits]
    ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16, device)
    outs = [torch.empty(num_tokens, hidden, device=device, dtype=torch.bfloat16) for _ in range(INPUT_SETS)]

    def layer(j: int) -> torch.Tensor:
        return safemoe.moe(xs[j], logits[j], w13, w2, top_k, activation=activation, num_valid=nv_tensor,
                           workspace=ws)

    def experts(j: int) -> torch.Tensor:
        r = routings[j]
        return experts_triton(xs[j], w13, w2, r.weights, r.ids, activation=activation, num_valid=nv,
                              health=None, workspace=ws, out=outs[j], ids_complete=True)

    def router(j: int) -> object:
        return safemoe.route(logits[j], top_k, num_valid=nv_tensor)

    assert torch.equal(layer(0), experts(0)), "layer and experts-on-its-routing differ"
    steps = {"layer": layer, "experts": experts, "router": router}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(time_graph(step, n_variants=INPUT_SETS, calls_per_graph=16, replays=20))
    med = {name: statistics.median(samples) for name, samples in times.items()}
    print(f"{prefix:9s} T={num_tokens:<3d} layer {med['layer']:8.2f} us  experts {med['experts']:8.2f} us  "
          f"router alone {med['router']:6.2f} us  layer - experts {med['layer'] - med['experts']:+6.2f} us "
          f"({100 * (med['layer'] / med['experts'] - 1):+5.1f}%)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3,gptoss,mixtral,deepseek")
    parser.add_argument("--tokens", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for prefix in args.shapes.split(","):
        for num_tokens in (int(t) for t in args.tokens.split(",")):
            measure(prefix, num_tokens, args.rounds)


if __name__ == "__main__":
    main()
