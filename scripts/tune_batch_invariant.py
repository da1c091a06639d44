"""Tune the one tile configuration that `batch_invariant=True` runs for every T, on this GPU.

Run from the repository root on a CUDA machine, after (or without) `scripts/tune_experts.py`:

    PYTHONPATH=src python3 scripts/tune_batch_invariant.py --out OUT_DIR [--shapes qwen3,mixtral]
        [--tokens 1,8,64,256,2048,8192] [--write]

Candidates: the configuration `safemoe.configs.get_config` picks for each T in --tokens (tuned
entries where the device file has them, else the heuristic), i.e. the decode, mid and prefill
tiles of the shape. Each candidate is timed at every T (the whole `experts_triton` call under
CUDA-graph replay, as `tune_experts.py` times it) and divided by the default's time at that T (the
T's own config). The winner has the smallest worst slowdown over T; ties go to the smaller worst
decode (T <= 64) slowdown. Every candidate's slowdowns are printed and kept in
OUT_DIR/tune_batch_invariant_<device>.json; with --write the winner becomes the shape's
"batch_invariant" entry in src/safemoe/configs/<device>.json, which `batch_invariant_config` reads.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

from tune_experts import SHAPES, Case, make_weights  # noqa: E402

from safemoe.configs import ExpertsConfig, device_file, get_config, shape_key  # noqa: E402

DEFAULT_TOKENS = (1, 8, 64, 256, 2048, 8192)
DECODE_TOKENS = 64  # T at or below: decode (the issue's <= 15% target), above: prefill (<= 25%)


def choose(slowdowns: list[dict[int, float]]) -> int:
    """Index of the candidate with the smallest worst slowdown over T (then worst decode one)."""
    def key(i: int) -> tuple[float, float]:
        s = slowdowns[i]
        decode = [v for t, v in s.items() if t <= DECODE_TOKENS] or [0.0]
        return max(s.values()), max(decode)

    return min(range(len(slowdowns)), key=key)


def tune_shape(name: str, tokens: list[int], device: torch.device) -> dict[str, Any]:
    num_experts, top_k, hidden, inter = SHAPES[name]
    w13, w2 = make_weights(name, device)
    cases = {t: Case(name, w13, w2, t) for t in tokens}
    candidates: list[ExpertsConfig] = []
    for t in tokens:
        cfg = get_config(t, num_experts, hidden, inter, top_k, torch.bfloat16, device)
        if cfg not in candidates:
            candidates.append(cfg)
    default_us = {t: cases[t].time(get_config(t, num_experts, hidden, inter, top_k, torch.bfloat16, device))
                  for t in tokens}
    slowdowns: list[dict[int, float]] = []
    for i, cfg in enumerate(candidates):
        err = cases[tokens[0]].check(cfg)
        if not err < 2e-2:
            print(f"{name} candidate {i}: relative error {err:.3g}, skipped", flush=True)
            slowdowns.append({t: float("inf") for t in tokens})
            continue
        slowdowns.append({t: cases[t].time(cfg) / default_us[t] for t in tokens})
        text = "  ".join(f"T={t}: {v:.3f}" for t, v in slowdowns[-1].items())
        tiles = f"block_m {cfg.block_m}, block_k {cfg.gemm1.block_k}/{cfg.gemm2.block_k}"
        print(f"{name} candidate {i} ({tiles}): {text}", flush=True)
    best = choose(slowdowns)
    print(f"{name}: candidate {best} wins, worst slowdown {max(slowdowns[best].values()):.3f}", flush=True)
    return {
        "key": shape_key(num_experts, hidden, inter, top_k, torch.bfloat16),
        "config": candidates[best].to_json(),
        "slowdown": {str(t): round(v, 3) for t, v in slowdowns[best].items()},
        "default_us": {str(t): round(v, 2) for t, v in default_us.items()},
        "candidates": [{"config": c.to_json(), "slowdown": {str(t): round(v, 3) for t, v in s.items()}}
                       for c, s in zip(candidates, slowdowns, strict=True)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default="qwen3,mixtral")
    parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)))
    parser.add_argument("--write", action="store_true",
                        help="merge the winners into the device's config file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    device_name = torch.cuda.get_device_name(device)
    tokens = [int(t) for t in args.tokens.split(",") if t]
    results = [tune_shape(name, tokens, device) for name in args.shapes.split(",") if name]
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    out = args.out / f"tune_batch_invariant_{device_name.replace(' ', '_')}.json"
    out.write_text(json.dumps({"device": device_name, "date": stamp, "tokens": tokens, "results": results},
                              indent=1))
    print(f"wrote {out}")
    if args.write:
        path = device_file(device_name)
        data = json.loads(path.read_text()) if path.exists() else {"device": device_name, "configs": {}}
        entries = data.setdefault("batch_invariant", {})
        for result in results:
            entries[result["key"]] = {**result["config"], "slowdown": result["slowdown"],
                                      "source": f"scripts/tune_batch_invariant.py, {stamp}"}
        path.write_text(json.dumps(data, indent=1) + "\n")
        print(f"merged {len(results)} batch_invariant entries into {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
