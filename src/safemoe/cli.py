"""The `safemoe` command. Each subcommand lives in its own module, imported only when chosen, that
exposes `add_arguments(parser)` and `run(args) -> int`.

Usage errors, the same way for every subcommand: every argument is checked before any work (its
type and range by argparse with the types below, what depends on other arguments or on the machine
by the subcommand, which raises `UsageError`), and a bad one ends in ONE line on stderr,
`safemoe CMD: error: argument --FLAG: what is wrong`, and exit status 2; never a traceback.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib
import math
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import safemoe

# name -> (module, one-line help)
SUBCOMMANDS = {
    "check": ("safemoe.check", "check the routing/padding/NaN contract on every backend available here"),
    "bench": ("safemoe.bench.cli", "time the ops under CUDA-graph replay against peers and physical floors"),
    "demo": ("safemoe.demo", "run a small MoE model end to end with CUDA-graph padding"),
    "soak": ("safemoe.soak", "replay a captured layer with adversarial inputs, count violations"),
}


class NotBuiltError(Exception):
    pass


class UsageError(Exception):
    """A bad command-line argument found after parsing (it depends on other arguments or on the
    machine): `main` prints `safemoe CMD: error: argument FLAG: MESSAGE` and returns 2."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"argument {flag}: {message}")
        self.flag = flag


RunFn = Callable[[argparse.Namespace], int]


def reports_usage_errors(command: str) -> Callable[[RunFn], RunFn]:
    """Decorate a subcommand's `run(args)`: a UsageError it raises is printed as one line on stderr
    (`safemoe COMMAND: error: argument --FLAG: ...`) and `run` returns 2, whoever called it."""

    def wrap(run: RunFn) -> RunFn:
        @functools.wraps(run)
        def wrapped(args: argparse.Namespace) -> int:
            try:
                return run(args)
            except UsageError as error:
                print(f"safemoe {command}: error: {error}", file=sys.stderr)
                return 2

        return wrapped

    return wrap


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error printed as one line (argparse prints the usage block first):
    `safemoe check: error: argument --case: must be an integer >= 0, got '-1'`. Subparsers made by
    `add_subparsers` are of the same class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# -- argument types: each raises ArgumentTypeError, which argparse reports as a usage error naming
# the flag ("argument --steps: must be an integer >= 1, got '0'").
INT64_MAX = 2**63 - 1


def int_in(low: int, high: int = INT64_MAX) -> Callable[[str], int]:
    """An integer in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            bound = f">= {low}" if high == INT64_MAX else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {text!r}")
        return value

    return parse


def shard(text: str) -> tuple[int, int]:
    """K/N with 1 <= K <= N: the K-th of N disjoint parts."""
    parts = text.split("/")
    try:
        k, n = (int(p) for p in parts) if len(parts) == 2 else (0, 0)
    except ValueError:
        k, n = 0, 0
    if not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"must be K/N with 1 <= K <= N (e.g. 2/3), got {text!r}")
    return k, n


def seconds(*, allow_zero: bool) -> Callable[[str], float]:
    """A finite number of seconds, > 0 (or >= 0 with allow_zero)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            raise argparse.ArgumentTypeError(f"must be a finite number of seconds {bound}, got {text!r}")
        return value

    return parse


def _nearest_existing(path: Path) -> Path:
    for parent in (path, *path.parents):
        if parent.exists():
            return parent
    return Path(".")


def _check_creatable(path: Path, what: str) -> None:
    """Raise ArgumentTypeError unless `path` (which does not exist) can be created: its nearest
    existing ancestor is a writable directory."""
    ancestor = _nearest_existing(path)
    if not ancestor.is_dir():
        raise argparse.ArgumentTypeError(
            f"cannot create {what} {str(path)!r}: {str(ancestor)!r} is not a directory"
        )
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(
            f"cannot create {what} {str(path)!r}: directory {str(ancestor)!r} is not writable"
        )


def output_file(text: str) -> Path:
    """A file to write: an existing writable file, or a new one whose directory exists or can be
    created (`prepare_output` creates it, saying so)."""
    if not text:
        raise argparse.ArgumentTypeError("must be a file path, got ''")
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file path")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise argparse.ArgumentTypeError(f"cannot write {text!r}: the file is not writable")
        return path
    _check_creatable(path, "file")
    return path


def output_dir(text: str) -> Path:
    """A directory to write into: an existing writable one, or one that can be created."""
    if not text:
        raise argparse.ArgumentTypeError("must be a directory path, got ''")
    path = Path(text)
    if path.exists():
        if not path.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise argparse.ArgumentTypeError(f"cannot write into {text!r}: the directory is not writable")
        return path
    _check_creatable(path, "directory")
    return path


def input_file(text: str) -> Path:
    """An existing readable file."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"cannot read {text!r}")
    return path


def prepare_output(path: Path, command: str, flag: str) -> None:
    """Create the missing parent directories of an output file, with a line on stderr saying so
    (the path was checked by `output_file`); an OSError is a usage error."""
    parent = path.parent
    if parent.exists():
        return
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        reason = error.strerror or str(error)
        raise UsageError(flag, f"cannot create directory {str(parent)!r}: {reason}") from None
    print(f"safemoe {command}: created directory {parent} for {flag}", file=sys.stderr)


def names_list(text: str) -> list[str]:
    """Comma-separated names, blanks dropped."""
    return [part.strip() for part in text.split(",") if part.strip()]


def unknown_names_message(unknown: Sequence[str], known: Iterable[str], what: str, *, see: str = "") -> str:
    """"unknown check(s) 'routing.nan_row' (did you mean 'routing.nan_rows'?); known: ..." (or
    "; see SEE" instead of the list of known names when `see` is given)."""
    known = list(known)
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        hints.append(f"{name!r}" + (f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""))
    tail = f"see {see}" if see else f"known: {', '.join(known)}"
    return f"unknown {what} {', '.join(hints)}; {tail}"


def _versions() -> str:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    return f"safemoe {safemoe.__version__} (torch {torch.__version__}, triton {triton_version})"


def build_parser() -> tuple[Parser, dict[str, Parser]]:
    parser = Parser(
        prog="safemoe",
        description="Mixture-of-Experts kernels that never crash and never leak NaN under CUDA-graph "
        "padding.",
    )
    parser.add_argument("--version", action="version", version=_versions())
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers = {
        name: commands.add_parser(name, help=text, description=text)
        for name, (_, text) in SUBCOMMANDS.items()
    }
    return parser, subparsers


def load(command: str) -> ModuleType:
    """Import a subcommand's module; NotBuiltError when it (or its package) does not exist yet."""
    module_name = SUBCOMMANDS[command][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and module_name.startswith(error.name):
            raise NotBuiltError(
                f"safemoe {command} is not built yet ({module_name} does not exist)"
            ) from None
        raise
    if not (hasattr(module, "add_arguments") and hasattr(module, "run")):
        raise NotBuiltError(f"safemoe {command} is not built yet ({module_name} has no add_arguments/run)")
    return module


def _chosen(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line (the first word that is not an option)."""
    first = next((word for word in argv if not word.startswith("-")), None)
    return first if first in SUBCOMMANDS else None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, subparsers = build_parser()
    command = _chosen(argv)
    module = None
    if command is not None:
        try:
            module = load(command)
        except NotBuiltError as error:
            print(f"safemoe: {error}", file=sys.stderr)
            return 2
        module.add_arguments(subparsers[command])
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # named by the subcommand's parser, which knows the flags that were meant
            subparsers.get(command or "", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as done:  # --help, --version, or a usage error (argparse printed it)
        return done.code if isinstance(done.code, int) else 2
    if module is None:
        parser.print_help()
        return 2
    try:
        return int(module.run(args))
    except UsageError as error:
        print(f"safemoe {command}: error: {error}", file=sys.stderr)
        return 2
