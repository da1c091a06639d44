#!/usr/bin/env bash
# Debug (issue 13, prepared in the twenty-fourth session): the packed 16-row tiles of the fused
# few-slot launch (kernels/experts.py PACK_FUSED_ROWS, then an A/B switch that was off; on since this
# run) in one device call.
#  1. The fused-bucket tests on the GPU (packed and 64-slot cases included) and under memcheck.
#  2. Whole-layer A/Bs (fused_decode.py, interleaved rounds): each bucket of 16 < T*K <= 64 slots as
#     its entry is ("two"), fused with 32-row tiles, and fused with packed tiles ("+pack"); gpt-oss
#     T = 8 also with the wider tiles that were 1.8% faster fused in the twenty-fourth session.
#     Buckets of 33-64 slots (Qwen3 / DeepSeek-V3 T = 8) run fused only packed.
#   OUT=/tmp/x bash scripts/debug/packed_fused_ab.sh
set -u
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:?set OUT}
timeout 150 python -m pytest -q tests/test_experts.py -k "64_slots and cuda" -p no:cacheprovider 2>&1 \
  | tail -3 | tee "$OUT/tests.txt"
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 \
  python -m pytest -q tests/test_experts.py -k "64_slots and cuda and True" -p no:cacheprovider 2>&1 \
  | tail -3 | tee "$OUT/memcheck.txt"
ab() {  # shape tokens variants...
  local shape=$1 tokens=$2
  shift 2
  timeout 120 python scripts/debug/fused_decode.py --shapes "$shape" --tokens "$tokens" --rounds 3 \
    --variants "$@" --out "$OUT/packed_${shape}_${tokens}.json" 2>&1 | grep -v -i warn | cut -c1-1200
}
{
  ab gptoss 8 fused fused+pack fused:g1n=64,g2n=128 fused:g1n=64,g2n=128+pack
  ab qwen3next 2 fused fused+pack
  ab qwen3 4 fused fused+pack
  ab deepseek 4 fused fused+pack
  ab mixtral 16 fused fused+pack
  ab qwen3 8 fused+pack
  ab deepseek 8 fused+pack
} | tee "$OUT/packed_ab.txt"
