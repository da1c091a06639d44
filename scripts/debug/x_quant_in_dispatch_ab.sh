#!/bin/bash
# Debug (issue 13, eighteenth session): x's fp8 quantisation in the decode dispatch launch
# (kernels/dispatch.py FUSE_X_QUANT) against its own launch, whole layer, two alternating rounds,
# outputs compared bit for bit. Log: bench/results/logs/x_quant_in_dispatch_ab_<device>_2026-11-28.txt
set -u
export PYTHONPATH=src:scripts/debug
D=safemoe.kernels.dispatch
nvidia-smi --query-gpu=name --format=csv,noheader
for round in 1 2; do
  for fused in 0 1; do
    label=$([ "$fused" = 1 ] && echo lent || echo own)
    python scripts/debug/tree_ab.py "$label" qwen3:8 qwen3:64 qwen3:256 deepseek:8 --quant block \
      --set $D.FUSE_X_QUANT=$fused --save "/tmp/xq_block_$fused.pt"
    python scripts/debug/tree_ab.py "$label-t" qwen3:8 qwen3:64 qwen3:256 --quant per_tensor \
      --set $D.FUSE_X_QUANT=$fused --save "/tmp/xq_pt_$fused.pt"
  done
done 2>&1 | grep -v -i warn
python - <<'PY'
import torch
for mode in ("block", "pt"):
    a, b = torch.load(f"/tmp/xq_{mode}_0.pt"), torch.load(f"/tmp/xq_{mode}_1.pt")
    print(mode, "bitwise equal:", all(torch.equal(a[c], b[c]) for c in a), sorted(a))
PY
