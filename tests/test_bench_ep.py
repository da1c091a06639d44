"""The EP bench's CPU-side parts: world sizes from the GPUs present, skipped rows without GPUs, the
scaling table built from rows, argument checks. (The timings themselves need >= 2 GPUs:
scripts/ep_gpu_run.sh.)"""

from __future__ import annotations

import pytest
import torch

from helpers import interpreter_only
from safemoe.bench import ep as ep_bench
from safemoe.bench.harness import BenchRow, DeviceCeilings


def test_worlds_degrade_to_the_gpus_present() -> None:
    assert ep_bench.default_worlds(0) == () and ep_bench.default_worlds(1) == ()
    assert ep_bench.default_worlds(3) == (2,) and ep_bench.default_worlds(8) == (2, 4, 8)
    assert set(ep_bench.SHAPES) == {"qwen3-30b-a3b", "deepseek-v3", "qwen3-next"}
    assert ep_bench.SHAPES["qwen3-next"] == (512, 10, 2048, 512)
    assert min(ep_bench.TOKENS) == 8 and max(ep_bench.TOKENS) == 8192


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks the no-GPU path")
def test_run_without_gpus_says_skipped() -> None:
    ceilings = DeviceCeilings.from_dict(_ceilings())
    rows = ep_bench.run(ceilings, quick=True, shapes=("deepseek-v3",))
    assert [(r.case, r.median_us) for r in rows] == [("deepseek-v3", None)]
    assert "needs >= 2 GPUs" in rows[0].note


def _ceilings() -> dict:
    return {"name": "test", "read_gbps": 1000.0, "write_gbps": 1000.0, "copy_gbps": 1000.0,
            "bf16_tflops": 100.0}  # fmt: skip


def test_scaling_table_from_rows() -> None:
    def row(impl: str, us: float, **extra: object) -> BenchRow:
        return BenchRow("ep", "deepseek-v3", 1024, "W=4", impl, us, extra=dict(extra))

    rows = [
        row("ep-capacity", 1000.0, tokens_per_s=4_096_000, scaling_vs_1gpu=3.1, comm_us=100.0,
            compute_us=800.0, rest_us=100.0),
        row("ep-capacity-torch", 1200.0, scaling_vs_1gpu=2.6),
        row("ep-dynamic", 2000.0, scaling_vs_1gpu=1.5),
        row("1gpu-global", 3100.0, tokens_per_s=1_321_290),
        BenchRow("ep", "deepseek-v3", 2048, "W=4", "ep-capacity", None, note="error: x"),
    ]
    table = ep_bench.scaling_table(rows)
    assert "| 4 | 1024 | 1,321,290 | 4,096,000 | 3.1x | 2.6x | 1.5x | 100.0 | 800.0 | 100.0 |" in table
    assert "| 4 | 2048 |" not in table  # an untimed row is left out, not printed as zeros


def test_main_rejects_unknown_shapes() -> None:
    with pytest.raises(SystemExit):
        ep_bench.main(["--shapes", "gpt-5"])


@interpreter_only("the exchange kernels on CPU tensors")
def test_exchange_only_rows_on_cpu(monkeypatch) -> None:
    """The one-GPU exchange bench's rows, run on CPU (the interpreter) with the timer stubbed: both
    exchanges give the same output bits at W = 2, 4, 8 (what `same_output` reports on the GPU)."""
    from safemoe.bench import harness

    monkeypatch.setattr(ep_bench, "_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(harness, "time_graph", lambda step, **_: (step(0), step(1), 2.0)[-1])
    monkeypatch.setitem(ep_bench.SHAPES, "tiny", (16, 3, 24, 8))
    for tokens, world in ((40, 4), (8, 2), (33, 8)):
        rows = ep_bench._exchange_rows("tiny", tokens, world)
        assert [r.impl for r in rows] == ["exchange-torch", "exchange-triton", "loopback-copies"]
        assert all(r.median_us == 2.0 and r.variant == f"W={world}" for r in rows)
        assert rows[0].extra["same_output"] and rows[1].extra["same_output"], (tokens, world)
        assert rows[1].extra["speedup_vs_torch"] == 1.0
