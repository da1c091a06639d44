# Sourced by the debug scripts that re-tune or A/B table entries on the GPU (small_batch_pin.sh,
# decode_t1_retune*.sh, few_source_ab.sh): the environment, $table (this GPU's device JSON) and
# `tune_write TIMEOUT_S TAIL_LINES ARGS...`, which keeps the table as it was under
# $OUT/table_before.json, runs `tune_experts.py --out $OUT/tune --write ARGS...` into
# $OUT/tune.log, prints its rc and last lines, and keeps the written table as
# $OUT/table_after.json; `changed_buckets KEY` then names the entries it changed.
set -u
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:?set OUT}
table=$(python -c "import torch; from safemoe.configs import device_file; print(device_file(torch.cuda.get_device_name()))")

tune_write() {
  local limit=$1 lines=$2
  shift 2
  cp "$table" "$OUT/table_before.json"
  timeout "$limit" python scripts/tune_experts.py --out "$OUT/tune" --write "$@" > "$OUT/tune.log" 2>&1
  echo "tune rc=$?"
  grep -v "^\s*$" "$OUT/tune.log" | cut -c1-700 | tail -"$lines"
  cp "$table" "$OUT/table_after.json"
}

# `changed_buckets KEY`: the buckets of shape key KEY whose config (ExpertsConfig: tiles and flags,
# not timings) differs between $OUT/table_before.json and $OUT/table_after.json, space-separated.
changed_buckets() {
  python - "$OUT/table_before.json" "$OUT/table_after.json" "$1" <<'PY'
import json, sys
from safemoe.configs import ExpertsConfig
before, after = (json.load(open(p))["configs"][sys.argv[3]] for p in sys.argv[1:3])
print(" ".join(b for b in after if b.isdigit() and (
    b not in before or ExpertsConfig.from_json(after[b]) != ExpertsConfig.from_json(before[b]))))
PY
}

# `layer_ab SHAPE BUCKET OTHER_TABLE STEP/ROUNDS...`: each step (T or T:NUM_VALID) of the whole
# layer with the device table against BUCKET's entry of OTHER_TABLE (`ab_entry.py`, interleaved
# rounds), appended to $OUT/ab.txt.
layer_ab() {
  local shape=$1 bucket=$2 other=$3
  shift 3
  {
    for step_rounds in "$@"; do
      timeout 120 python scripts/debug/ab_entry.py "$shape" "${step_rounds%/*}" "$bucket" "$other" \
        --rounds "${step_rounds#*/}"
    done
  } 2>&1 | grep -v -i warn | tee -a "$OUT/ab.txt"
}

# `shape_bench BENCH_SHAPE TIMEOUT_S`: `safemoe bench --suite layer` of one shape into $OUT/layer,
# its decode and padding verdicts printed.
shape_bench() {
  timeout "$2" python -m safemoe bench --suite layer --shapes "$1" --out "$OUT/layer" > "$OUT/layer.log" 2>&1
  echo "bench rc=$?"
  grep -E "^\| (decode|padding)" "$OUT/layer/layer_targets.md"
}
