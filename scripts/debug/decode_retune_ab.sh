#!/usr/bin/env bash
# Debug (issue 13, twentieth session): the two near misses of run 28.
#  1. Qwen3-Next's decode buckets (T = 8 / 64 / 256; T = 256 at 91.0% of the read floor against 92%)
#     were tuned with the default candidate lists only: re-tune them with the wide lists, then A/B
#     every bucket the tuner changed against the committed entry inside the whole layer
#     (ab_entry.py, interleaved rounds), on its full batch and its 8-row and 1-row padded steps.
#  2. Mixtral T = 256 (80.2%, 128-row blocks for ~64 rows an expert): GEMM2 on the Gluon engine,
#     which the tuner had decided for prefill buckets only, then the same layer A/B.
#  3. The fp8 search's check_dependents path on a GPU (CPU-tested only so far), without --write.
# The tuned table comes back as $OUT/tuned_NVIDIA_*.json.
#   OUT=/tmp/x bash scripts/debug/decode_retune_ab.sh
source "$(dirname "$0")/device_table.sh"
cp "$table" "$OUT/committed.json"
timeout 240 python scripts/tune_experts.py --out "$OUT/tune_qwen3next" --shapes qwen3next \
  --tokens 8,64,256 --wide --write --budget-s 140 2>&1 | grep -v -i warn | tail -12
timeout 100 python scripts/tune_experts.py --out "$OUT/tune_engine_mixtral" --shapes mixtral --tokens 256 \
  --engine-only --write 2>&1 | grep -v -i warn | tail -6
cp "$table" "$OUT/tuned_$(basename "$table")"
cp "$OUT/committed.json" "$table"   # the A/B's "table" side is the committed table
for t in 256 256:8 256:1 64 64:1; do
  timeout 60 python scripts/debug/ab_entry.py qwen3next $t ${t%%:*} "$OUT/tuned_$(basename "$table")" --rounds 5 \
    2>&1 | grep -v -i warn | tail -1
done
timeout 40 python scripts/debug/ab_entry.py qwen3next 8 8 "$OUT/tuned_$(basename "$table")" --rounds 5 \
  2>&1 | grep -v -i warn | tail -1
for t in 256 256:8 256:1; do
  timeout 60 python scripts/debug/ab_entry.py mixtral $t 256 "$OUT/tuned_$(basename "$table")" --rounds 5 \
    2>&1 | grep -v -i warn | tail -1
done
timeout 150 python scripts/tune_experts.py --out "$OUT/tune_fp8_dependents" --shapes qwen3 --tokens 8 \
  --quant block --replace-margin 0 --budget-s 40 2>&1 | grep -v -i warn | tail -12
date -u
