"""The experts_fp8 suite's issue-13 verdicts, on made-up rows (the suite itself needs a GPU)."""

from __future__ import annotations

import pytest

from safemoe.bench import experts_fp8
from safemoe.bench.harness import BenchRow, DeviceCeilings, distinct_experts


def row(case: str, tokens: int, us: float | None, floor: float, impl: str = "safemoe-fp8-block",
        variant: str = "experts", **extra) -> BenchRow:  # fmt: skip
    extra = {"bound": "read", **extra}
    return BenchRow(experts_fp8.SUITE, case, tokens, variant, impl, us, floor, extra=extra)


def test_each_fp8_target_met_and_missed(tmp_path):
    rows = [
        row("qwen3-30b-a3b", 8, 100.0, 90.0),  # 90% >= 88
        row("qwen3-30b-a3b", 8, 100.0, 87.0, impl="safemoe-fp8-per_tensor"),  # 87% < 88
        row("mixtral-8x7b", 256, 100.0, 88.0),  # exactly the limit: met
        row("qwen3-30b-a3b", 1, 100.0, 10.0),  # T = 1: no decode target
        row("qwen3-30b-a3b", 512, 100.0, 10.0),  # past 256: none
        row("deepseek-v3", 8192, 100.0, 50.0, x_vs_bf16=1.62),  # prefill met
        row("qwen3-30b-a3b", 8192, 100.0, 50.0, x_vs_bf16=1.21),  # prefill missed
        row("mixtral-8x7b", 8192, 100.0, 50.0, x_vs_bf16=1.1),  # not a prefill shape of the target
        row("deepseek-v3", 8192, 100.0, 50.0, impl="safemoe-fp8-per_tensor", x_vs_bf16=1.9),  # block only
        row("deepseek-v3", 16384, 100.0, 50.0, x_vs_bf16=1.9),  # issue 7's point, not 13's
        row("qwen3-30b-a3b", 64, 1.0, 90.0, impl="torch-scaled_grouped_mm"),  # peers are not judged
        row("qwen3-30b-a3b", 64, 1.0, 90.0, variant="quantize"),  # the quantize-only variant neither
        row("deepseek-v3", 64, None, 90.0),  # no time: no verdict
    ]
    table = experts_fp8.targets_table(rows)
    got = {(t["target"].split(":")[0], t["case"], t["T"]): t["met"] for t in table}
    assert got == {
        ("fp8 decode (block)", "qwen3-30b-a3b", 8): True,
        ("fp8 decode (per_tensor)", "qwen3-30b-a3b", 8): False,
        ("fp8 decode (block)", "mixtral-8x7b", 256): True,
        ("fp8 prefill (block)", "deepseek-v3", 8192): True,
        ("fp8 prefill (block)", "qwen3-30b-a3b", 8192): False,
    }
    measured = {(t["case"], t["T"], t["target"][:15]): t["measured"] for t in table}
    assert measured[("qwen3-30b-a3b", 8, "fp8 decode (blo")] == "90.0% (read-bound)"
    assert measured[("qwen3-30b-a3b", 8192, "fp8 prefill (bl")] == "1.21x"
    experts_fp8.plot(rows, tmp_path)
    text = (tmp_path / "experts_fp8_targets.md").read_text()
    assert text.count("\n") == 2 + len(table) and "| NO |" in text and "| yes |" in text


def test_quick_runs_time_the_bf16_kernel_at_the_prefill_point():
    assert experts_fp8.PREFILL_TOKENS_13 in experts_fp8.QUICK_TOKENS
    assert set(experts_fp8.PREFILL_SHAPES_13) <= set(experts_fp8.QUICK_SHAPES)


def test_fp8_floor_counts_the_experts_the_samples_hit():
    """The read floor of an fp8 step with the samples' D (issue 13's "% read") against the uniform
    expectation's: proportional, and the same when D is the expectation."""
    fp8_floor_us = experts_fp8.fp8_floor_us
    shape = (128, 8, 2048, 768, "silu")
    ceilings = DeviceCeilings("x", 3000.0, 3000.0, 800.0, 1600.0)
    expected = distinct_experts(128, 8, 8)
    base, bound = fp8_floor_us(shape, 8, "block", ceilings)
    assert bound == "read"
    assert fp8_floor_us(shape, 8, "block", ceilings, expected)[0] == pytest.approx(base)
    assert fp8_floor_us(shape, 8, "block", ceilings, expected / 2)[0] == pytest.approx(base / 2)
