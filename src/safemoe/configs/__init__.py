"""Tile configurations of the expert kernels: JSON data per device, plus a heuristic.

A configuration is chosen from shapes alone (E, H, I, K, dtype and the token bucket of T), on the
host, before any launch, so it is the same inside and outside a CUDA-graph capture and the same
for a padded batch and an unpadded one of the same T. Tuned entries live in
`src/safemoe/configs/<device name, spaces -> _>.json`, written by `scripts/tune_experts.py`:

    {"device": "NVIDIA H200", "triton": "3.6.0", "date": "...",
     "configs": {"E128_H2048_I768_K8_bfloat16": {"1": {"block_m": 16, "gemm1": {...}, ...}}}}

Token buckets are powers of two (T rounds up). A shape with entries but none for its bucket uses
the nearest tuned bucket if it is at most one octave away (the smaller on a tie), else, like a
shape with no entry at all, `heuristic_config`.

fp8 expert weights (`quant` = "per_tensor" or "block") have keys of their own
(`E{E}_H{H}_I{I}_K{K}_{dtype}_fp8-{quant}`, dtype = x's) and a heuristic of their own
(`heuristic_fp8_config`); block mode needs block_k <= 128 (one K step inside one 128-wide scale
group), which `get_config` guarantees for what it returns.

Batch-invariant mode (`batch_invariant=True`, see docs/contract.md) runs one configuration for
every T: `batch_invariant_config`, the device file's top-level `"batch_invariant"` entry for the
shape key (`{"batch_invariant": {"E128_H2048_I768_K8_bfloat16": {...config...}}}`) when it has
one, else the configuration `get_config` picks for BATCH_INVARIANT_TOKENS tokens.

A batch bucket larger than the small-batch bucket (kernels/experts.py SMALL_BATCH_TOKENS) runs its
steps of that many valid rows or fewer with small-batch tiles: `small_batch_entry`, the device
file's top-level `"small_batch"` entry for the shape key (same form as "batch_invariant") when it
has one, else the small-batch bucket's own entry. The top-level entry lets that bucket keep tiles
that are best for its own batches while the larger buckets' small steps keep the tiles that are
best inside their launches (`scripts/tune_experts.py` writes it when a winner for the bucket would
slow those steps).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from safemoe.fp8 import QUANT_MODES

CONFIG_DIR = Path(__file__).parent

# The workspace is sized for this BLOCK_M, so any configuration may use any BLOCK_M up to it.
MAX_BLOCK_M = 128
BLOCK_M_CHOICES = (16, 32, 64, 128)
GEMM2_ENGINES = ("triton", "ws", "ws_store")
# Batch-invariant mode without a tuned "batch_invariant" entry uses the tiles of this many tokens
# for every T: a mid-size batch (64 rows per expert on Qwen3-30B-A3B, E=128 K=8), between the decode
# and prefill regimes. A guess, not a measurement: `scripts/tune_batch_invariant.py --write` times
# candidates at T = 1..8192 against each T's own config and writes the shape's "batch_invariant"
# entry; `safemoe bench --suite invariance` measures what the mode costs.
BATCH_INVARIANT_TOKENS = 1024
_CONFIG_FIELDS = ("block_m", "gemm1", "gemm2", "programs_per_sm", "pdl", "one_launch", "few", "fused")


@dataclass(frozen=True)
class GemmTiles:
    """Tiles of one expert GEMM. block_n spans the output columns (I for GEMM1, whose gate and up
    halves each get a block_n-wide accumulator; H for GEMM2), block_k the reduction. With `tma`
    the weight tiles come through TMA descriptors where the shape allows (rows of 16-byte
    multiples), else through pointer loads. `interleave` (GEMM1, weights in x's dtype or fp8
    per-tensor; fp8 block mode ignores it): the gate and up rows as one [block_k, 2 block_n] tile
    and one MMA a K step instead of two (with `tma` through a descriptor over w13 seen as
    [E, I, 2, H]). `engine` (GEMM2 of 128-row blocks only): "triton" (the tile loop of
    kernels/experts.py), or the warp-specialised Gluon kernel of kernels/experts_ws.py, "ws" (a
    TMA producer warp and two MMA warpgroups that store their tiles) or "ws_store" (a third
    partition stores them); it needs 8 warps and runs where the GPU is sm_90 and the data bf16 or
    fp16, the Triton tiles elsewhere. `swap_ab` (the Triton tile loop, main tiles; not with
    interleave): each K step multiplies W^T x^T into a transposed accumulator, the weight columns
    on the MMA's M side, so a 16- or 32-row decode tile with block_n >= 64 runs Hopper's wgmma;
    for fp8 weights that is the native e4m3 MMA where the 16-row product converts both operands
    to f16 first (kernels/experts.py, _mma)."""

    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False  # weight tiles through TMA descriptors (Hopper+; else pointer loads)
    interleave: bool = False  # GEMM1: gate and up rows as one tile, one MMA a K step
    engine: str = "triton"  # GEMM2: "triton", or the Gluon kernel "ws" / "ws_store"
    swap_ab: bool = False  # the weights on the MMA's M side (decode tiles; Hopper wgmma)


@dataclass(frozen=True)
class ExpertsConfig:
    """block_m: rows per M-block; each expert's slots are padded to a multiple of it by dispatch,
    so both GEMMs share it. programs_per_sm caps the persistent grids at that many programs per SM.
    pdl: launch with programmatic dependent launch (Hopper+), overlapping each kernel's launch with
    the previous kernel's tail. one_launch: when a batch of this bucket switches to the small-batch
    tiles (few valid rows), each GEMM is one launch compiled with both tile sets (the small ones
    then run with these num_warps/num_stages) instead of two launches, one of which finds no work:
    a tuned choice per bucket, since the merged kernel can cost the main tiles a few percent (H100,
    2026-11-24: Qwen3 T=256 +3.5%, DeepSeek-V3 T=2048 +4%) while it saves ~5 µs on a padded decode
    step (Qwen3 and gpt-oss at T=1024 with one valid row). few: a batch of this bucket with at
    most 16 valid slots (num_valid * K, read on the device) takes the few-slot path of
    kernels/experts.py (each GEMM program builds the layout from the ids itself; no dispatch
    kernel), with this config's tiles when the bucket is that small, else with those of the
    largest such bucket; off, it runs the dispatch layout like any batch. fused: a bucket whose
    every batch takes the few-slot path (T*K <= 16) runs GEMM1 and GEMM2 as ONE launch, GEMM2's
    tiles of an expert starting as soon as that expert's GEMM1 tiles are done (with gemm1's
    num_warps/num_stages), and so does a padded step (<= 16 valid slots) of a larger bucket with
    block_m > 16 whose few-slot tiles are this bucket's: that launch goes first and returns at
    once on a larger batch, and the larger bucket's GEMM launches are compiled without the
    few-slot path."""

    block_m: int
    gemm1: GemmTiles
    gemm2: GemmTiles
    programs_per_sm: int = 4
    pdl: bool = False
    one_launch: bool = False
    few: bool = True
    fused: bool = False
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.block_m not in BLOCK_M_CHOICES:
            raise ValueError(f"block_m must be one of {BLOCK_M_CHOICES}, got {self.block_m}")
        for name, tiles in (("gemm1", self.gemm1), ("gemm2", self.gemm2)):
            for attr in ("block_n", "block_k"):
                value = getattr(tiles, attr)
                if value < 16 or value & (value - 1):
                    raise ValueError(f"{name}.{attr} must be a power of two >= 16, got {value}")
            for attr in ("tma", "interleave", "swap_ab"):
                flag_value = getattr(tiles, attr)
                if not isinstance(flag_value, bool):
                    raise TypeError(f"{name}.{attr} must be a bool, got {type(flag_value).__name__}")
            if tiles.swap_ab and (tiles.interleave or tiles.engine != "triton"):
                raise ValueError(f"{name}.swap_ab is for the Triton tile loop without interleave, got "
                                 f"interleave={tiles.interleave}, engine={tiles.engine!r}")
        self._check_engines()
        for flag in ("one_launch", "few", "fused"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be a bool, got {type(getattr(self, flag)).__name__}")

    def _check_engines(self) -> None:
        if self.gemm1.engine != "triton":
            raise ValueError("gemm1.engine must be 'triton' (the Gluon engines are GEMM2's), got "
                             f"{self.gemm1.engine!r}")
        tiles = self.gemm2
        if tiles.engine not in GEMM2_ENGINES:
            raise ValueError(f"gemm2.engine must be one of {GEMM2_ENGINES}, got {tiles.engine!r}")
        if tiles.engine == "triton":
            return
        if (self.block_m != 128 or tiles.num_warps != 8 or tiles.block_n not in (128, 256)
                or tiles.block_k > 128):
            raise ValueError(f"gemm2.engine {tiles.engine!r} runs block_m 128, 8 warps, block_n 128 or 256 "
                             f"and block_k <= 128, got block_m {self.block_m}, {tiles}")
        # shared memory: the ring, and the store partition's tile or (measured, ~17-21 KiB) the
        # scratch of the epilogue's layout change
        ring = tiles.num_stages * (128 + tiles.block_n) * tiles.block_k * 2
        epilogue = 128 * tiles.block_n * 2 if tiles.engine == "ws_store" else 24 * 1024
        if ring + epilogue > 230 * 1024 or tiles.num_stages < 2:
            raise ValueError(f"gemm2.engine {tiles.engine!r}: {tiles.num_stages} stages of {tiles.block_n} "
                             f"x {tiles.block_k} tiles do not fit an SM's shared memory (2 or more, "
                             "<= 230 KiB)")

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("extra")
        for name in ("gemm1", "gemm2"):  # tables written before the fields stay as they were
            if data[name]["engine"] == "triton":
                data[name].pop("engine")
            if not data[name]["swap_ab"]:
                data[name].pop("swap_ab")
        return data

    @staticmethod
    def from_json(data: dict[str, Any]) -> ExpertsConfig:
        return ExpertsConfig(
            block_m=int(data["block_m"]),
            gemm1=GemmTiles(**data["gemm1"]),
            gemm2=GemmTiles(**data["gemm2"]),
            programs_per_sm=int(data.get("programs_per_sm", 4)),
            pdl=bool(data.get("pdl", False)),
            one_launch=bool(data.get("one_launch", False)),
            few=bool(data.get("few", True)),
            fused=bool(data.get("fused", False)),
            extra={k: v for k, v in data.items() if k not in _CONFIG_FIELDS},
        )


def token_bucket(num_tokens: int) -> int:
    """The power of two at or above T (T >= 1)."""
    return 1 << max(0, int(num_tokens) - 1).bit_length()


def shape_key(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype,
              quant: str | None = None) -> str:
    key = f"E{num_experts}_H{hidden}_I{inter}_K{top_k}_{str(dtype).removeprefix('torch.')}"
    return key if quant is None else f"{key}_fp8-{quant}"


def device_file(device_name: str) -> Path:
    return CONFIG_DIR / f"{device_name.replace(' ', '_')}.json"


@functools.lru_cache(maxsize=16)
def _device_json(device_name: str) -> dict[str, Any]:
    path = device_file(device_name)
    return json.loads(path.read_text()) if path.exists() else {}


@functools.lru_cache(maxsize=16)
def load_device_configs(device_name: str) -> dict[str, dict[int, ExpertsConfig]]:
    """{shape key: {token bucket: config}} from the device's JSON file ({} when there is none)."""
    raw = _device_json(device_name)
    table: dict[str, dict[int, ExpertsConfig]] = {}
    for key, buckets in raw.get("configs", {}).items():
        table[key] = {int(b): ExpertsConfig.from_json(cfg) for b, cfg in buckets.items()}
    return table


@functools.lru_cache(maxsize=16)
def load_small_batch_configs(device_name: str) -> dict[str, ExpertsConfig]:
    """{shape key: config} of the device file's top-level "small_batch" entries ({} without)."""
    raw = _device_json(device_name).get("small_batch", {})
    return {key: ExpertsConfig.from_json(entry) for key, entry in raw.items()}


# Graphs of buckets up to here replay padded decode steps, which are all launches: the tuner puts
# PDL on every candidate up to it (and on none above: gpt-oss T = 8192 was 3-4% slower with it,
# H100), and the heuristic does the same. H100 2026-11-24, Qwen3 T = 1024 with one valid row 46.0
# -> 42.5 us with it, full batches within 1%.
PDL_MAX_TOKENS = 1024


def heuristic_config(num_tokens: int, num_experts: int, hidden: int, inter: int, top_k: int,
                     dtype: torch.dtype) -> ExpertsConfig:
    """Tiles for a shape with no tuned entry, from the expected rows per expert under uniform routing.

    BLOCK_M is the smallest block ABOVE the expected rows: an expert's rows spread around their
    mean, so a block of exactly the mean leaves about half the experts a second, nearly empty
    M-block whose programs stream the whole weight tile again. The tuned tables agree: at 16, 32,
    40 and 64 rows an expert the tuner picked 32-, 64-, 64- and (5 of 7) 128-row blocks on H100 and
    H200 (2026-11-28, H200: 16-row blocks at 16 rows 12-24% slower than 32-row ones on Qwen3,
    DeepSeek-V3 and gpt-oss, 32-row blocks at 32 and 40 rows 9-13% slower than 64-row ones).

    The tiles of each BLOCK_M are the rule that came closest to the tuned tables in
    `scripts/heuristic_eval.py` (H200, 2026-12-01: five tuned shapes and four untabled ones, T = 1
    to 4096; bench/results/heuristic_eval_NVIDIA-H200_2026-12-01.md), with PDL up to
    PDL_MAX_TOKENS and TMA weights where the tables use them (both only on Hopper or newer; the
    launchers fall back elsewhere). Decode (16-row blocks): 256-wide K steps, 3 stages, pointer
    loads, narrow N (DeepSeek-V3's and Mixtral's tuned decode tiles; the GEMMs stream weights,
    and many programs with deep pipelines keep enough bytes in flight). Prefill (128-row blocks):
    GEMM1's gate and up rows as one interleaved 256-column TMA tile, GEMM2 256 columns, 8 warps,
    one program an SM. The previous heuristic (no PDL, no TMA, 128-column prefill tiles) was 9-12%
    (decode), 18-21% (32-row blocks) and 15-16% (prefill) slower than the tables on the tuned shapes
    (geometric means of two runs).
    """
    rows_per_expert = token_bucket(num_tokens) * top_k / num_experts
    pdl = num_tokens <= PDL_MAX_TOKENS
    if dtype == torch.float32:  # fp32 tiles hold twice the bytes: the narrow K steps of before
        return _heuristic_fp32(rows_per_expert, pdl)
    if rows_per_expert < 16:
        return ExpertsConfig(
            block_m=16,
            gemm1=GemmTiles(block_n=32, block_k=256, group_m=1, num_warps=4, num_stages=3),
            gemm2=GemmTiles(block_n=64, block_k=256, group_m=1, num_warps=4, num_stages=3),
            pdl=pdl,
        )
    if rows_per_expert < 32:
        return ExpertsConfig(
            block_m=32,
            gemm1=GemmTiles(block_n=64, block_k=128, group_m=4, num_warps=4, num_stages=3),
            gemm2=GemmTiles(block_n=128, block_k=128, group_m=4, num_warps=4, num_stages=3, tma=True),
            pdl=pdl,
        )
    if rows_per_expert < 64:
        return ExpertsConfig(
            block_m=64,
            gemm1=GemmTiles(block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4, tma=True),
            gemm2=GemmTiles(block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4, tma=True),
            pdl=pdl,
        )
    # Prefill tiles leave the few-slot path out of their launch: compiled in, it cost the tuned
    # prefill buckets 2-3% on an H100 (device tables: "few": false at T >= 2048). Up to 96 rows an
    # expert (the decode buckets up to 1024 of the tuned shapes) a padded step keeps it.
    return ExpertsConfig(
        block_m=128,
        gemm1=GemmTiles(block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4, tma=True,
                        interleave=True),
        gemm2=GemmTiles(block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3, tma=True),
        programs_per_sm=1,
        pdl=pdl,
        few=rows_per_expert <= 96,
    )


def _heuristic_fp32(rows_per_expert: float, pdl: bool) -> ExpertsConfig:
    """fp32 activations and weights (no tuned entry anywhere): the earlier heuristic's tiles, whose
    64-wide K steps keep an fp32 tile within the shared memory of the bf16 ones."""
    if rows_per_expert < 16:
        block_m, n1, n2, group_m, warps, stages = 16, 32, 64, 1, 4, 4
    elif rows_per_expert < 32:
        block_m, n1, n2, group_m, warps, stages = 32, 64, 64, 4, 4, 4
    elif rows_per_expert < 64:
        block_m, n1, n2, group_m, warps, stages = 64, 64, 128, 8, 4, 4
    else:
        block_m, n1, n2, group_m, warps, stages = 128, 128, 128, 8, 8, 3
    return ExpertsConfig(
        block_m=block_m,
        gemm1=GemmTiles(block_n=n1, block_k=64, group_m=group_m, num_warps=warps, num_stages=stages),
        gemm2=GemmTiles(block_n=n2, block_k=64, group_m=group_m, num_warps=warps, num_stages=stages),
        pdl=pdl,
        few=block_m < 128 or rows_per_expert <= 96,
    )


def heuristic_fp8_config(num_tokens: int, num_experts: int, hidden: int, inter: int, top_k: int,
                         quant: str) -> ExpertsConfig:
    """Tiles for fp8 weights without a tuned entry, from the expected rows per expert.

    BLOCK_M as in `heuristic_config`: the smallest block above the expected rows (16, 32, 64),
    128 from 96 rows on. The H200 fp8 tables, tuned on every bucket from T = 8 to 8192 on
    Qwen3-30B-A3B and DeepSeek-V3 in both modes (2026-11-26 decode, 2026-12-01 the rest), agree at
    every point: at 16 and 32 rows an expert the 32- and 64-row blocks beat the previous
    heuristic's 16- and 32-row tiles by 24-39% (DeepSeek-V3 T = 512 / 1024, Qwen3 T = 512, both
    modes), and at 64 rows the 64-row blocks held (fp8 tiles are half the bytes, so a 64-row tile
    still streams its weights).
    Decode and the 32-row blocks use the swapped product (`swap_ab`: the weights on wgmma's M side,
    native e4m3, where the plain 16-row product converts to f16), as the tables' decode entries
    do, with 128-wide K steps in block mode (one scale group a step) and 256-wide per tensor. Prefill
    (measured on an H200, 2026-11-26, scripts/debug/fp8_prefill.py, T = 8192, us per experts call,
    older tiles -> these: block Qwen3 1329 -> 1166, DeepSeek-V3 10483 -> 9359; per-tensor Qwen3
    1139 -> 1056, DeepSeek-V3 8465 -> 7603; the 2026-12-01 tune kept them wherever they run):
    128-row M-blocks, 128-wide K steps, 8 warps, TMA weights, GEMM1 128 columns (times gate and
    up; it spills ~10 registers on triton 3.6 and is still the fastest), GEMM2 256 (two halves,
    QUANT 4 of kernels/experts.py). PDL up to PDL_MAX_TOKENS, as the tables and `heuristic_config`.
    """
    if quant not in QUANT_MODES:
        raise ValueError(f"quant must be one of {QUANT_MODES}, got {quant!r}")
    rows_per_expert = token_bucket(num_tokens) * top_k / num_experts
    pdl = num_tokens <= PDL_MAX_TOKENS
    wide_k = 256 if quant == "per_tensor" else 128  # block mode: one K step inside one scale group
    if rows_per_expert < 16:
        return ExpertsConfig(
            block_m=16,
            gemm1=GemmTiles(block_n=64, block_k=wide_k, group_m=1, num_warps=4,
                            num_stages=3 if wide_k == 256 else 6, swap_ab=True),
            gemm2=GemmTiles(block_n=128, block_k=128, group_m=1, num_warps=4, num_stages=4, tma=True,
                            swap_ab=True),
            pdl=pdl,
        )
    if rows_per_expert < 32:
        return ExpertsConfig(
            block_m=32,
            gemm1=GemmTiles(block_n=64, block_k=wide_k, group_m=4, num_warps=4, num_stages=4, swap_ab=True),
            gemm2=GemmTiles(block_n=64, block_k=128, group_m=4, num_warps=4, num_stages=3, tma=True,
                            swap_ab=True),
            pdl=pdl,
        )
    if rows_per_expert <= 96:
        return ExpertsConfig(
            block_m=64,
            gemm1=GemmTiles(block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=4),
            gemm2=GemmTiles(block_n=128, block_k=128, group_m=8, num_warps=4, num_stages=3, tma=True),
            pdl=pdl,
        )
    return ExpertsConfig(
        block_m=128,
        gemm1=GemmTiles(block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=3, tma=True),
        gemm2=GemmTiles(block_n=256, block_k=128, group_m=8, num_warps=8, num_stages=3, tma=True),
        programs_per_sm=1,
        pdl=pdl,
    )


def interpreter_config(num_tokens: int, num_experts: int, top_k: int) -> ExpertsConfig:
    """Small tiles for the CPU interpreter: shapes there are tiny and wide tiles only cost time."""
    block_m = 16 if num_tokens * top_k / num_experts <= 16 else 32
    return ExpertsConfig(
        block_m=block_m,
        gemm1=GemmTiles(block_n=32, block_k=32, group_m=4, num_warps=4, num_stages=1),
        gemm2=GemmTiles(block_n=32, block_k=32, group_m=4, num_warps=4, num_stages=1),
    )


def get_config(num_tokens: int, num_experts: int, hidden: int, inter: int, top_k: int,
               dtype: torch.dtype, device: torch.device, quant: str | None = None) -> ExpertsConfig:
    """The configuration for these shapes on `device` (tuned entry, else the heuristic); quant:
    None (weights in x's dtype) or the fp8 mode, "per_tensor" or "block"."""
    cfg = _lookup_config(num_tokens, num_experts, hidden, inter, top_k, dtype, device, quant)
    if quant == "block":
        cfg = limit_block_k(cfg, 128)
    return cfg


def batch_invariant_config(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype,
                           device: torch.device, quant: str | None = None) -> ExpertsConfig:
    """The one configuration batch-invariant mode uses for every T of these shapes: the device
    file's "batch_invariant" entry for the shape key, else `get_config(BATCH_INVARIANT_TOKENS, ...)`.
    No T in the arguments: that is the point."""
    if device.type == "cuda":
        entries = _device_json(torch.cuda.get_device_name(device)).get("batch_invariant", {})
        entry = entries.get(shape_key(num_experts, hidden, inter, top_k, dtype, quant))
        if entry is not None:
            cfg = ExpertsConfig.from_json(entry)
            return limit_block_k(cfg, 128) if quant == "block" else cfg
    return get_config(BATCH_INVARIANT_TOKENS, num_experts, hidden, inter, top_k, dtype, device, quant)


def limit_block_k(cfg: ExpertsConfig, max_block_k: int) -> ExpertsConfig:
    """cfg with both GEMMs' block_k at most max_block_k."""
    if cfg.gemm1.block_k <= max_block_k and cfg.gemm2.block_k <= max_block_k:
        return cfg
    return replace(
        cfg,
        gemm1=replace(cfg.gemm1, block_k=min(cfg.gemm1.block_k, max_block_k)),
        gemm2=replace(cfg.gemm2, block_k=min(cfg.gemm2.block_k, max_block_k)),
    )


def nearest_bucket(num_tokens: int, buckets: Iterable[int]) -> int | None:
    """The tuned bucket whose entry serves T tokens: the nearest to T's bucket within one octave
    (ties to the smaller), None when there is none (the heuristic then serves T). Further away the
    tiles of another regime (decode vs prefill) would be used, which the heuristic beats."""
    if isinstance(num_tokens, (bool, float)) or int(num_tokens) < 1:  # int(): also torch's SymInt
        raise ValueError(f"num_tokens must be an int >= 1, got {num_tokens!r}")
    buckets = tuple(buckets)
    # exact ints only before the cache: True == 1 and 2.0 == 2 would share its entries
    not_ints = [b for b in buckets if type(b) is not int]
    if not_ints:
        raise ValueError(f"buckets must be powers of two >= 1 (token buckets), got {not_ints}")
    return _nearest_of_bucket(token_bucket(num_tokens), buckets)


@functools.lru_cache(maxsize=1024)
def _nearest_of_bucket(bucket: int, buckets: tuple[int, ...]) -> int | None:
    # cached: every forward asks this (the table's buckets and T's bucket repeat), and the checks
    # and the search were ~5% of an eager decode step's host time (cProfile, H100 host, 2026-11-27)
    bad = [b for b in buckets if b < 1 or b & (b - 1)]
    if bad:
        raise ValueError(f"buckets must be powers of two >= 1 (token buckets), got {bad}")
    octaves = {b: abs(b.bit_length() - bucket.bit_length()) for b in buckets}
    if not octaves:
        return None
    chosen = min(octaves, key=lambda b: (octaves[b], b))
    return chosen if octaves[chosen] <= 1 else None


def _table_entries(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype,
                   device: torch.device, quant: str | None) -> dict[int, ExpertsConfig]:
    """{token bucket: config} of this shape in `device`'s table ({} off CUDA or without entries)."""
    if device.type != "cuda":
        return {}
    table = load_device_configs(torch.cuda.get_device_name(device))
    return table.get(shape_key(num_experts, hidden, inter, top_k, dtype, quant), {})


def _check_shape_query(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype,
                       device: torch.device, quant: str | None) -> None:
    """The arguments of a table question (`has_table`, `small_batch_entry`), checked before any lookup."""
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device, got {type(device).__name__}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    for name, value in (("num_experts", num_experts), ("hidden", hidden), ("inter", inter), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if quant not in (None, *QUANT_MODES):
        raise ValueError(f"quant must be None or one of {QUANT_MODES}, got {quant!r}")


def has_table(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype,
              device: torch.device, quant: str | None = None) -> bool:
    """Whether `device`'s table has tuned entries for this shape (False off CUDA)."""
    _check_shape_query(num_experts, hidden, inter, top_k, dtype, device, quant)
    return _has_table(num_experts, hidden, inter, top_k, dtype, device, quant)


@functools.lru_cache(maxsize=256)  # asked every forward of a shape whose launches carry the few-slot path
def _has_table(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype,
               device: torch.device, quant: str | None) -> bool:
    return bool(_table_entries(num_experts, hidden, inter, top_k, dtype, device, quant))


def small_batch_entry(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype,
                      device: torch.device, quant: str | None = None) -> ExpertsConfig | None:
    """The device file's "small_batch" config for these shapes (block_k capped at 128 in fp8 block
    mode), or None (off CUDA, or no such entry: the small-batch bucket's own config serves)."""
    _check_shape_query(num_experts, hidden, inter, top_k, dtype, device, quant)
    return _small_batch_entry(num_experts, hidden, inter, top_k, dtype, device, quant)


@functools.lru_cache(maxsize=256)  # asked every forward of a bucket above the small-batch bucket
def _small_batch_entry(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype,
                       device: torch.device, quant: str | None) -> ExpertsConfig | None:
    if device.type != "cuda":
        return None
    cfg = load_small_batch_configs(torch.cuda.get_device_name(device)).get(
        shape_key(num_experts, hidden, inter, top_k, dtype, quant))
    if cfg is not None and quant == "block":
        cfg = limit_block_k(cfg, 128)
    return cfg


def _lookup_config(num_tokens: int, num_experts: int, hidden: int, inter: int, top_k: int,
                   dtype: torch.dtype, device: torch.device, quant: str | None) -> ExpertsConfig:
    if device.type != "cuda":
        return interpreter_config(num_tokens, num_experts, top_k)
    buckets = _table_entries(num_experts, hidden, inter, top_k, dtype, device, quant)
    chosen = nearest_bucket(num_tokens, buckets)
    if chosen is not None:
        return buckets[chosen]
    # the heuristic depends on T through its bucket only (PDL_MAX_TOKENS is a bucket)
    return _fitted_heuristic(token_bucket(num_tokens), num_experts, hidden, inter, top_k, dtype, quant,
                             _shared_memory_limit(device.index))


@functools.lru_cache(maxsize=1024)
def _fitted_heuristic(bucket: int, num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype,
                      quant: str | None, limit: int | None) -> ExpertsConfig:
    """The heuristic's config of a bucket, fitted to `limit` bytes of shared memory (None: as it
    is). Cached: an untabled shape asks for it up to three times a forward (main, small-batch and
    few-slot tiles)."""
    if quant is not None:
        cfg = heuristic_fp8_config(bucket, num_experts, hidden, inter, top_k, quant)
    else:
        cfg = heuristic_config(bucket, num_experts, hidden, inter, top_k, dtype)
    if limit is None:
        return cfg
    # fp8: both GEMMs read fp8 A tiles (x and the intermediate are quantised before them)
    element = 1 if quant else dtype.itemsize
    return fit_shared_memory(cfg, limit, x_bytes=element, weight_bytes=element)


# Shared memory a GEMM launch needs beyond its pipeline buffers (barriers, the epilogue's layout
# conversions when they do not reuse the buffers): kept free by fit_shared_memory.
SHARED_MEMORY_RESERVE = 4096


def gemm_shared_memory(tiles: GemmTiles, block_m: int, x_bytes: int, weight_bytes: int, gemm1: bool) -> int:
    """An upper estimate of one GEMM launch's shared memory: num_stages buffers of its A tile
    [block_m, block_k] and its weight tile [block_k, block_n] (GEMM1: the gate and up tiles, 2 block_n
    columns), A's elements `x_bytes` each (1 with fp8 weights: the GEMMs read x and the
    intermediate quantised)."""
    for name, value in (("block_m", block_m), ("x_bytes", x_bytes), ("weight_bytes", weight_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    columns = 2 * tiles.block_n if gemm1 else tiles.block_n
    return tiles.num_stages * tiles.block_k * (block_m * x_bytes + columns * weight_bytes)


def fit_shared_memory(cfg: ExpertsConfig, limit: int, x_bytes: int = 2,
                      weight_bytes: int = 2) -> ExpertsConfig:
    """cfg with each GEMM's pipeline made to fit `limit` bytes of shared memory (a device's opt-in
    maximum a block), less SHARED_MEMORY_RESERVE: num_stages lowered to 2, then block_k halved down
    to 32, until `gemm_shared_memory` fits. The heuristic's tiles are sized for Hopper's 227 KB
    (H100 / H200, where they are unchanged); an A100 (163 KB) or an Ada / consumer card (99 KB) would
    otherwise fail to compile them. Tuned tables are per device and left as they are."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= SHARED_MEMORY_RESERVE:
        raise ValueError(f"limit must be an int of bytes > {SHARED_MEMORY_RESERVE}, got {limit!r}")
    budget = limit - SHARED_MEMORY_RESERVE
    gemm1 = _fit_pipeline(cfg.gemm1, cfg.block_m, budget, x_bytes, weight_bytes, gemm1=True)
    gemm2 = _fit_pipeline(cfg.gemm2, cfg.block_m, budget, x_bytes, weight_bytes, gemm1=False)
    if gemm1 == cfg.gemm1 and gemm2 == cfg.gemm2:
        return cfg
    return replace(cfg, gemm1=gemm1, gemm2=gemm2)


def _fit_pipeline(tiles: GemmTiles, block_m: int, budget: int, x_bytes: int, weight_bytes: int,
                  gemm1: bool) -> GemmTiles:
    """tiles with num_stages lowered to 2, then block_k halved down to 32, until
    `gemm_shared_memory` is at most `budget` bytes."""
    while gemm_shared_memory(tiles, block_m, x_bytes, weight_bytes, gemm1) > budget:
        if tiles.num_stages > 2:
            tiles = replace(tiles, num_stages=tiles.num_stages - 1)
        elif tiles.block_k > 32:
            tiles = replace(tiles, block_k=tiles.block_k // 2)
        else:
            break  # the smallest pipeline this rule makes; Triton reports what is left
    return tiles


def few_tiles_within(few: ExpertsConfig, main: ExpertsConfig, element_bytes: int = 2) -> ExpertsConfig:
    """Few-slot tiles `few` as compiled into the launches of `main` (a larger bucket's tiles), each
    GEMM's pipeline cut (stages, then block_k, as `fit_shared_memory`) until its shared memory is
    no more than main's own. A launch holds the buffers of both of its paths, so few-slot tiles
    with the deeper pipeline would set the whole launch's shared memory: the heuristic's 64-row
    GEMM2 (96 KB) went to 120 KB with the decode tiles compiled in (H200 2026-12-01,
    bench/results/logs/heuristic_kernel_stats_64row_NVIDIA-H200_2026-12-01.txt). Fitting them
    did not move the time (H200 2026-12-02: OLMoE T = 256 238.8 / 238.5 us, DeepSeek-V3 T = 1024
    5819 / 5822), so it is a bound, not a speed-up; those buckets now compile lighter few-slot
    tiles (kernels/experts.py LIGHT_FEW_BLOCK_M). `few_slots_config` applies it to every larger
    bucket of a shape without a tuned table (tables keep the few-slot tiles they were tuned
    with)."""
    for name, value in (("few", few), ("main", main)):
        if not isinstance(value, ExpertsConfig):
            raise TypeError(f"{name} must be a safemoe ExpertsConfig, got {type(value).__name__}")
    if isinstance(element_bytes, bool) or not isinstance(element_bytes, int) or element_bytes < 1:
        raise ValueError(f"element_bytes must be an int >= 1, got {element_bytes!r}")
    return _few_tiles_within(few, main, element_bytes)


@functools.lru_cache(maxsize=256)  # asked every forward of an untabled shape
def _few_tiles_within(few: ExpertsConfig, main: ExpertsConfig, element_bytes: int) -> ExpertsConfig:
    tiles = []
    for name, gemm1 in (("gemm1", True), ("gemm2", False)):
        budget = gemm_shared_memory(getattr(main, name), main.block_m, element_bytes, element_bytes, gemm1)
        tiles.append(_fit_pipeline(getattr(few, name), few.block_m, budget, element_bytes, element_bytes,
                                   gemm1))
    if (tiles[0], tiles[1]) == (few.gemm1, few.gemm2):
        return few
    return replace(few, gemm1=tiles[0], gemm2=tiles[1])


def _shared_memory_limit(device_index: int | None) -> int | None:
    """The device's opt-in shared memory a block, bytes; None where it cannot be read (torch does
    not report it, or no CUDA runtime answers: the tuner's CPU tests name a device they fake)."""
    try:
        index = device_index if device_index is not None else torch.cuda.current_device()
        return _device_shared_memory(index)
    except (AssertionError, RuntimeError):
        return None


@functools.lru_cache(maxsize=16)
def _device_shared_memory(device_index: int) -> int | None:
    props = torch.cuda.get_device_properties(device_index)
    return getattr(props, "shared_memory_per_block_optin", None)
