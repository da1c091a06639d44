#!/usr/bin/env bash
# Debug (issue 13, twenty-fifth session): with the packed 16-row fused tiles on by default and the
# H200 entries that now run fused (Qwen3 T = 4 / 8, DeepSeek-V3 T = 8, gpt-oss T = 8), in one call:
#  1. the few-slot and fused tests on the GPU;
#  2. layer A/Bs (fused_decode.py) of buckets the change reaches untimed (gpt-oss T = 16 takes the
#     T = 8 entry, Qwen3-Next T = 4 and Mixtral T = 32 could run fused) and of a few tile variants
#     for Qwen3 T = 8 fused (the run of 2026-12-02 also timed buckets of 65-128 slots packed, with
#     a "+pack128" side since dropped: 12-53% slower, bench/results/logs/packed_on_ab_*);
#  3. `safemoe bench --suite layer` (all five shapes) for issue 13's verdict.
#   OUT=/tmp/x bash scripts/debug/packed_on_bench.sh
set -u
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:?set OUT}
timeout 120 python -m pytest -q tests/test_experts.py -k "(fused or few_slot) and cuda" -p no:cacheprovider \
  2>&1 | tail -3 | tee "$OUT/tests.txt"
ab() {  # shape tokens variants...
  local shape=$1 tokens=$2
  shift 2
  timeout 60 python scripts/debug/fused_decode.py --shapes "$shape" --tokens "$tokens" --rounds 3 \
    --variants "$@" --out "$OUT/ab_${shape}_${tokens}.json" 2>&1 | grep -v -i warn | cut -c1-900
}
{
  ab gptoss 16 fused
  ab qwen3next 4 fused
  ab mixtral 32 fused
  ab qwen3 8 fused fused:g1n=32 fused:g1s=3 fused:g2k=64
} | tee "$OUT/ab.txt"
timeout 400 python -m safemoe bench --suite layer --out "$OUT/layer" > "$OUT/layer.log" 2>&1
echo "bench rc=$?"
tail -n 40 "$OUT/layer.log"
