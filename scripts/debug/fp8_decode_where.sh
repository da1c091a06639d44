#!/usr/bin/env bash
# Debug (issue 13, nineteenth session): the fp8 quick bench with today's kernels, then where Qwen3's
# fp8 decode step spends its time against bf16: a graph-replay timeline of each kernel
# (decode_timeline.py) and Nsight Compute on one eager step (ncu_layer.sh) at T = 64 and 256.
#   OUT=/tmp/x bash scripts/debug/fp8_decode_where.sh
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=src:scripts/debug
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
date -u
timeout 330 python -m safemoe.bench.experts_fp8 --quick --out "$OUT/bench" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; tail -25 "$OUT/bench.log"
timeout 100 python scripts/debug/decode_timeline.py quant=block qwen3:64 qwen3:256 quant=none qwen3:64 qwen3:256 \
  2>&1 | grep -v -i warn | tee "$OUT/timeline.txt"
mkdir -p "$OUT/ncu"
OUT="$OUT/ncu" timeout 150 bash scripts/debug/ncu_layer.sh "qwen3 256 block" "qwen3 256" "qwen3 64 block" \
  2>&1 | tee "$OUT/ncu.txt"
# the device tool returns a limited number of files: the CSVs come back as one archive
tar czf "$OUT/ncu.tar.gz" -C "$OUT" ncu && rm -rf "$OUT/ncu"
date -u
