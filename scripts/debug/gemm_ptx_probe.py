"""Debug (issue 13, fp8 decode): what the GEMM kernels of one layer step compile to.

    PYTHONPATH=src:scripts/debug python3 scripts/debug/gemm_ptx_probe.py SHAPE T [per_tensor|block] ...

Runs `ncu_step`'s eager layer step (ab_entry.layer_step) for each SHAPE T [QUANT] case with a fresh
Triton cache, then prints per compiled kernel its warps, stages, shared memory and the count of
the PTX instructions that tell how it streams and multiplies: wgmma (Hopper warpgroup MMA),
mma.sync (Ampere-style MMA), TMA loads (cp.async.bulk.tensor), cp.async, plain global loads, and
conversions. The thirteenth session measured the fp8 decode GEMM1 streaming at ~75% of the read
ceiling against ~90% for bf16 on the same shape; this says whether the two compile alike.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path

PATTERNS = {
    "wgmma": r"wgmma\.mma_async",
    "mma.sync": r"\bmma\.sync",
    "mma.e4m3": r"\bmma\.sync\S*e4m3",  # native fp8 MMA (sm_89+)
    "cvt.e4m3": r"\bcvt\S*e4m3",  # fp8 <-> f16 conversions (an upcast before a 16-bit MMA)
    "tma": r"cp\.async\.bulk\.tensor",
    "cp.async": r"cp\.async\.(?:ca|cg)",
    "ld.global": r"ld\.global",
    "ldmatrix": r"ldmatrix",
    "cvt": r"\bcvt\.",
    "prmt": r"\bprmt\.",
}


def main() -> None:
    args = sys.argv[1:]
    cases: list[list[str]] = []
    for arg in args:
        if arg.isdigit() or arg in ("per_tensor", "block"):
            cases[-1].append(arg)
        else:
            cases.append([arg])
    for case in cases:
        cache = tempfile.mkdtemp(prefix="ptx_probe_")
        os.environ["TRITON_CACHE_DIR"] = cache
        # A fresh interpreter per case: the cache dir is read when triton compiles the first kernel.
        code = (
            "import sys, torch; from ab_entry import layer_step; "
            f"s = layer_step({case[0]!r}, {int(case[1])}, {int(case[1])}, torch.device('cuda'), "
            f"{case[2] if len(case) > 2 else None!r}); s(0); torch.cuda.synchronize()"
        )
        rc = os.system(f'{sys.executable} -c "{code}"')
        print(f"=== {' '.join(case)} (rc {rc})")
        for ptx in sorted(Path(cache).rglob("*.ptx")):
            if not re.search(r"gemm|quantize|combine|count|route", ptx.name):
                continue
            text = ptx.read_text()
            meta_path = ptx.with_suffix(".json")
            meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
            counts = {k: len(re.findall(v, text)) for k, v in PATTERNS.items()}
            print(f"{ptx.stem:28s} warps {meta.get('num_warps')} stages {meta.get('num_stages')} "
                  f"shared {meta.get('shared')} " + " ".join(f"{k} {v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
