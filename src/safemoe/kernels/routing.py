"""Fused router kernel: logits [T, E] -> (weights [T, K] float32, ids [T, K] int32) in one launch.

Contract (docs/contract.md, spec `safemoe.reference.route_reference`):
- logits: [T, E] bf16 / fp16 / fp32, contiguous. bias: optional [E], any float dtype, selection only.
- Valid rows (row < num_valid) get K distinct ids in [0, E) and finite weights >= 0, whatever the
  logits hold: NaN -> -FLT_MAX and +-Inf -> +-FLT_MAX before scoring, ties go to the lowest index.
- Rows at or past num_valid are never loaded; they get ids -1 and weights 0.
- num_valid: a host int, or a 0-dim int32/int64 device tensor that the kernel loads and clamps to
  [0, T] (no host sync, so a captured CUDA graph replays for any count written in place).
- health (optional int64 [>= 8], safemoe.health): slot NONFINITE_ROWS += valid rows holding a
  non-finite logit, slot PADDED_ROWS += T - num_valid. Device atomics only, never read here.

How (everything in registers, one program per BLOCK_T rows, rows past num_valid never loaded):
1. Load the [BLOCK_T, E_PAD] tile (E_PAD = next power of two >= E), upcast to fp32, sanitise.
2. Score (softmax or sigmoid) in fp32; selection = score + sanitised bias (the reference's clamp
   to +-FLT_MAX is a no-op there: see the comment at the bias).
3. Each selection score becomes its order-preserving int32 image (`_ordered`: integer order ==
   float order), so row maxima are integer reductions (one REDUX instruction per warp on sm_90)
   and a top-K pass costs ~6 instructions per element, against ~10 with packed 64-bit
   (score, index) keys (SASS counts in docs/router.md).
   Columns that may not be picked (past E, already picked, in a dropped group) hold DEAD =
   INT32_MIN, strictly below every real value: the smallest real one is the image of -FLT_MAX
   (0x80800000); INT32_MIN is the image of a NaN bit pattern, and sanitised scores are never NaN.
4. Group-limited selection: group score = sum of the group's two best selection scores (its one
   score if it has one; a tie for the best counts twice), or its best one (group_score="max",
   GROUP_TOP2 off), the best `topk_group` groups stay eligible, ties to the lower group index.
   Power-of-two groups that tile E use one [R, G, S] view; other group sizes (E=160: 8 groups of
   20) one masked pass per group.
5. Top-K: K passes of "max, then the lowest column holding it, then mark it DEAD". The max is
   over live columns only and each pass kills exactly one live column, so the K ids are distinct,
   in [0, E), in the reference's total order (larger score first, ties to the lower index).
Batch invariance: a row's arithmetic is its own (row-wise reductions), but how a row is spread
over lanes, and so the order of the float sums (softmax denominator, renormalisation), follows the
[BLOCK_T, E_PAD] tile and num_warps, which the shipped pick varies with T. With `batch_invariant`
the launch config is `batch_invariant_router_config`, one for every T of a shape.

6. Weights: the unbiased scores of the picked experts (decoded from the ordered image, or
   recomputed from the cached logits when a bias moved the selection), renormalised in fp32 with
   a zero floor, times routed_scaling_factor.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from safemoe._checks import NumValid
from safemoe.configs import CONFIG_DIR
from safemoe.health import HEALTH_SLOTS, NONFINITE_ROWS, PADDED_ROWS
from safemoe.kernels.launch import (
    cdiv,
    launch_options,
    next_power_of_2,
    pdl_usable,
    wait_for_previous_kernel,
)
from safemoe.numerics import FLT_MAX as _FLT_MAX
from safemoe.route_config import RouteConfig

FLT_MAX = tl.constexpr(_FLT_MAX)
DEAD = tl.constexpr(-(2**31))  # below _ordered(-FLT_MAX) = 0x80800000 (see step 3 above)
_NONFINITE_ROWS = tl.constexpr(NONFINITE_ROWS)
_PADDED_ROWS = tl.constexpr(PADDED_ROWS)


@triton.jit
def _ordered(x):
    """fp32 -> int32 whose signed order is the float order (NaN-free input; -0.0 sorts below +0.0,
    so callers canonicalise -0.0 first where it can occur)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _unordered(o):
    """Inverse of _ordered: int32 -> fp32."""
    return (o ^ ((o >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _sanitize(x, SANITIZE: tl.constexpr, UPPER: tl.constexpr = True):
    """reference.sanitize_logits: nan -> -FLT_MAX, then clamp to +-FLT_MAX (+-inf included).

    tl.maximum's default (PropagateNan.NONE) is IEEE maxNum: max(NaN, -FLT_MAX) = -FLT_MAX, so
    two min/max instructions do all three replacements. UPPER=False skips the +inf clamp where it
    changes nothing (sigmoid(+inf) == sigmoid(FLT_MAX) == 1)."""
    if SANITIZE:
        x = tl.maximum(x, -FLT_MAX)
        if UPPER:
            x = tl.minimum(x, FLT_MAX)
    return x


@triton.jit
def _pick(values, index, NONE: tl.constexpr):
    """One pass over [R, N] ordered values: (max [R], the lowest index holding it [R])."""
    best = tl.max(values, axis=1)
    position = tl.min(tl.where(values == best[:, None], index, NONE), axis=1)
    return best, position


@triton.jit
def _topk(values, index, K_PAD: tl.constexpr, TOP_K: tl.constexpr, NONE: tl.constexpr):
    """[R, N] ordered values (DEAD = not eligible) -> ([R, K_PAD] the TOP_K largest, descending,
    [R, K_PAD] their indices); ties go to the lowest index, so the order is total."""
    kcol = tl.arange(0, K_PAD)[None, :]
    top = tl.full([values.shape[0], K_PAD], DEAD, tl.int32)
    top_index = tl.zeros([values.shape[0], K_PAD], tl.int32)
    for k in tl.static_range(TOP_K):
        best, position = _pick(values, index, NONE)
        top = tl.where(kcol == k, best[:, None], top)
        top_index = tl.where(kcol == k, position[:, None], top_index)
        if k + 1 < TOP_K:
            values = tl.where(index == position[:, None], DEAD, values)
    return top, top_index


@triton.jit
def _group_score(best, second):
    """Ordered image of (best + second) as floats; +-inf possible, NaN not, -0.0 canonicalised."""
    total = _unordered(best) + _unordered(second)
    return _ordered(tl.where(total == 0.0, 0.0, total))


@triton.jit
def _group_limit(
    values, expert,
    NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr,
    TOPK_GROUP: tl.constexpr, NG_PAD: tl.constexpr, GROUP_RESHAPE: tl.constexpr, GROUP_TOP2: tl.constexpr,
):
    """values [R, E_PAD] with the experts outside the best TOPK_GROUP groups set to DEAD. A group
    scores the sum of its two best values (GROUP_TOP2) or its best one."""
    rows: tl.constexpr = values.shape[0]
    group_id = tl.arange(0, NG_PAD)[None, :]
    if GROUP_RESHAPE:
        # Power-of-two groups tiling E exactly: one [R, G, S] view, reductions along S.
        grouped = tl.reshape(values, [rows, N_GROUP, GROUP_SIZE])
        column = tl.reshape(expert, [1, N_GROUP, GROUP_SIZE])
        best = tl.max(grouped, axis=2)  # [R, G]
        group_scores = best
        if GROUP_SIZE > 1:  # noqa: SIM102 (compile-time constants, kept apart for the Triton front end)
            if GROUP_TOP2:
                first = tl.min(tl.where(grouped == best[:, :, None], column, E_PAD), axis=2)
                second = tl.max(tl.where(column == first[:, :, None], DEAD, grouped), axis=2)
                group_scores = _group_score(best, second)
        kept_groups = tl.zeros([rows, N_GROUP], tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            _, g = _pick(group_scores, group_id, NG_PAD)
            kept_groups = kept_groups | (group_id == g[:, None])
            group_scores = tl.where(group_id == g[:, None], DEAD, group_scores)
        grouped = tl.where(kept_groups[:, :, None], grouped, DEAD)
        values = tl.reshape(grouped, [rows, E_PAD])
    else:
        # Any group size (E=160: 8 groups of 20): one masked pass per group over the padded row.
        group_of = expert // GROUP_SIZE  # [1, E_PAD]; >= N_GROUP past E
        group_scores = tl.full([rows, NG_PAD], DEAD, tl.int32)
        for g in tl.static_range(N_GROUP):
            member = group_of == g
            best, first = _pick(tl.where(member, values, DEAD), expert, E_PAD)
            score = best
            if GROUP_SIZE > 1:  # noqa: SIM102 (as above)
                if GROUP_TOP2:
                    second = tl.max(tl.where(member & (expert != first[:, None]), values, DEAD), axis=1)
                    score = _group_score(best, second)
            group_scores = tl.where(group_id == g, score[:, None], group_scores)
        kept = tl.zeros(values.shape, tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            _, g = _pick(group_scores, group_id, NG_PAD)
            kept = kept | (group_of == g[:, None])
            group_scores = tl.where(group_id == g[:, None], DEAD, group_scores)
        values = tl.where(kept, values, DEAD)
    return values


@triton.jit
def _route_rows(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, health_ptr,
    rows, row_in, row_valid, routed_scaling_factor,
    NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
    N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
    NG_PAD: tl.constexpr, GROUP_RESHAPE: tl.constexpr, GROUP_TOP2: tl.constexpr,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
    GROUPED: tl.constexpr, HAS_HEALTH: tl.constexpr, SANITIZE: tl.constexpr,
):
    """Route the rows `rows` [BLOCK_T] and store their outputs; row_in: row < T, row_valid: row <
    num_valid (only those rows are loaded)."""
    expert = tl.arange(0, E_PAD)[None, :]  # [1, E_PAD]
    in_range = expert < NUM_EXPERTS
    PAD_COLUMNS: tl.constexpr = NUM_EXPERTS < E_PAD  # else the column masks are compiled out

    # int64: row * E passes 2^31 at T = 4.2M, E = 512.
    row_offsets = rows.to(tl.int64) * NUM_EXPERTS
    load_mask = row_valid[:, None] & in_range
    x = tl.load(logits_ptr + row_offsets[:, None] + expert, mask=load_mask, other=0.0)
    x = x.to(tl.float32)  # [BLOCK_T, E_PAD]

    if HAS_HEALTH:
        bad = (x != x) | (tl.abs(x) == float("inf"))
        bad_rows = tl.max(bad.to(tl.int32), axis=1)
        num_bad = tl.sum(tl.where(row_valid, bad_rows, 0).to(tl.int64), axis=0)
        tl.atomic_add(health_ptr + _NONFINITE_ROWS, num_bad, mask=num_bad > 0, sem="relaxed")

    if SIGMOID:
        scores = tl.sigmoid(_sanitize(x, SANITIZE, False))
    else:
        x = _sanitize(x, SANITIZE)
        if PAD_COLUMNS:
            x = tl.where(in_range, x, float("-inf"))
        row_max = tl.max(x, axis=1)  # finite: sanitised logits are finite
        unnormalised = tl.exp(x - row_max[:, None])  # 0 on out-of-range columns
        inv_sum = 1.0 / tl.sum(unnormalised, axis=1)  # sum >= 1
        scores = unnormalised * inv_sum[:, None]

    if HAS_BIAS:
        # Loaded as a [BLOCK_T, E_PAD] tile (L1 hits): a [1, E_PAD] load gets a layout with warps
        # along E, and Triton then reduces every row across warps (shared memory + barriers).
        bias = tl.load(bias_ptr + (expert + 0 * rows[:, None]), mask=in_range, other=0.0).to(tl.float32)
        # The reference clamps score + bias to +-FLT_MAX and no -0.0 can arise: a score is in
        # [+0, 1] and a sanitised bias in [-FLT_MAX, FLT_MAX], so the sum is finite (1 is below
        # half an ulp of FLT_MAX) and -0.0 would need -0.0 + -0.0. Nothing to do here.
        select = scores + _sanitize(bias, True)
    else:
        select = scores  # in [+0, 1]: exp and sigmoid never give -0.0

    values = _ordered(select)  # [BLOCK_T, E_PAD] int32
    if PAD_COLUMNS:
        values = tl.where(in_range, values, DEAD)
    if GROUPED:
        values = _group_limit(values, expert, NUM_EXPERTS, E_PAD, N_GROUP, GROUP_SIZE, TOPK_GROUP, NG_PAD,
                              GROUP_RESHAPE, GROUP_TOP2)
    top, ids = _topk(values, expert, K_PAD, TOP_K, E_PAD)  # [BLOCK_T, K_PAD] each

    kcol = tl.arange(0, K_PAD)[None, :]
    slot_mask = row_valid[:, None] & (kcol < TOP_K)
    if HAS_BIAS:
        # The biased selection does not hold the weight; recompute the K unbiased scores from the
        # logits (cached: this program just read the row), exactly as the scores above.
        picked = tl.load(logits_ptr + row_offsets[:, None] + ids, mask=slot_mask, other=0.0)
        picked = _sanitize(picked.to(tl.float32), SANITIZE)
        if SIGMOID:
            weights = tl.sigmoid(picked)
        else:
            weights = tl.exp(picked - row_max[:, None]) * inv_sum[:, None]
    else:
        weights = _unordered(top)
    weights = tl.where(slot_mask, weights, 0.0)
    if RENORMALIZE:
        total = tl.sum(weights, axis=1)
        weights = tl.where(total[:, None] > 0.0, weights / tl.where(total > 0.0, total, 1.0)[:, None], 0.0)
    weights = weights * routed_scaling_factor

    out_offsets = rows.to(tl.int64)[:, None] * TOP_K + kcol
    store_mask = row_in[:, None] & (kcol < TOP_K)
    tl.store(ids_ptr + out_offsets, tl.where(slot_mask, ids, -1), mask=store_mask)
    tl.store(weights_ptr + out_offsets, weights, mask=store_mask)


@triton.jit(do_not_specialize=["num_tokens", "num_valid_count"])
def _router_kernel(
    # inputs
    logits_ptr, bias_ptr, num_valid_ptr,
    # outputs
    weights_ptr, ids_ptr, health_ptr,
    # shapes and scalars
    num_tokens, num_valid_count, routed_scaling_factor,
    NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
    N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
    NG_PAD: tl.constexpr, GROUP_RESHAPE: tl.constexpr, GROUP_TOP2: tl.constexpr,
    # modes
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, GROUPED: tl.constexpr,
    HAS_NUM_VALID_PTR: tl.constexpr, HAS_HEALTH: tl.constexpr,
    SANITIZE: tl.constexpr, HAS_PADDING: tl.constexpr,
    USE_PDL: tl.constexpr,
    # tunable
    BLOCK_T: tl.constexpr,
):
    """One program routes rows [pid * BLOCK_T, pid * BLOCK_T + BLOCK_T) of T = num_tokens.

    logits_ptr: [T, E] contiguous; bias_ptr: [E] (read iff HAS_BIAS); num_valid_ptr: 0-dim int32/64
    (read iff HAS_NUM_VALID_PTR, else num_valid_count); weights_ptr: [T, K] fp32 out; ids_ptr:
    [T, K] int32 out; health_ptr: int64 [>= 8] (iff HAS_HEALTH). SANITIZE / HAS_PADDING off build the
    unsafe variant the bench compares against (then every row < T is valid, NaN propagates).
    USE_PDL: launched with programmatic dependent launch (the launch overlaps the previous kernel's
    tail); nothing is read or written before that kernel has finished.
    """
    wait_for_previous_kernel(USE_PDL)
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    if HAS_PADDING:
        if HAS_NUM_VALID_PTR:
            num_valid = tl.load(num_valid_ptr).to(tl.int64)
            num_valid = tl.minimum(tl.maximum(num_valid, 0), num_tokens).to(tl.int32)
        else:
            num_valid = num_valid_count
        if HAS_HEALTH:  # noqa: SIM102 (HAS_HEALTH is a compile-time constant, pid is not)
            if pid == 0:  # one atomic per call, not per program
                tl.atomic_add(health_ptr + _PADDED_ROWS, (num_tokens - num_valid).to(tl.int64),
                              mask=num_valid < num_tokens, sem="relaxed")
    else:
        num_valid = num_tokens
    in_rows = rows < num_tokens
    if pid * BLOCK_T < num_valid:
        _route_rows(
            logits_ptr, bias_ptr, weights_ptr, ids_ptr, health_ptr,
            rows, in_rows, rows < num_valid, routed_scaling_factor,
            NUM_EXPERTS, E_PAD, TOP_K, K_PAD, N_GROUP, GROUP_SIZE, TOPK_GROUP, NG_PAD, GROUP_RESHAPE,
            GROUP_TOP2, SIGMOID, HAS_BIAS, RENORMALIZE, GROUPED, HAS_HEALTH, SANITIZE,
        )
    else:
        # Only padding rows here: nothing to load, just the sentinels.
        kcol = tl.arange(0, K_PAD)[None, :]
        out_offsets = rows.to(tl.int64)[:, None] * TOP_K + kcol
        store_mask = in_rows[:, None] & (kcol < TOP_K)
        tl.store(ids_ptr + out_offsets, tl.full([BLOCK_T, K_PAD], -1, tl.int32), mask=store_mask)
        tl.store(weights_ptr + out_offsets, tl.zeros([BLOCK_T, K_PAD], tl.float32), mask=store_mask)


@dataclass(frozen=True)
class RouterConfig:
    """Launch configuration; a function of shapes only (chosen before any graph capture)."""

    block_t: int  # rows per program (power of two)
    num_warps: int


# The launch configs tuned per shape (bf16 logits) live in configs/router.json; how each was
# measured is in its entries. Other shapes and dtypes take the heuristic of _pick_config.
ROUTER_TABLE = CONFIG_DIR / "router.json"
_NUM_WARPS = (1, 2, 4, 8, 16, 32)

RouterTable = dict[tuple[int, int, bool], tuple[tuple[int, int, int], ...]]


def load_router_table(path: Path) -> RouterTable:
    """{(E padded to a power of two, K, grouped): ((largest T, block_t, num_warps), ...)} from a
    router table file; ValueError naming the file and the entry for anything malformed."""
    try:
        entries = json.loads(Path(path).read_text())["entries"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        reason = f"{type(error).__name__}: {error}"
        raise ValueError(f"router table {str(path)!r} is not readable: {reason}") from None
    table: RouterTable = {}
    for n, entry in enumerate(entries):
        where = f"router table {str(path)!r}, entry {n}"
        try:
            key = (int(entry["experts_padded"]), int(entry["top_k"]), bool(entry["grouped"]))
            buckets = tuple((int(t), int(b), int(w)) for t, b, w in entry["buckets"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{where}: {type(error).__name__}: {error}") from None
        e_pad, top_k, _ = key
        if e_pad < 1 or e_pad & (e_pad - 1) or not 1 <= top_k <= e_pad:
            raise ValueError(f"{where}: experts_padded must be a power of two >= top_k >= 1, got {key}")
        if key in table:
            raise ValueError(f"{where}: {key} appears twice")
        tokens = [t for t, _, _ in buckets]
        if not buckets or tokens != sorted(set(tokens)) or tokens[0] < 1:
            raise ValueError(f"{where}: buckets must be non-empty, by strictly rising T >= 1, got {tokens}")
        for _, block_t, num_warps in buckets:
            if block_t < 1 or block_t & (block_t - 1) or num_warps not in _NUM_WARPS:
                raise ValueError(f"{where}: block_t must be a power of two and num_warps one of "
                                 f"{_NUM_WARPS}, got block_t {block_t}, num_warps {num_warps}")
        table[key] = buckets
    return table


@functools.lru_cache(maxsize=1)
def tuned_router_table() -> RouterTable:
    """The shipped table (configs/router.json), read once."""
    return load_router_table(ROUTER_TABLE)


def _pick_config(num_tokens: int, num_experts: int, top_k: int, elem_size: int,
                 grouped: bool = False) -> RouterConfig:
    """Config for a shape: the tuned table where it has the shape, else a heuristic. A row spans at
    most one warp, so its reductions stay inside the warp (no shared memory, no barriers); at 16
    bytes per thread a row takes E_PAD * elem_size / 16 lanes."""
    e_pad = next_power_of_2(num_experts)
    cap = next_power_of_2(max(num_tokens, 1))
    tuned = tuned_router_table().get((e_pad, top_k, grouped)) if elem_size == 2 else None
    if tuned is not None:
        block_t, num_warps = next(((b, w) for t, b, w in tuned if num_tokens <= t), tuned[-1][1:])
        return RouterConfig(block_t=min(block_t, cap), num_warps=num_warps)
    lanes_per_row = max(1, min(32, e_pad * elem_size // 16))
    rows_per_warp = 32 // lanes_per_row
    num_warps = 2 if num_tokens <= 256 else 4
    block_t = rows_per_warp * num_warps * (1 if num_tokens <= 256 else 2)
    return RouterConfig(block_t=min(block_t, cap), num_warps=num_warps)


def batch_invariant_router_config(num_experts: int, top_k: int, elem_size: int,
                                  grouped: bool = False) -> RouterConfig:
    """The launch config batch-invariant mode uses for every T: the pick for
    BATCH_INVARIANT_TOKENS tokens (its block_t is never capped by a smaller T)."""
    from safemoe.configs import BATCH_INVARIANT_TOKENS

    return _pick_config(BATCH_INVARIANT_TOKENS, num_experts, top_k, elem_size, grouped)


def candidate_configs(num_tokens: int, num_experts: int, top_k: int, elem_size: int,
                      grouped: bool = False) -> list[RouterConfig]:
    """The configs the bench's tuning sweep times for one shape (the shipped pick first): 1 to 8
    warps, 1 row per warp up to 64 elements per thread, at least min(4, E_PAD) per thread."""
    e_pad = next_power_of_2(num_experts)
    cap = next_power_of_2(max(num_tokens, 1))
    configs = [_pick_config(num_tokens, num_experts, top_k, elem_size, grouped)]
    for num_warps in (1, 2, 4, 8):
        for rows_per_warp in (1, 2, 4, 8, 16, 32, 64):
            per_thread = e_pad * rows_per_warp // 32
            if not min(4, e_pad) <= per_thread <= 64:
                continue
            config = RouterConfig(block_t=min(num_warps * rows_per_warp, cap), num_warps=num_warps)
            if config not in configs:
                configs.append(config)
    return configs


def _check_outputs(weights_out: torch.Tensor, ids_out: torch.Tensor, num_tokens: int, top_k: int,
                   device: torch.device) -> None:
    shape = (num_tokens, top_k)
    for name, t, dtype in (("weights_out", weights_out, torch.float32), ("ids_out", ids_out, torch.int32)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"{name} must be {dtype} of shape {shape}, got {t.dtype} {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name} must be on {device}, got {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def router_pdl(device: torch.device) -> bool:
    """Whether the router launches with programmatic dependent launch: on Hopper and newer GPUs
    where this Triton has the launch option. Its launch then overlaps the tail of whatever ran
    before it (the gate GEMM, or the previous layer), and the expert kernels after it overlap its
    own (they launch with PDL too)."""
    return pdl_usable(device)


def launch_router(
    logits: torch.Tensor,
    args: RouteConfig,
    *,
    bias: torch.Tensor | None,
    num_valid: NumValid,
    health: torch.Tensor | None,
    weights_out: torch.Tensor,
    ids_out: torch.Tensor,
    config: RouterConfig | None = None,
    sanitize: bool = True,
    padding: bool = True,
    batch_invariant: bool = False,
) -> None:
    """Launch the router kernel into `weights_out` / `ids_out` with no checks at all: what
    `route_into` runs after its checks, plus the knobs the bench and tests turn. `config`: a
    launch config (default: the shipped pick for the shape, see `candidate_configs`);
    `sanitize=False` / `padding=False` build the kernel without NaN sanitising / num_valid
    handling (what those cost; such a kernel is not safe on garbage or padded rows);
    `batch_invariant`: without a `config`, the one config of every T (see the module docstring)."""
    num_tokens, num_experts = logits.shape
    if num_tokens == 0:
        return
    if num_tokens >= 2**31 - 2**20:
        raise ValueError(f"logits has T={num_tokens} rows; the router supports T < 2^31 - 2^20")
    top_k = args.top_k
    grouped = args.n_group is not None and args.n_group > 1
    if config is None and batch_invariant:
        config = batch_invariant_router_config(num_experts, top_k, logits.element_size(), grouped)
    elif config is None:
        config = _pick_config(num_tokens, num_experts, top_k, logits.element_size(), grouped)
    n_group = args.n_group if grouped else 1
    topk_group = args.topk_group if grouped else 1
    assert n_group is not None and topk_group is not None
    group_size = num_experts // n_group
    e_pad = next_power_of_2(num_experts)
    nv_tensor = num_valid.tensor
    nv_count = num_valid.count if num_valid.count is not None else num_tokens
    grid = (cdiv(num_tokens, config.block_t),)  # one program per BLOCK_T rows
    use_pdl = router_pdl(logits.device)
    _router_kernel[grid](
        # inputs
        logits, bias if bias is not None else logits, nv_tensor if nv_tensor is not None else logits,
        # outputs
        weights_out, ids_out, health if health is not None else weights_out,
        # shapes and scalars
        num_tokens, nv_count, float(args.routed_scaling_factor),
        NUM_EXPERTS=num_experts, E_PAD=e_pad, TOP_K=top_k, K_PAD=next_power_of_2(top_k),
        N_GROUP=n_group, GROUP_SIZE=group_size, TOPK_GROUP=topk_group,
        NG_PAD=next_power_of_2(n_group),
        GROUP_RESHAPE=e_pad == num_experts and group_size & (group_size - 1) == 0,
        GROUP_TOP2=args.group_score == "top2_sum",
        # modes
        SIGMOID=args.scoring == "sigmoid", HAS_BIAS=bias is not None, RENORMALIZE=args.renormalize,
        GROUPED=grouped, HAS_NUM_VALID_PTR=nv_tensor is not None, HAS_HEALTH=health is not None,
        SANITIZE=sanitize, HAS_PADDING=padding, USE_PDL=use_pdl,
        # tunable
        BLOCK_T=config.block_t, num_warps=config.num_warps, **launch_options(use_pdl),
    )


def route_into(
    logits: torch.Tensor,
    args: RouteConfig,
    *,
    bias: torch.Tensor | None,
    num_valid: NumValid,
    health: torch.Tensor | None,
    weights_out: torch.Tensor,
    ids_out: torch.Tensor,
    batch_invariant: bool = False,
) -> None:
    """Route into preallocated `weights_out` [T, K] float32 and `ids_out` [T, K] int32.

    Allocation-free and sync-free: safe inside CUDA-graph capture. Arguments are assumed validated
    by `safemoe.routing.route`'s checks (`_checks.check_route_args`, `check_num_valid`,
    `health.check_health`); the output buffers are checked here.
    """
    _check_outputs(weights_out, ids_out, logits.shape[0], args.top_k, logits.device)
    if health is not None and health.numel() < HEALTH_SLOTS:
        raise ValueError(f"health must hold {HEALTH_SLOTS} int64 counters, got {health.numel()}")
    launch_router(logits, args, bias=bias, num_valid=num_valid, health=health,
                  weights_out=weights_out, ids_out=ids_out, batch_invariant=batch_invariant)




def route_triton(
    logits: torch.Tensor,
    args: RouteConfig,
    *,
    bias: torch.Tensor | None,
    num_valid: NumValid,
    health: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate the outputs and route: returns (weights [T, K] float32, ids [T, K] int32)."""
    num_tokens = logits.shape[0]
    weights = torch.empty(num_tokens, args.top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, args.top_k, dtype=torch.int32, device=logits.device)
    route_into(logits, args, bias=bias, num_valid=num_valid, health=health, weights_out=weights, ids_out=ids)
    return weights, ids
