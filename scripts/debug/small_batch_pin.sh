#!/usr/bin/env bash
# Debug (issue 13, prepared in the twenty-sixth session, run in the twenty-seventh: log
# bench/results/logs/small_batch_pin_NVIDIA-H200_2026-12-02.txt): gpt-oss T = 8 with a
# "small_batch" entry. On the H200 (2026-12-02) the fused wide search found T = 8 tiles faster for
# the bucket, refused because T = 8's entry is also the small-batch tiles of every larger gpt-oss
# bucket (T = 1024 with 8 valid rows 350.4 -> 374.8 us). The tuner now keeps such a winner and
# writes the incumbent as the shape's top-level "small_batch" entry (`small_batch_split`). In one
# device call (~5 min):
#  1. the tune, written to the device table (the table before it kept under $OUT);
#  2. the whole layer at T = 8 and at T = 1024 with 8 valid rows, the new table against the T = 8
#     entry of the old one (`ab_entry.py`; with the pin, T = 1024's 8-row step runs the old tiles
#     on both sides, so it should be level);
#  3. `safemoe bench --suite layer --shapes gpt-oss-120b` for the verdict (target: T = 8 >= 95%).
#  4. the E = 512 decode dispatch at 4 / 8 warps with the range fill (the twenty-sixth session
#     timed 4 and 16 only: 16 was 1.6x slower), alone and in the Qwen3-Next layer at T = 8 / 64
#     (93.3% of the floor at T = 64 in run 31; the dispatch alone is 7.5 us of its 542).
# MIXTRAL=1 also runs the wide tune of Mixtral T = 256 (the (256, 64, 8, 4) GEMM1 tile from vLLM's
# H200 table), without --write.
#   OUT=/tmp/x bash scripts/debug/small_batch_pin.sh
source "$(dirname "$0")/tune_write.sh"
tune_write 240 12 --shapes gptoss --tokens 8 --search-fused --wide
python - "$OUT" <<'PY'
import json, sys
before, after = (json.load(open(f"{sys.argv[1]}/table_{s}.json")) for s in ("before", "after"))
key = "E128_H2880_I2880_K4_bfloat16"
print("T = 8 before:", json.dumps({k: v for k, v in before["configs"][key]["8"].items() if k in ("gemm1", "gemm2", "fused")}))
print("T = 8 after: ", json.dumps({k: v for k, v in after["configs"][key]["8"].items() if k in ("gemm1", "gemm2", "fused")}))
print("small_batch:", json.dumps(after.get("small_batch", {}).get(key)))
PY
layer_ab gptoss 8 "$OUT/table_before.json" 8/5 1024:8/3
shape_bench gpt-oss-120b 200
settings=(4096/8/1024/4/1 4096/8/1024/8/1)
{
  timeout 100 python scripts/debug/dispatch_alone_ab.py --dispatch-only --rounds 5 \
    512:10:8 512:10:64 512:10:1024:8 --alone "${settings[@]}"
  timeout 150 python scripts/debug/dispatch_alone_ab.py --rounds 5 \
    qwen3next:8 qwen3next:64 --alone "${settings[@]}"
} 2>&1 | grep -v -i warn | tee "$OUT/dispatch_warps.txt"
if [ -n "${MIXTRAL:-}" ]; then
  timeout 300 python scripts/tune_experts.py --out "$OUT/tune_mixtral" --shapes mixtral --tokens 256 --wide \
    --budget-s 240 2>&1 | grep -v "^\s*$" | cut -c1-700 | tail -8
fi
