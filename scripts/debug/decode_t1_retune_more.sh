#!/usr/bin/env bash
# Debug (issue 13, twenty-seventh session): after gpt-oss T = 1's re-tune (its "run 1" tiles ->
# 57.5 us in the layer from 60.9), the other T = 1 buckets with --search-fused --wide. Qwen3 and
# Qwen3-Next are written (their padding targets fail already, so a faster T = 1 costs no verdict)
# and A/B'd in the layer; Mixtral and DeepSeek-V3 are timed without --write (T = 1 is their
# padding targets' denominator: 1.05x / 1.09x in run 32).
#   OUT=/tmp/x bash scripts/debug/decode_t1_retune_more.sh
source "$(dirname "$0")/tune_write.sh"
tune_write 150 8 --shapes qwen3,qwen3next --tokens 1 --search-fused --wide
layer_ab qwen3 1 "$OUT/table_before.json" 1/5
layer_ab qwen3next 1 "$OUT/table_before.json" 1/5
timeout 120 python scripts/tune_experts.py --out "$OUT/tune2" --shapes mixtral,deepseek --tokens 1 --search-fused --wide \
  > "$OUT/tune2.log" 2>&1
echo "tune2 rc=$?"
grep -v "^\s*$" "$OUT/tune2.log" | cut -c1-600 | tail -8
rm -f "$OUT"/tune*/*.json
