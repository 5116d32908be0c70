"""The eager twin of :class:`fold.Fold`: every ``add`` runs its op at once on a batch of one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fold._encoding import LIST, classify
from fold.errors import FoldError, op_name
from fold.node import Node, UnfoldNode, foreign_node
from fold.ops import device_of, literal_output
from fold.ragged import Ragged, element_shapes
from fold.run import NODES, classify_lists

__all__ = ["Unfold"]


class Unfold:
    """The eager twin of :class:`Fold`: every ``add`` runs its op at once on a batch of one.

    Same ``add`` / ``split`` / ``nobatch`` / ``apply`` API; use it to debug a model and as the
    reference that Fold results are compared with::

        u = Unfold(model)
        h, c = u.add("leaf", 3).split(2)
        (out,) = u.apply(model, [[h]])
    """

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.device = device_of(obj)

    Node = UnfoldNode

    def add(self, op: str | Callable[..., Any], *args: Any) -> UnfoldNode:
        """Run ``op(*args)`` now, on batch-of-one arguments, and return its value's handle."""
        vals = []
        for pos, a in enumerate(args):
            if type(a) is UnfoldNode:
                if a.unfold is not self:
                    raise FoldError(
                        f"Unfold.add({op_name(op)!r}, ...): argument {pos} is a Node of another "
                        "Unfold. Fix: record the whole computation in one Unfold."
                    )
                vals.append(a.get())
                continue
            if isinstance(a, Node):
                raise foreign_node(op, pos, a)
            if type(a) in (int, float, bool):
                value = a
            else:
                kind, value = classify(op, pos, a)
                if kind == LIST:  # a list argument: a Ragged of one list
                    vals.append(self._ragged(op, pos, a))
                    continue
            if isinstance(value, torch.Tensor):
                vals.append(value.to(self.device))
            elif isinstance(value, bool):
                vals.append(torch.tensor([value], dtype=torch.bool, device=self.device))
            elif isinstance(value, int):
                vals.append(torch.tensor([value], dtype=torch.long, device=self.device))
            else:
                vals.append(
                    torch.tensor([value], dtype=torch.get_default_dtype(), device=self.device)
                )
        fn = op if not isinstance(op, str) else getattr(self.obj, op, None)
        if fn is None or not callable(fn):
            raise FoldError(
                f"Unfold.add({op_name(op)!r}, ...): {type(self.obj).__name__} has no op "
                f"{op_name(op)!r}. Fix: define def {op_name(op)}(self, ...) on it."
            )
        out = fn(*vals)
        if isinstance(out, list):
            out = tuple(out)
        return UnfoldNode(self, out, op)

    def _ragged(self, op: Any, pos: int, items: list[Any]) -> Ragged:
        values = []
        for j, x in enumerate(items):
            if type(x) is not UnfoldNode or x.unfold is not self:
                raise FoldError(
                    f"Unfold.add({op_name(op)!r}, ...): argument {pos} is a list whose element "
                    f"{j} is not a Node of this Unfold. Fix: pass the nodes its add() returned."
                )
            values.append(x.get())
        metas = {(tuple(v.shape[1:]), v.dtype) for v in values}
        if len(metas) > 1:
            raise FoldError(
                f"Unfold.add({op_name(op)!r}, ...): argument {pos} is a list whose elements "
                "differ in shape or dtype; they are concatenated into one Ragged. Fix: make the "
                "listed nodes' ops return one shape and dtype."
            )
        shapes = element_shapes(self.obj)
        if values:
            shapes[(op, pos)] = (values[0].shape[1:], values[0].dtype)
            return Ragged.from_lists([values])
        known = shapes.get((op, pos))  # as Fold.apply gives an all-empty group
        return Ragged.from_lists([[]]) if known is None else Ragged.empty_lists(1, *known)

    def apply(self, obj: Any, lists: Sequence[Sequence[Any]]) -> list[torch.Tensor]:
        """Concatenate the values of each list, as :meth:`Fold.apply` returns them."""
        if obj is not self.obj:
            raise FoldError(
                "Unfold.apply(obj, lists): obj is not the object this Unfold was built with; "
                "its ops already ran. Fix: pass the same object, or build a new Unfold(obj)."
            )
        res = []
        for i, (kind, items) in enumerate(classify_lists(lists)):
            if kind == NODES:
                res.append(torch.cat([n.get() for n in items], 0))
            else:
                res.append(literal_output(kind, items, i, self.device))
        return res
