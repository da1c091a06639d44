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
set -u
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:?set OUT}
table=$(python -c "import torch; from safemoe.configs import device_file; print(device_file(torch.cuda.get_device_name()))")
cp "$table" "$OUT/table_before.json"
timeout 200 python scripts/tune_experts.py --out "$OUT/tune" --shapes gptoss --tokens 1 --search-fused --wide \
  --write > "$OUT/tune.log" 2>&1
echo "tune rc=$?"
grep -v "^\s*$" "$OUT/tune.log" | cut -c1-700 | tail -10
cp "$table" "$OUT/table_after.json"
{
  timeout 100 python scripts/debug/ab_entry.py gptoss 1 1 "$OUT/table_before.json" --rounds 5
  timeout 100 python scripts/debug/ab_entry.py gptoss 1024:1 1 "$OUT/table_before.json" --rounds 3
} 2>&1 | grep -v -i warn | tee "$OUT/ab.txt"
timeout 120 python -m safemoe bench --suite layer --shapes gpt-oss-120b --out "$OUT/layer" > "$OUT/layer.log" 2>&1
echo "bench rc=$?"
grep -E "^\| (decode|padding)" "$OUT/layer/layer_targets.md"
rm -f "$OUT/layer/layer.png" "$OUT"/tune/*.json
