"""The serving bench (safemoe.bench.serving) on the CPU: the GPU run's code path on the demo's tiny
Qwen3-MoE (fp32, no CUDA graphs, batches padded as the engine pads them under graphs), and its NaN
injection on its own."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")

from safemoe.bench import serving


def test_nan_into_padded_rows_only_touches_rows_at_or_past_the_count():
    hidden = torch.randn(1, 6, 4)
    count = torch.tensor([0, 2, 4], dtype=torch.int32)[-1]  # a view into an engine-like buffer
    poisoned, rows = serving.nan_into_padded_rows(hidden, count)
    assert int(rows) == 2
    assert torch.equal(poisoned[:, :4], hidden[:, :4])
    assert bool(poisoned[:, 4:].isnan().all())
    _, none = serving.nan_into_padded_rows(hidden, torch.tensor(6))
    assert int(none) == 0


def test_logits_checksum_sees_one_bit():
    logits = torch.randn(3, 16, dtype=torch.bfloat16)
    flipped = logits.clone()
    flipped.view(torch.int16)[1, 5] ^= 1
    assert int(serving.logits_bits_checksum(logits)) == int(serving.logits_bits_checksum(logits.clone()))
    assert int(serving.logits_bits_checksum(logits)) != int(serving.logits_bits_checksum(flipped))


def test_workloads_are_deterministic_and_in_range():
    a = serving.make_workloads((1, 8), 100, seed=3)
    b = serving.make_workloads((1, 8), 100, seed=3)
    assert [(w.prompts, w.new_tokens) for w in a] == [(w.prompts, w.new_tokens) for w in b]
    for w in a:
        assert len(w.prompts) == w.concurrency
        assert all(serving.PROMPT_LENGTHS[0] <= len(p) <= serving.PROMPT_LENGTHS[1] for p in w.prompts)
        assert all(serving.NEW_TOKENS[0] <= n <= serving.NEW_TOKENS[1] for n in w.new_tokens)
        assert all(1 <= t < 100 for p in w.prompts for t in p)


@torch.no_grad()
def test_serving_bench_on_cpu(tmp_path):
    from safemoe.demo_models import load_config

    checkpoints: list[serving.Report] = []
    report = serving.run_serving(
        config=load_config("tiny", 2), device=torch.device("cpu"), dtype=torch.float32, concurrencies=(1, 3),
        cuda_graphs=False, max_batch_tokens=16, page=16, prompt_lengths=(3, 20), new_tokens=(2, 5),
        force_padding=True, q_padding_interval=8, log=lambda line: None, checkpoint=checkpoints.append,
    )  # fmt: skip
    assert len(checkpoints) == 4 and all(c is report for c in checkpoints)  # after every phase
    assert list(report.settings["phases_s"]) == [
        "stock timed",
        "safemoe timed",
        "safemoe checks",
        "stock checks",
    ]
    assert [r.concurrency for r in report.rows] == [1, 3]
    assert report.settings["engine"]["pads_batches"] is True
    for row in report.rows:
        for side in (row.stock, row.safemoe):
            assert not side.errors, side.errors
            assert side.tokens_per_s is not None and side.tokens_per_s > 0
            assert side.steps > 0 and 0 < side.step_ms_p50 <= side.step_ms_p99
            assert side.engine_padded_rows > 0  # the engine padded: the NaN below landed somewhere
            assert side.nan_rows_injected > 0
            assert side.tokens_identical_under_nan is not None
        m = row.safemoe
        # Every padded row skipped (health = 2 layers x the engine's padding), in every run.
        assert set(m.expected_padded_rows) == {"timed", "clean", "nan"}
        assert row.padded_rows_skipped, (m.health, m.expected_padded_rows)
        assert all(m.expected_padded_rows[run] > 0 for run in m.expected_padded_rows)
        # NaN in the padded rows of every attention output: never routed, real rows bit for bit the same.
        assert m.health["nan"]["nonfinite_rows"] == 0
        assert m.nonfinite_logit_rows == {"clean": 0, "nan": 0}
        assert m.tokens_identical_under_nan and m.logits_bitwise_identical_under_nan
        assert row.tokens_equal_to_stock == 1.0  # fp32, the reference backend: stock's tokens exactly
        assert row.speedup is not None and row.speedup > 0

    serving.write_report(report, tmp_path)
    data = json.loads((tmp_path / "serving.json").read_text())
    assert data["device"] == "cpu" and data["date"] and len(data["rows"]) == 2
    assert data["rows"][0]["padded_rows_skipped"] is True
    text = (tmp_path / "serving.md").read_text()
    assert text.count("\n| 1 |") == 1 and text.count("\n| 3 |") == 1
    if (tmp_path / "serving.png").exists():
        assert (tmp_path / "serving.png").stat().st_size > 0


def test_cli_without_a_gpu(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert serving.main(["--out", str(tmp_path / "o"), "--quick"]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        serving.main(["--concurrency", "0,8"])
    assert done.value.code == 2
    assert math.isfinite(serving.WORKLOAD_TIMEOUT_S)


@torch.no_grad()
def test_a_failing_side_is_reported_not_raised(monkeypatch, tmp_path):
    """The stock model's forward raises in every step: its rows carry the error, safemoe's rows are
    measured, the report is written."""
    from safemoe.demo_models import load_config

    set_impl = serving._set_experts_implementation

    def break_stock(model, name):
        set_impl(model, name)

        target = model.model.layers[0].self_attn

        def boom(module, args):
            if module is target:  # not in the deep copy safemoe patches (it copies the hook too)
                raise RuntimeError("stock broke")

        target.register_forward_pre_hook(boom)

    monkeypatch.setattr(serving, "_set_experts_implementation", break_stock)
    monkeypatch.setattr(serving, "WORKLOAD_TIMEOUT_S", 30.0)
    report = serving.run_serving(
        config=load_config("tiny", 2), device=torch.device("cpu"), dtype=torch.float32, concurrencies=(2,),
        cuda_graphs=False, max_batch_tokens=16, page=16, prompt_lengths=(3, 10), new_tokens=(2, 3),
        force_padding=True, q_padding_interval=8, log=lambda line: None,
    )  # fmt: skip
    (row,) = report.rows
    assert row.stock.errors and row.stock.tokens_per_s is None
    assert not row.safemoe.errors and row.safemoe.tokens_per_s > 0 and row.padded_rows_skipped
    assert row.tokens_equal_to_stock is None
    serving.write_report(report, tmp_path)
    assert "stock" in (tmp_path / "serving.md").read_text().split("\n| 2 |")[1]
