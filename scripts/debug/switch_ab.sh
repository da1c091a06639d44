#!/bin/bash
# Debug (issue 13): one tree's module switch off (0) and on (1), whole layer in fp8 block mode, two
# alternating rounds (tree_ab.py), outputs compared bit for bit; first the GPU tests the switch
# touches (pytest -k TESTS on test_experts_fp8.py) and memcheck of MEMCHECK (tests/memcheck.py -k).
#   bash scripts/debug/switch_ab.sh MODULE.SWITCH TESTS MEMCHECK CASE... (CASE: SHAPE:T[:NUM_VALID])
# Nineteenth session (each with its reverted patch from bench/results/logs applied):
#   safemoe.kernels.experts.QUANT_INTER_ON_LOAD "gemm2_load or quantize_on_load or ..." gemm2_load
#     (gemm2_inter_on_load_reverted.patch; log inter_on_load_ab_NVIDIA-H200_2026-11-28.txt)
#   safemoe.kernels.experts.SHARE_INTER_QUANT "last_tile or whole_groups or ..." last_tile
#     (gemm1_inter_last_tile_reverted.patch; log inter_last_tile_ab_NVIDIA-H200_2026-11-28.txt)
set -u
switch=$1 tests=$2 memcheck=$3
shift 3
export PYTHONPATH=src:scripts/debug
nvidia-smi --query-gpu=name --format=csv,noheader; date -u
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_experts_fp8.py -k "$tests" 2>&1 | tail -4
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 \
  python tests/memcheck.py -- -k "$memcheck" 2>&1 | tail -3; echo "memcheck rc=${PIPESTATUS[0]}"
for round in 1 2; do
  for on in 0 1; do
    python scripts/debug/tree_ab.py "${switch##*.}=$on" "$@" --quant block --set "$switch=$on" \
      --save "/tmp/switch_$on.pt"
  done
done 2>&1 | grep -v -i warn
python - <<'PY'
import torch
a, b = torch.load("/tmp/switch_0.pt"), torch.load("/tmp/switch_1.pt")
print("bitwise equal:", all(torch.equal(a[c], b[c]) for c in a), sorted(a))
PY
date -u
