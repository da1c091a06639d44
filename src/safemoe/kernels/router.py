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

How (everything in registers, one program per BLOCK_T rows):
1. Load the row tile [BLOCK_T, NG_PAD, GS_PAD] (groups x experts-in-group, each padded to a power of
   two, so non-power-of-two E and group sizes such as E=160 / 8 groups of 20 need no special case),
   upcast to fp32 and sanitise.
2. Score (softmax or sigmoid) in fp32; selection = score + sanitised bias, clamped to +-FLT_MAX.
3. Each selection score becomes one int64 key: the order-preserving integer image of its fp32 bits
   in the upper half and (2^31 - 1 - expert) in the lower half. Keys are unique per row, and key
   order is exactly "larger score first, then lower index", the reference's total order (the packed
   (score, index) idea is the one SGLang's and triton_kernels' top-k kernels use). Columns that may
   not be picked (past E, or in a dropped group) get DEAD_KEY, a value no real key can take: its
   upper half is the image of a NaN bit pattern and sanitised scores are never NaN.
4. Group-limited selection: group score = sum of its two best selection scores, the best
   `topk_group` groups (ties to the lower group index, by the same kind of key) stay eligible.
5. Top-K over the keys: either K passes of "max among keys below the previous max" (a decreasing
   chain of unique keys, so K distinct ids) or Triton's bitonic tl.topk on the same keys. Both give
   the same K keys in the same order; the faster one per shape is chosen by `_pick_config`.
6. Weights: the unbiased scores of the picked experts, renormalised in fp32 with a zero floor and
   multiplied by routed_scaling_factor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from safemoe._checks import NumValid, RouteArgs
from safemoe.health import HEALTH_SLOTS, NONFINITE_ROWS, PADDED_ROWS

FLT_MAX = tl.constexpr(3.4028234663852886e38)
# Below every real key: its upper half (0x80000000) is the ordered image of the NaN bits 0xFFFFFFFF.
DEAD_KEY = tl.constexpr(-(2**63) + 1)
LOW_MASK = tl.constexpr(0x7FFFFFFF)  # lower half of a key: expert ^ LOW_MASK == LOW_MASK - expert
_NONFINITE_ROWS = tl.constexpr(NONFINITE_ROWS)
_PADDED_ROWS = tl.constexpr(PADDED_ROWS)


@triton.jit
def _ordered(x):
    """fp32 -> int32 whose signed order is the float order (NaN-free input, -0.0 canonicalised)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _unordered(o):
    """Inverse of _ordered: int32 -> fp32."""
    return (o ^ ((o >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _make_key(value, index):
    return (_ordered(value).to(tl.int64) << 32) | (index ^ LOW_MASK).to(tl.int64)


@triton.jit
def _key_value(key):
    return _unordered((key >> 32).to(tl.int32))


@triton.jit
def _key_index(key):
    return ((key & LOW_MASK) ^ LOW_MASK).to(tl.int32)


@triton.jit
def _sanitize(x, SANITIZE: tl.constexpr):
    # reference.sanitize_logits: nan -> -FLT_MAX, then clamp to +-FLT_MAX (+-inf included).
    if SANITIZE:
        x = tl.where(x != x, -FLT_MAX, x)
        x = tl.minimum(tl.maximum(x, -FLT_MAX), FLT_MAX)
    return x


@triton.jit
def _max_chain_topk(keys, K_PAD: tl.constexpr, TOP_K: tl.constexpr):
    """[R, P] unique keys -> [R, K_PAD] the TOP_K largest, descending (columns >= TOP_K: DEAD_KEY)."""
    kcol = tl.arange(0, K_PAD)[None, :]
    prev = tl.max(keys, axis=1)
    out = tl.where(kcol == 0, prev[:, None], DEAD_KEY)
    for k in tl.static_range(1, TOP_K):
        # Keys are unique, so "below the previous pick" removes exactly the picked columns.
        prev = tl.max(tl.where(keys < prev[:, None], keys, DEAD_KEY), axis=1)
        out = tl.where(kcol == k, prev[:, None], out)
    return out


@triton.jit
def _route_rows(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, health_ptr,
    rows, row_in, row_valid, routed_scaling_factor,
    NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
    N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
    NG_PAD: tl.constexpr, GS_PAD: tl.constexpr,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
    GROUPED: tl.constexpr, HAS_HEALTH: tl.constexpr, SANITIZE: tl.constexpr, BITONIC: tl.constexpr,
):
    """Route the rows `rows` [BLOCK_T] and store their outputs; row_in: row < T, row_valid: row <
    num_valid (only those rows are loaded)."""
    group = tl.arange(0, NG_PAD)[None, :, None]
    inner = tl.arange(0, GS_PAD)[None, None, :]
    expert = group * GROUP_SIZE + inner  # [1, NG_PAD, GS_PAD] expert id of each slot
    in_range = (group < N_GROUP) & (inner < GROUP_SIZE)

    # int64: row * E passes 2^31 at T = 4.2M, E = 512.
    row_offsets = rows.to(tl.int64) * NUM_EXPERTS
    load_mask = row_valid[:, None, None] & in_range
    x = tl.load(logits_ptr + row_offsets[:, None, None] + expert, mask=load_mask, other=0.0)
    x = x.to(tl.float32)  # [BLOCK_T, NG_PAD, GS_PAD]

    if HAS_HEALTH:
        bad = (x != x) | (tl.abs(x) == float("inf"))
        bad_rows = tl.max(tl.max(bad.to(tl.int32), axis=2), axis=1)
        num_bad = tl.sum(tl.where(row_valid, bad_rows, 0).to(tl.int64), axis=0)
        tl.atomic_add(health_ptr + _NONFINITE_ROWS, num_bad, mask=num_bad > 0, sem="relaxed")

    x = _sanitize(x, SANITIZE)
    if SIGMOID:
        scores = tl.sigmoid(x)
    else:
        x = tl.where(in_range, x, float("-inf"))
        row_max = tl.max(tl.max(x, axis=2), axis=1)  # finite: sanitised logits are finite
        unnormalised = tl.exp(x - row_max[:, None, None])  # 0 on out-of-range slots
        inv_sum = 1.0 / tl.sum(tl.sum(unnormalised, axis=2), axis=1)  # sum >= 1
        scores = unnormalised * inv_sum[:, None, None]

    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert, mask=in_range, other=0.0).to(tl.float32)
        select = scores + _sanitize(bias, True)
        select = tl.minimum(tl.maximum(select, -FLT_MAX), FLT_MAX)
        select = tl.where(select == 0.0, 0.0, select)  # -0.0 -> +0.0: keys must not split a tie
    else:
        select = scores  # >= +0.0 (exp and sigmoid never give -0.0)

    keys = tl.where(in_range, _make_key(select, expert), DEAD_KEY)

    if GROUPED:
        # Group score: sum of the group's two best selection scores (its one score if it has one).
        best = tl.max(keys, axis=2)  # [BLOCK_T, NG_PAD]
        group_score = _key_value(best)
        if GROUP_SIZE > 1:
            second = tl.max(tl.where(keys < best[:, :, None], keys, DEAD_KEY), axis=2)
            group_score = group_score + _key_value(second)
        group_score = tl.where(group_score == 0.0, 0.0, group_score)  # may be +-inf, never NaN
        group_id = tl.arange(0, NG_PAD)[None, :]
        group_keys = tl.where(group_id < N_GROUP, _make_key(group_score, group_id), DEAD_KEY)
        # The TOPK_GROUP-th largest group key; the groups at or above it stay eligible.
        last_kept = tl.max(group_keys, axis=1)
        for _ in tl.static_range(1, TOPK_GROUP):
            last_kept = tl.max(tl.where(group_keys < last_kept[:, None], group_keys, DEAD_KEY), axis=1)
        kept = group_keys >= last_kept[:, None]
        keys = tl.where(kept[:, :, None], keys, DEAD_KEY)

    flat = tl.reshape(keys, [keys.shape[0], NG_PAD * GS_PAD])
    if BITONIC and K_PAD > 1:
        top = tl.topk(flat, K_PAD)  # [BLOCK_T, K_PAD] descending
    else:
        top = _max_chain_topk(flat, K_PAD, TOP_K)

    kcol = tl.arange(0, K_PAD)[None, :]
    slot_mask = row_valid[:, None] & (kcol < TOP_K)
    ids = _key_index(top)  # [BLOCK_T, K_PAD]
    if HAS_BIAS:
        # The biased key does not hold the weight; recompute the K unbiased scores from the logits
        # (cached: this program just read the row), identically to the scores above.
        picked = tl.load(logits_ptr + row_offsets[:, None] + ids, mask=slot_mask, other=0.0)
        picked = _sanitize(picked.to(tl.float32), SANITIZE)
        if SIGMOID:
            weights = tl.sigmoid(picked)
        else:
            weights = tl.exp(picked - row_max[:, None]) * inv_sum[:, None]
    else:
        weights = _key_value(top)
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
    NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
    N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
    NG_PAD: tl.constexpr, GS_PAD: tl.constexpr,
    # modes
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, GROUPED: tl.constexpr,
    HAS_NUM_VALID_PTR: tl.constexpr, HAS_HEALTH: tl.constexpr,
    SANITIZE: tl.constexpr, HAS_PADDING: tl.constexpr,
    # tunable
    BLOCK_T: tl.constexpr, BITONIC: tl.constexpr,
):
    """One program routes rows [pid * BLOCK_T, pid * BLOCK_T + BLOCK_T) of T = num_tokens.

    logits_ptr: [T, E] contiguous; bias_ptr: [E] (read iff HAS_BIAS); num_valid_ptr: 0-dim int32/64
    (read iff HAS_NUM_VALID_PTR, else num_valid_count); weights_ptr: [T, K] fp32 out; ids_ptr:
    [T, K] int32 out; health_ptr: int64 [>= 8] (iff HAS_HEALTH). SANITIZE / HAS_PADDING off build the
    unsafe variant the bench compares against (then every row < T is valid, NaN propagates).
    """
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
            NUM_EXPERTS, TOP_K, K_PAD, N_GROUP, GROUP_SIZE, TOPK_GROUP, NG_PAD, GS_PAD,
            SIGMOID, HAS_BIAS, RENORMALIZE, GROUPED, HAS_HEALTH, SANITIZE, BITONIC,
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
    bitonic: bool  # top-K by tl.topk instead of K max passes (same result)


def _pick_config(num_tokens: int, num_experts: int, top_k: int, elem_size: int) -> RouterConfig:
    """Heuristic over shapes. One row spans at most a warp (reductions stay in shuffles): a thread
    loads 16 bytes, so a row takes E_PAD * elem_size / 16 lanes; small T keeps one row per lane group
    (latency), large T packs more rows per program (fewer programs, more independent work)."""
    e_pad = triton.next_power_of_2(num_experts)
    per_thread = max(1, 16 // elem_size)
    lanes_per_row = max(1, min(32, e_pad // per_thread))
    rows_per_warp = 32 // lanes_per_row
    num_warps = 4
    rows_per_lane_group = 1 if num_tokens <= 256 else 2
    block_t = rows_per_warp * num_warps * rows_per_lane_group
    block_t = max(1, min(block_t, triton.next_power_of_2(max(num_tokens, 1))))
    return RouterConfig(block_t=block_t, num_warps=num_warps, bitonic=False)


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


def _launch(
    logits: torch.Tensor,
    args: RouteArgs,
    *,
    bias: torch.Tensor | None,
    num_valid: NumValid,
    health: torch.Tensor | None,
    weights_out: torch.Tensor,
    ids_out: torch.Tensor,
    config: RouterConfig | None = None,
    sanitize: bool = True,
    padding: bool = True,
) -> None:
    num_tokens, num_experts = logits.shape
    if num_tokens == 0:
        return
    if num_tokens >= 2**31 - 2**20:
        raise ValueError(f"logits has T={num_tokens} rows; the router supports T < 2^31 - 2^20")
    top_k = args.top_k
    if config is None:
        config = _pick_config(num_tokens, num_experts, top_k, logits.element_size())
    grouped = args.n_group is not None and args.n_group > 1
    n_group = args.n_group if grouped else 1
    topk_group = args.topk_group if grouped else 1
    assert n_group is not None and topk_group is not None
    group_size = num_experts // n_group
    nv_tensor = num_valid.tensor
    nv_count = num_valid.count if num_valid.count is not None else num_tokens
    grid = (triton.cdiv(num_tokens, config.block_t),)  # one program per BLOCK_T rows
    _router_kernel[grid](
        # inputs
        logits, bias if bias is not None else logits, nv_tensor if nv_tensor is not None else logits,
        # outputs
        weights_out, ids_out, health if health is not None else weights_out,
        # shapes and scalars
        num_tokens, nv_count, float(args.routed_scaling_factor),
        NUM_EXPERTS=num_experts, TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
        N_GROUP=n_group, GROUP_SIZE=group_size, TOPK_GROUP=topk_group,
        NG_PAD=triton.next_power_of_2(n_group), GS_PAD=triton.next_power_of_2(group_size),
        # modes
        SIGMOID=args.scoring == "sigmoid", HAS_BIAS=bias is not None, RENORMALIZE=args.renormalize,
        GROUPED=grouped, HAS_NUM_VALID_PTR=nv_tensor is not None, HAS_HEALTH=health is not None,
        SANITIZE=sanitize, HAS_PADDING=padding,
        # tunable
        BLOCK_T=config.block_t, BITONIC=config.bitonic, num_warps=config.num_warps,
    )


def route_into(
    logits: torch.Tensor,
    args: RouteArgs,
    *,
    bias: torch.Tensor | None,
    num_valid: NumValid,
    health: torch.Tensor | None,
    weights_out: torch.Tensor,
    ids_out: torch.Tensor,
) -> None:
    """Route into preallocated `weights_out` [T, K] float32 and `ids_out` [T, K] int32.

    Allocation-free and sync-free: safe inside CUDA-graph capture. Arguments are assumed validated
    by `safemoe.routing.route`'s checks (`_checks.check_route_args`, `check_num_valid`,
    `health.check_health`); the output buffers are checked here.
    """
    _check_outputs(weights_out, ids_out, logits.shape[0], args.top_k, logits.device)
    if health is not None and health.numel() < HEALTH_SLOTS:
        raise ValueError(f"health must hold {HEALTH_SLOTS} int64 counters, got {health.numel()}")
    _launch(logits, args, bias=bias, num_valid=num_valid, health=health,
            weights_out=weights_out, ids_out=ids_out)


def route_triton(
    logits: torch.Tensor,
    args: RouteArgs,
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
