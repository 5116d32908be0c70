"""fold: dynamic batching of per-example PyTorch computations.

Record the per-example computation into a :class:`Fold` graph with :meth:`Fold.add`, then
:meth:`Fold.apply` runs it with every group of same-signature nodes executed as one batched
call::

    import fold
    f = fold.Fold()
    x = f.add("leaf", 3)            # op "leaf" of the object given to apply, on the int 3
    y = f.add("double", x)
    (out,) = f.apply(model, [[y]])  # model.leaf(LongTensor([3])) then model.double(...)
"""

from __future__ import annotations

import importlib
from typing import Any

from fold.autobatch import autobatch as autobatch
from fold.autobatch import batchable as batchable
from fold.distributed import FoldModule as FoldModule
from fold.errors import FoldError as FoldError
from fold.graph import Fold as Fold
from fold.node import Node as Node
from fold.ragged import Ragged as Ragged
from fold.unfold import Unfold as Unfold

__all__ = ["Fold", "FoldError", "FoldModule", "Node", "Ragged", "Unfold", "autobatch", "batchable"]
__version__ = "0.1.0"

# Submodules reachable as attributes after a plain ``import fold`` (``fold.optim.Adam``),
# imported on first use so that ``import fold`` stays light.
_SUBMODULES = frozenset(
    {
        "batched_ops",
        "diagnostics",
        "distributed",
        "models",
        "optim",
        "scheduler",
        "testing",
        "train",
        "treebank",
    }
)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"fold.{name}")
    raise AttributeError(f"module 'fold' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBMODULES})
