#!/usr/bin/env bash
# Everything safemoe checks on a CUDA machine, in one go: GPU tests, a compute-sanitizer memcheck
# pass over small cases, the benchmarks. Runs from a checkout with PYTHONPATH=src (nothing is
# installed). Usage:
#
#   bash scripts/gpu_run.sh OUT_DIR
#
# Environment:
#   GPU_RUN_STAGES  stages to run, comma-separated (default tests,sanitize,sanitize_check,soak,bench,serving)
#   SANITIZE_CHECK_SCALE / _ONLY / _SHARD / _MAX_TIME / _TIMEOUT  the check matrix under memcheck (stage sanitize_check)
#   SOAK_REPLAYS / SOAK_TIMEOUT  replays of the soak stage (default 100000) and its limit (300 s)
#   BENCH_SUITES    suites for the bench stage (default: all)
#   QUICK=1         smaller bench and per-stage time limits that fit a 7-minute call
#   TESTS_TIMEOUT / SANITIZE_TIMEOUT / BENCH_TIMEOUT   limits in seconds (SANITIZE_TIMEOUT per pass)
#   PYTEST_TARGETS  what pytest collects (default: tests)
#   PYTEST_ARGS     extra pytest arguments (e.g. "-k router"; "-n 8 --test-shard 1/2": half the suite,
#                   tests/conftest.py, for a suite longer than one device call; with -n 8 on one
#                   80 GB GPU the big-shape tests of test_experts.py can run out of memory together,
#                   H100 2026-11-26: they pass alone)
#   BENCH_SUITE_TIMEOUT  seconds allowed per bench suite (default: no limit of its own)
#   HEURISTIC_BUDGET / HEURISTIC_ARGS  stage heuristic (not in the default list): seconds of timing
#                   for scripts/heuristic_eval.py (default 420; QUICK 150) and extra arguments
#                   (e.g. "--padded --shapes olmoe,phimoe"); writes OUT_DIR/heuristic/
#   SERVING_TIMEOUT / SERVING_ARGS  limit of the serving stage (420 s) and extra arguments of
#                   `python -m safemoe.bench.serving` (e.g. "--layers 8 --concurrency 1,64,256")
#
# A failing stage is recorded and the later stages still run. Writes OUT_DIR/{tests,sanitize,
# bench,serving}.log, OUT_DIR/bench/, OUT_DIR/serving/, OUT_DIR/summary.txt and
# OUT_DIR/results.tar.gz (all of it in one file), prints the summary last, and exits non-zero if
# any stage failed. Only the serving stage: GPU_RUN_STAGES=serving bash scripts/gpu_run.sh OUT_DIR
set -u

OUT_DIR=${1:?usage: scripts/gpu_run.sh OUT_DIR}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
cd "$(dirname "$0")/.."

export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
STAGES=${GPU_RUN_STAGES:-tests,sanitize,sanitize_check,soak,bench,serving}
SERVING_TIMEOUT=${SERVING_TIMEOUT:-420}
SOAK_TIMEOUT=${SOAK_TIMEOUT:-300}
SOAK_REPLAYS=${SOAK_REPLAYS:-100000}
QUICK=${QUICK:-0}
if [ "$QUICK" = "1" ]; then
    # Worst case 180 + 2 x 50 + 110 = 390 s. Measured on an H200: both sanitizer passes ~20 s
    # together; the whole test suite needs more than 150 s (it is cut at the limit, counts kept).
    TESTS_TIMEOUT=${TESTS_TIMEOUT:-180}
    SANITIZE_TIMEOUT=${SANITIZE_TIMEOUT:-50}
    BENCH_TIMEOUT=${BENCH_TIMEOUT:-110}
else
    TESTS_TIMEOUT=${TESTS_TIMEOUT:-3600}
    SANITIZE_TIMEOUT=${SANITIZE_TIMEOUT:-1800}
    BENCH_TIMEOUT=${BENCH_TIMEOUT:-3600}
fi

declare -A RESULT=()
FAILED=0
has_stage() { [[ ",$STAGES," == *",$1,"* ]]; }
record() {  # stage rc detail
    if [ "$2" -eq 0 ]; then RESULT[$1]="ok${3:+ ($3)}"
    elif [ "$2" -eq 124 ]; then RESULT[$1]="FAILED: timed out after its limit${3:+ ($3)}"; FAILED=1
    else RESULT[$1]="FAILED: exit $2${3:+ ($3)}"; FAILED=1
    fi
}

{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || true
    python3 -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1
    python3 -c 'import triton; print("triton", triton.__version__)' 2>&1
    python3 - <<'EOF' 2>&1
import importlib.util
names = ["rich", "matplotlib", "numpy", "transformers", "vllm", "sglang", "flashinfer", "xdist", "hypothesis"]
print("importable:", " ".join(f"{n}={'yes' if importlib.util.find_spec(n) else 'no'}" for n in names))
EOF
    git rev-parse HEAD 2>/dev/null || echo "no git"
} > "$OUT_DIR/env.txt"
DEVICE=$(python3 -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")' 2>/dev/null)

if has_stage tests; then
    echo "== tests (limit ${TESTS_TIMEOUT} s) =="
    # The whole suite, compiled on the GPU; CPU-only tests run too. At the limit pytest gets SIGINT,
    # so it still prints its failures and counts so far.
    timeout -s INT --kill-after=20 "$TESTS_TIMEOUT" python3 -m pytest ${PYTEST_TARGETS:-tests} -m "gpu or not slow" -q -p no:cacheprovider \
        ${PYTEST_ARGS:-} > "$OUT_DIR/tests.log" 2>&1
    rc=$?
    counts=$(grep -E "(passed|failed|error|skipped)" "$OUT_DIR/tests.log" | tail -n 1 | tr -d '=' | xargs)
    record tests "$rc" "${counts:-no pytest summary line}"
    tail -n 3 "$OUT_DIR/tests.log"
fi

if has_stage sanitize; then
    echo "== sanitize (limit ${SANITIZE_TIMEOUT} s) =="
    SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
    if [ -z "$SANITIZER" ]; then
        echo "compute-sanitizer not found on PATH or in /usr/local/cuda*/bin" > "$OUT_DIR/sanitize.log"
        RESULT[sanitize]="FAILED: compute-sanitizer not found (memcheck not run)"; FAILED=1
    else
        # Pass 1, caching allocator off (its big blocks would hide out-of-bounds accesses); pass 2,
        # the CUDA-graph replay case, which needs the caching allocator to capture at all.
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout --kill-after=15 "$SANITIZE_TIMEOUT" "$SANITIZER" --tool memcheck \
            --error-exitcode 1 python3 scripts/sanitize.py --stages route,experts,moe > "$OUT_DIR/sanitize.log" 2>&1
        rc1=$?
        timeout --kill-after=15 "$SANITIZE_TIMEOUT" "$SANITIZER" --tool memcheck --error-exitcode 1 \
            python3 scripts/sanitize.py --stages graph >> "$OUT_DIR/sanitize.log" 2>&1
        rc2=$?
        rc=$(( rc1 != 0 ? rc1 : rc2 ))
        passes=$(grep -cE "ERROR SUMMARY: [0-9]+ error" "$OUT_DIR/sanitize.log")
        errors=$(grep -oE "ERROR SUMMARY: [0-9]+" "$OUT_DIR/sanitize.log" | awk '{n += $3} END {print n + 0}')
        cases=$(grep -E "^sanitize: " "$OUT_DIR/sanitize.log" | sed 's/^sanitize: //' | paste -sd ";" -)
        record sanitize "$rc" "memcheck errors: $errors in $passes of 2 passes; ${cases:-no case summary}"
    fi
    tail -n 3 "$OUT_DIR/sanitize.log"
fi

if has_stage sanitize_check; then
    # The whole `safemoe check` matrix under compute-sanitizer memcheck. SANITIZE_CHECK_SCALE=cpu
    # (default) is what `check --sanitizer` runs: 472 cases, 87 s on an H100; =cuda is the CUDA-sized
    # matrix (~8,000 cases of the seven data-path families at ~8 a second on an H100, so about 20
    # minutes with fp8/invariance): split it over calls with SANITIZE_CHECK_SHARD=K/N (calls 1/N..N/N
    # cover it once), SANITIZE_CHECK_ONLY (families) and SANITIZE_CHECK_MAX_TIME; the JSON of each
    # call lists what ran and what was left.
    scale=${SANITIZE_CHECK_SCALE:-cpu}
    limit=${SANITIZE_CHECK_TIMEOUT:-$([ "$QUICK" = "1" ] && echo 150 || echo 1800)}
    echo "== sanitize_check (scale $scale, limit $limit s) =="
    timeout -s INT --kill-after=30 "$limit" python3 -m safemoe check --sanitizer --scale "$scale" \
        --peers none ${SANITIZE_CHECK_ONLY:+--only "$SANITIZE_CHECK_ONLY"} \
        ${SANITIZE_CHECK_SHARD:+--shard "$SANITIZE_CHECK_SHARD"} \
        ${SANITIZE_CHECK_MAX_TIME:+--max-time "$SANITIZE_CHECK_MAX_TIME"} \
        --json "$OUT_DIR/sanitize_check_$scale.json" > "$OUT_DIR/sanitize_check.log" 2>&1
    rc=$?
    verdict=$(grep -E "^safemoe \(" "$OUT_DIR/sanitize_check.log" | tail -n 1)
    memcheck=$(grep -E "^memcheck " "$OUT_DIR/sanitize_check.log" | paste -sd ";" -)
    record sanitize_check "$rc" "${verdict:-no verdict line}; ${memcheck:-no memcheck lines}"
    tail -n 3 "$OUT_DIR/sanitize_check.log"
fi

if has_stage soak; then
    echo "== soak (limit ${SOAK_TIMEOUT} s) =="
    # The captured Qwen3-routing step replayed SOAK_REPLAYS times with fresh NaN rows, bad ids and
    # padding garbage each replay; violations counted on the device (safemoe/soak.py).
    timeout --kill-after=15 "$SOAK_TIMEOUT" python3 -m safemoe soak --replays "$SOAK_REPLAYS" \
        --json "$OUT_DIR/soak.json" > "$OUT_DIR/soak.log" 2>&1
    rc=$?
    record soak "$rc" "$(head -n 1 "$OUT_DIR/soak.log")"
    cat "$OUT_DIR/soak.log"
fi

if has_stage bench; then
    echo "== bench (limit ${BENCH_TIMEOUT} s) =="
    args=(--out "$OUT_DIR/bench")
    [ "$QUICK" = "1" ] && args+=(--quick)
    [ -n "${BENCH_SUITES:-}" ] && args+=(--suite "$BENCH_SUITES")
    [ -n "${BENCH_SUITE_TIMEOUT:-}" ] && args+=(--timeout "$BENCH_SUITE_TIMEOUT")
    # `python -m safemoe bench` is the `safemoe bench` command; the bench module itself is the fallback.
    if [ -f src/safemoe/__main__.py ]; then entry=(safemoe bench); else entry=(safemoe.bench.cli); fi
    timeout --kill-after=15 "$BENCH_TIMEOUT" python3 -m "${entry[@]}" "${args[@]}" > "$OUT_DIR/bench.log" 2>&1
    rc=$?
    suites=$(python3 - "$OUT_DIR/bench/summary.json" <<'EOF' 2>/dev/null
import json, sys
data = json.load(open(sys.argv[1]))["suites"]
print(", ".join(f"{name}: {entry['status'].split(':')[0]}" for name, entry in data.items()))
EOF
)
    record bench "$rc" "${suites:-no bench summary}"
    tail -n 8 "$OUT_DIR/bench.log"
fi

if has_stage heuristic; then
    budget=${HEURISTIC_BUDGET:-$([ "$QUICK" = "1" ] && echo 150 || echo 420)}
    echo "== heuristic (timing budget ${budget} s) =="
    # the untuned tiles (heuristic_config) against the device table, nine shapes, four untabled
    timeout --kill-after=15 $(( budget + 240 )) python3 scripts/heuristic_eval.py --out "$OUT_DIR/heuristic" \
        --budget "$budget" ${HEURISTIC_ARGS:-} > "$OUT_DIR/heuristic.log" 2>&1
    rc=$?
    record heuristic "$rc" "$(grep -cE '^[a-z0-9]+ T=' "$OUT_DIR/heuristic.log") points timed"
    grep -A 7 "^Full batch" "$OUT_DIR/heuristic.log"
fi

if has_stage serving; then
    echo "== serving (limit ${SERVING_TIMEOUT} s) =="
    # transformers' continuous batching with CUDA graphs, stock grouped_mm vs safemoe, NaN in the
    # padded rows of every attention output (safemoe/bench/serving.py says what each column means).
    args=(--out "$OUT_DIR/serving")
    [ "$QUICK" = "1" ] && args+=(--quick)
    timeout --kill-after=15 "$SERVING_TIMEOUT" python3 -m safemoe.bench.serving "${args[@]}" ${SERVING_ARGS:-} \
        > "$OUT_DIR/serving.log" 2>&1
    rc=$?
    detail=$(python3 - "$OUT_DIR/serving/serving.json" <<'EOF' 2>/dev/null
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
x = [r["speedup"] for r in rows if r["speedup"]]
m = [r["safemoe"] for r in rows]
same = all(s["tokens_identical_under_nan"] and s["logits_bitwise_identical_under_nan"] for s in m)
parts = [f"safemoe/stock tok/s {min(x):.2f}..{max(x):.2f}x" if x else "no tok/s ratio",
         f"padded rows skipped: {all(r['padded_rows_skipped'] for r in rows)}",
         f"safemoe non-finite logit rows {sum(sum(s['nonfinite_logit_rows'].values()) for s in m)}",
         f"safemoe bitwise same under NaN: {same}",
         f"errors {sum(len(r['stock']['errors']) + len(r['safemoe']['errors']) for r in rows)}"]
print("; ".join(parts))
EOF
)
    record serving "$rc" "${detail:-no serving.json}"
    tail -n 30 "$OUT_DIR/serving.log"
fi

{
    echo "safemoe gpu_run summary ($(date -u +%Y-%m-%dT%H:%M:%SZ), $DEVICE)"
    for stage in tests sanitize sanitize_check soak bench heuristic serving; do
        if has_stage "$stage"; then echo "  $stage: ${RESULT[$stage]:-not recorded}"; else echo "  $stage: not run"; fi
    done
    if has_stage tests && [ -f "$OUT_DIR/tests.log" ]; then
        grep -E "^(FAILED|ERROR) " "$OUT_DIR/tests.log" | cut -d' ' -f2 | head -n 20 | sed 's/^/    failing: /'
    fi
    has_stage sanitize && grep -E "^FAIL " "$OUT_DIR/sanitize.log" 2>/dev/null | head -n 10 | sed 's/^FAIL /    sanitize case failed: /'
    echo "  results: $OUT_DIR (everything also in results.tar.gz)"
} > "$OUT_DIR/summary.txt"
ARCHIVE=$(mktemp /tmp/safemoe_gpu_run.XXXXXX)
tar -czf "$ARCHIVE" -C "$OUT_DIR" --exclude=./results.tar.gz . && chmod 644 "$ARCHIVE" && mv -f "$ARCHIVE" "$OUT_DIR/results.tar.gz"

echo
cat "$OUT_DIR/summary.txt"
exit "$FAILED"
