"""How much of the `safemoe check` matrix a set of split runs covered, from their --json files.

A CUDA-scale memcheck pass does not fit one device call, so it runs as several (`--only`,
`--shard K/N`, `--max-time`). This joins their results by (check, backend, case) against the
matrix of the same scale and prints, per family and backend, the cases passed, n/a, failed or
crashed, and never run, plus the memcheck error totals; with --markdown it writes that table.

    python3 scripts/check_coverage.py RUN.json [RUN.json ...] [--families routing,fp8]
        [--backends reference,triton] [--markdown OUT.md] [--merged OUT.json.gz]

Exit status 1 when a case failed or crashed or memcheck reported errors, else 0 (cases never run
are reported, not judged: the table says how many).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from safemoe.check.registry import select_cases  # noqa: E402
from safemoe.check.runner import load_check_results  # noqa: E402

BAD = ("failed", "crashed")


def load_runs(paths: list[Path]) -> list[dict[str, Any]]:
    """Every run of the files (a `check --json` file, or a joined --merged one), each with its results
    (a joined file's results ride on its first run)."""
    runs = []
    for path in paths:
        try:
            headers, results = load_check_results(path)
        except ValueError as error:
            raise SystemExit(str(error)) from None
        runs += [dict(header, results=results if i == 0 else []) for i, header in enumerate(headers)]
    scales = {run["scale"] for run in runs}
    if len(scales) != 1:
        raise SystemExit(f"the runs mix matrix scales {sorted(scales)}; join runs of one scale")
    return runs


def join(runs: list[dict[str, Any]]) -> dict[tuple[str, str, int], dict[str, Any]]:
    """(check, backend, case) -> its result; a failure or crash in any run wins over a pass."""
    joined: dict[tuple[str, str, int], dict[str, Any]] = {}
    for run in runs:
        for result in run["results"]:
            if result["status"] == "not run":
                continue
            key = (result["check"], result["backend"], int(result["case"]))
            if key not in joined or result["status"] in BAD:
                joined[key] = result
    return joined


def coverage(joined: dict[tuple[str, str, int], dict[str, Any]], families: list[str], backends: list[str],
             scale: int, device: torch.device) -> dict[tuple[str, str], collections.Counter]:
    """(family, backend) -> Counter of statuses over every case of the matrix ('not run' for gaps)."""
    table: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    for case in select_cases(families):
        size = len(case.grid(scale, device))
        for backend in backends:
            for index in range(size):
                result = joined.get((case.name, backend, index))
                table[(case.family, backend)][result["status"] if result else "not run"] += 1
    return table


def memcheck_totals(runs: list[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """backend -> (errors, processes with an error summary) over the runs under memcheck."""
    totals: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for run in runs:
        for backend, info in (run.get("memcheck") or {}).items():
            totals[backend][0] += int(info.get("errors", 0))
            totals[backend][1] += int(info.get("processes", 0))
    return {backend: (errors, processes) for backend, (errors, processes) in totals.items()}


STATUSES = ("passed", "n/a", "failed", "crashed", "not run")


def markdown(table: dict[tuple[str, str], collections.Counter], memcheck: dict[str, tuple[int, int]],
             runs: list[dict[str, Any]]) -> str:
    devices = sorted({run.get("device_name", "?") for run in runs})
    commands = [run.get("command", "?") for run in runs]
    total = collections.Counter()
    lines = ["| family | backend | " + " | ".join(STATUSES) + " |", "|---|---|" + "---:|" * len(STATUSES)]
    for (family, backend), counts in table.items():
        total.update(counts)
        lines.append(f"| {family} | {backend} | " + " | ".join(str(counts[s]) for s in STATUSES) + " |")
    lines.append("| **all** | | " + " | ".join(f"**{total[s]}**" for s in STATUSES) + " |")
    head = [
        f"Runs joined: {len(runs)} on {', '.join(devices)}; matrix scale {runs[0]['scale']}; "
        f"{sum(total.values())} cases of the matrix, {sum(total.values()) - total['not run']} run.",
        "Memcheck: "
        + ("; ".join(f"{b} {e} errors in {p} process summaries" for b, (e, p) in memcheck.items())
           or "no run under memcheck")
        + ".",
        "",
    ]
    tail = ["", "Commands:", *[f"- `{c}`" for c in commands], ""]
    return "\n".join(head + lines + tail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path,
                        help="`safemoe check --json` files, or joined ones (--merged)")
    parser.add_argument("--families", default=None, help="families of the matrix (default: the runs' union)")
    parser.add_argument("--backends", default="reference,triton")
    parser.add_argument("--markdown", type=Path, default=None, help="write the table here")
    parser.add_argument("--merged", type=Path, default=None, help="write the joined results here (.json.gz)")
    args = parser.parse_args(argv)
    runs = load_runs(args.runs)
    families = (args.families.split(",") if args.families
                else sorted({f for run in runs for f in run.get("families", [])}))  # fmt: skip
    device = torch.device(str(runs[0].get("device", "cpu")))
    joined = join(runs)
    table = coverage(joined, families, args.backends.split(","), int(runs[0]["scale"]), device)
    memcheck = memcheck_totals(runs)
    text = markdown(table, memcheck, runs)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.merged:
        payload = {"runs": [{k: v for k, v in run.items() if k != "results"} for run in runs],
                   "results": list(joined.values())}
        with gzip.open(args.merged, "wt") as handle:
            json.dump(payload, handle)
    bad = any(counts[s] for counts in table.values() for s in BAD)
    return 1 if bad or any(errors for errors, _ in memcheck.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
