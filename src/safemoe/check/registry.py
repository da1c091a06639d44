"""The case registry of `safemoe check`.

A case is a small function `fn(ctx) -> None` registered under a dotted name `family.case`
(`routing.nan_rows`, `padding.experts`, ...). It builds seeded inputs, calls the public API through
`ctx.api` (the backend under test) and raises `CheckFailure` when the contract is broken. The
runner calls every selected case once per backend. New families (fault injection, graphs,
integrations) are new modules of `@case` functions imported by `safemoe.check.cases`.
"""

from __future__ import annotations

import fnmatch
import itertools
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

OPS = ("route", "experts", "moe")


class CheckFailure(AssertionError):
    """A broken contract clause; the message says which sub-case and what was seen."""


CaseFn = Callable[["CaseContext"], None]


@dataclass(frozen=True)
class Case:
    name: str  # "family.case"
    fn: CaseFn
    ops: tuple[str, ...]  # public ops the case calls on the backend under test
    doc: str

    @property
    def family(self) -> str:
        return self.name.split(".", 1)[0]


CASES: dict[str, Case] = {}
# Reading order of the families in the table: the data path, then the end-to-end checks.
FAMILY_ORDER = {"routing": 0, "padding": 1, "stale": 2, "experts": 3}


def case(name: str, *, ops: Sequence[str]) -> Callable[[CaseFn], CaseFn]:
    """Register `fn` as the check `name`; its docstring's first line is the table's description."""
    if name.count(".") != 1:
        raise ValueError(f"case name must be 'family.case', got {name!r}")
    unknown = set(ops) - set(OPS)
    if unknown:
        raise ValueError(f"case {name}: unknown ops {sorted(unknown)}, known {OPS}")

    def register(fn: CaseFn) -> CaseFn:
        if name in CASES:
            raise ValueError(f"case {name!r} registered twice")
        doc = (fn.__doc__ or "").strip().splitlines()
        CASES[name] = Case(name=name, fn=fn, ops=tuple(ops), doc=doc[0] if doc else "")
        return fn

    return register


def select_cases(patterns: Sequence[str] | None) -> list[Case]:
    """Cases matching any pattern: an exact name, a family name, or a glob (`routing.*_rows`)."""
    import safemoe.check.cases  # noqa: F401  (registers every case)

    ordered = sorted(CASES.values(), key=lambda c: FAMILY_ORDER.get(c.family, len(FAMILY_ORDER)))
    if not patterns:
        return ordered
    return [
        c for c in ordered if any(p in (c.name, c.family) or fnmatch.fnmatchcase(c.name, p) for p in patterns)
    ]


def case_seed(seed: int, name: str) -> int:
    """A per-case seed, stable across runs and Python versions (no `hash()` salt)."""
    return zlib.crc32(f"{seed}:{name}".encode()) & 0x7FFFFFFF


@dataclass
class CaseContext:
    """What a case sees: the backend under test, where to put tensors, and how big to go.

    `scale` is 0 for `--quick`, 1 on CPU (reference, or Triton under its slow interpreter) and 2
    on CUDA; cases pick their sizes and sub-case grids from it.
    """

    api: Any  # the adapter of the backend under test (see safemoe.check.adapters)
    device: torch.device
    seed: int
    scale: int
    case_name: str = ""
    generator: torch.Generator = field(default_factory=torch.Generator)
    subcases: int = 0
    _labels: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.generator.manual_seed(case_seed(self.seed, self.case_name))

    def choose(self, quick: Any, cpu: Any, cuda: Any) -> Any:
        return (quick, cpu, cuda)[self.scale]

    def grid(self, **axes: Sequence[Any]) -> Iterator[dict[str, Any]]:
        """Sub-case parameter sets.

        On CPU (and with --quick) a covering walk: every value of every axis appears at least once
        (zipped, shorter axes cycling, each rotated by a seeded offset). On CUDA every *pair* of
        values of any two axes appears at least once (a greedy all-pairs cover): most contract
        bugs need two factors to meet (an E with a mode, a dtype with a num_valid form), and the
        full cross product would compile hundreds of kernel specialisations.
        """
        names = list(axes)
        values = [list(axes[n]) for n in names]
        if self.scale == 2:
            for row in all_pairs([len(v) for v in values]):
                yield {n: v[i] for n, v, i in zip(names, values, row, strict=True)}
            return
        length = max(len(v) for v in values)
        offsets = [int(torch.randint(0, len(v), (1,), generator=self.generator)) for v in values]
        for i in range(length):
            yield {n: v[(i + o) % len(v)] for n, v, o in zip(names, values, offsets, strict=True)}

    @contextmanager
    def sub(self, **params: Any) -> Iterator[None]:
        """Label failures raised inside with the sub-case parameters."""
        label = " ".join(f"{k}={_short(v)}" for k, v in params.items())
        self._labels.append(label)
        self.subcases += 1
        try:
            yield
        except Exception as error:
            if getattr(error, "labelled", False):
                raise
            where = " ".join(self._labels)
            if isinstance(error, CheckFailure):
                labelled = CheckFailure(f"[{where}] {error}")
            else:  # a crash is a failure too; the cause keeps its traceback
                labelled = CheckFailure(f"[{where}] raised {type(error).__name__}: {error}")
            labelled.labelled = True  # type: ignore[attr-defined]
            raise labelled from (None if isinstance(error, CheckFailure) else error)
        finally:
            self._labels.pop()

    def fail(self, message: str) -> None:
        raise CheckFailure(message)

    def expect(self, condition: bool, message: str) -> None:
        if not condition:
            raise CheckFailure(message)


def _pair(axis: int, value: int, other: int, other_value: int) -> tuple[int, int, int, int]:
    return (axis, value, other, other_value) if axis < other else (other, other_value, axis, value)


def all_pairs(sizes: list[int]) -> list[tuple[int, ...]]:
    """Index rows in which every pair of values of any two axes occurs at least once (greedy, in
    the manner of AETG: start each row from an uncovered pair, fill the other axes with the value
    covering most uncovered pairs, lowest index on ties). Deterministic."""
    if len(sizes) == 1:
        return [(i,) for i in range(sizes[0])]
    axes = range(len(sizes))
    uncovered = {
        (a, i, b, j)
        for a, b in itertools.combinations(axes, 2)
        for i in range(sizes[a])
        for j in range(sizes[b])
    }
    rows = []
    while uncovered:
        a, i, b, j = min(uncovered)
        row = {a: i, b: j}
        for axis in axes:
            if axis not in row:
                gains = [
                    sum(_pair(axis, value, other, v) in uncovered for other, v in row.items())
                    for value in range(sizes[axis])
                ]
                row[axis] = gains.index(max(gains))
        full = tuple(row[axis] for axis in axes)
        for x, y in itertools.combinations(axes, 2):
            uncovered.discard((x, full[x], y, full[y]))
        rows.append(full)
    return rows


def _short(value: Any) -> str:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return str(value)
