#!/usr/bin/env bash
# Debug (issue 13, twentieth session): Qwen3-Next's decode candidate after the wide re-tune
# (decode_retune_ab.sh). The wide winner for T = 256 took the full batch -1.7% in the layer but its
# one-row padded step +16.9%; T = 64's winner (the same GEMM2, GEMM1 of 64 columns and 4 stages)
# put in T = 256 too is the candidate (a copy of the device table with the two entries, now the
# committed H200 table's).
#  1. A/B the candidate's T = 256 and T = 64 entries against the committed ones in the layer: full
#     batch, 8-row and 1-row padded steps.
#  2. The tuner's padded_steps_hold on bf16 on a GPU (no --write): the T = 256 wide search again,
#     whose winner the rule should now turn down.
#  3. The layer bench of Qwen3-Next with the candidate table.
#   OUT=/tmp/x bash scripts/debug/qwen3next_candidate_ab.sh CANDIDATE.json
source "$(dirname "$0")/device_table.sh"
for t in 256 256:8 256:1 64:8; do
  timeout 60 python scripts/debug/ab_entry.py qwen3next $t $(echo ${t%%:*}) "$1" --rounds 5 \
    2>&1 | grep -v -i warn | tail -1
done
timeout 200 python scripts/tune_experts.py --out "$OUT/tune_qwen3next_256" --shapes qwen3next \
  --tokens 256 --wide --budget-s 150 2>&1 | grep -v -i warn | tail -6
cp "$1" "$table"
timeout 200 python -m safemoe bench --suite layer --shapes qwen3-next-80b-a3b --out "$OUT/layer" > "$OUT/layer.log" 2>&1
echo "bench rc=$?"; cat "$OUT/layer/layer_targets.md" 2>/dev/null || tail -20 "$OUT/layer.log"
date -u
