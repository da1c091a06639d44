#!/usr/bin/env bash
# Debug (issue 13, twenty-seventh session; QUICK=1 run that session, log
# bench/results/logs/few_source_ab_NVIDIA-H200_2026-12-02.txt: T = 4 +3.8%, the 1024 bucket's one-row step +10.5%): the one-valid-row padded
# step of a large bucket runs the few-slot tiles of few_slots_bucket(K) (gpt-oss K = 4: T = 4's
# entry; Qwen3 K = 8: T = 2's), compiled into the large bucket's launches. gpt-oss's T = 4 entry is
# a copy of the old T = 8 tiles; T = 1's re-tune of 2026-12-02 (TMA loads, GEMM2 32 x 128, 4
# stages) made T = 1 5.7% faster in the layer and left the padding ratio at 1.13x (64.0 / 56.7 us;
# 1.1x needs the padded step under ~62.4). Here T = 4's entry (Qwen3: T = 2's) takes T = 1's GEMM
# tiles in an "other" table, A/B'd inside the whole layer (`ab_entry.py`, interleaved) on the steps
# it serves: the few-slot bucket itself, and one valid row in the 64, 256 and 1024 buckets.
#   OUT=/tmp/x [TUNE=1 [TUNE_ONLY=1]] [QUICK=1 | QWEN3_ONLY=1] bash scripts/debug/few_source_ab.sh
source "$(dirname "$0")/tune_write.sh"
python - "$table" "$OUT" <<'PY'
import json, sys
table, out = sys.argv[1], sys.argv[2]
for shape, key, few in (("gptoss", "E128_H2880_I2880_K4_bfloat16", "4"), ("qwen3", "E128_H2048_I768_K8_bfloat16", "2")):
    data = json.load(open(table))
    entries = data["configs"][key]
    entries[few] = {**entries[few], "gemm1": entries["1"]["gemm1"], "gemm2": entries["1"]["gemm2"]}
    print(shape, f"T = {few} other:", json.dumps({k: entries[few][k] for k in ("gemm1", "gemm2", "fused")}))
    json.dump(data, open(f"{out}/other_{shape}.json", "w"), indent=1)
PY
# QUICK=1: gpt-oss's T = 4 and 1024-bucket one-row step only, 3 rounds (~1 min); TUNE_ONLY=1:
# none of these A/Bs, only the TUNE=1 part; QWEN3_ONLY=1: Qwen3's three only
if [ -n "${TUNE_ONLY:-}" ]; then
  :
elif [ -n "${QWEN3_ONLY:-}" ]; then
  layer_ab qwen3 2 "$OUT/other_qwen3.json" 2/5 1024:1/5 256:1/5
elif [ -n "${QUICK:-}" ]; then
  layer_ab gptoss 4 "$OUT/other_gptoss.json" 1024:1/3 4/3
else
  layer_ab gptoss 4 "$OUT/other_gptoss.json" 4/5 1024:1/5 256:1/5 64:1/5
  layer_ab qwen3 2 "$OUT/other_qwen3.json" 2/5 1024:1/5 256:1/5
fi
# TUNE=1: also the tuner's own search of gpt-oss T = 4, written to the device table (its dependents
# check times the 1024 bucket's one-row step with each winner and refuses one that slows it), then
# the whole layer with the new table against T = 4's old entry at T = 4 and that one-row step. Ran
# (TUNE_ONLY) on the H200 on 2026-12-02: entry kept (winner's one-row step 72.7 us against 62.3); log
# bench/results/logs/programs_qwen3next_gptoss_t4_NVIDIA-H200_2026-12-02.txt.
if [ -n "${TUNE:-}" ]; then
  tune_write 230 10 --shapes gptoss --tokens 4 --search-fused --wide
  if [[ " $(changed_buckets E128_H2880_I2880_K4_bfloat16) " == *" 4 "* ]]
  then
    layer_ab gptoss 4 "$OUT/table_before.json" 4/5 1024:1/5
  else
    echo "gpt-oss T = 4: the tuner kept the entry's tiles"
  fi
  rm -f "$OUT"/tune/*.json
fi
