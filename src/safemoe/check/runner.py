"""`safemoe check`: the fault-injection matrix on every backend here, crash-isolated; a table
backend x family, failure details with one-line repros, JSON, and an exit status for the chosen
backends (default: safemoe's own). Peers are run side by side and reported honestly; their
failures do not fail the command."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import os
import platform
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import safemoe
from safemoe.check import adapters as adapters_module
from safemoe.check.adapters import SAFEMOE_BACKENDS, Adapter, make_adapters
from safemoe.check.pool import Job, Pool, PoolOptions, SanitizerReport, run_in_process, sanitizer_command
from safemoe.check.registry import FAMILIES, Case, all_cases, label, select_cases
from safemoe.check.worker import (
    CRASHED,
    FAILED,
    NA,
    PASSED,
    STATUSES,
    CaseResult,
    Runner,
    WorkerConfig,
    indexed_device,
    load_plugin,
    setup,
    static_status,
)
from safemoe.cli import (
    UsageError,
    input_file,
    int_in,
    names_list,
    output_file,
    prepare_output,
    reports_usage_errors,
    seconds,
    shard,
    unknown_names_message,
)

SCALES = {"quick": 0, "cpu": 1, "cuda": 2}
SCHEMA = "safemoe-check/2"
# Examples printed per (backend, check) with failures: all a chosen backend has (up to this), one
# for a peer (everything is in --json).
CHOSEN_EXAMPLES, PEER_EXAMPLES = 5, 1
# Cases per job: small chunks spread the Triton compiles over the workers; under the sanitizer a
# process costs seconds to start, so more per job.
JOB_CASES = {"cpu": 12, "cpu_triton": 6, "cuda": 40}
SANITIZER_JOB = 60
# Relative cost of a case, by family and backend (from the H200 run of 2026-11-21: boundaries and
# e2e cases take 5-10x a routing case; Triton's include its compiles): jobs are cut smaller for
# costly families and the costliest start first, so no long job is left for the end.
FAMILY_COST = {
    "routing": 1.0,
    "padding": 2.0,
    "dispatch": 2.0,
    "buffers": 2.0,
    "graphs": 3.0,
    "e2e": 5.0,
    "boundaries": 8.0,
    "fp8": 2.0,
    "ep": 20.0,  # each case spawns a process group: ~3-7 s on 2 CPU cores, whatever its size
}
BACKEND_COST = {"triton": 2.0, "reference": 1.5}
PROGRESS_LINE_S = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "The fault-injection matrix: routing contract, padding isolation, dispatch robustness, token-count "
        "boundaries, buffer hygiene, CUDA graphs, end-to-end layers, fp8 experts and expert parallelism, on "
        "safemoe's backends and every peer "
        "implementation installed here, each case group in a crash-isolated worker process. Exit status: 1 "
        "when a chosen backend (--backend, default safemoe's reference and triton) failed or crashed, had "
        "memcheck errors, or had cases left unrun by --max-time; 2 for a usage error; 0 otherwise. Peers "
        "(--peers) are shown for comparison and never change the exit status."
    )
    parser.add_argument(
        "--backend",
        default="safemoe",
        help="the chosen backends, whose failures set the exit status: safemoe (reference,triton; default), "
        "all, or comma-separated names",
    )
    parser.add_argument(
        "--peers",
        default="all",
        help="other backends run side by side for comparison: all (default: every registered one), none, or "
        "comma-separated names (torch, hf-eager, hf-grouped_mm, hf-batched_mm, vllm, sglang, flashinfer)",
    )
    parser.add_argument(
        "--only",
        default=None,
        metavar="CHECKS",
        help="comma-separated checks: a name (routing.nan_rows), a family (routing) or a glob",
    )
    parser.add_argument(
        "--case",
        type=int_in(0),
        default=None,
        metavar="INDEX",
        help="run only this case of each selected check (an index every one of them has; see --list)",
    )
    parser.add_argument(
        "--seed", type=int_in(0), default=0, help="seed of every generated input, >= 0 (default 0)"
    )
    parser.add_argument("--quick", action="store_true", help="the small matrix (CI)")
    parser.add_argument(
        "--scale",
        choices=tuple(SCALES),
        default=None,
        help="matrix size: quick (= --quick), cpu or cuda (default: cuda on a GPU, else cpu; cpu with "
        "--sanitizer, where --scale cuda runs the full CUDA matrix under memcheck)",
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where tensors live: cuda if available (auto), else cpu",
    )
    parser.add_argument(
        "--jobs",
        type=int_in(0),
        default=None,
        metavar="N",
        help="worker processes (default: up to 14 on CUDA, one per core on CPU); 0 runs every case in this "
        "process, without crash isolation (for debugging a repro)",
    )
    parser.add_argument(
        "--timeout",
        type=seconds(allow_zero=False),
        default=None,
        metavar="SECONDS",
        help="a case running longer is recorded as crashed (default 300 on CUDA, 600 on CPU, 4x that with "
        "--sanitizer)",
    )
    parser.add_argument(
        "--sanitizer",
        action="store_true",
        help="run every case group under compute-sanitizer memcheck (PYTORCH_NO_CUDA_MEMORY_CACHING=1 except "
        "for CUDA graphs) and report its errors per backend; CUDA only; the CPU-sized matrix",
    )
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="FILE_OR_MODULE",
        help="import this file or module first: it may register backends "
        "(safemoe.check.adapters.register_backend) and checks (safemoe.check.registry.case)",
    )
    parser.add_argument("--max-crashes", type=int_in(1), default=3, help=argparse.SUPPRESS)
    parser.add_argument(
        "--max-time",
        type=seconds(allow_zero=True),
        default=None,
        metavar="SECONDS",
        help="start no case after this long (>= 0); cases left are reported as not run, and the exit status "
        "is 1 if a chosen backend's were among them",
    )
    parser.add_argument(
        "--shard",
        type=shard,
        default=None,
        metavar="K/N",
        help="run the K-th of N disjoint parts of the selected matrix (case i of each check where "
        "i mod N = K-1), so runs 1/N..N/N together cover it once: a long matrix split over calls",
    )
    parser.add_argument(
        "--resume",
        type=input_file,
        default=None,
        metavar="PATH",
        help="skip every case that this earlier --json file (or scripts/check_coverage.py --merged file) "
        "records as run, so a split or cut-short run goes on where it stopped; same seed and scale",
    )
    parser.add_argument(
        "--json",
        type=output_file,
        default=None,
        metavar="PATH",
        dest="json_path",
        help="also write every case's result as JSON to PATH (checked before the run; a missing parent "
        "directory is created, with a line saying so)",
    )
    parser.add_argument(
        "--list", action="store_true", help="list the checks and their case counts, then exit"
    )


def _device(choice: str) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device", "cuda: no CUDA device is available here (use --device cpu or auto)")
    return indexed_device(torch.device(choice))


def _split(text: str | None) -> list[str]:
    return names_list(text or "")


def _names(text: str, everything: list[str], flag: str = "--backend") -> list[str]:
    """Backend names from --backend / --peers: all, none, or a comma-separated list where `safemoe`
    stands for safemoe's own backends. An unknown name is a usage error naming `flag`."""
    if text.strip() == "all":
        return list(everything)
    if text.strip() == "none":
        return []
    parts = _split(text)
    unknown = [p for p in parts if p != "safemoe" and p not in everything]
    if unknown:
        keywords = ["safemoe", "all", "none"]
        raise UsageError(flag, unknown_names_message(unknown, [*keywords, *everything], "backend(s)"))
    names: list[str] = []
    for part in parts:
        names += list(SAFEMOE_BACKENDS) if part == "safemoe" else [part]
    return list(dict.fromkeys(names))


def select_or_refuse(only: str | None) -> list[Case]:
    """The checks --only names; a pattern matching no check is a usage error (close names listed)."""
    if only is None:
        return all_cases()
    patterns = _split(only)
    if not patterns:
        raise UsageError("--only", f"names no check, got {only!r}; see safemoe check --list")
    everything = all_cases()
    unknown = [p for p in patterns if not select_cases([p])]
    if unknown:
        known = [*dict.fromkeys(c.family for c in everything), *(c.name for c in everything)]
        raise UsageError(
            "--only", unknown_names_message(unknown, known, "check(s)", see="safemoe check --list")
        )
    return select_cases(patterns)


def check_case_index(index: int | None, grids: dict[str, int], scale: int) -> None:
    """--case INDEX must be a case of every selected check (grids: check -> case count)."""
    if index is None:
        return
    lacking = {name: n for name, n in grids.items() if index >= n}
    if not lacking:
        return
    where = {0: " with --quick", 1: " at the CPU scale", 2: " at the CUDA scale"}[scale]
    shown = ", ".join(
        f"{name} has {n} cases" + (f" (0..{n - 1})" if n else "") for name, n in list(lacking.items())[:4]
    )
    more = f" and {len(lacking) - 4} more checks" if len(lacking) > 4 else ""
    raise UsageError(
        "--case",
        f"{index} is out of range: {shown}{more}{where}; see safemoe check --list, and pick one check "
        "with --only",
    )


def load_check_results(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(runs, results) of a `check --json` file (one run) or of a joined one (`{"runs", "results"}`,
    as scripts/check_coverage.py --merged writes, optionally gzipped). Runs are the header
    dictionaries (device, seed, scale, memcheck, ...), results the per-case dictionaries."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as handle:
            data = json.load(handle)
    except (OSError, ValueError, EOFError) as error:
        raise ValueError(f"{path}: not readable as JSON ({error})") from None
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise ValueError(f"{path}: not a `safemoe check --json` file (no 'results' list)")
    if "runs" in data:
        return list(data["runs"]), list(data["results"])
    return [{k: v for k, v in data.items() if k != "results"}], list(data["results"])


def resumed_cases(path: Path | None, *, seed: int, scale: int) -> frozenset[tuple[str, str, int]]:
    """The (check, backend, case) that --resume's file records as run; a file of another seed or
    matrix scale is a usage error (its case indices name other inputs)."""
    if path is None:
        return frozenset()
    try:
        runs, results = load_check_results(path)
    except ValueError as error:
        raise UsageError("--resume", str(error)) from None
    for run in runs:
        if run.get("scale") != scale or run.get("seed") != seed:
            raise UsageError(
                "--resume",
                f"{path} holds a run of seed {run.get('seed')} at matrix scale {run.get('scale')}; "
                f"this run is seed {seed} at scale {scale}, where the same case index names other inputs",
            )
    return frozenset(
        (r["check"], r["backend"], int(r["case"])) for r in results if r.get("status") != "not run"
    )


def scale_of(args: argparse.Namespace, device: torch.device) -> int:
    if args.scale is not None:
        return SCALES[args.scale]
    if args.quick:
        return 0
    if args.sanitizer:
        return 1  # memcheck makes every launch slow: the CPU-sized matrix, on CUDA dtypes
    return 2 if device.type == "cuda" else 1


def repro_command(
    args: argparse.Namespace, device: torch.device, check: str, backend: str, index: int
) -> str:
    parts = [
        "python3 -m safemoe check",
        f"--only {check}",
        f"--case {index}",
        f"--backend {backend}",
        "--peers none",
        f"--seed {args.seed}",
        f"--device {device.type}",
    ]
    if args.scale is not None:
        parts.append(f"--scale {args.scale}")
    elif args.quick:
        parts.append("--quick")
    parts += [f"--plugin {p}" for p in args.plugin]
    parts.append("--sanitizer" if args.sanitizer else "--jobs 0")
    return " ".join(parts)


def plan_jobs(
    cases: list[Case],
    adapters: list[Adapter],
    *,
    device: torch.device,
    scale: int,
    only_case: int | None,
    sanitizer: bool,
    part: tuple[int, int] | None = None,
    skip: frozenset[tuple[str, str, int]] = frozenset(),
) -> tuple[list[Job], list[CaseResult], dict[str, int]]:
    """(jobs to run, results decided without running, case count per check). Jobs hold cases of
    one backend: chunks of a check (small chunks spread the slow Triton compiles over the
    workers); under the sanitizer jobs of one (backend, family), so each process's error summary
    belongs to one backend. `skip` holds the (check, backend, case) already run (--resume)."""
    jobs: list[Job] = []
    decided: list[CaseResult] = []
    counts: dict[str, int] = {}
    grids = {c.name: c.grid(scale, device) for c in cases}
    for adapter in adapters:
        if not (adapter.installed and adapter.available):
            continue
        by_family: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
        for case in cases:
            grid = grids[case.name]
            counts[case.name] = len(grid)
            indices = [
                i for i in range(len(grid))
                if (only_case is None or i == only_case) and (part is None or i % part[1] == part[0] - 1)
                and (case.name, adapter.name, i) not in skip
            ]
            static = static_status(case, adapter, device)
            if static is not None:
                decided += [
                    CaseResult(case.name, adapter.name, i, static[0], label(grid[i]), message=static[1])
                    for i in indices
                ]
                continue
            items = [(case.name, i) for i in indices]
            if sanitizer:
                by_family[case.family] += items
                continue
            if device.type == "cuda":
                size = max(4, int(JOB_CASES["cuda"] / FAMILY_COST.get(case.family, 1.0)))
            else:
                size = JOB_CASES["cpu_triton" if adapter.name == "triton" else "cpu"]
            jobs += [Job(0, adapter.name, items[k : k + size]) for k in range(0, len(items), size)]
        for family, items in by_family.items():
            # CUDA graphs need the caching allocator to capture at all; memcheck then sees less.
            env: dict[str, str | None] = {
                "PYTORCH_NO_CUDA_MEMORY_CACHING": None if family == "graphs" else "1"
            }
            jobs += [
                Job(0, adapter.name, items[k : k + SANITIZER_JOB], env)
                for k in range(0, len(items), SANITIZER_JOB)
            ]
    # Longest first (the classic list-scheduling rule): the run ends with short jobs only.
    jobs.sort(key=lambda job: _job_cost(job, device), reverse=True)
    for number, job in enumerate(jobs, start=1):
        job.id = number
    return jobs, decided, counts


def _job_cost(job: Job, device: torch.device) -> float:
    backend = BACKEND_COST.get(job.backend, 1.0)
    if job.backend == "triton" and device.type == "cpu":
        backend = 20.0  # the Triton interpreter
    return sum(FAMILY_COST.get(check.split(".", 1)[0], 1.0) for check, _ in job.items) * backend


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )


def execute(
    jobs: list[Job],
    *,
    config: WorkerConfig,
    options: PoolOptions,
    in_process: bool,
    console: Console,
    decided: int = 0,
    log: Console | None = None,
) -> tuple[list[CaseResult], dict[str, SanitizerReport]]:
    """Run the jobs. The progress counts every case of the run, the `decided` ones (n/a without
    running: no CUDA, an op not built) done from the start, so it ends at the summary's count. A
    bar on `console` when it is a terminal; else a line every PROGRESS_LINE_S seconds on `log`
    (default `console`), the report's console, so the lines keep their place before the report."""
    log = log or console
    results: list[CaseResult] = []
    total = decided + sum(len(j.items) for j in jobs)
    start = last_line = time.monotonic()
    with _progress(console) as progress:
        task = progress.add_task("checking", total=total, completed=decided)

        def on_result(result: CaseResult) -> None:
            nonlocal last_line
            results.append(result)
            progress.update(task, advance=1, description=f"{result.backend}: {result.check}")
            now = time.monotonic()
            if not console.is_terminal and now - last_line > PROGRESS_LINE_S:  # a log: a line now and then
                last_line = now
                log.print(
                    f"checking: {decided + len(results)}/{total} cases, {now - start:.0f} s", highlight=False
                )

        if in_process:
            run_in_process(jobs, Runner(config).run_job, on_result, options.deadline)
            return results, {}
        pool = Pool(config, options, on_result)
        pool.run(jobs)
        return results, dict(pool.sanitizer)


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------

Counts = dict[str, int]


def tally(results: list[CaseResult]) -> dict[str, dict[str, Counts]]:
    """backend -> family -> status -> count."""
    table: dict[str, dict[str, Counts]] = collections.defaultdict(
        lambda: collections.defaultdict(lambda: dict.fromkeys(STATUSES, 0))
    )
    for r in results:
        table[r.backend][r.family][r.status] += 1
    return table


def _sum(counts: list[Counts]) -> Counts:
    return {s: sum(c[s] for c in counts) for s in STATUSES}


# Cell styles: a chosen backend's failures are red (they fail the run); a peer's are yellow (they
# are what the comparison is for, and never change the exit status).
CHOSEN_STYLES = {PASSED: "green", FAILED: "bold red", CRASHED: "bold magenta", NA: "dim"}
PEER_STYLES = {PASSED: "green", FAILED: "yellow", CRASHED: "yellow", NA: "dim"}
WORDS = {PASSED: "ok", FAILED: "FAIL", CRASHED: "CRASH", NA: "n/a"}


def _cell(counts: Counts, styles: dict[str, str] = CHOSEN_STYLES) -> str:
    parts = [f"[{styles[s]}]{counts[s]} {WORDS[s]}[/]" for s in STATUSES if counts[s]]
    return "\n".join(parts) or "[dim]-[/]"


def subject_of(chosen: list[str]) -> str:
    """How the report names the chosen backends: "safemoe" when they are all safemoe's own."""
    return "safemoe" if set(chosen) <= set(SAFEMOE_BACKENDS) else "chosen"


@dataclass
class Verdict:
    """The run's verdict on the chosen backends (the exit status is theirs)."""

    word: str  # PASSED, FAILED, INCOMPLETE or NOT RUN
    counts: Counts  # the chosen backends' cases by status
    not_run: int  # their cases left unrun by --max-time
    memcheck_errors: int
    absent: dict[str, str] = dataclasses.field(default_factory=dict)  # chosen, not installed/available

    @property
    def exit_status(self) -> int:
        return 0 if self.word == "PASSED" else 1


def verdict_of(
    results: list[CaseResult],
    chosen: list[str],
    not_run: dict[str, int],
    sanitizer: dict[str, SanitizerReport] | None,
    absent: dict[str, str] | None = None,
) -> Verdict:
    """FAILED (a chosen backend failed or crashed a case, or had memcheck errors), INCOMPLETE (cases
    of theirs left by --max-time), NOT RUN (no case of theirs at all: every chosen backend is
    `absent`, i.e. not installed or not available here) or PASSED. Only PASSED exits 0. A chosen
    backend absent while another ran is named in the verdict line, never counted as passed."""
    counts = summary_counts([r for r in results if r.backend in chosen])
    left = sum(not_run.get(b, 0) for b in chosen)
    errors = sum(sanitizer.get(b, SanitizerReport()).errors for b in chosen) if sanitizer else 0
    if counts[FAILED] or counts[CRASHED] or errors:
        word = "FAILED"
    elif left:
        word = "INCOMPLETE"
    elif not sum(counts.values()):
        word = "NOT RUN"
    else:
        word = "PASSED"
    return Verdict(word, counts, left, errors, dict(absent or {}))


def verdict_line(verdict: Verdict, chosen: list[str]) -> str:
    """`safemoe (reference, triton): PASSED: 0 failed, 0 crashed of 292 cases (260 passed, 32 n/a)`."""
    c = verdict.counts
    cases = sum(c.values())
    line = (
        f"{subject_of(chosen)} ({', '.join(chosen)}): {verdict.word}: {c[FAILED]} failed, {c[CRASHED]} "
        f"crashed of {cases} cases ({c[PASSED]} passed, {c[NA]} n/a)"
    )
    if verdict.memcheck_errors:
        line += f"; {verdict.memcheck_errors} memcheck errors"
    if verdict.not_run:
        line += f"; {verdict.not_run} cases not run (--max-time)"
    if verdict.absent:
        line += "; not run here: " + ", ".join(f"{name} ({state})" for name, state in verdict.absent.items())
    return line + f"; exit status {verdict.exit_status}"


def _backend_table(
    title: str, caption: str, adapters: list[Adapter], counts: dict[str, dict[str, Counts]],
    families: list[str], styles: dict[str, str], width: int,
) -> Table:  # fmt: skip
    table = Table(title=title, caption=caption, show_lines=True, title_justify="left", caption_justify="left")
    table.add_column("backend", no_wrap=True, min_width=width)
    for family in families:
        table.add_column(family, no_wrap=True)
    table.add_column("all", no_wrap=True)
    for adapter in adapters:
        if not (adapter.installed and adapter.available):
            table.add_row(f"[dim]{adapter.name}\n{adapter.state}[/]", *["[dim]-[/]"] * (len(families) + 1))
            continue
        row = counts[adapter.name]
        table.add_row(
            adapter.name,
            *[_cell(row[f], styles) for f in families],
            _cell(_sum([row[f] for f in families]), styles),
        )
    return table


def _describe(console: Console, adapters: list[Adapter], chosen: list[str]) -> None:
    for adapter in adapters:
        mark = " (chosen)" if adapter.name in chosen else ""
        if adapter.installed and adapter.available:
            console.print(f"[bold]{adapter.name}[/]{mark}: {escape(adapter.description)}", highlight=False)
        else:
            console.print(
                f"[dim]{adapter.name}{mark}: {adapter.state}: {escape(adapter.reason)}[/dim]", highlight=False
            )


def _print_memcheck(console: Console, sanitizer: dict[str, SanitizerReport], backends: list[str]) -> None:
    for backend, report in sorted(sanitizer.items()):
        if backend not in backends:
            continue
        style = "bold red" if report.errors else "green"
        console.print(
            f"[{style}]memcheck {backend}: {report.errors} errors[/] in {report.processes} processes",
            highlight=False,
        )
        for line in report.reports[:10]:
            console.print(f"  {escape(line)}", highlight=False, soft_wrap=True)


def print_report(
    console: Console,
    adapters: list[Adapter],
    chosen: list[str],
    results: list[CaseResult],
    families: list[str],
    title: str,
    sanitizer: dict[str, SanitizerReport] | None,
    verdict: Verdict,
) -> None:
    """safemoe's own (the chosen backends') section first, its verdict right under its table and
    its failures after it; then the peers, as peers: what the others do with the same inputs."""
    counts = tally(results)
    width = max(len(a.name) for a in adapters) + 2
    mine = [a for a in adapters if a.name in chosen]
    peers = [a for a in adapters if a.name not in chosen]
    subject = subject_of(chosen)
    console.rule(f"[bold]{escape(title)}[/]")
    _describe(console, mine, chosen)
    console.print(
        _backend_table(
            f"{subject}: the contract on {', '.join(chosen)}",
            "judged: a failure or crash here fails the run (exit status 1)",
            mine,
            counts,
            families,
            CHOSEN_STYLES,
            width,
        )
    )
    if sanitizer is not None:
        _print_memcheck(console, sanitizer, chosen)
    style = "bold green" if verdict.word == "PASSED" else "bold red"
    console.print(f"[{style}]{escape(verdict_line(verdict, chosen))}[/]", highlight=False, soft_wrap=True)
    _print_details(console, chosen, [r for r in results if r.backend in chosen])
    if not peers:
        return
    console.print()
    console.rule("[bold]peers: what the others do with the same inputs[/]")
    console.print(
        "Shown for comparison, never judged: a peer's failures and crashes do not change the exit status. "
        "They are expected (docs/check.md says which bug class each one is).",
        highlight=False,
    )
    _describe(console, peers, chosen)
    console.print(
        _backend_table(
            "peers",
            "not judged: the exit status is the chosen backends' alone",
            peers,
            counts,
            families,
            PEER_STYLES,
            width,
        )
    )
    if sanitizer is not None:
        _print_memcheck(console, sanitizer, [a.name for a in peers])
    _print_details(console, chosen, [r for r in results if r.backend not in chosen])


def _print_details(console: Console, chosen: list[str], results: list[CaseResult]) -> None:
    groups: dict[tuple[str, str], list[CaseResult]] = collections.defaultdict(list)
    sizes: collections.Counter[tuple[str, str]] = collections.Counter()
    for r in results:
        sizes[(r.backend, r.check)] += 1
        if r.status in (FAILED, CRASHED):
            groups[(r.backend, r.check)].append(r)
    ordered = sorted(groups, key=lambda k: (k[0] not in chosen, k))
    for backend, check in ordered:
        bad = sorted(groups[(backend, check)], key=lambda r: r.case)
        crashed = sum(r.status == CRASHED for r in bad)
        what = ", ".join(
            part
            for part in (
                f"{len(bad) - crashed} failed" if len(bad) > crashed else "",
                f"{crashed} crashed" if crashed else "",
            )
            if part
        )
        style = "bold red" if backend in chosen else "yellow"
        whose = "" if backend in chosen else " (peer)"
        size = sizes[(backend, check)]
        console.print(f"[{style}]{backend} {check}[/]{whose}: {what} of {size} cases", highlight=False)
        for r in bad[: CHOSEN_EXAMPLES if backend in chosen else PEER_EXAMPLES]:
            console.print(
                f"  {r.status.upper()} {escape(f'[{r.params}]')} {escape(r.message)}",
                highlight=False,
                soft_wrap=True,
            )
            console.print(f"    repro: {r.repro}", highlight=False, soft_wrap=True)


def summary_counts(results: list[CaseResult]) -> Counts:
    return {s: sum(r.status == s for r in results) for s in STATUSES}


def write_json(
    path: Path,
    *,
    args: argparse.Namespace,
    device: torch.device,
    scale: int,
    adapters: list[Adapter],
    chosen: list[str],
    results: list[CaseResult],
    families: list[str],
    seconds: float,
    not_run: int,
    sanitizer: dict[str, SanitizerReport] | None,
) -> None:
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    counts = tally(results)
    payload: dict[str, Any] = {
        "schema": SCHEMA,
        "safemoe_version": safemoe.__version__,
        "torch_version": torch.__version__,
        "triton_version": triton_version,
        "python": platform.python_version(),
        "command": " ".join(["safemoe", *sys.argv[1:]]),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "seed": args.seed,
        "quick": args.quick,
        "scale": scale,
        "sanitizer": args.sanitizer,
        "shard": None if args.shard is None else f"{args.shard[0]}/{args.shard[1]}",
        "resume": None if args.resume is None else str(args.resume),
        "families": families,
        "backends": {
            a.name: {
                "kind": a.kind,
                "description": a.description,
                "state": a.state,
                "reason": a.reason,
                "chosen": a.name in chosen,
                "ops": {op: asdict(s) for op, s in a.ops.items()},
                "counts": {f: dict(counts[a.name][f]) for f in families} if a.name in counts else {},
            }
            for a in adapters
        },
        "summary": {
            "cases": len(results),
            **summary_counts(results),
            "not_run": not_run,
            "seconds": round(seconds, 2),
        },
        "results": [{**asdict(r), "family": r.family} for r in results],
    }
    if sanitizer is not None:
        payload["memcheck"] = {b: asdict(r) for b, r in sanitizer.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")


def _counts_text(c: Counts) -> str:
    cases = sum(c.values())
    return f"{cases} cases, {c[PASSED]} passed, {c[FAILED]} failed, {c[CRASHED]} crashed, {c[NA]} n/a"


def summary_line(
    results: list[CaseResult],
    seconds: float,
    chosen: list[str],
    not_installed: list[str],
    verdict: Verdict | None = None,
) -> str:
    """The last line: the chosen backends' counts and verdict first, then the peers' (not judged),
    then the whole run: `check: 292 cases, 260 passed, 0 failed, 0 crashed, 32 n/a on safemoe
    (reference, triton): PASSED; peers, not judged (torch, ...): 584 cases, ...; 876 cases in 24 s`."""
    verdict = verdict or verdict_of(results, chosen, {}, None)
    whose = f"{subject_of(chosen)} ({', '.join(chosen)})"
    line = f"check: {_counts_text(verdict.counts)} on {whose}: {verdict.word}"
    order = {name: i for i, name in enumerate(adapters_module.BACKENDS)}
    peers = sorted({r.backend for r in results if r.backend not in chosen}, key=lambda n: order.get(n, 99))
    if peers:
        theirs = summary_counts([r for r in results if r.backend not in chosen])
        line += f"; peers, not judged ({', '.join(peers)}): {_counts_text(theirs)}"
    line += f"; {len(results)} cases in {seconds:.0f} s"
    if not_installed:
        line += f"; not installed: {', '.join(not_installed)}"
    return line


# ----------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------


@reports_usage_errors("check")
def run(args: argparse.Namespace) -> int:
    """The command. Every argument is checked (UsageError: one line, exit status 2) before the first
    case runs; the exit status is then the chosen backends' verdict (see `verdict_of`)."""
    console = Console()
    if not console.is_terminal:  # a log: room for the whole table (9 columns of counts)
        console = Console(width=max(console.width, 132))
    errors = Console(stderr=True)
    start = time.perf_counter()
    for plugin in args.plugin:
        try:
            load_plugin(plugin)
        except Exception as error:
            raise UsageError("--plugin", f"{plugin}: {type(error).__name__}: {error}") from None
    cases = select_or_refuse(args.only)
    device = _device(args.device)
    scale = scale_of(args, device)
    sizes = {case.name: len(case.grid(scale, device)) for case in cases}
    check_case_index(args.case, sizes, scale)
    if args.list:
        for case in cases:
            text = f"{case.name:28} {sizes[case.name]:5} cases  {escape(case.doc)}"
            console.print(text, highlight=False, soft_wrap=True)
        total = sum(sizes.values())
        console.print(f"{len(cases)} checks, {total} cases per backend on {device.type}", highlight=False)
        return 0
    everything = list(adapters_module.BACKENDS)
    chosen = _names(args.backend, everything, "--backend")
    if not chosen:
        raise UsageError(
            "--backend",
            f"chooses no backend ({args.backend!r}); the run needs one to judge (default: safemoe)",
        )
    peers = [n for n in _names(args.peers, everything, "--peers") if n not in chosen]
    sanitizer = None
    if args.sanitizer:
        if device.type != "cuda":
            raise UsageError(
                "--sanitizer", "needs CUDA: compute-sanitizer checks CUDA kernels, and this run is on the CPU"
            )
        sanitizer = sanitizer_command()
        if sanitizer is None:
            raise UsageError("--sanitizer", "compute-sanitizer not found on PATH or in /usr/local/cuda*/bin")
    skip = resumed_cases(args.resume, seed=args.seed, scale=scale)
    if args.json_path is not None:
        prepare_output(args.json_path, "check", "--json")
    adapters = make_adapters(chosen + peers, device)
    config = WorkerConfig(device=str(device), seed=args.seed, scale=scale, plugins=list(args.plugin))
    jobs, decided, _ = plan_jobs(
        cases, adapters, device=device, scale=scale, only_case=args.case, sanitizer=sanitizer is not None,
        part=args.shard, skip=skip,
    )
    cuda = device.type == "cuda"
    workers = args.jobs if args.jobs is not None else min(14 if cuda else 8, os.cpu_count() or 1)
    if sanitizer is not None:
        workers = max(1, workers)
    timeout = args.timeout
    if timeout is None:
        timeout = (300.0 if cuda else 600.0) * (4 if sanitizer else 1)
    deadline = None if args.max_time is None else time.monotonic() + args.max_time
    options = PoolOptions(
        workers=workers,
        timeout=timeout,
        sanitizer=sanitizer,
        max_crashes=args.max_crashes,
        probe_cuda=cuda,
        deadline=deadline,
    )
    in_process = workers == 0 and sanitizer is None
    threads = torch.get_num_threads()
    try:
        with warnings.catch_warnings():
            if in_process:
                setup(config)
            ran, memcheck = execute(
                jobs, config=config, options=options, in_process=in_process, console=errors,
                decided=len(decided), log=console,
            )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    planned = collections.Counter(job.backend for job in jobs for _ in job.items)
    finished = collections.Counter(r.backend for r in ran)
    not_run = {backend: planned[backend] - finished[backend] for backend in planned}
    results = sorted(decided + ran, key=lambda r: (r.backend, r.check, r.case))
    grids = {c.name: c for c in cases}
    for r in results:
        if r.status in (FAILED, CRASHED):
            r.repro = repro_command(args, device, r.check, r.backend, r.case)
        if not r.params:  # a crash recorded by the runner: name the parameters too
            r.params = label(grids[r.check].grid(scale, device)[r.case])
    seconds = time.perf_counter() - start
    families = [f for f in FAMILIES if any(c.family == f for c in cases)]
    names = [n for n in ("quick",) if args.quick] + (["memcheck"] if sanitizer else [])
    if args.shard is not None:
        names.append(f"shard {args.shard[0]}/{args.shard[1]}")
    if args.resume is not None:
        names.append(f"resuming {args.resume.name}: {len(skip)} cases already run")
    title = f"safemoe check ({device}, seed {args.seed}{''.join(', ' + n for n in names)})"
    reports = memcheck if sanitizer else None
    absent = {a.name: a.state for a in adapters if a.name in chosen and not (a.installed and a.available)}
    verdict = verdict_of(results, chosen, not_run, reports, absent)
    print_report(console, adapters, chosen, results, families, title, reports, verdict)
    if args.json_path is not None:
        write_json(
            args.json_path,
            args=args,
            device=device,
            scale=scale,
            adapters=adapters,
            chosen=chosen,
            results=results,
            families=families,
            seconds=seconds,
            not_run=sum(not_run.values()),
            sanitizer=memcheck if sanitizer else None,
        )
        console.print(f"wrote {args.json_path}", highlight=False)
    not_installed = [a.name for a in adapters if not a.installed]
    line = summary_line(results, seconds, chosen, not_installed, verdict)
    left = sum(not_run.values())
    if left:
        line += f"; {left} cases not run (--max-time {args.max_time:.0f} s)"
    console.print(line, highlight=False, soft_wrap=True)
    sys.stdout.flush()
    return verdict.exit_status
