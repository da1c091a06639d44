#!/usr/bin/env bash
# Debug (issue 13, nineteenth session): re-tune Qwen3's fp8 decode buckets on this GPU with the wide
# candidate lists (the H200 table's fp8 decode entries predate the block-mode GEMM1 epilogue that
# quantises the intermediate, which 128-column GEMM1 tiles get), then the fp8 quick bench on the
# table it wrote. The table comes back as $OUT/NVIDIA_*.json.
#   OUT=/tmp/x bash scripts/debug/fp8_decode_retune.sh
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=src
nvidia-smi --query-gpu=name --format=csv,noheader; date -u
for quant in block per_tensor; do
  timeout 220 python scripts/tune_experts.py --out "$OUT/tune_$quant" --shapes qwen3 \
    --tokens 8,64,256 --quant $quant --wide --write --budget-s 150 2>&1 | grep -v -i warn | tail -8
done
cp src/safemoe/configs/NVIDIA_*.json "$OUT/"
timeout 150 python -m safemoe.bench.experts_fp8 --quick --out "$OUT/bench" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; cat "$OUT/bench/experts_fp8_targets.md"
date -u
