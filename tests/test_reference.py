"""The reference (src/safemoe/reference.py) is the spec: it must keep the contract on every
adversarial input and give the hand-computed answers below."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import safemoe
from helpers import (
    ADVERSARIAL_ROW_KINDS,
    STALE_ID,
    adversarial_logits,
    assert_close,
    assert_equal,
    garbage_ids,
)
from safemoe._checks import NumValid
from safemoe.reference import (
    activation_reference,
    dispatch_reference,
    experts_reference,
    moe_reference,
    route_reference,
    sanitize_logits,
)

SCORINGS = ("softmax", "sigmoid")
ACTIVATIONS = ("silu", "gelu", "swigluoai")


def _nv(count: int) -> NumValid:
    return NumValid(count=count, tensor=None)


def assert_routing_contract(
    weights: torch.Tensor, ids: torch.Tensor, num_experts: int, num_valid: int
) -> None:
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.shape == weights.shape
    valid_ids, valid_w = ids[:num_valid].long(), weights[:num_valid]
    assert bool(((valid_ids >= 0) & (valid_ids < num_experts)).all()), valid_ids
    ordered = valid_ids.sort(dim=1).values
    assert not bool((ordered[:, 1:] == ordered[:, :-1]).any()), f"duplicate ids {valid_ids}"
    assert bool(torch.isfinite(valid_w).all()) and bool((valid_w >= 0).all()), valid_w
    assert bool((ids[num_valid:] == -1).all()), ids[num_valid:]
    assert bool((weights[num_valid:] == 0).all()), weights[num_valid:]


# --- the contract on adversarial rows -------------------------------------------------------------


@pytest.mark.parametrize("num_experts", [1, 6, 8, 60, 64, 257])
@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_adversarial_rows_keep_contract(
    num_experts: int, scoring: str, dtype: torch.dtype, renormalize: bool
) -> None:
    gen = torch.Generator().manual_seed(num_experts)
    rows, kinds = adversarial_logits(num_experts, dtype=dtype, generator=gen)
    padding = torch.full((3, num_experts), math.nan, dtype=dtype)
    logits = torch.cat([rows, padding])
    for top_k in sorted({1, min(2, num_experts), min(8, num_experts), num_experts}):
        weights, ids = route_reference(
            logits, top_k, scoring=scoring, renormalize=renormalize, num_valid=_nv(len(kinds))
        )
        assert_routing_contract(weights, ids, num_experts, len(kinds))
        if renormalize:
            sums = weights[: len(kinds)].sum(dim=1)
            assert bool((((sums - 1).abs() < 1e-5) | (sums == 0)).all()), sums


@pytest.mark.parametrize("kind", ADVERSARIAL_ROW_KINDS)
def test_each_row_kind_with_bias_and_groups(kind: str) -> None:
    """DeepSeek-V3 routing (sigmoid, bias, 8 groups keep 4, scaled) on every row kind."""
    gen = torch.Generator().manual_seed(7)
    rows, kinds = adversarial_logits(64, generator=gen)
    row = rows[kinds.index(kind)][None, :]
    bias = torch.randn(64, generator=gen) * 0.1
    weights, ids = route_reference(
        row, 8, scoring="sigmoid", bias=bias, n_group=8, topk_group=4, routed_scaling_factor=2.5
    )
    assert_routing_contract(weights, ids, 64, 1)
    total = float(weights.sum())
    assert total == 0 or abs(total - 2.5) < 1e-5
    # All 8 ids come from at most 4 groups of 8.
    assert len(set((ids[0] // 8).tolist())) <= 4


def test_fully_nonfinite_rows_go_to_the_first_experts() -> None:
    """Sanitised to a constant row, every fully non-finite row ties everywhere: experts 0..K-1."""
    for value in (math.nan, math.inf, -math.inf):
        logits = torch.full((1, 16), value)
        for scoring in SCORINGS:
            weights, ids = route_reference(logits, 4, scoring=scoring)
            assert ids.tolist() == [[0, 1, 2, 3]]
            expected = 0.0 if (scoring == "sigmoid" and value != math.inf) else 0.25
            assert weights.tolist() == [[expected] * 4]


def test_sanitize_logits() -> None:
    x = torch.tensor([math.nan, math.inf, -math.inf, 1.5], dtype=torch.float16)
    out = sanitize_logits(x)
    fmax = torch.finfo(torch.float32).max
    assert out.dtype == torch.float32
    assert out.tolist() == [-fmax, fmax, -fmax, 1.5]


# --- hand-computed cases ----------------------------------------------------------------------------


def test_softmax_hand_computed() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    weights, ids = route_reference(logits, 2)
    assert ids.tolist() == [[2, 1]]
    e2, e3 = math.exp(2), math.exp(3)
    assert_close(weights, torch.tensor([[e3 / (e2 + e3), e2 / (e2 + e3)]]))
    weights, ids = route_reference(logits, 2, renormalize=False)
    z = sum(math.exp(v) for v in (1.0, 2.0, 3.0, 0.0))
    assert_close(weights, torch.tensor([[e3 / z, e2 / z]]))


def test_sigmoid_hand_computed() -> None:
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0]])
    s = torch.sigmoid(logits)[0]
    weights, ids = route_reference(logits, 2, scoring="sigmoid")
    assert ids.tolist() == [[1, 3]]
    assert_close(weights, torch.stack([s[1], s[3]])[None] / (s[1] + s[3]))
    weights, _ = route_reference(logits, 2, scoring="sigmoid", renormalize=False)
    assert_close(weights, torch.stack([s[1], s[3]])[None])


def test_bias_steers_selection_only() -> None:
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0]])
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0])
    s = torch.sigmoid(logits)[0]
    weights, ids = route_reference(logits, 2, scoring="sigmoid", bias=bias)
    assert ids.tolist() == [[2, 1]]  # picked by s + bias
    assert_close(weights, torch.stack([s[2], s[1]])[None] / (s[2] + s[1]))  # weighted by s


def test_group_score_is_sum_of_top_two() -> None:
    # Group 0 has the single best expert, group 1 the better top-2 sum: group 1 is kept.
    logits = torch.tensor([[5.0, -5.0, -5.0, -5.0, 3.0, 3.0, -5.0, -5.0]])
    _, ids = route_reference(logits, 2, scoring="sigmoid", n_group=2, topk_group=1)
    assert ids.tolist() == [[4, 5]]


def test_group_score_max_is_the_best_expert() -> None:
    """DeepSeek-V2's group_limited_greedy: a group scores its best expert, not its top-2 sum."""
    logits = torch.tensor([[5.0, -5.0, -5.0, -5.0, 3.0, 3.0, -5.0, -5.0]])
    for scoring in ("sigmoid", "softmax"):
        _, ids = route_reference(logits, 2, scoring=scoring, n_group=2, topk_group=1, group_score="max")
        assert ids.tolist() == [[0, 1]]  # group 0 (the best expert) kept, group 1 dropped
    _, ids = route_reference(logits, 2, scoring="sigmoid", n_group=2, topk_group=1)
    assert ids.tolist() == [[4, 5]]  # by the sum of the top two, group 1 wins
    # Groups whose maxima tie: the lower group index wins; NaN rows stay inside the contract.
    tied = torch.tensor([[1.0, 2.0, 2.0, 0.0, math.nan, math.nan, math.nan, math.nan]])
    weights, ids = route_reference(tied, 2, n_group=4, topk_group=1, group_score="max", renormalize=False)
    assert ids.tolist() == [[1, 0]]
    assert_routing_contract(weights, ids, 8, 1)


def test_group_masking_uses_minus_inf_not_zero() -> None:
    """vLLM #13474: with negative selection scores, masking dropped groups with 0 would make a
    masked expert outrank every kept one."""
    logits = torch.tensor([[4.0, 3.0, -4.0, -4.0, 2.0, 1.0, -4.0, -4.0]])
    bias = torch.full((8,), -1.0)  # every selection score sigmoid - 1 is negative
    s = torch.sigmoid(logits)[0]
    weights, ids = route_reference(logits, 3, scoring="sigmoid", bias=bias, n_group=4, topk_group=2)
    assert ids.tolist() == [[0, 1, 4]]  # groups (0, 1) and (4, 5) kept; 0-masking would give [2, 3, 6]
    assert_close(weights, torch.stack([s[0], s[1], s[4]])[None] / (s[0] + s[1] + s[4]))
    masked_with_zero = (s - 1).clone()
    masked_with_zero[[2, 3, 6, 7]] = 0.0
    assert torch.topk(masked_with_zero, 3).indices.sort().values.tolist() != [0, 1, 4]


def test_zero_renormalisation_denominator_gives_zero_weights() -> None:
    """SGLang #31017: a row whose K scores sum to 0 must give weights 0, not NaN."""
    logits = torch.full((2, 8), -math.inf)
    logits[1] = -1e30  # sigmoid underflows to exactly 0 in fp32 as well
    weights, ids = route_reference(logits, 3, scoring="sigmoid", routed_scaling_factor=2.5)
    assert weights.tolist() == [[0.0] * 3, [0.0] * 3]
    assert_routing_contract(weights, ids, 8, 2)


@pytest.mark.parametrize("scoring", SCORINGS)
def test_routed_scaling_factor(scoring: str) -> None:
    logits = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    weights, _ = route_reference(logits, 4, scoring=scoring, routed_scaling_factor=2.5)
    assert_close(weights.sum(dim=1), torch.full((5,), 2.5))
    raw, _ = route_reference(logits, 4, scoring=scoring, renormalize=False)
    raw_scaled, _ = route_reference(logits, 4, scoring=scoring, renormalize=False, routed_scaling_factor=0.5)
    assert_close(raw_scaled, raw * 0.5)


def test_ties_go_to_the_lowest_index() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 1.0, 3.0, 0.0]])
    _, ids = route_reference(logits, 4)
    assert ids.tolist() == [[1, 2, 4, 0]]
    logits = torch.full((1, 8), 0.5)
    weights, ids = route_reference(logits, 3)
    assert ids.tolist() == [[0, 1, 2]]
    assert_close(weights, torch.full((1, 3), 1 / 3))


def test_single_bad_values() -> None:
    logits = torch.zeros(3, 8)
    logits[0, 3] = math.inf  # +inf -> FLT_MAX: takes all the softmax mass
    logits[1, 5] = math.nan  # NaN -> -FLT_MAX: never picked before finite experts
    logits[2, 5] = -math.inf
    weights, ids = route_reference(logits, 7)
    assert ids[0, 0] == 3 and weights[0, 0] == 1.0 and bool((weights[0, 1:] == 0).all())
    assert 5 not in ids[1].tolist() and 5 not in ids[2].tolist()


def test_padded_rows_never_influence_real_rows() -> None:
    gen = torch.Generator().manual_seed(3)
    real = torch.randn(4, 32, generator=gen)
    bias = torch.randn(32, generator=gen)
    kwargs = dict(scoring="sigmoid", bias=bias, n_group=4, topk_group=2)
    plain_w, plain_ids = route_reference(real, 4, **kwargs)
    for fill in (math.nan, math.inf, -math.inf, 1e30):
        logits = torch.cat([real, torch.full((5, 32), fill)])
        weights, ids = route_reference(logits, 4, num_valid=_nv(4), **kwargs)
        assert_equal(ids[:4], plain_ids)
        assert_equal(weights[:4], plain_w)
        assert_routing_contract(weights, ids, 32, 4)


def test_device_num_valid_is_clamped() -> None:
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(4))
    full_w, full_ids = route_reference(logits, 2)
    for value, count in ((3, 3), (0, 0), (5, 5), (9, 5), (-4, 0)):
        for dtype in (torch.int32, torch.int64):
            nv = NumValid(count=None, tensor=torch.tensor(value, dtype=dtype))
            weights, ids = route_reference(logits, 2, num_valid=nv)
            assert_routing_contract(weights, ids, 8, count)
            assert_equal(ids[:count], full_ids[:count])
            assert_equal(weights[:count], full_w[:count])


# --- dispatch -----------------------------------------------------------------------------------


def test_dispatch_reference_counts_offsets_drops() -> None:
    ids = torch.tensor([[1, 1], [0, -1], [5, 2]], dtype=torch.int32)
    layout = dispatch_reference(ids, 3)
    assert layout.counts.tolist() == [1, 2, 1]
    assert layout.counts.dtype == torch.int32
    assert layout.offsets.tolist() == [0, 1, 3, 4]
    assert layout.sorted_slots.tolist() == [2, 0, 1, 5]  # slot = t * K + k, grouped by expert
    assert layout.dropped == 2
    layout = dispatch_reference(ids, 3, _nv(2))  # row 2 is padding: neither served nor dropped
    assert layout.counts.tolist() == [1, 2, 0]
    assert layout.sorted_slots.tolist() == [2, 0, 1]
    assert layout.dropped == 1


def test_dispatch_reference_on_garbage_ids() -> None:
    gen = torch.Generator().manual_seed(5)
    ids = garbage_ids(40, 4, 16, generator=gen)
    layout = dispatch_reference(ids, 16, _nv(33))
    flat = ids.reshape(-1).long()
    served = [s for s in range(33 * 4) if 0 <= int(flat[s]) < 16]
    assert int(layout.counts.sum()) == len(served) == int(layout.offsets[-1])
    assert layout.dropped == 33 * 4 - len(served)
    for e in range(16):
        chunk = layout.sorted_slots[layout.offsets[e] : layout.offsets[e + 1]].tolist()
        assert chunk == [s for s in served if int(flat[s]) == e]


# --- experts ------------------------------------------------------------------------------------


def naive_experts(x, w13, w2, weights, ids, activation, num_valid):
    """One token and one slot at a time, straight from the formula."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32)
    for t in range(num_valid):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if not 0 <= e < num_experts:
                continue
            h = w13[e].float() @ x[t].float()
            act = activation_reference(h[:inter], h[inter:], activation).to(x.dtype).float()
            out[t] += float(weights[t, k]) * (w2[e].float() @ act)
    return out.to(x.dtype)


def _expert_problem(num_tokens=9, num_experts=6, top_k=3, hidden=16, inter=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / 4).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / 3).to(dtype)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    ids = garbage_ids(num_tokens, top_k, num_experts, generator=gen)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_experts_reference_matches_naive_loop(activation: str, dtype: torch.dtype) -> None:
    x, w13, w2, weights, ids = _expert_problem(dtype=dtype, seed=1)
    x = x * 3  # reach swigluoai's clamps
    out = experts_reference(x, w13, w2, weights, ids, activation=activation, num_valid=_nv(7))
    expected = naive_experts(x, w13, w2, weights, ids, activation, 7)
    assert out.dtype == dtype
    # Rounding the fp32 sum once vs the same: only the accumulation order differs.
    assert_close(out, expected, dtype=dtype)
    assert bool((out[7:] == 0).all())


def test_activation_formulas() -> None:
    gate = torch.tensor([-2.0, 0.5, 10.0, 3.0])
    up = torch.tensor([1.0, -2.0, -10.0, 9.0])
    assert_close(activation_reference(gate, up, "silu"), gate * torch.sigmoid(gate) * up)
    tanh_gelu = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)))
    assert_close(activation_reference(gate, up, "gelu"), tanh_gelu * up)
    g = gate.clamp(max=7.0)
    u = up.clamp(-7.0, 7.0)
    assert_close(activation_reference(gate, up, "swigluoai"), g * torch.sigmoid(1.702 * g) * (u + 1))
    assert float(
        activation_reference(torch.tensor([10.0]), torch.tensor([-10.0]), "swigluoai")
    ) == pytest.approx(7.0 * float(torch.sigmoid(torch.tensor(1.702 * 7.0))) * -6.0)
    assert_close(F.silu(gate) * up, activation_reference(gate, up, "silu"))


def test_duplicate_ids_are_each_served() -> None:
    x, w13, w2, _, _ = _expert_problem(num_tokens=4, top_k=1, seed=2)
    ids_dup = torch.tensor([[3, 3]] * 4, dtype=torch.int32)
    ids_one = torch.tensor([[3]] * 4, dtype=torch.int32)
    dup = experts_reference(x, w13, w2, torch.tensor([[0.25, 0.75]] * 4), ids_dup)
    one = experts_reference(x, w13, w2, torch.ones(4, 1), ids_one)
    assert_close(dup, one)


def test_padded_rows_are_exact_zeros_and_never_read() -> None:
    x, w13, w2, weights, ids = _expert_problem(num_tokens=8, seed=3)
    ids = ids.clamp(0, 5)
    ref = experts_reference(x, w13, w2, weights, ids, num_valid=_nv(5))
    x_bad, w_bad, ids_bad = x.clone(), weights.clone(), ids.clone()
    x_bad[5:], w_bad[5:], ids_bad[5:] = math.nan, math.nan, STALE_ID
    out = experts_reference(x_bad, w13, w2, w_bad, ids_bad, num_valid=_nv(5))
    assert_equal(out, ref)
    assert bool((out[5:] == 0).all()) and not bool(torch.signbit(out[5:]).any())


def test_dropped_slots_are_never_read() -> None:
    x, w13, w2, weights, ids = _expert_problem(num_tokens=10, seed=4)
    dropped = (ids < 0) | (ids >= 6)
    assert bool(dropped.any())
    out = experts_reference(x, w13, w2, torch.where(dropped, math.nan, weights), ids)
    assert bool(torch.isfinite(out).all())
    clean = experts_reference(x, w13, w2, torch.where(dropped, 0.0, weights), torch.where(dropped, 0, ids))
    assert_close(out, clean)


def test_experts_device_num_valid() -> None:
    x, w13, w2, weights, ids = _expert_problem(num_tokens=6, seed=5)
    for value, count in ((4, 4), (0, 0), (11, 6), (-1, 0)):
        nv = NumValid(count=None, tensor=torch.tensor(value))
        out = experts_reference(x, w13, w2, weights, ids, num_valid=nv)
        assert_equal(out, experts_reference(x, w13, w2, weights, ids, num_valid=_nv(count)))


def test_moe_reference_is_route_then_experts() -> None:
    x, w13, w2, _, _ = _expert_problem(num_tokens=7, seed=6)
    logits = torch.randn(7, 6, generator=torch.Generator().manual_seed(6))
    logits[2] = math.nan
    out = moe_reference(x, logits, w13, w2, 2, scoring="sigmoid", num_valid=_nv(5))
    weights, ids = route_reference(logits, 2, scoring="sigmoid", num_valid=_nv(5))
    assert_equal(out, experts_reference(x, w13, w2, weights, ids, num_valid=_nv(5)))
    assert bool(torch.isfinite(out).all())


def test_public_api_reference_backend_and_health() -> None:
    x, w13, w2, weights, ids = _expert_problem(num_tokens=6, seed=7)
    logits = torch.randn(6, 6, generator=torch.Generator().manual_seed(7))
    logits[1, 2] = math.nan
    logits[4] = math.inf  # padded: not counted as non-finite
    health = safemoe.new_health_tensor()
    routing = safemoe.route(logits, 2, num_valid=4, backend="reference", health=health)
    assert isinstance(routing, safemoe.Routing) and routing.top_k == 2
    assert health.tolist()[:3] == [1, 0, 2]
    out = safemoe.experts(
        x,
        w13,
        w2,
        safemoe.Routing(weights, ids),
        num_valid=torch.tensor(5),
        backend="reference",
        health=health,
    )
    dropped = int((((ids < 0) | (ids >= 6))[:5]).sum())
    assert health.tolist()[:3] == [1, dropped, 2]
    assert bool((out[5:] == 0).all())
    auto = safemoe.moe(x, logits, w13, w2, 2, num_valid=4)  # auto is the reference on CPU
    assert_equal(auto, moe_reference(x, logits, w13, w2, 2, num_valid=_nv(4)))
