"""What a scheduler reads (:class:`GraphView`) and what it produces (:class:`Plan`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

__all__ = ["ArrayGraph", "GraphView", "Group", "Input", "Pieces", "Plan", "RecordedView", "Step"]


class GraphView(Protocol):
    """The graph as every scheduler reads it: node arrays, never a Fold.

    :class:`fold.arrays.GraphArrays` (what ``Fold.snapshot`` returns) satisfies it, and so
    does :class:`ArrayGraph`, built by hand from arrays (schedulers are tested on both).
    """

    n: int  # nodes; node ids 0..n-1 are a topological order
    count: list[int]  # nodes per signature
    flat: bool  # no node has node arguments

    @property
    def sig(self) -> np.ndarray: ...  # (n,) int64 signature id per node

    @property
    def depth(self) -> np.ndarray: ...  # (n,) int64: 0, or 1 + the deepest argument's

    def edges(self) -> tuple[np.ndarray, np.ndarray]: ...  # (source, consumer), distinct

    def keys(self) -> list[Any] | None: ...  # per node, its group key; None: ``sig``


class RecordedView(GraphView, Protocol):
    """A GraphView that also shows the recorded arguments (what the chain planner reads)."""

    signatures: list[tuple[Any, tuple[Any, ...]]]  # per signature: (op, argument kinds)
    nobatch: set[int]

    def handles(self, sid: int) -> list[int]: ...

    def first_handle(self, sid: int) -> int: ...

    def first_nodes(self) -> dict[int, int]: ...

    def rows(self, sid: int) -> list[tuple[Any, ...]]: ...

    def first_row(self, sid: int) -> tuple[Any, ...]: ...

    def ids(self, sid: int) -> np.ndarray: ...


@dataclass(eq=False)
class ArrayGraph:
    """A :class:`GraphView` built by hand: per node its signature and depth, the edges.

    For tests of schedulers and for tools that make graphs without recording them::

        g = ArrayGraph(sig=[0, 0, 1], depth=[0, 0, 1], src=[0, 1], dst=[2, 2])
        depth_schedule(g)   # step 0: nodes 0 and 1; step 1: node 2
    """

    sig: Any
    depth: Any
    src: Any = ()
    dst: Any = ()
    group_keys: list[Any] | None = None

    def __post_init__(self) -> None:
        self.sig = np.asarray(self.sig, np.int64)
        self.depth = np.asarray(self.depth, np.int64)
        self.src = np.asarray(self.src, np.int64)
        self.dst = np.asarray(self.dst, np.int64)
        self.n = len(self.sig)
        self.count = np.bincount(self.sig).tolist() if self.n else []
        self.flat = not len(self.src)

    def edges(self) -> tuple[np.ndarray, np.ndarray]:
        return self.src, self.dst

    def keys(self) -> list[Any] | None:
        return self.group_keys


class Input(NamedTuple):
    """A node argument column that is one output of an earlier group of a whole plan:
    output ``out`` of the group of signature ``sid`` (or of slot ``sid``, see
    :class:`Group`), from handles of ``split(nsplit)``
    (0: used whole); row for row, or where ``rows`` is given, those rows of it: an int64
    array, one entry per member (one ``index_select``), or a slice of a contiguous run (a
    view)."""

    sid: int
    out: int
    nsplit: int
    rows: Any = None


class Pieces(NamedTuple):
    """A node argument column of a whole plan read from several earlier outputs: the
    ``parts`` (each an :class:`Input` with its rows) concatenated, then row ``order[i]`` of
    that for member ``i``."""

    parts: tuple[Input, ...]
    order: Any


@dataclass(slots=True, eq=False)
class Group:
    """Nodes that run as one batched call: same step, same signature.

    ``nodes`` are node ids (a list, or an int64 numpy array) in the order their rows take in
    the group's output; in a whole plan, a ``SignatureNodes`` (all the nodes of signature
    ``key``, in order, their ids read from the snapshot).  ``key`` is the signature id, extended with the ids of nobatch
    arguments where there are any.  ``inputs``, set by a planner that knows them, gives per
    argument position the :class:`Input` its column is (None at literal positions); the
    executor then takes those outputs as they are instead of gathering rows.

    ``slot``: in a whole plan whose signatures that read themselves are split by depth
    (``fold.scheduler.signature``), the number its :class:`Input` readers name this group's
    outputs by, where it holds part of its signature's nodes (an int64 array of their ids,
    in order); None: the signature id, the group holding all of its nodes.
    """

    key: Any
    nodes: Any  # Sequence[int] | numpy.ndarray
    inputs: tuple[Input | Pieces | None, ...] | None = None
    slot: int | None = None


@dataclass(slots=True, eq=False)
class Step:
    """Groups whose arguments are all computed by earlier steps."""

    groups: list[Group] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class Plan:
    """An execution order: steps run in order, groups of a step in any order.

    ``whole``: every group holds all the nodes of its signature and has its ``inputs`` (a
    chain of whole outputs, see ``fold.scheduler.chain``, or one group per signature, see
    ``fold.scheduler.signature``); the executor then keeps each group's outputs by
    signature and indexes rows only if an output list asks for it.
    """

    steps: list[Step]
    whole: bool = False

    @property
    def num_groups(self) -> int:
        return sum(len(s.groups) for s in self.steps)
