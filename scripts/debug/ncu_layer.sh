#!/usr/bin/env bash
# Debug (issue 13): Nsight Compute on one layer step per case (scripts/debug/ncu_step.py): speed of
# light, occupancy, launch stats, warp states and memory workload of the router, dispatch, GEMM
# and combine kernels, run eagerly (ncu serialises kernels, so PDL overlap is not in these
# durations). Full CSVs under $OUT/ncu_SHAPE_T[_QUANT].csv; a digest of the key metrics on stdout.
#   OUT=/tmp/ncu bash scripts/debug/ncu_layer.sh "qwen3 8" "qwen3 256" "qwen3 256 per_tensor"
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=src:scripts/debug
for c in "$@"; do
  set -- $c
  echo "=== $1 T=$2 ${3:-bf16}"
  name=ncu_$1_$2${3:+_$3}
  timeout 200 ncu --nvtx --nvtx-include "profiled/" -k regex:"_gemm|_combine|_count|_router|_quantize" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis --csv --page details \
    python3 scripts/debug/ncu_step.py $1 $2 ${3:-} > $OUT/$name.csv 2> $OUT/$name.err
  echo rc=$?; tail -3 $OUT/$name.err
  python3 - $OUT/$name.csv <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hdr = None
for i, r in enumerate(rows):
    if r and r[0] == "ID":
        hdr = r; start = i; break
if hdr is None:
    print(open(sys.argv[1]).read()[:2000]); sys.exit()
ki, si, mi, ui, vi = (hdr.index(x) for x in ("Kernel Name", "Section Name", "Metric Name", "Metric Unit", "Metric Value"))
want = ("Duration", "DRAM Throughput", "Memory Throughput", "Achieved Occupancy", "Theoretical Occupancy",
        "Registers Per Thread", "Dynamic Shared Memory Per Block", "Grid Size", "Block Limit Shared Mem",
        "Block Limit Registers", "Warp Cycles Per Issued Instruction", "Compute (SM) Throughput", "L2 Hit Rate",
        "Waves Per SM", "Max Bandwidth", "Mem Busy", "Avg. Active Threads Per Warp")
for r in rows[start + 1:]:
    if len(r) <= vi:
        continue
    try:
        val = float(r[vi].replace(",", ""))
    except ValueError:
        val = 0.0
    if r[mi] in want or ("Stall" in r[mi] and val > 1.0):
        print(f"{r[ki][:14]:14s} {r[mi]:40s} {r[vi]:>12s} {r[ui]}")
PY
done
