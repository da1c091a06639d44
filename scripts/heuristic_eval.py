"""How far the untuned tiles are from the tuned tables, on a GPU: candidate rules for
`safemoe.configs.heuristic_config` timed side by side with the device table's entries.

    PYTHONPATH=src python3 scripts/heuristic_eval.py --out OUT_DIR [--shapes qwen3,olmoe,...]
        [--tokens 1,8,64,256,1024,4096] [--budget 420] [--rules tree,previous,...] [--padded]
        [--kernel-stats] [--quant per_tensor|block] [--no-peer]

Every model shape without a table entry (most of the MoE families `patch()` takes) runs the
heuristic's tiles, so its distance from a tuned entry is what such a model loses. For each shape
and T this times (one experts call under CUDA-graph replay, full batch, `tune_experts.Case`):
"table", the device table's config where the shape has entries (the tuned reference), and every
rule of RULES at that T (each rule a function of the shapes alone, as `heuristic_config` is;
"tree" is the heuristic in this tree). Each rule's config is checked against the reference
first (relative error <= 2e-2, finite). The shapes without entries (OLMoE, Qwen1.5-MoE, Phi-3.5-MoE,
GLM-4.5-Air: `tune_experts.UNTABLED`) have no tuned reference; there rules are compared with the
best rule at the point. --padded also times the one-valid-row step of buckets up to
PDL_MAX_TOKENS; --kernel-stats records registers, spills and shared memory of the GEMM kernels
each rule's timing loaded. --quant times fp8 weights of that mode instead, against the device
table's fp8 entries, with FP8_RULES (`heuristic_fp8_config` as "tree"); the fp8 path has no
few-slot tiles. Torch grouped_mm (`safemoe.peers.grouped_mm_experts`) is timed on the same inputs
at every bf16 point (--no-peer skips it). Writes OUT_DIR/heuristic_eval[_fp8-<mode>]_<device>.json
(every time) and .md (per regime: each rule's geometric-mean and worst ratio to the table, to the
best rule and to grouped_mm). A
measurement script, not a test; `GPU_RUN_STAGES=heuristic bash scripts/gpu_run.sh OUT` runs it.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

from tune_experts import (  # noqa: E402
    PDL_MAX_TOKENS,
    QUANT_MODES,
    SHAPES,
    UNTABLED,
    Case,
    make_weights,
    precompile,
    quantize_weights,
)

from safemoe.configs import (  # noqa: E402
    ExpertsConfig,
    GemmTiles,
    few_tiles_within,
    get_config,
    heuristic_config,
    heuristic_fp8_config,
    limit_block_k,
    load_device_configs,
    nearest_bucket,
    shape_key,
    token_bucket,
)
from safemoe.kernels.experts import (  # noqa: E402
    FEW_SLOTS,
    LIGHT_FEW_BLOCK_M,
    few_slots_bucket,
    few_tiles_from,
    light_few_tiles,
)

DEFAULT_SHAPES = "qwen3,olmoe,mixtral,phimoe,deepseek,glm45air,gptoss,qwen2moe,qwen3next"
DEFAULT_TOKENS = (1, 8, 64, 256, 1024, 4096)
MAX_ERROR = 2e-2
Rule = Callable[[int, int, int, int, int], ExpertsConfig]  # (T, E, H, I, K) -> config


def _tree(t: int, e: int, h: int, i: int, k: int) -> ExpertsConfig:
    return heuristic_config(t, e, h, i, k, torch.bfloat16)


def _previous(t: int, e: int, h: int, i: int, k: int) -> ExpertsConfig:
    """heuristic_config for bf16 until 2026-12-01 (the first run's "tree"): no PDL, no TMA,
    128-column prefill tiles."""
    rows = token_bucket(t) * k / e
    if rows < 16:
        return ExpertsConfig(16, _gemm(32, 128, 4, 4, 1, tma=False), _gemm(64, 128, 4, 4, 1, tma=False))
    if rows < 32:
        return ExpertsConfig(32, _gemm(64, 64, 4, 4, 4, tma=False), _gemm(64, 64, 4, 4, 4, tma=False))
    if rows < 64:
        return ExpertsConfig(64, _gemm(64, 64, 4, 4, 8, tma=False), _gemm(128, 64, 4, 4, 8, tma=False))
    return ExpertsConfig(128, _gemm(128, 64, 8, 3, 8, tma=False), _gemm(128, 64, 8, 3, 8, tma=False),
                         few=rows <= 96)


def _tree_no_few(t: int, e: int, h: int, i: int, k: int) -> ExpertsConfig:
    """The tree with the few-slot path left out of 64-row launches (in the first run the decode
    tiles' 256-wide K steps compiled into them cost the 64-row tiles 3-6%)."""
    cfg = _tree(t, e, h, i, k)
    return replace(cfg, few=False) if cfg.block_m == 64 else cfg


def _prev64(t: int, e: int, h: int, i: int, k: int) -> ExpertsConfig:
    """The tree with the previous heuristic's 64-row tiles (pointer loads), PDL kept."""
    cfg = _tree(t, e, h, i, k)
    return replace(_previous(t, e, h, i, k), pdl=cfg.pdl) if cfg.block_m == 64 else cfg


def _light_few(t: int, e: int, h: int, i: int, k: int) -> ExpertsConfig:
    """The tree with the previous heuristic's decode tiles (128-wide K steps, 4 stages), PDL kept,
    in the buckets that always take the few-slot path (T * K <= FEW_SLOTS): the few-slot tiles
    every larger bucket compiles into its launches."""
    cfg = _tree(t, e, h, i, k)
    return replace(_previous(t, e, h, i, k), pdl=cfg.pdl) if t * k <= FEW_SLOTS else cfg


def _flags(t: int, e: int, h: int, i: int, k: int) -> ExpertsConfig:
    """The previous heuristic's tiles with what every tuned entry of a regime carries: PDL up to
    1024 tokens, TMA weights on both GEMMs, GEMM1's interleaved gate/up tile on 128-row blocks."""
    cfg = _previous(t, e, h, i, k)
    gemm1 = replace(cfg.gemm1, tma=True, interleave=cfg.block_m == 128)
    return replace(cfg, pdl=t <= PDL_MAX_TOKENS, gemm1=gemm1, gemm2=replace(cfg.gemm2, tma=True))


def _tree_raw_few(t: int, e: int, h: int, i: int, k: int) -> ExpertsConfig:
    """The tree with the few-slot tiles compiled into larger launches as the decode bucket has
    them (before `few_tiles_within`, twenty-second session): the tree's tiles, see RAW_FEW."""
    return _tree(t, e, h, i, k)


def _tree_inner_few(t: int, e: int, h: int, i: int, k: int) -> ExpertsConfig:
    """The tree with the decode bucket's own few-slot tiles (256-wide K steps) inside its 64-row
    launches, fitted to their shared memory: the twenty-second session's behaviour, before
    LIGHT_FEW_BLOCK_M (see FEW_WAYS)."""
    return _tree(t, e, h, i, k)


def _tree_fused_few(t: int, e: int, h: int, i: int, k: int) -> ExpertsConfig:
    """The tree with its 64-row buckets' few-slot path as the fused launch ahead of their GEMMs
    (the decode bucket's tiles marked `fused`; the GEMMs compiled without the path): the library
    between runs 3 and 5 of 2026-12-02 (see FEW_WAYS)."""
    return _tree(t, e, h, i, k)


def _gemm(n: int, k: int, warps: int, stages: int, group_m: int, tma: bool = True,
          interleave: bool = False) -> GemmTiles:
    return GemmTiles(block_n=n, block_k=k, group_m=group_m, num_warps=warps, num_stages=stages, tma=tma,
                     interleave=interleave)


def _modes(t: int, e: int, h: int, i: int, k: int) -> ExpertsConfig:
    """The tuned tables' most common tiles per BLOCK_M (H100 and H200, 2026-11-28)."""
    cfg = _previous(t, e, h, i, k)
    pdl = t <= PDL_MAX_TOKENS
    if cfg.block_m == 16:
        return replace(cfg, gemm1=_gemm(64, 128, 4, 4, 1), gemm2=_gemm(128, 64, 4, 4, 1), pdl=pdl)
    if cfg.block_m == 32:
        return replace(cfg, gemm1=_gemm(64, 128, 4, 3, 4, tma=False), gemm2=_gemm(128, 128, 4, 3, 4), pdl=pdl)
    if cfg.block_m == 64:
        return replace(cfg, gemm1=_gemm(128, 64, 4, 4, 8), gemm2=_gemm(128, 64, 4, 4, 8), pdl=pdl)
    gemm1 = _gemm(128, 64, 8, 4, 8, interleave=True)
    return replace(cfg, gemm1=gemm1, gemm2=_gemm(256, 64, 8, 3, 8), pdl=pdl)


def _wide_k(t: int, e: int, h: int, i: int, k: int) -> ExpertsConfig:
    """Decode tiles with 256-wide K steps, 3 stages (DeepSeek-V3's and Mixtral's tuned T <= 64
    tiles); the other regimes as _modes, with one program an SM at prefill."""
    cfg = _modes(t, e, h, i, k)
    if cfg.block_m == 16:
        gemm1 = _gemm(32, 256, 4, 3, 1, tma=False)
        return replace(cfg, gemm1=gemm1, gemm2=_gemm(64, 256, 4, 3, 1, tma=False))
    if cfg.block_m == 128:
        return replace(cfg, programs_per_sm=1)
    return cfg


def _by_tiles(t: int, e: int, h: int, i: int, k: int) -> ExpertsConfig:
    """_modes with decode N widths from the tile count: the widest of 64 / 32 (GEMM1) and 128 / 64
    (GEMM2) that leaves at least 4 tiles an SM over the experts a uniform batch hits (132 SMs)."""
    cfg = _modes(t, e, h, i, k)
    if cfg.block_m != 16:
        return cfg
    hit = e * (1 - (1 - k / e) ** token_bucket(t))
    enough = 4 * 132
    n1 = 64 if hit * math.ceil(i / 64) >= enough else 32
    n2 = 128 if hit * math.ceil(h / 128) >= enough else 64
    return replace(cfg, gemm1=_gemm(n1, 128, 4, 4, 1), gemm2=_gemm(n2, 64 if n2 == 128 else 128, 4, 4, 1))


# The first run (H200, 2026-12-01) timed previous (then the tree), flags, modes, wide_k and
# by_tiles; the tree took wide_k's tiles, modes' at 64-row blocks. Default: the tree against the
# previous heuristic and the few-slot variant.
RULES: dict[str, Rule] = {
    "tree": _tree, "previous": _previous, "tree_no_few": _tree_no_few, "tree_raw_few": _tree_raw_few,
    "tree_inner_few": _tree_inner_few, "tree_fused_few": _tree_fused_few, "prev64": _prev64,
    "light_few": _light_few, "flags": _flags, "modes": _modes, "wide_k": _wide_k, "by_tiles": _by_tiles,
}
DEFAULT_RULES = "tree,previous,tree_no_few"

Fp8Rule = Callable[[int, int, int, int, int, str], ExpertsConfig]  # (T, E, H, I, K, quant) -> config


def _fp8_fit(cfg: ExpertsConfig, quant: str) -> ExpertsConfig:
    """As get_config serves fp8 tiles: block mode's K steps inside one 128-wide scale group."""
    return limit_block_k(cfg, 128) if quant == "block" else cfg


def _fp8_tree(t: int, e: int, h: int, i: int, k: int, quant: str) -> ExpertsConfig:
    return _fp8_fit(heuristic_fp8_config(t, e, h, i, k, quant), quant)


def _fp8_previous(t: int, e: int, h: int, i: int, k: int, quant: str) -> ExpertsConfig:
    """heuristic_fp8_config until 2026-12-01: BLOCK_M 16 up to 16 rows an expert, 32 up to 48, 64
    up to 96 (a block of the mean rows, not above it); decode tiles 32 / 64 columns, 128-wide K
    steps, 6 stages, no swapped product; PDL on every block under 128 rows whatever T."""
    rows = token_bucket(t) * k / e
    block_m = 16 if rows <= 16 else 32 if rows <= 48 else 64 if rows <= 96 else 128
    if block_m == 128:
        return ExpertsConfig(128, _gemm(128, 128, 8, 3, 8), _gemm(256, 128, 8, 3, 8), programs_per_sm=1)
    return ExpertsConfig(block_m, *_fp8_previous_tiles(block_m), pdl=True)


def _fp8_previous_tiles(block_m: int) -> tuple[GemmTiles, GemmTiles]:
    """The previous fp8 heuristic's GEMM1 and GEMM2 tiles of a 16-, 32- or 64-row block."""
    if block_m == 16:
        return _gemm(32, 128, 4, 6, 1, tma=False), _gemm(64, 128, 4, 6, 1, tma=False)
    return _gemm(64, 128, 4, 4, 4, tma=False), _gemm(64 if block_m == 32 else 128, 128, 4, 4, 4, tma=False)


def _fp8_prev_tiles(t: int, e: int, h: int, i: int, k: int, quant: str) -> ExpertsConfig:
    """The tree's BLOCK_M and PDL with the previous heuristic's tiles of that BLOCK_M (what the
    M-block rule alone is worth)."""
    tree = _fp8_tree(t, e, h, i, k, quant)
    if tree.block_m == 128:
        return tree
    gemm1, gemm2 = _fp8_previous_tiles(tree.block_m)
    return replace(tree, gemm1=gemm1, gemm2=gemm2)


def _fp8_no_swap(t: int, e: int, h: int, i: int, k: int, quant: str) -> ExpertsConfig:
    """The tree without the swapped product (16- and 32-row tiles as plain products)."""
    cfg = _fp8_tree(t, e, h, i, k, quant)
    return replace(cfg, gemm1=replace(cfg.gemm1, swap_ab=False), gemm2=replace(cfg.gemm2, swap_ab=False))


FP8_RULES: dict[str, Fp8Rule] = {
    "tree": _fp8_tree, "previous": _fp8_previous, "prev_tiles": _fp8_prev_tiles, "no_swap": _fp8_no_swap,
}
DEFAULT_FP8_RULES = "tree,previous,prev_tiles"


RAW_FEW = {"tree_raw_few", "light_few"}  # rules whose few-slot tiles are not fitted to the main tiles'
# How a rule's 64-row buckets get their few-slot tiles where it is not as `few_slots_config` has
# them for an untabled shape (the light tiles inside, LIGHT_FEW_BLOCK_M): "decode", the decode
# bucket's own tiles inside; "fused", those tiles as the fused launch ahead of the GEMMs.
FEW_WAYS = {"tree_inner_few": "decode", "tree_fused_few": "fused"}


def _few(rule: Rule, t: int, e: int, h: int, i: int, k: int, cfg: ExpertsConfig,
         fit: bool = True, way: str | None = None) -> ExpertsConfig | None:
    """The few-slot tiles an untabled shape would run beside cfg, as `few_slots_config` has them:
    the rule's own at few_slots_bucket(K), lighter in a 64-row bucket and fitted to cfg's shared
    memory where they go into cfg's launches (`fit` False: neither, as they are); `way` (FEW_WAYS)
    "decode": not lighter; "fused": not lighter, as the fused launch ahead of cfg's GEMMs."""
    def source() -> ExpertsConfig:
        return rule(few_slots_bucket(k), e, h, i, k)

    if way == "fused" and cfg.block_m == LIGHT_FEW_BLOCK_M:
        raw = few_tiles_from(t, k, cfg, source)
        return replace(raw, fused=True) if raw is not None and raw is not cfg else raw
    light = fit and way is None and cfg.block_m == LIGHT_FEW_BLOCK_M
    return few_tiles_from(t, k, cfg, source, fit=fit, light=light)


def evaluate(name: str, tokens: list[int], rules: dict[str, Rule], device: torch.device, deadline: float,
             log: Callable[[str], None], padded: bool = False,
             kernel_stats: bool = False, quant: str | None = None, peer: bool = True,
             table_few: list[str] | None = None) -> list[dict[str, Any]]:
    e, k, h, i = SHAPES[name]
    entries = load_device_configs(torch.cuda.get_device_name(device)).get(
        shape_key(e, h, i, k, torch.bfloat16, quant), {})
    w13, w2 = make_weights(name, device)
    fp8 = None
    if quant is not None:
        w13, w2, fp8 = quantize_weights(w13, w2, quant)
    rows = []
    for t in tokens:
        if time.monotonic() > deadline:
            log(f"{name} T={t}: budget spent, stopping")
            break
        case = Case(name, w13, w2, t, fp8=fp8)
        row: dict[str, Any] = {"shape": name, "T": t, "rows_per_expert": t * k / e, "us": {}, "configs": {}}
        if nearest_bucket(t, entries) is not None:  # a tuned entry serves T (else get_config is the tree)
            cfg = get_config(t, e, h, i, k, torch.bfloat16, device, quant)
            row["us"]["table"] = case.time(cfg)
            if padded and few_slots_bucket(k) < t <= PDL_MAX_TOKENS:
                row.setdefault("padded_us", {})["table"] = case.time(cfg, num_valid=1)
            row["configs"]["table"] = cfg.to_json()
            if table_few and quant is None:
                _time_table_few(case, row, cfg, padded, table_few)
        if peer and quant is None:  # torch grouped_mm on the same inputs, timed the same way
            try:
                row["peer_us"] = {PEER: case.time_step(_grouped_mm_step(case))}
            except Exception as exc:  # a torch without grouped_mm: said, the rules still timed
                row.setdefault("errors", {})[PEER] = f"{type(exc).__name__}: {str(exc)[:160]}"
        timed: dict[tuple[ExpertsConfig, ExpertsConfig | None], str] = {}
        for label, rule in rules.items():
            cfg = rule(t, e, h, i, k)
            row["configs"][label] = cfg.to_json()
            # fp8: no few-slot path
            few = None if quant is not None else _few(rule, t, e, h, i, k, cfg, fit=label not in RAW_FEW,
                                                        way=FEW_WAYS.get(label))
            if (cfg, few) in timed:  # the same launches as another rule here: its times
                twin = timed[(cfg, few)]
                for field in ("us", "padded_us"):
                    if twin in row.get(field, {}):
                        row[field][label] = row[field][twin]
                continue
            timed[(cfg, few)] = label
            before = set(_gemm_kernels()) if kernel_stats else set()
            try:
                err = case.check(cfg, few=few)
                if not err <= MAX_ERROR:
                    row.setdefault("errors", {})[label] = f"relative error {err:.3g}"
                    continue
                row["us"][label] = case.time(cfg, few=few)
                if padded and few_slots_bucket(k) < t <= PDL_MAX_TOKENS:
                    row.setdefault("padded_us", {})[label] = case.time(cfg, few=few, num_valid=1)
                if kernel_stats:
                    row.setdefault("kernels", {})[label] = _kernel_stats(before)
            except Exception as exc:  # a rule's tiles that cannot run here (shared memory, layout)
                row.setdefault("errors", {})[label] = f"{type(exc).__name__}: {str(exc)[:160]}"
        rows.append(row)
        log(f"{name} T={t} ({row['rows_per_expert']:.1f} rows/expert, block_m "
            f"{rules['tree'](t, e, h, i, k).block_m}): "
            + ", ".join(f"{lbl} {us:.1f}" for lbl, us in row["us"].items())
            + "".join(f", {lbl} {us:.1f}" for lbl, us in row.get("peer_us", {}).items())
            + ("; one valid row: " + ", ".join(f"{lbl} {us:.1f}" for lbl, us in row["padded_us"].items())
               if "padded_us" in row else "")
            + ("; kernels (regs/spills/shared KB): " + ", ".join(
                f"{lbl} " + " ".join(f"{k.get('n_regs')}/{k.get('n_spills')}/{k.get('shared', 0) // 1024}"
                                     for k in stats) for lbl, stats in row["kernels"].items())
               if "kernels" in row else "")
            + (f"  errors: {row['errors']}" if "errors" in row else ""))
        del case
    del w13, w2
    torch.cuda.empty_cache()
    return rows


PEER = "torch grouped_mm"
# --table-few: a table entry timed with its few-slot path changed, one label per way
TABLE_FEW = {"fit": "table_fit_few", "fused": "table_fused_few", "none": "table_no_few",
             "light": "table_light_few"}


def fitted_table_few(raw: ExpertsConfig | None, cfg: ExpertsConfig) -> ExpertsConfig | None:
    """The table entry's few-slot tiles fitted into cfg's launches (`few_tiles_within`, what
    untabled shapes get since the twenty-second session), or None where fitting changes nothing
    (no few-slot path, the bucket's own tiles, or tiles already within cfg's shared memory)."""
    if raw is None or raw is cfg:
        return None
    fitted = few_tiles_within(raw, cfg)
    return None if fitted == raw else fitted


def table_few_variants(raw: ExpertsConfig | None, cfg: ExpertsConfig,
                       ways: list[str]) -> dict[str, tuple[ExpertsConfig, ExpertsConfig | None]]:
    """{label: (config, few-slot tiles)} of a table entry `cfg` whose few-slot tiles are `raw`
    (few_slots_config's), one per way that changes its launches: fit (the tiles fitted into cfg's
    launches), fused (the tiles as the fused launch ahead of cfg's GEMMs, what untabled 64-row
    buckets ran between runs 3 and 5 of 2026-12-02; buckets above 16 rows whose tiles are not
    fused yet), none (the path left out), light (the tiles with K steps of at most 128, what untabled
    64-row buckets compile since run 5 of 2026-12-02; where that changes them)."""
    unknown = [way for way in ways if way not in TABLE_FEW]
    if unknown:
        raise ValueError(f"--table-few takes ways of {sorted(TABLE_FEW)}, got {unknown[0]!r}")
    if raw is None or raw is cfg:  # no few-slot path, or the bucket's own tiles: nothing to change
        return {}
    candidates: dict[str, tuple[ExpertsConfig, ExpertsConfig | None] | None] = {
        "fit": (cfg, fitted) if (fitted := fitted_table_few(raw, cfg)) is not None else None,
        "fused": (cfg, replace(raw, fused=True)) if cfg.block_m > FEW_SLOTS and not raw.fused else None,
        "none": (replace(cfg, few=False), None),
        "light": (cfg, light) if (light := light_few_tiles(raw)) != raw else None,
    }
    return {TABLE_FEW[way]: variant for way in ways if (variant := candidates[way]) is not None}


def _time_table_few(case: Case, row: dict[str, Any], cfg: ExpertsConfig, padded: bool,
                    ways: list[str]) -> None:
    """Time the table's config with its few-slot path changed (--table-few) where that changes its
    launches: whether tuned entries gain from what untabled shapes run (H200 2026-12-02: fitting
    did not, full batch level and one-row steps up to 6% slower)."""
    from safemoe.kernels.experts import few_slots_config

    e, k, h, i = SHAPES[case.name]
    device = case.w13.device
    # the table's own few-slot tiles (few_slots_config keeps them as they are for a tabled shape)
    raw = few_slots_config(case.num_tokens, e, h, i, k, torch.bfloat16, device, cfg)
    for label, (config, few) in table_few_variants(raw, cfg, ways).items():
        row["configs"][label] = {"config": config.to_json(),
                                 "few": few.to_json() if few is not None else None}
        row["us"][label] = case.time(config, few=few)
        if padded and few_slots_bucket(k) < case.num_tokens <= PDL_MAX_TOKENS:
            row.setdefault("padded_us", {})[label] = case.time(config, few=few, num_valid=1)


def _grouped_mm_step(case: Case) -> Callable[[int], object]:
    """The experts call through torch grouped_mm (`safemoe.peers.grouped_mm_experts`, as the bench
    suites time it) on case's input set j."""
    from safemoe.peers import grouped_mm_experts

    return lambda j: grouped_mm_experts(case.xs[j], case.w13, case.w2, case.weights[j], case.ids[j], "silu")


def peer_summary(rows: list[dict[str, Any]], labels: list[str]) -> list[str]:
    """Per regime: geometric mean and worst of (rule or table) / torch grouped_mm, full batch."""
    lines = [f"| regime | rule | vs {PEER}: geomean | worst | points |", "|---|---|---|---|---|"]
    for regime in sorted({_regime(r) for r in rows if r.get("peer_us")}, key=lambda s: int(s.split()[-1])):
        members = [r for r in rows if _regime(r) == regime and r.get("peer_us")]
        for label in ["table", *labels]:
            ratios = [r["us"][label] / r["peer_us"][PEER] for r in members if label in r["us"]]
            if ratios:
                lines.append(f"| {regime} | {label} {_ratio_cells(ratios)}|")
    return lines


def _gemm_kernels() -> dict[str, Any]:
    """{key: compiled kernel} of the two GEMM kernels in this process's Triton caches."""
    from safemoe.kernels.experts import _gemm1_kernel, _gemm2_kernel

    found: dict[str, Any] = {}
    try:
        for fn in (_gemm1_kernel, _gemm2_kernel):
            for device, cache in getattr(fn, "device_caches", {}).items():
                kernels = cache[0] if isinstance(cache, tuple) else cache
                for key, kernel in kernels.items():
                    found[f"{fn.__name__}:{device}:{key}"] = kernel
    except Exception:  # another Triton's cache layout: no stats rather than no timings
        return {}
    return found


def _kernel_stats(before: set[str]) -> list[dict[str, Any]]:
    """Registers, spills and shared memory of the GEMM kernels compiled since `before` (what a
    rule's timing loaded): the few-slot tiles compiled into a launch change its kernel, not its
    tiles (the 64-row buckets' 3-4%, docs/experts.md, twenty-first session)."""
    stats = []
    for key, kernel in _gemm_kernels().items():
        if key in before:
            continue
        try:
            stats.append({"kernel": key.split(":")[0], "n_regs": kernel.n_regs, "n_spills": kernel.n_spills,
                          "shared": kernel.metadata.shared, "num_warps": kernel.metadata.num_warps,
                          "num_stages": kernel.metadata.num_stages})
        except Exception as exc:  # another Triton's field names: said, not fatal
            stats.append({"kernel": key.split(":")[0], "error": f"{type(exc).__name__}: {exc}"[:120]})
    return stats


def _regime(row: dict[str, Any]) -> str:
    return f"block_m {row['configs']['tree']['block_m']}"


def summarise(rows: list[dict[str, Any]], labels: list[str], field: str = "us") -> list[str]:
    """Per regime and rule: geometric mean and worst of (rule / table) and (rule / best rule), of
    the full batch's times (field "us") or the one-valid-row step's ("padded_us")."""
    lines = ["| regime | rule | vs table: geomean | worst | points "
             "| vs best rule: geomean | worst | points |", "|---|---|---|---|---|---|---|---|"]
    for regime in sorted({_regime(r) for r in rows if r.get(field)}, key=lambda s: int(s.split()[-1])):
        members = [{**r, "us": r.get(field, {})} for r in rows if _regime(r) == regime]
        for label in labels:
            to_table = [r["us"][label] / r["us"]["table"] for r in members
                        if label in r["us"] and "table" in r["us"]]
            to_best = [r["us"][label] / min(r["us"][x] for x in labels if x in r["us"])
                       for r in members if label in r["us"]]
            lines.append(f"| {regime} | {label} {_ratio_cells(to_table)}{_ratio_cells(to_best)}|")
    return lines


def _ratio_cells(ratios: list[float]) -> str:
    """'| geometric mean | worst | count ' of ratios (dashes when there are none)."""
    if not ratios:
        return "| - | - | 0 "
    return f"| {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f} | {max(ratios):.3f} | {len(ratios)} "


def select_rules(labels: str | None, quant: str | None) -> dict[str, Rule]:
    """The rules --rules names (the defaults when None), "tree" always among them; with `quant`,
    FP8_RULES bound to that mode."""
    known: dict[str, Any] = RULES if quant is None else FP8_RULES
    chosen = (labels or (DEFAULT_RULES if quant is None else DEFAULT_FP8_RULES)).split(",")
    unknown = [label for label in chosen if label and label not in known]
    if unknown:
        where = " with --quant" if quant else ""
        raise SystemExit(f"--rules: unknown {unknown}; known{where}: {', '.join(known)}")
    labels_in_order = ["tree", *[label for label in chosen if label and label != "tree"]]
    if quant is None:
        return {label: RULES[label] for label in labels_in_order}
    return {label: functools.partial(FP8_RULES[label], quant=quant) for label in labels_in_order}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)))
    parser.add_argument("--rules", default=None,
                        help=f"of {', '.join(RULES)} (default {DEFAULT_RULES}); with --quant of "
                        f"{', '.join(FP8_RULES)} (default {DEFAULT_FP8_RULES})")
    parser.add_argument("--quant", choices=QUANT_MODES, default=None,
                        help="fp8 weights of this mode, against the device table's fp8 entries")
    parser.add_argument("--padded", action="store_true",
                        help="also time the one-valid-row step of buckets up to PDL_MAX_TOKENS")
    parser.add_argument("--kernel-stats", action="store_true",
                        help="record registers, spills and shared memory of the GEMM kernels each rule loads")
    parser.add_argument("--no-peer", action="store_true",
                        help=f"do not time {PEER} (timed by default on bf16 runs; fp8 runs have no peer)")
    parser.add_argument("--table-few", default="",
                        help="also time each table entry with its few-slot path changed, ways of "
                        f"{','.join(TABLE_FEW)} (labels {', '.join(TABLE_FEW.values())}; bf16, where the "
                        "way changes its launches)")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds of timing before stopping")
    parser.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    args = parser.parse_args()
    unknown = sorted(set(args.table_few.split(",")) - set(TABLE_FEW) - {""})
    if unknown:
        parser.error(f"--table-few takes ways of {','.join(TABLE_FEW)}, got {','.join(unknown)}")
    table_few = [way for way in args.table_few.split(",") if way]
    if not torch.cuda.is_available():
        raise SystemExit("heuristic_eval.py times kernels on a CUDA device")
    names = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        raise SystemExit(f"--shapes: unknown {unknown}; known: {', '.join(SHAPES)}")
    tokens = [int(t) for t in args.tokens.split(",") if t]
    rules = select_rules(args.rules, args.quant)
    device = torch.device("cuda", 0)
    device_name = torch.cuda.get_device_name(device)
    args.out.mkdir(parents=True, exist_ok=True)
    mode = "" if args.quant is None else f"_fp8-{args.quant}"
    stem = args.out / f"heuristic_eval{mode}_{device_name.replace(' ', '-')}"
    lines: list[str] = []

    def log(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    start = time.monotonic()
    tasks = []
    for name in names:
        e, k, h, i = SHAPES[name]
        for t in tokens:
            configs = {rule(t, e, h, i, k) for rule in rules.values()}
            configs.add(get_config(t, e, h, i, k, torch.bfloat16, device, args.quant))  # the table's
            tasks.append((name, t, [(c.to_json(), None) for c in configs], args.quant))
    failures = precompile(tasks, args.jobs)
    log(f"precompiled {len(tasks)} tasks in {time.monotonic() - start:.0f} s; {len(failures)} failures")
    for line in failures:
        log(f"  {line}")
    deadline = time.monotonic() + args.budget
    rows: list[dict[str, Any]] = []
    for name in names:
        rows += evaluate(name, tokens, rules, device, deadline, log, args.padded, args.kernel_stats,
                         args.quant, peer=not args.no_peer, table_few=table_few)
        payload = {
            "device": device_name, "torch": torch.__version__, "quant": args.quant,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "untabled": [n for n in names if n in UNTABLED], "rows": rows,
        }
        stem.with_suffix(".json").write_text(json.dumps(payload, indent=1))
    labels = list(rules) + [label for label in TABLE_FEW.values() if any(label in r["us"] for r in rows)]
    table = ["Full batch:", "", *summarise(rows, labels)]
    if any(r.get("peer_us") for r in rows):
        table += ["", f"Against {PEER} (same inputs, same timing):", "", *peer_summary(rows, labels)]
    if args.padded:
        table += ["", "One valid row (buckets up to PDL_MAX_TOKENS):", "",
                  *summarise(rows, labels, "padded_us")]
    for line in table:
        log(line)
    title = "heuristic_eval.py" + ("" if args.quant is None else f" --quant {args.quant}")
    stem.with_suffix(".md").write_text(
        f"# {title}, {device_name}, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC\n\n"
        + "\n".join(table) + "\n\n```\n" + "\n".join(lines) + "\n```\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
