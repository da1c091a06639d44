#!/usr/bin/env bash
# Debug (issue 13, twentieth session): serving buckets the H200 table lacks. DeepSeek-V3 T = 512
# (16 rows an expert) runs the 256 entry's tiles, gpt-oss-120b T = 128 and 512 the 64 and 256
# entries' (the nearest bucket, ties to the smaller). Tune them (--write; the bf16 padded-step rule
# applies), then A/B each written entry against the committed table in the whole layer
# (ab_entry.py; the committed side runs the nearest entry): full batch and one-row padded step.
# The tuned table comes back as $OUT/tuned_NVIDIA_*.json.
#   OUT=/tmp/x bash scripts/debug/serving_buckets_tune.sh
source "$(dirname "$0")/device_table.sh"
cp "$table" "$OUT/committed.json"
timeout 230 python scripts/tune_experts.py --out "$OUT/tune_serving" --shapes deepseek,gptoss --tokens 512,128 \
  --write --budget-s 170 2>&1 | grep -v -i warn | tail -10
cp "$table" "$OUT/tuned_$(basename "$table")"
cp "$OUT/committed.json" "$table"
for case in "deepseek 512" "deepseek 512:1" "gptoss 128" "gptoss 128:1" "gptoss 512" "gptoss 512:1"; do
  set -- $case
  timeout 50 python scripts/debug/ab_entry.py $1 $2 ${2%%:*} "$OUT/tuned_$(basename "$table")" --rounds 3 \
    2>&1 | grep -v -i warn | tail -1
done
tar czf "$OUT/tune_logs.tar.gz" -C "$OUT" tune_serving && rm -rf "$OUT/tune_serving" "$OUT/committed.json"
date -u
