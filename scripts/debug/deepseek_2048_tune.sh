#!/usr/bin/env bash
# Debug (issue 13, twentieth session): DeepSeek-V3 has no T = 2048 entry in the H200 table, so the
# layer bench's T = 2048 point (64 rows an expert) runs the T = 1024 entry's 64-row tiles (the
# nearest bucket). Qwen3-Next's T = 2048 went from 63.8% to 75.3% of its read floor with its own
# entry (thirteenth session). Tune the bucket (tiles, then GEMM1's interleave and GEMM2's engine, as
# the prefill buckets were), then the layer bench of DeepSeek-V3 on the written table.
# The table comes back as $OUT/tuned_NVIDIA_*.json.
#   OUT=/tmp/x bash scripts/debug/deepseek_2048_tune.sh
source "$(dirname "$0")/device_table.sh"
timeout 300 python scripts/tune_experts.py --out "$OUT/tune_deepseek_2048" --shapes deepseek --tokens 2048 \
  --write --budget-s 200 2>&1 | grep -v -i warn | tail -8
timeout 60 python scripts/tune_experts.py --out "$OUT/tune_deepseek_2048_interleave" --shapes deepseek --tokens 2048 \
  --interleave-only --write 2>&1 | grep -v -i warn | tail -3
timeout 60 python scripts/tune_experts.py --out "$OUT/tune_deepseek_2048_engine" --shapes deepseek --tokens 2048 \
  --engine-only --write 2>&1 | grep -v -i warn | tail -3
cp "$table" "$OUT/tuned_$(basename "$table")"
timeout 170 python -m safemoe bench --suite layer --shapes deepseek-v3 --out "$OUT/layer" > "$OUT/layer.log" 2>&1
echo "bench rc=$?"; grep -E "deepseek-v3,(1|8|64|256|2048|8192|1024)," "$OUT/layer/layer.csv" | grep -E "triton|grouped" | cut -d, -f2-8
cat "$OUT/layer/layer_targets.md" 2>/dev/null || tail -20 "$OUT/layer.log"
date -u
