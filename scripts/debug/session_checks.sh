#!/usr/bin/env bash
# Session 2026-11-24b: pieces of the CUDA-scale check matrix in one call, side by side.
#   SAN_ONLY  families run under memcheck (--sanitizer --scale cuda); SAN_JOBS, SAN_MAX
#   PLAIN_ONLY families run without memcheck (--scale cuda); PLAIN_JOBS, PLAIN_MAX
set -u
OUT=${1:?OUT}
export PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/device.txt
git rev-parse HEAD > $OUT/commit.txt 2>/dev/null || true
pids=()
if [ -n "${SAN_ONLY:-}" ]; then
  timeout --kill-after=20 $(( ${SAN_MAX:-480} + 90 )) python3 -m safemoe check --sanitizer --scale cuda --peers none \
    --only "$SAN_ONLY" --jobs ${SAN_JOBS:-12} --max-time ${SAN_MAX:-480} --json $OUT/sanitize.json > $OUT/sanitize.txt 2>&1 &
  pids+=($!)
fi
if [ -n "${PLAIN_ONLY:-}" ]; then
  timeout --kill-after=20 $(( ${PLAIN_MAX:-480} + 90 )) python3 -m safemoe check --scale cuda --peers none \
    --only "$PLAIN_ONLY" --jobs ${PLAIN_JOBS:-4} --max-time ${PLAIN_MAX:-480} --json $OUT/plain.json > $OUT/plain.txt 2>&1 &
  pids+=($!)
fi
for p in "${pids[@]}"; do wait $p; echo "rc=$?"; done
for f in $OUT/sanitize.txt $OUT/plain.txt; do [ -f $f ] && { echo "== $f"; grep -E "memcheck|safemoe \(|^check:" $f; }; done
