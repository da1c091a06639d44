"""Check every entry of this GPU's config table against the reference at its own bucket.

    PYTHONPATH=src python3 scripts/debug/table_check.py [--keys SUBSTR] [--entries CHANGED.json]
        [--max-tokens 8192] [--out F.json]

The table's tiles only run at the model shapes (the GPU tests use small shapes and the heuristic),
so a tuning run can write an entry no test executes. For each shape key and bucket T (up to
--max-tokens), `safemoe.moe` on seeded bf16 stand-in weights (fp8 keys: the same weights through
`quantize_experts` in the key's mode) at T rows, num_valid = T - 3 as a device tensor with the
padding rows of x and of the logits NaN, against `moe_reference` (fp8: `experts_fp8_reference` on
the reference routing). Prints max |error| / max |reference| over the valid rows (bf16: <= 2e-2,
fp8: <= 1e-1, the tuner's bounds) and whether every padding row is exact zeros; exits 1 on a
failure. A debugging and release check for tables, not a unit test.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import safemoe
from safemoe._checks import NumValid
from safemoe.bench.experts import SHAPES
from safemoe.bench.layer import _rel_err as max_rel_err
from safemoe.configs import load_device_configs
from safemoe.fp8 import quantize_experts
from safemoe.reference import experts_fp8_reference, moe_reference, route_reference

BF16_TOLERANCE, FP8_TOLERANCE = 2e-2, 1e-1
# the bench shapes' activations by (E, K, H, I); a key of another shape is checked with silu
ACTIVATIONS = {shape[:4]: shape[4] for shape in SHAPES.values()}


def parse_key(key: str) -> tuple[int, int, int, int, str | None]:
    """(E, H, I, K, fp8 mode or None) of a table key such as E128_H2048_I768_K8_bfloat16_fp8-block."""
    parts = key.split("_")
    dims = {p[0]: int(p[1:]) for p in parts[:4]}
    quant = key.split("fp8-")[1] if "fp8-" in key else None
    return dims["E"], dims["H"], dims["I"], dims["K"], quant


def check(key: str, num_tokens: int, device: torch.device) -> dict[str, object]:
    num_experts, hidden, inter, top_k, quant = parse_key(key)
    activation = ACTIVATIONS.get((num_experts, top_k, hidden, inter), "silu")
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=device, dtype=torch.bfloat16, generator=gen)
    w13 *= hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, device=device, dtype=torch.bfloat16, generator=gen)
    w2 *= inter**-0.5
    x = torch.randn(num_tokens, hidden, device=device, dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(num_tokens, num_experts, device=device, dtype=torch.float32, generator=gen)
    valid = max(1, num_tokens - 3)
    x[valid:] = float("nan")
    logits[valid:] = float("nan")
    nv = torch.tensor(valid, dtype=torch.int32, device=device)
    if quant is None:
        out = safemoe.moe(x, logits, w13, w2, top_k, activation=activation, num_valid=nv, backend="triton")
        expected = moe_reference(x, logits, w13, w2, top_k, activation=activation,
                                 num_valid=NumValid(valid, None))
        tolerance = BF16_TOLERANCE
    else:
        w13_q, w2_q, w13_s, w2_s = quantize_experts(w13, w2, quant)
        out = safemoe.moe(x, logits, w13_q, w2_q, top_k, activation=activation, num_valid=nv,
                          backend="triton", w13_scale=w13_s, w2_scale=w2_s)
        weights, ids = route_reference(logits, top_k, num_valid=NumValid(valid, None))
        expected = experts_fp8_reference(x, w13_q, w2_q, w13_s, w2_s, weights, ids, activation=activation,
                                         num_valid=NumValid(valid, None))
        tolerance = FP8_TOLERANCE
    err = max_rel_err(out[:valid], expected[:valid])  # max |error| / max |reference|, inf if not finite
    padding_zero = bool((out[valid:] == 0).all())
    return {"key": key, "T": num_tokens, "rel_err": round(err, 5), "padding_zero": padding_zero,
            "ok": err <= tolerance and padding_zero}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", default="", help="only keys containing this")
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--entries", type=Path,
                        help="a JSON {key: [buckets]}: only those (e.g. the entries a tuning run changed)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    only = json.loads(args.entries.read_text()) if args.entries else None
    device = torch.device("cuda")
    table = load_device_configs(torch.cuda.get_device_name(device))
    results = []
    for key, buckets in table.items():
        if args.keys not in key or (only is not None and key not in only):
            continue
        for bucket in sorted(b for b in buckets if b <= args.max_tokens and (only is None or b in only[key])):
            result = check(key, bucket, device)
            results.append(result)
            print(f"{'ok  ' if result['ok'] else 'FAIL'} {key} T={bucket}: rel err {result['rel_err']}, "
                  f"padding zero {result['padding_zero']}", flush=True)
            torch.cuda.empty_cache()
    failed = [r for r in results if not r["ok"]]
    name = torch.cuda.get_device_name(device)
    print(f"{len(results) - len(failed)} of {len(results)} entries ok on {name}")
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(device), "results": results},
                                       indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
