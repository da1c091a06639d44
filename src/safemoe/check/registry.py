"""The check registry of `safemoe check`: what a check is, its parameter grid, and what it sees.

A check is a function `fn(ctx, **params)` registered under a dotted name `family.check`
(`routing.nan_rows`, `padding.experts`, ...) together with a function `params(plan)` listing its
parameter combinations. Every (backend, check, parameter combination) is one *case*: it is seeded
on its own (`case_seed`), so any one case can be re-run alone (`--only CHECK --case INDEX`), and
it ends as passed, failed (`CheckFailure`, or any exception the backend raised), n/a
(`NotApplicable`: the backend cannot express the case) or, when the process running it dies or
hangs, crashed. New families are new modules of `@case` functions imported by
`safemoe.check.cases`.
"""

from __future__ import annotations

import fnmatch
import itertools
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

OPS = ("route", "experts", "moe")

# The fault-injection families, in the table's reading order: the data path, then the runtime.
FAMILIES = (
    "routing", "padding", "dispatch", "boundaries", "buffers", "graphs", "e2e", "fp8", "ep", "invariance",
)
FAMILY_DOCS = {
    "routing": "routing contract on NaN/Inf/equal/tie-free rows, every E, scoring and grouping mode",
    "padding": "rows past num_valid poisoned (NaN, Inf, 1e4, stale ids): real rows untouched, pads zero",
    "dispatch": "duplicate, -1, >= E and stale ids; empty experts; every token on one expert",
    "boundaries": "token counts 0, 1, 2, 3, 7, 17, 127-129, 255-257, 4095-4097, 65535-65537",
    "buffers": "outputs and workspaces pre-filled with NaN/+-Inf/stale ids before the call",
    "graphs": "CUDA graph captured once, replayed with num_valid changed in place, NaN injected between",
    "e2e": "safemoe.MoE and a transformers block patched by safemoe, on NaN-poisoned padding",
    "fp8": "fp8 experts, per_tensor and block: NaN/Inf rows isolated, padding never quantised, bad ids",
    "ep": "EPMoE over spawned ranks (gloo/NCCL): ragged, an empty rank, NaN padding, stale ids, overflow",
    "invariance": "batch_invariant=True: the same row in batches of T = 1..8192 (CPU: 1..200), bitwise",
}


class CheckFailure(AssertionError):
    """A broken contract clause; the message says what was seen."""


class NotApplicable(Exception):
    """The backend under test cannot express this case (the message says why): reported as n/a."""


@dataclass
class Plan:
    """How big the matrix is: `scale` 0 for --quick, 1 on CPU, 2 on CUDA (see `CaseContext`)."""

    scale: int
    device: torch.device
    check: str = ""

    def choose(self, quick: Any, cpu: Any, cuda: Any) -> Any:
        return (quick, cpu, cuda)[self.scale]

    def _generator(self, salt: str) -> torch.Generator:
        generator = torch.Generator()
        generator.manual_seed(case_seed(0, f"{self.check}:{salt}"))
        return generator

    def pairs(self, **axes: Sequence[Any]) -> list[dict[str, Any]]:
        """Parameter sets over axes whose values each compile a kernel specialisation (E, modes,
        dtypes, activations).

        On CPU (and with --quick) a covering walk: every value of every axis appears at least once
        (zipped, shorter axes cycling, each rotated by an offset fixed per check). On CUDA every
        *pair* of values of any two axes appears at least once (a greedy all-pairs cover): most
        contract bugs need two factors to meet (an E with a mode, a dtype with a num_valid form),
        and the full cross product would compile hundreds of specialisations.
        """
        names = list(axes)
        values = [list(axes[n]) for n in names]
        if self.scale == 2:
            return [
                {n: v[i] for n, v, i in zip(names, values, row, strict=True)}
                for row in all_pairs([len(v) for v in values])
            ]
        generator = self._generator("pairs")
        length = max(len(v) for v in values)
        offsets = [int(torch.randint(0, len(v), (1,), generator=generator)) for v in values]
        return [
            {n: v[(i + o) % len(v)] for n, v, o in zip(names, values, offsets, strict=True)}
            for i in range(length)
        ]

    def cross(self, rows: list[dict[str, Any]], **axes: Sequence[Any]) -> list[dict[str, Any]]:
        """Every row with cheap axes (row kinds, fills, num_valid forms: runtime values that compile
        nothing new) added: on CUDA the full product, elsewhere one combination per row, walking
        each axis so that every value still appears when there are enough rows."""
        names = list(axes)
        values = [list(axes[n]) for n in names]
        if self.scale == 2:
            return [
                {**row, **dict(zip(names, combo, strict=True))}
                for row in rows
                for combo in itertools.product(*values)
            ]
        count = max([len(rows)] + [len(v) for v in values])
        return [
            {**rows[i % len(rows)], **{n: v[i % len(v)] for n, v in zip(names, values, strict=True)}}
            for i in range(count)
        ]


ParamsFn = Callable[[Plan], list[dict[str, Any]]]
CaseFn = Callable[..., None]


@dataclass(frozen=True)
class Case:
    """A registered check: `fn(ctx, **params)` for each of `params(plan)`."""

    name: str  # "family.check"
    fn: CaseFn
    ops: tuple[str, ...]  # public ops the check calls on the backend under test
    doc: str
    params: ParamsFn | None = None
    cuda_only: bool = False  # n/a on other devices (CUDA graphs)

    @property
    def family(self) -> str:
        return self.name.split(".", 1)[0]

    def grid(self, scale: int, device: torch.device) -> list[dict[str, Any]]:
        """The parameter combinations (one per case) at this scale, in a fixed order."""
        if self.params is None:
            return [{}]
        return self.params(Plan(scale=scale, device=device, check=self.name))


CASES: dict[str, Case] = {}


def case(
    name: str, *, ops: Sequence[str], params: ParamsFn | None = None, cuda_only: bool = False
) -> Callable[[CaseFn], CaseFn]:
    """Register `fn` as the check `name`; its docstring's first line describes it in --list."""
    if name.count(".") != 1:
        raise ValueError(f"check name must be 'family.check', got {name!r}")
    family = name.split(".", 1)[0]
    if family not in FAMILIES:
        raise ValueError(f"check {name}: unknown family {family!r}, known {FAMILIES}")
    unknown = set(ops) - set(OPS)
    if unknown:
        raise ValueError(f"check {name}: unknown ops {sorted(unknown)}, known {OPS}")

    def register(fn: CaseFn) -> CaseFn:
        if name in CASES:
            raise ValueError(f"check {name!r} registered twice")
        doc = (fn.__doc__ or "").strip().splitlines()
        CASES[name] = Case(
            name=name, fn=fn, ops=tuple(ops), doc=doc[0] if doc else "", params=params, cuda_only=cuda_only
        )
        return fn

    return register


def all_cases() -> list[Case]:
    import safemoe.check.cases  # noqa: F401  (registers every check)

    order = {f: i for i, f in enumerate(FAMILIES)}
    return sorted(CASES.values(), key=lambda c: order[c.family])


def select_cases(patterns: Sequence[str] | None) -> list[Case]:
    """Checks matching any pattern: an exact name, a family name, or a glob (`routing.*_rows`)."""
    ordered = all_cases()
    if not patterns:
        return ordered
    return [
        c for c in ordered if any(p in (c.name, c.family) or fnmatch.fnmatchcase(c.name, p) for p in patterns)
    ]


def case_seed(seed: int, name: str) -> int:
    """A seed stable across runs and Python versions (no `hash()` salt)."""
    return zlib.crc32(f"{seed}:{name}".encode()) & 0x7FFFFFFF


@dataclass
class CaseContext:
    """What one case sees: the backend under test, where to put tensors, and how big to go.

    `scale` is 0 for `--quick`, 1 on CPU (reference, or Triton under its slow interpreter) and 2
    on CUDA; checks pick their sizes from it. `generator` is seeded from (seed, check, index), so
    a case draws the same tensors whether it runs in the whole matrix or alone.
    """

    api: Any  # the adapter of the backend under test (see safemoe.check.adapters)
    device: torch.device
    seed: int
    scale: int
    case_name: str = ""
    index: int = 0
    generator: torch.Generator = field(default_factory=torch.Generator)

    def __post_init__(self) -> None:
        self.generator.manual_seed(case_seed(self.seed, f"{self.case_name}#{self.index}"))

    def choose(self, quick: Any, cpu: Any, cuda: Any) -> Any:
        return (quick, cpu, cuda)[self.scale]

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def fail(self, message: str) -> None:
        raise CheckFailure(message)

    def expect(self, condition: bool, message: str) -> None:
        if not condition:
            raise CheckFailure(message)

    def not_applicable(self, reason: str) -> None:
        raise NotApplicable(reason)

    def close(
        self, actual: torch.Tensor, expected: torch.Tensor, what: str, rows: torch.Tensor | None = None
    ) -> None:
        """`invariants.expect_close` with the backend's tolerance scale (a peer that rounds every
        intermediate to the input dtype gets a wider one than safemoe's kernels)."""
        from safemoe.check.invariants import expect_close

        expect_close(actual, expected, what, rows, scale=getattr(self.api, "tolerance_scale", 1.0))

    def rand_rows(self, count: int, width: int) -> torch.Tensor:
        return torch.randn(count, width, generator=self.generator)


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


def short(value: Any) -> str:
    """A parameter value as the failure label and the JSON show it."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    name = getattr(value, "name", None)
    if isinstance(name, str):
        return name
    return str(value)


def label(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={short(v)}" for k, v in params.items())


def iter_labels(params: list[dict[str, Any]]) -> Iterator[str]:
    return (label(p) for p in params)
