#!/bin/bash
# Debug (issue 13, nineteenth session): fp8 block GEMM1 tiles narrower than a 1x128 group, each
# group's last tile quantising it (kernels/experts.py SHARE_INTER_QUANT), against the separate
# pass: whole layer, two alternating rounds, outputs compared bit for bit; the GPU tests of the
# fp8 paths it touches and memcheck of the new test first. Needs
# bench/results/logs/gemm1_inter_last_tile_reverted.patch applied (the switch was reverted).
# Log: bench/results/logs/inter_last_tile_ab_<device>_2026-11-28.txt
set -u
export PYTHONPATH=src:scripts/debug
E=safemoe.kernels.experts
nvidia-smi --query-gpu=name --format=csv,noheader; date -u
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_experts_fp8.py \
  -k "last_tile or whole_groups or gemm1_epilogue or swapped or x_quantised or graph or small_batch" 2>&1 | tail -4
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 \
  python tests/memcheck.py -- -k last_tile 2>&1 | tail -3; echo "memcheck rc=${PIPESTATUS[0]}"
for round in 1 2; do
  for on in 0 1; do
    label=$([ "$on" = 1 ] && echo last-tile || echo pass)
    python scripts/debug/tree_ab.py "$label" qwen3:8 qwen3:64 qwen3:256 qwen3:256:8 qwen3:256:1 \
      deepseek:8 deepseek:64 deepseek:256 \
      --quant block --set $E.SHARE_INTER_QUANT=$on --save "/tmp/lt_$on.pt"
  done
done 2>&1 | grep -v -i warn
python - <<'PY'
import torch
a, b = torch.load("/tmp/lt_0.pt"), torch.load("/tmp/lt_1.pt")
print("bitwise equal:", all(torch.equal(a[c], b[c]) for c in a), sorted(a))
PY
date -u
