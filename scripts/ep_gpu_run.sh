#!/usr/bin/env bash
# Expert parallelism on the GPUs of one host, with NVLink multicast off. Runs from a checkout with
# PYTHONPATH=src. Stages: the exchange kernels' tests (tests/test_ep_exchange.py, one GPU is
# enough), the NCCL tests (tests/test_distributed.py -m gpu, 2 GPUs; skipped with fewer), then the
# `ep` bench: on >= 2 GPUs the layer against one GPU for W = 2, 4, 8 up to the GPUs present; on
# one GPU (or with EP_EXCHANGE_ONLY=1) the exchange alone, torch ops vs Triton, loopback.
#
#   bash scripts/ep_gpu_run.sh OUT_DIR
#
# Environment:
#   EP_TESTS_TIMEOUT   seconds for each test stage (default 240)
#   EP_SKIP_TESTS=1    bench only
#   EP_SKIP_BENCH=1    tests only
#   EP_BENCH_TIMEOUT   seconds for the bench (default 480); a bench cut short keeps the rows it
#                      finished in OUT_DIR/bench/ep.partial.jsonl
#   EP_WORLDS          e.g. "4" or "2,4,8" (default: powers of two up to the GPUs present)
#   EP_SHAPES          e.g. "deepseek-v3" (default: qwen3-30b-a3b,deepseek-v3,qwen3-next)
#   EP_TOKENS          T per rank, e.g. "256,1024,4096" (default 8,64,256,1024,4096,8192)
#   EP_QUICK=1         T per rank in {8, 256, 4096}
#   EP_EXCHANGE_ONLY=1 the one-GPU exchange bench even on a multi-GPU host
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
TESTS_TIMEOUT=${EP_TESTS_TIMEOUT:-240}
BENCH_TIMEOUT=${EP_BENCH_TIMEOUT:-480}
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)

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

run_tests() {  # stage log pytest-args...
    local stage=$1 log=$2; shift 2
    echo "== $stage (limit ${TESTS_TIMEOUT} s) =="
    timeout -s INT --kill-after=15 "$TESTS_TIMEOUT" python3 -m pytest "$@" -q -p no:cacheprovider -rfE \
        > "$OUT_DIR/$log" 2>&1
    local rc=$?
    local counts
    counts=$(grep -E "(passed|failed|error|skipped)" "$OUT_DIR/$log" | tail -n 1 | tr -d '=' | xargs)
    record "$stage" "$rc" "${counts:-no pytest summary line}"
    tail -n 5 "$OUT_DIR/$log"
}
STAGES="bench"
if [ -z "${EP_SKIP_TESTS:-}" ]; then
    STAGES="kernel-tests nccl-tests bench"
    run_tests kernel-tests kernel_tests.log tests/test_ep_exchange.py
    if [ "$GPUS" -ge 2 ]; then
        run_tests nccl-tests tests.log tests/test_distributed.py -m gpu
    else
        RESULT[nccl-tests]="skipped: $GPUS GPU(s), the NCCL tests need 2"
    fi
fi

if [ -z "${EP_SKIP_BENCH:-}" ]; then
    echo "== bench (limit ${BENCH_TIMEOUT} s) =="
    CEILINGS=${EP_CEILINGS:-}
    if [ -z "$CEILINGS" ] && nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | grep -q "H200"; then
        CEILINGS=$(ls bench/results/ceilings_NVIDIA-H200_*.json 2>/dev/null | tail -n 1)
    fi
    BENCH_ARGS=(--out "$OUT_DIR/bench")
    [ -n "${EP_QUICK:-}" ] && BENCH_ARGS+=(--quick)
    [ -n "$CEILINGS" ] && BENCH_ARGS+=(--ceilings "$CEILINGS")
    [ -n "${EP_WORLDS:-}" ] && BENCH_ARGS+=(--worlds "$EP_WORLDS")
    [ -n "${EP_SHAPES:-}" ] && BENCH_ARGS+=(--shapes "$EP_SHAPES")
    [ -n "${EP_TOKENS:-}" ] && BENCH_ARGS+=(--tokens "$EP_TOKENS")
    if [ -n "${EP_EXCHANGE_ONLY:-}" ] || [ "$GPUS" -lt 2 ]; then
        BENCH_ARGS+=(--exchange-only)
    fi
    echo "python3 -m safemoe.bench.ep ${BENCH_ARGS[*]}"
    timeout -s INT --kill-after=15 "$BENCH_TIMEOUT" python3 -m safemoe.bench.ep "${BENCH_ARGS[@]}" \
        > "$OUT_DIR/bench.log" 2>&1
    rc=$?
    rows=0
    [ -f "$OUT_DIR/bench/ep.partial.jsonl" ] && rows=$(wc -l < "$OUT_DIR/bench/ep.partial.jsonl")
    record bench "$rc" "$rows rows${CEILINGS:+, ceilings from $CEILINGS}"
    tail -n 40 "$OUT_DIR/bench.log"

else
    STAGES=${STAGES% bench}
    [ "$STAGES" = "bench" ] && STAGES=""
fi

{
    echo "safemoe EP GPU run: $(head -n 1 "$OUT_DIR/env.txt")"
    grep -m 1 -E "^[0-9]+, " "$OUT_DIR/env.txt" || true
    for stage in $STAGES; do echo "$stage: ${RESULT[$stage]:-not run}"; done
    cat "$OUT_DIR"/kernel_tests.log "$OUT_DIR"/tests.log 2>/dev/null | grep -E "^(FAILED|ERROR)" | head -n 20 || true
    [ -f "$OUT_DIR/bench/ep_scaling.md" ] && cat "$OUT_DIR/bench/ep_scaling.md"
} > "$OUT_DIR/summary.txt"
echo "== summary =="
cat "$OUT_DIR/summary.txt"
exit "$FAILED"
