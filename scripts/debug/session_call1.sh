#!/usr/bin/env bash
# Session 2026-11-24b, call 1: GPU tests at HEAD, the ep family on one GPU (gloo over CUDA).
set -u
OUT=${1:?OUT}
export PYTHONPATH=$PWD/src:$PWD/tests
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/device.txt
python3 -c "import xdist" 2>/dev/null && XD="-n 4" || XD=""
echo "xdist: ${XD:-none}" > $OUT/tests.log
timeout -s INT --kill-after=15 330 python3 -m pytest tests -m "gpu or not slow" -q -p no:cacheprovider $XD >> $OUT/tests.log 2>&1
echo "tests rc=$?"; tail -n 15 $OUT/tests.log
timeout 200 python3 -m safemoe check --only ep --scale cuda --peers none --json $OUT/check_ep.json > $OUT/check_ep.txt 2>&1
echo "check ep rc=$?"; tail -n 22 $OUT/check_ep.txt
