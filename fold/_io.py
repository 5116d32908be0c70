"""Writing files: the one atomic save that checkpoints and sweeps use."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["atomic_save"]


def atomic_save(obj: Any, path: str | Path) -> None:
    """``torch.save(obj)`` to ``path`` atomically: a temporary file in the same folder,
    flushed to disk, then renamed over ``path``; a failure leaves ``path`` as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
