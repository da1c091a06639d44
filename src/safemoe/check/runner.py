"""`safemoe check`: run the registered cases on every backend here, show a table, write JSON."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import safemoe
from safemoe.check.adapters import ADAPTERS, BROKEN, NOT_BUILT, Adapter, make_adapters
from safemoe.check.registry import Case, CaseContext, CheckFailure, select_cases

PASSED, FAILED, UNAVAILABLE = "passed", "failed", "unavailable"
STYLES = {PASSED: "green", FAILED: "bold red", NOT_BUILT: "yellow", UNAVAILABLE: "dim"}


@dataclass
class Result:
    check: str
    backend: str
    status: str  # passed, failed, not built, unavailable
    seconds: float = 0.0
    subcases: int = 0
    message: str = ""
    repro: str = ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run the contract checks (routing on NaN/Inf rows, padding isolation, stale ids, ...) through "
        "the public API on every backend available here. Exits 1 if any check fails."
    )
    parser.add_argument(
        "--backend",
        default="all",
        help=f"comma-separated backends to check: {', '.join(ADAPTERS)} or all (default)",
    )
    parser.add_argument(
        "--only",
        default=None,
        metavar="CHECKS",
        help="comma-separated checks: a name (routing.nan_rows), a family (routing) or a glob",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of every generated input (default 0)")
    parser.add_argument("--quick", action="store_true", help="fewer and smaller sub-cases (CI)")
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where tensors live: cuda if available (auto), else cpu",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="PATH",
        dest="json_path",
        help="also write the results as JSON to PATH",
    )
    parser.add_argument("--list", action="store_true", help="list the checks and exit")


def _device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    return torch.device(choice)


def _split(text: str | None) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def repro_command(args: argparse.Namespace, check: str, backend: str) -> str:
    parts = ["safemoe check", f"--only {check}", f"--seed {args.seed}", f"--backend {backend}"]
    if args.quick:
        parts.append("--quick")
    if args.device != "auto":
        parts.append(f"--device {args.device}")
    return " ".join(parts)


def _where(error: BaseException) -> str:
    """file:line of the innermost frame of what a case raised (the crash site, not the case)."""
    cause = error.__cause__ or error
    frames = traceback.extract_tb(cause.__traceback__)
    if not frames or isinstance(cause, CheckFailure):
        return ""
    frame = frames[-1]
    return f" (at {Path(frame.filename).name}:{frame.lineno})"


def run_case(case: Case, adapter: Adapter, *, seed: int, scale: int) -> Result:
    if not adapter.available:
        return Result(case.name, adapter.name, UNAVAILABLE, message=adapter.reason)
    status = adapter.status_of(case.ops)
    if status.state == NOT_BUILT:
        return Result(case.name, adapter.name, NOT_BUILT, message=status.detail)
    if status.state == BROKEN:
        return Result(case.name, adapter.name, FAILED, message=status.detail)
    ctx = CaseContext(api=adapter, device=adapter.device, seed=seed, scale=scale, case_name=case.name)
    start = time.perf_counter()
    try:
        case.fn(ctx)
    except Exception as error:  # a crash of the backend is a failure like any broken clause
        text = str(error) if isinstance(error, CheckFailure) else f"raised {type(error).__name__}: {error}"
        return Result(
            case.name, adapter.name, FAILED, time.perf_counter() - start, ctx.subcases, text + _where(error)
        )
    return Result(case.name, adapter.name, PASSED, time.perf_counter() - start, ctx.subcases)


def run_checks(
    cases: list[Case], adapters: list[Adapter], *, seed: int, scale: int, console: Console | None = None
) -> list[Result]:
    console = console or Console(stderr=True)
    results = []
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    ) as progress:
        task = progress.add_task("checking", total=len(cases) * len(adapters))
        for case in cases:
            for adapter in adapters:
                progress.update(task, description=f"{adapter.name}: {case.name}")
                results.append(run_case(case, adapter, seed=seed, scale=scale))
                progress.advance(task)
    return results


def _cell(result: Result) -> str:
    style = STYLES[result.status]
    text = result.status.upper() if result.status == FAILED else result.status
    if result.status in (PASSED, FAILED):
        text += f" [dim]{result.seconds:.1f}s[/dim]"
    return f"[{style}]{text}[/{style}]"


def print_report(
    console: Console,
    cases: list[Case],
    adapters: list[Adapter],
    results: list[Result],
    args: argparse.Namespace,
    device: torch.device,
) -> None:
    for adapter in adapters:
        if not adapter.available:
            console.print(f"[dim]{adapter.name}: unavailable here: {escape(adapter.reason)}[/dim]")
            continue
        ops = ", ".join(f"{op} {s.state}" for op, s in adapter.ops.items())
        console.print(f"{adapter.name} on {device}: {escape(ops)}", highlight=False)
    by_key = {(r.check, r.backend): r for r in results}
    table = Table(title=f"safemoe check ({device}, seed {args.seed}{', quick' if args.quick else ''})")
    # The description column only where it fits without wrapping every row into four lines.
    describe = console.width >= 60 + 16 * len(adapters)
    table.add_column("check", no_wrap=True)
    if describe:
        table.add_column("what it checks", style="dim")
    for adapter in adapters:
        table.add_column(adapter.name, no_wrap=True)
    for case in cases:
        cells = [_cell(by_key[(case.name, a.name)]) for a in adapters]
        table.add_row(case.name, *([escape(case.doc)] if describe else []), *cells)
    console.print(table)
    for result in results:
        if result.status == FAILED:
            console.print(
                f"[bold red]FAILED[/bold red] {result.backend} {result.check}: {escape(result.message)}",
                highlight=False,
                soft_wrap=True,
            )
            console.print(f"  repro: {result.repro}", highlight=False, soft_wrap=True)
    counts = {s: sum(r.status == s for r in results) for s in (PASSED, FAILED, NOT_BUILT, UNAVAILABLE)}
    console.print(", ".join(f"{n} {s}" for s, n in counts.items() if n or s in (PASSED, FAILED)))


def write_json(
    path: Path, results: list[Result], adapters: list[Adapter], args: argparse.Namespace, device: torch.device
) -> None:
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    payload = {
        "safemoe_version": safemoe.__version__,
        "torch_version": torch.__version__,
        "triton_version": triton_version,
        "python": platform.python_version(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "seed": args.seed,
        "quick": args.quick,
        "backends": {
            a.name: {
                "available": a.available,
                "reason": a.reason,
                "ops": {op: asdict(s) for op, s in a.ops.items()},
            }
            for a in adapters
        },
        "results": [asdict(r) for r in results],
        "summary": {s: sum(r.status == s for r in results) for s in (PASSED, FAILED, NOT_BUILT, UNAVAILABLE)},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


def run(args: argparse.Namespace) -> int:
    console = Console()
    errors = Console(stderr=True)
    cases = select_cases(_split(args.only))
    if args.list:
        for case in cases:
            console.print(f"{case.name:26} {escape(case.doc)}", highlight=False, soft_wrap=True)
        return 0
    if not cases:
        errors.print(f"safemoe check: no check matches --only {args.only!r}; see safemoe check --list")
        return 2
    names = list(ADAPTERS) if args.backend == "all" else _split(args.backend)
    try:
        device = _device(args.device)
        adapters = make_adapters(names, device)
    except ValueError as error:
        errors.print(f"safemoe check: {error}")
        return 2
    scale = 0 if args.quick else (2 if device.type == "cuda" else 1)
    threads = torch.get_num_threads()
    try:
        if device.type == "cpu":
            # The shapes are tiny; on a busy small machine torch's spinning worker threads made
            # the reference up to 50x slower (12 s instead of 0.2 s for one case on 2 cores).
            torch.set_num_threads(1)
        with warnings.catch_warnings():
            # The Triton interpreter evaluates masked-out lanes too (exp of -FLT_MAX - FLT_MAX,
            # ...) and numpy warns about it; the results are checked, the warnings are noise.
            warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
            results = run_checks(cases, adapters, seed=args.seed, scale=scale, console=errors)
    finally:
        torch.set_num_threads(threads)
    for result in results:
        if result.status == FAILED:
            result.repro = repro_command(args, result.check, result.backend)
    print_report(console, cases, adapters, results, args, device)
    if args.json_path is not None:
        write_json(args.json_path, results, adapters, args, device)
        console.print(f"wrote {args.json_path}")
    sys.stdout.flush()
    return 1 if any(r.status == FAILED for r in results) else 0
