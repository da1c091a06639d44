"""safemoe.ops: eager calls run the op bodies directly (no torch.library dispatch on the host path),
anything traced goes through the registered `safemoe::*` ops, and both give the same bits."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import safemoe
from helpers import assert_equal, by_device
from safemoe import ops
from safemoe.health import new_health_tensor
from safemoe.workspace import Workspace

H, I, E, K = 32, 16, 8, 2  # noqa: E741 (the project's shape names)


class _OpLog(TorchDispatchMode):
    """Records the name of every aten/custom op dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _inputs(device: str, num_tokens: int):
    gen = torch.Generator(device="cpu").manual_seed(3)
    x = torch.randn(num_tokens, H, generator=gen).to(device)
    logits = torch.randn(num_tokens, E, generator=gen).to(device)
    logits[1] = float("nan")  # a NaN row: sanitised the same way on both paths
    w13 = (torch.randn(E, 2 * I, H, generator=gen) * 0.2).to(device)
    w2 = (torch.randn(E, H, I, generator=gen) * 0.2).to(device)
    return x, logits, w13, w2


def test_eager_is_plain_tensors_outside_any_mode() -> None:
    t = torch.zeros(2)
    assert ops._eager(t)
    assert not ops._eager(torch.nn.Parameter(t))  # a subclass: through the op
    with _OpLog():
        assert not ops._eager(t)


@pytest.mark.parametrize(("device", "backend"), by_device(cpu=["triton", "reference"], cuda=["triton"]))
def test_direct_and_registered_paths_agree(device: str, backend: str) -> None:
    """The same call, eager (bodies run directly) and under a dispatch mode (the registered ops run:
    the log proves it), with a device num_valid and a health tensor: same outputs, same counters."""
    num_tokens, num_valid = 7, 5
    x, logits, w13, w2 = _inputs(device, num_tokens)
    nv = torch.tensor(num_valid, dtype=torch.int32, device=device)
    results = []
    for traced in (False, True):
        health = new_health_tensor(device)
        ws = Workspace(num_tokens, E, K, H, I, x.dtype, device) if backend == "triton" else None
        if ws is not None:  # the data segment (after the zeroed index segment) poisoned: NaN bytes
            ws.buffer[ws.buffer.numel() // 2 :].fill_(0xFF)
        log = _OpLog()
        if traced:
            with log:
                out = safemoe.moe(x, logits, w13, w2, K, num_valid=nv, backend=backend, workspace=ws,
                                  health=health)
            assert any("safemoe.route" in n for n in log.names), log.names
            assert any("safemoe.experts" in n for n in log.names), log.names
        else:
            out = safemoe.moe(x, logits, w13, w2, K, num_valid=nv, backend=backend, workspace=ws,
                              health=health)
        results.append((out, health))
    (eager_out, eager_health), (op_out, op_health) = results
    assert_equal(eager_out, op_out, "moe output, direct vs registered op")
    assert_equal(eager_health, op_health, "health counters, direct vs registered op")
    assert torch.isfinite(eager_out).all()
    assert (eager_out[num_valid:] == 0).all()
