#!/usr/bin/env bash
# No speed regression: time the `experts` and `router` bench suites with an old commit's tree and
# with this checkout in ONE GPU call, interleaved, and compare every point.
#
#   bash scripts/bench_compare.sh OLD_SRC_DIR OUT_DIR        (on the GPU machine, from the repo root)
#
# OLD_SRC_DIR holds the old commit's src/ tree (OLD_SRC_DIR/src/safemoe), e.g.
#   mkdir -p old && git archive OLD_COMMIT src | tar -x -C old && echo OLD_COMMIT > old/COMMIT
#
# What it measures: `python -m safemoe.bench.cli --suite S --quick` (the suites' own smaller shape
# and token sets) once with PYTHONPATH=OLD_SRC_DIR/src and once with PYTHONPATH=src, per round;
# rounds interleave old, new, old, new... within a suite, so clock and thermal drift hit both
# sides alike. Each row's median_us is the bench's own median (CUDA-graph replay, or eager where
# the step cannot be captured; docs/bench.md). The ceilings are measured once, by the first run,
# and reused by the others (--ceilings, where the tree's bench has it): floors are the same on
# both sides. Only suites that exist under these names in both trees run (experts, router; not
# `layer`, which was `reference` before). The Triton cache is shared: a kernel both trees compile
# alike is compiled once, outside any timing. Each side times with its own bench code: a change
# to what a suite's step does shows up as a difference too.
#
# Then `scripts/bench_compare.py` joins the rows by (suite, case, T, variant, impl), takes each
# side's median over its rounds, and writes OUT_DIR/compare.md: old and new median us, new/old,
# verdict `ok` within +-2% (else slower / faster), judged on safemoe's rows only (peers such as
# torch grouped_mm are shown, marked as peers), and a summary line (points, within 2%, worst).
#
# Time: a round of both sides costs about the suite's quick run twice (the first one also compiles
# the kernels). A suite always gets one round; a further round starts only if the previous one
# fits in the suite's share of BUDGET_S; no run goes past LIMIT_S. Defaults fit an 8-minute call.
#
# Environment:
#   SUITES       suites, comma-separated (default experts,router; both trees must have them)
#   ROUNDS       most rounds per suite (default 3)
#   BUDGET_S     seconds the rounds may take together (default 360)
#   LIMIT_S      hard limit in seconds from the start; a run still going then is stopped (default 470)
#   QUICK        1 (default): --quick; 0: every shape (far longer than one call)
#   TOLERANCE    band of `ok` (default 0.02)
#   OLD_LABEL / NEW_LABEL   names in the table (default: OLD_SRC_DIR/COMMIT or the path; git HEAD)
#
# Writes OUT_DIR/compare.md, OUT_DIR/runs.tar.gz (runs/<old|new>_<suite>_r<N>/: each run's bench output),
# OUT_DIR/bench_compare.log; prints the summary last. Exit status: bench_compare.py's (1 when a
# safemoe point is slower than the tolerance), 2 when no pair of runs produced results.
set -u

OLD_ARG=${1:?usage: scripts/bench_compare.sh OLD_SRC_DIR OUT_DIR}
OUT_ARG=${2:?usage: scripts/bench_compare.sh OLD_SRC_DIR OUT_DIR}
OLD_DIR=$(cd "$OLD_ARG" && pwd) || exit 2
mkdir -p "$OUT_ARG"
OUT_DIR=$(cd "$OUT_ARG" && pwd)
cd "$(dirname "$0")/.."
NEW_TREE="$PWD/src"
if [ -d "$OLD_DIR/src/safemoe" ]; then OLD_TREE="$OLD_DIR/src"
elif [ -d "$OLD_DIR/safemoe" ]; then OLD_TREE="$OLD_DIR"  # given the src/ directory itself
else echo "no safemoe package under $OLD_DIR/src (extract the old commit's src/ there)" >&2; exit 2
fi

SUITES=${SUITES:-experts,router}
ROUNDS=${ROUNDS:-3}
BUDGET_S=${BUDGET_S:-360}
LIMIT_S=${LIMIT_S:-470}
QUICK=${QUICK:-1}
TOLERANCE=${TOLERANCE:-0.02}
if [ -z "${OLD_LABEL:-}" ]; then
    if [ -f "$OLD_DIR/COMMIT" ]; then OLD_LABEL=$(head -c 64 "$OLD_DIR/COMMIT" | tr -d '\n'); else OLD_LABEL=$OLD_DIR; fi
fi
if [ -z "${NEW_LABEL:-}" ]; then
    NEW_LABEL=$(git rev-parse --short HEAD 2>/dev/null || echo "this checkout")
    [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && NEW_LABEL="$NEW_LABEL (with uncommitted changes)"
fi

RUNS="$OUT_DIR/runs"
LOG="$OUT_DIR/bench_compare.log"
CEILINGS="$OUT_DIR/ceilings.json"
rm -rf "$RUNS" "$CEILINGS"
mkdir -p "$RUNS"
: > "$LOG"
log() { echo "$*" | tee -a "$LOG"; }

# Which tree is which: the import path each side really gets (an installed safemoe must not win).
for side in old new; do
    if [ "$side" = old ]; then tree=$OLD_TREE; else tree=$NEW_TREE; fi
    where=$(PYTHONPATH="$tree" python3 -c 'import safemoe.bench.cli as m; print(m.__file__)' 2>>"$LOG")
    case "$where" in
        "$tree"/*) log "$side: $where" ;;
        *) log "$side: safemoe.bench.cli comes from '${where:-nowhere}', not $tree"; exit 2 ;;
    esac
done

declare -a PAIRS=()
declare -a MISSING=()
declare -A DONE_ROUNDS=()

run_one() {  # side tree suite round -> 0 when <suite>.json was written
    local side=$1 tree=$2 suite=$3 round=$4
    local out="$RUNS/${side}_${suite}_r${round}"
    local left=$((LIMIT_S - SECONDS))
    if [ "$left" -le 10 ]; then log "  $side r$round: skipped, the ${LIMIT_S} s limit is reached"; return 1; fi
    local args=(--suite "$suite" --out "$out")
    [ "$QUICK" = "1" ] && args+=(--quick)
    if [ -f "$CEILINGS" ] && grep -q -- '"--ceilings"' "$tree/safemoe/bench/cli.py"; then
        args+=(--ceilings "$CEILINGS")
    fi
    local start=$SECONDS
    echo "==== $side $suite round $round: PYTHONPATH=$tree python3 -m safemoe.bench.cli ${args[*]}" >> "$LOG"
    PYTHONPATH="$tree" timeout --kill-after=15 "$left" python3 -m safemoe.bench.cli "${args[@]}" >> "$LOG" 2>&1
    local rc=$?
    [ -f "$CEILINGS" ] || { [ -f "$out/ceilings.json" ] && cp "$out/ceilings.json" "$CEILINGS"; }
    if [ -f "$out/$suite.json" ]; then
        log "  $side r$round: $((SECONDS - start)) s, exit $rc"
        return 0
    fi
    log "  $side r$round: NO RESULTS after $((SECONDS - start)) s (exit $rc$([ "$rc" -eq 124 ] && echo ', stopped at the limit'); see $LOG)"
    return 1
}

IFS=, read -r -a suite_list <<< "$SUITES"
for index in "${!suite_list[@]}"; do
    suite=${suite_list[$index]}
    if [ ! -f "$OLD_TREE/safemoe/bench/$suite.py" ] || [ ! -f "$NEW_TREE/safemoe/bench/$suite.py" ]; then
        log "suite $suite: not in both trees, skipped"; MISSING+=("$suite (not in both trees)"); continue
    fi
    if [ $((LIMIT_S - SECONDS)) -le 10 ]; then
        log "suite $suite: skipped, the ${LIMIT_S} s limit is reached"; MISSING+=("$suite (no time left)"); continue
    fi
    suites_left=$(( ${#suite_list[@]} - index ))
    share=$(( (BUDGET_S - SECONDS) / suites_left ))
    suite_start=$SECONDS
    log "suite $suite: up to $ROUNDS rounds, share ${share} s"
    round=1
    while :; do
        round_start=$SECONDS
        run_one old "$OLD_TREE" "$suite" "$round"; old_ok=$?
        run_one new "$NEW_TREE" "$suite" "$round"; new_ok=$?
        if [ "$old_ok" -eq 0 ] && [ "$new_ok" -eq 0 ]; then
            PAIRS+=("$RUNS/old_${suite}_r${round}/$suite.json" "$RUNS/new_${suite}_r${round}/$suite.json")
            DONE_ROUNDS[$suite]=$round
        else
            MISSING+=("$suite round $round")
        fi
        took=$((SECONDS - round_start))
        [ "$round" -ge "$ROUNDS" ] && break
        [ "$old_ok" -ne 0 ] || [ "$new_ok" -ne 0 ] && break  # failing or out of time: no more rounds
        [ $((SECONDS - suite_start + took)) -gt "$share" ] && break
        [ $((SECONDS + took)) -gt "$LIMIT_S" ] && break
        round=$((round + 1))
    done
done

if [ "${#PAIRS[@]}" -eq 0 ]; then
    log "no pair of runs produced results; nothing to compare (see $LOG)"
    exit 2
fi
python3 scripts/bench_compare.py --tolerance "$TOLERANCE" --old-label "$OLD_LABEL" --new-label "$NEW_LABEL" \
    "${PAIRS[@]}" > "$OUT_DIR/compare.md" 2>> "$LOG"
status=$?
{
    echo "- runs: $(for s in "${suite_list[@]}"; do [ -n "${DONE_ROUNDS[$s]:-}" ] && printf '%s %s round(s); ' "$s" "${DONE_ROUNDS[$s]}"; done)$([ "$QUICK" = "1" ] && echo "--quick" || echo "full shapes"), ${SECONDS} s in all"
    if [ "${#MISSING[@]}" -gt 0 ]; then echo "- without results (not compared): ${MISSING[*]}"; fi
} >> "$OUT_DIR/compare.md"

# The device tool brings back files at most 16 levels deep and only so many of them: the runs'
# directories travel as one archive (each side's CSV/JSON/PNG and targets tables).
tar -czf "$OUT_DIR/runs.tar.gz" -C "$OUT_DIR" runs 2>> "$LOG" && rm -rf "$RUNS"

echo
grep -m 1 '^\*\*Summary' "$OUT_DIR/compare.md"
tail -n 2 "$OUT_DIR/compare.md"
echo "table: $OUT_DIR/compare.md; runs: $OUT_DIR/runs.tar.gz; log: $LOG"
exit "$status"
