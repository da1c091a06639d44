"""Stale, out-of-range and duplicate expert ids fed to experts: a slot whose id is -1, negative,
>= E or garbage (123456789 from a torch.empty buffer, vLLM #41834) contributes nothing and is never
used as an address; duplicate ids in a row are each served; the health counter counts the drops."""

from __future__ import annotations

import math

import torch

from safemoe._checks import NumValid
from safemoe.check.cases.common import NUM_VALID_FORMS, dtypes, num_valid_arg
from safemoe.check.inputs import expert_weights, random_weights, stale_ids, tokens
from safemoe.check.invariants import expect_close, expect_finite, expect_zero_rows
from safemoe.check.registry import CaseContext, CheckFailure, case
from safemoe.health import DROPPED_SLOTS, new_health_tensor
from safemoe.reference import experts_reference, valid_slot_mask
from safemoe.routing import Routing


def _weights(
    ctx: CaseContext, dtype: torch.dtype, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(w13, w2, H) on the device."""
    hidden, inter = ctx.choose((32, 16), (32, 16), (128, 64))
    w13, w2 = expert_weights(num_experts, hidden, inter, dtype, ctx.generator)
    return w13.to(ctx.device), w2.to(ctx.device), hidden


@case("stale.ids", ops=("experts",))
def stale(ctx: CaseContext) -> None:
    """ids -1, -7, E, 123456789 are dropped (their NaN weights never read), duplicates each served"""
    for p in ctx.grid(
        dtype=dtypes(ctx), E=ctx.choose((8,), (6, 8), (8, 64, 160)), K=(1, 2, 4), num_valid=NUM_VALID_FORMS
    ):
        num_experts, top_k, dtype = p["E"], p["K"], p["dtype"]
        with ctx.sub(**p):
            w13, w2, hidden = _weights(ctx, dtype, num_experts)
            num_rows = ctx.choose(5, 6, 41)
            n = num_rows - 2
            ids = stale_ids(num_rows, top_k, num_experts, ctx.generator)
            weights = random_weights(num_rows, top_k, ctx.generator)
            # A dropped slot's weight is NaN, so reading it for anything shows in the output.
            dropped = ~valid_slot_mask(ids, num_experts)
            weights = torch.where(dropped, math.nan, weights)
            x = tokens(num_rows, hidden, ctx.generator)
            x[n:] = math.nan
            routing = Routing(weights=weights.to(ctx.device), ids=ids.to(ctx.device))
            x = x.to(dtype).to(ctx.device)
            counter = new_health_tensor(ctx.device)
            out = ctx.api.experts(
                x, w13, w2, routing, num_valid=num_valid_arg(p["num_valid"], n, ctx.device), health=counter
            )
            expect_finite(out, n, "experts with stale ids")
            expect_zero_rows(out, n, "experts with stale ids")
            expected = experts_reference(
                x, w13, w2, routing.weights, routing.ids, num_valid=NumValid(n, None)
            )
            expect_close(out, expected, "experts with stale ids vs reference")
            want = int(dropped[:n].sum())
            got = int(counter[DROPPED_SLOTS])
            if got != want:
                raise CheckFailure(
                    f"health[DROPPED_SLOTS] is {got}, expected {want} dropped slots on valid rows"
                )


@case("stale.duplicates", ops=("experts",))
def duplicates(ctx: CaseContext) -> None:
    """a row whose K ids are all the same expert gets K times its contribution"""
    for p in ctx.grid(dtype=dtypes(ctx), K=(2, 4, 8)):
        top_k, dtype = p["K"], p["dtype"]
        num_experts = 8
        with ctx.sub(**p):
            w13, w2, hidden = _weights(ctx, dtype, num_experts)
            num_rows = ctx.choose(3, 4, 33)
            ids = torch.randint(0, num_experts, (num_rows, 1), generator=ctx.generator, dtype=torch.int32)
            ids = ids.expand(num_rows, top_k).contiguous()
            weights = torch.full((num_rows, top_k), 1.0 / top_k)
            x = tokens(num_rows, hidden, ctx.generator).to(dtype).to(ctx.device)
            dup = ctx.api.experts(x, w13, w2, Routing(weights.to(ctx.device), ids.to(ctx.device)))
            single = ctx.api.experts(
                x,
                w13,
                w2,
                Routing(torch.ones(num_rows, 1, device=ctx.device), ids[:, :1].contiguous().to(ctx.device)),
            )
            expect_close(dup, single, f"{top_k} duplicate slots of weight 1/{top_k} vs one slot of weight 1")
