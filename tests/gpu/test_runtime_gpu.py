"""Runtime on a GPU: CUDA-graph buckets up to 8192 tokens, torch.compile, memory, patched models."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import assert_close, assert_equal
from safemoe.graphs import CUDAGraphRunner, token_buckets
from safemoe.layer import MoE

pytestmark = pytest.mark.gpu

E, K, H, I = 128, 8, 2048, 768  # noqa: E741 (Qwen3-30B-A3B; the project's shape names)
MAX_TOKENS = 8192


def qwen3_moe(workspace=None, **kwargs) -> MoE:
    torch.manual_seed(0)
    moe = MoE(H, I, E, K, dtype=torch.bfloat16, device="cuda", workspace=workspace, **kwargs)
    with torch.no_grad():
        moe.gate.weight.normal_(0, H**-0.5)
        moe.w13.normal_(0, H**-0.5)
        moe.w2.normal_(0, I**-0.5)
    return moe


def workspace_for(max_tokens: int, inter: int = I, hidden: int = H):
    from safemoe.workspace import Workspace

    return Workspace(max_tokens, E, K, hidden, inter, torch.bfloat16, "cuda")


@torch.inference_mode()
def test_every_bucket_to_8192_captures_and_replays_with_num_valid_in_place():
    moe = qwen3_moe(workspace_for(MAX_TOKENS))
    runner = CUDAGraphRunner(lambda x, num_valid: moe(x, num_valid=num_valid), MAX_TOKENS,
                             torch.zeros(1, H, dtype=torch.bfloat16, device="cuda"))  # fmt: skip
    assert runner.graphed and sorted(runner.graphs) == token_buckets(MAX_TOKENS)
    for num_tokens in (1, 3, 100, 2047, 4097, 8192):
        x = torch.randn(num_tokens, H, dtype=torch.bfloat16, device="cuda")
        bucket = runner.bucket_for(num_tokens)
        runner.poison_padding(num_tokens, bucket)
        got = runner(x).clone()
        want = moe(x)
        assert_close(got, want, what=f"T={num_tokens}")
        static = runner.static_outputs[0]
        assert_equal(
            static[num_tokens:bucket], torch.zeros_like(static[num_tokens:bucket]), what="padded rows"
        )
        # Change num_valid in place and replay the same graph: rows past it become zeros.
        if num_tokens > 2:
            runner.num_valid.fill_(num_tokens // 2)
            runner.graphs[bucket].replay()
            half = num_tokens // 2
            assert_close(static[:half], want[:half], what=f"T={num_tokens} replay with num_valid={half}")
            assert_equal(static[half:bucket], torch.zeros_like(static[half:bucket]))
    torch.cuda.synchronize()


@torch.inference_mode()
def test_torch_compile_fullgraph_gpu():
    moe = qwen3_moe(workspace_for(64), shared_intermediate_size=256, shared_expert_gate=True)
    x = torch.randn(64, H, dtype=torch.bfloat16, device="cuda")
    x[40:] = math.nan
    nv = torch.tensor(40, device="cuda", dtype=torch.int32)
    eager = moe(x, num_valid=nv)
    compiled = torch.compile(moe, fullgraph=True)
    got = compiled(x, num_valid=nv)
    assert_close(got, eager)
    assert_equal(got[40:], torch.zeros_like(got[40:]))


def _round(nbytes: int) -> int:
    return -(-nbytes // 512) * 512  # the caching allocator's granularity


@pytest.mark.parametrize("num_tokens", [1, 64, 4096])
@torch.inference_mode()
def test_peak_memory_is_outputs_only(num_tokens):
    moe = qwen3_moe(workspace_for(4096))
    x = torch.randn(num_tokens, H, dtype=torch.bfloat16, device="cuda")
    nv = torch.tensor(num_tokens, device="cuda", dtype=torch.int32)
    moe(x, num_valid=nv)  # warm-up: Triton compilation, cuBLAS workspace
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = moe(x, num_valid=nv)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    outputs = {
        "logits [T, E] bf16": _round(num_tokens * E * 2),
        "weights [T, K] f32": _round(num_tokens * K * 4),
        "ids [T, K] i32": _round(num_tokens * K * 4),
        "out [T, H] bf16": _round(num_tokens * H * 2),
    }
    assert out.shape == (num_tokens, H)
    assert peak <= sum(outputs.values()), (
        f"peak {peak} B > workspace-free outputs {outputs} ({sum(outputs.values())} B)"
    )


def _record_routing(routers: list[torch.nn.Module]) -> tuple[list[torch.Tensor], list]:
    """Forward hooks keeping each router's ids (the last output, [T, K]) as sorted sets."""
    seen: list[torch.Tensor] = []

    def hook(module, args, output):
        seen.append(torch.sort(output[-1].long(), dim=-1).values)

    return seen, [r.register_forward_hook(hook) for r in routers]


def _hf_router(block: torch.nn.Module) -> torch.nn.Module:
    return block.router if hasattr(block, "router") else block.gate


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss"])
@torch.inference_mode()
def test_patched_models_bf16(family):
    """bf16, Triton backend, against the unpatched model. bf16 logits can tie exactly at the top-k
    boundary, where transformers' torch.topk and safemoe's lowest-index rule pick differently: rows
    (tokens) whose expert sets differ in any layer are excluded from the value comparison, and
    must stay rare; every other row must match."""
    pytest.importorskip("transformers")
    from safemoe.integrations.transformers import patch
    from test_integrations_transformers import block_out, build, moe_blocks

    model = build(family).to(device="cuda", dtype=torch.bfloat16)
    blocks = moe_blocks(model)
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (4, 6), device="cuda")
    x = torch.randn(4, 8, 32, device="cuda", dtype=torch.bfloat16)

    hf_seen, handles = _record_routing([_hf_router(b) for _, b in blocks])
    want_logits = model(ids).logits.float()
    want_blocks = [block_out(b, x).float() for _, b in blocks]
    for h in handles:
        h.remove()
    patch(model, backend="triton")
    new_blocks = [model.get_submodule(n) for n, _ in blocks]
    sm_seen, handles = _record_routing([b.moe.gate for b in new_blocks])
    got_logits = model(ids).logits.float()
    got_blocks = [block_out(b, x).float() for b in new_blocks]
    for h in handles:
        h.remove()

    layers = len(blocks)
    same = [(a == b).all(dim=-1) for a, b in zip(hf_seen, sm_seen, strict=True)]  # per call, [T]
    model_rows = torch.stack(same[:layers]).all(dim=0)  # tokens routed alike in every layer
    flips = int((~torch.cat(same)).sum())
    assert flips <= 2, f"{family}: {flips} rows routed differently (more than bf16 top-k ties explain)"
    for i, ((name, _), got, want) in enumerate(zip(blocks, got_blocks, want_blocks, strict=True)):
        rows = same[layers + i]
        got, want = got.reshape(-1, got.shape[-1])[rows], want.reshape(-1, want.shape[-1])[rows]
        assert_close(got, want, atol=0.03 * float(want.abs().max()), rtol=0.03, what=f"{family} {name}")
    got, want = got_logits.reshape(-1, got_logits.shape[-1]), want_logits.reshape(-1, want_logits.shape[-1])
    got, want = got[model_rows], want[model_rows]
    assert_close(got, want, atol=0.03 * float(want.abs().max()), rtol=0.03, what=f"{family} logits")
