"""experts_implementation="safemoe" (safemoe.integrations.hf_experts) on tiny random models.

fp32 on CPU (safemoe's reference backend; one case runs the Triton kernels under the
interpreter). Every family of the installed transformers whose experts class carries
`@use_experts_implementation` and that builds from a tiny config (builders shared with
scripts/models_coverage.py): the logits of a left-padded batch of two prompts match the stock
experts ("eager") at fp32 rounding and greedy generation gives the same tokens; a family whose
experts safemoe cannot run falls back to grouped_mm with a recorded reason and still matches.
Then the layouts one by one, the prepared-once cache, and ids outside [0, E) from a router.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from helpers import interpreter_only, load_script

transformers = pytest.importorskip("transformers")

import safemoe.integrations.transformers  # noqa: E402,F401  registers "safemoe"
from safemoe.health import DROPPED_SLOTS, Health  # noqa: E402
from safemoe.integrations import hf_experts  # noqa: E402

coverage = load_script("models_coverage")

FAMILIES = sorted(coverage.moe_families())


def test_registered_in_the_experts_interfaces():
    from transformers.integrations import moe

    assert moe.ALL_EXPERTS_FUNCTIONS["safemoe"] is hf_experts.safemoe_experts_forward
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    if hasattr(fp8, "ALL_FP8_EXPERTS_FUNCTIONS"):
        assert fp8.ALL_FP8_EXPERTS_FUNCTIONS["safemoe"] is hf_experts.safemoe_fp8_experts_forward


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_stock_experts(family):
    try:
        stock = coverage.build(family, "eager")
    except coverage.Unbuildable as exc:
        pytest.skip(f"{family}: {exc}")
    model = coverage.build(family, "safemoe")  # from_config(..., experts_implementation="safemoe")
    model.load_state_dict(stock.state_dict())
    assert model.config._experts_implementation == "safemoe"
    modules = hf_experts.experts_modules(model)
    assert modules, f"{family}: no @use_experts_implementation module in the tiny model"

    want = coverage.logits(stock)
    got = coverage.logits(model)
    assert torch.isfinite(want).all()
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, rtol=coverage.RTOL, atol=coverage.ATOL * scale)

    # Every experts module was planned by safemoe: it runs it, or fell back with a reason.
    missing = [n for n, m in modules if getattr(m, "_safemoe_plan", None) is None]
    assert not missing, f"never reached safemoe's forward: {missing}"
    for name, reason in hf_experts.fallbacks(model).items():
        assert reason and isinstance(reason, str), name

    try:
        want_tokens = coverage.generate(stock)
    except Exception as exc:  # the stock tiny model itself: inkling2 under transformers 5.24 (an id
        # past its embedding); the logits and the plans above were compared all the same
        pytest.skip(f"{family}: logits match; the stock tiny model cannot generate: "
                    f"{type(exc).__name__}: {exc}")
    assert torch.equal(coverage.generate(model), want_tokens)


def test_switching_an_existing_model():
    stock = coverage.build("qwen3_moe", "eager")
    want = coverage.logits(stock)
    stock.set_experts_implementation("safemoe")
    assert stock.config._experts_implementation == "safemoe"
    got = coverage.logits(stock)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert hf_experts.fallbacks(stock) == {}


# -- layouts on a bare experts module ----------------------------------------------------------

E, H, INTER, T, K = 6, 16, 8, 10, 3


class _Config:
    _experts_implementation = "eager"
    hidden_act = "silu"


def _experts_class(flags: dict, *, activation: str = "silu", interleaved_gate: bool = False) -> type:
    """A decorated experts class of the given layout; its eager forward is the plain loop."""
    from transformers.activations import ACT2FN
    from transformers.integrations.moe import use_experts_implementation

    transposed = flags.get("is_transposed", False)
    bias = flags.get("has_bias", False)

    class Experts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = E
            shape13 = (E, H, 2 * INTER) if transposed else (E, 2 * INTER, H)
            shape2 = (E, INTER, H) if transposed else (E, H, INTER)
            self.gate_up_proj = nn.Parameter(torch.randn(shape13) / 4)
            self.down_proj = nn.Parameter(torch.randn(shape2) / 3)
            if bias:
                self.gate_up_proj_bias = nn.Parameter(torch.randn(E, 2 * INTER) / 4)
                self.down_proj_bias = nn.Parameter(torch.randn(E, H) / 4)
            self.act_fn = ACT2FN[activation]

        if interleaved_gate:

            def _apply_gate(self, gate_up):
                return self.act_fn(gate_up[..., ::2]) * gate_up[..., 1::2]

        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden_states)
            for t in range(hidden_states.shape[0]):
                for k in range(top_k_index.shape[1]):
                    e = int(top_k_index[t, k])
                    if not 0 <= e < self.num_experts:
                        continue
                    w13 = self.gate_up_proj[e].t() if transposed else self.gate_up_proj[e]
                    w2 = self.down_proj[e].t() if transposed else self.down_proj[e]
                    h = w13 @ hidden_states[t]
                    if bias:
                        h = h + self.gate_up_proj_bias[e]
                    y = w2 @ self._apply_gate(h[None])[0]
                    if bias:
                        y = y + self.down_proj_bias[e]
                    out[t] += top_k_weights[t, k] * y
            return out

    return use_experts_implementation(Experts, **flags)


LAYOUTS = {
    "standard": (dict(), "silu", False),
    "gelu_tanh": (dict(), "gelu_pytorch_tanh", False),
    "transposed": (dict(is_transposed=True), "silu", False),
    "interleaved": (dict(is_concatenated=False), "silu", True),
    "gpt_oss_like": (dict(is_concatenated=False, is_transposed=True, has_bias=True), "silu", True),
    "bias": (dict(has_bias=True), "silu", False),
}


def _routing(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=gen)
    return x, ids, weights


def _run(module: nn.Module, impl: str, *args: torch.Tensor) -> torch.Tensor:
    module.config._experts_implementation = impl
    with torch.no_grad():
        return module(*args)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layouts(layout):
    flags, activation, interleaved = LAYOUTS[layout]
    torch.manual_seed(0)
    module = _experts_class(flags, activation=activation, interleaved_gate=interleaved)(_Config())
    x, ids, weights = _routing()
    want = _run(module, "eager", x, ids, weights)
    got = _run(module, "safemoe", x, ids, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plan = module._safemoe_plan
    assert plan.fallback is None
    direct = layout in ("standard", "gelu_tanh")
    # The matching layout runs on the module's own Parameters; others on a copy made once.
    assert (plan.w13 is module.gate_up_proj) == direct and (plan.w2 is module.down_proj) == direct
    assert plan.copied == (not direct)
    _run(module, "safemoe", x, ids, weights)
    assert module._safemoe_plan is plan  # prepared once, not per call


def test_cache_rebuilt_when_parameters_change():
    module = _experts_class({"is_transposed": True})(_Config())
    x, ids, weights = _routing()
    _run(module, "safemoe", x, ids, weights)
    plan = module._safemoe_plan
    with torch.no_grad():
        module.down_proj.mul_(2.0)  # in place: the version counter moves
    want = _run(module, "eager", x, ids, weights)
    got = _run(module, "safemoe", x, ids, weights)
    assert module._safemoe_plan is not plan
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    module.gate_up_proj = nn.Parameter(module.gate_up_proj.detach().clone() * 0.5)  # replaced
    want = _run(module, "eager", x, ids, weights)
    torch.testing.assert_close(_run(module, "safemoe", x, ids, weights), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "activation, reason",
    [("gelu", "none of safemoe's activations"), ("relu2", "none of safemoe's activations")],
)
def test_unsupported_activation_falls_back_to_grouped_mm(activation, reason):
    module = _experts_class({}, activation=activation)(_Config())
    x, ids, weights = _routing()
    want = _run(module, "eager", x, ids, weights)
    got = _run(module, "safemoe", x, ids, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert reason in module._safemoe_plan.fallback


def test_non_gated_and_post_norm_fall_back():
    cases = (({"has_gate": False}, "non-gated"), ({"has_post_expert_norm": True}, "post_expert_norm"))
    for flags, reason in cases:
        module = _experts_class({})(_Config())
        for key, value in flags.items():
            setattr(module, key, value)
        plan = hf_experts._plan(module, fp8=False)
        assert plan.fallback is not None and reason in plan.fallback


@interpreter_only("CPU tensors on backend='triton'")
def test_triton_backend_under_the_interpreter():
    module = _experts_class({"is_transposed": True, "has_bias": True})(_Config())
    hf_experts.configure(module, backend="triton")
    x, ids, weights = _routing()
    want = _run(module, "eager", x, ids, weights)
    got = _run(module, "safemoe", x, ids, weights)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_nan_row_stays_in_its_row():
    module = _experts_class({})(_Config())
    x, ids, weights = _routing()
    clean = _run(module, "safemoe", x, ids, weights)
    x[3] = math.nan
    weights[5, 1] = math.nan
    out = _run(module, "safemoe", x, ids, weights)
    assert out[3].isnan().all() and out[5].isnan().any()
    rows = [r for r in range(T) if r not in (3, 5)]
    assert torch.equal(out[rows], clean[rows])


# -- ids outside [0, E) from a router ----------------------------------------------------------


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_router_ids_outside_range_are_dropped(family):
    """A router emitting -1, E, -E, 2**31 - 1 and 2**32 + 1 (int64: wraps to 1 in int32): those
    slots are dropped and counted, never served or used as an address; the model does not crash
    and matches the stock experts with the same slots given weight 0 (on expert 0: transformers
    5.17's eager loop one-hots every id, so its EP sentinel E is no option there)."""
    stock = coverage.build(family, "eager")
    model = coverage.build(family, "safemoe")
    model.load_state_dict(stock.state_dict())
    num_experts = hf_experts.experts_modules(model)[0][1].gate_up_proj.shape[0]
    bad = torch.tensor([-1, num_experts, -num_experts, 2**31 - 1, 2**32 + 1])

    def corrupt(stock: bool):
        def hook(module, args, output):
            logits, scores, index = output
            index, scores = index.clone(), scores.clone()
            flat = index.view(-1)
            picks = torch.arange(0, flat.numel(), 3)[: 3 * len(bad)]
            if stock:  # the same slots contribute nothing
                flat[picks] = 0
                scores.view(-1)[picks] = 0
            else:
                flat[picks] = bad.repeat(3)[: len(picks)]
            return logits, scores, index

        return hook

    def gates(m):
        return [mod for name, mod in m.named_modules() if name.endswith("mlp.gate")]

    health = Health()
    hf_experts.configure(model, health=health)
    handles = [g.register_forward_hook(corrupt(stock=False)) for g in gates(model)]
    handles += [g.register_forward_hook(corrupt(stock=True)) for g in gates(stock)]
    try:
        got = coverage.logits(model)
        want = coverage.logits(stock)
    finally:
        for h in handles:
            h.remove()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * max(1.0, want.abs().max().item()))
    dropped = health.tensor[DROPPED_SLOTS].item()
    assert dropped >= 3 * len(bad), dropped  # every corrupted slot of every layer, counted


def test_routing_of_never_wraps_an_id_into_range():
    index = torch.tensor([[0, 2**32 + 1, -1], [5, 2**40, 3]])
    routing = hf_experts.routing_of(index, torch.ones(2, 3), 6)
    assert routing.ids.dtype == torch.int32 and routing.weights.dtype == torch.float32
    assert routing.ids.tolist() == [[0, -1, -1], [5, -1, 3]]


# -- fine-grained fp8 experts (FP8ExpertsInterface) --------------------------------------------


@pytest.mark.parametrize("mode", ["block", "per_tensor"])
def test_fp8_experts_run_safemoe_fp8_kernels(mode):
    """transformers' FP8Experts with e4m3 weights and float32 scale_inv run safemoe's fp8 path
    with the module's own tensors (scales reshaped to safemoe's per-tensor [E, 2] / [E])."""
    import safemoe

    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    if not hasattr(fp8, "ALL_FP8_EXPERTS_FUNCTIONS"):
        pytest.skip("this transformers has no FP8ExpertsInterface")
    from transformers.integrations.moe import use_experts_implementation

    num_experts, size = 4, 128
    config = transformers.MixtralConfig(hidden_size=size, intermediate_size=size,
                                        num_local_experts=num_experts, num_experts_per_tok=2)
    config._experts_implementation = "safemoe"
    cls = use_experts_implementation(experts_class=fp8.FP8Experts,
                                     experts_interface=fp8.ALL_FP8_EXPERTS_FUNCTIONS)
    module = cls(config=config, block_size=(128, 128) if mode == "block" else None)
    gen = torch.Generator().manual_seed(0)
    w13 = (torch.randn(num_experts, 2 * size, size, generator=gen) / 8).bfloat16()
    w2 = (torch.randn(num_experts, size, size, generator=gen) / 8).bfloat16()
    q13, q2, s13, s2 = safemoe.quantize_experts(w13, w2, mode)
    if mode == "per_tensor":  # transformers keeps one scale per half of gate_up: [E, 2, 1]
        s13 = s13[:, None].expand(num_experts, 2).contiguous()
    with torch.no_grad():
        module.gate_up_proj.data = q13
        module.down_proj.data = q2
        module.gate_up_proj_scale_inv.data = s13.reshape(module.gate_up_proj_scale_inv.shape)
        module.down_proj_scale_inv.data = s2.reshape(module.down_proj_scale_inv.shape)
    x = torch.randn(5, size, generator=gen).bfloat16()
    ids = torch.tensor([[0, 1], [2, 3], [3, -1], [num_experts, 1], [1, 1]])
    weights = torch.rand(5, 2, generator=gen)
    with torch.no_grad():
        out = module(x, ids, weights)
    plan = module._safemoe_plan
    assert plan.fallback is None and plan.w13 is module.gate_up_proj
    want = safemoe.experts(x, q13, q2, hf_experts.routing_of(ids, weights, num_experts), w13_scale=s13,
                           w2_scale=s2)
    assert torch.equal(out, want)

    module.activation_scheme = "static"  # per-expert static activation scales: not safemoe's
    module.gate_up_proj_scale_inv.data = module.gate_up_proj_scale_inv.data.clone()  # new plan
    assert "activation_scheme" in hf_experts._plan(module, fp8=True).fallback
