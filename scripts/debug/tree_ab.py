"""Whole-layer timings of a list of cases under the `safemoe` on PYTHONPATH, for A/Bs of two
source trees in one GPU call: run it once per tree and round, alternating (e.g. an old tree's
`src` exported with `git archive` next to this one), and compare the medians it prints. Each case
is `safemoe.moe` as `ab_entry.layer_step` builds it (bench shape, seeded weights, inputs and
logits, num_valid as a device tensor, one workspace), timed under CUDA-graph replay.

    PYTHONPATH=src:scripts/debug python scripts/debug/tree_ab.py LABEL qwen3:1 qwen3:1024:1 ... [--json F]
        [--save F.pt] [--quant block|per_tensor] [--set safemoe.kernels.experts.FUSE_INTER_QUANT=0 ...]

Prints one line per case and, with --json, appends {label, case: us} to F; with --save, writes
each case's output on its first input set to F.pt, so two trees' outputs can be compared bit for
bit (`safemoe.moe` is deterministic run to run); --quant: every case with fp8 weights of that mode;
--set MODULE.NAME=VALUE (an int, repeatable): a module switch set before any case, for A/Bs of
one tree with a switch off and on (each setting in its own process, alternating).
A measurement script, not a test.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import torch
from ab_entry import VARIANTS, layer_step  # scripts/debug is on sys.path when run as a script

from safemoe.bench.harness import time_graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("label")
    parser.add_argument("cases", nargs="+", help="SHAPE:T[:NUM_VALID]")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--save", type=Path)
    parser.add_argument("--quant", choices=("block", "per_tensor"))
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE")
    args = parser.parse_args()
    for setting in args.set:
        target, value = setting.split("=")
        module, name = target.rsplit(".", 1)
        owner = importlib.import_module(module)
        assert hasattr(owner, name), f"{module} has no {name}"
        setattr(owner, name, type(getattr(owner, name))(int(value)))
    device = torch.device("cuda")
    result: dict[str, object] = {"label": args.label}
    outputs: dict[str, torch.Tensor] = {}
    for case in args.cases:
        shape, tokens, *valid = case.split(":")
        num_tokens = int(tokens)
        step = layer_step(shape, num_tokens, int(valid[0]) if valid else num_tokens, device, args.quant)
        if args.save:
            outputs[case] = step(0).cpu()
        us = time_graph(step, n_variants=VARIANTS, calls_per_graph=10, replays=20)
        result[case] = us
        print(f"{args.label:6s} {case:16s} {us:9.2f} us", flush=True)
        del step
        torch.cuda.empty_cache()
    if args.save:
        torch.save(outputs, args.save)
    if args.json:
        with args.json.open("a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
