"""scripts/tune_router.py's pure parts (the timing needs a GPU): the pick rule, the buckets, the
router.json merge and its on-disk format, and the arguments checked before anything is timed."""

from __future__ import annotations

import json

import pytest

from helpers import load_script
from safemoe.kernels import routing


@pytest.fixture(scope="module")
def tune_router():
    return load_script("tune_router")


def cfg(block_t: int, num_warps: int) -> routing.RouterConfig:
    return routing.RouterConfig(block_t, num_warps)


def test_pick_prefers_the_fast_padded_step_near_the_fastest_full_batch(tune_router):
    """Qwen3-Next's T = 8192 timings (H200, 2026-11-27): (1, 1) has the fastest full batch but a
    slow one-row step; (2, 1) is within 3% and twice as fast padded; (4, 4) is faster padded still
    but 25% slower full."""
    timings = [tune_router.Timing(cfg(8, 4), 25.80, 6.76), tune_router.Timing(cfg(1, 1), 19.10, 10.54),
               tune_router.Timing(cfg(2, 1), 19.60, 5.66), tune_router.Timing(cfg(4, 4), 23.93, 4.76)]
    assert tune_router.pick(timings) == cfg(2, 1)
    assert tune_router.pick(timings, tolerance=0.0) == cfg(1, 1)
    # no padded step timed (small T): the fastest full batch
    small = [tune_router.Timing(cfg(1, 2), 3.28, None), tune_router.Timing(cfg(1, 1), 2.55, None)]
    assert tune_router.pick(small) == cfg(1, 1)


def test_buckets_fold_runs_of_equal_picks(tune_router):
    picks = [(8, cfg(1, 1)), (1, cfg(1, 1)), (4096, cfg(1, 1)), (8192, cfg(2, 1)), (16384, cfg(2, 1))]
    assert tune_router.buckets_of(picks) == [(4096, 1, 1), (16384, 2, 1)]
    apart = [(1, cfg(1, 1)), (8, cfg(2, 2)), (64, cfg(1, 1))]
    assert tune_router.buckets_of(apart) == [(1, 1, 1), (8, 2, 2), (64, 1, 1)]


def test_merge_and_write_keep_the_table_loadable(tune_router, tmp_path):
    shipped = routing.ROUTER_TABLE.read_text()
    doc = json.loads(shipped)
    out = tmp_path / "router.json"
    tune_router.write_table(doc, out)
    assert out.read_text() == shipped  # the repository's format, byte for byte
    key = (512, 10, False)
    merged = tune_router.merge_entry(doc, key, [(64, 2, 2), (16384, 1, 1)], "test source")
    assert len(merged["entries"]) == len(doc["entries"])  # replaced, not added
    tune_router.write_table(merged, out)
    table = routing.load_router_table(out)
    assert table[key] == ((64, 2, 2), (16384, 1, 1))
    assert {k: v for k, v in table.items() if k != key} == {
        k: v for k, v in routing.tuned_router_table().items() if k != key}
    added = tune_router.merge_entry(doc, (1024, 8, False), [(16384, 1, 1)], "new")
    assert len(added["entries"]) == len(doc["entries"]) + 1
    assert added["device"] == doc["device"] and added["method"] == doc["method"]
    before = out.read_text()
    with pytest.raises(ValueError, match="power of two"):
        tune_router.write_table(tune_router.merge_entry(doc, (1000, 8, False), [(1, 1, 1)], "bad"), out)
    assert out.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["router.json"]


@pytest.mark.parametrize(("argv", "text"), [
    (["512"], "E:K"),
    (["8:16"], "1 <= K <= E"),
    (["64:4", "--layer-check"], "--layer-check knows E"),
])
def test_bad_arguments_exit_before_timing(tune_router, capsys, argv, text):
    with pytest.raises(SystemExit) as exit_info:
        tune_router.main(argv)
    assert exit_info.value.code == 2
    assert text in capsys.readouterr().err


def test_main_writes_the_entry_and_the_log(tune_router, monkeypatch, tmp_path, capsys):
    """The whole flow with the GPU timing replaced by made-up timings: picks per T, the folded
    buckets merged into the table (a copy here) and every timing in --out."""
    table = tmp_path / "router.json"
    table.write_text(routing.ROUTER_TABLE.read_text())
    monkeypatch.setattr(routing, "ROUTER_TABLE", table)
    monkeypatch.setattr(tune_router.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tune_router.torch.cuda, "get_device_name", lambda *a: "Fake GPU")

    def fake_timings(num_experts, top_k, num_tokens, device):
        one = (lambda us: us) if num_tokens >= tune_router.PADDED_FROM else (lambda us: None)
        small_first = num_tokens <= 64
        return [tune_router.Timing(cfg(8, 4), 9.0, one(9.0)),
                tune_router.Timing(cfg(1, 1), 5.0 if small_first else 7.0, one(2.0)),
                tune_router.Timing(cfg(2, 2), 6.0, one(3.0))]

    monkeypatch.setattr(tune_router, "time_candidates", fake_timings)
    out = tmp_path / "log.json"
    assert tune_router.main(["64:4", "--tokens", "1,64,1024", "--write", "--out", str(out)]) == 0
    # T = 1, 64: (1, 1) is fastest; T = 1024: (2, 2) fastest full, (1, 1) outside 3% of it
    assert routing.load_router_table(table)[(64, 4, False)] == ((64, 1, 1), (1024, 2, 2))
    log = json.loads(out.read_text())
    assert log["device"] == "Fake GPU" and len(log["shapes"][0]["timings"]) == 9
    assert "Fake GPU" in json.loads(table.read_text())["entries"][-1]["source"]
    assert "router.json entry (64, 4, False)" in capsys.readouterr().out
