"""safemoe.MoE against the reference, padding and health behaviour, workspace plumbing, compile;
on a GPU also torch.compile of the Triton layer at the Qwen3-30B-A3B shape and its peak memory."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import safemoe
from helpers import QWEN3_SHAPE, assert_close, assert_equal, interpreter_only, qwen3_moe, qwen3_workspace
from safemoe import ops
from safemoe._checks import NumValid
from safemoe.health import Health
from safemoe.layer import MoE, fold_expert_biases, folded_hidden
from safemoe.reference import activation_reference, moe_reference

H, I, E, K = 32, 16, 8, 2  # noqa: E741 (the project's shape names)


def make_moe(**kwargs) -> MoE:
    torch.manual_seed(0)
    moe = MoE(H, I, E, K, **kwargs)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
        if moe.expert_bias:
            moe.w13[:, :, H + 1 :].zero_()
            moe.w2[:, H:, :].zero_()
    return moe


def route_kwargs(moe: MoE) -> dict:
    g = moe.gate  # the routing options travel whole, as the gate's RouteConfig
    options = {name: value for name, value in vars(g.config).items() if name != "top_k"}
    return dict(bias=g.selection_bias, **options)


def padded_input(num_tokens: int, num_valid: int) -> torch.Tensor:
    x = torch.randn(num_tokens, H)
    x[num_valid:] = math.nan
    return x


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(renormalize=False, activation="gelu"),
        dict(scoring="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5, selection_bias=True),
    ],
)
@pytest.mark.parametrize("nv_kind", ["none", "int", "tensor"])
def test_moe_matches_reference(options, nv_kind):
    moe = make_moe(**options)
    if moe.gate.selection_bias is not None:
        moe.gate.selection_bias.normal_(0, 0.5)
    num_valid = 7
    x = padded_input(11, num_valid) if nv_kind != "none" else torch.randn(11, H)
    nv = {"none": None, "int": num_valid, "tensor": torch.tensor(num_valid)}[nv_kind]
    with torch.no_grad():
        got = moe(x, num_valid=nv)
        logits = F.linear(x, moe.gate.weight)
        count = 11 if nv is None else num_valid
        want = moe_reference(
            x, logits, moe.w13, moe.w2, K, activation=moe.activation, num_valid=NumValid(count, None),
            **route_kwargs(moe),
        )  # fmt: skip
    assert_close(got, want, what="MoE vs reference")
    assert_equal(got[count:], torch.zeros_like(got[count:]), what="padded rows")


def test_moe_keeps_leading_dims_and_fp16():
    moe = make_moe(dtype=torch.float16)
    x = torch.randn(2, 3, H, dtype=torch.float16)
    with torch.no_grad():
        got = moe(x)
        want = moe_reference(x.reshape(6, H), F.linear(x.reshape(6, H), moe.gate.weight), moe.w13, moe.w2, K)
    assert got.shape == (2, 3, H) and got.dtype == torch.float16
    assert_close(got.reshape(6, H), want)


def test_shared_expert_with_gate_and_padding():
    moe = make_moe(shared_intermediate_size=24, shared_expert_gate=True)
    x = padded_input(9, 5)
    with torch.no_grad():
        got = moe(x, num_valid=torch.tensor(5))
        routed = moe_reference(
            x, F.linear(x, moe.gate.weight), moe.w13, moe.w2, K, num_valid=NumValid(5, None)
        )
        s = moe.shared_expert
        shared = s.down_proj(F.silu(s.gate_proj(x)) * s.up_proj(x)) * torch.sigmoid(moe.shared_expert_gate(x))
    assert_close(got[:5], routed[:5] + shared[:5])
    assert_equal(got[5:], torch.zeros_like(got[5:]), what="padded rows (shared expert zeroed)")


def slot_reference(x, w13, b13, w2, b2, weights, ids, activation):
    """Per-slot gated MLP with biases: what gpt-oss computes."""
    out = torch.zeros_like(x)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0:
                continue
            h = w13[e] @ x[t] + b13[e]
            act = activation_reference(h[:inter], h[inter:], activation)
            out[t] += weights[t, k] * (w2[e] @ act + b2[e])
    return out


def test_expert_biases_folded():
    moe = MoE(H, I, E, K, activation="swigluoai", router_bias=True, expert_bias=True)
    torch.manual_seed(1)
    w13, b13 = torch.randn(E, 2 * I, H) * 0.3, torch.randn(E, 2 * I)
    w2, b2 = torch.randn(E, H, I) * 0.3, torch.randn(E, H)
    moe.load_experts(w13, w2, b13, b2)
    assert moe.w13.shape == (E, 2 * I, folded_hidden(H)) and folded_hidden(H) % 16 == 0
    assert_equal(moe.w13_bias, b13)
    x = padded_input(6, 4)
    with torch.no_grad():
        moe.gate.bias.normal_()
        got = moe(x, num_valid=4)
        routing = safemoe.route(F.linear(x, moe.gate.weight, moe.gate.bias), K, num_valid=4)
    want = slot_reference(x[:4], w13, b13, w2, b2, routing.weights[:4], routing.ids[:4], "swigluoai")
    assert_close(got[:4], want, atol=1e-4, rtol=1e-4)
    assert_equal(got[4:], torch.zeros_like(got[4:]), what="padded rows")


def input_weighted_reference(x, w13, w2, weights, ids):
    """Llama 4: sum over picked experts of expert(x * w), x * w rounded to x's dtype; no weight on
    the output."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0:
                continue
            h = w13[e].float() @ (x[t] * weights[t, k].to(x.dtype)).float()
            act = activation_reference(h[:inter], h[inter:], "silu").to(x.dtype).float()
            out[t] += w2[e].float() @ act
    return out.to(x.dtype)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=interpreter_only(
    "CPU tensors; the Llama 4 family runs on the GPU in test_integrations_transformers"))])
def test_input_weighted_experts(top_k, backend):
    """input_weighted (Llama 4): the weight scales the expert's input; with a gated MLP that is
    not the output-weighted sum. NaN padding rows are never read and come out as zeros."""
    dtype = torch.float16 if backend == "triton" else torch.float32
    torch.manual_seed(2)
    moe = MoE(H, I, E, top_k, scoring="sigmoid", renormalize=False, input_weighted=True, backend=backend,
              dtype=dtype)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    x = padded_input(9, 6).to(dtype)
    with torch.no_grad():
        got = moe(x, num_valid=torch.tensor(6))
        logits = F.linear(x, moe.gate.weight)
        routing = safemoe.route(logits, moe.route_config, num_valid=6, backend="reference")
        want = input_weighted_reference(x[:6], moe.w13, moe.w2, routing.weights[:6], routing.ids[:6])
        output_weighted = moe_reference(x[:6], F.linear(x[:6], moe.gate.weight), moe.w13, moe.w2,
                                        moe.route_config)
    assert_close(got[:6], want, what="input-weighted experts")
    assert_equal(got[6:], torch.zeros_like(got[6:]), what="padded rows")
    assert not torch.allclose(got[:6].float(), output_weighted.float(), atol=1e-3), "not output weighting"
    with pytest.raises(ValueError, match="input_weighted"):
        MoE(H, I, E, top_k, input_weighted=True, expert_bias=True)


def test_fold_expert_biases_layout():
    w13, b13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, 2 * I), torch.randn(E, H, I)
    w13f, w2f = fold_expert_biases(w13, b13, w2)
    assert_equal(w13f[:, :, :H], w13)
    assert_equal(w13f[:, :, H], b13)
    assert (w13f[:, :, H + 1 :] == 0).all() and (w2f[:, H:] == 0).all()
    assert_equal(w2f[:, :H], w2)


def test_health_counts_nonfinite_and_padded_rows():
    health = Health()
    moe = make_moe(health=health)
    assert moe.health is health.tensor
    x = torch.randn(8, H)
    x[2, 3] = math.nan  # a valid row with a NaN: its logits are NaN
    x[6:] = math.nan  # padding
    with torch.no_grad():
        out = moe(x, num_valid=torch.tensor(6))
    assert torch.isfinite(out[[0, 1, 3, 4, 5]]).all()
    counts = health.read()
    assert counts == {"nonfinite_rows": 1, "dropped_slots": 0, "padded_rows": 2, "ep_overflow_slots": 0}
    with torch.no_grad():
        moe(x, num_valid=6)
    assert health.read()["padded_rows"] == 4
    health.reset()
    assert set(health.read().values()) == {0}
    assert "cpu" in repr(health)


def test_moe_argument_errors():
    with pytest.raises(ValueError, match="activation"):
        MoE(H, I, E, K, activation="relu")
    with pytest.raises(ValueError, match="shared_expert_gate"):
        MoE(H, I, E, K, shared_expert_gate=True)
    with pytest.raises(ValueError, match="top_k"):
        MoE(H, I, E, E + 1)
    with pytest.raises(ValueError, match="n_group"):
        MoE(H, I, E, K, n_group=3, topk_group=1)
    with pytest.raises(ValueError, match="backend"):
        MoE(H, I, E, K, backend="cuda")
    with pytest.raises(ValueError, match="H=32"):
        make_moe()(torch.randn(3, H + 1))
    with pytest.raises(ValueError, match="expert_bias=False"):
        make_moe().load_experts(torch.randn(E, 2 * I, H), torch.randn(E, H, I), torch.randn(E, 2 * I))


def _workspace_module():
    try:
        import safemoe.workspace as module
    except ImportError:
        return None
    return module


def test_layers_share_one_workspace(monkeypatch):
    workspace = safemoe.Workspace(16, E, K, H, I, torch.float32, "cpu")
    layers = [make_moe(workspace=workspace) for _ in range(4)]
    seen = []

    def recording_experts(x, w13, w2, weights, ids, *, workspace=None, **kwargs):
        seen.append(workspace)
        return torch.zeros_like(x)

    monkeypatch.setattr(ops, "experts", recording_experts)
    x = torch.randn(5, H)
    with torch.no_grad():
        for layer in layers:
            layer(x)
    assert len(seen) == 4 and all(s is workspace for s in seen)
    assert all(layer.workspace is workspace for layer in layers)


def test_workspace_is_typed():
    with pytest.raises(TypeError, match=r"workspace must be a safemoe\.Workspace"):
        make_moe(workspace=object())
    moe = make_moe()
    with pytest.raises(TypeError, match=r"workspace must be a safemoe\.Workspace"):
        moe.set_workspace("x")  # type: ignore[arg-type]


@pytest.mark.skipif(_workspace_module() is None, reason="safemoe.workspace not built yet")
def test_workspace_bytes_matches_allocation():
    module = _workspace_module()
    args = dict(max_tokens=64, num_experts=E, top_k=K, hidden=H, inter=I, dtype=torch.float16)
    ws = module.Workspace(**args, device="cpu")
    assert ws.nbytes == module.workspace_bytes(**args)


def test_torch_compile_fullgraph_cpu():
    moe = make_moe(shared_intermediate_size=24, shared_expert_gate=True, health=Health())
    x = padded_input(10, 6)
    with torch.no_grad():
        eager = moe(x, num_valid=torch.tensor(6))
        compiled = torch.compile(moe, fullgraph=True)
        got = compiled(x, num_valid=torch.tensor(6))
        assert_equal(got, eager)
        again = compiled(x, num_valid=torch.tensor(3))  # a new count, same graph
    assert_equal(again[3:], torch.zeros_like(again[3:]))
    assert moe.health is not None and int(moe.health[2]) == 4 + 4 + 7


def _triton_kernels_built() -> bool:
    try:
        import safemoe.kernels.experts
        import safemoe.kernels.routing  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _triton_kernels_built(), reason="Triton router/expert kernels not built yet")
@interpreter_only("CPU tensors; on a GPU test_graphs.py and the compile case below run the Triton layer")
def test_four_layers_share_a_workspace_triton_interpreter():
    """Four layers, one real Workspace, the Triton kernels under the interpreter vs the reference."""
    module = _workspace_module()
    assert module is not None
    workspace = module.Workspace(8, E, K, H, I, torch.float16, "cpu")
    x = padded_input(6, 4).half()
    for seed in range(4):
        torch.manual_seed(seed)
        layer = MoE(H, I, E, K, backend="triton", dtype=torch.float16, workspace=workspace)
        reference = MoE(H, I, E, K, backend="reference", dtype=torch.float16)
        reference.load_state_dict(layer.state_dict())
        with torch.no_grad():
            got = layer(x, num_valid=torch.tensor(4))
            want = reference(x, num_valid=4)
        assert_close(got, want, what=f"layer {seed}")
        assert_equal(got[4:], torch.zeros_like(got[4:]))


@pytest.mark.gpu
@torch.inference_mode()
def test_torch_compile_fullgraph_gpu():
    """The Triton layer (Qwen3 shape, bf16, a workspace, a gated shared expert) under fullgraph
    compile. Not merged with the CPU case above: that one compiles the reference backend and also
    checks bitwise equality and health counters."""
    hidden = QWEN3_SHAPE[2]
    moe = qwen3_moe(qwen3_workspace(64), shared_intermediate_size=256, shared_expert_gate=True)
    x = torch.randn(64, hidden, dtype=torch.bfloat16, device="cuda")
    x[40:] = math.nan
    nv = torch.tensor(40, device="cuda", dtype=torch.int32)
    eager = moe(x, num_valid=nv)
    compiled = torch.compile(moe, fullgraph=True)
    got = compiled(x, num_valid=nv)
    assert_close(got, eager)
    assert_equal(got[40:], torch.zeros_like(got[40:]))


def _round(nbytes: int) -> int:
    return -(-nbytes // 512) * 512  # the caching allocator's granularity


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 4096])
@torch.inference_mode()
def test_peak_memory_is_outputs_only(num_tokens):
    num_experts, top_k, hidden, _ = QWEN3_SHAPE
    moe = qwen3_moe(qwen3_workspace(4096))
    x = torch.randn(num_tokens, hidden, dtype=torch.bfloat16, device="cuda")
    nv = torch.tensor(num_tokens, device="cuda", dtype=torch.int32)
    moe(x, num_valid=nv)  # warm-up: Triton compilation, cuBLAS workspace
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = moe(x, num_valid=nv)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    outputs = {
        "logits [T, E] bf16": _round(num_tokens * num_experts * 2),
        "weights [T, K] f32": _round(num_tokens * top_k * 4),
        "ids [T, K] i32": _round(num_tokens * top_k * 4),
        "out [T, H] bf16": _round(num_tokens * hidden * 2),
    }
    assert out.shape == (num_tokens, hidden)
    assert peak <= sum(outputs.values()), (
        f"peak {peak} B > workspace-free outputs {outputs} ({sum(outputs.values())} B)"
    )
