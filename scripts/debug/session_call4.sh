#!/usr/bin/env bash
# Session 2026-11-24b, call 4: one_launch as a tuned per-bucket choice vs the tree before the merge.
set -u
OUT=${1:?OUT}
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/device.txt
PYTHONPATH=src:tests timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/test_experts.py -k "regimes or small_batch or switch" -s > $OUT/tests.txt 2>&1
echo "tests rc=$?"; grep -E "bitwise equal|passed|failed" $OUT/tests.txt | tail -n 4
SUITES=experts ROUNDS=2 BUDGET_S=330 LIMIT_S=400 bash scripts/bench_compare.sh old_src $OUT/cmp > $OUT/cmp.txt 2>&1
echo "compare rc=$?"; tail -n 4 $OUT/cmp.txt
