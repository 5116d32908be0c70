"""Chains of whole outputs: the plan of per-sample loops, found without sorting any node.

A per-sample training loop records ``f.add("forward", image)`` per sample, often followed by
``f.add("loss", logits, label)``: each op runs as one group on whole outputs of earlier
ones.  Where every node argument column of a signature is all the nodes of one earlier
signature in recording order (whole, or output k of one split), every signature sits at one
depth and the depth (or agenda) schedule would make it one group; :func:`chain_plan` says so
with a few list comparisons, done in C, and emits that plan with each column's
:class:`~fold.scheduler.plan.Input` filled in, so the executor passes the earlier outputs as
they are (no gather, no index).  For a graph of a few groups the general schedule and
gather planning cost more than the groups, every training step.
"""

from __future__ import annotations

from itertools import repeat
from typing import Any

import numpy as np

from fold._encoding import LIST, NODE, any_shape, low_bits, out_index, split_count
from fold.scheduler.plan import Group, Input, Plan, RecordedView, Step

__all__ = ["SignatureNodes", "chain_plan", "in_order", "one_shape", "whole_output"]


def _head(h: Any, first: dict[int, int]) -> Input | None:
    """The Input a column whose first handle is ``h`` would be, if ``h`` is (an output of)
    the first node of a signature; else None."""
    h0 = int(h)  # Nodes refuse arithmetic (it would not record); plain ints from here
    low = low_bits(h0)
    t = first.get(h0 - low)
    return None if t is None else Input(t, out_index(low), split_count(low))


def in_order(col: Any, handles: list[int], low: int) -> bool:
    """Whether ``col`` holds every node of ``handles`` in order, each with low bits ``low``."""
    # The nodes' own handles have no low bits, so the column equals theirs after subtracting
    # the first one's low bits only if all of its handles carry the same low bits.
    return (list(col) if low == 0 else list(map(int.__sub__, col, repeat(low)))) == handles


def whole_output(a: RecordedView, items: list[Any]) -> Input | None:
    """The Input a list of handles is, where it is a whole output (every node of one
    signature, in order, whole or output k of one split); else None."""
    src = _head(items[0], a.first_nodes())
    if src is None or a.count[src.sid] != len(items):
        return None
    return src if in_order(items, a.handles(src.sid), low_bits(int(items[0]))) else None


class SignatureNodes:
    """A group's ``nodes`` in a whole plan: every node of signature ``sid``, in order.

    Its length is ``count``; the ids themselves are the snapshot's (``ids(view)``), read
    only where something needs rows.  Holding no snapshot, a whole plan is the same for
    every graph of one structure, and :func:`chain_plan` reuses it (a training loop records
    a graph of the same structure every step)."""

    __slots__ = ("sid", "count")

    def __init__(self, sid: int, count: int) -> None:
        self.sid, self.count = sid, count

    def __len__(self) -> int:
        return self.count

    def ids(self, view: RecordedView) -> np.ndarray:
        return view.ids(self.sid)


# (counts, heads) -> plan, for the structures seen last (a training loop's few).
_PLANS: dict[tuple[Any, ...], Plan] = {}


def chain_plan(a: RecordedView) -> Plan | None:
    """The plan of a chain of whole outputs (see above), or None where ``a`` is no chain."""
    if a.nobatch or not a.n:
        return None
    counts = a.count
    first = a.first_nodes()
    # A cheap pass on the first node of each column: most graphs that are not chains (trees,
    # sequences) fail here, before any column is read whole.
    heads: list[tuple[Input | None, ...]] = []
    for s, (op, kinds) in enumerate(a.signatures):
        if LIST in kinds:  # list arguments are gathered, never a whole output
            return None
        if (
            any(map(any_shape, kinds))
            and getattr(op, "ragged_call", None) is None
            and not one_shape(a.rows(s), kinds)
        ):
            # Literal tensors of several shapes: the executor runs them in parts, or, where
            # the op takes rows of several lengths at once (``ragged_call``), whole.
            return None
        if NODE not in kinds:
            heads.append((None,) * len(kinds))
            continue
        row0 = a.first_row(s)
        head: list[Input | None] = [None] * len(kinds)
        for j, k in enumerate(kinds):
            if k == NODE:
                src = head[j] = _head(row0[j], first)
                if src is None or src.sid >= s or counts[src.sid] != counts[s]:
                    return None
        heads.append(tuple(head))
    for s, head in enumerate(heads):
        if any(head):
            rows = a.rows(s)
            for j, src in enumerate(head):
                if src is not None:
                    col = [r[j] for r in rows]
                    if not in_order(col, a.handles(src.sid), low_bits(int(col[0]))):
                        return None
    # The plan is its structure only: per signature its count and its columns' inputs.
    key = (tuple(counts), tuple(heads))
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) > 64:
            _PLANS.clear()
        plan = _PLANS[key] = _make_plan(heads, counts)
    return plan


def one_shape(rows: Any, kinds: tuple[Any, ...]) -> bool:
    """Whether every literal column of any shape (see ``fold._encoding.any_shape``) of a
    signature's ``rows`` holds tensors of one shape (a chain's group, or a graph of one op,
    concatenates it whole; the executor runs several shapes in parts)."""
    for j, k in enumerate(kinds):
        if any_shape(k):
            shape = rows[0][j].shape
            if any(r[j].shape != shape for r in rows):
                return False
    return True


def _make_plan(heads: list[tuple[Input | None, ...]], counts: list[int]) -> Plan:
    """Each signature one group, at 1 + the depth of the groups it reads (0 for none)."""
    depth: list[int] = []
    by_depth: dict[int, list[Group]] = {}
    for s, head in enumerate(heads):
        d = 1 + max((depth[src.sid] for src in head if src is not None), default=-1)
        depth.append(d)
        by_depth.setdefault(d, []).append(Group(s, SignatureNodes(s, counts[s]), head))
    return Plan([Step(by_depth[d]) for d in sorted(by_depth)], whole=True)
