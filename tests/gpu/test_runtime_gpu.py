"""Runtime on a GPU: CUDA-graph buckets up to 8192 tokens, torch.compile, memory, patched models."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import assert_close, assert_equal
from safemoe.graphs import CUDAGraphRunner, token_buckets
from safemoe.module import MoE

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


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss"])
@torch.inference_mode()
def test_patched_models_bf16(family):
    pytest.importorskip("transformers")
    from safemoe.integrations.transformers import patch
    from test_integrations_transformers import block_out, build, moe_blocks

    model = build(family).to(device="cuda", dtype=torch.bfloat16)
    blocks = moe_blocks(model)
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (4, 6), device="cuda")
    x = torch.randn(4, 8, 32, device="cuda", dtype=torch.bfloat16)
    want_logits = model(ids).logits.float()
    want_blocks = [block_out(b, x).float() for _, b in blocks]
    patch(model, backend="triton")
    got_logits = model(ids).logits.float()
    for (name, _), want in zip(blocks, want_blocks, strict=True):
        got = block_out(model.get_submodule(name), x).float()
        assert_close(got, want, atol=0.03 * float(want.abs().max()), rtol=0.03, what=f"{family} {name}")
    assert_close(got_logits, want_logits, atol=0.03 * float(want_logits.abs().max()), rtol=0.03, what=family)
