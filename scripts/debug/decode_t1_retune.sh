#!/usr/bin/env bash
# Debug (issue 13, twenty-seventh session): re-tune the T = 1 buckets of gpt-oss (69.7% of the read
# floor in run 32, target 80%), whose H200 entry is still "run 1"'s (2026-11-21) tiles with fused
# decided later; and of Mixtral and DeepSeek-V3 (no T = 1 target, but T = 1 is the padding targets'
# denominator, so a faster T = 1 must be checked against them). In one device call (~5 min):
#  1. `tune_experts.py --shapes gptoss --tokens 1 --search-fused --wide --write` (the table before
#     it kept under $OUT; the tuner refuses a winner that slows a padded step it serves);
#  2. the whole layer at T = 1 and at T = 1024 with one valid row, the new table against T = 1's
#     old entry (`ab_entry.py`);
#  3. `safemoe bench --suite layer --shapes gpt-oss-120b` for the verdict.
#   OUT=/tmp/x bash scripts/debug/decode_t1_retune.sh
source "$(dirname "$0")/tune_write.sh"
tune_write 200 10 --shapes gptoss --tokens 1 --search-fused --wide
layer_ab gptoss 1 "$OUT/table_before.json" 1/5 1024:1/3
shape_bench gpt-oss-120b 120
rm -f "$OUT/layer/layer.png" "$OUT"/tune/*.json
