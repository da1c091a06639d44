"""Experts against the reference on ordinary inputs, every activation, and the whole moe step on
router rows with NaN/Inf (the production chain: NaN logits -> routing -> experts) end to end."""

from __future__ import annotations

import torch

from safemoe._checks import NumValid
from safemoe.check.cases.common import dtypes, padded_logits, route_modes
from safemoe.check.inputs import expert_weights, interleave_with_tie_free, tokens, top_k_for
from safemoe.check.invariants import expect_close, expect_finite, expect_zero_rows
from safemoe.check.registry import CaseContext, CheckFailure, case
from safemoe.health import NONFINITE_ROWS, new_health_tensor
from safemoe.reference import experts_reference, moe_reference, route_reference
from safemoe.routing import Routing

ACTIVATIONS = ("silu", "gelu", "swigluoai")


@case("experts.activations", ops=("experts",))
def activations(ctx: CaseContext) -> None:
    """experts equal the reference for silu, gelu and swigluoai"""
    for p in ctx.grid(dtype=dtypes(ctx), activation=ACTIVATIONS, E=ctx.choose((8,), (8,), (8, 64, 128))):
        dtype, num_experts = p["dtype"], p["E"]
        with ctx.sub(**p):
            top_k = top_k_for(num_experts)
            hidden, inter = ctx.choose((32, 16), (32, 16), (512, 256))
            num_rows = ctx.choose(4, 6, 67)
            w13, w2 = (
                w.to(ctx.device) for w in expert_weights(num_experts, hidden, inter, dtype, ctx.generator)
            )
            # Larger inputs than tokens() so swigluoai's clamps at +-7 are reached.
            x = (3 * tokens(num_rows, hidden, ctx.generator)).to(dtype).to(ctx.device)
            logits = torch.randn(num_rows, num_experts, generator=ctx.generator)
            weights, ids = route_reference(logits, top_k)
            routing = Routing(weights.to(ctx.device), ids.to(ctx.device))
            out = ctx.api.experts(x, w13, w2, routing, activation=p["activation"])
            expected = experts_reference(x, w13, w2, routing.weights, routing.ids, activation=p["activation"])
            expect_close(out, expected, "experts vs reference")


@case("experts.nan_router_chain", ops=("moe",))
def nan_router_chain(ctx: CaseContext) -> None:
    """moe with NaN/Inf router rows: finite outputs, reference values, non-finite rows counted"""
    kinds = interleave_with_tie_free(["all_nan", "mixed_nonfinite", "all_pos_inf", "one_nan_odd"])
    nonfinite = 4
    for p in ctx.grid(dtype=dtypes(ctx), mode=route_modes(ctx)):
        dtype, mode = p["dtype"], p["mode"]
        with ctx.sub(dtype=dtype, mode=mode.name):
            num_experts = ctx.choose(8, 8, 64)
            top_k = top_k_for(num_experts)
            hidden, inter = ctx.choose((32, 16), (32, 16), (256, 128))
            w13, w2 = (
                w.to(ctx.device) for w in expert_weights(num_experts, hidden, inter, dtype, ctx.generator)
            )
            n, num_padded = len(kinds), 2
            logits = padded_logits(kinds, num_padded, num_experts, dtype, ctx)
            x = tokens(n + num_padded, hidden, ctx.generator).to(dtype).to(ctx.device)
            kwargs = mode.kwargs(num_experts, top_k, ctx.generator, ctx.device)
            counter = new_health_tensor(ctx.device)
            out = ctx.api.moe(x, logits, w13, w2, top_k, num_valid=n, health=counter, **kwargs)
            expect_finite(out, n, "moe on NaN router rows")
            expect_zero_rows(out, n, "moe on NaN router rows")
            expected = moe_reference(x, logits, w13, w2, top_k, num_valid=NumValid(n, None), **kwargs)
            expect_close(out, expected, "moe vs reference")
            if int(counter[NONFINITE_ROWS]) != nonfinite:
                raise CheckFailure(
                    f"health[NONFINITE_ROWS] is {int(counter[NONFINITE_ROWS])}, expected {nonfinite}"
                )
