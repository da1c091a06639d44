"""`safemoe check`: the contract, checked through the public API on every backend available here.

Cases live in `safemoe.check.cases` (one module per family), registered with
`safemoe.check.registry.case`; backends are `safemoe.check.adapters.Adapter`s. See docs/contract.md
for the clauses they check.
"""

from safemoe.check.registry import CASES, Case, CaseContext, CheckFailure, case, select_cases
from safemoe.check.runner import Result, add_arguments, run, run_checks

__all__ = [
    "CASES",
    "Case",
    "CaseContext",
    "CheckFailure",
    "Result",
    "add_arguments",
    "case",
    "run",
    "run_checks",
    "select_cases",
]
