"""Handles on recorded values: :class:`Node` (a Fold's) and :class:`UnfoldNode` (an Unfold's).

A Node is an int laid out as ``fold._encoding`` describes, of a Node subclass made for its
Fold: recording looks its fast path up by argument types, so a Node of another Fold is
another type, misses it, and is rejected on the slow path without any per-argument check on
the fast one.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

from fold._encoding import (
    LOW_MASK,
    MAX_SPLIT,
    SPLIT,
    depth_of,
    node_id,
    out_index,
    split_code,
)
from fold.errors import FoldError, op_name

__all__ = ["Node", "UnfoldNode", "foreign_node", "node_type_for"]


def _refuse_arithmetic(self: Node, *_: Any) -> Any:
    raise FoldError(
        f"{self!r} is a handle on a recorded value, not a value: arithmetic on it does not "
        "record anything. Fix: record the computation as an op, f.add('my_op', node, ...)."
    )


_SPLIT2 = split_code(2)


class Node(int):
    """A handle on one recorded value, returned by :meth:`Fold.add` and :meth:`Node.split`.

    Handles are ints (see ``fold._encoding``); equal handles of one Fold denote the same value.
    """

    __slots__ = ()
    _fold_ref: Callable[[], Any] = staticmethod(lambda: None)

    @property
    def fold(self) -> Any:
        """The Fold that recorded this node."""
        f = self._fold_ref()
        if f is None:
            raise FoldError(f"node {self.id}: the Fold that recorded it no longer exists.")
        return f

    @property
    def id(self) -> int:
        """The index of the recorded node in its Fold."""
        return node_id(self)

    @property
    def depth(self) -> int:
        """The step the depth scheduler runs the node at."""
        return depth_of(self)

    @property
    def index(self) -> int | None:
        """The output index of a split output; None for a whole node."""
        return out_index(self) if self & SPLIT else None

    def split(self, n: int) -> tuple[Node, ...]:
        """Handles on the ``n`` outputs of a multi-output op: ``h, c = f.add("cell", x).split(2)``.

        Nothing is written into the graph: ``apply`` checks that the op returns ``n`` outputs
        when a handle is used (a FoldError names the node and the count the op returned).
        """
        if n == 2 and not self & LOW_MASK:  # the common case, kept short
            t = type(self)
            b = self | _SPLIT2
            return t(b), t(b | 1)
        if self & SPLIT:
            raise FoldError(
                f"Node.split({n}) on output {out_index(self)} of node {self.id}, which is "
                "already one output of a split. Fix: split the node itself once, and have its "
                "op return a flat tuple."
            )
        if type(n) is not int or not 1 <= n <= MAX_SPLIT:
            raise FoldError(
                f"Node.split({n!r}) on node {self.id}: n must be an int from 1 to {MAX_SPLIT}, "
                "the number of tensors the op returns."
            )
        t = type(self)
        b = self | split_code(n)
        return tuple([t(b | k) for k in range(n)])

    def nobatch(self) -> Node:
        """Pass this node's value whole to every consumer instead of one row per consumer.

        The node runs in a group of its own (its output need not have one row), and consumers
        are grouped only with consumers of the same nobatch node::

            table = f.add("embed_table").nobatch()   # (vocab, dim), shared by every lookup
            f.add("lookup", table, word_id)
        """
        self.fold.nobatch_ids.add(self.id)
        return self

    def __repr__(self) -> str:
        fold = self._fold_ref()
        op = f", op={op_name(fold.op_of(self.id))!r}" if fold is not None else ""
        suffix = f"[{out_index(self)}]" if self & SPLIT else ""
        return f"Node({self.id}{suffix}{op}, depth={self.depth})"

    __str__ = __repr__
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse_arithmetic
    __truediv__ = __rtruediv__ = __matmul__ = __rmatmul__ = __neg__ = __pow__ = _refuse_arithmetic


def foreign_node(op: Any, pos: int, a: Any) -> FoldError:
    """The FoldError for argument ``pos`` of ``op``, a Node that another Fold recorded."""
    return FoldError(
        f"Fold.add({op_name(op)!r}, ...): argument {pos} is a Node of another Fold "
        f"({a!r}). Nodes can only be combined within the Fold that recorded them. Fix: "
        "record the whole computation in one Fold."
    )


# Node classes are pooled: a class costs tens of microseconds to make and is cyclic garbage
# once dropped (a per-sample training loop makes a Fold per step).  A pooled class serves a
# new Fold only when nothing but the pool refers to it: no Fold, no recorder, and no handle
# (each instance holds a reference to its class), so a handle of a dropped Fold can never be
# mistaken for a handle of the new one.
_NODE_TYPES: list[type[Node]] = []
_POOL_SIZE = 16


def _make_node_type() -> type[Node]:
    return type("Node", (Node,), {"__slots__": ()})


def _unused_refcount() -> int:
    """The reference count of a pooled class nothing uses, read as node_type_for reads it."""
    probe = [_make_node_type()]
    for cls in probe:
        return sys.getrefcount(cls)
    raise AssertionError


_UNUSED = _unused_refcount()


def node_type_for(fold: Any) -> type[Node]:
    """A Node class of ``fold``'s own: new, or a pooled one nothing refers to any more."""
    for cls in _NODE_TYPES:
        if sys.getrefcount(cls) == _UNUSED:
            break
    else:
        cls = _make_node_type()
        if len(_NODE_TYPES) < _POOL_SIZE:
            _NODE_TYPES.append(cls)
    cls._fold_ref = weakref.ref(fold)
    return cls


class UnfoldNode:
    """A computed value of an :class:`fold.Unfold`, with the ``split`` / ``nobatch`` methods
    of a Fold's Node (also reachable as ``Unfold.Node``)."""

    __slots__ = ("unfold", "value", "op")

    def __init__(self, unfold: Any, value: Any, op: Any) -> None:
        self.unfold = unfold
        self.value = value
        self.op = op

    def split(self, n: int) -> tuple[UnfoldNode, ...]:
        v = self.value
        if isinstance(v, torch.Tensor):
            v = (v,)
        if type(n) is not int or len(v) != n:
            raise FoldError(
                f"Node.split({n!r}): op {op_name(self.op)!r} returned {len(v)} output(s). "
                f"Fix: call .split({len(v)})."
            )
        return tuple(UnfoldNode(self.unfold, x, self.op) for x in v)

    def nobatch(self) -> UnfoldNode:
        return self

    def get(self) -> torch.Tensor:
        v = self.value
        if isinstance(v, tuple):
            if len(v) != 1:
                raise FoldError(
                    f"op {op_name(self.op)!r} returned {len(v)} outputs and its node is used "
                    f"whole. Fix: call .split({len(v)}) on the node and use its outputs."
                )
            v = v[0]
        return v
