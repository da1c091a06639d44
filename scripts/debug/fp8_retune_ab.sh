#!/usr/bin/env bash
# Debug (issue 13, nineteenth session): the re-tuned Qwen3 fp8 T = 256 entries (fp8_decode_retune.sh)
# against the committed table in the whole layer, interleaved rounds (ab_entry.py), full batch and
# two padded steps, both fp8 modes.
#   OUT=/tmp/x bash scripts/debug/fp8_retune_ab.sh OTHER_TABLE.json
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=src:scripts/debug
nvidia-smi --query-gpu=name --format=csv,noheader; date -u
for quant in block per_tensor; do
  for t in 256 256:8 256:1; do
    python scripts/debug/ab_entry.py qwen3 $t 256 "$1" --rounds 5 --quant $quant 2>&1 | grep -v -i warn | tail -1
  done
done
date -u
