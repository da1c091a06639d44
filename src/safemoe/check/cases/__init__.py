"""Every family of checks; importing this package registers their cases."""

from safemoe.check.cases import (  # noqa: F401
    boundaries,
    buffers,
    dispatch,
    e2e,
    ep,
    fp8,
    graphs,
    invariance,
    padding,
    routing,
)
