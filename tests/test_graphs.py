"""CUDAGraphRunner: on CPU the clear error and the eager mode with the same bucketing/padding; on a
GPU every bucket up to 8192 tokens captured and replayed with num_valid changed in place."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import QWEN3_SHAPE, assert_close, assert_equal, qwen3_moe, qwen3_workspace
from safemoe.graphs import CUDAGraphRunner, token_buckets, warm_up


def test_token_buckets():
    assert token_buckets(1) == [1]
    assert token_buckets(8) == [1, 2, 4, 8]
    assert token_buckets(12) == [1, 2, 4, 8, 12]
    assert token_buckets(8192)[-1] == 8192 and len(token_buckets(8192)) == 14
    with pytest.raises(ValueError, match="max_tokens"):
        token_buckets(0)


def test_cpu_raises_clear_error():
    with pytest.raises(RuntimeError, match=r"needs CUDA tensors.*allow_eager=True"):
        CUDAGraphRunner(lambda x, num_valid: x, 8, torch.zeros(1, 4))


def test_warm_up_refuses_bad_input_before_running_anything():
    ran = []
    with pytest.raises(TypeError, match="step must be callable"):
        warm_up(42)  # type: ignore[arg-type]
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="must be a CUDA device"):
            warm_up(lambda: ran.append(1), "cpu")
    else:
        with pytest.raises(RuntimeError, match="needs CUDA"):
            warm_up(lambda: ran.append(1))
    assert ran == []


@pytest.mark.gpu
def test_warm_up_runs_the_step_once_and_joins_the_stream():
    x = torch.zeros(4, device="cuda")
    warm_up(lambda: x.add_(1))
    assert x.tolist() == [1.0] * 4  # synchronised: the side stream's work is done


def test_eager_mode_buckets_pads_and_slices():
    calls = []

    def fn(x, y, num_valid):
        calls.append((x.shape[0], int(num_valid)))
        rows = torch.arange(x.shape[0])[:, None] < num_valid
        return torch.where(rows, x * 2, 0.0), torch.where(rows[:, 0], y + 1, 0)

    runner = CUDAGraphRunner(fn, 12, torch.zeros(1, 3), torch.zeros(1, dtype=torch.int64), allow_eager=True)
    assert not runner.graphed and runner.buckets == [1, 2, 4, 8, 12]
    runner.poison_padding(0)
    x, y = torch.randn(5, 3), torch.arange(5)
    out_x, out_y = runner(x, y)
    assert calls[-1] == (8, 5) and runner.bucket_for(5) == 8
    assert_equal(out_x, x * 2)
    assert_equal(out_y, y + 1)
    assert torch.isnan(runner.static_inputs[0][5:8]).all(), "padding rows are left as they were"
    out_x, _ = runner(x[:1], y[:1])
    assert calls[-1] == (1, 1) and out_x.shape == (1, 3)
    runner(torch.randn(12, 3), torch.arange(12))
    assert calls[-1] == (12, 12)


def test_single_output_and_input_errors():
    runner = CUDAGraphRunner(lambda x, num_valid: x + 1, 4, torch.zeros(1, 2), allow_eager=True)
    out = runner(torch.zeros(3, 2))
    assert isinstance(out, torch.Tensor) and out.shape == (3, 2)
    with pytest.raises(ValueError, match="exceeds max_tokens=4"):
        runner(torch.zeros(5, 2))
    with pytest.raises(ValueError, match="expected 1 inputs"):
        runner(torch.zeros(2, 2), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="inputs must be"):
        runner(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="at least one token"):
        runner(torch.zeros(0, 2))


def test_given_num_valid_scalar_is_the_one_set():
    scalar = torch.zeros((), dtype=torch.int64)
    seen = []
    runner = CUDAGraphRunner(
        lambda x, num_valid: seen.append(num_valid) or x,
        4,
        torch.zeros(1, 1),
        num_valid=scalar,
        allow_eager=True,
    )
    runner(torch.full((3, 1), math.pi))
    assert seen[-1] is scalar and int(scalar) == 3
    with pytest.raises(ValueError, match="0-dim"):
        CUDAGraphRunner(
            lambda x, num_valid: x, 4, torch.zeros(1, 1), num_valid=torch.zeros(1), allow_eager=True
        )


def test_bad_outputs_and_buckets():
    runner = CUDAGraphRunner(lambda x, num_valid: x[:1], 4, torch.zeros(1, 2), allow_eager=True)
    with pytest.raises(ValueError, match="rows first"):
        runner(torch.zeros(3, 2))
    with pytest.raises(ValueError, match="end at max_tokens"):
        CUDAGraphRunner(lambda x, num_valid: x, 8, torch.zeros(1, 2), buckets=[1, 4], allow_eager=True)
    with pytest.raises(TypeError, match="Tensor or a tuple"):
        CUDAGraphRunner(lambda x, num_valid: 3, 2, torch.zeros(1, 2), allow_eager=True)(torch.zeros(1, 2))


@pytest.mark.gpu
@torch.inference_mode()
def test_every_bucket_to_8192_captures_and_replays_with_num_valid_in_place():
    max_tokens, hidden = 8192, QWEN3_SHAPE[2]
    moe = qwen3_moe(qwen3_workspace(max_tokens))
    runner = CUDAGraphRunner(lambda x, num_valid: moe(x, num_valid=num_valid), max_tokens,
                             torch.zeros(1, hidden, dtype=torch.bfloat16, device="cuda"))  # fmt: skip
    assert runner.graphed and sorted(runner.graphs) == token_buckets(max_tokens)
    for num_tokens in (1, 3, 100, 2047, 4097, 8192):
        x = torch.randn(num_tokens, hidden, dtype=torch.bfloat16, device="cuda")
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
