#!/usr/bin/env bash
# Debug (issue 13, prepared in the twenty-fifth session, not yet run): the warps of Qwen3-Next's
# decode dispatch (kernels/dispatch.py MANY_BINS_WARPS: a one-program launch of <= CHUNK slots with
# 1024 bins), which took 10.8 us of Qwen3-Next T = 8's 135.5 us step on an H200 (eager kernel
# times; Qwen3's 256-bin one 3.0 us). In one device call:
#  1. the knob's layout test on the GPU (4 / 8 / 16 warps);
#  2. the dispatch alone and the whole layer at 4 (today), 8 and 16 warps, interleaved; as controls
#     the knob does not reach: Qwen3 (256 bins) and Qwen3-Next T = 256 (a program wider than CHUNK,
#     ALONE_WARPS), here with 8 valid rows.
#   OUT=/tmp/x bash scripts/debug/many_bins_dispatch_ab.sh
set -u
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:?set OUT}
timeout 120 python -m pytest -q tests/test_dispatch.py -k "many_bins and cuda" -p no:cacheprovider 2>&1 \
  | tail -3 | tee "$OUT/tests.txt"
settings=(4096/8/1024/4 4096/8/1024/8 4096/8/1024/16)
{
  timeout 150 python scripts/debug/dispatch_alone_ab.py --dispatch-only --rounds 5 --alone "${settings[@]}" \
    512:10:8 512:10:64 512:10:64:8 128:8:8
  timeout 240 python scripts/debug/dispatch_alone_ab.py --rounds 5 --alone "${settings[@]}" \
    qwen3next:8 qwen3next:64 qwen3next:256:8 qwen3:8
} 2>&1 | grep -v -i warn | tee "$OUT/many_bins_ab.txt"
