"""The one error class fold raises, and the names and shapes its messages show."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["FoldError", "FoldOutOfMemoryError", "describe", "op_name"]


class FoldError(ValueError):
    """Raised for bad input to fold and for failures inside a user op during ``apply``.

    Messages say what was expected, what came, and the fix.  Failures inside a user op are
    chained to the original exception (``raise FoldError(...) from err``), so the original
    traceback stays available as ``err.__cause__``.
    """


class FoldOutOfMemoryError(FoldError, torch.OutOfMemoryError):
    """A user op ran out of device memory during ``apply``.

    It is a FoldError (its message names the op, the group and the fix: ``max_rows``,
    ``max_bytes`` or ``offload="cpu"``) and also a ``torch.OutOfMemoryError``, so code that
    catches out-of-memory errors around a training step (to halve its batch, say) still
    catches it.
    """


def op_name(op: Any) -> str:
    """A readable name for an op: the method name, or a callable's qualified name."""
    if isinstance(op, str):
        return op
    return getattr(op, "__qualname__", None) or getattr(op, "__name__", None) or repr(op)


def describe(shape: Any, dtype: Any, always_dtype: bool = False) -> str:
    """A shape for messages and summaries: ``(4, 7)``, with the dtype when it is not the
    default one (or ``always_dtype``): ``(4,) int64``."""
    shown = f"{tuple(shape)}"
    if always_dtype or dtype != torch.get_default_dtype():
        shown += f" {str(dtype).replace('torch.', '')}"
    return shown
