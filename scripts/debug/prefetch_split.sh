#!/bin/bash
# Debug (issue 13, eighteenth session): the prefetch and the early launch of GEMM2 apart (fp8 block, Qwen3),
# two rounds, then a timeline with both (H100 log: bench/results/logs/prefetch_split_NVIDIA-H100_2026-11-28.txt).
export PYTHONPATH=src:scripts/debug
E=safemoe.kernels.experts; Q=safemoe.kernels.act_quant
for r in 1 2; do
python scripts/debug/tree_ab.py off qwen3:8 qwen3:64 qwen3:256 --quant block --set $E.PREFETCH_L2_BYTES=0 --set $Q.EARLY_LAUNCH_OF_GEMM2=0
python scripts/debug/tree_ab.py pf qwen3:8 qwen3:64 qwen3:256 --quant block --set $E.PREFETCH_EVICT_LAST=1 --set $Q.EARLY_LAUNCH_OF_GEMM2=0
python scripts/debug/tree_ab.py early qwen3:8 qwen3:64 qwen3:256 --quant block --set $E.PREFETCH_L2_BYTES=0
python scripts/debug/tree_ab.py both qwen3:8 qwen3:64 qwen3:256 --quant block --set $E.PREFETCH_EVICT_LAST=1
done
python - <<'PY'
import safemoe.kernels.experts as E
E.PREFETCH_EVICT_LAST = True
import sys; sys.argv = ["x", "quant=block", "qwen3:256", "qwen3:8"]
exec(open("scripts/debug/decode_timeline.py").read())
PY
