"""The Triton router kernel against the reference (safemoe.reference.route_reference).

Runs on the Triton interpreter on CPU (fp16/fp32, small shapes) and compiled on a GPU. Every case
routes into output buffers poisoned beforehand (NaN weights, stale ids), so an unwritten element
fails. ids must equal the reference exactly; weights within the fp32 tolerance.
"""

from __future__ import annotations

import math

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
from safemoe.health import NONFINITE_ROWS, PADDED_ROWS, new_health_tensor
from safemoe.kernels import router
from safemoe.reference import route_reference

# -FLT_MAX - FLT_MAX overflows to -inf inside softmax on purpose (exp gives 0); numpy says so.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 arithmetic does not run on the interpreter; the GPU tests cover it.
DTYPES = (torch.float32, torch.float16)

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
    )


def _route_both(
    logits: torch.Tensor,
    top_k: int,
    *,
    num_valid: int | torch.Tensor | None = None,
    health: torch.Tensor | None = None,
    **kwargs,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(kernel weights, ids) routed into poisoned buffers, and the reference's."""
    args = _args(logits, top_k, **kwargs)
    nv = _checks.check_num_valid(num_valid, logits.shape[0], logits.device)
    weights = poisoned((logits.shape[0], top_k), torch.float32, logits.device)
    ids = poisoned((logits.shape[0], top_k), torch.int32, logits.device)
    router.route_into(logits, args, bias=kwargs.get("bias"), num_valid=nv, health=health,
                      weights_out=weights, ids_out=ids)
    expected = route_reference(
        logits,
        top_k,
        scoring=args.scoring,
        renormalize=args.renormalize,
        bias=kwargs.get("bias"),
        n_group=args.n_group,
        topk_group=args.topk_group,
        routed_scaling_factor=args.routed_scaling_factor,
        num_valid=nv,
    )
    return (weights, ids), expected


def _assert_matches(logits: torch.Tensor, top_k: int, what: str, **kwargs) -> None:
    (weights, ids), (ref_weights, ref_ids) = _route_both(logits, top_k, **kwargs)
    assert_equal(ids, ref_ids, what=f"{what} ids")
    assert_close(weights, ref_weights, dtype=torch.float32, what=f"{what} weights")


def _bias(num_experts: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(num_experts, generator=_gen(seed)) * 0.05).to(dtype).to(DEVICE)


def _rows(num_experts: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Tie-free rows followed by one row of every adversarial kind."""
    tie_free = tie_free_logits(5, num_experts, generator=_gen(seed))
    adversarial, _ = adversarial_logits(num_experts, generator=_gen(seed + 1))
    return torch.cat([tie_free, adversarial]).to(dtype).to(DEVICE)


@pytest.mark.parametrize(("num_experts", "top_k", "n_group", "topk_group"), SHAPES)
def test_matches_reference_every_mode(num_experts, top_k, n_group, topk_group):
    """Tie-free and adversarial rows, every scoring mode, at every E."""
    dtype = DTYPES[num_experts % 2]
    logits = _rows(num_experts, dtype, seed=num_experts)
    bias = _bias(num_experts, seed=num_experts + 7)
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
    for mode in modes:
        _assert_matches(logits, top_k, f"E={num_experts} K={top_k} {dtype} {mode}", **mode)


@pytest.mark.parametrize("num_experts", [8, 64, 160])
def test_each_adversarial_kind_valid_contract(num_experts):
    """Each adversarial row alone (one row per program): K distinct in-range ids, finite weights."""
    logits, kinds = adversarial_logits(num_experts, dtype=torch.float16, generator=_gen(3))
    logits = logits.to(DEVICE)
    top_k = min(4, num_experts)
    for row, kind in enumerate(kinds):
        for mode in ({"scoring": "softmax"}, {"scoring": "sigmoid", "bias": _bias(num_experts, 5)}):
            (weights, ids), (ref_weights, ref_ids) = _route_both(logits[row : row + 1], top_k, **mode)
            assert_equal(ids, ref_ids, what=f"{kind} {mode['scoring']} ids")
            assert_close(weights, ref_weights, dtype=torch.float32, what=f"{kind} weights")
            assert len(set(ids[0].tolist())) == top_k and int(ids.min()) >= 0 and int(ids.max()) < num_experts
            assert bool(torch.isfinite(weights).all()) and bool((weights >= 0).all())
    assert len(kinds) == len(ADVERSARIAL_ROW_KINDS)


def test_bias_ties_and_extremes():
    """A bias of +-Inf/NaN is sanitised; a bias making every selection equal ties to index order."""
    num_experts, top_k = 16, 4
    logits = tie_free_logits(3, num_experts, generator=_gen(11)).to(DEVICE)
    bias = torch.zeros(num_experts)
    bias[3], bias[5], bias[7] = math.inf, math.nan, -math.inf
    _assert_matches(logits, top_k, "inf/nan bias", scoring="sigmoid", bias=bias.to(DEVICE))
    flat = torch.zeros(2, num_experts, device=DEVICE)
    zero_bias = torch.zeros(num_experts, device=DEVICE)
    _assert_matches(flat, top_k, "all-equal sigmoid", scoring="sigmoid", bias=zero_bias)
    # Groups whose scores tie: the lower group index wins.
    _assert_matches(flat, top_k, "tied groups", scoring="sigmoid", n_group=4, topk_group=2, bias=zero_bias)


@pytest.mark.parametrize("dtype", DTYPES)
def test_padding_rows_and_num_valid_forms(dtype):
    """Rows >= num_valid come out -1/0 (buffers poisoned), for int and tensor num_valid; the
    padding holding NaN/garbage does not change the real rows bitwise."""
    num_tokens, num_experts, top_k = 11, 128, 8  # BLOCK_T = 4: programs of mixed and pure padding
    clean = tie_free_logits(num_tokens, num_experts, generator=_gen(21)).to(dtype).to(DEVICE)
    for count in (0, 1, 5, num_tokens):
        dirty = clean.clone()
        dirty[count:] = math.nan
        if count + 1 < num_tokens:
            dirty[count + 1] = 6.0e4 if dtype == torch.float16 else 3.0e38
        for num_valid in (count, torch.tensor(count, device=DEVICE)):
            (weights, ids), (ref_weights, ref_ids) = _route_both(dirty, top_k, num_valid=num_valid)
            assert_equal(ids, ref_ids, what=f"num_valid={num_valid!r} ids")
            assert_close(weights, ref_weights, dtype=torch.float32, what="weights")
            assert bool((ids[count:] == -1).all()) and bool((weights[count:] == 0).all())
            (clean_weights, clean_ids), _ = _route_both(clean, top_k, num_valid=num_valid)
            assert_equal(weights, clean_weights, what="real rows with dirty padding (weights, bitwise)")
            assert_equal(ids, clean_ids, what="real rows with dirty padding (ids)")


def test_num_valid_tensor_is_clamped_and_int64_ok():
    logits = tie_free_logits(6, 8, generator=_gen(5)).to(DEVICE)
    args = _args(logits, 2)
    for value, dtype, expect in ((-3, torch.int64, 0), (99, torch.int32, 6), (4, torch.int64, 4)):
        nv = _checks.NumValid(count=None, tensor=torch.tensor(value, dtype=dtype, device=DEVICE))
        health = new_health_tensor(DEVICE)
        _, ids = router.route_triton(logits, args, bias=None, num_valid=nv, health=health)
        assert bool((ids[expect:] == -1).all()) and bool((ids[:expect] >= 0).all()), f"num_valid={value}"
        assert int(health[PADDED_ROWS]) == 6 - expect


def test_health_counters_exact():
    num_experts, top_k = 64, 4
    logits, kinds = adversarial_logits(num_experts, generator=_gen(8))
    logits = torch.cat([logits, logits]).to(DEVICE)  # 20 rows, 6 non-finite kinds in each half
    bad_kinds = {"all_nan", "all_pos_inf", "all_neg_inf", "mixed_nonfinite", "one_nan_odd",
                 "one_pos_inf_odd", "one_neg_inf_odd"}
    num_valid = 13  # the first half and rows 10..12 of the second
    expected_bad = sum(k in bad_kinds for k in kinds) + sum(k in bad_kinds for k in kinds[:3])
    health = new_health_tensor(DEVICE)
    for call in (1, 2):  # counters accumulate across calls
        _route_both(logits, top_k, num_valid=torch.tensor(num_valid, device=DEVICE), health=health)
        assert int(health[NONFINITE_ROWS]) == call * expected_bad
        assert int(health[PADDED_ROWS]) == call * (logits.shape[0] - num_valid)
        assert int(health[3:].abs().sum()) == 0 and int(health[1]) == 0


def test_every_config_computes_the_same():
    """The configs the bench's sweep times (rows per program, warps) give the same ids; weights may
    differ in the last bit (the K-sum's order follows the layout)."""
    for num_experts, top_k, mode in ((16, 4, {}), (60, 3, {"n_group": 6, "topk_group": 2}), (64, 8, {})):
        logits = _rows(num_experts, torch.float32, seed=31)
        args = _args(logits, top_k, scoring="sigmoid", **mode)
        nv = _checks.check_num_valid(torch.tensor(13, device=DEVICE), logits.shape[0], logits.device)
        outs = []
        for config in router.candidate_configs(logits.shape[0], num_experts, top_k, 4)[::3]:
            weights = poisoned((logits.shape[0], top_k), torch.float32, DEVICE)
            ids = poisoned((logits.shape[0], top_k), torch.int32, DEVICE)
            router._launch(logits, args, bias=None, num_valid=nv, health=None, weights_out=weights,
                           ids_out=ids, config=config)
            outs.append((weights, ids))
        for weights, ids in outs[1:]:
            assert_equal(ids, outs[0][1], what=f"E={num_experts} ids")
            assert_close(weights, outs[0][0], what=f"E={num_experts} weights")


def test_unsafe_variant_equals_safe_on_clean_rows():
    """The bench's comparison build (no sanitising, no padding) computes the same on clean input."""
    logits = tie_free_logits(9, 128, generator=_gen(41)).to(DEVICE)
    args = _args(logits, 8)
    nv = _checks.check_num_valid(None, 9, logits.device)
    outs = []
    for safe in (True, False):
        weights = poisoned((9, 8), torch.float32, DEVICE)
        ids = poisoned((9, 8), torch.int32, DEVICE)
        router._launch(logits, args, bias=None, num_valid=nv, health=None, weights_out=weights, ids_out=ids,
                       sanitize=safe, padding=safe)
        outs.append((weights, ids))
    assert_equal(outs[0][0], outs[1][0], what="weights")
    assert_equal(outs[0][1], outs[1][1], what="ids")


def test_public_route_and_empty_batch():
    logits = tie_free_logits(3, 32, generator=_gen(2)).to(DEVICE)
    got = safemoe.route(logits, 4, scoring="sigmoid", backend="triton", num_valid=2)
    ref = safemoe.route(logits, 4, scoring="sigmoid", backend="reference", num_valid=2)
    assert_equal(got.ids, ref.ids, what="ids")
    assert_close(got.weights, ref.weights, what="weights")
    assert got.ids.dtype == torch.int32 and got.weights.dtype == torch.float32
    empty = safemoe.route(torch.empty(0, 32, device=DEVICE), 4, backend="triton")
    assert empty.ids.shape == (0, 4) and empty.weights.shape == (0, 4)
    empty = safemoe.route(torch.empty(0, 32, device=DEVICE), 4, backend="triton",
                          num_valid=torch.tensor(0, device=DEVICE))
    assert empty.ids.shape == (0, 4)


def test_route_into_rejects_bad_outputs():
    logits = tie_free_logits(3, 8, generator=_gen(2)).to(DEVICE)
    args = _args(logits, 2)
    nv = _checks.check_num_valid(None, 3, logits.device)
    good_w = torch.empty(3, 2, device=DEVICE)
    good_i = torch.empty(3, 2, dtype=torch.int32, device=DEVICE)
    bad = {
        "weights_out": [
            torch.empty(3, 3, device=DEVICE),
            torch.empty(3, 2, dtype=torch.float16, device=DEVICE),
            torch.empty(2, 3, device=DEVICE).t(),
        ],
        "ids_out": [torch.empty(3, 2, dtype=torch.int64, device=DEVICE), None],
    }
    for name, candidates in bad.items():
        for candidate in candidates:
            outs = {"weights_out": good_w, "ids_out": good_i, name: candidate}
            with pytest.raises((TypeError, ValueError), match=name):
                router.route_into(logits, args, bias=None, num_valid=nv, health=None, **outs)
