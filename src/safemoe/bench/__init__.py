"""safemoe's benchmarks: one harness (`safemoe.bench.harness`), peers (`safemoe.peers`) and
one module per suite, each exposing `run(ceilings, *, quick) -> list[BenchRow]` and optionally
`plot(rows, out_dir)`. Suites are imported lazily, only when run; a suite whose module does not
exist yet is reported as "not built yet". See docs/bench.md."""

from __future__ import annotations

import importlib
from types import ModuleType

SUITES: dict[str, str] = {
    "router": "safemoe.bench.router",
    "experts": "safemoe.bench.experts",
    "runtime": "safemoe.bench.runtime",
    "layer": "safemoe.bench.layer",
    "experts_fp8": "safemoe.bench.experts_fp8",
    "ep": "safemoe.bench.ep",
    "invariance": "safemoe.bench.invariance",
}

# Suites whose `run` takes `shapes=` (names of their module's SHAPES): `safemoe bench --shapes`.
SHAPED_SUITES = ("layer", "experts", "experts_fp8", "invariance", "ep")


def load_suite(name: str) -> ModuleType | None:
    """The suite's module, or None when that module does not exist yet.

    Raises KeyError for a name not in SUITES. An ImportError from inside an existing suite module
    (a missing dependency) propagates: that suite is broken, not unbuilt."""
    module_name = SUITES[name]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            return None
        raise
