#!/bin/bash
# Debug (issue 13, eighteenth session): GEMM2's L2 weight prefetch before its PDL wait, off / on /
# on with evict-last lines, in one GPU call, alternating rounds (tree_ab.py --set). Writes under $1.
# PREFETCH_ROUNDS (default 2), BF16_CASES and FP8_CASES override the case lists.
set -u
out=${1:-${OUT:-/tmp}}
mkdir -p "$out"
export PYTHONPATH=src:scripts/debug
bf16=${BF16_CASES:-"qwen3:8 qwen3:64 qwen3:256 mixtral:256 gptoss:8 deepseek:64 qwen3:8192"}
fp8=${FP8_CASES:-"qwen3:8 qwen3:64 qwen3:256"}
E=safemoe.kernels.experts
Q=safemoe.kernels.act_quant
declare -A sets=(
  [off]="--set $E.PREFETCH_L2_BYTES=0 --set $Q.EARLY_LAUNCH_OF_GEMM2=0"
  [on]=""
  [last]="--set $E.PREFETCH_EVICT_LAST=1"
)
for round in $(seq "${PREFETCH_ROUNDS:-2}"); do
  for label in off on last; do
    # shellcheck disable=SC2086
    python scripts/debug/tree_ab.py "$label" $bf16 ${sets[$label]} --json "$out/prefetch_ab.jsonl" \
      --save "/tmp/prefetch_$label.pt"
    # shellcheck disable=SC2086
    [ -n "$fp8" ] && python scripts/debug/tree_ab.py "$label-b" $fp8 --quant block ${sets[$label]} \
      --json "$out/prefetch_ab.jsonl"
  done
done
python - <<'PY'
import torch
off = torch.load("/tmp/prefetch_off.pt")
for label in ("on", "last"):
    other = torch.load(f"/tmp/prefetch_{label}.pt")
    print(label, "bitwise equal to off:", all(torch.equal(off[c], other[c]) for c in off), sorted(off))
PY
