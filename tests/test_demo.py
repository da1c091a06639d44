"""`safemoe demo --quick` on CPU: both sides run, safemoe keeps padding out of real rows."""

from __future__ import annotations

import argparse
import json

import pytest

pytest.importorskip("transformers")

from safemoe import demo


def test_demo_quick(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    out = tmp_path / "demo.json"
    args = parser.parse_args(["--quick", "--device", "cpu", "--json", str(out)])
    assert demo.run(args) == 0
    printed = capsys.readouterr().out
    assert "stock transformers" in printed and "safemoe" in printed and "duplicate expert ids" in printed
    payload = json.loads(out.read_text())
    stock, safe = payload["results"]
    assert stock["steps"] == safe["steps"] == 8
    assert safe["steps_with_padding"] > 0 and safe["padding_rows_nan_filled"] > 0
    assert safe["crashes"] == safe["nan_leaked_real_rows"] == safe["duplicate_id_rows"] == 0
    assert safe["moe_nonfinite_padding_rows"] == 0, "safemoe writes exact zeros in padding rows"
    assert safe["tokens_differ"] == 0
    assert safe["health"]["padded_rows"] == 2 * safe["padding_rows_nan_filled"]  # 2 layers
    assert stock["steps_with_padding"] == safe["steps_with_padding"]


def test_make_stream_has_padded_and_unpadded_batches():
    stream = demo.make_stream(16, 24, 100, seed=3)
    sizes = [len(b) for b in stream]
    assert all(1 <= s <= 24 for s in sizes)
    assert any(s & (s - 1) == 0 for s in sizes) and any(s & (s - 1) for s in sizes)


def test_demo_models_live_apart_from_tile_tables() -> None:
    """The demo's model configs ship in safemoe.demo_models; safemoe.configs holds tile tables only."""
    from importlib import resources

    from safemoe import demo_models

    for name in demo_models.CONFIGS:
        config = demo_models.load_config(name, num_layers=1)
        assert config.num_hidden_layers == 1 and config.num_experts > config.num_experts_per_tok
    tile_tables = [p.name for p in resources.files("safemoe.configs").iterdir() if p.name.endswith(".json")]
    assert tile_tables and not [name for name in tile_tables if "qwen3_moe" in name], tile_tables
