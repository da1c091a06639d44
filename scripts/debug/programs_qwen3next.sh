#!/usr/bin/env bash
# Debug (issue 13, twenty-eighth session): Qwen3-Next T = 64 reads 93.5% of the read floor (run 32;
# 95% needs ~8.5 us off 532) and its decode entries never had programs_per_sm decided
# (`tune_experts.py --programs-only`; 64 programs per SM took 1.8-2.4% off DeepSeek-V3 and gpt-oss
# T = 8-256 on the H200, 2026-11-26). Tunes T = 64 / 256 with --write, then A/Bs each
# changed entry against the table before it inside the whole layer (`ab_entry.py`, interleaved):
# the full batch and its one-row padded step. Ran on the H200 on 2026-12-02: no entry changed (-0.4% /
# -0.8%, under the 1% margin); log bench/results/logs/programs_qwen3next_gptoss_t4_NVIDIA-H200_2026-12-02.txt.
#   OUT=/tmp/x bash scripts/debug/programs_qwen3next.sh
source "$(dirname "$0")/tune_write.sh"
tune_write 150 8 --programs-only --shapes qwen3next --tokens 64,256
changed=$(changed_buckets E512_H2048_I512_K10_bfloat16)
echo "programs_per_sm changed at T = ${changed:-none}"
for bucket in $changed; do
  layer_ab qwen3next "$bucket" "$OUT/table_before.json" "$bucket/5" "$bucket:1/3"
done
