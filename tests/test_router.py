"""The Triton router kernel against the reference (safemoe.reference.route_reference), on every
device: under the Triton interpreter on CPU (fp16/fp32, small shapes) and compiled on a GPU. The
GPU-only cases add bf16 at every E and mode, 2M rows, T * E > 2^31 (int64 offsets) and a CUDA
graph captured once and replayed with num_valid changed in place and NaN injected between replays.

Every case routes into output buffers poisoned beforehand (NaN weights, stale ids), so an unwritten
element fails. ids must equal the reference exactly; weights within the fp32 tolerance. The
GPU-only cases compare through `_check`, which excludes the rare rows whose selection has a float64
near-tie (< 1e-5): there the GPU's fast exp/sigmoid may order two experts differently from torch.

Also a memcheck driver over small CUDA cases (run it under compute-sanitizer, the caching allocator
off; tests/memcheck.py runs it with the other small CUDA cases):

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \\
        python3 tests/test_router.py
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

import safemoe
from helpers import (
    ADVERSARIAL_ROW_KINDS,
    adversarial_logits,
    assert_close,
    assert_equal,
    poisoned,
    tie_free_logits,
)
from safemoe import _checks
from safemoe.graphs import warm_up
from safemoe.health import NONFINITE_ROWS, PADDED_ROWS, new_health_tensor
from safemoe.kernels import routing as router
from safemoe.reference import route_reference

# -FLT_MAX - FLT_MAX overflows to -inf inside softmax on purpose (exp gives 0); numpy says so.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

# bf16 arithmetic does not run on the interpreter; the GPU-only grid covers it.
DTYPES = (torch.float32, torch.float16)
GPU_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# (E, K, n_group, topk_group) per E: K sampled up to min(E, 32); a grouping where E allows one
# (E=160: 8 groups of 20, E=72: 8 groups of 9, E=8: groups of a single expert).
SHAPES = [
    (1, 1, None, None),
    (6, 2, 3, 2),
    (8, 2, 8, 4),
    (60, 4, 6, 3),
    (64, 6, 8, 4),
    (72, 8, 8, 3),
    (128, 8, 8, 4),
    (160, 6, 8, 3),
    (256, 8, 8, 4),
    (257, 5, None, None),
    (384, 16, 8, 4),
    (512, 32, 8, 4),
]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _args(logits: torch.Tensor, top_k: int, **kwargs) -> _checks.RouteArgs:
    return _checks.check_route_args(
        logits,
        top_k,
        scoring=kwargs.get("scoring", "softmax"),
        renormalize=kwargs.get("renormalize", True),
        bias=kwargs.get("bias"),
        n_group=kwargs.get("n_group"),
        topk_group=kwargs.get("topk_group"),
        routed_scaling_factor=kwargs.get("routed_scaling_factor", 1.0),
        group_score=kwargs.get("group_score", "top2_sum"),
    )


def _reference(logits: torch.Tensor, args: _checks.RouteArgs, bias, nv) -> tuple[torch.Tensor, torch.Tensor]:
    return route_reference(
        logits, args.top_k, scoring=args.scoring, renormalize=args.renormalize, bias=bias,
        n_group=args.n_group, topk_group=args.topk_group,
        routed_scaling_factor=args.routed_scaling_factor, group_score=args.group_score, num_valid=nv,
    )


def _route_both(
    logits: torch.Tensor,
    top_k: int,
    *,
    num_valid: int | torch.Tensor | None = None,
    health: torch.Tensor | None = None,
    config: router.RouterConfig | None = None,
    **kwargs,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(kernel weights, ids) routed into poisoned buffers (through route_into, or the launcher
    when a config is given), and the reference's."""
    args = _args(logits, top_k, **kwargs)
    nv = _checks.check_num_valid(num_valid, logits.shape[0], logits.device)
    weights = poisoned((logits.shape[0], top_k), torch.float32, logits.device)
    ids = poisoned((logits.shape[0], top_k), torch.int32, logits.device)
    outs = {"bias": kwargs.get("bias"), "num_valid": nv, "health": health, "weights_out": weights,
            "ids_out": ids}
    if config is None:
        router.route_into(logits, args, **outs)
    else:
        router.launch_router(logits, args, config=config, **outs)
    return (weights, ids), _reference(logits, args, kwargs.get("bias"), nv)


def _assert_matches(logits: torch.Tensor, top_k: int, what: str, **kwargs) -> None:
    """Exactly the reference's ids; weights within the fp32 tolerance."""
    (weights, ids), (ref_weights, ref_ids) = _route_both(logits, top_k, **kwargs)
    assert_equal(ids, ref_ids, what=f"{what} ids")
    assert_close(weights, ref_weights, dtype=torch.float32, what=f"{what} weights")


def _near_tie_rows(logits, top_k, rows: torch.Tensor, **kw) -> torch.Tensor:
    """Of `rows`, those whose selection has a near-tie (0 < gap < 1e-5, recomputed in float64)
    among the kept groups' top topk_group + 1 or the eligible experts' top K + 1: there the
    kernel's fp32 exp/sigmoid (ex2.approx) and torch's may order two experts differently. Exact
    ties are not near-ties: both sides break them by the lower index."""
    flt_max = torch.finfo(torch.float32).max
    x = logits[rows].double()
    x = torch.where(torch.isnan(x), -flt_max, x).clamp(-flt_max, flt_max)
    scores = torch.softmax(x, -1) if kw.get("scoring", "softmax") == "softmax" else torch.sigmoid(x)
    bias = kw.get("bias")
    select = scores if bias is None else scores + bias.double().nan_to_num(nan=-flt_max)[None]

    def near_tie(values: torch.Tensor, k: int) -> torch.Tensor:
        top = values.sort(dim=-1, descending=True).values[:, : k + 1]
        gaps = top[:, :-1] - top[:, 1:]
        return ((gaps > 0) & (gaps < 1e-5)).any(dim=1)

    near = torch.zeros(len(rows), dtype=torch.bool, device=logits.device)
    if kw.get("n_group"):
        n_group, topk_group = kw["n_group"], kw["topk_group"]
        groups = select.view(len(rows), n_group, select.shape[1] // n_group)
        best = 1 if kw.get("group_score") == "max" else 2
        group_scores = groups.topk(min(best, groups.shape[-1]), dim=-1).values.sum(-1)
        near |= near_tie(group_scores, topk_group)
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        select = select.masked_fill(~kept.repeat_interleave(groups.shape[-1], dim=1), -math.inf)
    near |= near_tie(select, top_k)
    return rows[near]


def _check(logits, top_k, what, **kw) -> None:
    """As _assert_matches, less the rows with a float64 near-tie (at most 1% of the rows, or one):
    for the compiled kernel's fast exp/sigmoid at large T and in bf16."""
    (weights, ids), (ref_weights, ref_ids) = _route_both(logits, top_k, **kw)
    differ = torch.nonzero((ids != ref_ids).any(dim=1)).flatten()
    if differ.numel():
        allowed = _near_tie_rows(logits, top_k, differ, **kw)
        keep = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
        keep[allowed] = False
        if allowed.numel():
            print(f"{what}: {allowed.numel()} row(s) with a float64 near-tie (< 1e-5) excluded: "
                  f"{allowed[:8].tolist()}")
        assert allowed.numel() <= max(1, ids.shape[0] // 100), f"{what}: too many near-tie rows"
        ids, ref_ids, weights, ref_weights = ids[keep], ref_ids[keep], weights[keep], ref_weights[keep]
    assert_equal(ids, ref_ids, what=f"{what} ids")
    assert_close(weights, ref_weights, dtype=torch.float32, what=f"{what} weights")


def _bias(num_experts: int, seed: int, device: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(num_experts, generator=_gen(seed)) * 0.05).to(dtype).to(device)


def _rows(num_experts: int, dtype: torch.dtype, seed: int, device: str) -> torch.Tensor:
    """Tie-free rows followed by one row of every adversarial kind."""
    tie_free = tie_free_logits(5, num_experts, generator=_gen(seed))
    adversarial, _ = adversarial_logits(num_experts, generator=_gen(seed + 1))
    return torch.cat([tie_free, adversarial]).to(dtype).to(device)


def _gpu_tie_free(num_tokens: int, num_experts: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """helpers.tie_free_logits generated on the GPU (the CPU argsort is slow at millions of rows)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    perms = torch.argsort(torch.rand(num_tokens, num_experts, generator=g, device="cuda"), dim=1)
    step = min(1.0 / 8.0, 16.0 / num_experts)
    return ((perms.float() - num_experts / 2) * step).to(dtype)


# ---------------------------------------------------------------------------------------------
# Every device
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("num_experts", "top_k", "n_group", "topk_group"), SHAPES)
def test_matches_reference_every_mode(device, num_experts, top_k, n_group, topk_group):
    """Tie-free and adversarial rows, every scoring mode, at every E."""
    dtype = DTYPES[num_experts % 2]
    logits = _rows(num_experts, dtype, seed=num_experts, device=device)
    bias = _bias(num_experts, seed=num_experts + 7, device=device)
    modes: list[dict] = [
        {"scoring": "softmax"},
        {"scoring": "softmax", "renormalize": False, "routed_scaling_factor": 2.5},
        {"scoring": "sigmoid", "bias": bias, "routed_scaling_factor": 1.5},
    ]
    if num_experts <= 128:  # keep the interpreter's time down for the big rows
        modes.append({"scoring": "sigmoid", "renormalize": False})
    if n_group is not None:
        modes.append({"scoring": "sigmoid", "bias": bias, "n_group": n_group, "topk_group": topk_group})
        if num_experts <= 160:
            modes.append({"scoring": "softmax", "n_group": n_group, "topk_group": topk_group})
            # DeepSeek-V2's group_limited_greedy: a group scores its best expert.
            modes.append({"scoring": "softmax", "n_group": n_group, "topk_group": topk_group,
                          "group_score": "max", "renormalize": False, "routed_scaling_factor": 16.0})
        if num_experts <= 64:
            modes.append({"scoring": "sigmoid", "bias": bias, "n_group": n_group, "topk_group": topk_group,
                          "group_score": "max"})
    for mode in modes:
        _assert_matches(logits, top_k, f"E={num_experts} K={top_k} {dtype} {mode}", **mode)


@pytest.mark.parametrize("num_experts", [8, 64, 160])
def test_each_adversarial_kind_valid_contract(device, num_experts):
    """Each adversarial row alone (one row per program): K distinct in-range ids, finite weights."""
    logits, kinds = adversarial_logits(num_experts, dtype=torch.float16, generator=_gen(3))
    logits = logits.to(device)
    top_k = min(4, num_experts)
    for row, kind in enumerate(kinds):
        for mode in ({"scoring": "softmax"}, {"scoring": "sigmoid", "bias": _bias(num_experts, 5, device)}):
            (weights, ids), (ref_weights, ref_ids) = _route_both(logits[row : row + 1], top_k, **mode)
            assert_equal(ids, ref_ids, what=f"{kind} {mode['scoring']} ids")
            assert_close(weights, ref_weights, dtype=torch.float32, what=f"{kind} weights")
            assert len(set(ids[0].tolist())) == top_k and int(ids.min()) >= 0 and int(ids.max()) < num_experts
            assert bool(torch.isfinite(weights).all()) and bool((weights >= 0).all())
    assert len(kinds) == len(ADVERSARIAL_ROW_KINDS)


def test_bias_ties_and_extremes(device):
    """A bias of +-Inf/NaN is sanitised; a bias making every selection equal ties to index order."""
    num_experts, top_k = 16, 4
    logits = tie_free_logits(3, num_experts, generator=_gen(11)).to(device)
    bias = torch.zeros(num_experts)
    bias[3], bias[5], bias[7] = math.inf, math.nan, -math.inf
    _assert_matches(logits, top_k, "inf/nan bias", scoring="sigmoid", bias=bias.to(device))
    flat = torch.zeros(2, num_experts, device=device)
    zero_bias = torch.zeros(num_experts, device=device)
    _assert_matches(flat, top_k, "all-equal sigmoid", scoring="sigmoid", bias=zero_bias)
    # Groups whose scores tie: the lower group index wins.
    _assert_matches(flat, top_k, "tied groups", scoring="sigmoid", n_group=4, topk_group=2, bias=zero_bias)
    _assert_matches(flat, top_k, "tied group maxima", n_group=4, topk_group=2, group_score="max")
    # Group maxima tied but the top-2 sums not (and back): each rule keeps its own groups.
    row = torch.tensor([[3.0, 3.0, 0.0, 0.0, 3.0, -1.0, 0.0, 0.0, 2.9, 2.9, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]])
    for group_score in ("top2_sum", "max"):
        _assert_matches(row.to(device), 2, f"{group_score} groups", n_group=4, topk_group=1,
                        group_score=group_score)


@pytest.mark.parametrize("dtype", DTYPES)
def test_padding_rows_and_num_valid_forms(device, dtype):
    """Rows >= num_valid come out -1/0 (buffers poisoned), for int and tensor num_valid; the
    padding holding NaN/garbage does not change the real rows bitwise."""
    num_tokens, num_experts, top_k = 11, 128, 8  # BLOCK_T = 4: programs of mixed and pure padding
    clean = tie_free_logits(num_tokens, num_experts, generator=_gen(21)).to(dtype).to(device)
    for count in (0, 1, 5, num_tokens):
        dirty = clean.clone()
        dirty[count:] = math.nan
        if count + 1 < num_tokens:
            dirty[count + 1] = 6.0e4 if dtype == torch.float16 else 3.0e38
        for num_valid in (count, torch.tensor(count, device=device)):
            (weights, ids), (ref_weights, ref_ids) = _route_both(dirty, top_k, num_valid=num_valid)
            assert_equal(ids, ref_ids, what=f"num_valid={num_valid!r} ids")
            assert_close(weights, ref_weights, dtype=torch.float32, what="weights")
            assert bool((ids[count:] == -1).all()) and bool((weights[count:] == 0).all())
            (clean_weights, clean_ids), _ = _route_both(clean, top_k, num_valid=num_valid)
            assert_equal(weights, clean_weights, what="real rows with dirty padding (weights, bitwise)")
            assert_equal(ids, clean_ids, what="real rows with dirty padding (ids)")


def test_num_valid_tensor_is_clamped_and_int64_ok(device):
    logits = tie_free_logits(6, 8, generator=_gen(5)).to(device)
    args = _args(logits, 2)
    for value, dtype, expect in ((-3, torch.int64, 0), (99, torch.int32, 6), (4, torch.int64, 4)):
        nv = _checks.NumValid(count=None, tensor=torch.tensor(value, dtype=dtype, device=device))
        health = new_health_tensor(device)
        _, ids = router.route_triton(logits, args, bias=None, num_valid=nv, health=health)
        assert bool((ids[expect:] == -1).all()) and bool((ids[:expect] >= 0).all()), f"num_valid={value}"
        assert int(health[PADDED_ROWS]) == 6 - expect


def test_health_counters_exact(device):
    num_experts, top_k = 64, 4
    logits, kinds = adversarial_logits(num_experts, generator=_gen(8))
    logits = torch.cat([logits, logits]).to(device)  # 20 rows, 6 non-finite kinds in each half
    bad_kinds = {"all_nan", "all_pos_inf", "all_neg_inf", "mixed_nonfinite", "one_nan_odd",
                 "one_pos_inf_odd", "one_neg_inf_odd"}
    num_valid = 13  # the first half and rows 10..12 of the second
    expected_bad = sum(k in bad_kinds for k in kinds) + sum(k in bad_kinds for k in kinds[:3])
    health = new_health_tensor(device)
    for call in (1, 2):  # counters accumulate across calls
        _route_both(logits, top_k, num_valid=torch.tensor(num_valid, device=device), health=health)
        assert int(health[NONFINITE_ROWS]) == call * expected_bad
        assert int(health[PADDED_ROWS]) == call * (logits.shape[0] - num_valid)
        assert int(health[3:].abs().sum()) == 0 and int(health[1]) == 0


def test_every_config_computes_the_same(device):
    """The configs the bench's sweep times (rows per program, warps) give the same ids; weights may
    differ in the last bit (the K-sum's order follows the layout)."""
    for num_experts, top_k, mode in ((16, 4, {}), (60, 3, {"n_group": 6, "topk_group": 2}), (64, 8, {})):
        logits = _rows(num_experts, torch.float32, seed=31, device=device)
        args = _args(logits, top_k, scoring="sigmoid", **mode)
        nv = _checks.check_num_valid(torch.tensor(13, device=device), logits.shape[0], logits.device)
        outs = []
        for config in router.candidate_configs(logits.shape[0], num_experts, top_k, 4)[::3]:
            weights = poisoned((logits.shape[0], top_k), torch.float32, device)
            ids = poisoned((logits.shape[0], top_k), torch.int32, device)
            router.launch_router(logits, args, bias=None, num_valid=nv, health=None, weights_out=weights,
                           ids_out=ids, config=config)
            outs.append((weights, ids))
        for weights, ids in outs[1:]:
            assert_equal(ids, outs[0][1], what=f"E={num_experts} ids")
            assert_close(weights, outs[0][0], what=f"E={num_experts} weights")


def test_unsafe_variant_equals_safe_on_clean_rows(device):
    """The bench's comparison build (no sanitising, no padding) computes the same on clean input."""
    logits = tie_free_logits(9, 128, generator=_gen(41)).to(device)
    args = _args(logits, 8)
    nv = _checks.check_num_valid(None, 9, logits.device)
    outs = []
    for safe in (True, False):
        weights = poisoned((9, 8), torch.float32, device)
        ids = poisoned((9, 8), torch.int32, device)
        router.launch_router(logits, args, bias=None, num_valid=nv, health=None, weights_out=weights,
                             ids_out=ids, sanitize=safe, padding=safe)
        outs.append((weights, ids))
    assert_equal(outs[0][0], outs[1][0], what="weights")
    assert_equal(outs[0][1], outs[1][1], what="ids")


def test_public_route_and_empty_batch(device):
    logits = tie_free_logits(3, 32, generator=_gen(2)).to(device)
    got = safemoe.route(logits, 4, scoring="sigmoid", backend="triton", num_valid=2)
    ref = safemoe.route(logits, 4, scoring="sigmoid", backend="reference", num_valid=2)
    assert_equal(got.ids, ref.ids, what="ids")
    assert_close(got.weights, ref.weights, what="weights")
    assert got.ids.dtype == torch.int32 and got.weights.dtype == torch.float32
    empty = safemoe.route(torch.empty(0, 32, device=device), 4, backend="triton")
    assert empty.ids.shape == (0, 4) and empty.weights.shape == (0, 4)
    empty = safemoe.route(torch.empty(0, 32, device=device), 4, backend="triton",
                          num_valid=torch.tensor(0, device=device))
    assert empty.ids.shape == (0, 4)


def test_route_into_rejects_bad_outputs(device):
    logits = tie_free_logits(3, 8, generator=_gen(2)).to(device)
    args = _args(logits, 2)
    nv = _checks.check_num_valid(None, 3, logits.device)
    good_w = torch.empty(3, 2, device=device)
    good_i = torch.empty(3, 2, dtype=torch.int32, device=device)
    bad = {
        "weights_out": [
            torch.empty(3, 3, device=device),
            torch.empty(3, 2, dtype=torch.float16, device=device),
            torch.empty(2, 3, device=device).t(),
        ],
        "ids_out": [torch.empty(3, 2, dtype=torch.int64, device=device), None],
    }
    for name, candidates in bad.items():
        for candidate in candidates:
            outs = {"weights_out": good_w, "ids_out": good_i, name: candidate}
            with pytest.raises((TypeError, ValueError), match=name):
                router.route_into(logits, args, bias=None, num_valid=nv, health=None, **outs)


# ---------------------------------------------------------------------------------------------
# CUDA only: bf16 (no bf16 arithmetic on the interpreter), T in the millions, CUDA graphs
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize(("num_experts", "top_k", "n_group", "topk_group"), SHAPES)
def test_grid_matches_reference(num_experts, top_k, n_group, topk_group, dtype):
    """bf16 in every mode (fp16 and fp32 once each: every mode is one more compile) on 37 tie-free
    rows plus the adversarial ones, then padded. Not merged with test_matches_reference_every_mode
    (which also runs compiled): bf16, other modes and rows, compared with the near-tie rule."""
    g = torch.Generator().manual_seed(num_experts)
    tie_free = tie_free_logits(37, num_experts, generator=g)
    adversarial, _ = adversarial_logits(num_experts, generator=g)
    logits = torch.cat([tie_free, adversarial]).to(dtype).cuda()
    bias = (torch.randn(num_experts, generator=g) * 0.05).cuda()
    modes: list[dict] = [{"scoring": "softmax"}]
    if dtype == torch.bfloat16:  # every mode in bf16; fp16 and fp32 once (each is one more compile)
        modes.append({"scoring": "sigmoid", "bias": bias.to(dtype), "renormalize": False,
                      "routed_scaling_factor": 2.5})
        modes.append({"scoring": "sigmoid"})
        if n_group is not None:
            modes.append({"scoring": "sigmoid", "bias": bias, "n_group": n_group, "topk_group": topk_group})
            modes.append({"scoring": "softmax", "n_group": n_group, "topk_group": topk_group})
            modes.append({"scoring": "softmax", "n_group": n_group, "topk_group": topk_group,
                          "group_score": "max", "renormalize": False})
    for mode in modes:
        _check(logits, top_k, f"E={num_experts} {dtype} {mode}", **mode)
    nv = torch.tensor(20, device="cuda")
    _check(logits, top_k, f"E={num_experts} {dtype} padded {modes[-1]}", num_valid=nv, **modes[-1])


@pytest.mark.gpu
@pytest.mark.parametrize(("num_experts", "top_k", "mode"), [
    (128, 8, {}),
    (256, 8, {"scoring": "sigmoid", "n_group": 8, "topk_group": 4}),
    (8, 2, {}),
    (160, 6, {"n_group": 8, "topk_group": 3}),
    (160, 6, {"n_group": 8, "topk_group": 3, "group_score": "max", "renormalize": False}),
    (512, 10, {}),  # Qwen3-Next: its tuned pick (one row, one warp) comes first
])
def test_every_config_agrees(num_experts, top_k, mode):
    """The configs the bench sweeps (rows per program, warps) all compute the same as the
    reference, with num_valid splitting a program (T = 1000, bf16, every 7th row NaN)."""
    logits = _gpu_tie_free(1000, num_experts, torch.bfloat16, seed=3)
    logits[::7] = math.nan
    grouped = "n_group" in mode
    for config in router.candidate_configs(1000, num_experts, top_k, 2, grouped)[::3]:
        _check(logits, top_k, f"{config}", num_valid=torch.tensor(777, device="cuda"), config=config, **mode)


@pytest.mark.gpu
def test_large_t_2m_rows():
    num_tokens, num_experts, top_k = 2_000_000, 256, 8
    logits = _gpu_tie_free(num_tokens, num_experts, torch.bfloat16, seed=1)
    logits[123_457] = math.nan
    health = new_health_tensor("cuda")
    nv = torch.tensor(num_tokens - 3, device="cuda")
    kw = {"scoring": "sigmoid", "bias": torch.linspace(-0.01, 0.01, num_experts, device="cuda"),
          "n_group": 8, "topk_group": 4}
    _check(logits, top_k, "2M rows", num_valid=nv, health=health, **kw)
    assert int(health[NONFINITE_ROWS]) == 1 and int(health[PADDED_ROWS]) == 3


@pytest.mark.gpu
def test_rows_past_2_pow_31_elements():
    """T * E > 2^31: rows whose offsets need int64 (and padding beyond that point)."""
    num_tokens, num_experts, top_k = 4_200_000, 512, 8
    free = torch.cuda.mem_get_info()[0]
    if free < 12 * 2**30:
        pytest.skip(f"needs ~12 GiB free, {free / 2**30:.1f} GiB free")
    logits = torch.randn(num_tokens, num_experts, device="cuda", dtype=torch.bfloat16)
    assert num_tokens * num_experts > 2**31
    first_big = 2**31 // num_experts + 1  # first row with an element past 2^31
    logits[first_big + 5] = math.nan
    num_valid = num_tokens - 1000
    logits[num_valid:] = math.nan
    _route_both(logits[:8], top_k)  # compile + warm
    args = _args(logits, top_k)
    nv = _checks.check_num_valid(torch.tensor(num_valid, device="cuda"), num_tokens, logits.device)
    weights = poisoned((num_tokens, top_k), torch.float32, "cuda")
    ids = poisoned((num_tokens, top_k), torch.int32, "cuda")
    router.route_into(logits, args, bias=None, num_valid=nv, health=None, weights_out=weights, ids_out=ids)
    for start, stop in ((0, 2048), (first_big - 1024, first_big + 1024), (num_valid - 2048, num_tokens)):
        part = logits[start:stop]
        ref_weights, ref_ids = _reference(part, args, None, _checks.check_num_valid(
            max(0, min(stop, num_valid) - start), stop - start, logits.device))
        what = f"rows {start}:{stop}"
        assert_equal(ids[start:stop], ref_ids, what=f"{what} ids")
        assert_close(weights[start:stop], ref_weights, dtype=torch.float32, what=f"{what} weights")


@pytest.mark.gpu
def test_cuda_graph_replay_with_num_valid_changed_in_place():
    num_tokens, num_experts, top_k = 256, 128, 8
    logits = _gpu_tie_free(num_tokens, num_experts, torch.bfloat16, seed=9)
    clean = logits.clone()
    num_valid = torch.tensor(num_tokens, device="cuda", dtype=torch.int32)
    health = new_health_tensor("cuda")
    weights = poisoned((num_tokens, top_k), torch.float32, "cuda")
    ids = poisoned((num_tokens, top_k), torch.int32, "cuda")
    args = _args(logits, top_k)
    nv = _checks.check_num_valid(num_valid, num_tokens, logits.device)

    def step() -> None:
        router.route_into(logits, args, bias=None, num_valid=nv, health=health,
                          weights_out=weights, ids_out=ids)

    warm_up(step)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    health.zero_()
    expected_bad = expected_pad = 0
    for count, nan_rows in ((256, []), (1, [0]), (0, [3]), (100, [5, 99, 150]), (255, [254]), (17, [])):
        logits.copy_(clean)
        for row in nan_rows:
            logits[row, row % num_experts] = math.nan
        logits[count:] = math.nan  # padding holds garbage
        num_valid.fill_(count)
        weights.fill_(math.nan)
        ids.fill_(123456789)
        graph.replay()
        ref_weights, ref_ids = _reference(logits, args, None, nv)
        assert_equal(ids, ref_ids, what=f"replay num_valid={count} ids")
        assert_close(weights, ref_weights, dtype=torch.float32, what=f"replay num_valid={count} weights")
        expected_bad += sum(row < count for row in nan_rows)
        expected_pad += num_tokens - count
        assert int(health[NONFINITE_ROWS]) == expected_bad
        assert int(health[PADDED_ROWS]) == expected_pad


# ---------------------------------------------------------------------------------------------
# memcheck driver (not a test): python3 tests/test_router.py under compute-sanitizer
# ---------------------------------------------------------------------------------------------


def memcheck_cases() -> int:
    """Small CUDA cases for compute-sanitizer: every mode, odd E, tiny T, padding, a non-default
    config. Returns the number of failed cases."""
    failures = 0
    grouped = {"scoring": "sigmoid", "n_group": 8, "topk_group": 4}
    cases = [(1, 1, 1, {}), (3, 6, 2, {"n_group": 3, "topk_group": 2}), (7, 8, 2, {}), (33, 60, 4, {}),
             (5, 160, 6, {"scoring": "sigmoid", "n_group": 8, "topk_group": 3}),
             (17, 256, 8, {**grouped, "bias": torch.randn(256, device="cuda")}),
             (9, 257, 8, {}), (4, 512, 32, {"scoring": "sigmoid"})]
    small = router.RouterConfig(block_t=2, num_warps=2)
    for num_tokens, num_experts, top_k, mode in cases:
        for dtype in (torch.bfloat16,) if num_experts != 257 else (torch.bfloat16, torch.float32):
            logits = torch.randn(num_tokens, num_experts, device="cuda").to(dtype)
            logits[0, num_experts // 2] = math.nan
            nv_tensor = torch.tensor(num_tokens - 1, device="cuda")
            for nv, config in ((None, None), (num_tokens // 2, small), (nv_tensor, None)):
                what = f"memcheck T={num_tokens} E={num_experts} {dtype} nv={nv} {config}"
                try:
                    _check(logits, top_k, what, num_valid=nv, health=new_health_tensor("cuda"), config=config,
                           **mode)
                except AssertionError as exc:
                    failures += 1
                    print(f"FAILED: {exc}")
    torch.cuda.synchronize()
    print(f"router memcheck cases done, {failures} failed")
    return failures


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("router memcheck cases: need a CUDA GPU; nothing run")
        sys.exit(0)
    sys.exit(1 if memcheck_cases() else 0)


def test_qwen3_next_tuned_configs_match_the_reference(device):
    """The bf16 launch configs tuned for E = 512, K = 10 (one row a program, then two; one warp)
    route like the reference, padded rows and adversarial rows included."""
    logits = _rows(512, torch.bfloat16, seed=41, device=device)
    picks = {router._pick_config(t, 512, 10, 2) for t in (1, 1024, 8192)}
    assert picks == {router.RouterConfig(1, 1), router.RouterConfig(2, 1)}
    for config in sorted(picks, key=lambda c: c.block_t):
        _assert_matches(logits, 10, f"{config}", num_valid=torch.tensor(logits.shape[0] - 2, device=device),
                        config=config)


def test_router_table_file(tmp_path):
    """configs/router.json holds the tuned launch configs (data, not code); a malformed table is a
    ValueError naming the file and the entry, never a silent fallback."""
    import json

    table = router.tuned_router_table()
    assert table == router.load_router_table(router.ROUTER_TABLE)
    assert table[(512, 10, False)] == ((4096, 1, 1), (16384, 2, 1))
    assert router._pick_config(1024, 512, 10, 2) == router.RouterConfig(1, 1)
    assert router._pick_config(1024, 512, 10, 4) != router.RouterConfig(1, 1)  # fp32 logits: heuristic
    good = {"experts_padded": 64, "top_k": 4, "grouped": False, "buckets": [[1, 1, 1], [64, 2, 2]]}
    path = tmp_path / "router.json"
    path.write_text(json.dumps({"entries": [good]}))
    assert router.load_router_table(path) == {(64, 4, False): ((1, 1, 1), (64, 2, 2))}
    bad_entries = {
        "power of two": {**good, "experts_padded": 60},
        "rising": {**good, "buckets": [[64, 1, 1], [8, 1, 1]]},
        "non-empty": {**good, "buckets": []},
        "num_warps": {**good, "buckets": [[1, 1, 3]]},
        "block_t": {**good, "buckets": [[1, 3, 1]]},
        "KeyError": {k: v for k, v in good.items() if k != "top_k"},
    }
    for text, entry in bad_entries.items():
        path.write_text(json.dumps({"entries": [entry]}))
        with pytest.raises(ValueError, match=rf"router\.json.*entry 0.*{text}"):
            router.load_router_table(path)
    path.write_text(json.dumps({"entries": [good, good]}))
    with pytest.raises(ValueError, match=r"entry 1.*twice"):
        router.load_router_table(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"router\.json.*not readable"):
        router.load_router_table(path)
