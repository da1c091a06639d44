"""safemoe.moe at T = 1 (gpt-oss, Qwen3) and T = 1024 with one valid row (Qwen3), num_valid given
as a host int and as a device tensor (as a CUDA-graph engine passes it), same inputs, medians of 3
graph timings: what a device num_valid costs the decode path. A measurement script, not a test.

    PYTHONPATH=src python scripts/debug/num_valid_probe.py LABEL
"""

from __future__ import annotations

import statistics
import sys

import torch

import safemoe
from safemoe.bench.harness import time_graph
from safemoe.workspace import Workspace

# (name, E, K, H, I, T, valid rows)
CASES = (("gptoss", 128, 4, 2880, 2880, 1, 1), ("qwen3", 128, 8, 2048, 768, 1, 1),
         ("qwen3", 128, 8, 2048, 768, 1024, 1))


def timings(case: tuple[str, int, int, int, int, int, int], device: torch.device) -> dict[str, float]:
    name, num_experts, top_k, hidden, inter, num_tokens, valid = case
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(num_experts, 2 * inter, hidden, dtype=torch.bfloat16, device=device, generator=gen)
    w2 = torch.randn(num_experts, hidden, inter, dtype=torch.bfloat16, device=device, generator=gen)
    w13.mul_(hidden**-0.5)
    w2.mul_(inter**-0.5)
    xs = [torch.randn(num_tokens, hidden, dtype=torch.bfloat16, device=device, generator=gen)
          for _ in range(8)]  # fmt: skip
    logits = [torch.randn(num_tokens, num_experts, dtype=torch.bfloat16, device=device, generator=gen)
              for _ in range(8)]  # fmt: skip
    ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16, device)
    result = {}
    for where, nv in (("host", valid), ("device", torch.tensor(valid, dtype=torch.int32, device=device))):

        def step(j: int, nv: object = nv) -> torch.Tensor:
            return safemoe.moe(xs[j], logits[j], w13, w2, top_k, workspace=ws, num_valid=nv)

        runs = [time_graph(step, n_variants=8, calls_per_graph=10, replays=20) for _ in range(3)]
        result[f"{name} T={num_tokens}:{valid} {where} nv"] = round(statistics.median(runs), 2)
    return result


def main() -> None:
    device = torch.device("cuda", 0)
    out: dict[str, float] = {}
    for case in CASES:
        out.update(timings(case, device))
    print(sys.argv[1] if len(sys.argv) > 1 else "", out, flush=True)


if __name__ == "__main__":
    main()
