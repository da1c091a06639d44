"""K > E is legal input to `experts`: duplicate ids are each served (contract, docs/contract.md
section 2). A Workspace used to reject it; the H200 check run of 2026-11-21 found that."""

from __future__ import annotations

import pytest
import torch

import safemoe
from helpers import assert_close
from safemoe.routing import Routing
from safemoe.workspace import Workspace

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("with_workspace", [False, True])
def test_more_slots_than_experts_on_triton(with_workspace: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    num_tokens, num_experts, top_k, hidden, inter = 5, 3, 5, 16, 16
    x = torch.randn(num_tokens, hidden, generator=gen).half().to(DEVICE)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / 4).half().to(DEVICE)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / 4).half().to(DEVICE)
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen, dtype=torch.int32).to(DEVICE)
    routing = Routing(weights=torch.rand(num_tokens, top_k, generator=gen).to(DEVICE), ids=ids)
    workspace = None
    if with_workspace:
        workspace = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.float16, DEVICE)
    out = safemoe.experts(x, w13, w2, routing, num_valid=4, backend="triton", workspace=workspace)
    want = safemoe.experts(x, w13, w2, routing, num_valid=4, backend="reference")
    assert_close(out, want, what="K > E")
    assert torch.equal(out[4], torch.zeros_like(out[4]))
