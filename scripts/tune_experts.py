"""Tune the expert kernels' tiles on this GPU; write the winners as `src/safemoe/configs/<device>.json`.

Run from the repository root on a CUDA machine:

    PYTHONPATH=src python3 scripts/tune_experts.py --out OUT_DIR [--shapes qwen3,mixtral]
        [--tokens 1,8,64] [--jobs 12] [--budget-s 240] [--write] [--breakdown] [--no-one-launch] [--wide]
        [--quant per_tensor|block]
    PYTHONPATH=src python3 scripts/tune_experts.py --out OUT_DIR --one-launch-only [--write]
    PYTHONPATH=src python3 scripts/tune_experts.py --out OUT_DIR --fused-only [--write]
    PYTHONPATH=src python3 scripts/tune_experts.py --out OUT_DIR --engine-only [--write]

How it searches (per model shape and token bucket T):
1. Candidates: for each BLOCK_M that suits T's rows per expert, GEMM1 tiles with a base GEMM2, and
   GEMM2 tiles with a base GEMM1 (coordinate descent: the GEMMs are separate kernels, so GEMM1's
   time barely depends on GEMM2's tiles).
2. Every kernel variant is compiled first by `--jobs` worker processes in parallel (each runs the
   whole op once with num_valid = 0, so nothing is read from the stand-in weights); the timing
   process then finds them in Triton's on-disk cache.
3. Timing: `safemoe.bench.harness.time_graph`, the whole `experts_triton` call (dispatch, GEMM1,
   GEMM2, combine) under CUDA-graph replay, rotating 4 routing sets (uniform random routing) so
   weights come from HBM, num_valid as a device tensor (as in a captured model), the ids passed as
   complete (`ids_complete`: every row written, as `moe()`'s router leaves them).
   GEMM1 candidates are timed with the base GEMM2, then GEMM2 candidates with the best GEMM1, per
   BLOCK_M, then TMA weight loads for each GEMM (`pdl` is on up to PDL_MAX_TOKENS).
   From T = 1024 the persistent grid's programs per SM (1, 2, 4, 8) too. The incumbent (what
   `get_config` gives the bucket before this run: the device table's entry, the nearest bucket's,
   or the heuristic) and the heuristic's tiles are timed among the candidates, so a re-tune never
   keeps tiles slower than those in its own timings (H100 2026-11-26: the first fp8 tune, without
   them, put tiles 3-14% slower than the heuristic's at T = 8192 into the table; the heuristic's
   256-column GEMM2 is in no list).
   The leaders (within CONFIRM_WINDOW of the fastest single timing) are then timed CONFIRM_ROUNDS
   more times, interleaved, and ranked by median (`confirm_ranking`); the incumbent stays unless
   the winner is faster by more than REPLACE_MARGIN (`keep_incumbent`; --replace-margin). A
   winner that replaces an incumbent whose tiles other buckets' padded steps also run (the
   few-slot and small-batch tiles of the larger buckets, `dependents`) must leave the largest such
   step of each kind (one valid row, SMALL_BATCH_TOKENS rows) within ONE_LAUNCH_TOLERANCE, timed
   both ways in ONE_LAUNCH_ROUNDS interleaved rounds (`check_dependents`; the entry records them
   as `dependents_us`), else the incumbent stays. Where the bucket replays
   padded decode steps through its own launches (few-slot path compiled in, T*K > FEW_SLOTS), the
   distinct candidates within ONE_LAUNCH_TOLERANCE of the fastest full batch are also timed with
   one valid row (a candidate with a larger BLOCK_M than the small-batch tiles together with those
   tiles, as the call runs it), and the fastest of those wins (`prefer_fast_padded_step`). That
   ranking never includes the incumbent, so a winner that replaces it in a bucket with
   SMALL_BATCH_TOKENS < T <= PDL_MAX_TOKENS must also leave the bucket's own padded steps
   (SMALL_BATCH_TOKENS rows and one row) within ONE_LAUNCH_TOLERANCE, timed both ways in
   ONE_LAUNCH_ROUNDS interleaved rounds (`padded_steps_hold`; the entry records them as
   `padded_us`), or save on the full batch PADDED_TRADE times what those steps lose, none by more
   than PADDED_TRADE_MAX (`padded_trade_allows`). Else the winner with one GEMM's tiles of the
   incumbent (`padded_hybrids`) is tried under the same rules, once faster than the incumbent's full
   batch by more than the replace margin and checked against the reference; else the incumbent stays.
4. one_launch (after a shape's tiles; skip with --no-one-launch): every bucket whose winner has
   small-batch tiles (T > SMALL_BATCH_TOKENS and a larger BLOCK_M than the small config, which is
   this run's winner for SMALL_BATCH_TOKENS tokens when there is one, else the device table's) is
   timed at T = its bucket with the small tiles in the GEMMs' own launch and in a second launch
   each, on a full batch (num_valid = T) and on two padded decode steps (num_valid = 8, the
   small-batch regime, and 1, the few-slot path, which still runs the empty small-tile launches
   when they are separate), ONE_LAUNCH_ROUNDS interleaved rounds each, medians compared:
   `choose_one_launch` (merged only when the two padded steps together get faster and the full
   batch is not slower by more than ONE_LAUNCH_TOLERANCE).
   --one-launch-only does this step alone for the entries already in the device table (tiles
   kept; --tokens picks buckets), so one_launch can be re-decided without re-tuning; an entry
   whose one_launch was set by hand carries `one_launch_pinned` (the reason) and is kept.
5. fused (after one_launch; skip with --no-fused): every bucket whose every call takes the few-slot
   path (T*K <= FEW_SLOTS) or, fused, would (`fused_bucket`: T*K <= 64 with the packed 16-row
   tiles, no dispatch launch; H200 2026-12-02: Qwen3-Next T = 2 -23%, Qwen3 T = 8 -5.4%, gpt-oss
   T = 8 -3.3%) is timed with GEMM1 and GEMM2 in two launches and in one (`ExpertsConfig.fused`),
   ONE_LAUNCH_ROUNDS interleaved rounds, medians compared: fused only when faster by more than
   FUSED_MARGIN (`choose_fused`), and only if the one-row steps of the larger buckets whose
   few-slot tiles the entry gives are no slower (`fused_dependents_hold`; H200 2026-12-02: gpt-oss
   T = 8 fused, serving T = 4, took T = 1024's one-row step from 63.5 to 77.1 us); --search-fused
   times those buckets' tile candidates fused too (a fused incumbent always does). It pays where
   GEMM1 runs several waves of tiles and GEMM2 has many tiles per expert (H100/H200 2026-11-26: gpt-oss and
   DeepSeek-V3 T = 1 -1.5 to -3.4% in the layer) and costs where it does not (Qwen3 T = 1 +11-26%,
   Mixtral T = 1 +2-9%), so it is a per-bucket choice. --fused-only does this step alone for the
   device table's entries (tiles kept).
5b. interleave (--interleave-only, for the device table's bf16 entries of INTERLEAVE_MIN_TOKENS
   tokens and more, or the buckets --tokens names): GEMM1's gate and up rows as one weight tile
   and one MMA a K step (`GemmTiles.interleave`; weights through pointers and through TMA), each
   at the entry's stages and one fewer, timed against the entry for ONE_LAUNCH_ROUNDS interleaved
   rounds; the fastest median is kept when faster than the entry's by more than
   INTERLEAVE_MARGIN (`choose_interleave`). H100 2026-11-26 (prefill, T = 8192, experts only,
   pointer loads): DeepSeek-V3 -4.3%, gpt-oss -2.0%, Qwen3 -0.9%, Mixtral -1.2% (3 stages).
5c. programs (--programs-only, for the device table's bf16 decode entries: `programs_buckets`): the
   persistent grid at PROGRAMS_CANDIDATES programs per SM against the entry's, ONE_LAUNCH_ROUNDS
   interleaved rounds; the fastest median is kept when faster than the entry's by more than
   PROGRAMS_MARGIN and the padded steps that run the bucket's tiles stay within
   ONE_LAUNCH_TOLERANCE (`check_dependents`). The full search varies the grid from T = 1024 only.
5d. GEMM2's engine (--engine-only, for the device table's bf16 entries of ENGINE_MIN_TOKENS tokens
   and more, or the buckets --tokens names; an sm_90 GPU): the warp-specialised Gluon GEMM2 of
   kernels/experts_ws.py (`GemmTiles.engine`, ENGINE_VARIANTS at 256 x 64 tiles) against the
   entry, ONE_LAUNCH_ROUNDS interleaved rounds; the fastest median is kept when faster than the
   entry's by more than ENGINE_MARGIN (`choose_engine`). Entries whose block_m is not 128 have no
   candidate. Below ENGINE_MIN_TOKENS a padded step pays the engine's launch (see the constant).
6. fp8 weights (--quant per_tensor or block): the same search on e4m3 weights quantised from the
   stand-in bf16 ones (`safemoe.fp8.quantize_experts`), x bf16, under the shape's fp8 key
   (`E.._fp8-{quant}`, what `get_config(..., quant=...)` reads). Block mode's candidates keep
   block_k <= 128 (a K step inside one 128-wide scale group, as `get_config` enforces). The
   few-slot path takes no fp8 weights and one_launch is not timed: candidates carry few off, and
   winners one_launch off. A winner is checked against `experts_fp8_reference` (FP8_CHECK_TOLERANCE).
   The padded-step rules of step 3 hold too (`padded_steps_hold`, then the other buckets' padded
   steps that run its tiles), on fp8 weights.
Results: OUT_DIR/tune_log.json (winners, with their times, `one_launch_us`, and every timing in
`log`) and, with --write, merged into src/safemoe/configs/<device>.json (per bucket; other buckets,
shapes and top-level keys such as "batch_invariant" and "notes" are kept).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from safemoe.configs import (  # noqa: E402
    PDL_MAX_TOKENS,
    ExpertsConfig,
    GemmTiles,
    device_file,
    load_device_configs,
    load_small_batch_configs,
    shape_key,
    token_bucket,
)
from safemoe.kernels.experts import FEW_SLOTS, SMALL_BATCH_TOKENS, fused_bucket  # noqa: E402
from safemoe.numerics import FP8_BLOCK  # noqa: E402

# (E, K, H, I)
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "qwen3": (128, 8, 2048, 768),
    "mixtral": (8, 2, 4096, 14336),
    "gptoss": (128, 4, 2880, 2880),
    "deepseek": (256, 8, 7168, 2048),
    # Issue 13 names Qwen3-Next among the shapes to tune; the -ep2 shapes are what each of two
    # expert-parallel ranks runs locally (half the experts: E/2, same K), untuned until now.
    "qwen3next": (512, 10, 2048, 512),
    "qwen3-ep2": (64, 8, 2048, 768),
    "deepseek-ep2": (128, 8, 7168, 2048),
    # Shapes no device table holds, which the heuristic serves (scripts/heuristic_eval.py times
    # its rules on them): OLMoE-1B-7B, Qwen1.5-MoE-A2.7B (60 experts), Phi-3.5-MoE, GLM-4.5-Air.
    "olmoe": (64, 8, 2048, 1024),
    "qwen2moe": (60, 4, 2048, 1408),
    "phimoe": (16, 2, 4096, 6400),
    "glm45air": (128, 8, 4096, 1408),
}
UNTABLED = ("olmoe", "qwen2moe", "phimoe", "glm45air")
# Shapes tuned when --shapes is not given (the extra ones above are asked for by name).
DEFAULT_SHAPES = "qwen3,mixtral,gptoss,deepseek"
DEFAULT_TOKENS = {
    "qwen3": (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384),
    "mixtral": (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384),
    # 512 and 2048 since 2026-11-28: served by the 256 and 1024 entries' tiles (16 and 64 rows an expert
    # in blocks of 16 and 64), the layer ran T = 512 17-24% and DeepSeek-V3 T = 2048 14% slower
    "gptoss": (1, 8, 64, 256, 512, 1024, 2048, 4096, 8192),
    "deepseek": (1, 8, 64, 256, 512, 1024, 2048, 4096, 8192),
    "qwen3next": (1, 8, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
    "qwen3-ep2": (8, 64, 256, 1024, 4096, 8192),
    "deepseek-ep2": (8, 64, 256, 1024, 4096, 8192),
    **dict.fromkeys(UNTABLED, (1, 8, 64, 256, 1024, 4096, 8192)),
}
QUICK_TOKENS = {
    "qwen3": (1, 8, 64, 256, 2048, 8192),
    "mixtral": (1, 8, 64, 256, 2048, 8192),
    "gptoss": (1, 64, 1024, 8192),
    "deepseek": (1, 64, 1024, 8192),
    "qwen3next": (1, 64, 1024, 8192),
    "qwen3-ep2": (8, 256, 4096),
    "deepseek-ep2": (8, 256, 4096),
    **dict.fromkeys(UNTABLED, (1, 64, 1024, 8192)),
}
N_VARIANTS = 4
# The padded decode steps of the one_launch decision: the small-batch regime's largest count, and
# one valid row. One row takes the few-slot path, whose tiles one_launch does not change, but with
# the small tiles in launches of their own those two launches still run, empty: H200 2026-11-26
# (scripts/debug/padded_step.py), Qwen3 T = 1024 with one valid row 33.9 us with them, 30.4 merged.
# (Until then the decision timed 8 rows only, believing one row unaffected.)
ONE_LAUNCH_PADDED_ROWS = SMALL_BATCH_TOKENS
ONE_LAUNCH_ONE_ROW = 1
# The few-slot path compiled into the launch of buckets up to this; prefill buckets leave it out
# (it cost them 2-3%, H100 2026-11-24), and their candidates are timed without it.
FEW_MAX_TOKENS = 1024
# one_launch: the merged launch must not cost a full batch more than this. It is the noise of a
# full-batch timing (one-round bench_compare on the H100, 2026-11-24: unchanged code within
# +-1.3%), so only a real cost turns it down (there: Qwen3 T=256 +3.5%, DeepSeek-V3 T=2048 +4%),
# while a padded decode step's ~5 us saving (~10% of Qwen3's) is well above it.
ONE_LAUNCH_TOLERANCE = 0.01
# padded_steps_hold: a winner whose own padded steps get slower (beyond ONE_LAUNCH_TOLERANCE) is
# still kept when the time it saves on one full batch is at least PADDED_TRADE times what it adds
# to those steps together, and no step is slower by more than PADDED_TRADE_MAX. A bucket replays a
# step with a few valid rows when data-parallel ranks pad to a common size (one engine's graph
# takes the smallest bucket that holds its batch), and such a rank then waits for the fullest one.
# H200 2026-11-28, gpt-oss-120b T = 512: 32-row tiles 1883 -> 1524 us on the full batch (-19%), the
# one-row step 62.1 -> 67.5 us (+8.7%); the strict rule kept the 256 entry's 16-row tiles. The
# trades it turned down stay turned down: Qwen3-Next T = 256 (13 us saved, 8 added, one row +16%),
# fp8 Qwen3 T = 256 (3.7 saved, 1.6 added).
PADDED_TRADE = 10.0
PADDED_TRADE_MAX = 0.10
# An entry field naming why its one_launch was set by hand; --one-launch-only keeps such entries.
# H100 2026-11-26, Qwen3 T = 1024: the rule above turned the merged launch down (experts only,
# full batch +1.3%), while the whole layer, 5 interleaved rounds, gave one valid row 45.75 ->
# 41.58 us (-9.1%), 8 rows -2.0%, a full batch +0.9% (scripts/debug/ab_entry.py): for the padding
# target (a padded bucket replayed with one row) that trade is worth it, so the entry is pinned.
ONE_LAUNCH_PIN = "one_launch_pinned"
# Interleaved rounds of the four one_launch timings; each side's median is compared, so one slow
# replay set cannot decide it.
ONE_LAUNCH_ROUNDS = 3
# fused: the one-launch GEMMs of a few-slot bucket must beat the two launches by more than this
# (their medians over ONE_LAUNCH_ROUNDS interleaved rounds): a fused launch that only ties keeps
# its spin-waits and counters for nothing.
FUSED_MARGIN = 0.01
# --interleave-only: the prefill buckets it times, and the margin its winner needs
INTERLEAVE_MIN_TOKENS = 2048
INTERLEAVE_MARGIN = 0.01
# --engine-only: the buckets it times, the Gluon GEMM2 variants (engine, stages) and the margin
# its winner needs. A bucket below ENGINE_MIN_TOKENS pays the engine's launch on a padded step (the
# small-batch and few-slot tiles run in a Triton launch beside it): H200 2026-11-27, Mixtral
# T = 1024 with one valid row 184 -> 191 us, past the 1.1x padding target, while its full batch
# gained 6%. Whole layer, two runs (scripts/debug/pps_sweep.py): Qwen3 T = 4096-16384 -2.7..-4.9%,
# Mixtral T = 4096/8192 -4.2..-5.1%, DeepSeek-V3 T = 8192 -3.3..-4.1%, gpt-oss T = 8192 -0.9%.
ENGINE_MIN_TOKENS = 2048
ENGINE_VARIANTS = (("ws", 3), ("ws", 4), ("ws_store", 3))
ENGINE_MARGIN = 0.02
# --programs-only: the persistent-grid sizes timed against a decode entry's (the full search varies
# programs_per_sm only from T = 1024 up, so every decode entry kept the default 4), the buckets it
# times (a dispatch layout, T * K > FEW_SLOTS, below PROGRAMS_MAX_TOKENS) and the margin its winner
# needs. 64 programs per SM is about one tile a program, scheduled by the hardware instead of a
# static stride. H200 2026-11-26, whole layer, 3 interleaved rounds (scripts/debug/pps_sweep.py):
# at 64, DeepSeek-V3 T = 8 / 64 -2.2 / -2.4%, gpt-oss T = 64 / 256 -2.2 / -1.8%, Qwen3 and
# Mixtral T = 8..256 within -0.2..+0.6%; a second sweep an hour later -0.7 / -0.9% at DeepSeek-V3
# and gpt-oss T = 64, and this mode (experts only) -0.6..-0.8%: kept at 4 there. It moved Qwen3
# T = 16 / 32 and Mixtral T = 512 by -1.0..-1.4%.
PROGRAMS_CANDIDATES = (8, 16, 64)
PROGRAMS_MAX_TOKENS = 1024
PROGRAMS_MARGIN = 0.01
# Candidates within ONE_LAUNCH_TOLERANCE of a bucket's fastest full batch that are also timed on a
# one-valid-row padded step (prefer_fast_padded_step).
PADDED_PICK_CANDIDATES = 4
# After the search, the distinct candidates within CONFIRM_WINDOW of the fastest single timing (at
# most CONFIRM_CANDIDATES) are timed CONFIRM_ROUNDS more times, interleaved, and ranked by the
# median of all their timings (`confirm_ranking`), so one disturbed timing cannot pick the
# winner. Measured since (H100 2026-11-26, T = 1 of four shapes, 16 leaders x 4 timings): 15
# leaders' timings agreed within 0.5%, one had a sample 1.3% off (gpt-oss: 78.11 against
# 77.07-77.10 us), which the median discards; leaders sat 0.1-2% apart, and the same tiles timed
# on different days moved ~1% (gpt-oss T = 1: 79.4 us on 11-24, 78.5 on 11-26).
CONFIRM_WINDOW = 0.04
CONFIRM_CANDIDATES = 4
CONFIRM_ROUNDS = 3
# A re-tune replaces a bucket's incumbent only when its winner is faster by more than this:
# a change carries costs the bucket's own timing does not see. A few-slot bucket's tiles also run
# the padded steps of every larger bucket of the shape (`few_slots_config`): H100 2026-11-26,
# Mixtral T = 8 re-tuned 751 -> 749 us (-0.3%) took the T = 1024 bucket's one-valid-row layer
# step from 247 to 302 us (its merged launch runs those tiles with its own 8 warps).
REPLACE_MARGIN = 0.01
# Case.step's `few` default: the few-slot tiles the device table gives the config at its T.
FROM_TABLE = "table"
# fp8 weight modes (--quant) and the tiles' K-step limit of block mode (one 128-wide scale group).
QUANT_MODES = ("per_tensor", "block")
FP8_BLOCK_K = FP8_BLOCK
# A winner's relative Frobenius error against the reference, above which it is rejected: bf16
# against experts_reference; fp8 against experts_fp8_reference, where a one-row batch's
# re-quantised intermediate alone reaches 4.5e-2 (tests/test_experts_fp8.py's measured spread), so
# this only catches broken tiles (their error is ~1 or not finite).
CHECK_TOLERANCE = 1e-2
FP8_CHECK_TOLERANCE = 0.1

Tiles = tuple[int, int, int, int]  # (block_n, block_k, num_warps, num_stages)

# Decode (<= 16 rows per expert): the GEMMs stream weights; narrow N tiles give many programs and
# long K tiles keep bytes in flight.
DECODE_G1: list[Tiles] = [
    (32, 128, 4, 4),
    (16, 128, 4, 4),
    (16, 128, 4, 6),
    (16, 256, 4, 4),
    (32, 256, 4, 3),
    (32, 128, 4, 6),
    (32, 64, 4, 8),
    (64, 128, 4, 4),
    (64, 64, 4, 6),
]
DECODE_G2: list[Tiles] = [
    (64, 64, 4, 6),
    (32, 128, 4, 4),
    (32, 128, 4, 6),
    (32, 64, 4, 8),
    (64, 128, 4, 4),
    (64, 128, 4, 6),
    (64, 256, 4, 3),
    (128, 64, 4, 4),
    (128, 128, 8, 3),
]
MID_G1: list[Tiles] = [(64, 128, 4, 3), (32, 128, 4, 4), (64, 64, 4, 4), (128, 64, 4, 4), (128, 64, 8, 3)]
MID_G2: list[Tiles] = [(128, 64, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 8, 3), (256, 64, 8, 3)]
PREFILL_G1: list[Tiles] = [(128, 64, 8, 4), (64, 64, 8, 4), (128, 64, 8, 3), (128, 32, 8, 4), (64, 128, 8, 3)]
PREFILL_G2: list[Tiles] = [
    (256, 64, 8, 3),
    (128, 64, 8, 3),
    (128, 64, 8, 4),
    (128, 128, 8, 3),
    (256, 32, 8, 4),
]


# --wide adds these to each regime's lists: larger N and K tiles (more bytes per program in flight,
# fewer re-reads of x), two-warp decode tiles and deeper pipelines. Environment, not an argument,
# so the precompile worker processes see the same candidate lists.
WIDE_ENV = "SAFEMOE_TUNE_WIDE"
# --search-fused: every bucket that can run fused (`fused_bucket`) has its candidates timed
# fused whatever its incumbent (an env var, as WIDE_ENV, so the precompile workers plan the same)
SEARCH_FUSED_ENV = "SAFEMOE_TUNE_SEARCH_FUSED"
WIDE_DECODE_G1: list[Tiles] = [
    (32, 256, 4, 4), (64, 256, 4, 3), (16, 256, 2, 6), (32, 128, 2, 6), (128, 128, 4, 3),
]
WIDE_DECODE_G2: list[Tiles] = [
    (32, 256, 4, 4), (64, 256, 4, 4), (16, 256, 2, 6), (128, 128, 4, 4), (32, 128, 2, 6),
]
WIDE_MID_G1: list[Tiles] = [
    (128, 128, 4, 3), (128, 128, 8, 3), (64, 256, 4, 3), (256, 64, 8, 3), (64, 128, 4, 4),
]
WIDE_MID_G2: list[Tiles] = [
    (128, 128, 4, 3), (64, 256, 4, 3), (128, 128, 4, 4), (128, 128, 8, 3), (64, 128, 4, 5),
]
# (256, 64, 8, 4): the tile vLLM's H200 table gives Mixtral's shape (E = 8, N = 14336) from
# M = 256 up, 192 KB of shared memory with 128-row blocks; Mixtral T = 256 is at 80% of its read
# floor with (128, 64, 8, 4), where vLLM's kernel reaches 89% (issue 13).
WIDE_PREFILL_G1: list[Tiles] = [
    (256, 64, 8, 3), (128, 128, 8, 3), (256, 32, 8, 4), (128, 64, 4, 4), (128, 64, 8, 5), (256, 64, 8, 4),
]
WIDE_PREFILL_G2: list[Tiles] = [
    (256, 64, 8, 4), (128, 32, 8, 5), (128, 64, 8, 5), (128, 64, 4, 4), (64, 128, 4, 4),
]


# fp8 weights in the decode and mid regimes: an e4m3 tile of the bf16 lists' shape moves half the
# bytes a K step. H200 2026-11-27 (ncu, Qwen3 T = 64 / 256): the tuned fp8 GEMM1 (32 x 128 boxes, no
# TMA) streams at 77% / 59% of the DRAM peak where the bf16 one (64 x 128 through TMA) reaches 89% /
# 84%, and the seventh session's fp8 tune never timed a 64-column x 256-byte tile nor TMA on any
# tile but the descent's best. These add the byte-equivalent tiles of the bf16 winners (block mode
# keeps block_k <= 128 through for_quant, so wider N there), and with fp8 every GEMM candidate of
# these regimes is timed with and without TMA.
FP8_DECODE_G1: list[Tiles] = [
    (64, 256, 4, 4), (64, 256, 4, 3), (32, 256, 4, 6), (32, 512, 4, 3), (128, 128, 4, 4), (64, 128, 4, 6),
]
FP8_DECODE_G2: list[Tiles] = [
    (128, 256, 4, 3), (64, 256, 4, 4), (128, 128, 4, 6), (128, 256, 8, 3), (64, 512, 4, 3),
]


def _lists(regime: str) -> tuple[list[Tiles], list[Tiles]]:
    base = {"decode": (DECODE_G1, DECODE_G2), "mid": (MID_G1, MID_G2), "prefill": (PREFILL_G1, PREFILL_G2)}
    wide = {"decode": (WIDE_DECODE_G1, WIDE_DECODE_G2), "mid": (WIDE_MID_G1, WIDE_MID_G2),
            "prefill": (WIDE_PREFILL_G1, WIDE_PREFILL_G2)}  # fmt: skip
    g1, g2 = base[regime]
    if os.environ.get(WIDE_ENV) == "1":
        g1 = g1 + [t for t in wide[regime][0] if t not in g1]
        g2 = g2 + [t for t in wide[regime][1] if t not in g2]
    return g1, g2


def for_quant(tiles: list[Tiles], quant: str | None) -> list[Tiles]:
    """`tiles` as candidates for weights of `quant`: block mode steps K by at most FP8_BLOCK_K
    (wider K steps become FP8_BLOCK_K, duplicates dropped, order kept); others unchanged."""
    if quant != "block":
        return tiles
    out: list[Tiles] = []
    for n, k, warps, stages in tiles:
        t = (n, min(k, FP8_BLOCK_K), warps, stages)
        if t not in out:
            out.append(t)
    return out


def _fp8_extra(tiles: list[Tiles], extra: list[Tiles], quant: str | None, regime: str) -> list[Tiles]:
    """FP8_DECODE_G* candidates not already in `tiles`, for fp8 weights in the decode and mid regimes."""
    if quant is None or regime == "prefill":
        return []
    return [t for t in extra if t not in tiles]


Variant = tuple[bool, bool]  # (tma, swap_ab)


def fp8_per_candidate(quant: str | None, block_m: int) -> bool:
    """Whether every GEMM candidate is timed in its (tma, swap_ab) variants (fp8 weights at decode
    and mid BLOCK_M, <= 32), rather than TMA tried on the descent's best alone."""
    return quant is not None and block_m <= 32


def fp8_variants(quant: str | None, block_m: int, tiles: Tiles) -> tuple[Variant, ...]:
    """(tma, swap_ab) settings a GEMM candidate is timed with: where `fp8_per_candidate`, TMA both
    ways (see FP8_DECODE_G1) and, where the tile has 64+ columns (wgmma's M), the swapped product
    both ways too (GemmTiles.swap_ab: native e4m3 wgmma instead of the 16-row tile's f16 mma.sync on
    converted operands; H200 2026-11-27, bare tile loop `fp8_swap_ab_probe.py`: 4-13% faster on
    Qwen3's GEMMs); else plain only."""
    if not fp8_per_candidate(quant, block_m):
        return ((False, False),)
    swaps = (False, True) if tiles[0] >= 64 else (False,)
    return tuple((tma, swap) for swap in swaps for tma in (False, True))


def regimes(num_tokens: int, num_experts: int, top_k: int,
            quant: str | None = None) -> list[tuple[int, list[Tiles], list[Tiles], int]]:
    """(block_m, GEMM1 candidates, GEMM2 candidates, group_m) worth trying at this T (for weights
    of `quant`: None, bf16 like x, or an fp8 mode)."""
    rows = token_bucket(num_tokens) * top_k / num_experts
    decode, mid, prefill = (
        (for_quant(g1 + _fp8_extra(g1, FP8_DECODE_G1, quant, regime), quant),
         for_quant(g2 + _fp8_extra(g2, FP8_DECODE_G2, quant, regime), quant))
        for regime, (g1, g2) in ((r, _lists(r)) for r in ("decode", "mid", "prefill"))
    )
    if rows <= 8:
        return [(16, *decode, 1)]
    if rows <= 24:
        return [(16, *decode, 1), (32, *mid, 4)]
    if rows <= 48:
        return [(32, *mid, 4), (64, *mid, 8)]
    if rows <= 96:
        # Around 64 rows per expert about half the experts pass 64 (uniform routing), and a second
        # 64-row block of an expert reads its weights again; 128 rows hold every expert in one block.
        # vLLM's tuned Mixtral H200 table moves to BLOCK_SIZE_M 128 at 256 tokens (64 rows per expert).
        return [(32, *mid, 4), (64, *mid, 8), (128, *prefill, 8)]
    if rows <= 192:
        return [(64, *prefill, 8), (128, *prefill, 8)]
    return [(128, *prefill, 8), (64, *prefill, 8)]


def _tiles(t: Tiles, group_m: int, tma: bool = False, swap_ab: bool = False) -> GemmTiles:
    return GemmTiles(block_n=t[0], block_k=t[1], group_m=group_m, num_warps=t[2], num_stages=t[3], tma=tma,
                     swap_ab=swap_ab)


def _pdl(num_tokens: int) -> bool:
    # Programmatic dependent launch overlaps each launch with the previous kernel's tail: worth it
    # where launches are a visible share (run 1 on an H200 picked it at most decode points, and
    # it was within noise elsewhere). Every candidate up to PDL_MAX_TOKENS uses it: a graph
    # captured for such a bucket replays padded decode steps too (one valid row), which are all
    # launches; prefill candidates do not (gpt-oss T = 8192 was 3-4% slower with it, H100).
    from safemoe.kernels.launch import pdl_supported

    return num_tokens <= PDL_MAX_TOKENS and pdl_supported()


def _few(num_tokens: int, quant: str | None) -> bool:
    """Whether candidates at this T carry the few-slot path (it takes no fp8 weights)."""
    return num_tokens <= FEW_MAX_TOKENS and quant is None


def candidate_plan(num_tokens: int, num_experts: int, top_k: int,
                   quant: str | None = None, fused: bool = False) -> list[ExpertsConfig]:
    """Every config whose kernels the search may time at this T (for precompiling): per BLOCK_M,
    GEMM1 candidates with the base GEMM2, GEMM2 candidates with the base GEMM1, each also with
    TMA weight loads (kernels compile per GEMM, so these cover every combination searched; with
    `fused`, one kernel holds both GEMMs and the combinations of the descent compile as timed)."""
    plan = []
    flags: dict[str, Any] = {"pdl": _pdl(num_tokens), "few": _few(num_tokens, quant), "fused": fused}
    for block_m, g1s, g2s, group_m in regimes(num_tokens, num_experts, top_k, quant):
        base1, base2 = _tiles(g1s[0], group_m), _tiles(g2s[0], group_m)
        plan += [ExpertsConfig(block_m, _tiles(t, group_m, *v), base2, **flags)
                 for t in g1s for v in _plan_variants(quant, block_m, t)]
        plan += [ExpertsConfig(block_m, base1, _tiles(t, group_m, *v), **flags)
                 for t in g2s for v in _plan_variants(quant, block_m, t)]
    return plan


def _plan_variants(quant: str | None, block_m: int, tiles: Tiles) -> list[Variant]:
    """What candidate_plan compiles a tile in: with and without TMA always (the descent may try
    either), and the swapped variants the fp8 search times (`fp8_variants`)."""
    return [(False, False), (True, False)] + [v for v in fp8_variants(quant, block_m, tiles) if v[1]]


def choose_one_launch(
    full_two: float,
    full_one: float,
    padded_two: float,
    padded_one: float,
    tolerance: float = ONE_LAUNCH_TOLERANCE,
) -> bool:
    """one_launch for a bucket from its four timings (us; `two`: small tiles in a second launch
    per GEMM, `one`: merged): True only when the padded decode steps (num_valid = 8 and 1, their
    medians added) get faster and the full batch (num_valid = T) gets no slower than `tolerance`
    (a fraction)."""
    return padded_one < padded_two and full_one <= full_two * (1.0 + tolerance)


def choose_for_padded_step(full: dict[int, float], padded: dict[int, float],
                           tolerance: float = ONE_LAUNCH_TOLERANCE) -> int:
    """Key of the config to keep among candidates whose full batch took `full` us: of those within
    `tolerance` of the fastest, the one whose one-valid-row step (`padded`, us) is fastest; the
    fastest full batch when none of them was timed padded."""
    fastest = min(full.values())
    close = [key for key, us in full.items() if us <= fastest * (1.0 + tolerance) and key in padded]
    if not close:
        return min(full, key=full.__getitem__)
    return min(close, key=lambda key: (padded[key], full[key]))


def confirm_ranking(results: list[tuple[float, ExpertsConfig]],
                    retime: Callable[[ExpertsConfig], float | None],
                    window: float = CONFIRM_WINDOW, limit: int = CONFIRM_CANDIDATES,
                    rounds: int = CONFIRM_ROUNDS) -> list[tuple[float, ExpertsConfig]]:
    """`results` (sorted by us) re-ranked: the distinct configs within `window` (a fraction) of
    the fastest, at most `limit`, are timed `rounds` more times by `retime` (None: a failed
    timing, left out), round-robin so drift hits each alike, and carry the median of all their
    timings; the others keep theirs. Sorted by us again."""
    fastest = results[0][0]
    leaders: dict[ExpertsConfig, list[float]] = {}  # configs compare by their fields, not `extra`
    for us, cfg in results:
        if cfg in leaders:
            leaders[cfg].append(us)
        elif us <= fastest * (1.0 + window) and len(leaders) < limit:
            leaders[cfg] = [us]
    if len(leaders) < 2:
        return results
    for _ in range(rounds):
        for cfg, times in leaders.items():
            retimed = retime(cfg)
            if retimed is not None:
                times.append(retimed)
    ranked = [(statistics.median(times), cfg) for cfg, times in leaders.items()]
    ranked += [(us, cfg) for us, cfg in results if cfg not in leaders]
    return sorted(ranked, key=lambda r: r[0])


def keep_incumbent(results: list[tuple[float, ExpertsConfig]], incumbent: ExpertsConfig | None,
                   margin: float = REPLACE_MARGIN) -> list[tuple[float, ExpertsConfig]]:
    """`results` (sorted by us) with the incumbent first when it was timed within `margin` (a
    fraction) of the fastest; unchanged otherwise."""
    if incumbent is None:
        return results
    mine = [r for r in results if r[1] == incumbent]
    if not mine or min(us for us, _ in mine) > results[0][0] * (1.0 + margin):
        return results
    pick = min(mine, key=lambda r: r[0])
    return [pick] + [r for r in results if r is not pick]


class Dependent(NamedTuple):
    """A padded step of a larger bucket that runs a source bucket's tiles: `bucket` (its T), its
    table `config`, and `num_valid` (1: the few-slot path, SMALL_BATCH_TOKENS: the small tiles)."""

    bucket: int
    config: ExpertsConfig
    num_valid: int


def tiles_with(table: dict[int, ExpertsConfig], dependent: ExpertsConfig, num_tokens: int, top_k: int,
               fallback: Callable[[int], ExpertsConfig], small_pin: ExpertsConfig | None = None
               ) -> tuple[ExpertsConfig | None, ExpertsConfig | None]:
    """(small-batch tiles, few-slot tiles) a bucket of T tokens with config `dependent` runs by the
    rules of `small_batch_config` and `few_slots_config`, read from `table` ({bucket: config};
    `fallback(T)` where no bucket serves T: the heuristic) and `small_pin` (the shape's "small_batch"
    entry, which replaces SMALL_BATCH_TOKENS' bucket as the small-batch source)."""
    from safemoe.configs import nearest_bucket
    from safemoe.kernels.experts import few_slots_bucket

    def lookup(tokens: int) -> ExpertsConfig:
        bucket = nearest_bucket(tokens, table)
        return table[bucket] if bucket is not None else fallback(tokens)

    small = None
    if num_tokens > SMALL_BATCH_TOKENS:
        candidate = small_pin if small_pin is not None else lookup(SMALL_BATCH_TOKENS)
        small = candidate if candidate.block_m < dependent.block_m else None
    few = None
    if top_k <= FEW_SLOTS and dependent.few and num_tokens * top_k > FEW_SLOTS:
        candidate = lookup(few_slots_bucket(top_k))
        few = candidate if candidate.few else None
    return small, few


def dependents(bucket: int, top_k: int, sources: tuple[ExpertsConfig, ExpertsConfig],
               table: dict[int, ExpertsConfig], fallback: Callable[[int], ExpertsConfig],
               small_pin: ExpertsConfig | None = None) -> list[Dependent]:
    """The padded steps whose tiles change when `bucket`'s entry goes from sources[0] to
    sources[1]: of the table's buckets up to FEW_MAX_TOKENS above `bucket`, the largest whose
    few-slot tiles (one valid row) and the largest whose small-batch tiles (SMALL_BATCH_TOKENS
    rows) differ between the two (`tiles_with`). A few-slot or small-batch source bucket's tiles
    run those steps with the larger bucket's launch (H100 2026-11-26: a Mixtral T = 8 re-tune,
    -0.3% on its own, took T = 1024's one-row step from 247 to 302 us). `fallback(T)`: the tiles
    of a T no bucket serves (the heuristic's). With `small_pin` (the shape's "small_batch" entry)
    no small-batch step depends on any bucket."""
    found: dict[int, Dependent] = {}
    for larger in sorted(b for b in table if bucket < b <= FEW_MAX_TOKENS):
        old, new = (tiles_with({**table, bucket: source}, table[larger], larger, top_k, fallback, small_pin)
                    for source in sources)
        if old[1] != new[1]:
            found[ONE_LAUNCH_ONE_ROW] = Dependent(larger, table[larger], ONE_LAUNCH_ONE_ROW)
        if old[0] != new[0]:
            found[SMALL_BATCH_TOKENS] = Dependent(larger, table[larger], SMALL_BATCH_TOKENS)
    return list(found.values())


def small_batch_split(bucket: int, timings: dict[str, dict[str, float]] | None,
                      small_pin: ExpertsConfig | None) -> bool:
    """Whether a winner of SMALL_BATCH_TOKENS' bucket that `check_dependents` refused can take the
    bucket anyway, with the incumbent written as the shape's "small_batch" entry (the tiles the
    larger buckets' steps of at most SMALL_BATCH_TOKENS valid rows run, which then stay the
    incumbent's): the shape has no such entry yet, and every dependent step that got slower is a
    small-batch one. A slower one-row step (the few-slot tiles, which Mixtral's T = 8 entry also
    gives) still keeps the incumbent. H200 2026-12-02: gpt-oss T = 8's fused wide search found
    tiles faster for the bucket, refused because T = 1024's 8-row step went 350.4 -> 374.8 us."""
    if small_pin is not None or timings is None or bucket != token_bucket(SMALL_BATCH_TOKENS):
        return False
    slower = [step for step, t in timings.items() if not dependents_allow({step: t})]
    return bool(slower) and all(step.endswith(f" num_valid={SMALL_BATCH_TOKENS}") for step in slower)


def small_batch_pin_entry(case: Case, timings: dict[str, dict[str, float]] | None) -> dict[str, Any]:
    """The shape's "small_batch" entry when `small_batch_split` lets case's winner take its bucket:
    the incumbent's config, why it is kept, and the dependent steps' timings (printed too)."""
    assert case.incumbent is not None
    bucket = token_bucket(case.num_tokens)
    print(f"  {case.name} T={case.num_tokens}: the winner takes the bucket; its incumbent stays the larger "
          f"buckets' small-batch tiles (\"small_batch\" entry): {timings}", flush=True)
    return {
        **case.incumbent.to_json(),
        "source": f"T = {bucket}'s entry before the run of {time.strftime('%Y-%m-%d', time.gmtime())}, kept "
                  "for the larger buckets' small-batch steps, which its winner slowed",
        "dependents_us": timings,
    }


def dependents_allow(timings: dict[str, dict[str, float]], tolerance: float = ONE_LAUNCH_TOLERANCE) -> bool:
    """True when no dependent padded step ({step: {"incumbent": us, "winner": us}}) gets slower by
    more than `tolerance` with the winner's tiles."""
    return all(t["winner"] <= t["incumbent"] * (1.0 + tolerance) for t in timings.values())


def padded_trade_allows(saved_us: float, timings: dict[str, dict[str, float]], trade: float = PADDED_TRADE,
                        limit: float = PADDED_TRADE_MAX) -> bool:
    """True when a winner that saves `saved_us` on the full batch may make the padded steps of
    `timings` ({step: {"incumbent": us, "winner": us}}) slower: none by more than `limit`, and
    all together by at most saved_us / trade."""
    added = sum(max(0.0, t["winner"] - t["incumbent"]) for t in timings.values())
    return saved_us >= trade * added and all(
        t["winner"] <= t["incumbent"] * (1.0 + limit) for t in timings.values())


def prefer_fast_padded_step(case: Case, results: list[tuple[float, ExpertsConfig]], log: list[dict[str, Any]],
                            limit: int = PADDED_PICK_CANDIDATES) -> list[tuple[float, ExpertsConfig]]:
    """`results` (sorted by full-batch us) with the candidate to keep first: a bucket whose graph
    also replays padded decode steps (the few-slot path merged into its GEMM launches) runs the
    main config's warps, stages and persistent grid on a one-row step, so among the distinct
    configs within ONE_LAUNCH_TOLERANCE of the fastest full batch (at most `limit`) the one with the
    fastest one-valid-row step wins (`choose_for_padded_step`). H100 2026-11-26, Qwen3 T = 1024:
    the full batch within 1% at 1-8 programs per SM, the one-row step 38.5 us at 1 and 40.4 at 8;
    a tune that kept the fastest full batch alone picked 8-warp 128-row tiles whose one-row step
    made the layer's padded step 1.42x T = 1 (48.4 / 34.0 us). A candidate whose BLOCK_M is above
    the small-batch tiles' (`case.small_source`) is timed with them, in launches of their own, as
    the call will run it until one_launch is decided (H100 2026-11-27, Qwen3-Next T = 512: a
    32-row candidate's one-row step was 32.9 us without them and 37.1 with them, the same as the
    16-row tiles it then replaced by 0.1% on the full batch)."""
    fastest = results[0][0]
    close: list[tuple[float, ExpertsConfig]] = []
    seen: set[ExpertsConfig] = set()
    for result in results:
        us, cfg = result
        if us <= fastest * (1.0 + ONE_LAUNCH_TOLERANCE) and cfg not in seen:
            seen.add(cfg)
            close.append(result)
    close = close[:limit]
    if len(close) < 2:
        return results
    padded = {}
    for index, (_, cfg) in enumerate(close):
        small = padded_step_small(case, cfg)
        one_row_us = _timed(case, cfg, log, "padded_one_row", None, small=small, num_valid=ONE_LAUNCH_ONE_ROW)
        if one_row_us is not None:
            padded[index] = one_row_us
    pick = close[choose_for_padded_step({index: us for index, (us, _) in enumerate(close)}, padded)]
    return [pick] + [r for r in results if r is not pick]


def padded_step_small(case: Case | None, cfg: ExpertsConfig) -> ExpertsConfig | None:
    """The small-batch tiles a call of `case`'s bucket runs beside `cfg` (small_tiles_from's rule,
    with `case.small_source` as the SMALL_BATCH_TOKENS config), or None."""
    from safemoe.kernels.experts import small_tiles_from

    if case is None or case.small_source is None:
        return None
    source = case.small_source
    return small_tiles_from(case.num_tokens, cfg, lambda: source)


def small_batch_source(name: str, configs: dict[int, ExpertsConfig], device: torch.device,
                       quant: str | None = None, small_pin: ExpertsConfig | None = None) -> ExpertsConfig:
    """The config a bucket takes its small-batch tiles from (`small_batch_config`'s source): the
    shape's "small_batch" entry (`small_pin`) when it has one, else the SMALL_BATCH_TOKENS bucket's
    of `configs` (this run's winners) when there is one, else what the device runs for that many
    tokens today with weights of `quant` (the table's nearest bucket or the heuristic)."""
    if small_pin is not None:
        return small_pin
    mine = configs.get(token_bucket(SMALL_BATCH_TOKENS))
    return mine if mine is not None else incumbent_config(name, SMALL_BATCH_TOKENS, quant, device)


def one_launch_plan(
    winners: dict[int, ExpertsConfig], fallback_small: ExpertsConfig, small_pin: ExpertsConfig | None = None
) -> dict[int, ExpertsConfig]:
    """{bucket: small config} for the buckets whose one_launch is worth timing: the same rule as
    `safemoe.kernels.experts.small_batch_config` (T above SMALL_BATCH_TOKENS, small BLOCK_M below
    the bucket's), with the small config taken from `winners` (this run's, or the table's) at
    SMALL_BATCH_TOKENS' bucket, else `fallback_small` (what get_config picks for that many tokens
    on the device: the table's nearest bucket or the heuristic), or `small_pin`, the shape's
    "small_batch" entry, when it has one."""
    small = winners.get(token_bucket(SMALL_BATCH_TOKENS), fallback_small) if small_pin is None else small_pin
    return {
        bucket: small
        for bucket, cfg in sorted(winners.items())
        if bucket > SMALL_BATCH_TOKENS and small.block_m < cfg.block_m
    }


def merge_device_json(existing: dict[str, Any], payload: dict[str, Any]) -> dict[str, Any]:
    """The device file after --write: payload's metadata, its config entries replacing the same
    (shape, bucket) entries whole (one_launch included; `few` is kept where the existing entry
    turned it off, a choice this script does not time), every other entry and top-level key of
    `existing` ("batch_invariant", "notes") kept; payload's "small_batch" entries replace the same
    shapes' and keep the others'."""
    merged = {**existing, **{k: v for k, v in payload.items() if k not in ("configs", "small_batch")}}
    if "small_batch" in payload:
        merged["small_batch"] = {**existing.get("small_batch", {}), **payload["small_batch"]}
    configs = {key: dict(buckets) for key, buckets in existing.get("configs", {}).items()}
    for key, buckets in payload["configs"].items():
        old = configs.setdefault(key, {})
        for bucket, entry in buckets.items():
            few_off = old.get(bucket, {}).get("few") is False
            old[bucket] = {**entry, "few": False} if few_off else entry
    merged["configs"] = {
        key: dict(sorted(buckets.items(), key=lambda item: int(item[0]))) for key, buckets in configs.items()
    }
    return merged


# ---------------------------------------------------------------------------------------------
# Parallel compilation
# ---------------------------------------------------------------------------------------------


# (shape name, T, [(config, small config or None)], quant)
CompileTask = tuple[str, int, list[tuple[dict[str, Any], dict[str, Any] | None]], str | None]


def stand_in_fp8(num_experts: int, hidden: int, inter: int, quant: str,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(w13, w2, Fp8Weights) of the real shapes and scale shapes, each weight one zero broadcast
    (strides 0, nothing worth reading): what the precompile workers compile fp8 kernels against.
    The scales are built as Fp8Weights directly: `check_fp8_weights` wants contiguous weights."""
    from safemoe._checks import Fp8Weights, fp8_scale_shapes
    from safemoe.numerics import FP8_DTYPE

    one = torch.zeros(1, dtype=FP8_DTYPE, device=device)
    w13 = one.expand(num_experts, 2 * inter, hidden)
    w2 = one.expand(num_experts, hidden, inter)
    shapes = fp8_scale_shapes(num_experts, hidden, inter, quant)
    s13, s2 = (torch.ones(shape, device=device) for shape in shapes)
    return w13, w2, Fp8Weights(quant, s13, s2)


def _compile_task(task: CompileTask) -> list[str]:
    """Run the op once per (config, small config or None) with num_valid = 0 (no weight is read)
    to fill Triton's cache."""
    name, num_tokens, configs, quant = task
    from safemoe._checks import NumValid
    from safemoe.kernels.experts import experts_triton
    from safemoe.workspace import Workspace

    num_experts, top_k, hidden, inter = SHAPES[name]
    device = torch.device("cuda", 0)
    dtype = torch.bfloat16
    # Stand-in weights: one element broadcast to the real shape (strides 0). With num_valid = 0 no
    # M-block exists, so the GEMMs load nothing; shapes (and so specialisations) are the real ones.
    one = torch.zeros(1, dtype=dtype, device=device)
    w13 = one.expand(num_experts, 2 * inter, hidden)
    w2 = one.expand(num_experts, hidden, inter)
    fp8 = None
    if quant is not None:
        w13, w2, fp8 = stand_in_fp8(num_experts, hidden, inter, quant, device)
    x = torch.zeros(num_tokens, hidden, dtype=dtype, device=device)
    ids = torch.zeros(num_tokens, top_k, dtype=torch.int32, device=device)
    weights = torch.zeros(num_tokens, top_k, dtype=torch.float32, device=device)
    nv = NumValid(None, torch.zeros((), dtype=torch.int32, device=device))
    ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, dtype, device, fp8=fp8 is not None)
    failures = []
    for data, small_data in configs:
        cfg = ExpertsConfig.from_json(data)
        small = None if small_data is None else ExpertsConfig.from_json(small_data)
        try:
            experts_triton(
                x,
                w13,
                w2,
                weights,
                ids,
                activation="silu",
                num_valid=nv,
                health=None,
                workspace=ws,
                config=cfg,
                small_config=small,
                few_config=few_slots_tiles(cfg, name, num_tokens, device, quant),
                fp8=fp8,
            )
            torch.cuda.synchronize()
        except Exception as exc:  # out of shared memory, unsupported layout...
            failures.append(
                f"{name} T={num_tokens} {json.dumps(data)}: {type(exc).__name__}: {str(exc)[:200]}"
            )
    return failures


def few_slots_tiles(cfg: ExpertsConfig, name: str, num_tokens: int, device: torch.device,
                    quant: str | None = None) -> ExpertsConfig | None:
    """The few-slot tiles `experts_triton` would run with candidate `cfg` once the shape has a
    table, so a candidate is timed as the bucket will run: a bucket whose every batch takes the
    path (T*K <= 16) on it with the candidate's own tiles; a larger one with the path compiled
    into its launch (the device table's tiles of the largest such bucket, as they are: a tabled
    shape's few-slot tiles are neither lightened nor fitted, even while the shape being tuned has
    no table yet) unless the candidate turns it off. None with fp8 weights (the path takes none)."""
    from safemoe.configs import get_config
    from safemoe.kernels.experts import few_slots_bucket, few_tiles_from

    if quant is not None:
        return None
    num_experts, top_k, hidden, inter = SHAPES[name]
    return few_tiles_from(num_tokens, top_k, cfg, lambda: get_config(
        few_slots_bucket(top_k), num_experts, hidden, inter, top_k, torch.bfloat16, device))


def compile_tasks(names: list[str], tokens_of: dict[str, tuple[int, ...]], quant: str | None = None,
                  baselines: dict[tuple[str, int], list[ExpertsConfig]] | None = None) -> list[CompileTask]:
    """Each distinct config once (at the first T that times it), 3 configs a task; `baselines`
    ({(shape, T): [incumbent, heuristic]}) are timed too."""
    tasks = []
    for name in names:
        num_experts, top_k, _, _ = SHAPES[name]
        seen: set[ExpertsConfig] = set()
        for num_tokens in tokens_of[name]:
            fresh: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
            extra = (baselines or {}).get((name, num_tokens), [])
            fused = search_fused(extra[0] if extra else None, num_tokens, top_k)
            for cfg in [*extra, *candidate_plan(num_tokens, num_experts, top_k, quant, fused)]:
                if cfg not in seen:
                    seen.add(cfg)
                    fresh.append((cfg.to_json(), None))
            for i in range(0, len(fresh), 3):
                tasks.append((name, num_tokens, fresh[i : i + 3], quant))
    return tasks


def one_launch_tasks(name: str, plan: dict[int, tuple[ExpertsConfig, ExpertsConfig]]) -> list[CompileTask]:
    """Both one_launch variants of each planned bucket ({bucket: (winner, small config)}), one
    bucket a task: the merged kernels are new; the separate small-tile kernels mostly cached."""
    return [
        (
            name,
            bucket,
            [(replace(cfg, one_launch=merged).to_json(), small.to_json()) for merged in (False, True)],
            None,
        )
        for bucket, (cfg, small) in plan.items()
    ]


def precompile(tasks: list[CompileTask], jobs: int) -> list[str]:
    if not tasks:
        return []
    ctx = mp.get_context("spawn")
    with ctx.Pool(processes=min(jobs, len(tasks))) as pool:
        results = pool.map(_compile_task, tasks, chunksize=1)
    return [line for failures in results for line in failures]


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


class Case:
    """Weights of one model shape plus N_VARIANTS routing sets at one T, and a workspace. With
    `fp8` (the Fp8Weights of fp8 w13 and w2) every call runs the fp8 path."""

    def __init__(
        self, name: str, w13: torch.Tensor, w2: torch.Tensor, num_tokens: int, seed: int = 0,
        fp8: Any = None, incumbent: ExpertsConfig | None = None, heuristic: ExpertsConfig | None = None,
        replace_margin: float = REPLACE_MARGIN,
    ) -> None:
        from safemoe._checks import NumValid
        from safemoe.workspace import Workspace

        num_experts, top_k, hidden, inter = SHAPES[name]
        device = w13.device
        gen = torch.Generator(device=device).manual_seed(seed)
        self.name, self.num_tokens, self.w13, self.w2 = name, num_tokens, w13, w2
        self.fp8 = fp8
        self.quant: str | None = None if fp8 is None else fp8.mode
        self.incumbent = incumbent  # today's config of the bucket, timed among the candidates
        self.heuristic = heuristic  # the untuned tiles, timed too (the incumbent may be a neighbour's)
        self.replace_margin = replace_margin
        self.ranked: list[tuple[float, ExpertsConfig]] = []  # tune_case's final ranking
        # the SMALL_BATCH_TOKENS config a call of this bucket takes its small-batch tiles from
        # (this run's winner or the device table's; set by main): prefer_fast_padded_step's
        self.small_source: ExpertsConfig | None = None
        self.xs = [
            torch.randn(num_tokens, hidden, device=device, dtype=torch.bfloat16, generator=gen)
            for _ in range(N_VARIANTS)
        ]
        self.ids, self.weights = [], []
        for _ in range(N_VARIANTS):
            scores = torch.rand(num_tokens, num_experts, device=device, generator=gen)
            self.ids.append(torch.topk(scores, top_k, dim=1).indices.to(torch.int32))
            self.weights.append(torch.rand(num_tokens, top_k, device=device, generator=gen))
        self.outs = [torch.empty_like(x) for x in self.xs]
        # num_valid as a device tensor: T (a full batch), or 1 (a padded decode step, same graph)
        self.nvs = {
            n: NumValid(None, torch.tensor(n, dtype=torch.int32, device=device))
            for n in {num_tokens, 1, min(num_tokens, ONE_LAUNCH_PADDED_ROWS)}
        }
        self.nv = self.nvs[num_tokens]
        self.ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16, device,
                            fp8=fp8 is not None)
        self.est_us = estimate_us(name, num_tokens, weight_bytes=2 if fp8 is None else 1)

    def step(
        self,
        cfg: ExpertsConfig,
        stages: str = "all",
        small: ExpertsConfig | None = None,
        num_valid: int | None = None,
        few: ExpertsConfig | str | None = FROM_TABLE,
    ) -> Callable[[int], None]:
        """One call on input set j: `stages` "all" is experts_triton with `cfg` (and `small` as its
        small-batch tiles, None: none; `few` its few-slot tiles, by default those the device table
        gives `cfg` at this T) at num_valid T or `num_valid`; else the stages up to and including
        that one (dispatch, gemm1, gemm2), main tiles only (bf16 weights only)."""
        from safemoe.kernels.combine import combine_into
        from safemoe.kernels.dispatch import dispatch_into
        from safemoe.kernels.experts import experts_triton, gemm1_into, gemm2_into

        num_experts, top_k, hidden, inter = SHAPES[self.name]

        nv = self.nvs[self.num_tokens if num_valid is None else num_valid]
        if stages != "all" and self.fp8 is not None:
            raise ValueError(f"stages={stages!r} times the bf16 kernels alone; this case has fp8 weights")
        few_tiles = (few_slots_tiles(cfg, self.name, self.num_tokens, self.w13.device, self.quant)
                     if few == FROM_TABLE else few)
        assert few_tiles is None or isinstance(few_tiles, ExpertsConfig)

        def run(j: int) -> None:
            if stages == "all":
                experts_triton(
                    self.xs[j],
                    self.w13,
                    self.w2,
                    self.weights[j],
                    self.ids[j],
                    activation="silu",
                    num_valid=nv,
                    health=None,
                    workspace=self.ws,
                    out=self.outs[j],
                    config=cfg,
                    small_config=small,
                    few_config=few_tiles,
                    fp8=self.fp8,
                    # every row's ids written (torch.topk), as moe()'s router leaves them
                    ids_complete=True,
                )
                return
            views = self.ws.views(self.num_tokens, num_experts, top_k, hidden, inter)
            dispatch_into(self.ids[j], num_experts, self.nv, cfg.block_m, views, None)
            if stages == "dispatch":
                return
            gemm1_into(self.xs[j], self.w13, views, top_k, "silu", cfg)
            if stages == "gemm1":
                return
            gemm2_into(self.w2, self.weights[j], views, self.num_tokens, top_k, cfg)
            if stages == "gemm2":
                return
            combine_into(views.y, self.ids[j], num_experts, self.nv, self.outs[j])

        return run

    def check(self, cfg: ExpertsConfig, few: ExpertsConfig | str | None = FROM_TABLE) -> float:
        """Frobenius-relative error of this config (with `few` as in `step`) against the reference
        on input set 0 (fp8: `experts_fp8_reference`, the same quantisation rules)."""
        from safemoe.reference import experts_fp8_reference, experts_reference

        self.step(cfg, few=few)(0)
        if self.fp8 is None:
            ref = experts_reference(
                self.xs[0], self.w13, self.w2, self.weights[0], self.ids[0], activation="silu"
            )
        else:
            ref = experts_fp8_reference(
                self.xs[0], self.w13, self.w2, self.fp8.w13_scale, self.fp8.w2_scale, self.weights[0],
                self.ids[0], activation="silu",
            )
        out = self.outs[0].float()
        if not bool(torch.isfinite(out).all()):
            return float("inf")
        return float((out - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))

    def time(
        self,
        cfg: ExpertsConfig,
        stages: str = "all",
        est_us: float | None = None,
        small: ExpertsConfig | None = None,
        num_valid: int | None = None,
        few: ExpertsConfig | str | None = FROM_TABLE,
    ) -> float:
        return self.time_step(self.step(cfg, stages, small, num_valid, few), est_us)

    def time_step(self, step: Callable[[int], object], est_us: float | None = None) -> float:
        """Median us of step(j) (j over the N_VARIANTS input sets) under CUDA-graph replay, with
        the loop sizes `time` uses (a peer's call on this case's inputs, timed the same way)."""
        from safemoe.bench.harness import time_graph

        est = est_us or self.est_us
        calls = int(min(20, max(2, 20000 / est)))
        replays = int(min(20, max(3, 300000 / (est * calls))))
        return time_graph(step, n_variants=N_VARIANTS, calls_per_graph=calls, replays=replays, warmup=2)


def estimate_us(name: str, num_tokens: int, weight_bytes: int = 2) -> float:
    """A rough time per call (3 TB/s for the weights touched, 400 TFLOP/s, +10 us) to size the
    timing loops."""
    num_experts, top_k, hidden, inter = SHAPES[name]
    touched = num_experts * (1 - (1 - top_k / num_experts) ** num_tokens)
    seconds = max(touched * 3 * hidden * inter * weight_bytes / 3e12,
                  6 * num_tokens * top_k * hidden * inter / 4e14)
    return seconds * 1e6 + 10


def make_weights(name: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    num_experts, _, hidden, inter = SHAPES[name]
    gen = torch.Generator(device=device).manual_seed(1234)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=device, dtype=torch.bfloat16, generator=gen)
    w13.mul_(hidden**-0.5)
    w2 = torch.randn(num_experts, hidden, inter, device=device, dtype=torch.bfloat16, generator=gen)
    w2.mul_(inter**-0.5)
    return w13, w2


def quantize_weights(w13: torch.Tensor, w2: torch.Tensor,
                     quant: str) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(fp8 w13, fp8 w2, their Fp8Weights) of bf16 stand-in weights, quantised expert by expert."""
    from safemoe._checks import check_fp8_weights
    from safemoe.fp8 import quantize_experts

    q13, q2, s13, s2 = quantize_experts(w13, w2, quant)
    return q13, q2, check_fp8_weights(q13, q2, s13, s2)


def incumbent_config(name: str, num_tokens: int, quant: str | None, device: torch.device) -> ExpertsConfig:
    """What `experts_triton` runs for this bucket today on `device` (table entry or heuristic)."""
    from safemoe.configs import get_config

    num_experts, top_k, hidden, inter = SHAPES[name]
    return get_config(num_tokens, num_experts, hidden, inter, top_k, torch.bfloat16, device, quant)


def heuristic_tiles(name: str, num_tokens: int, quant: str | None) -> ExpertsConfig:
    """The untuned tiles of this bucket (`heuristic_config`, or `heuristic_fp8_config` with block
    mode's K limit): a bucket without an entry of its own runs a neighbour's within an octave,
    which can be another regime's (fp8 Qwen3 T = 2048 would run T = 1024's 64-row tiles)."""
    from safemoe.configs import heuristic_config, heuristic_fp8_config, limit_block_k

    num_experts, top_k, hidden, inter = SHAPES[name]
    if quant is None:
        return heuristic_config(num_tokens, num_experts, hidden, inter, top_k, torch.bfloat16)
    cfg = heuristic_fp8_config(num_tokens, num_experts, hidden, inter, top_k, quant)
    return limit_block_k(cfg, FP8_BLOCK_K) if quant == "block" else cfg


def search_fused(incumbent: ExpertsConfig | None, num_tokens: int, top_k: int) -> bool:
    """Whether a bucket's candidates are timed fused: it takes the few-slot path fused
    (`fused_bucket`) and its incumbent is fused, or --search-fused asks for it (SEARCH_FUSED_ENV), so
    the tiles are searched as the bucket would run (the fused launch has one num_stages and
    occupancy for both GEMMs: its best tiles need not be the two launches'; H200 2026-12-02:
    gpt-oss T = 8 fused 31% slower with its entry's tiles, 1.8% faster with wider ones). The
    fused step after the search re-decides it for the winner."""
    if not fused_bucket(num_tokens, top_k):
        return False
    asked = os.environ.get(SEARCH_FUSED_ENV) == "1"
    return asked or (incumbent is not None and incumbent.fused)


def tune_case(case: Case, log: list[dict[str, Any]], deadline: float) -> tuple[ExpertsConfig, float] | None:
    """The incumbent (if any), coordinate descent per BLOCK_M (GEMM1 tiles, then GEMM2 tiles,
    then TMA for each), then the persistent grid's programs per SM; the fastest config (the
    leaders re-timed) that also checks out wins."""
    num_experts, top_k, _, _ = SHAPES[case.name]
    flags: dict[str, Any] = {"pdl": _pdl(case.num_tokens), "few": _few(case.num_tokens, case.quant),
                             "fused": search_fused(case.incumbent, case.num_tokens, top_k)}
    results: list[tuple[float, ExpertsConfig]] = []
    est: float | None = None

    def trial(cfg: ExpertsConfig, sweep: str) -> float | None:
        nonlocal est
        if time.time() > deadline:
            return None
        us = _timed(case, cfg, log, sweep, est)
        if us is not None:
            est = us if est is None else min(est, us)
            results.append((us, cfg))
        return us

    if case.incumbent is not None:
        trial(case.incumbent, "incumbent")
    if case.heuristic is not None and case.heuristic != case.incumbent:
        trial(case.heuristic, "heuristic")
    for block_m, g1s, g2s, group_m in regimes(case.num_tokens, num_experts, top_k, case.quant):
        base2 = _tiles(g2s[0], group_m)
        tried1 = [
            (trial(ExpertsConfig(block_m, _tiles(t, group_m, *v), base2, **flags), "gemm1"), t, v)
            for t in g1s for v in fp8_variants(case.quant, block_m, t)
        ]
        timed1 = [(us, t, v) for us, t, v in tried1 if us is not None]
        if not timed1:
            continue
        best1 = _tiles(min(timed1)[1], group_m, *min(timed1)[2])
        timed2 = [(min(timed1)[0], g2s[0], (False, False))]
        for t, v in [(t2, v2) for t2 in g2s for v2 in fp8_variants(case.quant, block_m, t2)]:
            if (t, v) == (g2s[0], (False, False)):
                continue
            us = trial(ExpertsConfig(block_m, best1, _tiles(t, group_m, *v), **flags), "gemm2")
            if us is not None:
                timed2.append((us, t, v))
        best2 = _tiles(min(timed2)[1], group_m, *min(timed2)[2])
        base = ExpertsConfig(block_m, best1, best2, **flags)
        base_us = min(timed2)[0]
        if fp8_per_candidate(case.quant, block_m):
            continue  # every candidate was timed with and without TMA
        tma1 = replace(base, gemm1=replace(best1, tma=True))
        tma2 = replace(base, gemm2=replace(best2, tma=True))
        us1, us2 = trial(tma1, "tma1"), trial(tma2, "tma2")
        if us1 is not None and us2 is not None and us1 < base_us and us2 < base_us:
            trial(replace(tma1, gemm2=tma2.gemm2), "tma12")
    if not results:
        return None
    results.sort(key=lambda r: r[0])
    if case.num_tokens >= 1024:
        for programs in (1, 2, 8):
            trial(replace(results[0][1], programs_per_sm=programs), "programs")
        results.sort(key=lambda r: r[0])
    results = confirm_ranking(results, lambda cfg: _timed(case, cfg, log, "confirm", est))
    if flags["few"] and case.num_tokens * top_k > FEW_SLOTS:
        # among near-equal full batches the one-row padded step decides (the incumbent competes)
        results = prefer_fast_padded_step(case, results, log)
    else:
        results = keep_incumbent(results, case.incumbent, case.replace_margin)
    case.ranked = results
    for us, cfg in results[:3]:
        if matches_reference(case, cfg, log):
            return cfg, us
    return None


def matches_reference(case: Case, cfg: ExpertsConfig, log: list[dict[str, Any]]) -> bool:
    """Whether `cfg` computes case's batch within CHECK_TOLERANCE (fp8: FP8_CHECK_TOLERANCE) of the
    reference; logged, and said when not."""
    tolerance = CHECK_TOLERANCE if case.fp8 is None else FP8_CHECK_TOLERANCE
    error = case.check(cfg)
    log.append({"shape": case.name, "T": case.num_tokens, "check": cfg.to_json(), "rel_error": error})
    if error < tolerance:
        return True
    print(f"  {case.name} T={case.num_tokens}: rejected (rel error {error:.3g}) {json.dumps(cfg.to_json())}")
    return False


def _timed(
    case: Case,
    cfg: ExpertsConfig,
    log: list[dict[str, Any]],
    sweep: str,
    est: float | None,
    small: ExpertsConfig | None = None,
    num_valid: int | None = None,
    few: ExpertsConfig | str | None = FROM_TABLE,
) -> float | None:
    entry: dict[str, Any] = {
        "shape": case.name,
        "T": case.num_tokens,
        "sweep": sweep,
        "config": cfg.to_json(),
    }
    if small is not None:
        entry["small"] = small.to_json()
    if num_valid is not None:
        entry["num_valid"] = num_valid
    extra: dict[str, Any] = {}
    if few != FROM_TABLE:
        extra["few"] = few
        entry["few"] = few.to_json() if isinstance(few, ExpertsConfig) else None
    try:
        entry["us"] = round(case.time(cfg, est_us=est, small=small, num_valid=num_valid, **extra), 3)
    except Exception as exc:
        entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        torch.cuda.synchronize()
    log.append(entry)
    return entry.get("us")


def check_dependents(name: str, w13: torch.Tensor, w2: torch.Tensor, case: Case, cfg: ExpertsConfig,
                     us: float, table: dict[int, ExpertsConfig], log: list[dict[str, Any]],
                     deadline: float, small_pin: ExpertsConfig | None = None
                     ) -> tuple[ExpertsConfig, float, dict[str, dict[str, float]] | None]:
    """(config, us, dependent timings) to write for case's bucket: the winner `cfg`, unless it
    replaces an incumbent whose tiles other buckets' padded steps also run (`dependents`) and one
    of those steps gets slower with it by more than ONE_LAUNCH_TOLERANCE, or cannot be timed: then
    the incumbent, with its own time from the bucket's ranking."""
    incumbent = case.incumbent
    if incumbent is None or cfg == incumbent:
        return cfg, us, None
    _, top_k, _, _ = SHAPES[name]
    bucket = token_bucket(case.num_tokens)

    def fallback(tokens: int) -> ExpertsConfig:
        return heuristic_tiles(name, tokens, case.quant)

    found = dependents(bucket, top_k, (incumbent, cfg), table, fallback, small_pin)
    if not found:
        return cfg, us, None
    timings = time_dependents(name, w13, w2, bucket, (incumbent, cfg), found, table, fallback, log, deadline,
                              fp8=case.fp8, small_pin=small_pin)
    if timings is not None and dependents_allow(timings):
        return cfg, us, timings
    incumbent_us = next((t for t, c in case.ranked if c == incumbent), None)
    if incumbent_us is None:
        return cfg, us, timings
    print(f"  {name} T={case.num_tokens}: the incumbent stays, a padded step it serves got slower with "
          f"the winner: {timings}", flush=True)
    return incumbent, incumbent_us, timings


def padded_steps_hold(case: Case, cfg: ExpertsConfig, us: float, log: list[dict[str, Any]], deadline: float
                      ) -> tuple[ExpertsConfig, float, dict[str, dict[str, float]] | None]:
    """(config, us, padded-step timings) to write for a bucket whose graph also replays padded
    decode steps (SMALL_BATCH_TOKENS < T <= PDL_MAX_TOKENS), bf16 or fp8: the winner `cfg`, unless
    it replaces the incumbent and the bucket's own padded steps (num_valid = SMALL_BATCH_TOKENS,
    the small tiles, and 1; the one-row step takes the table's few-slot tiles), timed with each
    config and its small tiles for ONE_LAUNCH_ROUNDS interleaved rounds, get slower by more than
    ONE_LAUNCH_TOLERANCE (`dependents_allow`) without a full-batch saving worth PADDED_TRADE times
    the loss (`padded_trade_allows`), or cannot be timed: then the first of `padded_hybrids` (the
    winner with one GEMM's tiles of the incumbent) that beats the incumbent's full batch by more
    than the replace margin and keeps those rules, else the incumbent, with its own time from the
    bucket's ranking. `prefer_fast_padded_step` only ranks the candidates within
    ONE_LAUNCH_TOLERANCE of the fastest full batch, never against the incumbent, and a full-batch
    winner alone slowed the padded steps twice on the H200: fp8 Qwen3 block T = 256 (2026-11-28:
    full batch -0.6%, 8 and 1 valid rows +1.1 / +2.5% in the layer) and bf16 Qwen3-Next T = 256
    (the wide search of 2026-11-28, session 20: full batch -1.7%, 8 and 1 valid rows +1.6 / +16.9%
    in the layer, `ab_entry.py`)."""
    incumbent = case.incumbent
    if (incumbent is None or cfg == incumbent
            or not SMALL_BATCH_TOKENS < case.num_tokens <= PDL_MAX_TOKENS):
        return cfg, us, None
    incumbent_us = next((t for t, c in case.ranked if c == incumbent), None)
    if incumbent_us is None:  # not timed among the candidates: nothing to fall back on
        return cfg, us, None
    timings = _padded_steps(case, incumbent, cfg, "padded_{name}", log, deadline)
    if timings is not None and _padded_steps_allow(timings, incumbent_us - us):
        return cfg, us, timings
    if timings is not None:
        for hybrid in padded_hybrids(incumbent, cfg):
            kept = _hybrid_holds(case, incumbent, hybrid, log, deadline)
            if kept is not None:
                print(f"  {case.name} T={case.num_tokens}: the winner's padded steps got slower ({timings}); "
                      f"kept instead: {json.dumps(hybrid.to_json())}", flush=True)
                return hybrid, kept[0], kept[1]
    why = ("its padded steps got slower with the winner" if timings is not None
           else "its padded steps could not be timed (budget spent or a timing failed)")
    print(f"  {case.name} T={case.num_tokens}: the incumbent stays, {why}: {timings}", flush=True)
    return incumbent, incumbent_us, timings


def _padded_steps(case: Case, incumbent: ExpertsConfig, other: ExpertsConfig, label: str,
                  log: list[dict[str, Any]], deadline: float) -> dict[str, dict[str, float]] | None:
    """{"num_valid=N": {"incumbent": us, "winner": us}} of the bucket's padded steps (N =
    SMALL_BATCH_TOKENS and 1) with `incumbent` and `other` and their small tiles, interleaved;
    None when one could not be timed."""
    sides = {"incumbent": incumbent, "winner": other}
    timings: dict[str, dict[str, float]] = {}
    for num_valid in (SMALL_BATCH_TOKENS, 1):
        medians = time_candidates(case, sides, label, log, deadline, None, num_valid=num_valid,
                                  small=lambda side_cfg: padded_step_small(case, side_cfg))
        if medians is None:
            return None
        timings[f"num_valid={num_valid}"] = medians
    return timings


def _padded_steps_allow(timings: dict[str, dict[str, float]], saved_us: float) -> bool:
    return dependents_allow(timings) or padded_trade_allows(saved_us, timings)


def padded_hybrids(incumbent: ExpertsConfig, winner: ExpertsConfig) -> list[ExpertsConfig]:
    """The winner with one GEMM's tiles of the incumbent (GEMM2's first), when both run the same
    M-blocks: `padded_steps_hold` tries them when the winner's padded steps got slower. H200
    2026-11-28, Qwen3-Next T = 256: the wide search's winner (GEMM1 128 columns, GEMM2 128 x 128)
    made the one-row step 17% slower; with the incumbent's GEMM1 it was 1.2% faster on the full
    batch and no slower padded (layer A/B, written by hand that session)."""
    if incumbent.block_m != winner.block_m:
        return []
    hybrids = []
    for gemm in ("gemm1", "gemm2"):
        try:
            hybrid = (replace(winner, gemm1=incumbent.gemm1) if gemm == "gemm1"
                      else replace(winner, gemm2=incumbent.gemm2))
        except ValueError:  # a pairing ExpertsConfig refuses (its checks are per GEMM today)
            continue
        if hybrid not in (winner, incumbent):
            hybrids.append(hybrid)
    return hybrids


def _hybrid_holds(case: Case, incumbent: ExpertsConfig, hybrid: ExpertsConfig, log: list[dict[str, Any]],
                  deadline: float) -> tuple[float, dict[str, dict[str, float]]] | None:
    """(full-batch us, timings) when `hybrid` beats the incumbent by more than case.replace_margin
    on the full batch (interleaved rounds), matches the reference and keeps the padded steps by
    `padded_steps_hold`'s rules; else None."""
    sides = {"incumbent": incumbent, "winner": hybrid}
    full = time_candidates(case, sides, "hybrid_{name}", log, deadline, None)
    if full is None or full["winner"] >= full["incumbent"] * (1.0 - case.replace_margin):
        return None
    if not matches_reference(case, hybrid, log):
        return None
    steps = _padded_steps(case, incumbent, hybrid, "padded_hybrid_{name}", log, deadline)
    if steps is None or not _padded_steps_allow(steps, full["incumbent"] - full["winner"]):
        return None
    return full["winner"], {"full_batch": full, **steps}


def time_dependents(name: str, w13: torch.Tensor, w2: torch.Tensor, bucket: int,
                    sources: tuple[ExpertsConfig, ExpertsConfig], found: list[Dependent],
                    table: dict[int, ExpertsConfig], fallback: Callable[[int], ExpertsConfig],
                    log: list[dict[str, Any]], deadline: float, fp8: Any = None,
                    small_pin: ExpertsConfig | None = None) -> dict[str, dict[str, float]] | None:
    """{step: {"incumbent": us, "winner": us}}: each dependent padded step timed with `bucket`'s
    entry as sources[0] (the incumbent) and sources[1] (the winner), ONE_LAUNCH_ROUNDS interleaved
    rounds, medians; None when the budget runs out or a timing fails. fp8: the Fp8Weights of
    w13 / w2 when they are fp8 (the steps then run the fp8 path, as the tuned bucket's did)."""
    _, top_k, _, _ = SHAPES[name]
    result: dict[str, dict[str, float]] = {}
    for dep in found:
        case = Case(name, w13, w2, dep.bucket, fp8=fp8)
        est = estimate_us(name, dep.num_valid)
        tiles = [tiles_with({**table, bucket: source}, dep.config, dep.bucket, top_k, fallback, small_pin)
                 for source in sources]
        times: dict[str, list[float]] = {"incumbent": [], "winner": []}
        for _ in range(ONE_LAUNCH_ROUNDS):
            for side, (small, few) in zip(times, tiles, strict=True):
                if time.time() > deadline:
                    return None
                us = _timed(case, dep.config, log, f"dependent_{side}", est, small=small,
                            num_valid=dep.num_valid, few=few)
                if us is None:
                    return None
                times[side].append(us)
        result[f"T={dep.bucket} num_valid={dep.num_valid}"] = {
            side: round(statistics.median(v), 2) for side, v in times.items()
        }
        del case
    return result


def decide_one_launch(
    case: Case,
    cfg: ExpertsConfig,
    small: ExpertsConfig,
    log: list[dict[str, Any]],
    deadline: float,
) -> tuple[bool, dict[str, dict[str, float]]] | None:
    """(one_launch, median us of each side) for `cfg` at case's T with `small` as its small-batch
    tiles: ONE_LAUNCH_ROUNDS interleaved rounds of a full batch and two padded decode steps
    (ONE_LAUNCH_PADDED_ROWS and ONE_LAUNCH_ONE_ROW valid rows of T, the same graph), each with the
    small tiles in a second launch and merged. None when the budget runs out or a timing fails
    (the caller then leaves one_launch off)."""
    rows = ONE_LAUNCH_PADDED_ROWS
    batches = (
        ("full_batch", None, cfg.extra.get("us")),
        ("padded_decode", rows, estimate_us(case.name, rows)),
        ("padded_one_row", ONE_LAUNCH_ONE_ROW, estimate_us(case.name, ONE_LAUNCH_ONE_ROW)),
    )
    times: dict[tuple[str, bool], list[float]] = {}
    for _ in range(ONE_LAUNCH_ROUNDS):
        for batch, num_valid, est in batches:
            for merged in (False, True):
                if time.time() > deadline:
                    return None
                variant = replace(cfg, one_launch=merged)
                us = _timed(
                    case, variant, log, "one_launch", est, small=small, num_valid=num_valid or case.num_tokens
                )
                if us is None:
                    return None
                times.setdefault((batch, merged), []).append(us)
    med = {k: statistics.median(v) for k, v in times.items()}
    choice = choose_one_launch(
        med["full_batch", False],
        med["full_batch", True],
        med["padded_decode", False] + med["padded_one_row", False],
        med["padded_decode", True] + med["padded_one_row", True],
    )
    summary = {
        batch: {"two_launches": round(med[batch, False], 2), "one_launch": round(med[batch, True], 2)}
        for batch, _, _ in batches
    }
    return choice, summary


OneLaunchPlan = dict[int, tuple[ExpertsConfig, ExpertsConfig]]  # {bucket: (config, small config)}


def one_launch_targets(
    name: str, configs: dict[int, ExpertsConfig], device: torch.device, buckets: set[int] | None = None,
    small_pin: ExpertsConfig | None = None
) -> OneLaunchPlan:
    """The buckets of `configs` whose one_launch is timed (`one_launch_plan` with the device's
    config for SMALL_BATCH_TOKENS tokens as the fallback small config, or the shape's "small_batch"
    entry `small_pin`; only `buckets` when given)."""
    fallback = small_batch_source(name, {}, device)
    return {
        bucket: (configs[bucket], small)
        for bucket, small in one_launch_plan(configs, fallback, small_pin).items()
        if buckets is None or bucket in buckets
    }


def precompile_one_launch(plans: dict[str, OneLaunchPlan], jobs: int) -> None:
    """Both one_launch variants of every planned bucket, compiled in parallel worker processes."""
    tasks = [task for name, plan in plans.items() for task in one_launch_tasks(name, plan)]
    if not tasks:
        return
    started = time.time()
    failures = precompile(tasks, jobs)
    print(f"one_launch kernels of {len(tasks)} buckets compiled in {time.time() - started:.0f} s")
    for line in failures[:20]:
        print("  ", line)


Decision = TypeVar("Decision")


def decide_per_bucket(name: str, w13: torch.Tensor, w2: torch.Tensor, buckets: list[int], what: str,
                      decide: Callable[[Case], Decision | None], fp8: Any = None) -> dict[int, Decision]:
    """decide(case) for a Case at T = each bucket (fp8: the Fp8Weights of fp8 w13 and w2); a
    bucket whose decision could not be measured (budget spent, a timing failed) is reported and
    left out (its flag stays off)."""
    decided: dict[int, Decision] = {}
    for bucket in buckets:
        case = Case(name, w13, w2, bucket, fp8=fp8)
        result = decide(case)
        del case
        if result is None:
            print(f"  {name} T={bucket}: {what} not measured (budget spent or a timing failed): left off")
            continue
        decided[bucket] = result
    return decided


def run_one_launch(
    name: str,
    w13: torch.Tensor,
    w2: torch.Tensor,
    plan: OneLaunchPlan,
    log: list[dict[str, Any]],
    deadline: float,
) -> dict[int, tuple[bool, dict[str, dict[str, float]]]]:
    """one_launch decided for each bucket of `plan` (its config's extra "us", when there, sizes the
    full-batch timing loops), timed at T = the bucket."""
    decided = decide_per_bucket(
        name, w13, w2, list(plan), "one_launch",
        lambda case: decide_one_launch(case, *plan[case.num_tokens], log, deadline))
    for bucket, (choice, timings) in decided.items():
        full, padded = timings["full_batch"], timings["padded_decode"]
        print(
            f"  {name} T={bucket}: one_launch={choice}  padded decode "
            f"{padded['two_launches']:.1f} -> {padded['one_launch']:.1f} us, full batch "
            f"{full['two_launches']:.1f} -> {full['one_launch']:.1f} us "
            f"({full['one_launch'] / full['two_launches'] - 1:+.1%})",
            flush=True,
        )
    return decided


def fused_buckets(configs: dict[int, ExpertsConfig], top_k: int) -> list[int]:
    """The buckets of `configs` whose `fused` is timed: every call takes the few-slot path there
    (T*K <= FEW_SLOTS) or would, fused (`fused_bucket`), the path not turned off."""
    return [bucket for bucket in sorted(configs) if fused_bucket(bucket, top_k) and configs[bucket].few]


def choose_fused(two_launches_us: float, fused_us: float, margin: float = FUSED_MARGIN) -> bool:
    return fused_us < two_launches_us * (1 - margin)


def decide_fused(case: Case, cfg: ExpertsConfig, log: list[dict[str, Any]],
                 deadline: float) -> tuple[bool, dict[str, float]] | None:
    """(fused, median us of each side) for `cfg` at case's T: ONE_LAUNCH_ROUNDS interleaved rounds
    of the two launches and the fused one. None when the budget runs out or a timing fails."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(ONE_LAUNCH_ROUNDS):
        for fused in (False, True):
            if time.time() > deadline:
                return None
            us = _timed(case, replace(cfg, fused=fused), log, "fused", cfg.extra.get("us"))
            if us is None:
                return None
            times[fused].append(us)
    med = {fused: statistics.median(v) for fused, v in times.items()}
    return choose_fused(med[False], med[True]), {"two_launches": round(med[False], 2),
                                                 "fused": round(med[True], 2)}


def fused_dependents_hold(name: str, w13: torch.Tensor, w2: torch.Tensor, bucket: int, cfg: ExpertsConfig,
                          choice: bool, configs: dict[int, ExpertsConfig], log: list[dict[str, Any]],
                          deadline: float) -> tuple[bool, dict[str, dict[str, float]] | None]:
    """(whether `bucket`'s entry may go from cfg.fused to `choice`, dependent timings): a bucket
    whose entry also gives larger buckets their few-slot tiles (`dependents`: few_slots_bucket(K),
    or a bucket its entry serves by the nearest-bucket rule) moves their padded steps onto or off
    the fused launch ahead of their GEMMs, so the flip holds only if no such step gets slower by
    more than ONE_LAUNCH_TOLERANCE (`time_dependents`, `dependents_allow`). H200 2026-12-02: gpt-oss
    T = 8 fused (-3.3% on its own) also served T = 4, few_slots_bucket(4), and its T = 1024 one-row
    step went 63.5 -> 77.1 us. Not timed (budget spent, a timing failed): the flag stays."""
    if choice == cfg.fused:
        return True, None

    def fallback(tokens: int) -> ExpertsConfig:
        return heuristic_tiles(name, tokens, None)

    sources = (cfg, replace(cfg, fused=choice))
    # only the one-row steps: the flag means nothing to a larger bucket's small-batch tiles
    found = [dep for dep in dependents(bucket, SHAPES[name][1], sources, configs, fallback)
             if dep.num_valid == ONE_LAUNCH_ONE_ROW]
    if not found:
        return True, None
    timings = time_dependents(name, w13, w2, bucket, sources, found, configs, fallback, log, deadline)
    return timings is not None and dependents_allow(timings), timings


def run_fused(name: str, w13: torch.Tensor, w2: torch.Tensor, configs: dict[int, ExpertsConfig],
              log: list[dict[str, Any]], deadline: float, table: dict[int, ExpertsConfig] | None = None
              ) -> dict[int, tuple[bool, dict[str, Any]]]:
    """`fused` decided for each of `fused_buckets(configs)`, timed at T = the bucket; a change of
    the flag that slows a padded step the entry serves is not taken (`fused_dependents_hold` over
    `table`, the shape's other entries, with `configs` over it; its timings under "dependents")."""
    whole = {**(table or {}), **configs}
    decided = decide_per_bucket(name, w13, w2, fused_buckets(configs, SHAPES[name][1]), "fused",
                                lambda case: decide_fused(case, configs[case.num_tokens], log, deadline))
    result: dict[int, tuple[bool, dict[str, Any]]] = {}
    for bucket, (choice, med) in decided.items():
        cfg = configs[bucket]
        holds, timings = fused_dependents_hold(name, w13, w2, bucket, cfg, choice, whole, log, deadline)
        record: dict[str, Any] = dict(med)
        if timings is not None:
            record["dependents"] = timings
        if not holds:
            print(f"  {name} T={bucket}: fused stays {cfg.fused}, a padded step the entry serves got "
                  f"slower or was not timed: {timings}", flush=True)
            choice = cfg.fused
        print(f"  {name} T={bucket}: fused={choice}  {med['two_launches']:.1f} -> {med['fused']:.1f} us "
              f"({med['fused'] / med['two_launches'] - 1:+.1%})", flush=True)
        result[bucket] = (choice, record)
    return result


def interleave_candidates(cfg: ExpertsConfig) -> dict[str, ExpertsConfig]:
    """The entry and its GEMM1 interleaved, weights through pointers and through TMA (an
    [E, I, 2, H] view), each at the entry's stages and at one fewer."""
    candidates = {"entry": cfg}
    for tma in (False, True):
        for stages in sorted({cfg.gemm1.num_stages, max(2, cfg.gemm1.num_stages - 1)}, reverse=True):
            gemm1 = replace(cfg.gemm1, tma=tma, interleave=True, num_stages=stages)
            candidates[f"interleave{'_tma' if tma else ''}_s{stages}"] = replace(cfg, gemm1=gemm1)
    return candidates


def choose_over_entry(medians: dict[str, float], margin: float) -> str:
    """The fastest candidate's name, or "entry" unless it beats the entry by more than `margin`."""
    best = min(medians, key=lambda name: medians[name])
    return best if medians[best] < medians["entry"] * (1 - margin) else "entry"


def choose_interleave(medians: dict[str, float], margin: float = INTERLEAVE_MARGIN) -> str:
    """`choose_over_entry` with the interleave margin."""
    return choose_over_entry(medians, margin)


def engine_candidates(cfg: ExpertsConfig) -> dict[str, ExpertsConfig]:
    """The entry, the Triton GEMM2 if the entry runs a Gluon one, and each of ENGINE_VARIANTS at
    256 x 64 tiles, 8 warps (none where block_m is not 128: the engine's tiles are 128 rows)."""
    candidates = {"entry": cfg}
    if cfg.gemm2.engine != "triton":
        candidates["triton"] = replace(cfg, gemm2=replace(cfg.gemm2, engine="triton"))
    if cfg.block_m != 128:
        return candidates
    for engine, stages in ENGINE_VARIANTS:
        tiles = replace(cfg.gemm2, block_n=256, block_k=64, num_warps=8, num_stages=stages, engine=engine)
        candidate = replace(cfg, gemm2=tiles)
        if candidate != cfg:
            candidates[f"{engine}_s{stages}"] = candidate
    return candidates


def choose_engine(medians: dict[str, float], margin: float = ENGINE_MARGIN) -> str:
    """`choose_over_entry` with the engine margin."""
    return choose_over_entry(medians, margin)


def time_candidates(case: Case, candidates: dict[str, ExpertsConfig], label: str, log: list[dict[str, Any]],
                    deadline: float, est_us: float | None, *, num_valid: int | None = None,
                    small: Callable[[ExpertsConfig], ExpertsConfig | None] | None = None
                    ) -> dict[str, float] | None:
    """Median us of each candidate at case's T (with `num_valid` valid rows, and `small(candidate)`
    as its small-batch tiles, when given) over ONE_LAUNCH_ROUNDS interleaved rounds; None when the
    budget runs out or a timing fails. `label` names the log's sweep ("{name}" in it: the
    candidate's name)."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(ONE_LAUNCH_ROUNDS):
        for name, candidate in candidates.items():
            if time.time() > deadline:
                return None
            us = _timed(case, candidate, log, label.format(name=name), est_us,
                        small=small(candidate) if small is not None else None, num_valid=num_valid)
            if us is None:
                return None
            times[name].append(us)
    return {name: round(statistics.median(v), 2) for name, v in times.items()}


def decide_interleave(case: Case, cfg: ExpertsConfig, log: list[dict[str, Any]],
                      deadline: float) -> tuple[ExpertsConfig, dict[str, float]] | None:
    """(config kept, median us of each candidate) at case's T: ONE_LAUNCH_ROUNDS interleaved rounds
    of `interleave_candidates(cfg)`. None when the budget runs out or a timing fails."""
    candidates = interleave_candidates(cfg)
    med = time_candidates(case, candidates, "interleave", log, deadline, cfg.extra.get("us"))
    return None if med is None else (candidates[choose_interleave(med)], med)


def programs_candidates(cfg: ExpertsConfig) -> dict[str, ExpertsConfig]:
    """The entry and the entry at each of PROGRAMS_CANDIDATES programs per SM (its own left out)."""
    candidates = {"entry": cfg}
    for programs in PROGRAMS_CANDIDATES:
        if programs != cfg.programs_per_sm:
            candidates[f"programs_{programs}"] = replace(cfg, programs_per_sm=programs)
    return candidates


def programs_buckets(entries: dict[str, Any], top_k: int, chosen: set[int] | None) -> list[int]:
    """The buckets --programs-only times: with --tokens those (any size), else the decode entries
    above SMALL_BATCH_TOKENS (a dispatch layout; a few-slot bucket's grid is one tile a program
    already) below PROGRAMS_MAX_TOKENS. The SMALL_BATCH_TOKENS bucket is left to --tokens: its
    config is also the small-batch regime of every larger merged launch, whose grid is the largest
    of its regimes', so its grid size would change those buckets' full batches too."""
    buckets = [int(b) for b in entries]
    if chosen is not None:
        return sorted(b for b in buckets if b in chosen)
    return sorted(b for b in buckets
                  if SMALL_BATCH_TOKENS < b < PROGRAMS_MAX_TOKENS and b * top_k > FEW_SLOTS)


def decide_programs(name: str, w13: torch.Tensor, w2: torch.Tensor, case: Case, cfg: ExpertsConfig,
                    table: dict[int, ExpertsConfig], log: list[dict[str, Any]], deadline: float,
                    small_pin: ExpertsConfig | None = None) -> tuple[ExpertsConfig, dict[str, Any]] | None:
    """(config kept, {candidate: median us}, plus the dependent padded steps' timings when the
    bucket's tiles also run larger buckets' steps) at case's T. The fastest grid size wins when
    it beats the entry by more than PROGRAMS_MARGIN and leaves those steps within
    ONE_LAUNCH_TOLERANCE (`check_dependents`; `small_pin`, the shape's "small_batch" entry, serves
    the small-batch steps). None when the budget runs out or a timing fails."""
    candidates = programs_candidates(cfg)
    med = time_candidates(case, candidates, "programs", log, deadline, cfg.extra.get("us"))
    if med is None:
        return None
    best = choose_over_entry(med, PROGRAMS_MARGIN)
    record: dict[str, Any] = dict(med)
    if best == "entry":
        return cfg, record
    case.incumbent = cfg
    case.ranked = [(med[n], c) for n, c in candidates.items()]
    kept, _, timings = check_dependents(name, w13, w2, case, candidates[best], med[best], table, log,
                                        deadline, small_pin)
    if timings is not None:
        record["dependents"] = timings
    return kept, record


def _device_table() -> tuple[torch.device, str, Path, dict[str, Any]]:
    """(device, its name, its device file, that file's "configs") for the *-only runs, which
    re-decide one field of the table's entries."""
    device = torch.device("cuda", torch.cuda.current_device())
    device_name = torch.cuda.get_device_name(device)
    path = device_file(device_name)
    return device, device_name, path, json.loads(path.read_text()).get("configs", {}) if path.exists() else {}


def _shape_entries(table: dict[str, Any], name: str, quant: str | None = None) -> tuple[str, dict[str, Any]]:
    """(the shape's bf16 key, or its fp8 `quant` key, and its entries in the device table's
    "configs")."""
    num_experts, top_k, hidden, inter = SHAPES[name]
    key = shape_key(num_experts, hidden, inter, top_k, torch.bfloat16, quant)
    return key, table.get(key, {})


def missing_buckets(tokens: tuple[int, ...], entries: dict[str, Any]) -> tuple[int, ...]:
    """The T of `tokens` whose bucket has no entry in `entries` (a shape's part of the device
    table, keyed by bucket strings), each bucket once: such a T runs the nearest bucket's tiles,
    which cost DeepSeek-V3 and gpt-oss T = 512 17-24% and DeepSeek-V3 T = 2048 14% in the H200
    layer (2026-11-28)."""
    found: dict[int, int] = {}
    for num_tokens in tokens:
        bucket = token_bucket(num_tokens)
        if str(bucket) not in entries and bucket not in found:
            found[bucket] = num_tokens
    return tuple(found.values())


def _table_only_state(args: argparse.Namespace
                      ) -> tuple[set[int] | None, float, list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """(the buckets --tokens names, or None; the timing deadline; an empty timing log; empty
    winners {key: {bucket: entry}}) of a run that re-decides one field of the table's entries."""
    chosen = {token_bucket(int(t)) for t in args.tokens.split(",")} if args.tokens else None
    return chosen, time.time() + args.budget_s, [], {}


def _table_buckets(entries: dict[str, Any], chosen: set[int] | None, min_tokens: int) -> list[int]:
    """A shape's table buckets a --*-only run decides: those --tokens names, else min_tokens and up."""
    return sorted(int(b) for b in entries if (int(b) >= min_tokens if chosen is None else int(b) in chosen))


def _decide_entries(name: str, device: torch.device, entries: dict[str, Any], buckets: list[int], what: str,
                    decide_one: Callable[[Case, ExpertsConfig], Decision | None],
                    quant: str | None = None) -> dict[int, Decision]:
    """decide_one(case, the bucket's entry) for each bucket of a shape, on stand-in weights made once
    (quant: quantised to fp8 of that mode, every Case carrying them)."""
    w13, w2 = make_weights(name, device)
    fp8 = None
    if quant is not None:
        w13, w2, fp8 = quantize_weights(w13, w2, quant)
    configs = {b: ExpertsConfig.from_json(entries[str(b)]) for b in buckets}
    decided = decide_per_bucket(name, w13, w2, buckets, what,
                                lambda case: decide_one(case, configs[case.num_tokens]), fp8)
    del w13, w2
    torch.cuda.empty_cache()
    return decided


def interleave_only(args: argparse.Namespace, names: list[str], start: float) -> int:
    """--interleave-only: GEMM1's interleave decided for the device table's bf16 entries (with
    --quant per_tensor: its fp8 per-tensor entries, timed on quantised stand-in weights) of at
    least INTERLEAVE_MIN_TOKENS tokens (--tokens: those buckets, any size), every other field kept."""
    device, device_name, path, table = _device_table()
    chosen, deadline, log, winners = _table_only_state(args)
    for name in names:
        key, entries = _shape_entries(table, name, args.quant)
        buckets = _table_buckets(entries, chosen, INTERLEAVE_MIN_TOKENS)
        print(f"{name}: interleave timed at T = {buckets} ({key} in {path})", flush=True)
        decided = _decide_entries(name, device, entries, buckets, "interleave",
                                  lambda case, cfg: decide_interleave(case, cfg, log, deadline), args.quant)
        for bucket, (kept, med) in decided.items():
            entry = {**entries[str(bucket)], "gemm1": kept.to_json()["gemm1"], "interleave_us": med}
            winners.setdefault(key, {})[str(bucket)] = entry
            verdict = f"interleave, {kept.gemm1.num_stages} stages" if kept.gemm1.interleave else "kept"
            timings = ", ".join(f"{n} {us:.1f}" for n, us in med.items())
            print(f"  {name} T={bucket}: {timings} us -> GEMM1 {verdict}", flush=True)

    method = ("scripts/tune_experts.py --interleave-only: the table's tiles, GEMM1 interleaved at the "
              "entry's stages and one fewer, full batches under CUDA-graph replay, medians of "
              f"{ONE_LAUNCH_ROUNDS} interleaved rounds (interleave_us), kept when faster by more than "
              f"{INTERLEAVE_MARGIN:.0%}")
    what = "interleave" if args.quant is None else f"fp8_{args.quant}_interleave"
    if args.quant is not None:
        method += f"; fp8 {args.quant} weights (quantize_experts of the stand-in bf16 ones)"
    return _finish_table_only(args, device_name, what, method, winners, log, start)


def decide_engine(case: Case, cfg: ExpertsConfig, log: list[dict[str, Any]],
                  deadline: float) -> tuple[ExpertsConfig, dict[str, float]] | None:
    """(config kept, median us of each candidate) at case's T: ONE_LAUNCH_ROUNDS interleaved rounds
    of `engine_candidates(cfg)`; the entry unchanged, untimed, when it has no candidate. None when
    the budget runs out or a timing fails."""
    candidates = engine_candidates(cfg)
    if len(candidates) == 1:
        return cfg, {}
    med = time_candidates(case, candidates, "engine", log, deadline, cfg.extra.get("us"))
    return None if med is None else (candidates[choose_engine(med)], med)


def engine_only(args: argparse.Namespace, names: list[str], start: float) -> int:
    """--engine-only: GEMM2's engine decided for the device table's bf16 entries of at least
    ENGINE_MIN_TOKENS tokens (--tokens: those buckets, any size), every other field kept."""
    if torch.cuda.get_device_capability() != (9, 0):
        print("--engine-only: the Gluon GEMM2 runs on sm_90 GPUs (H100/H200) only")
        return 1
    device, device_name, path, table = _device_table()
    chosen, deadline, log, winners = _table_only_state(args)
    for name in names:
        key, entries = _shape_entries(table, name)
        buckets = _table_buckets(entries, chosen, ENGINE_MIN_TOKENS)
        print(f"{name}: GEMM2 engine timed at T = {buckets} ({key} in {path})", flush=True)
        decided = _decide_entries(name, device, entries, buckets, "engine",
                                  lambda case, cfg: decide_engine(case, cfg, log, deadline))
        for bucket, (kept, med) in decided.items():
            if not med:
                print(f"  {name} T={bucket}: block_m {kept.block_m}, no engine candidate", flush=True)
                continue
            entry = {**entries[str(bucket)], "gemm2": kept.to_json()["gemm2"], "gemm2_engine_us": med}
            winners.setdefault(key, {})[str(bucket)] = entry
            verdict = f"{kept.gemm2.engine}, {kept.gemm2.num_stages} stages"
            timings = ", ".join(f"{n} {us:.1f}" for n, us in med.items())
            print(f"  {name} T={bucket}: {timings} us -> GEMM2 {verdict}", flush=True)

    method = ("scripts/tune_experts.py --engine-only: the table's tiles, GEMM2 as the Gluon engine "
              f"{ENGINE_VARIANTS} at 256 x 64 tiles against the entry, full batches under CUDA-graph "
              f"replay, medians of {ONE_LAUNCH_ROUNDS} interleaved rounds (gemm2_engine_us), kept when "
              f"faster by more than {ENGINE_MARGIN:.0%}")
    return _finish_table_only(args, device_name, "engine", method, winners, log, start)


def programs_only(args: argparse.Namespace, names: list[str], start: float) -> int:
    """--programs-only: programs_per_sm decided for the device table's bf16 decode entries
    (`programs_buckets`), every other field kept."""
    device, device_name, path, table = _device_table()
    chosen, deadline, log, winners = _table_only_state(args)
    for name in names:
        _, top_k, _, _ = SHAPES[name]
        key, entries = _shape_entries(table, name)
        buckets = programs_buckets(entries, top_k, chosen)
        print(f"{name}: programs_per_sm timed at T = {buckets} ({key} in {path})", flush=True)
        if not buckets:
            continue
        w13, w2 = make_weights(name, device)
        configs = {int(b): ExpertsConfig.from_json(data) for b, data in entries.items()}
        small_pin = load_small_batch_configs(device_name).get(key)
        for bucket in buckets:
            case = Case(name, w13, w2, bucket)
            decided = decide_programs(name, w13, w2, case, configs[bucket], configs, log, deadline, small_pin)
            del case
            if decided is None:
                print(f"  {name} T={bucket}: programs_per_sm not measured (budget spent or a timing "
                      "failed): kept")
                continue
            kept, record = decided
            configs[bucket] = kept  # a later bucket's dependents see this one's grid
            winners.setdefault(key, {})[str(bucket)] = {
                **entries[str(bucket)], "programs_per_sm": kept.programs_per_sm, "programs_us": record}
            timings = ", ".join(f"{n} {us:.1f}" for n, us in record.items() if n != "dependents")
            print(f"  {name} T={bucket}: {timings} us -> {kept.programs_per_sm} programs per SM"
                  + (f"; dependents {record['dependents']}" if "dependents" in record else ""), flush=True)
        del w13, w2
        torch.cuda.empty_cache()

    method = ("scripts/tune_experts.py --programs-only: the table's tiles, programs_per_sm of "
              f"{PROGRAMS_CANDIDATES} against the entry's, full batches under CUDA-graph replay, medians of "
              f"{ONE_LAUNCH_ROUNDS} interleaved rounds (programs_us), kept when faster by more than "
              f"{PROGRAMS_MARGIN:.0%} with the padded steps that run the bucket's tiles within "
              f"{ONE_LAUNCH_TOLERANCE:.0%}")
    return _finish_table_only(args, device_name, "programs", method, winners, log, start)


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                        help=f"comma-separated, of {', '.join(SHAPES)} (default {DEFAULT_SHAPES})")
    parser.add_argument("--tokens", default="", help="comma-separated T values (default: per shape)")
    parser.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop timing new configs after this")
    parser.add_argument(
        "--write", action="store_true", help="merge winners into src/safemoe/configs/<device>.json"
    )
    parser.add_argument(
        "--breakdown", action="store_true", help="time dispatch/GEMM1/GEMM2/combine of winners"
    )
    parser.add_argument("--no-precompile", action="store_true")
    parser.add_argument("--precompile-only", action="store_true", help="fill Triton's cache, time nothing")
    parser.add_argument("--quick", action="store_true", help="fewer token counts per shape")
    parser.add_argument(
        "--no-one-launch", action="store_true", help="do not time one_launch (winners get one_launch off)"
    )
    parser.add_argument(
        "--wide", action="store_true", help="more tile candidates per regime (WIDE_*: ~twice the timings)"
    )
    parser.add_argument(
        "--one-launch-only",
        action="store_true",
        help="re-decide one_launch of the device table's entries (--tokens: those buckets), tiles kept",
    )
    parser.add_argument("--no-fused", action="store_true",
                        help="do not time fused (few-slot winners get fused off)")
    parser.add_argument("--search-fused", action="store_true",
                        help="time the candidates of the buckets that can run fused (up to 64 slots) "
                             "fused, whatever their incumbent")
    parser.add_argument("--interleave-only", action="store_true",
                        help="decide GEMM1's interleave for the device table's prefill entries (--tokens: "
                        "those buckets), other fields kept")
    parser.add_argument("--programs-only", action="store_true",
                        help="decide programs_per_sm for the device table's decode entries (--tokens: those "
                        "buckets), other fields kept")
    parser.add_argument("--engine-only", action="store_true",
                        help="decide GEMM2's engine (Triton or the Gluon kernel) for the device table's "
                        "prefill entries (--tokens: those buckets), other fields kept")
    parser.add_argument("--fused-only", action="store_true",
                        help="re-decide fused of the device table's few-slot entries (--tokens: those "
                        "buckets), tiles kept")
    parser.add_argument(
        "--replace-margin", type=float, default=REPLACE_MARGIN,
        help=f"a winner replaces a bucket's incumbent only when faster by more than this fraction "
        f"(default {REPLACE_MARGIN})",
    )
    parser.add_argument(
        "--missing", action="store_true",
        help="tune only the buckets (of --tokens or the defaults) the device table has no entry for",
    )
    parser.add_argument(
        "--quant", choices=QUANT_MODES, default=None,
        help="tune for fp8 weights of this mode (the shapes' _fp8-{quant} keys; one_launch not timed)",
    )
    args = parser.parse_args(argv)
    if args.one_launch_only and args.no_one_launch:
        parser.error("--one-launch-only and --no-one-launch exclude each other")
    if args.one_launch_only and args.quant:
        parser.error("--one-launch-only re-decides bf16 entries; --quant tunes without one_launch")
    if args.fused_only and (args.one_launch_only or args.no_fused or args.quant):
        parser.error("--fused-only re-decides fused alone, for bf16 entries")
    if args.programs_only and (args.one_launch_only or args.fused_only or args.interleave_only or args.quant):
        parser.error("--programs-only decides programs_per_sm alone, for bf16 entries")
    if args.engine_only and (args.one_launch_only or args.fused_only or args.interleave_only
                             or args.programs_only or args.quant):
        parser.error("--engine-only decides GEMM2's engine alone, for bf16 entries")
    only = (args.one_launch_only, args.fused_only, args.interleave_only, args.programs_only, args.engine_only)
    if args.missing and any(only):
        parser.error("--missing picks the buckets a search tunes; the *-only runs re-decide existing entries")
    if args.interleave_only and args.quant == "block":
        parser.error("--interleave-only: fp8 block mode runs GEMM1 without interleave (bf16 and per_tensor)")
    if args.search_fused and (args.no_fused or args.quant or any(only)):
        parser.error("--search-fused searches tiles fused in a bf16 tune that decides fused")
    names = [n for n in args.shapes.split(",") if n]
    unknown = [n for n in names if n not in SHAPES]
    if unknown or not names:
        parser.error(f"--shapes: unknown {unknown or args.shapes!r}; known: {', '.join(SHAPES)}")
    if not torch.cuda.is_available():
        print("tune_experts needs a CUDA GPU")
        return 0
    if args.wide:
        os.environ[WIDE_ENV] = "1"  # before the precompile workers start
    if args.search_fused:
        os.environ[SEARCH_FUSED_ENV] = "1"
    start = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.one_launch_only:
        return one_launch_only(args, names, start)
    if args.fused_only:
        return fused_only(args, names, start)
    if args.interleave_only:
        return interleave_only(args, names, start)
    if args.programs_only:
        return programs_only(args, names, start)
    if args.engine_only:
        return engine_only(args, names, start)
    defaults = QUICK_TOKENS if args.quick else DEFAULT_TOKENS
    tokens_of = {
        n: tuple(int(t) for t in args.tokens.split(",")) if args.tokens else defaults[n] for n in names
    }
    if args.missing:
        table = _device_table()[3]
        tokens_of = {n: missing_buckets(tokens_of[n], _shape_entries(table, n, args.quant)[1]) for n in names}
        for n in names:
            print(f"{n}: buckets without an entry: {list(tokens_of[n]) or 'none'}", flush=True)
        names = [n for n in names if tokens_of[n]]
        if not names:
            return 0

    device = torch.device("cuda", torch.cuda.current_device())
    incumbents = {(n, t): incumbent_config(n, t, args.quant, device) for n in names for t in tokens_of[n]}
    heuristics = {(n, t): heuristic_tiles(n, t, args.quant) for n in names for t in tokens_of[n]}
    tasks = compile_tasks(names, tokens_of, args.quant,
                          {bucket: [incumbents[bucket], heuristics[bucket]] for bucket in incumbents})
    failures = [] if args.no_precompile else precompile(tasks, args.jobs)
    print(f"precompiled {len(tasks)} tasks in {time.time() - start:.0f} s; {len(failures)} configs failed")
    for line in failures[:20]:
        print("  ", line)
    if args.precompile_only:
        return 0

    device_name = torch.cuda.get_device_name(device)
    table_entries = load_device_configs(device_name)  # the table as it was before this run
    # the shapes' "small_batch" entries: the device file's, then this run's (`small_batch_split`)
    small_pins: dict[str, ExpertsConfig] = dict(load_small_batch_configs(device_name))
    small_entries: dict[str, dict[str, Any]] = {}
    deadline = time.time() + args.budget_s
    log: list[dict[str, Any]] = []
    winners: dict[str, dict[str, Any]] = {}
    breakdown: list[dict[str, Any]] = []
    for name in names:
        num_experts, top_k, hidden, inter = SHAPES[name]
        key = shape_key(num_experts, hidden, inter, top_k, torch.bfloat16, args.quant)
        w13, w2 = make_weights(name, device)
        fp8 = None
        if args.quant is not None:
            w13, w2, fp8 = quantize_weights(w13, w2, args.quant)
        tuned: dict[int, ExpertsConfig] = {}
        for num_tokens in tokens_of[name]:
            if time.time() > deadline:
                print(f"budget spent: {name} T={num_tokens} and later not tuned")
                break
            case = Case(name, w13, w2, num_tokens, fp8=fp8, incumbent=incumbents[name, num_tokens],
                        heuristic=heuristics[name, num_tokens], replace_margin=args.replace_margin)
            case.small_source = small_batch_source(name, tuned, device, args.quant, small_pins.get(key))
            best = tune_case(case, log, deadline)
            if best is None:
                continue
            cfg, us = best
            cfg, us, padded = padded_steps_hold(case, cfg, us, log, deadline)
            winner, winner_us = cfg, us
            # other buckets' padded steps that run this bucket's small-batch or few-slot tiles
            cfg, us, checked = check_dependents(name, w13, w2, case, cfg, us, table_entries.get(key, {}),
                                                log, deadline, small_pins.get(key))
            if cfg is not winner and case.incumbent is not None and small_batch_split(
                    token_bucket(num_tokens), checked, small_pins.get(key)):
                small_pins[key] = case.incumbent
                small_entries[key] = small_batch_pin_entry(case, checked)
                cfg, us = winner, winner_us
            data = cfg.to_json()
            data["us"] = round(us, 2)
            if checked is not None:
                data["dependents_us"] = checked
            if padded is not None:
                data["padded_us"] = padded
            winners.setdefault(key, {})[str(token_bucket(num_tokens))] = data
            tuned[token_bucket(num_tokens)] = replace(cfg, extra={"us": us})
            print(f"{name:9s} T={num_tokens:6d} {us:10.1f} us  {json.dumps(cfg.to_json())}", flush=True)
            if args.breakdown and fp8 is None and num_tokens in (1, 64, 1024, 8192):
                parts = {
                    s: round(case.time(cfg, s, est_us=us), 2) for s in ("dispatch", "gemm1", "gemm2", "all")
                }
                breakdown.append({"shape": name, "T": num_tokens, **parts})
                print(f"          breakdown (cumulative us): {parts}", flush=True)
            del case
        if not args.no_one_launch and args.quant is None:
            plan = one_launch_targets(name, tuned, device, small_pin=small_pins.get(key))
            if not args.no_precompile:
                precompile_one_launch({name: plan}, args.jobs)
            decided = run_one_launch(name, w13, w2, plan, log, deadline)
            for bucket, (choice, timings) in decided.items():
                winners[key][str(bucket)].update(one_launch=choice, one_launch_us=timings)
        if not args.no_fused and args.quant is None:
            for bucket, (choice, med) in run_fused(name, w13, w2, tuned, log, deadline,
                                                   table_entries.get(key, {})).items():
                winners[key][str(bucket)].update(fused=choice, fused_us=med)
        del w13, w2
        torch.cuda.empty_cache()

    method = (
        "scripts/tune_experts.py: whole experts_triton call under CUDA-graph replay, 4 rotating "
        "uniform routing sets, bf16, num_valid as a device tensor"
    )
    if args.quant is not None:
        method += (f"; fp8 {args.quant} weights (quantize_experts of the stand-in bf16 ones), "
                   "one_launch not timed")
    elif not args.no_one_launch:
        method += (
            f"; one_launch per bucket with small-batch tiles from a full batch and a padded decode step "
            f"(num_valid = {ONE_LAUNCH_PADDED_ROWS}), medians of {ONE_LAUNCH_ROUNDS} rounds (one_launch_us)"
        )
    if args.quant is None and not args.no_fused:
        method += f"; fused per few-slot bucket, medians of {ONE_LAUNCH_ROUNDS} rounds (fused_us)"
    run = run_metadata(device_name, method)
    # An fp8 run's metadata goes under its own key: the top-level one describes the bf16 tiles.
    meta: dict[str, Any] = run if args.quant is None else {f"fp8_{args.quant}_run": run}
    payload = {**meta, "configs": winners}
    if small_entries:
        payload["small_batch"] = small_entries
    _write_results(args, device_name, payload, {"breakdown": breakdown, "log": log})
    print(f"tuned {len(log)} timings in {time.time() - start:.0f} s")
    return 0


def _pinned_one_launch(name: str, bucket: int, entry: dict[str, Any]) -> bool:
    """Whether an entry's one_launch was set by hand (`one_launch_pinned`: the reason, e.g. a
    whole-layer A/B), which --one-launch-only keeps (printed); a full re-tune of the bucket writes
    a fresh entry and decides again."""
    reason = entry.get(ONE_LAUNCH_PIN)
    if reason:
        print(f"  {name} T={bucket}: one_launch={entry.get('one_launch')} kept, pinned: {reason}")
    return bool(reason)


def one_launch_only(args: argparse.Namespace, names: list[str], start: float) -> int:
    """--one-launch-only: one_launch re-decided for the device table's entries of `names`, their
    tiles and every other field kept (the device file's metadata too: its tiles are that run's)."""
    device, device_name, path, table = _device_table()
    buckets = {token_bucket(int(t)) for t in args.tokens.split(",")} if args.tokens else None
    log: list[dict[str, Any]] = []
    winners: dict[str, dict[str, Any]] = {}
    plans: dict[str, OneLaunchPlan] = {}
    for name in names:
        key, entries = _shape_entries(table, name)
        configs = {int(b): ExpertsConfig.from_json(data) for b, data in entries.items()}
        targets = one_launch_targets(name, configs, device, buckets)
        plans[name] = {bucket: pair for bucket, pair in targets.items()
                       if not _pinned_one_launch(name, bucket, entries[str(bucket)])}
        print(
            f"{name}: {len(entries)} entries for {key} in {path}, one_launch timed at T = {list(plans[name])}"
        )
    if not args.no_precompile:
        precompile_one_launch(plans, args.jobs)
    deadline = time.time() + args.budget_s
    for name, plan in plans.items():
        if not plan:
            continue
        num_experts, top_k, hidden, inter = SHAPES[name]
        key = shape_key(num_experts, hidden, inter, top_k, torch.bfloat16)
        entries = table[key]
        w13, w2 = make_weights(name, device)
        decided = run_one_launch(name, w13, w2, plan, log, deadline)
        for bucket, (choice, timings) in decided.items():
            winners.setdefault(key, {})[str(bucket)] = {
                **entries[str(bucket)],
                "one_launch": choice,
                "one_launch_us": timings,
            }
        del w13, w2
        torch.cuda.empty_cache()

    method = (f"scripts/tune_experts.py --one-launch-only: the table's tiles, one_launch from a full batch "
              f"and a padded decode step (num_valid = {ONE_LAUNCH_PADDED_ROWS}) under CUDA-graph replay, "
              f"medians of {ONE_LAUNCH_ROUNDS} rounds (one_launch_us)")
    return _finish_table_only(args, device_name, "one_launch", method, winners, log, start)


def fused_only(args: argparse.Namespace, names: list[str], start: float) -> int:
    """--fused-only: fused re-decided for the device table's few-slot entries of `names`, their
    tiles and every other field kept."""
    device, device_name, path, table = _device_table()
    buckets = {token_bucket(int(t)) for t in args.tokens.split(",")} if args.tokens else None
    deadline = time.time() + args.budget_s
    log: list[dict[str, Any]] = []
    winners: dict[str, dict[str, Any]] = {}
    for name in names:
        key, entries = _shape_entries(table, name)
        whole = {int(b): ExpertsConfig.from_json(data) for b, data in entries.items()}
        configs = {b: cfg for b, cfg in whole.items() if buckets is None or b in buckets}
        timed = fused_buckets(configs, SHAPES[name][1])
        print(f"{name}: fused timed at T = {timed} ({key} in {path})", flush=True)
        w13, w2 = make_weights(name, device)
        for bucket, (choice, med) in run_fused(name, w13, w2, configs, log, deadline, whole).items():
            entry = {**entries[str(bucket)], "fused": choice, "fused_us": med}
            winners.setdefault(key, {})[str(bucket)] = entry
        del w13, w2
        torch.cuda.empty_cache()

    method = ("scripts/tune_experts.py --fused-only: the table's tiles, fused from full batches under "
              f"CUDA-graph replay, medians of {ONE_LAUNCH_ROUNDS} interleaved rounds (fused_us), kept when "
              f"faster by more than {FUSED_MARGIN:.0%}")
    return _finish_table_only(args, device_name, "fused", method, winners, log, start)


def _finish_table_only(args: argparse.Namespace, device_name: str, what: str, method: str,
                       winners: dict[str, dict[str, Any]], log: list[dict[str, Any]], start: float) -> int:
    """Write a --one-launch-only / --fused-only run: its metadata under "{what}_run" (the table's
    tiles, and their run's top-level metadata, are kept)."""
    payload = {f"{what}_run": run_metadata(device_name, method), "configs": winners}
    _write_results(args, device_name, payload, {"log": log})
    print(f"{len(log)} {what} timings in {time.time() - start:.0f} s")
    return 0


def run_metadata(device_name: str, method: str) -> dict[str, Any]:
    """What a device file records about the run that wrote its entries."""
    import triton

    return {"device": device_name, "triton": triton.__version__, "torch": torch.__version__,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "method": method}


def _write_results(
    args: argparse.Namespace, device_name: str, payload: dict[str, Any], extra: dict[str, Any]
) -> None:
    """OUT_DIR/tune_log.json (payload plus `extra`), and with --write the merged device file."""
    (args.out / "tune_log.json").write_text(json.dumps({**payload, **extra}, indent=1) + "\n")
    if args.write:
        path = device_file(device_name)
        existing = json.loads(path.read_text()) if path.exists() else {"configs": {}}
        path.write_text(json.dumps(merge_device_json(existing, payload), indent=1, sort_keys=False) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
