#!/usr/bin/env bash
# Debug (issue 13, prepared in the twenty-fifth session, run in the twenty-sixth): two A/B switches of the
# one-program (decode) dispatch launch, whose count kernel took 10.8 us of Qwen3-Next T = 8's
# 135.5 us step on an H200 (eager kernel times; Qwen3's 256-bin one 3.0 us):
#   kernels/dispatch.py MANY_BINS_WARPS    the warps of a <= CHUNK-slot program with 1024 bins (4)
#   kernels/dispatch.py RANGE_PADDING_FILL the -1 padding as one range, not per bin (on since 2026-12-02)
# In one device call:
#  1. the dispatch tests on the GPU (every case with both fills; the 1024-bin program at 4 / 8 / 16
#     warps) and the range fill under memcheck;
#  2. the dispatch alone and the whole layer, interleaved, with each setting (ALONE_SLOTS /
#     ALONE_WARPS / ATOMIC_COUNT_BINS / MANY_BINS_WARPS / RANGE_FILL; the first is today's);
#     Qwen3-Next T = 256 with 8 valid rows is a program wider than CHUNK (ALONE_WARPS) that the
#     warps do not reach, and Qwen3's 256 bins are not "many".
#   OUT=/tmp/x bash scripts/debug/decode_dispatch_ab.sh
set -u
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:?set OUT}
[ -n "${SKIP_TESTS:-}" ] || timeout 240 python -m pytest -q tests/test_dispatch.py -k cuda -x -p no:cacheprovider 2>&1 | tail -3 \
  | tee "$OUT/tests.txt"
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 1 \
  python -m pytest -q tests/test_dispatch.py -k "cuda and range_fill and (many_bins or poisoned or one_valid)" \
  -p no:cacheprovider 2>&1 | tail -3 | tee "$OUT/memcheck.txt"
settings=(4096/8/1024/4/0 4096/8/1024/4/1 4096/8/1024/16/0 4096/8/1024/16/1)
{
  timeout 150 python scripts/debug/dispatch_alone_ab.py --dispatch-only --rounds 5 \
    512:10:8 512:10:64 512:10:1024:8 128:8:8 128:8:256 --alone "${settings[@]}"
  timeout 240 python scripts/debug/dispatch_alone_ab.py --rounds 5 \
    qwen3next:8 qwen3next:64 qwen3next:256:8 qwen3:8 qwen3:64 qwen3:1024:2 --alone "${settings[@]}"
} 2>&1 | grep -v -i warn | tee "$OUT/decode_dispatch_ab.txt"
