"""The router suite's target verdicts, on made-up rows (the suite itself needs a GPU)."""

from __future__ import annotations

from safemoe.bench import router
from safemoe.bench.harness import BenchRow


def row(case: str, tokens: int, us: float, variant: str = "clean", impl: str = "safemoe") -> BenchRow:
    return BenchRow(router.SUITE, case, tokens, variant, impl, us, None)


def test_issue13_router_point_and_the_older_targets():
    rows = [
        row("256x8 softmax", 1024, 3.9),  # issue 13: <= 4.0 us, met
        row("256x8 softmax", 1024, 4.7, variant="nan10"),  # judged on the clean row only
        row("qwen3 128x8 softmax", 1024, 2.5),  # issue 3: half of vLLM's 2.2 us, missed
        row("qwen3 128x8 softmax", 64, 1.9),  # <= 2.0 at T <= 64
        row("256x8 softmax", 1024, 1.0, impl="torch-eager"),  # peers are not judged
    ]
    got = {(t["target"], t["case"], t["T"]): t["met"] for t in router.targets_table(rows)}
    assert got == {
        ("<= 4.0 us at E = 256, T = 1024 (issue 13)", "256x8 softmax", 1024): True,
        ("<= half of vLLM (H200)", "qwen3 128x8 softmax", 1024): False,
        ("<= 2.0 us at T <= 64", "qwen3 128x8 softmax", 64): True,
    }
    slow = router.targets_table([row("256x8 softmax", 1024, 4.71)])
    assert [(t["measured"], t["met"]) for t in slow] == [("4.71 us", False)]
