"""The `safemoe` command. Each subcommand lives in its own module, imported only when chosen, that
exposes `add_arguments(parser)` and `run(args) -> int`."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

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


def _versions() -> str:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    return f"safemoe {safemoe.__version__} (torch {torch.__version__}, triton {triton_version})"


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
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
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help, --version, or a usage error (argparse printed it)
        return done.code if isinstance(done.code, int) else 2
    if module is None:
        parser.print_help()
        return 2
    return int(module.run(args))
