"""Compare `safemoe bench` results of an old and a new commit: a markdown table on stdout.

    python3 scripts/bench_compare.py OLD.json NEW.json [OLD.json NEW.json ...] > compare.md

Arguments come in (old, new) pairs of `<suite>.json` files as `safemoe bench` writes them (any
suites, any number of rounds: scripts/bench_compare.sh passes every round of every suite). Rows
are joined by their key (suite, case, T, variant, impl); a key measured in several rounds takes
the median of its rounds on each side. Each point gets new/old and a verdict: `ok` within +-2%
(`--tolerance`), else `slower` or `faster`. Only safemoe's own rows (impl `safemoe*`) are judged;
peers (torch, HF, vLLM...) are shown with their ratio, marked `peer`, and never fail the run.
Points measured on one side only, or with no time (an unavailable peer, an error), are listed
as such.

Exit status: 1 when a safemoe point is slower than the tolerance allows, 0 otherwise. Needs only
the standard library (it imports no safemoe).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Key = tuple[str, str, int, str, str]  # suite, case, T, variant, impl
KEY_COLUMNS = ("suite", "case", "T", "variant", "impl")
OURS_PREFIX = "safemoe"


def row_key(row: dict[str, Any]) -> Key:
    return (str(row["suite"]), str(row["case"]), int(row["tokens"]), str(row["variant"]), str(row["impl"]))


def is_ours(key: Key) -> bool:
    """safemoe's own rows (judged); everything else is a peer (shown only)."""
    return key[4].startswith(OURS_PREFIX)


def load_rows(path: Path) -> tuple[dict[str, Any], dict[Key, float | None]]:
    """(run info, {key: median_us}) of one `<suite>.json`; a key seen twice gets `#2`, `#3`...
    appended to its impl so nothing is silently merged."""
    data = json.loads(Path(path).read_text())
    info = {name: data.get(name) for name in ("suite", "device", "date", "torch", "triton", "safemoe")}
    rows: dict[Key, float | None] = {}
    for row in data.get("rows", []):
        key = row_key(row)
        base, n = key, 1
        while key in rows:
            n += 1
            key = (*base[:4], f"{base[4]}#{n}")
        value = row.get("median_us")
        rows[key] = None if value is None else float(value)
    return info, rows


@dataclass
class Point:
    key: Key
    old: list[float] = field(default_factory=list)  # one median per round that timed it
    new: list[float] = field(default_factory=list)
    in_old: bool = False
    in_new: bool = False

    @property
    def old_us(self) -> float | None:
        return statistics.median(self.old) if self.old else None

    @property
    def new_us(self) -> float | None:
        return statistics.median(self.new) if self.new else None

    @property
    def ratio(self) -> float | None:
        if self.old_us is None or self.new_us is None or self.old_us <= 0:
            return None
        return self.new_us / self.old_us

    def spread(self) -> float | None:
        """The larger round-to-round spread of the two sides, (max - min) / median; None with one
        round per side."""
        spreads = [(max(v) - min(v)) / statistics.median(v) for v in (self.old, self.new) if len(v) > 1]
        return max(spreads) if spreads else None

    def verdict(self, tolerance: float) -> str:
        ratio = self.ratio
        if not self.in_old or not self.in_new:
            word = "only in new" if self.in_new else "only in old"
        elif ratio is None:
            word = "no time"
        elif ratio > 1.0 + tolerance:
            word = "slower"
        elif ratio < 1.0 - tolerance:
            word = "faster"
        else:
            word = "ok"
        return word if is_ours(self.key) else f"peer ({word})"


def join(pairs: list[tuple[dict[Key, float | None], dict[Key, float | None]]]) -> list[Point]:
    """Points keyed across every (old rows, new rows) pair, in first-seen order (new side first,
    so the table follows the bench's own row order)."""
    points: dict[Key, Point] = {}
    for old_rows, new_rows in pairs:
        for side, rows in (("new", new_rows), ("old", old_rows)):
            for key, value in rows.items():
                point = points.setdefault(key, Point(key))
                setattr(point, f"in_{side}", True)
                if value is not None:
                    getattr(point, side).append(value)
    return list(points.values())


@dataclass
class Summary:
    judged: int
    within: int
    slower: int
    faster: int
    worst: Point | None
    peers: int
    untimed: int


def summarise(points: list[Point], tolerance: float) -> Summary:
    ours = [p for p in points if is_ours(p.key) and p.ratio is not None]
    worst = max(ours, key=lambda p: p.ratio or 0.0, default=None)
    return Summary(
        judged=len(ours),
        within=sum(1 for p in ours if p.verdict(tolerance) == "ok"),
        slower=sum(1 for p in ours if p.verdict(tolerance) == "slower"),
        faster=sum(1 for p in ours if p.verdict(tolerance) == "faster"),
        worst=worst,
        peers=sum(1 for p in points if not is_ours(p.key)),
        untimed=sum(1 for p in points if is_ours(p.key)) - len(ours),
    )


def _us(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|")


def summary_line(summary: Summary, tolerance: float) -> str:
    pct = f"{tolerance * 100:g}%"
    if summary.worst is None:
        return f"**Summary**: no safemoe point was timed on both sides ({summary.peers} peer points shown)."
    worst = summary.worst
    where = ", ".join(f"{name} {value}" for name, value in zip(KEY_COLUMNS, worst.key, strict=True))
    return (
        f"**Summary**: {summary.judged} safemoe points, {summary.within} within {pct} "
        f"({summary.slower} slower, {summary.faster} faster); worst new/old {worst.ratio:.3f} "
        f"({where}). {summary.peers} peer points shown, not judged"
        + (f"; {summary.untimed} safemoe points without a time on both sides." if summary.untimed else ".")
    )


def render(
    points: list[Point],
    tolerance: float,
    *,
    old_info: list[dict[str, Any]],
    new_info: list[dict[str, Any]],
    old_label: str,
    new_label: str,
) -> str:
    rounds = max((max(len(p.old), len(p.new)) for p in points), default=0)
    summary = summarise(points, tolerance)
    lines = [f"# Bench comparison: {old_label} (old) vs {new_label} (new)", ""]
    for label, infos in (("old", old_info), ("new", new_info)):
        seen = sorted({(str(i.get("device")), str(i.get("torch")), str(i.get("triton"))) for i in infos})
        dates = sorted(str(i.get("date")) for i in infos)
        runs = "; ".join(f"{d}, torch {t}, triton {tr}" for d, t, tr in seen)
        span = f"{dates[0]} .. {dates[-1]}" if dates else "no files"
        lines.append(f"- {label}: {len(infos)} result files ({runs}), {span}")
    lines += [
        f"- rows joined by ({', '.join(KEY_COLUMNS)}); rounds per side: up to {rounds} (median of "
        f"them); verdict `ok` within +-{tolerance * 100:g}%, judged on safemoe rows only",
        "",
        summary_line(summary, tolerance),
        "",
    ]
    header = [*KEY_COLUMNS, "old median µs", "new median µs", "new/old", "verdict"]
    if rounds > 1:
        header.append("round spread")
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join("---:" if i in (2, 5, 6, 7, 9) else "---" for i in range(len(header))) + "|")
    for p in points:
        ratio = p.ratio
        cells = [
            *(_cell(v) for v in p.key),
            _us(p.old_us),
            _us(p.new_us),
            "n/a" if ratio is None else f"{ratio:.3f}",
            p.verdict(tolerance),
        ]
        if rounds > 1:
            spread = p.spread()
            cells.append("" if spread is None else f"{spread * 100:.1f}%")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", summary_line(summary, tolerance), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Join old and new `safemoe bench` JSON results and judge each safemoe point."
    )
    parser.add_argument("files", nargs="+", type=Path, help="OLD.json NEW.json pairs (any number of pairs)")
    parser.add_argument("--tolerance", type=float, default=0.02, help="relative band of `ok` (default 0.02)")
    parser.add_argument("--old-label", default="old", help="what the old side is (a commit, a path)")
    parser.add_argument("--new-label", default="new", help="what the new side is")
    args = parser.parse_args(argv)
    if len(args.files) % 2:
        parser.error(f"files come in OLD NEW pairs; got {len(args.files)} files")
    pairs, old_info, new_info = [], [], []
    for old_path, new_path in zip(args.files[::2], args.files[1::2], strict=True):
        old_meta, old_rows = load_rows(old_path)
        new_meta, new_rows = load_rows(new_path)
        pairs.append((old_rows, new_rows))
        old_info.append(old_meta)
        new_info.append(new_meta)
    points = join(pairs)
    print(
        render(
            points,
            args.tolerance,
            old_info=old_info,
            new_info=new_info,
            old_label=args.old_label,
            new_label=args.new_label,
        )
    )
    return 1 if summarise(points, args.tolerance).slower else 0


if __name__ == "__main__":
    sys.exit(main())
