"""Every family of checks; importing this package registers their cases."""

from safemoe.check.cases import (  # noqa: F401
    boundaries,
    buffers,
    dispatch,
    e2e,
    graphs,
    invariance,
    padding,
    routing,
)
