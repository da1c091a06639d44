#!/bin/bash
# Debug (issue 13, eighteenth session): the fp8 Qwen3 T = 256 entries with one_launch on against the
# device table's (off), inside the whole layer (ab_entry.py --quant, 5 interleaved rounds): the full
# batch and the padded steps with 8 and 1 valid rows. Log:
# bench/results/logs/one_launch_fp8_qwen3_256_NVIDIA-H200_2026-11-28.txt
set -u
export PYTHONPATH=src:scripts/debug
other=$(mktemp --suffix=.json)
python - "$other" <<'PY'
import json, sys, torch
from safemoe.configs import device_file
table = json.loads(device_file(torch.cuda.get_device_name()).read_text())
for quant in ("block", "per_tensor"):
    table["configs"][f"E128_H2048_I768_K8_bfloat16_fp8-{quant}"]["256"]["one_launch"] = True
open(sys.argv[1], "w").write(json.dumps(table))
PY
nvidia-smi --query-gpu=name --format=csv,noheader
for q in block per_tensor; do for t in 256 256:8 256:1; do
  python scripts/debug/ab_entry.py qwen3 $t 256 "$other" --quant $q --rounds 5 2>&1 | grep -v -i warn
done; done
