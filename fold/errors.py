"""The one error class fold raises for bad input and failed ops."""

from __future__ import annotations

__all__ = ["FoldError"]


class FoldError(ValueError):
    """Raised for bad input to fold and for failures inside a user op during ``apply``.

    Messages say what was expected, what came, and the fix.  Failures inside a user op are
    chained to the original exception (``raise FoldError(...) from err``), so the original
    traceback stays available as ``err.__cause__``.
    """
