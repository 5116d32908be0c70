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

from fold._encoding import NODE, depth_of, low_bits, out_index, split_count
from fold.scheduler.plan import Group, Input, Plan, RecordedView, Step

__all__ = ["chain_plan", "whole_output"]


def _head(h: Any, first: dict[int, int]) -> Input | None:
    """The Input a column whose first handle is ``h`` would be, if ``h`` is (an output of)
    the first node of a signature; else None."""
    h0 = int(h)  # Nodes refuse arithmetic (it would not record); plain ints from here
    low = low_bits(h0)
    t = first.get(h0 - low)
    return None if t is None else Input(t, out_index(low), split_count(low))


def _in_order(col: Any, src: Input, handles: list[int], low: int) -> bool:
    """Whether ``col`` holds every node of ``handles`` in order, each with low bits ``low``."""
    # The nodes' own handles have no low bits, so the column equals theirs after subtracting
    # the first one's low bits only if all of its handles carry the same low bits.
    return (list(col) if low == 0 else list(map(int.__sub__, col, repeat(low)))) == handles


def chain_plan(a: RecordedView) -> Plan | None:
    """The plan of a chain of whole outputs (see above), or None where ``a`` is no chain."""
    if a.nobatch or not a.n:
        return None
    counts = a.count
    first = a.first_nodes()
    # A cheap pass on the first node of each column: most graphs that are not chains (trees,
    # sequences) fail here, before any column is read whole.
    heads: list[list[Input | None]] = []
    for s, (_op, kinds) in enumerate(a.signatures):
        row0 = a.first_row(s)
        head: list[Input | None] = [None] * len(kinds)
        for j, k in enumerate(kinds):
            if k == NODE:
                src = head[j] = _head(row0[j], first)
                if src is None or src.sid >= s or counts[src.sid] != counts[s]:
                    return None
        heads.append(head)
    for s, head in enumerate(heads):
        if any(head):
            cols = list(zip(*a.rows(s)))
            for col, src in zip(cols, head):
                if src is not None:
                    low = low_bits(int(col[0]))
                    if not _in_order(col, src, a.handles(src.sid), low):
                        return None
    by_depth: dict[int, list[Group]] = {}
    for s, head in enumerate(heads):
        nodes = np.arange(counts[0]) if len(counts) == 1 else a.ids(s)
        group = Group(s, nodes, tuple(head))
        by_depth.setdefault(depth_of(a.first_handle(s)), []).append(group)
    return Plan([Step(by_depth[d]) for d in sorted(by_depth)], whole=True)


def whole_output(a: RecordedView, items: list[Any]) -> Input | None:
    """The Input that a list of handles is (a whole output, every node in order), or None."""
    src = _head(items[0], a.first_nodes())
    if src is None or a.count[src.sid] != len(items):
        return None
    if not _in_order(items, src, a.handles(src.sid), low_bits(int(items[0]))):
        return None
    return src
