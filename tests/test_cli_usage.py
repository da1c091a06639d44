"""Every flag of every subcommand (check, bench, demo) with a bad value: exit status 2, ONE line on
stderr that names the flag, nothing on stdout (no work was done), no traceback. Run through
`safemoe.cli.main` in this process (fast), and the issue's own examples once more through
`python -m safemoe` in a subprocess. Also: what a good run around those flags does (a missing
--json directory is created with a line saying so)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from safemoe import cli

CUDA = torch.cuda.is_available()


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    """Paths the bad invocations point at: a plain file, a directory, bad JSON files."""
    plain = tmp_path / "f"
    plain.write_text("not a directory\n")
    bad_plugin = tmp_path / "bad_plugin.py"
    bad_plugin.write_text("raise RuntimeError('plugin fails')\n")
    configs = {
        "syntax.json": "{bad",
        "list.json": "[1, 2]",
        "zero.json": json.dumps({"hidden_size": 0}),
        "topk.json": json.dumps({"num_experts": 4, "num_experts_per_tok": 8}),
        "noceil.json": json.dumps({"name": "x"}),
    }
    for name, text in configs.items():
        (tmp_path / name).write_text(text)
    paths = {name.replace(".", "_"): str(tmp_path / name) for name in configs}
    return {
        **paths,
        "file": str(plain),
        "under_file": str(plain / "x.json"),
        "dir": str(tmp_path),
        "missing": str(tmp_path / "nosuch.json"),
        "missing_py": str(tmp_path / "nosuch.py"),
        "bad_plugin": str(bad_plugin),
    }


# (argv with {placeholders} from `files`, the flag the message must name, more text it must hold)
CHECK = [
    (["--only", "routing.nan_rows", "--case", "99", "--scale", "cpu"], "--case", "routing.nan_rows has"),
    (["--only", "routing.nan_rows", "--case", "-1"], "--case", ">= 0"),
    (["--case", "two"], "--case", ""),
    (["--only", "routing", "--case", "9999"], "--case", "out of range"),
    (["--list", "--case", "9999"], "--case", "out of range"),
    (["--only", "routing.health,nonexistent"], "--only", "'nonexistent'"),
    (["--only", "routing.nan_row"], "--only", "did you mean 'routing.nan_rows'"),
    (["--only", "nosuchfamily.*"], "--only", "unknown check"),
    (["--only", ""], "--only", "names no check"),
    (["--only", " , "], "--only", "names no check"),
    (["--json", "{under_file}"], "--json", "is not a directory"),
    (["--json", "{dir}"], "--json", "is a directory"),
    (["--json", ""], "--json", ""),
    (["--max-time", "-5"], "--max-time", ">= 0"),
    (["--max-time", "inf"], "--max-time", "finite"),
    (["--max-time", "soon"], "--max-time", ""),
    (["--shard", "0/3"], "--shard", "1 <= K <= N"),
    (["--shard", "4/3"], "--shard", "1 <= K <= N"),
    (["--shard", "2"], "--shard", "K/N"),
    (["--shard", "a/b"], "--shard", "K/N"),
    (["--timeout", "0"], "--timeout", "> 0"),
    (["--timeout", "-1"], "--timeout", "> 0"),
    (["--timeout", "nan"], "--timeout", "finite"),
    (["--jobs", "-1"], "--jobs", ">= 0"),
    (["--jobs", "many"], "--jobs", ""),
    (["--seed", "-1"], "--seed", ">= 0"),
    (["--seed", "1.5"], "--seed", ""),
    (["--seed", str(2**64)], "--seed", ""),
    (["--backend", "cutlass"], "--backend", "known: safemoe"),
    (["--backend", "refernce"], "--backend", "did you mean 'reference'"),
    (["--backend", "none"], "--backend", "chooses no backend"),
    (["--backend", ""], "--backend", "chooses no backend"),
    (["--peers", "torc"], "--peers", "did you mean 'torch'"),
    (["--peers", "torch,vlm"], "--peers", "'vlm'"),
    (["--device", "gpu"], "--device", "invalid choice"),
    (["--plugin", "{missing_py}"], "--plugin", "nosuch.py"),
    (["--plugin", "no_such_plugin_module"], "--plugin", "No module named"),
    (["--plugin", "{bad_plugin}"], "--plugin", "plugin fails"),
    (["--scale", "huge"], "--scale", "invalid choice"),
    (["--max-crashes", "0"], "--max-crashes", ">= 1"),
    (["--quick=yes"], "--quick", "ignored explicit argument"),
    (["--list=1"], "--list", "ignored explicit argument"),
    (["--bogus"], "--bogus", "unrecognized arguments"),
    (["routing"], "routing", "unrecognized arguments"),
]
if not CUDA:
    CHECK += [
        (["--device", "cuda"], "--device", "no CUDA device"),
        (["--sanitizer", "--only", "routing.health"], "--sanitizer", "needs CUDA"),
    ]

BENCH = [
    (["--suite", "nope"], "--suite", "known: router"),
    (["--suite", "routr,experts"], "--suite", "did you mean 'router'"),
    (["--suite", ""], "--suite", "names no suite"),
    (["--suite", "layer", "--shapes", ""], "--shapes", "names no shape"),
    (["--suite", "layer", "--shapes", "qwen3-next-80b"], "--shapes", "did you mean 'qwen3-next-80b-a3b'"),
    (["--suite", "layer,experts", "--shapes", "qwen3-next-80b-a3b"], "--shapes", "of suite experts"),
    (["--shapes", "qwen3-30b-a3b"], "--shapes", "suite 'router' has no model shapes"),
    (["--out", "{file}"], "--out", "not a directory"),
    (["--out", "{under_file}"], "--out", "is not a directory"),
    (["--out", ""], "--out", ""),
    (["--timeout", "-1"], "--timeout", "> 0"),
    (["--timeout", "0"], "--timeout", "> 0"),
    (["--ceilings", "{missing}"], "--ceilings", "no such file"),
    (["--ceilings", "{dir}"], "--ceilings", "is not a file"),
    (["--ceilings", "{syntax_json}"], "--ceilings", "JSONDecodeError"),
    (["--ceilings", "{noceil_json}"], "--ceilings", "not a ceilings.json"),
    (["--ceilings", "{list_json}"], "--ceilings", "not a ceilings.json"),
    (["--isolate=1"], "--isolate", "ignored explicit argument"),
    (["--quick=1"], "--quick", "ignored explicit argument"),
    (["--bogus"], "--bogus", "unrecognized arguments"),
]

DEMO = [
    (["--device", "tpu"], "--device", "invalid choice"),
    (["--layers", "-1"], "--layers", ">= 1"),
    (["--layers", "0"], "--layers", ">= 1"),
    (["--steps", "-3"], "--steps", ">= 1"),
    (["--steps", "0"], "--steps", ">= 1"),
    (["--steps", "x"], "--steps", ""),
    (["--max-batch", "0"], "--max-batch", ">= 1"),
    (["--max-batch", "-8"], "--max-batch", ">= 1"),
    (["--seed", "-1"], "--seed", ">= 0"),
    (["--json", "{under_file}"], "--json", "is not a directory"),
    (["--json", "{dir}"], "--json", "is a directory"),
    (["--quick=1"], "--quick", "ignored explicit argument"),
    (["--bogus"], "--bogus", "unrecognized arguments"),
]
# These are checked once transformers (the demo's model) is known to be there.
DEMO_CONFIG = [
    (["--config", "{missing}"], "--config", "does not exist"),
    (["--config", "tinyy"], "--config", "does not exist; give tiny, gpu"),
    (["--config", "{dir}"], "--config", "is not a file"),
    (["--config", "{syntax_json}"], "--config", "JSONDecodeError"),
    (["--config", "{list_json}"], "--config", "not a Qwen3-MoE config"),
    (["--config", "{zero_json}"], "--config", "hidden_size=0"),
    (["--config", "{topk_json}"], "--config", "num_experts_per_tok=8 > num_experts=4"),
]
if not CUDA:
    DEMO_CONFIG += [(["--device", "cuda"], "--device", "no CUDA device")]


def assert_usage_error(
    capsys: pytest.CaptureFixture[str], command: str, argv: list[str], flag: str, text: str
) -> str:
    code = cli.main([command, *argv])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, captured.out + captured.err
    assert captured.out == "", f"work was done before the usage error:\n{captured.out}"
    assert len(lines) == 1, captured.err
    line = lines[0]
    assert line.startswith(f"safemoe {command}: error: "), line
    assert flag in line and text in line, line
    assert "Traceback" not in captured.err
    return line


def _fill(argv: list[str], files: dict[str, str]) -> list[str]:
    return [word.format(**files) if "{" in word else word for word in argv]


def _id(case: tuple[list[str], str, str]) -> str:
    return " ".join(case[0])[:60]


@pytest.mark.parametrize(("argv", "flag", "text"), CHECK, ids=[_id(c) for c in CHECK])
def test_check_usage_errors(capsys, files, argv, flag, text) -> None:
    assert_usage_error(capsys, "check", _fill(argv, files), flag, text)


@pytest.mark.parametrize(("argv", "flag", "text"), BENCH, ids=[_id(c) for c in BENCH])
def test_bench_usage_errors(capsys, files, argv, flag, text) -> None:
    assert_usage_error(capsys, "bench", _fill(argv, files), flag, text)


@pytest.mark.parametrize(("argv", "flag", "text"), DEMO, ids=[_id(c) for c in DEMO])
def test_demo_usage_errors(capsys, files, argv, flag, text) -> None:
    assert_usage_error(capsys, "demo", _fill(argv, files), flag, text)


@pytest.mark.parametrize(("argv", "flag", "text"), DEMO_CONFIG, ids=[_id(c) for c in DEMO_CONFIG])
def test_demo_config_and_device_errors(capsys, files, argv, flag, text) -> None:
    pytest.importorskip("transformers")
    assert_usage_error(capsys, "demo", _fill(argv, files), flag, text)


def test_top_level_usage_errors(capsys) -> None:
    for argv, text in ((["nosuch"], "invalid choice: 'nosuch'"), (["--bogus"], "--bogus")):
        code = cli.main(argv)
        captured = capsys.readouterr()
        assert code == 2 and captured.out == ""
        assert captured.err.strip().startswith("safemoe: error: ") and text in captured.err
        assert len(captured.err.strip().splitlines()) == 1


def test_check_json_dir_created_with_a_line(capsys, tmp_path: Path) -> None:
    """A missing parent directory of --json is created before the run, with a line saying so."""
    out_json = tmp_path / "new" / "deeper" / "check.json"
    code = cli.main(
        ["check", "--only", "routing.health", "--case", "0", "--backend", "reference", "--peers", "none",
         "--quick", "--jobs", "0", "--device", "cpu", "--json", str(out_json)]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    assert f"safemoe check: created directory {out_json.parent} for --json" in captured.err
    assert json.loads(out_json.read_text())["summary"]["passed"] == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_unwritable_paths_are_usage_errors(capsys, tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        assert_usage_error(capsys, "check", ["--json", str(locked / "x.json")], "--json", "not writable")
        assert_usage_error(capsys, "bench", ["--out", str(locked / "o")], "--out", "not writable")
    finally:
        locked.chmod(0o755)


def test_run_functions_report_usage_errors_themselves(capsys) -> None:
    """`safemoe.check.run(args)` called directly (not through the command) answers a usage error
    the same way: one line, status 2."""
    import argparse

    from safemoe import check

    parser = argparse.ArgumentParser()
    check.add_arguments(parser)
    assert check.run(parser.parse_args(["--only", "nonexistent"])) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("safemoe check: error: argument --only:") and len(err.splitlines()) == 1


# The issue's own examples, end to end: a new interpreter, as a user runs them.
SUBPROCESS = [
    (["check", "--only", "routing.nan_rows", "--case", "99", "--scale", "cpu"], "--case"),
    (["check", "--only", "routing.health,nonexistent"], "--only"),
    (["check", "--json", "{under_file}"], "--json"),
    (["check", "--max-time", "-5"], "--max-time"),
    (["demo", "--config", "{missing}"], "--config"),
    (["demo", "--layers", "-1"], "--layers"),
    (["demo", "--steps", "-3"], "--steps"),
    (["bench", "--suite", "nope"], "--suite"),
]
if not CUDA:
    SUBPROCESS.append((["demo", "--device", "cuda"], "--device"))


@pytest.mark.parametrize(("argv", "flag"), SUBPROCESS, ids=[" ".join(a)[:50] for a, _ in SUBPROCESS])
def test_issue_examples_in_a_subprocess(files, argv, flag) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "safemoe", *_fill(argv, files)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"argument {flag}" in lines[0], done.stderr
    assert done.stdout == "" and "Traceback" not in done.stderr
