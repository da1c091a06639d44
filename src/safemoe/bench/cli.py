"""`safemoe bench [--suite a,b] [--shapes x,y] [--out DIR] [--quick]`: measure the device's
ceilings once, run the chosen suites against them, write `<suite>.csv/.json/.png` and
`ceilings.json` under DIR.

With more than one suite each suite runs in its own child process (`--isolate`, the default then):
a suite whose kernels fault cannot take the others down with it, and every child reuses the
parent's ceilings (passed as `--ceilings ceilings.json`), so all suites share one measurement.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from safemoe.bench import SHAPED_SUITES, SUITES, load_suite
from safemoe.cli import (
    Parser,
    UsageError,
    input_file,
    names_list,
    output_dir,
    reports_usage_errors,
    seconds,
    unknown_names_message,
)

if TYPE_CHECKING:
    from safemoe.bench.harness import DeviceCeilings

NO_GPU_MESSAGE = "GPU timings need a CUDA GPU; nothing timed (this machine has no CUDA device)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Time safemoe's ops under CUDA-graph replay against peers and the device's measured ceilings. "
        "Exit status: 1 when a suite failed; 2 for a usage error; 0 otherwise (also on a machine without "
        "CUDA, where nothing is timed)."
    )
    parser.add_argument(
        "--suite",
        default=",".join(SUITES),
        help=f"comma-separated suites to run (default: all of {', '.join(SUITES)})",
    )
    parser.add_argument(
        "--out",
        type=output_dir,
        default=Path("bench-out"),
        help="directory for CSV/JSON/PNG results, created if missing (default: bench-out/)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer shapes and token counts (a smoke run)")
    parser.add_argument(
        "--shapes",
        default=None,
        help="comma-separated model shapes to run, e.g. qwen3-next-80b-a3b (every chosen suite must have "
        f"them: {', '.join(SHAPED_SUITES)} have model shapes; default: each suite's own)",
    )
    parser.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run each suite in its own process (default: when more than one suite)",
    )
    parser.add_argument(
        "--timeout",
        type=seconds(allow_zero=False),
        default=None,
        help="seconds (> 0) allowed per isolated suite before it is stopped (default: none)",
    )
    parser.add_argument(
        "--ceilings",
        type=input_file,
        default=None,
        help="reuse the ceilings in this JSON file (a ceilings.json of an earlier run) "
        "instead of measuring them",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one isolated suite


def _parse_suites(text: str) -> list[str]:
    names = names_list(text)
    if not names:
        raise UsageError("--suite", f"names no suite, got {text!r}; choose from {', '.join(SUITES)}")
    unknown = [name for name in names if name not in SUITES]
    if unknown:
        raise UsageError("--suite", unknown_names_message(unknown, SUITES, "suite(s)"))
    return list(dict.fromkeys(names))


def _parse_shapes(text: str | None, suites: list[str]) -> list[str] | None:
    """The --shapes names, checked against every chosen suite's SHAPES (before anything is timed)."""
    if text is None:
        return None
    names = names_list(text)
    if not names:
        raise UsageError("--shapes", f"names no shape, got {text!r}")
    for suite in suites:
        if suite not in SHAPED_SUITES:
            raise UsageError(
                "--shapes", f"suite {suite!r} has no model shapes to choose; pick from "
                f"{', '.join(SHAPED_SUITES)} with --suite"
            )
        module = load_suite(suite)
        known = list(getattr(module, "SHAPES", {}))
        unknown = [name for name in names if name not in known]
        if unknown:
            raise UsageError("--shapes", unknown_names_message(unknown, known, f"shape(s) of suite {suite}"))
    return list(dict.fromkeys(names))


def _load_ceilings(path: Path) -> DeviceCeilings:
    """The ceilings of an earlier run's ceilings.json; anything else is a usage error."""
    from safemoe.bench.harness import DeviceCeilings

    try:
        return DeviceCeilings.from_dict(json.loads(path.read_text())["ceilings"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        reason = f"{type(error).__name__}: {error}"
        raise UsageError(
            "--ceilings", f"{str(path)!r} is not a ceilings.json of safemoe bench ({reason})"
        ) from None


def _suite_exists(name: str) -> bool:
    return importlib.util.find_spec(SUITES[name]) is not None


def _heading(text: str) -> None:
    try:
        from rich.console import Console
    except ImportError:
        print(f"== {text} ==", flush=True)
        return
    Console().rule(text)


def run_suite(
    name: str, ceilings: DeviceCeilings, out_dir: Path, *, quick: bool, shapes: list[str] | None = None
) -> str:
    """Run one suite in this process; returns its status ('ok', 'not built yet', 'failed: ...').
    shapes: the model shapes to run (a suite of SHAPED_SUITES), default the suite's own."""
    from safemoe.bench.harness import plot_pct_of_floor, write_results

    try:
        module = load_suite(name)
    except Exception as exc:
        traceback.print_exc()
        return f"failed: cannot import {SUITES[name]}: {type(exc).__name__}: {exc}"
    if module is None:
        print(f"suite {name}: not built yet ({SUITES[name]} does not exist)", flush=True)
        return "not built yet"
    try:
        rows = module.run(ceilings, quick=quick, **({"shapes": shapes} if shapes else {}))
        write_results(rows, out_dir, name, ceilings)
        if hasattr(module, "plot"):
            module.plot(rows, out_dir)
        else:
            plot_pct_of_floor(
                rows,
                out_dir / f"{name}.png",
                title=f"safemoe bench {name} on {ceilings.name}",
            )
    except Exception as exc:
        traceback.print_exc()
        return f"failed: {type(exc).__name__}: {str(exc)[:300]}"
    return "ok"


def _run_isolated(name: str, args: argparse.Namespace, ceilings_path: Path) -> str:
    if not _suite_exists(name):
        print(f"suite {name}: not built yet ({SUITES[name]} does not exist)", flush=True)
        return "not built yet"
    command = [
        sys.executable,
        "-m",
        "safemoe.bench.cli",
        "--suite",
        name,
        "--out",
        str(args.out),
        "--ceilings",
        str(ceilings_path),
        "--child",
    ] + (["--quick"] if args.quick else []) + (["--shapes", args.shapes] if args.shapes else [])
    status_file = args.out / f".status_{name}.json"
    status_file.unlink(missing_ok=True)  # a stale one from an earlier run must not speak for this one
    try:
        done = subprocess.run(command, timeout=args.timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"failed: timed out after {args.timeout:.0f} s"
    if status_file.exists():
        return str(json.loads(status_file.read_text())["status"])
    if done.returncode != 0:  # died before reporting (a CUDA fault, a signal)
        return f"failed: suite process exited with {done.returncode}"
    return "ok"


@reports_usage_errors("bench")
def run(args: argparse.Namespace) -> int:
    """Every argument is checked (UsageError) before anything is measured, on every machine."""
    names = _parse_suites(args.suite)
    shapes = _parse_shapes(args.shapes, names)
    given_ceilings = _load_ceilings(Path(args.ceilings)) if args.ceilings is not None else None
    if not torch.cuda.is_available():
        print(NO_GPU_MESSAGE)
        return 0

    from safemoe.bench.harness import measure_ceilings, run_info

    out: Path = args.out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError("--out", f"cannot create {str(out)!r}: {error.strerror or error}") from None
    ceilings_path = out / "ceilings.json"
    if given_ceilings is not None:
        ceilings = given_ceilings
    else:
        _heading("measuring device ceilings")
        ceilings = measure_ceilings()
    if not args.child and not (
        args.ceilings is not None and Path(args.ceilings).resolve() == ceilings_path.resolve()
    ):
        ceilings_path.write_text(
            json.dumps({**run_info(), "ceilings": ceilings.to_dict()}, indent=1, default=str) + "\n"
        )
    if not args.child:
        print(f"ceilings: {ceilings.summary()}", flush=True)

    isolate = not args.child and (args.isolate if args.isolate is not None else len(names) > 1)
    statuses: dict[str, dict[str, object]] = {}
    for index, name in enumerate(names, 1):
        if not args.child:
            _heading(f"suite {name} ({index}/{len(names)})")
        start = time.monotonic()
        if isolate:
            status = _run_isolated(name, args, ceilings_path)
        else:
            status = run_suite(name, ceilings, out, quick=args.quick, shapes=shapes)
            if args.child:  # tell the parent the status ('not built yet' exits 0 too)
                (out / f".status_{name}.json").write_text(json.dumps({"status": status}))
        statuses[name] = {"status": status, "seconds": round(time.monotonic() - start, 1)}

    if not args.child:
        (out / "summary.json").write_text(
            json.dumps({"ceilings": ceilings.to_dict(), "suites": statuses}, indent=1, default=str) + "\n"
        )
        _heading("bench summary")
        for name, entry in statuses.items():
            print(f"  {name:10s} {entry['status']}  ({entry['seconds']} s)")
        print(f"  results in {out.resolve()}")
    return 1 if any(str(e["status"]).startswith("failed") for e in statuses.values()) else 0


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="safemoe bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
