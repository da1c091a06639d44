"""`safemoe check`: the fault-injection matrix, through each backend's API, crash-isolated.

Checks live in `safemoe.check.cases` (one module per family), registered with
`safemoe.check.registry.case` together with their parameter grids; backends are
`safemoe.check.adapters.Adapter`s; `safemoe.check.pool` runs case groups in worker processes
(`safemoe.check.worker`) and survives their crashes. See docs/check.md.
"""

from safemoe.check.adapters import Adapter, register_backend
from safemoe.check.registry import CASES, Case, CaseContext, CheckFailure, NotApplicable, case, select_cases
from safemoe.check.runner import add_arguments, run
from safemoe.check.worker import CaseResult, run_case

__all__ = [
    "CASES",
    "Adapter",
    "Case",
    "CaseContext",
    "CaseResult",
    "CheckFailure",
    "NotApplicable",
    "add_arguments",
    "case",
    "register_backend",
    "run",
    "run_case",
    "select_cases",
]
