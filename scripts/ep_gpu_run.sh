#!/usr/bin/env bash
# Expert parallelism on a host with >= 2 GPUs: the NCCL tests (tests/test_distributed.py -m gpu)
# and the `ep` bench suite, with NVLink multicast off. Runs from a checkout with PYTHONPATH=src.
#
#   bash scripts/ep_gpu_run.sh OUT_DIR
#
# Environment:
#   EP_TESTS_TIMEOUT   seconds for the tests (default 100)
#   EP_BENCH_TIMEOUT   seconds for the bench (default 180); a bench cut short keeps the rows it
#                      finished in OUT_DIR/bench/ep.partial.jsonl
#   EP_QUICK=1         bench T per rank in {1, 64, 4096} instead of {1, 8, 64, 256, 4096}
#   EP_CEILINGS        a JSON with a "ceilings" entry to reuse (default: the committed H200 one when
#                      the GPUs are H200s, else measured)
#
# `timeout` signals its whole process group, so the spawned ranks stop with their parent. Writes
# OUT_DIR/{env,tests,bench}.log, OUT_DIR/bench/ep.{csv,json,png}, OUT_DIR/summary.txt; prints the
# summary last; exits non-zero if a stage failed.
set -u

OUT_DIR=${1:?usage: scripts/ep_gpu_run.sh OUT_DIR}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
cd "$(dirname "$0")/.."

export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
TESTS_TIMEOUT=${EP_TESTS_TIMEOUT:-100}
BENCH_TIMEOUT=${EP_BENCH_TIMEOUT:-180}

{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv 2>&1 || true
    nvidia-smi topo -m 2>&1 || true
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())' 2>&1
    python3 -c 'import triton; print("triton", triton.__version__)' 2>&1
    git rev-parse HEAD 2>/dev/null || echo "no git"
} > "$OUT_DIR/env.txt"

FAILED=0
declare -A RESULT=()
record() {  # stage rc detail
    if [ "$2" -eq 0 ]; then RESULT[$1]="ok${3:+ ($3)}"
    elif [ "$2" -eq 124 ]; then RESULT[$1]="FAILED: timed out after its limit${3:+ ($3)}"; FAILED=1
    else RESULT[$1]="FAILED: exit $2${3:+ ($3)}"; FAILED=1
    fi
}

echo "== tests (limit ${TESTS_TIMEOUT} s) =="
timeout -s INT --kill-after=15 "$TESTS_TIMEOUT" python3 -m pytest tests/test_distributed.py -m gpu -q \
    -p no:cacheprovider -rfE > "$OUT_DIR/tests.log" 2>&1
rc=$?
counts=$(grep -E "(passed|failed|error|skipped)" "$OUT_DIR/tests.log" | tail -n 1 | tr -d '=' | xargs)
record tests "$rc" "${counts:-no pytest summary line}"
tail -n 5 "$OUT_DIR/tests.log"

echo "== bench (limit ${BENCH_TIMEOUT} s) =="
CEILINGS=${EP_CEILINGS:-}
if [ -z "$CEILINGS" ] && nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | grep -q "H200"; then
    CEILINGS=$(ls bench/results/ceilings_NVIDIA-H200_*.json 2>/dev/null | tail -n 1)
fi
timeout -s INT --kill-after=15 "$BENCH_TIMEOUT" python3 -m safemoe.bench.ep --out "$OUT_DIR/bench" \
    ${EP_QUICK:+--quick} ${CEILINGS:+--ceilings "$CEILINGS"} > "$OUT_DIR/bench.log" 2>&1
rc=$?
rows=0
[ -f "$OUT_DIR/bench/ep.partial.jsonl" ] && rows=$(wc -l < "$OUT_DIR/bench/ep.partial.jsonl")
record bench "$rc" "$rows rows${CEILINGS:+, ceilings from $CEILINGS}"
tail -n 40 "$OUT_DIR/bench.log"

{
    echo "safemoe EP GPU run: $(head -n 1 "$OUT_DIR/env.txt")"
    grep -m 1 -E "^[0-9]+, " "$OUT_DIR/env.txt" || true
    for stage in tests bench; do echo "$stage: ${RESULT[$stage]}"; done
    grep -E "^(FAILED|ERROR)" "$OUT_DIR/tests.log" | head -n 20 || true
} > "$OUT_DIR/summary.txt"
echo "== summary =="
cat "$OUT_DIR/summary.txt"
exit "$FAILED"
