"""zero_padding_: rows >= num_valid become exact zeros in place, rows below are untouched."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import assert_equal
from safemoe._checks import check_num_valid
from safemoe.padding import _zero_padding_triton, zero_padding_


def expected(t: torch.Tensor, count: int) -> torch.Tensor:
    e = t.clone()
    e[max(0, min(count, t.shape[0])) :] = 0
    return e


@pytest.mark.parametrize("num_valid", [0, 1, 3, 5])
@pytest.mark.parametrize("kind", ["int", "int32", "int64"])
def test_zero_padding_cpu(num_valid, kind):
    t = torch.randn(5, 7)
    t[3:] = math.nan
    nv = num_valid if kind == "int" else torch.tensor(num_valid, dtype=getattr(torch, kind))
    out = zero_padding_(t.clone(), nv)
    assert_equal(out, expected(t, num_valid))


def test_zero_padding_returns_same_tensor_and_none_is_noop():
    t = torch.full((4, 3), math.nan)
    assert zero_padding_(t, None) is t
    assert torch.isnan(t).all()
    assert zero_padding_(t, 2) is t
    assert torch.isnan(t[:2]).all() and (t[2:] == 0).all()


def test_zero_padding_clamps_device_count():
    t = torch.randn(4, 3)
    assert_equal(zero_padding_(t.clone(), torch.tensor(9)), t)
    assert_equal(zero_padding_(t.clone(), torch.tensor(-2)), torch.zeros_like(t))


def test_zero_padding_rejects_bad_counts():
    with pytest.raises(ValueError, match="num_valid"):
        zero_padding_(torch.zeros(3, 2), 4)
    with pytest.raises(TypeError, match="num_valid"):
        zero_padding_(torch.zeros(3, 2), 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="0-dim"):
        zero_padding_(torch.zeros(3, 2), torch.tensor([1]))
    with pytest.raises(ValueError, match="at least one dimension"):
        zero_padding_(torch.tensor(1.0), 0)


def test_zero_padding_rows_with_stride_and_bad_layouts():
    base = torch.randn(6, 10)
    view = base[:, 2:6]  # rows contiguous, row stride 10
    zero_padding_(view, 4)
    assert (base[4:, 2:6] == 0).all() and torch.isfinite(base[:4]).all() and (base[4:, :2] != 0).all()
    with pytest.raises(ValueError, match="trailing dimensions must be contiguous"):
        zero_padding_(torch.randn(4, 6)[:, ::2], 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.bool])
def test_zero_padding_dtypes_3d(dtype):
    t = (torch.randn(5, 3, 4) * 10).to(dtype)
    if dtype == torch.bool:
        t = torch.ones(5, 3, 4, dtype=torch.bool)
    assert_equal(zero_padding_(t.clone(), torch.tensor(2)), expected(t, 2))


# The Triton kernel itself, on every device: under the interpreter on CPU, compiled on CUDA.


@pytest.mark.parametrize(
    "shape,count",
    [((5, 7), 2), ((1, 3), 0), ((9, 1), 1), ((4, 3), 4), ((3000, 3), 5), ((4, 2, 3), 1)],
)
@pytest.mark.parametrize("as_tensor", [False, True])
def test_zero_padding_triton_kernel(device, shape, count, as_tensor):
    # Drawn on the CPU: a CUDA generator left mid-capture by another test in this worker must not
    # fail a test of zero_padding_.
    t = torch.randn(shape, dtype=torch.float16).to(device)
    nv = torch.tensor(count, dtype=torch.int32, device=device) if as_tensor else count
    out = t.clone()
    _zero_padding_triton(out, check_num_valid(nv, t.shape[0], t.device))
    assert_equal(out, expected(t, count))


def test_zero_padding_triton_kernel_row_stride_and_clamp(device):
    base = torch.randn(7, 12).to(device)
    out = base.clone()
    _zero_padding_triton(out[:, 3:8], check_num_valid(torch.tensor(3, device=out.device), 7, out.device))
    e = base.clone()
    e[3:, 3:8] = 0
    assert_equal(out, e)
    out = base.clone()
    too_many = torch.tensor(100, dtype=torch.int64, device=out.device)
    _zero_padding_triton(out, check_num_valid(too_many, 7, out.device))
    assert_equal(out, base)


def test_zero_padding_custom_op_compiles():
    t = torch.randn(6, 4)

    def f(x, nv):
        y = x * 2
        zero_padding_(y, nv)
        return y

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(t, torch.tensor(4))
    assert_equal(got, expected(t * 2, 4))
