"""scripts/check_coverage.py: split check runs joined against the matrix they belong to."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import torch

from helpers import load_script
from safemoe.check.registry import select_cases

coverage = load_script("check_coverage")


def _run(path: Path, results: list[dict], memcheck: dict | None = None, scale: int = 0) -> Path:
    path.write_text(json.dumps({"scale": scale, "device": "cpu", "device_name": "x",
                                "command": "safemoe check", "families": ["dispatch"], "results": results,
                                "memcheck": memcheck or {}}))
    return path


def _result(check: str, case: int, status: str = "passed", backend: str = "triton") -> dict:
    return {"check": check, "backend": backend, "case": case, "status": status}


def test_joins_split_runs_and_counts_gaps(tmp_path: Path, capsys) -> None:
    case = select_cases(["dispatch.duplicates"])[0]
    size = len(case.grid(0, torch.device("cpu")))
    assert size >= 3
    first = _run(tmp_path / "a.json", [_result(case.name, 0), _result(case.name, 1, "not run")],
                 memcheck={"triton": {"errors": 0, "processes": 2}})
    second = _run(tmp_path / "b.json", [_result(case.name, 1), _result(case.name, 0)])
    md, merged = tmp_path / "cov.md", tmp_path / "m.json.gz"
    only = ["--families", "dispatch.duplicates", "--backends", "triton"]
    code = coverage.main([str(first), str(second), *only, "--markdown", str(md), "--merged", str(merged)])
    assert code == 0
    row = next(line for line in md.read_text().splitlines() if line.startswith("| dispatch | triton"))
    assert row == f"| dispatch | triton | 2 | 0 | 0 | 0 | {size - 2} |"
    assert "triton 0 errors in 2 process summaries" in md.read_text()
    with gzip.open(merged, "rt") as handle:
        assert len(json.load(handle)["results"]) == 2
    # The joined file is an input too: joined with a third run, it counts as the runs it came from.
    third = _run(tmp_path / "c.json", [_result(case.name, 2)],
                 memcheck={"triton": {"errors": 0, "processes": 1}})
    code = coverage.main([str(merged), str(third), *only, "--markdown", str(md)])
    assert code == 0
    row = next(line for line in md.read_text().splitlines() if line.startswith("| dispatch | triton"))
    assert row == f"| dispatch | triton | 3 | 0 | 0 | 0 | {size - 3} |"
    assert "Runs joined: 3" in md.read_text() and "triton 0 errors in 3 process summaries" in md.read_text()


def test_a_failure_in_any_run_wins_and_fails(tmp_path: Path) -> None:
    case = select_cases(["dispatch.duplicates"])[0]
    passed = _run(tmp_path / "a.json", [_result(case.name, 0)])
    failed = _run(tmp_path / "b.json", [_result(case.name, 0, "failed")])
    only = ["--families", "dispatch.duplicates", "--backends", "triton"]
    assert coverage.main([str(passed), str(failed), *only]) == 1
    errors = _run(tmp_path / "c.json", [_result(case.name, 0)],
                  memcheck={"triton": {"errors": 3, "processes": 1}})
    assert coverage.main([str(errors), *only]) == 1


def test_refuses_mixed_scales(tmp_path: Path) -> None:
    import pytest

    a = _run(tmp_path / "a.json", [], scale=0)
    b = _run(tmp_path / "b.json", [], scale=2)
    with pytest.raises(SystemExit, match="mix matrix scales"):
        coverage.main([str(a), str(b)])
