#!/usr/bin/env bash
# Debug (issue 13, twentieth session): the DeepSeek-V3 T = 2048 entry (deepseek_2048_tune.sh) against
# the committed table, which has no 2048 bucket (T = 2048 then runs the 1024 entry, T = 4096 the
# 8192 entry; with a 2048 entry T = 4096 takes it: the nearest bucket, ties to the smaller), in the
# whole layer (ab_entry.py): full batches of 2048 and 4096 and their one-row padded steps. Then
# Qwen3-Next's serving buckets T = 128 and 512 (not bench points) re-tuned with the wide lists
# (the padded-step rule now on for bf16) and A/B'd the same way.
#   OUT=/tmp/x bash scripts/debug/deepseek_2048_ab.sh TUNED_DEEPSEEK_TABLE.json
source "$(dirname "$0")/device_table.sh"
for t in 2048 2048:1 4096 4096:1; do
  timeout 90 python scripts/debug/ab_entry.py deepseek $t 2048 "$1" --rounds 3 2>&1 | grep -v -i warn | tail -1
done
cp "$table" "$OUT/committed.json"
timeout 170 python scripts/tune_experts.py --out "$OUT/tune_qwen3next_128_512" --shapes qwen3next \
  --tokens 128,512 --wide --write --budget-s 110 2>&1 | grep -v -i warn | tail -8
cp "$table" "$OUT/tuned_qwen3next_$(basename "$table")"
cp "$OUT/committed.json" "$table"
for t in 128 128:1 512 512:1; do
  timeout 40 python scripts/debug/ab_entry.py qwen3next $t ${t%%:*} "$OUT/tuned_qwen3next_$(basename "$table")" \
    --rounds 5 2>&1 | grep -v -i warn | tail -1
done
tar czf "$OUT/tune_logs.tar.gz" -C "$OUT" tune_qwen3next_128_512 && rm -rf "$OUT/tune_qwen3next_128_512" "$OUT/committed.json"
date -u
