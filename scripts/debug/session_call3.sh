#!/usr/bin/env bash
# Session 2026-11-24b, call 3: one launch for both tile regimes (regimes) vs the tree before it (old_src).
set -u
OUT=${1:?OUT}
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/device.txt
for t in old_src/src src; do echo "== $t"; PYTHONPATH=$t timeout 150 python3 scripts/debug/profile_padding.py; done > $OUT/profile.txt 2>&1
echo "profile rc=$?"
PYTHONPATH=src:tests timeout 170 python3 -m pytest -q -rs -p no:cacheprovider tests/test_experts.py tests/test_experts_fp8.py tests/test_batch_invariance.py tests/test_graphs.py -k "regimes or padding or graph or small_batch or switch" > $OUT/tests.txt 2>&1
echo "tests rc=$?"; tail -n 4 $OUT/tests.txt
SUITES=experts BUDGET_S=200 LIMIT_S=260 bash scripts/bench_compare.sh old_src $OUT/cmp > $OUT/cmp.txt 2>&1
echo "compare rc=$?"; tail -n 5 $OUT/cmp.txt
