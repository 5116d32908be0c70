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

from fold.distributed import FoldModule as FoldModule
from fold.errors import FoldError as FoldError
from fold.graph import Fold as Fold
from fold.graph import Node as Node
from fold.graph import Unfold as Unfold

__all__ = ["Fold", "FoldError", "FoldModule", "Node", "Unfold"]
__version__ = "0.1.0"
