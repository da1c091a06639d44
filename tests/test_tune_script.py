"""scripts/tune_experts.py: the GPU tuner's planning code runs here (it is only ever run on a GPU
machine, so a stale import there surfaced only on the device: 2026-11-24)."""

from __future__ import annotations

import importlib.util
import json
import types
from pathlib import Path

import pytest

from helpers import interpreter_only
from safemoe.configs import BLOCK_M_CHOICES, ExpertsConfig, GemmTiles

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "tune_experts.py"


def _load():
    spec = importlib.util.spec_from_file_location("tune_experts", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_candidate_plans_cover_every_shape_and_bucket():
    tune = _load()
    for name, (num_experts, top_k, _, _) in tune.SHAPES.items():
        for num_tokens in (1, 8, 256, 8192):
            plan = tune.candidate_plan(num_tokens, num_experts, top_k)
            assert plan, (name, num_tokens)
            assert all(isinstance(c, ExpertsConfig) and c.block_m in BLOCK_M_CHOICES for c in plan)
            assert {c.gemm1.tma for c in plan} == {False, True}, f"{name} T={num_tokens}: TMA not searched"


def test_fp8_decode_searches_byte_equivalent_tiles_and_tma_on_each():
    """fp8 weights at decode: the bf16 winners' byte-equivalent tiles (64 columns x 256-wide K steps)
    are candidates and every GEMM1 candidate is timed with and without TMA (and swapped, with 64+
    columns); block mode keeps K
    steps inside one 128-wide scale group; bf16 candidates are unchanged."""
    tune = _load()
    bf16 = tune.regimes(64, 128, 8)
    for quant in ("per_tensor", "block"):
        (block_m, g1s, g2s, _), *_ = tune.regimes(64, 128, 8, quant)
        assert block_m == 16 and tune.fp8_variants(quant, block_m, (32, 128, 4, 4)) == (
            (False, False), (True, False))
        # 64+ columns: the swapped product (wgmma's M side) both ways too, and precompiled
        assert set(tune.fp8_variants(quant, block_m, (64, 128, 4, 4))) == {
            (False, False), (True, False), (False, True), (True, True)}
        plan = tune.candidate_plan(64, 128, 8, quant)
        assert any(c.gemm1.swap_ab and c.gemm1.block_n >= 64 for c in plan)
        assert any(c.gemm2.swap_ab for c in plan) and not any(c.gemm1.swap_ab and c.gemm1.block_n < 64
                                                              for c in plan)
        assert set(bf16[0][1]) < set(g1s) or quant == "block"
        if quant == "per_tensor":
            assert (64, 256, 4, 4) in g1s and (128, 256, 4, 3) in g2s
        else:
            assert all(t[1] <= tune.FP8_BLOCK_K for t in g1s + g2s)
            assert (128, 128, 4, 4) in g1s
    assert tune.fp8_variants(None, 16, (64, 128, 4, 4)) == ((False, False),)
    assert tune.fp8_variants("block", 128, (64, 128, 4, 4)) == ((False, False),)
    assert not any(c.gemm1.swap_ab or c.gemm2.swap_ab for c in tune.candidate_plan(64, 128, 8))
    assert tune.regimes(8192, 128, 8, "per_tensor") == [
        (m, tune.for_quant(g1, "per_tensor"), tune.for_quant(g2, "per_tensor"), g)
        for m, g1, g2, g in tune.regimes(8192, 128, 8)], "prefill lists are the bf16 ones"


def test_block_m_128_is_searched_from_48_rows_per_expert():
    """Mixtral T = 256 (64 rows per expert): 64-row blocks split about half the experts in two, each
    block reading the expert's weights; 128-row blocks are a candidate there, not at 32 rows."""
    tune = _load()
    assert {c.block_m for c in tune.candidate_plan(256, 8, 2)} == {32, 64, 128}
    assert {c.block_m for c in tune.candidate_plan(128, 8, 2)} == {32, 64}


def test_padded_step_decides_inside_the_full_batch_noise():
    tune = _load()
    full = {1: 553.3, 2: 553.3, 4: 553.2, 8: 555.4}
    padded = {1: 38.5, 2: 39.5, 4: 39.4, 8: 40.4}
    assert tune.choose_for_padded_step(full, padded) == 1
    # past the tolerance on the full batch a candidate loses however fast its padded step
    assert tune.choose_for_padded_step({1: 600.0, 4: 553.0}, {1: 30.0, 4: 39.0}) == 4
    # nothing timed padded: the fastest full batch
    assert tune.choose_for_padded_step({1: 560.0, 8: 553.0}, {}) == 8


def test_prefer_fast_padded_step_times_the_close_candidates_once(monkeypatch):
    tune = _load()
    cfgs = [ExpertsConfig(64, GemmTiles(block_n=n, block_k=64), GemmTiles(block_n=64, block_k=64))
            for n in (32, 64, 128, 256)]
    results = [(100.0, cfgs[0]), (100.5, cfgs[1]), (100.5, cfgs[1]), (100.9, cfgs[2]), (103.0, cfgs[3])]
    padded_us = {32: 45.0, 64: 40.0, 128: 41.0, 256: 10.0}
    timed = []

    def fake_timed(case, cfg, log, sweep, est, small=None, num_valid=None):
        assert sweep == "padded_one_row" and num_valid == 1
        timed.append(cfg.gemm1.block_n)
        return padded_us[cfg.gemm1.block_n]

    monkeypatch.setattr(tune, "_timed", fake_timed)
    ordered = tune.prefer_fast_padded_step(None, results, [])
    assert sorted(timed) == [32, 64, 128]  # the duplicate once, the 3%-slower one not at all
    assert ordered[0] == (100.5, cfgs[1]) and len(ordered) == len(results)


def test_padded_step_candidates_run_with_their_small_tiles(monkeypatch):
    """A candidate whose BLOCK_M is above the small-batch tiles' is timed on the one-row step with
    those tiles, as the call runs it (the Qwen3-Next T = 512 tune of 2026-11-27 timed a 32-row
    candidate without them: 32.9 us there, 37.1 in the call); a 16-row one without; none in a
    bucket of SMALL_BATCH_TOKENS rows or fewer, nor without a case."""
    import types

    tune = _load()
    small = ExpertsConfig(16, GemmTiles(block_n=32, block_k=64), GemmTiles(block_n=64, block_k=64))
    big = ExpertsConfig(32, GemmTiles(block_n=64, block_k=64), GemmTiles(block_n=64, block_k=64))
    same = ExpertsConfig(16, GemmTiles(block_n=64, block_k=128), GemmTiles(block_n=64, block_k=64))
    case = types.SimpleNamespace(num_tokens=512, small_source=small)
    seen = {}

    def fake_timed(case, cfg, log, sweep, est, small=None, num_valid=None):
        seen[cfg.block_m] = small
        return {32: 37.1, 16: 37.0}[cfg.block_m]

    monkeypatch.setattr(tune, "_timed", fake_timed)
    ordered = tune.prefer_fast_padded_step(case, [(1149.9, big), (1151.3, same)], [])
    assert seen == {32: small, 16: None}
    assert ordered[0] == (1151.3, same)
    assert tune.padded_step_small(None, big) is None
    assert tune.padded_step_small(types.SimpleNamespace(num_tokens=8, small_source=small), big) is None
    assert tune.padded_step_small(types.SimpleNamespace(num_tokens=512, small_source=None), big) is None


def test_small_batch_source_reads_the_runs_quant(monkeypatch):
    """The small-batch tiles' source: this run's SMALL_BATCH_TOKENS winner when there is one, else
    the device's config for that many tokens with the run's weights (fp8 tunes read the fp8 key, as
    `small_batch_config` does in the call)."""
    tune = _load()
    winner = ExpertsConfig(16, GemmTiles(block_n=32, block_k=64), GemmTiles(block_n=64, block_k=64))
    asked = []

    def fake_incumbent(name, num_tokens, quant, device):
        asked.append((name, num_tokens, quant))
        return winner

    monkeypatch.setattr(tune, "incumbent_config", fake_incumbent)
    cpu = tune.torch.device("cpu")
    assert tune.small_batch_source("qwen3-30b-a3b", {}, cpu, "block") is winner
    assert asked == [("qwen3-30b-a3b", tune.SMALL_BATCH_TOKENS, "block")]
    mine = {tune.token_bucket(tune.SMALL_BATCH_TOKENS): winner}
    assert tune.small_batch_source("qwen3-30b-a3b", mine, cpu, "block") is winner
    assert len(asked) == 1


def test_wide_adds_candidates(monkeypatch):
    """--wide (through the environment, so precompile workers agree): a strict superset of each
    bucket's plan. Tiles past an SM's shared memory at some BLOCK_M fail to compile and the tuner
    lists and skips them (on the H100: 6 of Mixtral T=256's, GEMM1 keeps two weight tiles a stage)."""
    tune = _load()
    monkeypatch.delenv(tune.WIDE_ENV, raising=False)
    narrow = {n: tune.candidate_plan(n, 128, 8) for n in (1, 256, 1024, 8192)}
    monkeypatch.setenv(tune.WIDE_ENV, "1")
    for num_tokens, base in narrow.items():
        wide = tune.candidate_plan(num_tokens, 128, 8)
        assert {repr(c) for c in base} < {repr(c) for c in wide}, num_tokens


# --- one_launch (issue 13): the decision rule, which buckets get timed, and --write's merge ------


def test_choose_one_launch_rule_and_tolerance():
    tune = _load()
    assert tune.ONE_LAUNCH_TOLERANCE == 0.01
    # H100, 2026-11-24 (bench_compare): Qwen3 T=1024 padded 51.3 -> 46.9 us, full batch unchanged
    assert tune.choose_one_launch(620.0, 621.0, 51.3, 46.9)
    # DeepSeek-V3 T=1024: the padded step got slower (273 -> 289 us)
    assert not tune.choose_one_launch(1000.0, 1000.0, 273.0, 289.0)
    assert not tune.choose_one_launch(100.0, 100.0, 50.0, 50.0), "no gain on the padded step"
    # full batch: up to the tolerance is accepted, beyond it refused however much the padded step gains
    assert tune.choose_one_launch(100.0, 100.9, 50.0, 40.0)
    assert tune.choose_one_launch(100.0, 101.0, 50.0, 40.0)
    assert not tune.choose_one_launch(100.0, 101.1, 50.0, 40.0)
    assert not tune.choose_one_launch(434.9, 450.1, 50.0, 40.0), "Qwen3 T=256's +3.5%"
    assert tune.choose_one_launch(100.0, 103.0, 50.0, 40.0, tolerance=0.05)
    assert not tune.choose_one_launch(100.0, 100.5, 50.0, 40.0, tolerance=0.0)


def _cfg(block_m: int, **kw) -> ExpertsConfig:
    return ExpertsConfig(block_m, GemmTiles(32, 64), GemmTiles(64, 64), **kw)


def test_one_launch_plan_picks_buckets_with_small_tiles():
    tune = _load()
    small = _cfg(16, pdl=True)
    fallback = _cfg(16)
    # block_m per bucket as in the H100 table's Qwen3 entries (T=4 given a large BLOCK_M on purpose:
    # at or below SMALL_BATCH_TOKENS there is no small-batch switch)
    winners = {1: _cfg(16), 4: _cfg(32), 8: small, 16: _cfg(16)}
    winners.update({256: _cfg(32), 1024: _cfg(64), 8192: _cfg(128)})
    plan = tune.one_launch_plan(winners, fallback)
    assert list(plan) == [256, 1024, 8192]
    assert all(s is small for s in plan.values()), "the run's own small-batch winner is the small config"
    # without a winner at SMALL_BATCH_TOKENS' bucket, the device's config for that many tokens
    del winners[8]
    plan = tune.one_launch_plan(winners, _cfg(32))
    assert list(plan) == [1024, 8192] and all(s.block_m == 32 for s in plan.values())
    assert tune.one_launch_plan({}, fallback) == {}


def test_one_launch_plan_follows_small_batch_config():
    """The plan times exactly the buckets where experts_triton switches tiles (small_batch_config
    on the CPU device, whose small config is interpreter_config's for SMALL_BATCH_TOKENS tokens)."""
    import torch

    from safemoe.configs import interpreter_config
    from safemoe.kernels.experts import SMALL_BATCH_TOKENS, small_batch_config

    tune = _load()
    num_experts, top_k, hidden, inter = tune.SHAPES["qwen3"]
    fallback = interpreter_config(SMALL_BATCH_TOKENS, num_experts, top_k)
    cpu = torch.device("cpu")
    for bucket in (1, 4, 8, 16, 64, 1024):
        for block_m in BLOCK_M_CHOICES:
            cfg = _cfg(block_m)
            expected = small_batch_config(bucket, num_experts, hidden, inter, top_k, torch.bfloat16, cpu, cfg)
            plan = tune.one_launch_plan({bucket: cfg}, fallback)
            assert plan.get(bucket) == expected, (bucket, block_m)


def test_one_launch_tasks_compile_both_variants():
    tune = _load()
    small, cfg = _cfg(16), _cfg(64, one_launch=True)
    tasks = tune.one_launch_tasks("qwen3", {1024: (cfg, small)})
    assert len(tasks) == 1
    name, bucket, pairs, quant = tasks[0]
    assert (name, bucket, quant) == ("qwen3", 1024, None)
    assert [ExpertsConfig.from_json(c).one_launch for c, _ in pairs] == [False, True]
    assert all(ExpertsConfig.from_json(s) == small for _, s in pairs)
    tile_tasks = tune.compile_tasks(["qwen3"], {"qwen3": (1, 256)})
    assert tile_tasks and all(s is None for _, _, items, _ in tile_tasks for _, s in items)
    assert {quant for *_, quant in tile_tasks} == {None}
    fp8_tasks = tune.compile_tasks(["qwen3"], {"qwen3": (1, 256)}, "block")
    assert fp8_tasks and {quant for *_, quant in fp8_tasks} == {"block"}
    block_ks = {ExpertsConfig.from_json(c).gemm1.block_k for _, _, items, _ in fp8_tasks for c, _ in items}
    assert max(block_ks) <= 128


class _FakeCase:
    """Stands in for tune_experts.Case: fixed times per (one_launch, num_valid), one slow outlier."""

    name, num_tokens = "qwen3", 1024

    def __init__(self, times):
        self.times, self.calls = times, []

    def time(self, cfg, est_us=None, small=None, num_valid=None):
        self.calls.append((cfg.one_launch, num_valid, small))
        us = self.times[cfg.one_launch, num_valid]
        return us * 3 if len(self.calls) == 2 else us  # round 1's merged full batch: an outlier


def test_decide_one_launch_times_both_batches_interleaved_and_logs_them():
    tune = _load()
    cfg, small = _cfg(64, extra={"us": 620.0}), _cfg(16)
    rows, one = tune.ONE_LAUNCH_PADDED_ROWS, tune.ONE_LAUNCH_ONE_ROW
    assert (rows, one) == (tune.SMALL_BATCH_TOKENS, 1)
    times = {(False, 1024): 620.0, (True, 1024): 622.0, (False, rows): 51.3, (True, rows): 46.9,
             (False, one): 33.9, (True, one): 30.4}
    case = _FakeCase(times)
    log: list = []
    choice, summary = tune.decide_one_launch(case, cfg, small, log, deadline=float("inf"))
    assert choice is True, "the outlier must not decide it (medians of the rounds)"
    assert summary == {
        "full_batch": {"two_launches": 620.0, "one_launch": 622.0},
        "padded_decode": {"two_launches": 51.3, "one_launch": 46.9},
        "padded_one_row": {"two_launches": 33.9, "one_launch": 30.4},
    }
    rounds = tune.ONE_LAUNCH_ROUNDS
    assert [c[:2] for c in case.calls] == [(False, 1024), (True, 1024), (False, rows), (True, rows),
                                           (False, one), (True, one)] * rounds
    assert all(c[2] is small for c in case.calls)
    assert len(log) == 6 * rounds
    assert {(e["sweep"], e["config"]["one_launch"], e["num_valid"]) for e in log} == {
        ("one_launch", merged, nv) for merged in (False, True) for nv in (1024, rows, one)
    }
    assert all(e["small"] == small.to_json() and "us" in e for e in log)
    # a full batch that gets 2% slower keeps two launches
    case = _FakeCase({**times, (True, 1024): 633.0})
    assert tune.decide_one_launch(case, cfg, small, [], deadline=float("inf"))[0] is False
    # the one-row step alone can decide it: 8 rows unchanged, one row 3.5 us faster merged
    case = _FakeCase({**times, (True, rows): 51.3})
    assert tune.decide_one_launch(case, cfg, small, [], deadline=float("inf"))[0] is True
    # both padded steps together must gain: one row faster, 8 rows slower by more
    case = _FakeCase({**times, (True, rows): 56.0})
    assert tune.decide_one_launch(case, cfg, small, [], deadline=float("inf"))[0] is False
    # out of budget: nothing decided
    assert tune.decide_one_launch(case, cfg, small, [], deadline=0.0) is None


def test_write_merge_keeps_one_launch_and_other_keys():
    tune = _load()
    key = "E128_H2048_I768_K8_bfloat16"
    old_1024 = {**_cfg(64, one_launch=True).to_json(), "us": 60.0}
    existing = {
        "device": "GPU",
        "date": "old",
        "notes": "kept",
        "batch_invariant": {key: _cfg(32).to_json()},
        "configs": {key: {"8": _cfg(16).to_json(), "1024": old_1024}, "other": {"1": _cfg(16).to_json()}},
    }
    new_256 = {**_cfg(32, one_launch=True).to_json(), "us": 400.0, "one_launch_us": {"padded_decode": {}}}
    new_1024 = {**_cfg(128).to_json(), "us": 58.0}
    payload = {"device": "GPU", "date": "new", "configs": {key: {"1024": new_1024, "256": new_256}}}
    merged = tune.merge_device_json(existing, payload)
    assert merged["date"] == "new" and merged["notes"] == "kept"
    assert merged["batch_invariant"] == existing["batch_invariant"]
    assert list(merged["configs"][key]) == ["8", "256", "1024"], "buckets in numeric order"
    assert merged["configs"]["other"] == existing["configs"]["other"]
    loaded = {b: ExpertsConfig.from_json(d) for b, d in merged["configs"][key].items()}
    assert loaded["256"].one_launch is True
    assert not loaded["1024"].one_launch and loaded["1024"].block_m == 128, "replaced whole"
    assert existing["configs"][key]["1024"] is old_1024, "existing is not modified"
    # one_launch survives the to_json/from_json round trip
    for flag in (False, True):
        assert ExpertsConfig.from_json(_cfg(64, one_launch=flag).to_json()).one_launch is flag


def test_write_merge_small_batch_entries_by_shape():
    """payload's "small_batch" entries replace the same shapes' and keep the others'; a payload
    without any leaves the section as it was."""
    tune = _load()
    a, b = "E128_H2048_I768_K8_bfloat16", "E8_H4096_I14336_K2_bfloat16"
    existing = {"configs": {}, "small_batch": {a: _cfg(16).to_json(), b: _cfg(16).to_json()}}
    payload = {"configs": {}, "small_batch": {a: {**_cfg(32).to_json(), "source": "run"}}}
    merged = tune.merge_device_json(existing, payload)["small_batch"]
    assert merged[a]["block_m"] == 32 and merged[b] == existing["small_batch"][b]
    assert existing["small_batch"][a]["block_m"] == 16, "existing is not modified"
    assert tune.merge_device_json(existing, {"configs": {}})["small_batch"] == existing["small_batch"]


def test_write_merge_keeps_few_turned_off():
    """`few` off in the existing entry (a measured choice the script does not time) survives a
    re-tune of the bucket; an entry without that choice takes the payload's."""
    tune = _load()
    key = "E128_H2048_I768_K8_bfloat16"
    existing = {"configs": {key: {"2048": {**_cfg(128).to_json(), "few": False}, "64": _cfg(32).to_json()}}}
    payload = {"configs": {key: {"2048": _cfg(64).to_json(), "64": _cfg(16).to_json()}}}
    merged = tune.merge_device_json(existing, payload)["configs"][key]
    assert merged["2048"]["few"] is False and merged["2048"]["block_m"] == 64
    assert merged["64"]["few"] is True and merged["64"]["block_m"] == 16


def test_candidates_are_timed_as_the_bucket_runs(monkeypatch):
    """Candidates carry few = T <= FEW_MAX_TOKENS, and each is timed with the few-slot tiles
    `experts_triton` would run: its own at T*K <= 16, the table's of the few bucket above that,
    none when the candidate turns the path off."""
    import torch

    from safemoe.configs import get_config

    tune = _load()
    for num_tokens in (1, 64, 1024, 2048, 8192):
        plan = tune.candidate_plan(num_tokens, 128, 8)
        assert {c.few for c in plan} == {num_tokens <= tune.FEW_MAX_TOKENS}, num_tokens
    monkeypatch.setitem(tune.SHAPES, "tiny", (4, 2, 64, 32))  # (E, K, H, I): few-slot buckets T <= 8
    cpu = torch.device("cpu")
    own = _cfg(16)
    assert tune.few_slots_tiles(own, "tiny", 8, cpu) is own
    few_bucket = get_config(8, 4, 64, 32, 2, torch.bfloat16, cpu)
    assert tune.few_slots_tiles(_cfg(64), "tiny", 1024, cpu) == few_bucket
    assert tune.few_slots_tiles(tune.replace(_cfg(64), few=False), "tiny", 1024, cpu) is None
    # A shape tuned before it has a table is timed as it will run with one: the decode bucket's
    # few-slot tiles as they are, not the untabled runtime's lighter or fitted ones.
    import safemoe.configs as configs
    import safemoe.kernels.experts as ex

    wide = ExpertsConfig(16, GemmTiles(block_n=32, block_k=256, num_stages=3),
                         GemmTiles(block_n=64, block_k=256, num_stages=3))
    monkeypatch.setattr(configs, "get_config", lambda t, *args, **kwargs: wide if t <= 8 else _cfg(64))
    monkeypatch.setattr(ex, "has_table", lambda *args, **kwargs: False)
    assert ex.light_few_tiles(wide) != wide
    assert tune.few_slots_tiles(_cfg(64), "tiny", 1024, cpu) is wide


def test_one_launch_flags_exclude_each_other(tmp_path):
    tune = _load()
    with pytest.raises(SystemExit):
        tune.main(["--out", str(tmp_path), "--one-launch-only", "--no-one-launch"])


def test_search_fused_only_in_a_tune_that_decides_fused(tmp_path, capsys):
    """--search-fused times candidates fused: refused with --no-fused, --quant or an *-only run."""
    tune = _load()
    for extra in (["--no-fused"], ["--quant", "block"], ["--fused-only"]):
        with pytest.raises(SystemExit):
            tune.main(["--out", str(tmp_path), "--search-fused", *extra])
        assert "--search-fused searches tiles fused" in capsys.readouterr().err


def test_unknown_shapes_are_refused_before_anything_runs(tmp_path, capsys):
    tune = _load()
    for shapes in ("qwen4", "qwen3,nope", ","):
        with pytest.raises(SystemExit) as exit_info:
            tune.main(["--out", str(tmp_path / "x"), "--shapes", shapes])
        assert exit_info.value.code == 2
        assert "--shapes: unknown" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert {"qwen3next", "qwen3-ep2", "deepseek-ep2"} <= set(tune.SHAPES) <= set(tune.DEFAULT_TOKENS)
    assert set(tune.SHAPES) <= set(tune.QUICK_TOKENS)


@interpreter_only("CPU tensors through the Triton kernels")
def test_case_step_passes_small_tiles_and_padded_num_valid(monkeypatch):
    """Case.step (what the one_launch timings replay) on a tiny shape in the interpreter: both
    launch modes, a full batch and 1 valid row, match the reference; padding rows are zeros."""
    import torch

    from safemoe.reference import experts_reference

    tune = _load()
    monkeypatch.setitem(tune.SHAPES, "tiny", (4, 2, 64, 32))  # (E, K, H, I)
    gen = torch.Generator().manual_seed(0)
    w13 = (torch.randn(4, 64, 64, generator=gen) * 0.1).to(torch.bfloat16)
    w2 = (torch.randn(4, 64, 32, generator=gen) * 0.1).to(torch.bfloat16)
    case = tune.Case("tiny", w13, w2, 40)
    small = ExpertsConfig(16, GemmTiles(32, 32, 1, 4, 1), GemmTiles(32, 32, 1, 4, 1))
    cfg = ExpertsConfig(32, GemmTiles(32, 32, 4, 4, 1), GemmTiles(32, 32, 4, 4, 1))
    for merged in (False, True):
        for num_valid in (None, 1):
            rows = case.num_tokens if num_valid is None else num_valid
            case.outs[0].fill_(float("nan"))
            case.step(tune.replace(cfg, one_launch=merged), "all", small, num_valid)(0)
            ref = experts_reference(
                case.xs[0][:rows], w13, w2, case.weights[0][:rows], case.ids[0][:rows], activation="silu"
            ).float()
            out = case.outs[0].float()
            assert float((out[:rows] - ref).norm() / ref.norm()) < 2e-2, (merged, num_valid)
            assert bool((out[rows:] == 0).all()), (merged, num_valid)
    # the few-slot tiles as given (what the dependent padded steps time): none, or other tiles
    ref = experts_reference(case.xs[0][:1], w13, w2, case.weights[0][:1], case.ids[0][:1], activation="silu")
    for few in (None, ExpertsConfig(16, GemmTiles(64, 32, 1, 4, 1), GemmTiles(16, 64, 1, 4, 1))):
        case.outs[0].fill_(float("nan"))
        case.step(cfg, "all", small, 1, few)(0)
        out = case.outs[0].float()
        assert float((out[:1] - ref.float()).norm() / ref.float().norm()) < 2e-2, few
        assert bool((out[1:] == 0).all()), few


def _fake_gpu(monkeypatch, tmp_path, tune):
    """main() on the CPU: a fake CUDA device "FakeGPU" (no device table, so get_config falls back
    to the heuristic), a tiny shape, the device file under tmp_path, and Case.time returning fixed
    times: merged pays at T=64 (padded 30 -> 25 us and 22 -> 20 us, full batch +0.5%), not at
    T=1024 (full +5%); fused pays at the few-slot buckets (T <= 8: 12 -> 10 us)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "FakeGPU")
    monkeypatch.setitem(tune.SHAPES, "tiny", (4, 2, 64, 32))  # (E, K, H, I)
    path = tmp_path / "FakeGPU.json"
    monkeypatch.setattr(tune, "device_file", lambda name: path)
    monkeypatch.setattr(
        tune, "make_weights", lambda name, device: (torch.zeros(4, 64, 64), torch.zeros(4, 64, 32))
    )
    full = {64: (100.0, 100.5), 1024: (200.0, 210.0)}

    def fake_time(self, cfg, stages="all", est_us=None, small=None, num_valid=None, few=None):
        if self.num_tokens * tune.SHAPES["tiny"][1] <= tune.FEW_SLOTS:  # the fused decision
            assert small is None and num_valid is None
            return 10.0 if cfg.fused else 12.0
        assert small is not None and small.block_m < cfg.block_m
        if num_valid == tune.ONE_LAUNCH_PADDED_ROWS:
            return 25.0 if cfg.one_launch else 30.0
        if num_valid == tune.ONE_LAUNCH_ONE_ROW and isinstance(few, ExpertsConfig):
            return 30.0 if few.fused else 22.0  # a dependent step: slower with fused few-slot tiles
        if num_valid == tune.ONE_LAUNCH_ONE_ROW:
            return 20.0 if cfg.one_launch else 22.0
        return full[self.num_tokens][cfg.one_launch]

    monkeypatch.setattr(tune.Case, "time", fake_time)
    return path


def _check_written(path, tune, key):
    data = json.loads(path.read_text())
    assert data["notes"] == "kept"
    entries = data["configs"][key]
    assert ExpertsConfig.from_json(entries["64"]).one_launch is True
    assert ExpertsConfig.from_json(entries["1024"]).one_launch is False
    assert entries["64"]["one_launch_us"] == {
        "full_batch": {"two_launches": 100.0, "one_launch": 100.5},
        "padded_decode": {"two_launches": 30.0, "one_launch": 25.0},
        "padded_one_row": {"two_launches": 22.0, "one_launch": 20.0},
    }
    assert "one_launch_us" not in entries["8"], "no small-batch tiles at T <= SMALL_BATCH_TOKENS"
    return data


def test_main_one_launch_only_writes_decisions(monkeypatch, tmp_path):
    tune = _load()
    path = _fake_gpu(monkeypatch, tmp_path, tune)
    key = "E4_H64_I32_K2_bfloat16"
    entries = {"8": {**_cfg(16).to_json(), "us": 9.0}, "64": _cfg(32).to_json(), "1024": _cfg(64).to_json()}
    path.write_text(
        json.dumps({"device": "FakeGPU", "date": "old", "notes": "kept", "configs": {key: entries}})
    )
    out = tmp_path / "out"
    argv = ["--out", str(out), "--shapes", "tiny", "--one-launch-only", "--no-precompile", "--write"]
    assert tune.main(argv) == 0
    data = _check_written(path, tune, key)
    assert data["date"] == "old", "the table's tiles (and their run's metadata) are kept"
    assert data["configs"][key]["8"] == entries["8"]
    log = json.loads((out / "tune_log.json").read_text())["log"]
    assert len(log) == 2 * 6 * tune.ONE_LAUNCH_ROUNDS and {e["T"] for e in log} == {64, 1024}
    # --tokens picks buckets: only T=1024 re-decided, the T=64 entry as written before
    path.write_text(json.dumps({"notes": "kept", "configs": {key: entries}}))
    assert tune.main([*argv, "--tokens", "1000"]) == 0
    written = json.loads(path.read_text())["configs"][key]
    assert written["64"] == entries["64"] and "one_launch_us" in written["1024"]


def test_main_one_launch_only_keeps_a_pinned_entry(monkeypatch, tmp_path, capsys):
    """An entry whose one_launch was set by hand (`one_launch_pinned`, the reason) is neither timed
    nor rewritten by --one-launch-only; the other buckets are decided as usual."""
    tune = _load()
    path = _fake_gpu(monkeypatch, tmp_path, tune)
    key = "E4_H64_I32_K2_bfloat16"
    pinned = {**_cfg(64).to_json(), "one_launch": True, tune.ONE_LAUNCH_PIN: "layer A/B"}
    entries = {"8": _cfg(16).to_json(), "64": _cfg(32).to_json(), "1024": pinned}
    path.write_text(json.dumps({"notes": "kept", "configs": {key: entries}}))
    out = tmp_path / "out"
    argv = ["--out", str(out), "--shapes", "tiny", "--one-launch-only", "--no-precompile", "--write"]
    assert tune.main(argv) == 0
    written = json.loads(path.read_text())["configs"][key]
    assert written["1024"] == pinned, "the pinned entry as it was (the fake timings would turn it off)"
    assert "one_launch_us" in written["64"]
    log = json.loads((out / "tune_log.json").read_text())["log"]
    assert {e["T"] for e in log} == {64}
    assert "T=1024: one_launch=True kept, pinned: layer A/B" in capsys.readouterr().out


def test_main_tuning_decides_one_launch_after_the_tiles(monkeypatch, tmp_path):
    tune = _load()
    path = _fake_gpu(monkeypatch, tmp_path, tune)
    path.write_text(json.dumps({"notes": "kept", "configs": {}}))
    tiles = {8: _cfg(16), 64: _cfg(32), 1024: _cfg(64)}
    monkeypatch.setattr(tune, "tune_case", lambda case, log, deadline: (tiles[case.num_tokens], 50.0))
    argv = ["--out", str(tmp_path / "out"), "--shapes", "tiny", "--tokens", "8,64,1024", "--no-precompile"]
    assert tune.main([*argv, "--write"]) == 0
    _check_written(path, tune, "E4_H64_I32_K2_bfloat16")
    entries = json.loads(path.read_text())["configs"]["E4_H64_I32_K2_bfloat16"]
    # T = 8 (few_slots_bucket(2)) is 12 -> 10 us fused, but gives T = 1024 its few-slot tiles,
    # whose one-row step the fake times slower fused (22 -> 30 us): the flag stays off
    assert entries["8"]["fused"] is False and entries["8"]["fused_us"] == {
        "two_launches": 12.0, "fused": 10.0,
        "dependents": {"T=1024 num_valid=1": {"incumbent": 22.0, "winner": 30.0}}}
    assert not any(entries[b]["fused"] or "fused_us" in entries[b] for b in ("64", "1024"))
    # --no-one-launch: winners keep one_launch off, nothing timed for it
    assert tune.main([*argv, "--write", "--no-one-launch", "--no-fused"]) == 0
    entries = json.loads(path.read_text())["configs"]["E4_H64_I32_K2_bfloat16"]
    assert not any(e["one_launch"] or "one_launch_us" in e for e in entries.values())
    assert not any(e["fused"] or "fused_us" in e for e in entries.values())


def test_missing_buckets():
    """Each bucket of the T given whose entry the table lacks, once (the first T asking for it)."""
    tune = _load()
    entries = {"1": {}, "8": {}, "256": {}}
    assert tune.missing_buckets((1, 8, 64, 256, 512, 2048), entries) == (64, 512, 2048)
    assert tune.missing_buckets((3, 4, 5, 8), entries) == (3,)  # buckets 4, 4, 8, 8; 8 has an entry
    assert tune.missing_buckets((1, 8), entries) == ()
    assert tune.missing_buckets((1, 8), {}) == (1, 8)


def test_main_missing_tunes_only_the_buckets_without_an_entry(monkeypatch, tmp_path, capsys):
    """--missing: the search runs only at the buckets (of --tokens or the defaults) the device
    table lacks; the entries it has stay as they were; nothing to do is not an error; it cannot be
    combined with the *-only runs, which re-decide existing entries."""
    tune = _load()
    path = _fake_gpu(monkeypatch, tmp_path, tune)
    key = "E4_H64_I32_K2_bfloat16"
    kept = {**_cfg(16).to_json(), "us": 9.0}
    path.write_text(json.dumps({"notes": "kept", "configs": {key: {"8": kept}}}))
    tuned = []

    def fake_tune(case, log, deadline):
        tuned.append(case.num_tokens)
        return _cfg(32), 50.0

    monkeypatch.setattr(tune, "tune_case", fake_tune)
    argv = ["--out", str(tmp_path / "out"), "--shapes", "tiny", "--tokens", "8,64", "--no-precompile",
            "--no-one-launch", "--no-fused", "--write", "--missing"]
    assert tune.main(argv) == 0
    assert tuned == [64]
    entries = json.loads(path.read_text())["configs"][key]
    assert entries["8"] == kept and set(entries) == {"8", "64"}
    assert "tiny: buckets without an entry: [64]" in capsys.readouterr().out
    tuned.clear()
    assert tune.main(argv) == 0 and tuned == []
    assert "tiny: buckets without an entry: none" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tune.main([*argv[:-3], "--missing", "--one-launch-only"])


def test_fused_buckets_and_rule(monkeypatch):
    """fused is timed where every call takes the few-slot path (T*K <= 16, few on) or would, fused
    (T*K <= 64 with the packed tiles, the default; 32 without), and kept only when faster by more
    than FUSED_MARGIN."""
    import safemoe.kernels.experts as experts_module

    tune = _load()
    configs = {b: _cfg(16) for b in (1, 2, 4, 8, 16, 64)}
    assert tune.fused_buckets(configs, 2) == [1, 2, 4, 8, 16]
    assert tune.fused_buckets(configs, 8) == [1, 2, 4, 8]
    assert tune.fused_buckets({**configs, 2: _cfg(16, few=False)}, 8) == [1, 4, 8]
    assert tune.fused_buckets(configs, 17) == []
    monkeypatch.setattr(experts_module, "PACK_FUSED_ROWS", False)
    assert tune.fused_buckets(configs, 8) == [1, 2, 4]
    assert tune.fused_buckets(configs, 4) == [1, 2, 4, 8]
    margin = tune.FUSED_MARGIN
    assert tune.choose_fused(100.0, 100.0 * (1 - margin) - 0.01)
    assert not tune.choose_fused(100.0, 100.0 * (1 - margin) + 0.01)
    assert not tune.choose_fused(100.0, 104.0)


def test_decide_fused_times_both_interleaved_by_median():
    tune = _load()

    class Case:
        name, num_tokens = "gptoss", 1

        def __init__(self, times):
            self.times, self.calls = times, []

        def time(self, cfg, est_us=None, small=None, num_valid=None):
            self.calls.append(cfg.fused)
            us = self.times[cfg.fused]
            return us / 2 if len(self.calls) == 1 else us  # round 1's two launches: an outlier

    cfg = _cfg(16, extra={"us": 80.0})
    case, log = Case({False: 80.0, True: 78.4}), []
    choice, med = tune.decide_fused(case, cfg, log, deadline=float("inf"))
    assert choice is True and med == {"two_launches": 80.0, "fused": 78.4}
    assert case.calls == [False, True] * tune.ONE_LAUNCH_ROUNDS
    assert [(e["sweep"], e["config"]["fused"]) for e in log] == [("fused", f) for f in (False, True)] * 3
    assert tune.decide_fused(Case({False: 80.0, True: 79.6}), cfg, [], float("inf"))[0] is False
    assert tune.decide_fused(Case({False: 80.0, True: 78.0}), cfg, [], deadline=0.0) is None


def test_main_fused_only_writes_decisions(monkeypatch, tmp_path):
    tune = _load()
    path = _fake_gpu(monkeypatch, tmp_path, tune)
    key = "E4_H64_I32_K2_bfloat16"
    entries = {"1": _cfg(16).to_json(), "8": {**_cfg(16).to_json(), "us": 9.0}, "64": _cfg(32).to_json()}
    path.write_text(json.dumps({"date": "old", "notes": "kept", "configs": {key: entries}}))
    out = tmp_path / "out"
    argv = ["--out", str(out), "--shapes", "tiny", "--fused-only", "--write"]
    assert tune.main(argv) == 0
    data = json.loads(path.read_text())
    assert data["date"] == "old" and data["notes"] == "kept" and "fused_run" in data
    written = data["configs"][key]
    med = {"two_launches": 12.0, "fused": 10.0}
    assert written["1"] == {**entries["1"], "fused": True, "fused_us": med}
    # T = 8 is few_slots_bucket(2): fused, it would slow T = 64's one-row step (22 -> 30 us)
    assert written["8"] == {**entries["8"], "fused": False, "fused_us": {
        **med, "dependents": {"T=64 num_valid=1": {"incumbent": 22.0, "winner": 30.0}}}}
    assert written["64"] == entries["64"]
    log = json.loads((out / "tune_log.json").read_text())["log"]
    assert len(log) == 3 * 2 * tune.ONE_LAUNCH_ROUNDS and {e["T"] for e in log} == {1, 8, 64}
    with pytest.raises(SystemExit):
        tune.main([*argv, "--no-fused"])


def test_interleave_candidates_and_rule():
    """GEMM1 interleaved (pointer loads) at the entry's stages and one fewer (never below 2); the
    fastest is kept only when it beats the entry by more than INTERLEAVE_MARGIN."""
    tune = _load()
    entry = ExpertsConfig(128, GemmTiles(128, 64, num_stages=4, tma=True), GemmTiles(256, 64))
    candidates = tune.interleave_candidates(entry)
    assert list(candidates) == ["entry", "interleave_s4", "interleave_s3", "interleave_tma_s4",
                                "interleave_tma_s3"]
    for name, candidate in list(candidates.items())[1:]:
        gemm1 = candidate.gemm1
        assert gemm1.interleave and gemm1.tma == ("tma" in name) and gemm1.block_n == 128
        assert gemm1.num_stages == int(name[-1]) and candidate.gemm2 == entry.gemm2
    two = ExpertsConfig(128, GemmTiles(128, 64, num_stages=2), GemmTiles(256, 64))
    assert list(tune.interleave_candidates(two)) == ["entry", "interleave_s2", "interleave_tma_s2"]
    margin = tune.INTERLEAVE_MARGIN
    assert tune.choose_interleave({"entry": 100.0, "a": 100.0 * (1 - margin) - 0.01, "b": 101.0}) == "a"
    assert tune.choose_interleave({"entry": 100.0, "a": 100.0 * (1 - margin) + 0.01}) == "entry"
    assert tune.choose_interleave({"entry": 100.0, "a": 98.0, "b": 97.0}) == "b"


def test_main_interleave_only_writes_decisions(monkeypatch, tmp_path):
    """--interleave-only times the table's prefill entries (T >= INTERLEAVE_MIN_TOKENS) against their
    GEMM1 interleaved, ONE_LAUNCH_ROUNDS interleaved rounds, and writes the winner's GEMM1 with the
    medians; smaller buckets and every other field stay as they were."""
    tune = _load()
    path = _fake_gpu(monkeypatch, tmp_path, tune)
    key = "E4_H64_I32_K2_bfloat16"
    prefill = ExpertsConfig(128, GemmTiles(128, 64, num_stages=4, tma=True), GemmTiles(256, 64),
                            one_launch=True)
    entries = {"64": _cfg(32).to_json(), "2048": {**prefill.to_json(), "us": 900.0},
               "8192": prefill.to_json()}
    path.write_text(json.dumps({"date": "old", "notes": "kept", "configs": {key: entries}}))
    # T=2048: interleaved at 3 stages wins by 4%; T=8192: by 0.5% only (the entry stays)
    times = {2048: {(False, 4): 100.0, (True, 4): 98.0, (True, 3): 96.0},
             8192: {(False, 4): 400.0, (True, 4): 398.0, (True, 3): 401.0}}
    calls = []

    def fake_time(self, cfg, stages="all", est_us=None, small=None, num_valid=None):
        calls.append(self.num_tokens)
        # the entry has TMA; interleaved with TMA costs 1 us more than through pointers here
        interleaved_tma = cfg.gemm1.interleave and cfg.gemm1.tma
        return times[self.num_tokens][(cfg.gemm1.interleave, cfg.gemm1.num_stages)] + interleaved_tma

    monkeypatch.setattr(tune.Case, "time", fake_time)
    out = tmp_path / "out"
    assert tune.main(["--out", str(out), "--shapes", "tiny", "--interleave-only", "--write"]) == 0
    data = json.loads(path.read_text())
    assert data["date"] == "old" and data["notes"] == "kept" and "interleave_run" in data
    written = data["configs"][key]
    assert written["64"] == entries["64"]
    won = ExpertsConfig.from_json(written["2048"])
    assert won.gemm1 == GemmTiles(128, 64, num_stages=3, interleave=True) and won.one_launch
    assert written["2048"]["us"] == 900.0
    assert written["2048"]["interleave_us"] == {"entry": 100.0, "interleave_s4": 98.0, "interleave_s3": 96.0,
                                                "interleave_tma_s4": 99.0, "interleave_tma_s3": 97.0}
    assert ExpertsConfig.from_json(written["8192"]).gemm1 == prefill.gemm1
    assert sorted(calls) == [2048] * 15 + [8192] * 15
    calls.clear()
    times[64] = {(False, 4): 50.0, (True, 4): 51.0, (True, 3): 52.0}
    entries["64"] = {**prefill.to_json(), "block_m": 32}
    path.write_text(json.dumps({"configs": {key: entries}}))
    argv = ["--out", str(out), "--shapes", "tiny", "--interleave-only", "--tokens", "64"]
    assert tune.main(argv) == 0  # --tokens: any bucket, here a decode one
    assert calls == [64] * 15


def test_engine_candidates_and_rule():
    """GEMM2's Gluon engine at ENGINE_VARIANTS (256 x 64 tiles, 8 warps) against the entry; none
    for a block_m other than 128; the Triton GEMM2 as a candidate when the entry already runs the
    engine; the fastest kept only when it beats the entry by more than ENGINE_MARGIN."""
    tune = _load()
    entry = ExpertsConfig(128, GemmTiles(128, 64, num_warps=8), GemmTiles(256, 64, group_m=4, num_warps=8))
    candidates = tune.engine_candidates(entry)
    assert list(candidates) == ["entry"] + [f"{e}_s{s}" for e, s in tune.ENGINE_VARIANTS]
    for name, candidate in list(candidates.items())[1:]:
        tiles = candidate.gemm2
        assert (tiles.engine, tiles.num_stages) in tune.ENGINE_VARIANTS and name.startswith(tiles.engine)
        assert (tiles.block_n, tiles.block_k, tiles.num_warps, tiles.group_m) == (256, 64, 8, 4)
        assert candidate.gemm1 == entry.gemm1
    assert list(tune.engine_candidates(ExpertsConfig(64, GemmTiles(64, 64), GemmTiles(128, 64)))) == ["entry"]
    running = candidates["ws_s4"]
    again = tune.engine_candidates(running)
    assert "triton" in again and again["triton"].gemm2.engine == "triton" and "ws_s4" not in again
    margin = tune.ENGINE_MARGIN
    assert tune.choose_engine({"entry": 100.0, "a": 100.0 * (1 - margin) - 0.01, "b": 101.0}) == "a"
    assert tune.choose_engine({"entry": 100.0, "a": 100.0 * (1 - margin) + 0.01}) == "entry"


def test_main_engine_only_writes_decisions(monkeypatch, tmp_path):
    """--engine-only times the table's prefill entries (T >= ENGINE_MIN_TOKENS) against the Gluon
    GEMM2 variants and writes the winner's GEMM2 with the medians; an entry of another block_m is
    left untimed, smaller buckets and every other field stay as they were; it is refused off sm_90
    and beside another -only mode."""
    import torch

    tune = _load()
    path = _fake_gpu(monkeypatch, tmp_path, tune)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    key = "E4_H64_I32_K2_bfloat16"
    prefill = ExpertsConfig(128, GemmTiles(128, 64, num_warps=8), GemmTiles(256, 64, num_warps=8),
                            one_launch=True)
    entries = {"64": _cfg(32).to_json(), "2048": {**prefill.to_json(), "us": 900.0},
               "8192": prefill.to_json(), "16384": _cfg(64).to_json()}
    path.write_text(json.dumps({"date": "old", "notes": "kept", "configs": {key: entries}}))
    # T=2048: ws_store wins by 4%; T=8192: the best variant by 1% only (the entry stays)
    times = {2048: {"triton": 100.0, ("ws", 3): 98.0, ("ws", 4): 97.0, ("ws_store", 3): 96.0},
             8192: {"triton": 400.0, ("ws", 3): 396.0, ("ws", 4): 399.0, ("ws_store", 3): 401.0}}
    calls = []

    def fake_time(self, cfg, stages="all", est_us=None, small=None, num_valid=None):
        calls.append(self.num_tokens)
        tiles = cfg.gemm2
        engine = "triton" if tiles.engine == "triton" else (tiles.engine, tiles.num_stages)
        return times[self.num_tokens][engine]

    monkeypatch.setattr(tune.Case, "time", fake_time)
    out = tmp_path / "out"
    assert tune.main(["--out", str(out), "--shapes", "tiny", "--engine-only", "--write"]) == 0
    data = json.loads(path.read_text())
    assert data["date"] == "old" and data["notes"] == "kept" and "engine_run" in data
    written = data["configs"][key]
    assert written["64"] == entries["64"] and written["16384"] == entries["16384"]
    won = ExpertsConfig.from_json(written["2048"])
    assert (won.gemm2.engine, won.gemm2.num_stages) == ("ws_store", 3) and won.one_launch
    assert won.gemm1 == prefill.gemm1 and written["2048"]["us"] == 900.0
    assert written["2048"]["gemm2_engine_us"] == {"entry": 100.0, "ws_s3": 98.0, "ws_s4": 97.0,
                                                  "ws_store_s3": 96.0}
    assert ExpertsConfig.from_json(written["8192"]).gemm2 == prefill.gemm2
    assert sorted(calls) == [2048] * 12 + [8192] * 12  # 4 candidates x ONE_LAUNCH_ROUNDS; 16384 untimed
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert tune.main(["--out", str(out), "--shapes", "tiny", "--engine-only"]) == 1
    with pytest.raises(SystemExit):
        tune.main(["--out", str(out), "--shapes", "tiny", "--engine-only", "--programs-only"])


def test_main_interleave_only_fp8_per_tensor_entries(monkeypatch, tmp_path):
    """--interleave-only --quant per_tensor decides the fp8 per-tensor key's entries, timed on
    quantised weights (every Case carries them), and records its run under its own name; the bf16
    entries stay as written. Block mode, whose GEMM1 runs no interleave, is a usage error."""
    from types import SimpleNamespace

    tune = _load()
    path = _fake_gpu(monkeypatch, tmp_path, tune)
    fake_fp8 = SimpleNamespace(mode="per_tensor")
    monkeypatch.setattr(tune, "quantize_weights", lambda w13, w2, quant: (w13, w2, fake_fp8))
    bf16_key, fp8_key = "E4_H64_I32_K2_bfloat16", "E4_H64_I32_K2_bfloat16_fp8-per_tensor"
    prefill = ExpertsConfig(128, GemmTiles(128, 64, num_stages=4), GemmTiles(256, 64))
    entries = {"8192": prefill.to_json()}
    path.write_text(json.dumps({"configs": {bf16_key: entries, fp8_key: entries}}))
    seen = []

    def fake_time(self, cfg, stages="all", est_us=None, small=None, num_valid=None):
        seen.append(self.fp8)
        return 90.0 if cfg.gemm1.interleave and not cfg.gemm1.tma and cfg.gemm1.num_stages == 4 else 100.0

    monkeypatch.setattr(tune.Case, "time", fake_time)
    argv = ["--out", str(tmp_path / "out"), "--shapes", "tiny", "--interleave-only", "--write"]
    assert tune.main([*argv, "--quant", "per_tensor"]) == 0
    data = json.loads(path.read_text())
    assert "fp8_per_tensor_interleave_run" in data and "interleave_run" not in data
    assert ExpertsConfig.from_json(data["configs"][fp8_key]["8192"]).gemm1 == GemmTiles(128, 64, num_stages=4,
                                                                                          interleave=True)
    assert data["configs"][bf16_key] == entries
    assert seen and all(fp8 is fake_fp8 for fp8 in seen)
    with pytest.raises(SystemExit):
        tune.main([*argv, "--quant", "block"])


def test_main_programs_only_decides_decode_grids(monkeypatch, tmp_path):
    """--programs-only times the table's decode entries that run a dispatch layout (above
    SMALL_BATCH_TOKENS, below PROGRAMS_MAX_TOKENS) at PROGRAMS_CANDIDATES programs per SM against
    the entry's, and writes a faster grid only past PROGRAMS_MARGIN; --tokens reaches the
    small-batch source bucket, whose winner must leave the padded steps it serves within
    ONE_LAUNCH_TOLERANCE (here it slows the 8-row step: the entry stays)."""
    tune = _load()
    path = _fake_gpu(monkeypatch, tmp_path, tune)
    key = "E4_H64_I32_K2_bfloat16"
    entries = {"4": _cfg(16, few=True).to_json(), "8": _cfg(16, few=True).to_json(),
               "64": _cfg(32).to_json(), "256": {**_cfg(32).to_json(), "us": 700.0},
               "2048": _cfg(128).to_json()}
    path.write_text(json.dumps({"date": "old", "configs": {key: entries}}))
    full = {8: {4: 100.0, 64: 90.0}, 64: {4: 100.0, 8: 99.5, 16: 98.0, 64: 95.0},
            256: {4: 100.0, 16: 99.5}}
    calls = []

    def fake_time(self, cfg, stages="all", est_us=None, small=None, num_valid=None, few=None):
        if num_valid is not None:  # a dependent padded step of a larger bucket
            calls.append((self.num_tokens, num_valid))
            return 60.0 if num_valid == tune.SMALL_BATCH_TOKENS and small.programs_per_sm == 64 else 50.0
        calls.append(self.num_tokens)
        return full[self.num_tokens].get(cfg.programs_per_sm, 100.0)

    monkeypatch.setattr(tune.Case, "time", fake_time)
    out = tmp_path / "out"
    assert tune.main(["--out", str(out), "--shapes", "tiny", "--programs-only", "--write"]) == 0
    data = json.loads(path.read_text())
    assert data["date"] == "old" and "programs_run" in data
    written = data["configs"][key]
    assert {b: written[b] for b in ("4", "8", "2048")} == {b: entries[b] for b in ("4", "8", "2048")}
    assert ExpertsConfig.from_json(written["64"]) == _cfg(32, programs_per_sm=64)
    assert written["64"]["programs_us"] == {"entry": 100.0, "programs_8": 99.5, "programs_16": 98.0,
                                            "programs_64": 95.0}
    assert ExpertsConfig.from_json(written["256"]) == _cfg(32) and written["256"]["us"] == 700.0
    assert sorted(calls) == [64] * 12 + [256] * 12  # 4 candidates x ONE_LAUNCH_ROUNDS each
    calls.clear()
    argv = ["--out", str(out), "--shapes", "tiny", "--programs-only", "--write", "--tokens", "8"]
    assert tune.main(argv) == 0
    kept = json.loads(path.read_text())["configs"][key]["8"]
    assert ExpertsConfig.from_json(kept) == _cfg(16, few=True)
    assert kept["programs_us"]["programs_64"] == 90.0
    assert kept["programs_us"]["dependents"]["T=256 num_valid=8"] == {"incumbent": 50.0, "winner": 60.0}
    assert (256, tune.SMALL_BATCH_TOKENS) in calls
    with pytest.raises(SystemExit):
        tune.main([*argv, "--interleave-only"])


def test_fp8_candidates_follow_the_weight_mode():
    """Block mode steps K inside one 128-wide scale group; per-tensor keeps the wider K steps; no
    fp8 candidate carries the few-slot path (it takes no fp8 weights)."""
    tune = _load()
    for num_tokens in (1, 8, 64, 256, 8192):
        bf16 = tune.candidate_plan(num_tokens, 128, 8)
        block = tune.candidate_plan(num_tokens, 128, 8, "block")
        per_tensor = tune.candidate_plan(num_tokens, 128, 8, "per_tensor")
        assert block and all(max(c.gemm1.block_k, c.gemm2.block_k) <= tune.FP8_BLOCK_K for c in block)
        assert not any(c.few for c in block + per_tensor), num_tokens
        # per-tensor: the bf16 candidates, and at decode / mid the fp8 byte-equivalent ones besides
        # (FP8_DECODE_G1/G2, test above); prefill lists are the same
        assert {repr(replace_few(c)) for c in bf16} <= {repr(replace_few(c)) for c in per_tensor}, num_tokens
        if num_tokens == 8192:
            assert [replace_few(c) for c in per_tensor] == [replace_few(c) for c in bf16], num_tokens
        assert {c.block_m for c in block} == {c.block_m for c in bf16}
    wide_k = [c for c in tune.candidate_plan(8, 128, 8) if c.gemm1.block_k > tune.FP8_BLOCK_K]
    assert wide_k, "the decode lists have 256-wide K steps that block mode must narrow"
    assert tune.for_quant([(32, 256, 4, 4), (32, 128, 4, 4), (64, 64, 4, 6)], "block") == [
        (32, 128, 4, 4), (64, 64, 4, 6)]


def replace_few(cfg):
    from dataclasses import replace

    return replace(cfg, few=False)


def test_confirm_ranking_retimes_the_leaders_round_robin():
    tune = _load()
    cfgs = [_cfg(16), _cfg(32), _cfg(64), _cfg(128)]
    # cfgs[0] got one lucky timing; its median over the rounds is slower than cfgs[1]'s
    results = [(30.0, cfgs[0]), (31.0, cfgs[1]), (31.0, cfgs[1]), (31.5, cfgs[2]), (40.0, cfgs[3])]
    later = {16: [34.0, 33.0, 35.0], 32: [31.2, 30.8, 31.1], 64: [32.0, None, 31.9]}
    calls = []

    def retime(cfg):
        calls.append(cfg.block_m)
        return later[cfg.block_m][sum(1 for b in calls if b == cfg.block_m) - 1]

    ranked = tune.confirm_ranking(results, retime, window=0.06, limit=4, rounds=3)
    assert calls == [16, 32, 64] * 3, "round-robin over the leaders, the 33%-slower one never"
    assert [cfg.block_m for _, cfg in ranked] == [32, 64, 16, 128]
    assert ranked[0][0] == 31.0 and ranked[1][0] == 31.9 and ranked[-1] == (40.0, cfgs[3])
    # one leader alone: nothing to confirm
    assert tune.confirm_ranking([(30.0, cfgs[0]), (40.0, cfgs[3])], retime, window=0.04) == [
        (30.0, cfgs[0]), (40.0, cfgs[3])]
    assert len(calls) == 9


def test_main_tunes_fp8_under_its_own_key(monkeypatch, tmp_path):
    """--quant block: cases carry the quantised weights, winners land under the shape's
    _fp8-block key (what get_config reads with quant="block"), one_launch is neither timed nor
    set; --one-launch-only refuses --quant."""
    tune = _load()
    path = _fake_gpu(monkeypatch, tmp_path, tune)
    path.write_text(json.dumps({"notes": "kept", "configs": {}}))
    seen = []
    import torch

    def fake_tune_case(case, log, deadline):
        seen.append((case.num_tokens, case.quant, case.w13.dtype, case.ws.fp8))
        cuda = torch.device("cuda", 0)
        assert case.incumbent == tune.incumbent_config("tiny", case.num_tokens, "block", cuda)
        return _cfg(16 if case.num_tokens <= 8 else 32), 50.0

    monkeypatch.setattr(tune, "tune_case", fake_tune_case)
    argv = ["--out", str(tmp_path / "out"), "--shapes", "tiny", "--tokens", "8,64", "--no-precompile",
            "--quant", "block", "--write"]
    assert tune.main(argv) == 0
    assert seen == [(8, "block", torch.float8_e4m3fn, True), (64, "block", torch.float8_e4m3fn, True)]
    written = json.loads(path.read_text())
    assert "date" not in written and written["fp8_block_run"]["device"] == "FakeGPU", "bf16 metadata kept"
    configs = written["configs"]
    assert list(configs) == ["E4_H64_I32_K2_bfloat16_fp8-block"]
    entries = configs["E4_H64_I32_K2_bfloat16_fp8-block"]
    assert not any(e["one_launch"] or "one_launch_us" in e for e in entries.values())
    assert ExpertsConfig.from_json(entries["64"]).block_m == 32
    with pytest.raises(SystemExit):
        tune.main(["--out", str(tmp_path / "x"), "--one-launch-only", "--quant", "block"])


@interpreter_only("CPU tensors through the Triton kernels")
def test_case_runs_fp8_weights_like_the_fp8_reference():
    """Case with fp8 weights (what --quant times) on a tiny shape in the interpreter: the fp8 path
    runs, `check` compares it with experts_fp8_reference, padding rows are zeros, and the
    per-stage timings (bf16 kernels alone) are refused."""
    import torch

    tune = _load()
    tune.SHAPES["tiny-fp8"] = (4, 2, 128, 64)  # (E, K, H, I)
    try:
        gen = torch.Generator().manual_seed(0)
        w13 = (torch.randn(4, 128, 128, generator=gen) * 0.1).to(torch.bfloat16)
        w2 = (torch.randn(4, 128, 64, generator=gen) * 0.1).to(torch.bfloat16)
        cfg = ExpertsConfig(16, GemmTiles(32, 32, 1, 4, 1), GemmTiles(32, 32, 1, 4, 1))
        for mode in tune.QUANT_MODES:
            q13, q2, fp8 = tune.quantize_weights(w13, w2, mode)
            case = tune.Case("tiny-fp8", q13, q2, 12, fp8=fp8)
            assert case.quant == mode and case.ws.fp8
            case.outs[0].fill_(float("nan"))
            error = case.check(cfg)
            assert error < 3e-2, (mode, error)
            case.outs[0].fill_(float("nan"))
            case.step(cfg, num_valid=1)(0)
            assert bool(torch.isfinite(case.outs[0][:1]).all()) and bool((case.outs[0][1:] == 0).all())
            with pytest.raises(ValueError, match="fp8"):
                case.step(cfg, "gemm1")
    finally:
        del tune.SHAPES["tiny-fp8"]


def test_precompile_stand_ins_have_the_scale_shapes_of_real_fp8_weights():
    """The precompile workers compile fp8 kernels against broadcast stand-ins: same dtypes, shapes
    and scale shapes as `quantize_experts` gives (I = 96: a partial 128-wide block)."""
    import torch

    tune = _load()
    w13, w2 = torch.zeros(4, 192, 256), torch.zeros(4, 256, 96)
    for mode in tune.QUANT_MODES:
        q13, q2, real = tune.quantize_weights(w13, w2, mode)
        s13, s2, stand_in = tune.stand_in_fp8(4, 256, 96, mode, torch.device("cpu"))
        assert (s13.shape, s13.dtype, s2.shape, s2.dtype) == (q13.shape, q13.dtype, q2.shape, q2.dtype)
        assert stand_in.mode == real.mode == mode
        assert stand_in.w13_scale.shape == real.w13_scale.shape
        assert stand_in.w2_scale.shape == real.w2_scale.shape


def test_the_incumbent_is_compiled_timed_and_can_win(monkeypatch):
    """A bucket's config of today (here the fp8 block heuristic at T = 8192, whose 256-column
    GEMM2 no candidate list holds) is precompiled and timed first; when nothing beats it in the
    run's own timings it stays."""
    import torch

    from safemoe.configs import heuristic_fp8_config, limit_block_k

    tune = _load()
    incumbent = limit_block_k(heuristic_fp8_config(8192, 128, 2048, 768, 8, "block"), 128)
    key = json.dumps(incumbent.to_json(), sort_keys=True)
    plan = {json.dumps(c.to_json(), sort_keys=True) for c in tune.candidate_plan(8192, 128, 8, "block")}
    assert key not in plan
    baselines = {("qwen3", 8192): [incumbent, incumbent]}
    tasks = tune.compile_tasks(["qwen3"], {"qwen3": (8192,)}, "block", baselines)
    compiled = [json.dumps(c, sort_keys=True) for _, _, items, _ in tasks for c, _ in items]
    assert compiled.count(key) == 1 and len(compiled) == len(plan) + 1
    assert tune.incumbent_config("qwen3", 8192, "block", torch.device("cpu")).gemm2.block_k <= 128
    assert tune.heuristic_tiles("qwen3", 8192, "block") == incumbent
    assert tune.heuristic_tiles("qwen3", 8192, "per_tensor").gemm2.block_n == 256
    assert tune.heuristic_tiles("qwen3", 8192, None).block_m == 128

    class Case:
        name, num_tokens, quant, fp8 = "qwen3", 8192, "block", object()
        replace_margin = tune.REPLACE_MARGIN

        def __init__(self, heuristic=None):
            self.incumbent, self.heuristic = incumbent, heuristic

        def check(self, cfg):
            return 0.0

    sweeps = []

    def fake_timed(case, cfg, log, sweep, est, small=None, num_valid=None):
        sweeps.append(sweep)
        return 100.0 if json.dumps(cfg.to_json(), sort_keys=True) == key else 103.0 + len(sweeps) % 3

    monkeypatch.setattr(tune, "_timed", fake_timed)
    best, us = tune.tune_case(Case(), [], deadline=float("inf"))
    assert sweeps[0] == "incumbent" and best == incumbent and us == 100.0
    # the heuristic is timed after the incumbent (once, when it is another config) and can win too:
    # a bucket without an entry of its own runs a neighbour's tiles as its incumbent
    neighbour = tune.replace(incumbent, block_m=64)
    sweeps.clear()
    key = json.dumps(incumbent.to_json(), sort_keys=True)

    class Neighboured(Case):
        def __init__(self):
            super().__init__(heuristic=incumbent)
            self.incumbent = neighbour

    best, us = tune.tune_case(Neighboured(), [], deadline=float("inf"))
    assert sweeps[:2] == ["incumbent", "heuristic"] and best == incumbent and us == 100.0
    sweeps.clear()
    tune.tune_case(Case(heuristic=incumbent), [], deadline=float("inf"))
    assert sweeps.count("heuristic") == 0


def test_keep_incumbent_within_the_replace_margin():
    """A winner faster by at most REPLACE_MARGIN does not replace the incumbent (its tiles may also
    serve other buckets' padded steps); a clearly faster one does; no incumbent timed: unchanged."""
    tune = _load()
    assert tune.REPLACE_MARGIN == 0.01
    incumbent, rival, third = _cfg(16), _cfg(32), _cfg(64)
    results = [(748.7, rival), (751.3, incumbent), (760.0, third)]
    kept = tune.keep_incumbent(results, incumbent)
    assert kept[0] == (751.3, incumbent) and sorted(map(id, kept)) == sorted(map(id, results))
    faster = [(740.0, rival), (751.3, incumbent)]
    assert tune.keep_incumbent(faster, incumbent) == faster
    assert tune.keep_incumbent(results, None) == results
    assert tune.keep_incumbent([(748.7, rival)], incumbent) == [(748.7, rival)]
    # an equal config built anew (another object, extra fields) is the incumbent too
    same = tune.replace(incumbent, extra={"us": 1.0})
    assert tune.keep_incumbent([(748.7, rival), (750.0, same)], incumbent)[0][1] is same


def test_winner_must_keep_the_buckets_padded_steps(monkeypatch):
    """A winner (bf16 or fp8) that replaces the incumbent of a bucket replaying padded decode steps
    is kept only if both of the bucket's own padded steps (SMALL_BATCH_TOKENS rows with the small
    tiles, and one row), timed interleaved for ONE_LAUNCH_ROUNDS rounds, stay within
    ONE_LAUNCH_TOLERANCE (the H200 retunes of 2026-11-28 would have written a fp8 Qwen3 T = 256
    entry +1.1 / +2.5% on them, and a bf16 Qwen3-Next T = 256 entry +1.6 / +16.9%); otherwise
    the incumbent stays with its ranked time. Nothing is timed for the incumbent itself, for buckets
    that replay no padded step, or when the incumbent was not ranked."""
    import math

    tune = _load()
    small = _cfg(16)
    incumbent, winner = _cfg(32), _cfg(64)
    calls = []

    def run(padded_us, num_tokens=256, ranked=((180.0, winner), (183.0, incumbent)), cfg=winner):
        case = types.SimpleNamespace(name="qwen3", num_tokens=num_tokens, small_source=small,
                                     incumbent=incumbent, ranked=list(ranked))

        def fake_timed(case, cfg, log, sweep, est, small=None, num_valid=None):
            side = "winner" if cfg == winner else "incumbent"
            assert sweep == f"padded_{side}" and small is not None
            calls.append((side, num_valid))
            return padded_us[side, num_valid]

        monkeypatch.setattr(tune, "_timed", fake_timed)
        calls.clear()
        return tune.padded_steps_hold(case, cfg, 180.0, [], math.inf)

    slower = {("incumbent", 8): 79.3, ("winner", 8): 80.2, ("incumbent", 1): 31.6, ("winner", 1): 32.4}
    cfg, us, timings = run(slower)
    assert (cfg, us) == (incumbent, 183.0)
    assert timings == {"num_valid=8": {"incumbent": 79.3, "winner": 80.2},
                       "num_valid=1": {"incumbent": 31.6, "winner": 32.4}}
    rounds = tune.ONE_LAUNCH_ROUNDS
    assert calls == ([("incumbent", 8), ("winner", 8)] * rounds + [("incumbent", 1), ("winner", 1)] * rounds)
    within = {**slower, ("winner", 8): 79.3 * (1 + tune.ONE_LAUNCH_TOLERANCE) - 0.01, ("winner", 1): 31.0}
    cfg, us, timings = run(within)
    assert (cfg, us) == (winner, 180.0) and timings is not None
    unchecked = ({"num_tokens": 8}, {"num_tokens": 2048}, {"cfg": incumbent}, {"ranked": ((180.0, winner),)})
    for kwargs in unchecked:
        cfg, _, timings = run(slower, **kwargs)
        assert timings is None and calls == [] and cfg == kwargs.get("cfg", winner)
    # a full-batch saving PADDED_TRADE times what the padded steps lose buys them (none > 10% slower)
    cfg, us, _ = run(slower, ranked=((180.0, winner), (200.0, incumbent)))
    assert (cfg, us) == (winner, 180.0)
    too_slow = {**slower, ("winner", 1): 31.6 * (1 + tune.PADDED_TRADE_MAX) + 0.1}
    cfg, us, _ = run(too_slow, ranked=((180.0, winner), (400.0, incumbent)))
    assert (cfg, us) == (incumbent, 400.0)


def test_padded_hybrids_replace_a_winner_whose_padded_steps_got_slower(monkeypatch):
    """When the winner fails its bucket's padded-step rule, the winner with the incumbent's GEMM1
    (then with its GEMM2) is tried: kept when it beats the incumbent's full batch by more than the
    replace margin (interleaved), matches the reference and keeps the padded steps; else the next,
    else the incumbent. Qwen3-Next T = 256 on the H200 (2026-11-28) by hand: the wide winner's
    GEMM2 on the incumbent's GEMM1 gave -1.2% full batch and no slower padded steps."""
    import math
    from dataclasses import replace

    tune = _load()
    incumbent = ExpertsConfig(16, GemmTiles(64, 128), GemmTiles(64, 256))
    winner = ExpertsConfig(16, GemmTiles(128, 128, num_stages=3), GemmTiles(128, 128))
    new_gemm2 = replace(winner, gemm1=incumbent.gemm1)
    new_gemm1 = replace(winner, gemm2=incumbent.gemm2)
    assert tune.padded_hybrids(incumbent, winner) == [new_gemm2, new_gemm1]
    assert tune.padded_hybrids(_cfg(32), _cfg(16)) == []  # other M-blocks: no hybrid
    assert tune.padded_hybrids(incumbent, replace(incumbent, gemm2=winner.gemm2)) == []  # nothing new

    def run(full_us, padded_us, errors=None):
        """full_us / padded_us: {config: us} (padded: {(config, num_valid): us})."""
        case = types.SimpleNamespace(name="qwen3next", num_tokens=256, small_source=_cfg(16), fp8=None,
                                     incumbent=incumbent, ranked=[(740.0, winner), (756.0, incumbent)],
                                     replace_margin=tune.REPLACE_MARGIN,
                                     check=lambda cfg: (errors or {}).get(cfg, 0.001))

        def fake_timed(case, cfg, log, sweep, est, small=None, num_valid=None):
            return padded_us[cfg, num_valid] if num_valid is not None else full_us[cfg]

        monkeypatch.setattr(tune, "_timed", fake_timed)
        return tune.padded_steps_hold(case, winner, 740.0, [], math.inf)

    full = {incumbent: 756.0, new_gemm2: 745.0, new_gemm1: 752.0}
    padded = {(incumbent, 8): 129.6, (incumbent, 1): 27.3, (winner, 8): 133.3, (winner, 1): 31.6,
              (new_gemm2, 8): 129.5, (new_gemm2, 1): 26.4, (new_gemm1, 8): 133.0, (new_gemm1, 1): 31.0}
    cfg, us, timings = run(full, padded)
    assert (cfg, us) == (new_gemm2, 745.0)
    assert timings == {"full_batch": {"incumbent": 756.0, "winner": 745.0},
                       "num_valid=8": {"incumbent": 129.6, "winner": 129.5},
                       "num_valid=1": {"incumbent": 27.3, "winner": 26.4}}
    # the first hybrid within the replace margin of the incumbent: the second is tried (and fails
    # its padded steps), so the incumbent stays
    cfg, us, _ = run({**full, new_gemm2: 756.0 * (1 - tune.REPLACE_MARGIN) + 0.1}, padded)
    assert (cfg, us) == (incumbent, 756.0)
    # the second hybrid holds where the first's one-row step does not
    second_holds = {**padded, (new_gemm2, 1): 31.0, (new_gemm1, 8): 129.0, (new_gemm1, 1): 27.0}
    cfg, _, _ = run({**full, new_gemm1: 740.0}, second_holds)
    assert cfg == new_gemm1
    # a hybrid that misses the reference is not kept
    cfg, _, _ = run(full, padded, errors={new_gemm2: 1.0})
    assert cfg == incumbent


def test_padded_trade_allows():
    """The padded steps' loss is bought by a full-batch saving of at least PADDED_TRADE times it,
    with no step slower by more than PADDED_TRADE_MAX: the H200 gpt-oss T = 512 winner (358.7 us
    saved, +1.5 and +5.4 us) passes, Qwen3-Next T = 256's (13.3 saved, +3.8 and +4.3, one row
    +15.6%) and fp8 Qwen3 T = 256's (3.7 saved, +0.8 and +0.8) do not."""
    tune = _load()
    assert (tune.PADDED_TRADE, tune.PADDED_TRADE_MAX) == (10.0, 0.10)

    def steps(eight, one):
        return {"num_valid=8": dict(zip(("incumbent", "winner"), eight, strict=True)),
                "num_valid=1": dict(zip(("incumbent", "winner"), one, strict=True))}

    assert tune.padded_trade_allows(358.7, steps((328.51, 330.05), (62.12, 67.52)))
    assert not tune.padded_trade_allows(13.3, steps((129.56, 133.31), (27.29, 31.56)))
    assert not tune.padded_trade_allows(1000.0, steps((129.56, 133.31), (27.29, 31.56)))  # +15.6%
    assert not tune.padded_trade_allows(3.7, steps((76.50, 77.29), (29.60, 30.38)))
    assert tune.padded_trade_allows(0.0, steps((10.0, 9.0), (5.0, 5.0)))  # nothing lost
    assert not tune.padded_trade_allows(9.9, steps((10.0, 10.5), (5.0, 5.5)))
    assert tune.padded_trade_allows(10.0, steps((10.0, 10.5), (5.0, 5.5)))


def test_dependents_of_an_fp8_bucket_run_on_fp8_weights(monkeypatch):
    """The padded steps of larger buckets that run an fp8 bucket's small-batch tiles are timed on
    the fp8 path (the tuned case's Fp8Weights reach their Case), with the fp8 heuristic where no
    bucket serves a T: before, the fp8 search skipped them."""
    import math

    tune = _load()
    made, fallbacks = [], []

    class FakeCase:
        def __init__(self, name, w13, w2, num_tokens, seed=0, fp8=None, **kwargs):
            made.append((num_tokens, fp8))

    monkeypatch.setattr(tune, "Case", FakeCase)
    monkeypatch.setattr(tune, "_timed", lambda *args, **kwargs: 10.0)
    weights = object()
    dep = tune.Dependent(64, _cfg(32), tune.SMALL_BATCH_TOKENS)
    out = tune.time_dependents("qwen3", None, None, 8, (_cfg(16), _cfg(16)), [dep], {8: _cfg(16)},
                               lambda tokens: _cfg(16), [], math.inf, fp8=weights)
    assert made == [(64, weights)]
    assert out == {f"T=64 num_valid={tune.SMALL_BATCH_TOKENS}": {"incumbent": 10.0, "winner": 10.0}}

    def fake_time(name, w13, w2, bucket, sources, found, table, fallback, log, deadline, fp8=None,
                  small_pin=None):
        fallbacks.append((fp8, fallback(4096)))
        return {"step": {"incumbent": 10.0, "winner": 10.0}}

    monkeypatch.setattr(tune, "time_dependents", fake_time)
    old, new = _cfg(16), ExpertsConfig(16, GemmTiles(64, 128), GemmTiles(64, 64))
    table = {8: old, 64: _cfg(32)}
    case = types.SimpleNamespace(name="qwen3", num_tokens=8, incumbent=old, quant="block", fp8=weights,
                                 ranked=[(70.0, new), (71.0, old)])
    assert tune.check_dependents("qwen3", None, None, case, new, 70.0, table, [], math.inf)[0] == new
    assert fallbacks == [(weights, tune.heuristic_tiles("qwen3", 4096, "block"))]


def _decode_cfg(gemm2_n: int, few: bool = True) -> ExpertsConfig:
    return ExpertsConfig(16, GemmTiles(32, 256, 1, 4, 4), GemmTiles(gemm2_n, 256, 1, 4, 4), pdl=True, few=few)


def test_dependents_are_the_padded_steps_a_source_bucket_serves():
    """Mixtral (K = 2): the T = 8 entry is both the few-slot tiles (few_slots_bucket(2) = 8) and the
    small-batch tiles of every larger bucket, so re-tuning it changes T = 1024's one-row step and
    its 8-row step; Qwen3 (K = 8): the T = 2 entry the few-slot tiles only; DeepSeek-V3's table has
    no T = 2, so its T = 1 entry serves that role (nearest within an octave)."""
    tune = _load()

    def fallback(tokens):
        raise AssertionError(f"every T here has a tuned bucket, asked for {tokens}")

    old, new = _decode_cfg(64), _decode_cfg(16)
    mid, big = _cfg(32, few=True), _cfg(128, few=True)
    table = {1: _decode_cfg(32), 8: old, 64: mid, 1024: big}
    found = tune.dependents(8, 2, (old, new), table, fallback)
    assert sorted((d.bucket, d.num_valid) for d in found) == [(1024, 1), (1024, tune.SMALL_BATCH_TOKENS)]
    assert all(d.config is big for d in found)
    small, few = tune.tiles_with({**table, 8: new}, big, 1024, 2, fallback)
    assert small is new and few is new
    # T = 1024 turned the few-slot path off: its small-batch step, and T = 64's one-row step, depend
    table_off = {**table, 1024: tune.replace(big, few=False)}
    found = tune.dependents(8, 2, (old, new), table_off, fallback)
    assert sorted((d.bucket, d.num_valid) for d in found) == [(64, 1), (1024, tune.SMALL_BATCH_TOKENS)]
    assert tune.tiles_with(table_off, table_off[1024], 1024, 2, fallback)[1] is None
    # a winner that turns the few-slot path off changes the few-slot step too (tiles -> none)
    off = tune.dependents(8, 2, (old, _decode_cfg(64, few=False)), table, fallback)
    assert (1024, 1) in [(d.bucket, d.num_valid) for d in off]
    # Qwen3: T = 2 serves the few-slot tiles, T = 8 the small ones
    qwen = {1: _decode_cfg(32), 2: old, 8: _decode_cfg(128), 64: mid, 1024: big}
    assert [(d.bucket, d.num_valid) for d in tune.dependents(2, 8, (old, new), qwen, fallback)] == [(1024, 1)]
    assert [(d.bucket, d.num_valid) for d in tune.dependents(8, 8, (qwen[8], new), qwen, fallback)] == [
        (1024, tune.SMALL_BATCH_TOKENS)]
    assert tune.dependents(64, 8, (mid, _cfg(64)), qwen, fallback) == []
    # DeepSeek-V3: no T = 2 entry, T = 1 serves it
    deepseek = {1: old, 8: _decode_cfg(128), 64: mid, 1024: big}
    found = tune.dependents(1, 8, (old, new), deepseek, fallback)
    assert [(d.bucket, d.num_valid) for d in found] == [(1024, 1)]
    # nothing changes, nothing depends
    assert tune.dependents(8, 2, (old, old), table, fallback) == []


def test_a_small_batch_pin_takes_the_small_batch_steps_off_the_bucket():
    """With the shape's "small_batch" entry, the larger buckets' small-batch steps run its tiles,
    whatever SMALL_BATCH_TOKENS' bucket holds: re-tuning that bucket changes only the few-slot
    steps it serves (Mixtral, K = 2: T = 8 is also few_slots_bucket(2)), and the run's sources of
    small-batch tiles (the search's, one_launch's plan) are the pin."""
    tune = _load()

    def fallback(tokens):
        raise AssertionError(f"every T here has a tuned bucket, asked for {tokens}")

    old, new, pin = _decode_cfg(64), _decode_cfg(16), _decode_cfg(128)
    big = _cfg(128, few=True)
    table = {1: _decode_cfg(32), 8: old, 64: _cfg(32, few=True), 1024: big}
    small, few = tune.tiles_with({**table, 8: new}, big, 1024, 2, fallback, pin)
    assert small is pin and few is new
    found = tune.dependents(8, 2, (old, new), table, fallback, pin)
    assert [(d.bucket, d.num_valid) for d in found] == [(1024, 1)]
    assert tune.dependents(8, 8, (old, new), table, fallback, pin) == [], "K = 8: T = 8 serves no few step"
    cpu = tune.torch.device("cpu")
    assert tune.small_batch_source("qwen3", {8: new}, cpu, None, pin) is pin
    plan = tune.one_launch_plan({8: new, 1024: big}, old, pin)
    assert plan == {1024: pin}


def test_small_batch_split_rule():
    """A refused winner of SMALL_BATCH_TOKENS' bucket takes it with the incumbent pinned only when
    every slower dependent step is a small-batch step and the shape has no pin yet."""
    tune = _load()
    eight = f"T=1024 num_valid={tune.SMALL_BATCH_TOKENS}"
    one = "T=1024 num_valid=1"
    slower = {"incumbent": 350.43, "winner": 374.76}  # gpt-oss T = 8, H200 2026-12-02
    level = {"incumbent": 60.0, "winner": 60.3}
    bucket = tune.token_bucket(tune.SMALL_BATCH_TOKENS)
    assert tune.small_batch_split(bucket, {eight: slower}, None)
    assert tune.small_batch_split(bucket, {eight: slower, one: level}, None)
    assert not tune.small_batch_split(bucket, {eight: slower, one: slower}, None), "a one-row step slowed"
    assert not tune.small_batch_split(bucket, {one: slower}, None)
    assert not tune.small_batch_split(bucket, {eight: level}, None), "nothing slower: nothing to split"
    assert not tune.small_batch_split(bucket, {eight: slower}, _decode_cfg(64)), "already pinned"
    assert not tune.small_batch_split(bucket, None, None), "not timed"
    assert not tune.small_batch_split(bucket // 2, {eight: slower}, None), "another bucket"


def test_main_pins_the_incumbent_when_a_small_batch_winner_slows_larger_steps(monkeypatch, tmp_path, capsys):
    """gpt-oss T = 8 on the H200 (2026-12-02): the search's winner was faster for the bucket and
    slowed T = 1024's 8-row step. The run writes the winner for T = 8 and the incumbent as the
    shape's "small_batch" entry; a later run with that entry times no small-batch step."""
    tune = _load()
    path = _fake_gpu(monkeypatch, tmp_path, tune)
    key = "E4_H64_I32_K2_bfloat16"
    old, new, newer = _decode_cfg(64), _decode_cfg(16), _decode_cfg(32)
    big = _cfg(128, few=False)
    entries = {"8": old.to_json(), "1024": big.to_json()}
    path.write_text(json.dumps({"notes": "kept", "configs": {key: entries}}))
    table = {8: old, 1024: big}
    pins: dict = {}
    monkeypatch.setattr(tune, "load_device_configs", lambda name: {key: table})
    monkeypatch.setattr(tune, "load_small_batch_configs", lambda name: pins)
    monkeypatch.setattr(tune, "incumbent_config", lambda name, tokens, quant, device: table[tokens])
    winner = {"cfg": new}

    def fake_tune(case, log, deadline):
        case.ranked = [(40.0, winner["cfg"]), (45.0, case.incumbent)]
        return winner["cfg"], 40.0

    timed = []

    def fake_dependents(name, w13, w2, bucket, sources, found, table_, fallback, log, deadline, fp8=None,
                        small_pin=None):
        timed.append(sorted((d.bucket, d.num_valid) for d in found))
        slower = {"incumbent": 350.43, "winner": 374.76}
        return {f"T={d.bucket} num_valid={d.num_valid}": slower for d in found}

    monkeypatch.setattr(tune, "tune_case", fake_tune)
    monkeypatch.setattr(tune, "time_dependents", fake_dependents)
    argv = ["--out", str(tmp_path / "out"), "--shapes", "tiny", "--tokens", "8", "--no-precompile",
            "--no-one-launch", "--no-fused", "--write"]
    assert tune.main(argv) == 0
    assert timed == [[(1024, tune.SMALL_BATCH_TOKENS)]]
    data = json.loads(path.read_text())
    assert ExpertsConfig.from_json(data["configs"][key]["8"]) == new
    assert data["configs"][key]["8"]["us"] == 40.0
    pinned = data["small_batch"][key]
    assert ExpertsConfig.from_json(pinned) == old and "kept for the larger buckets" in pinned["source"]
    assert pinned["dependents_us"] == {f"T=1024 num_valid={tune.SMALL_BATCH_TOKENS}":
                                       {"incumbent": 350.43, "winner": 374.76}}
    assert "its incumbent stays the larger buckets' small-batch tiles" in capsys.readouterr().out
    # the next run: the pin serves the small-batch steps, so a new winner for T = 8 is not checked
    # against them (K = 2: T = 8 also gives T = 1024 its few-slot tiles, off in its entry here)
    pins[key] = old
    table[8], winner["cfg"] = new, newer
    timed.clear()
    assert tune.main(argv) == 0
    assert timed == []
    data = json.loads(path.read_text())
    assert ExpertsConfig.from_json(data["configs"][key]["8"]) == newer
    assert ExpertsConfig.from_json(data["small_batch"][key]) == old, "the pin as it was"


def test_check_dependents_keeps_the_incumbent_when_a_served_step_slows(monkeypatch):
    import torch

    tune = _load()
    monkeypatch.setitem(tune.SHAPES, "tiny", (8, 2, 64, 32))  # (E, K, H, I)
    old, new = _decode_cfg(64), _decode_cfg(16)
    table = {1: _decode_cfg(32), 8: old, 64: _cfg(32), 1024: _cfg(128)}

    class Case:
        name, num_tokens, incumbent, quant, fp8 = "tiny", 8, old, None, None

        def __init__(self):
            self.ranked = [(748.7, new), (751.3, old)]

    step = "T=1024 num_valid=1"
    slower = {step: {"incumbent": 247.4, "winner": 302.5}}
    same = {step: {"incumbent": 247.4, "winner": 248.0}}
    calls = []

    def fake_time(name, w13, w2, bucket, sources, found, table_, fallback, log, deadline, fp8=None,
                  small_pin=None):
        assert fp8 is None  # bf16 weights: the steps run bf16
        calls.append((bucket, sources, sorted((d.bucket, d.num_valid) for d in found)))
        return result

    monkeypatch.setattr(tune, "time_dependents", fake_time)
    w = torch.zeros(1)

    def check(case, cfg, us):
        return tune.check_dependents("tiny", w, w, case, cfg, us, table, [], float("inf"))

    result = slower
    assert check(Case(), new, 748.7) == (old, 751.3, slower)
    assert calls[-1][:2] == (8, (old, new))
    result = same
    assert check(Case(), new, 748.7) == (new, 748.7, same)
    result = None  # out of budget: not verified, the incumbent stays
    assert check(Case(), new, 748.7)[:2] == (old, 751.3)
    calls.clear()
    # the winner is the incumbent, or nothing depends on the bucket: no timing at all
    assert check(Case(), old, 751.3) == (old, 751.3, None)
    case64 = Case()
    case64.num_tokens, case64.incumbent = 64, table[64]
    assert check(case64, _cfg(64), 900.0) == (_cfg(64), 900.0, None)
    assert calls == []
    assert tune.dependents_allow({"a": {"incumbent": 100.0, "winner": 101.0}})
    assert not tune.dependents_allow({"a": {"incumbent": 100.0, "winner": 101.1}})


def test_run_fused_keeps_the_flag_when_a_served_padded_step_slows(monkeypatch):
    """gpt-oss-like (K = 4): T = 4 is few_slots_bucket(4) and has no entry, so T = 8's entry (the
    nearest) gives the larger buckets their few-slot tiles; fusing it moves T = 1024's one-row step
    onto the fused launch. The flip holds only if that step is timed no slower; a bucket no larger
    bucket's step depends on is decided on its own time alone."""
    import torch

    tune = _load()
    monkeypatch.setitem(tune.SHAPES, "tiny4", (8, 4, 64, 32))  # (E, K, H, I)
    monkeypatch.setitem(tune.SHAPES, "tiny8", (8, 8, 64, 32))
    entry = _decode_cfg(64)
    table = {1: tune.replace(_decode_cfg(32), fused=True), 8: entry, 64: _cfg(32, few=True),
             1024: _cfg(128, few=True)}
    med = {"two_launches": 341.1, "fused": 329.8}
    def decide_all(name, w13, w2, buckets, what, decide, fp8=None):
        return {bucket: (True, med) for bucket in buckets}

    monkeypatch.setattr(tune, "decide_per_bucket", decide_all)
    step = "T=1024 num_valid=1"
    calls = []

    def fake_time(name, w13, w2, bucket, sources, found, table_, fallback, log, deadline, fp8=None):
        calls.append((name, bucket, sources, sorted((d.bucket, d.num_valid) for d in found)))
        return result

    monkeypatch.setattr(tune, "time_dependents", fake_time)
    w = torch.zeros(1)

    def run(name="tiny4", configs=None):
        return tune.run_fused(name, w, w, configs or {8: entry}, [], float("inf"), table)

    result = {step: {"incumbent": 63.5, "winner": 77.1}}
    assert run() == {8: (False, {**med, "dependents": result})}
    assert calls == [("tiny4", 8, (entry, tune.replace(entry, fused=True)), [(1024, 1)])]
    result = {step: {"incumbent": 63.5, "winner": 63.6}}
    assert run() == {8: (True, {**med, "dependents": result})}
    result = None  # not timed: the flag stays
    assert run() == {8: (False, med)}
    # K = 8: few_slots_bucket(8) = 2 takes T = 1's entry, so T = 8's flag serves no padded step
    calls.clear()
    assert run("tiny8") == {8: (True, med)}
    assert calls == []
    # a flag already as decided: nothing to check
    fused_entry = tune.replace(entry, fused=True)
    assert run(configs={8: fused_entry}) == {8: (True, med)} and calls == []


def test_a_fused_incumbent_has_its_candidates_searched_fused(monkeypatch):
    """A few-slot bucket whose incumbent is fused times (and precompiles) its tile candidates
    fused: the one launch has one num_stages and one occupancy for both GEMMs, so its best tiles
    need not be the two launches'. Larger buckets and unfused incumbents search as before."""
    tune = _load()
    fused_incumbent = _cfg(16, fused=True)
    assert tune.search_fused(fused_incumbent, 1, 8) and tune.search_fused(fused_incumbent, 2, 8)
    assert tune.search_fused(fused_incumbent, 4, 8), "T*K <= 32: fused"
    assert tune.search_fused(fused_incumbent, 8, 8), "T*K <= 64: fused with the packed tiles"
    assert not tune.search_fused(fused_incumbent, 16, 8), "T*K > 64: never fused"
    assert not tune.search_fused(fused_incumbent, 1, 17), "K > 16: no few-slot path"
    monkeypatch.setenv(tune.SEARCH_FUSED_ENV, "1")  # --search-fused
    assert tune.search_fused(_cfg(16), 4, 8) and tune.search_fused(None, 8, 4)
    assert not tune.search_fused(_cfg(16), 16, 8), "--search-fused: still T*K <= 64 only"
    monkeypatch.delenv(tune.SEARCH_FUSED_ENV)
    assert not tune.search_fused(_cfg(16), 1, 8) and not tune.search_fused(None, 1, 8)
    assert all(c.fused for c in tune.candidate_plan(1, 128, 4, fused=True))
    assert not any(c.fused for c in tune.candidate_plan(1, 128, 4))
    monkeypatch.setitem(tune.SHAPES, "tiny", (4, 2, 64, 32))
    baselines = {("tiny", 1): [fused_incumbent, _cfg(16)], ("tiny", 64): [fused_incumbent, _cfg(16)]}
    tasks = tune.compile_tasks(["tiny"], {"tiny": (1, 64)}, None, baselines)
    fused_of = {}
    for _, num_tokens, configs, _ in tasks:
        for data, _ in configs:
            fused_of.setdefault(num_tokens, set()).add(ExpertsConfig.from_json(data).fused)
    assert fused_of[1] == {True, False}  # the candidates fused, the heuristic baseline not
    assert fused_of[64] == {False}  # candidates unfused (the incumbent was compiled at T = 1)
    timed = []

    class Case:
        name, num_tokens, quant, fp8 = "tiny", 1, None, None
        incumbent, heuristic, replace_margin, ranked = fused_incumbent, None, 0.01, []

        def time(self, cfg, est_us=None, small=None, num_valid=None):
            timed.append(cfg)
            return 10.0

        def check(self, cfg):
            return 0.0

    tune.tune_case(Case(), [], deadline=float("inf"))
    assert timed and all(c.fused for c in timed)
