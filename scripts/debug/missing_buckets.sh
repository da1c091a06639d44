#!/usr/bin/env bash
# Debug (issue 13): tune the buckets this GPU's table lacks (`tune_experts.py --missing --write`;
# a bucket without an entry runs its nearest neighbour's tiles, which cost the H200 layer 14-24% at
# DeepSeek-V3 T = 512 / 2048 and gpt-oss T = 512), then A/B every bucket the run wrote against the
# committed table inside the whole layer (ab_entry.py, 3 rounds; the committed side runs the
# nearest entry): full batch and one-row padded step. Keep what the A/B confirms by copying
# entries from $OUT/tuned_NVIDIA_*.json (with their layer_ab_us) into the committed table.
#   OUT=/tmp/x bash scripts/debug/missing_buckets.sh "deepseek,gptoss,qwen3next" [BUDGET_S]
source "$(dirname "$0")/device_table.sh"
shapes=$1
budget=${2:-240}
tuned="$OUT/tuned_$(basename "$table")"
cp "$table" "$OUT/committed.json"
timeout $((budget + 90)) python scripts/tune_experts.py --out "$OUT/tune_missing" --shapes "$shapes" --missing \
  --write --budget-s "$budget" 2>&1 | grep -v -i warn | tail -20
cp "$table" "$tuned"
cp "$OUT/committed.json" "$table"
# shape (ab_entry's name) and bucket of every entry the tuned table has and the committed one lacks
python - "$OUT/committed.json" "$tuned" "$shapes" > "$OUT/new_buckets.txt" <<'PY'
import json, sys
sys.path.insert(0, "scripts")
from tune_experts import _shape_entries
old, new = (json.load(open(p))["configs"] for p in sys.argv[1:3])
for name in sys.argv[3].split(","):
    for bucket in sorted(set(_shape_entries(new, name)[1]) - set(_shape_entries(old, name)[1]), key=int):
        print(name, bucket)
PY
cat "$OUT/new_buckets.txt"
while read -r name bucket; do
  for t in "$bucket" "$bucket:1"; do
    timeout 90 python scripts/debug/ab_entry.py "$name" "$t" "$bucket" "$tuned" --rounds 3 2>&1 | grep -v -i warn | tail -1
  done
done < "$OUT/new_buckets.txt"
tar czf "$OUT/tune_logs.tar.gz" -C "$OUT" tune_missing && rm -rf "$OUT/tune_missing" "$OUT/committed.json"
date -u
