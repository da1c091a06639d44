"""Every family of checks; importing this package registers their cases."""

from safemoe.check.cases import experts, padding, routing, stale  # noqa: F401
