"""Contract clauses as assertions that raise `CheckFailure` with the first offending rows."""

from __future__ import annotations

import math

import torch

from safemoe._checks import NumValid
from safemoe.check.registry import CheckFailure
from safemoe.reference import FLT_MAX, route_reference, sanitize_logits, topk_lowest_index
from safemoe.route_config import RouteConfig
from safemoe.routing import Routing

# Selection scores closer than this (relative) may legitimately order differently in two correct
# fp32 implementations (exp vs exp2, another reduction order); such rows are checked for the
# contract only, not for the reference's exact ids.
NEAR_TIE_RTOL = 1e-5
# Weights of the same experts: a few fp32 ulps of softmax/sigmoid and the renormalising division.
WEIGHT_ATOL, WEIGHT_RTOL = 1e-5, 1.3e-5


def _rows(mask: torch.Tensor, names: list[str] | None, limit: int = 4) -> str:
    idx = torch.nonzero(mask).flatten()[:limit].tolist()
    return ", ".join(f"{i}" + (f" ({names[i]})" if names and i < len(names) else "") for i in idx)


def expect_routing_contract(
    routing: object,
    *,
    num_rows: int,
    top_k: int,
    num_experts: int,
    num_valid: int,
    device: torch.device,
    row_names: list[str] | None = None,
) -> None:
    """Valid rows: K distinct ids in [0, E), finite weights >= 0. Padded rows: ids -1, weights 0."""
    if not isinstance(routing, Routing):
        raise CheckFailure(f"route returned {type(routing).__name__}, not safemoe.Routing")
    for name, t, dtype in (("ids", routing.ids, torch.int32), ("weights", routing.weights, torch.float32)):
        if tuple(t.shape) != (num_rows, top_k) or t.dtype != dtype or t.device != device:
            raise CheckFailure(
                f"{name} must be [{num_rows}, {top_k}] {dtype} on {device}, got {tuple(t.shape)} {t.dtype} "
                f"on {t.device}"
            )
    ids = routing.ids.cpu().long()
    weights = routing.weights.cpu()
    valid_ids, valid_w = ids[:num_valid], weights[:num_valid]
    out_of_range = ((valid_ids < 0) | (valid_ids >= num_experts)).any(dim=1)
    if out_of_range.any():
        raise CheckFailure(
            f"ids outside [0, E={num_experts}) on valid rows {_rows(out_of_range, row_names)}: "
            f"{valid_ids[out_of_range][:2].tolist()}"
        )
    ordered = valid_ids.sort(dim=1).values
    duplicated = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1)
    if duplicated.any():
        raise CheckFailure(
            f"duplicate ids on valid rows {_rows(duplicated, row_names)}: "
            f"{valid_ids[duplicated][:2].tolist()}"
        )
    bad_weight = (~torch.isfinite(valid_w) | (valid_w < 0)).any(dim=1)
    if bad_weight.any():
        raise CheckFailure(
            f"weights not finite or negative on valid rows {_rows(bad_weight, row_names)}: "
            f"{valid_w[bad_weight][:2].tolist()}"
        )
    pad_ids, pad_w = ids[num_valid:], weights[num_valid:]
    wrong_pad = (pad_ids != -1).any(dim=1) | (pad_w != 0).any(dim=1) | torch.isnan(pad_w).any(dim=1)
    if wrong_pad.any():
        first = int(torch.nonzero(wrong_pad)[0])
        raise CheckFailure(
            f"padded row {num_valid + first} must be ids -1 / weights 0, got "
            f"{pad_ids[first].tolist()} / {pad_w[first].tolist()}"
        )


def _near(a: torch.Tensor, b: torch.Tensor, exact_ties_are_ties: bool) -> torch.Tensor:
    """a >= b elementwise (sorted scores); True where their order is not reliable."""
    gap = a - b
    tol = NEAR_TIE_RTOL * torch.maximum(a.abs(), b.abs())
    near = gap <= tol
    # Equal scores from equal inputs (all-equal or non-finite rows, saturated sigmoid) are true
    # ties, resolved to the lowest index by contract; with a bias, equality is a rounding collision.
    return near & (gap > 0) if exact_ties_are_ties else near


def clear_rows(
    logits: torch.Tensor,
    config: RouteConfig | int,
    bias: torch.Tensor | None = None,
    exact_ties: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([T] bool, [T] bool): rows whose reference selection is far from any near-tie, for the set of
    experts and for their order, under the routing `config` (or just K) and selection `bias`.
    Computed from the reference's own scores. `exact_ties=False` (a backend that does not promise
    ties to the lowest index) makes exactly equal scores unclear too."""
    config = RouteConfig.of(config)
    top_k = config.top_k
    x = sanitize_logits(logits.cpu())
    scores = torch.softmax(x, dim=-1) if config.scoring == "softmax" else torch.sigmoid(x)
    select = (
        scores if bias is None else (scores + sanitize_logits(bias.cpu())[None, :]).clamp(-FLT_MAX, FLT_MAX)
    )
    exact_ties = exact_ties and bias is None
    num_rows, num_experts = x.shape
    set_unclear = torch.zeros(num_rows, dtype=torch.bool)
    eligible = torch.ones_like(select, dtype=torch.bool)
    n_group, topk_group = config.n_group, config.topk_group
    if n_group is not None and topk_group is not None:
        group_size = num_experts // n_group
        grouped = select.view(num_rows, n_group, group_size)
        best = 1 if config.group_score == "max" else 2
        group_score = grouped.sort(dim=-1, descending=True).values[..., : min(best, group_size)].sum(-1)
        ordered_groups = group_score.sort(dim=-1, descending=True).values
        if topk_group < n_group:
            set_unclear |= _near(ordered_groups[:, topk_group - 1], ordered_groups[:, topk_group], exact_ties)
        kept = torch.zeros(num_rows, n_group, dtype=torch.bool)
        kept.scatter_(1, topk_lowest_index(group_score, topk_group), True)
        eligible = kept[:, :, None].expand(-1, -1, group_size).reshape(num_rows, num_experts)
    ordered = select.masked_fill(~eligible, -math.inf).sort(dim=-1, descending=True).values
    count = int(eligible[0].sum()) if num_rows else 0
    if top_k < count:
        set_unclear |= _near(ordered[:, top_k - 1], ordered[:, top_k], exact_ties)
    order_unclear = set_unclear.clone()
    for k in range(top_k - 1):
        order_unclear |= _near(ordered[:, k], ordered[:, k + 1], exact_ties)
    return ~set_unclear, ~order_unclear


def expect_route_matches_reference(
    routing: Routing,
    logits: torch.Tensor,
    config: RouteConfig | int,
    bias: torch.Tensor | None,
    num_valid: int,
    row_names: list[str] | None = None,
    *,
    exact_ties: bool = True,
    ordered: bool = True,
    tolerance: tuple[float, float] = (WEIGHT_ATOL, WEIGHT_RTOL),
) -> None:
    """Same ids (in the same order) and close weights as the reference routing (`config`, or just
    K, and `bias`) on rows without near-ties; rows whose order is near-tied (every row, when not
    `ordered`) compare as sets. `tolerance` is (atol, rtol) of the weights."""
    config = RouteConfig.of(config)
    ref_weights, ref_ids = route_reference(logits, config, bias=bias, num_valid=NumValid(num_valid, None))
    set_clear, order_clear = clear_rows(logits, config, bias, exact_ties)
    valid = torch.arange(logits.shape[0]) < num_valid
    ids, weights = routing.ids.cpu().long(), routing.weights.cpu()
    ref_ids, ref_weights = ref_ids.cpu().long(), ref_weights.cpu()
    # Rows where only the order is unclear: compare (id, weight) pairs sorted by id.
    by_id = set_clear & ~order_clear if ordered else set_clear
    if by_id.any():
        perm, ref_perm = ids.argsort(dim=1), ref_ids.argsort(dim=1)
        ids, weights = (
            torch.where(by_id[:, None], ids.gather(1, perm), ids),
            torch.where(by_id[:, None], weights.gather(1, perm), weights),
        )
        ref_ids, ref_weights = (
            torch.where(by_id[:, None], ref_ids.gather(1, ref_perm), ref_ids),
            torch.where(by_id[:, None], ref_weights.gather(1, ref_perm), ref_weights),
        )
    compared = valid & set_clear
    wrong_ids = compared & (ids != ref_ids).any(dim=1)
    if wrong_ids.any():
        first = int(torch.nonzero(wrong_ids)[0])
        raise CheckFailure(
            f"ids differ from the reference on rows {_rows(wrong_ids, row_names)}; row {first}: "
            f"got {ids[first].tolist()}, reference {ref_ids[first].tolist()}"
        )
    err = (weights - ref_weights).abs()
    atol, rtol = tolerance
    wrong_w = compared & (~(err <= atol + rtol * ref_weights.abs())).any(dim=1)
    if wrong_w.any():
        first = int(torch.nonzero(wrong_w)[0])
        raise CheckFailure(
            f"weights differ from the reference on rows {_rows(wrong_w, row_names)}; row "
            f"{first}: got {weights[first].tolist()}, reference {ref_weights[first].tolist()}"
        )


def expect_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Identical bits (NaN == NaN of the same payload, -0.0 != +0.0)."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise CheckFailure(
            f"{what}: {tuple(actual.shape)} {actual.dtype} vs {tuple(expected.shape)} {expected.dtype}"
        )
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if a.is_floating_point():
        as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, e = a.view(as_int), e.view(as_int)
    differ = a != e
    if differ.any():
        where = tuple(torch.nonzero(differ)[0].tolist())
        raise CheckFailure(
            f"{what}: {int(differ.sum())} elements differ bitwise; first at {where}: "
            f"{actual.detach().cpu()[where].item()} vs {expected.detach().cpu()[where].item()}"
        )


# Output tolerances of experts/moe against the reference, per dtype (atol, rtol): the I-wide
# intermediate is rounded to the input dtype in both, so the difference is fp32 accumulation order.
OUTPUT_TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (5e-3, 5e-3), torch.bfloat16: (3e-2, 3e-2)}


def expect_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    what: str,
    rows: torch.Tensor | None = None,
    scale: float = 1.0,
) -> None:
    """Within the dtype's tolerance (times `scale`); only the `rows` ([T] bool) when given.

    The absolute part scales with the row's largest magnitude (at least 1): a row's error comes
    from rounding its partial sums (bf16 per-slot products, the intermediate), which are as large
    as the row, so a small element of a large row (cancellation) carries the row's error."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise CheckFailure(
            f"{what}: {tuple(actual.shape)} {actual.dtype} vs {tuple(expected.shape)} {expected.dtype}"
        )
    atol, rtol = (scale * t for t in OUTPUT_TOLERANCES[expected.dtype])
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    if e.dim() >= 1 and e.numel():
        row_size = e.abs().amax(dim=-1, keepdim=True).nan_to_num(0.0).clamp(min=1.0)
    else:
        row_size = torch.ones(())
    bad = ~((a - e).abs() <= atol * row_size + rtol * e.abs())  # NaN never passes
    if rows is not None:
        bad &= rows.cpu().reshape(-1, *([1] * (bad.dim() - 1)))
    if bad.any():
        where = tuple(torch.nonzero(bad)[0].tolist())
        raise CheckFailure(
            f"{what}: {int(bad.sum())}/{a.numel()} elements differ (atol={atol:g} x row max, rtol={rtol:g}); "
            f"first at {where}: {a[where].item():.6g} vs {e[where].item():.6g}"
        )


def expect_zero_rows(out: torch.Tensor, first_row: int, what: str) -> None:
    """Rows from `first_row` on are exact zeros (padded rows)."""
    tail = out.detach().cpu()[first_row:]
    nonzero = (tail != 0) | torch.isnan(tail)
    if nonzero.any():
        row = first_row + int(torch.nonzero(nonzero)[0, 0])
        raise CheckFailure(f"{what}: padded row {row} must be exact zeros, got {out[row, :4].tolist()}...")


def expect_finite(out: torch.Tensor, rows: int, what: str) -> None:
    head = out.detach().cpu()[:rows]
    bad = ~torch.isfinite(head)
    if bad.any():
        where = tuple(torch.nonzero(bad)[0].tolist())
        raise CheckFailure(f"{what}: non-finite output at {where} on a valid row: {head[where].item()}")
