"""Family 8, fp8 expert weights: `experts` with float8_e4m3fn w13/w2 and their scales, in both
quantisation modes (per_tensor: activations quantised per token; block: DeepSeek-V3's 128x128
weight blocks and 1x128 activation groups). The clauses of docs/fp8.md:

- Activation scales depend only on their own row (vLLM #40047: one shared scale let a NaN row
  poison every row). A NaN/+-Inf value in a valid row makes that row's output all NaN and leaves
  every other row bitwise what it is when the bad row is finite.
- Padded rows (>= num_valid) are never read and never quantised: poisoned with NaN/+-Inf/1e4/stale
  ids, real rows are bitwise equal to a clean (zero) padding at the same T, padded outputs are
  exact zeros, and (where the backend takes a workspace) the padded rows of the quantised-x
  buffer and its scales keep what was there before the call.
- ids -1, negative, >= E and stale in valid rows are dropped (their NaN weights never read) and
  counted in health[DROPPED_SLOTS]; duplicates are each served; stale ids in padded rows count
  nothing.

Values are compared with `reference.experts_fp8_reference` within the tolerances of
tests/test_experts_fp8.py. A peer takes no fp8 expert weights: n/a.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from safemoe._checks import NumValid
from safemoe.check.cases.common import NUM_VALID_FORMS, num_valid_arg
from safemoe.check.inputs import STALE_ID, random_weights, tokens
from safemoe.check.invariants import expect_bitwise, expect_zero_rows
from safemoe.check.registry import CaseContext, CheckFailure, NotApplicable, Plan, case
from safemoe.fp8 import QUANT_MODES, quantize_experts
from safemoe.health import DROPPED_SLOTS, new_health_tensor
from safemoe.reference import experts_fp8_reference, valid_slot_mask
from safemoe.routing import Routing
from safemoe.workspace import Workspace

# vs `experts_fp8_reference`, per device and x dtype: (relative Frobenius error, worst element /
# max |ref|), as tests/test_experts_fp8.py measured them (CPU fp16 ~4e-4; the interpreter's bf16
# stores truncate: ~1.5e-2; GPU: fp8 MMA accumulation and bf16 rounding of the intermediate).
FP8_TOLERANCES = {
    "cpu": {torch.float16: (5e-3, 2e-2), torch.bfloat16: (3e-2, 6e-2)},
    "cuda": {torch.float16: (3e-2, 1e-1), torch.bfloat16: (3e-2, 1e-1)},
}
BAD_VALUES = {"nan": math.nan, "inf": math.inf, "neg_inf": -math.inf}
PAD_FILLS = ("nan", "inf", "1e4", "stale")
# What the quantised-x buffer and its scales hold before the call: padded rows must keep them
# (0x7e is the e4m3 code of 448; a quantised row is never all 448, a NaN row's codes are 0).
FP8_SENTINEL_BYTE = 0x7E
SCALE_SENTINEL = -3.25


def _dtypes(plan: Plan | CaseContext) -> tuple[torch.dtype, ...]:
    """fp8 experts take bf16/fp16 x. On CPU fp16 first (the interpreter's bf16 stores truncate,
    so bf16 gets the looser bound); on CUDA bf16, the production dtype, first."""
    if plan.device.type == "cuda":
        return (torch.bfloat16, torch.float16)
    return (torch.float16, torch.bfloat16)


def _shapes(ctx: CaseContext) -> tuple[int, int, int, int]:
    """(E, K, H, I): H and I past one 128-group with a tail, so block mode has 2+ groups a row."""
    return ctx.choose((8, 2, 160, 48), (8, 2, 160, 48), (16, 4, 384, 200))


def _require_fp8(ctx: CaseContext) -> None:
    if not getattr(ctx.api, "fp8_experts", False):
        raise NotApplicable(f"{ctx.api.name} takes no fp8 expert weights")


def _problem(ctx: CaseContext, mode: str) -> dict[str, Any]:
    num_experts, top_k, hidden, inter = _shapes(ctx)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=ctx.generator) / math.sqrt(hidden)
    w2 = torch.randn(num_experts, hidden, inter, generator=ctx.generator) / math.sqrt(inter)
    q13, q2, s13, s2 = (t.to(ctx.device) for t in quantize_experts(w13, w2, mode))
    return {"E": num_experts, "K": top_k, "H": hidden, "I": inter, "w13": q13, "w2": q2,
            "w13_scale": s13, "w2_scale": s2, "mode": mode}  # fmt: skip


def _routing(num_rows: int, prob: dict[str, Any], ctx: CaseContext) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, K] fp32, ids [T, K] int32): K distinct valid experts a row."""
    scores = torch.rand(num_rows, prob["E"], generator=ctx.generator)
    ids = scores.argsort(dim=1)[:, : prob["K"]].to(torch.int32).contiguous()
    return random_weights(num_rows, prob["K"], ctx.generator), ids


def _run(ctx: CaseContext, prob: dict[str, Any], x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
         **kwargs: Any) -> torch.Tensor:  # fmt: skip
    routing = Routing(weights=weights.to(ctx.device), ids=ids.to(ctx.device))
    return ctx.api.experts(x.to(ctx.device), prob["w13"], prob["w2"], routing, w13_scale=prob["w13_scale"],
                           w2_scale=prob["w2_scale"], **kwargs)  # fmt: skip


def _expect_fp8_close(
    ctx: CaseContext,
    out: torch.Tensor,
    prob: dict[str, Any],
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    rows: list[int],
    n: int,
    what: str,
) -> None:
    """out[rows] against the fp8 reference (rows < n valid): relative Frobenius error and worst
    element within the measured bounds."""
    ref = experts_fp8_reference(
        x.to(ctx.device), prob["w13"], prob["w2"], prob["w13_scale"], prob["w2_scale"],
        weights.to(ctx.device), ids.to(ctx.device), num_valid=NumValid(n, None),
    )  # fmt: skip
    got, want = out.detach().cpu()[rows].double(), ref.detach().cpu()[rows].double()
    if not bool(torch.isfinite(got).all()):
        row = rows[int(torch.nonzero(~torch.isfinite(got))[0, 0])]
        raise CheckFailure(f"{what}: non-finite output on finite valid row {row}")
    rel_tol, worst_tol = FP8_TOLERANCES[ctx.device.type][x.dtype]
    diff = got - want
    rel = float(diff.norm() / want.norm().clamp_min(1e-30))
    worst = float(diff.abs().max() / want.abs().max().clamp_min(1e-30)) if diff.numel() else 0.0
    if rel > rel_tol or worst > worst_tol:
        raise CheckFailure(
            f"{what} vs experts_fp8_reference: relative error {rel:.2e} (bound {rel_tol:g}), worst element "
            f"{worst:.2e} of max|ref| (bound {worst_tol:g})"
        )


def _nonfinite_params(plan: Plan) -> list[dict[str, Any]]:
    rows = plan.pairs(mode=QUANT_MODES, dtype=_dtypes(plan))
    return plan.cross(rows, bad=plan.choose(("nan", "inf"), tuple(BAD_VALUES), tuple(BAD_VALUES)),
                      num_valid=NUM_VALID_FORMS)  # fmt: skip


@case("fp8.nonfinite_rows", ops=("experts",), params=_nonfinite_params)
def nonfinite_rows(ctx: CaseContext, **p: Any) -> None:
    """a NaN/Inf value in valid rows: those rows all NaN, every other row bitwise as without it"""
    _require_fp8(ctx)
    dtype, mode = p["dtype"], p["mode"]
    prob = _problem(ctx, mode)
    n, num_padded = ctx.choose(9, 9, 45), 3
    x = tokens(n + num_padded, prob["H"], ctx.generator).to(dtype)
    x[n:] = math.nan
    weights, ids = _routing(n + num_padded, prob, ctx)
    # One bad element per poisoned row, in the last 128-group (block: not the group of column 0)
    # at a column that moves with the row.
    bad_rows = [1, n // 2, n - 1]
    dirty = x.clone()
    for i, row in enumerate(bad_rows):
        dirty[row, prob["H"] - 1 - 5 * i] = BAD_VALUES[p["bad"]]
    nv = num_valid_arg(p["num_valid"], n, ctx.device)
    clean_out = _run(ctx, prob, x, weights, ids, num_valid=nv)
    dirty_out = _run(ctx, prob, dirty, weights, ids, num_valid=nv)
    others = [r for r in range(n) if r not in bad_rows]
    expect_bitwise(dirty_out[others], clean_out[others],
                   f"{mode}: rows without {p['bad']} beside rows with it vs those rows finite")  # fmt: skip
    poisoned = dirty_out.detach().cpu()[bad_rows]
    if not bool(poisoned.isnan().all()):
        row = bad_rows[int(torch.nonzero(~poisoned.isnan().all(dim=1))[0])]
        raise CheckFailure(
            f"{mode}: valid row {row} holding {p['bad']} must come out all NaN (docs/fp8.md), got "
            f"{dirty_out[row, :4].tolist()}..."
        )
    expect_zero_rows(dirty_out, n, f"{mode}: padded rows")
    _expect_fp8_close(ctx, clean_out, prob, x, weights, ids, list(range(n)), n, f"{mode}: clean batch")


def _padding_params(plan: Plan) -> list[dict[str, Any]]:
    rows = plan.pairs(mode=QUANT_MODES, dtype=_dtypes(plan))
    fills = plan.choose(("nan", "stale"), PAD_FILLS, PAD_FILLS)
    return plan.cross(rows, fill=fills, num_valid=NUM_VALID_FORMS)


def _workspace(ctx: CaseContext, prob: dict[str, Any], num_rows: int, dtype: torch.dtype) -> Workspace | None:
    """A fp8 workspace with the quantised-x buffer and its scales filled with sentinels, where the
    backend uses one (else None)."""
    if not ctx.api.uses_workspace:
        return None
    ws = Workspace(num_rows, prob["E"], prob["K"], prob["H"], prob["I"], dtype, ctx.device, fp8=True)
    views = ws.fp8_views(num_rows, prob["E"], prob["K"], prob["H"], prob["I"], _group(prob))
    views.x.view(torch.uint8).fill_(FP8_SENTINEL_BYTE)
    views.x_scale.fill_(SCALE_SENTINEL)
    return ws


def _group(prob: dict[str, Any]) -> int | None:
    return 128 if prob["mode"] == "block" else None


@case("fp8.padding", ops=("experts",), params=_padding_params)
def padding(ctx: CaseContext, **p: Any) -> None:
    """padded rows poisoned (NaN/Inf/1e4 x, stale ids, NaN weights): never quantised, zeros; real rows kept"""
    _require_fp8(ctx)
    dtype, mode, fill = p["dtype"], p["mode"], p["fill"]
    prob = _problem(ctx, mode)
    n, num_padded = ctx.choose(7, 7, 37), ctx.choose(5, 5, 27)
    num_rows = n + num_padded
    x = tokens(num_rows, prob["H"], ctx.generator).to(dtype)
    weights, ids = _routing(num_rows, prob, ctx)
    nv = num_valid_arg(p["num_valid"], n, ctx.device)

    def padded(kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        px, pw, pids = x.clone(), weights.clone(), ids.clone()
        if kind == "zero":
            px[n:], pw[n:], pids[n:] = 0, 0, -1
        elif kind == "stale":  # finite x that looks real; garbage and stale ids; huge weights
            pids[n::2] = STALE_ID
            pids[n + 1 :: 2] = torch.tensor([-1, prob["E"]], dtype=torch.int32).repeat(prob["K"])[: prob["K"]]
            pw[n:] = 1e4
        else:  # x poisoned, ids that look real (a reused buffer, vLLM #41834), NaN weights
            px[n:] = {"nan": math.nan, "inf": math.inf, "1e4": 1e4}[kind]
            px[n::2, 0] = -px[n::2, 0]
            pw[n:] = math.nan
        return px, pw, pids

    ws = _workspace(ctx, prob, num_rows, dtype)
    clean = _run(ctx, prob, *padded("zero"), num_valid=nv)
    dirty_x, dirty_w, dirty_ids = padded(fill)
    kwargs: dict[str, Any] = {"num_valid": nv} if ws is None else {"num_valid": nv, "workspace": ws}
    dirty = _run(ctx, prob, dirty_x, dirty_w, dirty_ids, **kwargs)
    expect_bitwise(dirty[:n], clean[:n], f"{mode}: real rows, padding {fill} vs zero padding at the same T")
    expect_zero_rows(dirty, n, f"{mode}: padding {fill}")
    if ws is not None:
        views = ws.fp8_views(num_rows, prob["E"], prob["K"], prob["H"], prob["I"], _group(prob))
        codes = views.x.view(torch.uint8)[n:].cpu()
        if bool((codes != FP8_SENTINEL_BYTE).any()):
            row = n + int(torch.nonzero(codes != FP8_SENTINEL_BYTE)[0, 0])
            raise CheckFailure(f"{mode}: padded row {row} of the quantised x was written (padding {fill})")
        scales = views.x_scale[n:].cpu()
        if bool((scales != SCALE_SENTINEL).any()):
            row = n + int(torch.nonzero(scales != SCALE_SENTINEL)[0, 0])
            raise CheckFailure(f"{mode}: the activation scale of padded row {row} was written ({fill})")
    _expect_fp8_close(ctx, dirty, prob, x, weights, ids, list(range(n)), n, f"{mode}: real rows")


def _bad_ids_params(plan: Plan) -> list[dict[str, Any]]:
    rows = plan.pairs(mode=QUANT_MODES, dtype=_dtypes(plan))
    return plan.cross(rows, num_valid=NUM_VALID_FORMS)


@case("fp8.bad_ids", ops=("experts",), params=_bad_ids_params)
def bad_ids(ctx: CaseContext, **p: Any) -> None:
    """ids -1, -7, E, 123456789 in valid rows dropped and counted, duplicates served, stale padding ignored"""
    _require_fp8(ctx)
    dtype, mode = p["dtype"], p["mode"]
    prob = _problem(ctx, mode)
    n, num_padded = ctx.choose(8, 8, 40), 4
    num_rows = n + num_padded
    num_experts = prob["E"]
    x = tokens(num_rows, prob["H"], ctx.generator).to(dtype)
    x[n:] = math.nan
    weights, ids = _routing(num_rows, prob, ctx)
    bad_values = torch.tensor([-1, -7, num_experts, STALE_ID], dtype=torch.int32)
    for row in range(0, n, 2):  # every other valid row: its last slot holds a bad id
        ids[row, -1] = bad_values[(row // 2) % len(bad_values)]
    ids[1::3, 0] = ids[1::3, -1].clamp(min=0, max=num_experts - 1)  # duplicates (or a fresh valid id)
    ids[n:] = STALE_ID
    ids[n + 1 :: 2, 0] = 0  # padded rows that look routed
    dropped = ~valid_slot_mask(ids, num_experts)
    weights = torch.where(dropped, math.nan, weights)
    weights[n:] = math.nan
    counter = new_health_tensor(ctx.device) if ctx.api.counts_health else None
    kwargs: dict[str, Any] = {"num_valid": num_valid_arg(p["num_valid"], n, ctx.device)}
    if counter is not None:
        kwargs["health"] = counter
    out = _run(ctx, prob, x, weights, ids, **kwargs)
    expect_zero_rows(out, n, f"{mode}: padded rows")
    _expect_fp8_close(ctx, out, prob, x, weights, ids, list(range(n)), n, f"{mode}: rows with bad ids")
    if counter is not None:
        want, got = int(dropped[:n].sum()), int(counter[DROPPED_SLOTS])
        if got != want:
            raise CheckFailure(f"{mode}: health[DROPPED_SLOTS] is {got}, expected {want}")
