"""scripts/bench_compare.py: joining old and new bench rows by key, medians over rounds, verdicts."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_compare.py"
_spec = importlib.util.spec_from_file_location("bench_compare", SCRIPT)
assert _spec is not None and _spec.loader is not None
bench_compare = importlib.util.module_from_spec(_spec)
sys.modules["bench_compare"] = bench_compare  # dataclasses resolve annotations through it
_spec.loader.exec_module(bench_compare)


def _row(impl: str, us: float | None, *, suite: str = "router", case: str = "qwen3", tokens: int = 64,
         variant: str = "clean") -> dict[str, Any]:
    return {"suite": suite, "case": case, "tokens": tokens, "variant": variant, "impl": impl,
            "median_us": us, "floor_us": 1.0, "note": "", "extra": {}, "pct_of_floor": None}


def _write(path: Path, rows: list[dict[str, Any]], suite: str = "router") -> Path:
    payload = {"suite": suite, "date": "2026-11-21T00:00:00+00:00", "torch": "2.13", "triton": "3.9",
               "device": "Test GPU", "ceilings": {}, "rows": rows}
    path.write_text(json.dumps(payload))
    return path


def _points(tmp_path: Path, *pairs: tuple[list[dict[str, Any]], list[dict[str, Any]]]) -> dict[tuple, Any]:
    loaded = []
    for i, (old, new) in enumerate(pairs):
        _, old_rows = bench_compare.load_rows(_write(tmp_path / f"old{i}.json", old))
        _, new_rows = bench_compare.load_rows(_write(tmp_path / f"new{i}.json", new))
        loaded.append((old_rows, new_rows))
    return {p.key: p for p in bench_compare.join(loaded)}


def test_verdicts_judge_safemoe_rows_only(tmp_path: Path) -> None:
    old = [_row("safemoe", 10.0), _row("safemoe+health", 10.0), _row("safemoe-unsafe", 10.0),
           _row("torch-eager", 10.0), _row("vllm", None), _row("safemoe", 10.0, tokens=8)]
    new = [_row("safemoe", 10.19), _row("safemoe+health", 10.3), _row("safemoe-unsafe", 9.7),
           _row("torch-eager", 13.0), _row("vllm", None), _row("safemoe", 10.0, tokens=1)]
    points = _points(tmp_path, (old, new))
    verdict = {key[4] + f"@{key[2]}": p.verdict(0.02) for key, p in points.items()}
    assert verdict == {
        "safemoe@64": "ok",  # +1.9%
        "safemoe+health@64": "slower",  # +3%
        "safemoe-unsafe@64": "faster",  # -3%
        "torch-eager@64": "peer (slower)",  # a peer: shown, not judged
        "vllm@64": "peer (no time)",
        "safemoe@8": "only in old",
        "safemoe@1": "only in new",
    }
    key = ("router", "qwen3", 64, "clean", "safemoe")
    assert points[key].ratio == pytest.approx(1.019)
    summary = bench_compare.summarise(list(points.values()), 0.02)
    assert (summary.judged, summary.within, summary.slower, summary.faster) == (3, 1, 1, 1)
    assert summary.worst.key[4] == "safemoe+health" and summary.peers == 2 and summary.untimed == 2


def test_rows_join_by_their_whole_key(tmp_path: Path) -> None:
    """Same impl in another suite, case, T or variant is another point; order follows the new file."""
    old = [_row("safemoe", 5.0, variant="nan10"), _row("safemoe", 4.0),
           _row("safemoe-triton", 50.0, suite="experts", case="qwen3", tokens=64, variant="experts")]
    new = [_row("safemoe", 4.0), _row("safemoe", 5.0, variant="nan10"),
           _row("safemoe-triton", 50.0, suite="experts", case="qwen3", tokens=64, variant="experts")]
    points = _points(tmp_path, (old, new))
    assert [k[3] for k in points][:2] == ["clean", "nan10"]
    assert all(p.ratio == pytest.approx(1.0) and p.verdict(0.02) == "ok" for p in points.values())
    assert len(points) == 3


def test_rounds_take_the_median_of_each_side(tmp_path: Path) -> None:
    rounds = [([_row("safemoe", us_old)], [_row("safemoe", us_new)])
              for us_old, us_new in ((10.0, 10.0), (10.4, 13.0), (9.9, 10.1))]
    point = next(iter(_points(tmp_path, *rounds).values()))
    assert (point.old_us, point.new_us) == (10.0, 10.1)  # one noisy round does not decide
    assert point.verdict(0.02) == "ok"
    assert point.spread() == pytest.approx(3.0 / 10.1)


def test_duplicate_keys_are_kept_apart(tmp_path: Path) -> None:
    path = _write(tmp_path / "d.json", [_row("safemoe", 1.0), _row("safemoe", 2.0)])
    _, rows = bench_compare.load_rows(path)
    assert list(rows.values()) == [1.0, 2.0] and list(rows)[1][4] == "safemoe#2"


def test_cli_prints_the_table_and_fails_on_a_slower_point(tmp_path: Path) -> None:
    old = _write(tmp_path / "old.json", [_row("safemoe", 10.0), _row("torch-eager", 10.0)])
    same = _write(tmp_path / "same.json", [_row("safemoe", 10.1), _row("torch-eager", 20.0)])
    slower = _write(tmp_path / "slow.json", [_row("safemoe", 10.5), _row("torch-eager", 10.0)])

    def run(*files: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(SCRIPT), "--old-label", "abc", "--new-label", "def",
                               *map(str, files)], capture_output=True, text=True, check=False)

    done = run(old, same)
    assert done.returncode == 0, done.stderr
    table = [line for line in done.stdout.splitlines() if line.startswith("| router")]
    assert table == [
        "| router | qwen3 | 64 | clean | safemoe | 10.00 | 10.10 | 1.010 | ok |",
        "| router | qwen3 | 64 | clean | torch-eager | 10.00 | 20.00 | 2.000 | peer (slower) |",
    ]
    assert "abc (old) vs def (new)" in done.stdout
    assert "1 safemoe points, 1 within 2% (0 slower, 0 faster); worst new/old 1.010" in done.stdout
    done = run(old, slower)
    assert done.returncode == 1 and "| safemoe | 10.00 | 10.50 | 1.050 | slower |" in done.stdout
    assert run(old).returncode == 2  # files come in pairs


def test_committed_results_compare_with_themselves() -> None:
    """The real H200 outputs: every point joins, every safemoe point is `ok` against itself."""
    results = REPO / "bench" / "results"
    files = [results / f"{suite}_NVIDIA-H200_2026-11-21.json" for suite in ("router", "experts")]
    pairs = []
    for path in files:
        _, rows = bench_compare.load_rows(path)
        pairs.append((rows, dict(rows)))
    points = bench_compare.join(pairs)
    summary = bench_compare.summarise(points, 0.02)
    assert summary.judged == summary.within > 500 and summary.slower == summary.faster == 0
    assert summary.peers > 0 and summary.worst is not None and summary.worst.ratio == 1.0
