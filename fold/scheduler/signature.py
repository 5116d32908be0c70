"""One group per signature, where the graph allows it: the plan with the fewest groups.

A graph whose signatures never read themselves, directly or through one another, can run
each signature's nodes as ONE group, in a topological order of the signatures: every node
a group reads belongs to a signature run before it.  No plan has fewer groups.  Depth makes
more where a signature's nodes sit at several depths: an autobatch round in which one
example's feature row is a padding vector made one op earlier and another's an encoder row
read at once puts the ``cat`` of the features, and every op after it, at two depths, and
each op runs twice.  The agenda would merge them too, but plans node by node.

Where the recorded arguments are at hand (a Fold's snapshot) and no column needs the
executor's general gathers (no list arguments, literal tensors of one shape per column),
the plan is a *whole* plan: each node column is named as the rows it reads of the earlier
groups' outputs (:class:`~fold.scheduler.plan.Input` with rows, or
:class:`~fold.scheduler.plan.Pieces` where it reads several), so the executor takes one
``index_select`` per source and keeps no value tables.  Else the groups run on the general
gathers.

Recursive graphs (a tree's cells, a sequence's steps) have a signature that reads itself
and get no plan here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fold._encoding import (
    LIST,
    LOW_MASK,
    NODE,
    any_shape,
    list_handles,
    node_id,
    out_index,
    split_count,
)
from fold.arrays import distinct
from fold.scheduler.chain import SignatureNodes, one_shape
from fold.scheduler.depth import plan_by_level
from fold.scheduler.plan import GraphView, Group, Input, Pieces, Plan, Step

__all__ = ["signature_levels", "signature_schedule"]


def _reads(a: GraphView) -> tuple[list[int], list[int]]:
    """(read, reader) signature pairs, distinct: from the recorded columns where the view
    has them (no per-node edge list), else from its edges."""
    nsig = len(a.count)
    sig = a.sig
    columns = getattr(a, "columns", None)
    if columns is None:
        src, dst = a.edges()
        pairs = distinct(sig[src] * nsig + sig[dst]) if len(src) else src
    else:
        found = []
        for sid, (_op, kinds) in enumerate(a.signatures):
            if NODE not in kinds and LIST not in kinds:
                continue
            cols, node_js, _hmat, decoded = columns(sid)
            ids = [decoded[0].ravel()] if node_js else []
            for j, k in enumerate(kinds):
                if k == LIST:
                    ids.append(node_id(list_handles(cols[j])))
            read = np.concatenate(ids) if len(ids) > 1 else ids[0]
            if len(read):
                found.append(distinct(sig[read]) * nsig + sid)
        pairs = np.concatenate(found) if found else np.zeros(0, np.int64)
    return (pairs // nsig).tolist(), (pairs % nsig).tolist()


def signature_levels(a: GraphView) -> np.ndarray | None:
    """Per signature, its level in the graph of signatures (0 where it reads no node, else
    1 + the highest level of the signatures it reads); None where some signature reads
    itself, directly or through others.  A few array operations per signature, then a walk
    over the signatures (not the nodes)."""
    nsig = len(a.count)
    levels = np.zeros(nsig, np.int64)
    reads, readers = _reads(a)
    if not reads:
        return levels
    waiting = [0] * nsig  # per signature, the signatures it reads that have no level yet
    after: list[list[int]] = [[] for _ in range(nsig)]
    for s, d in zip(reads, readers):
        if s == d:
            return None
        waiting[d] += 1
        after[s].append(d)
    ready = [s for s in range(nsig) if not waiting[s]]
    done = 0
    while ready:
        s = ready.pop()
        done += 1
        for d in after[s]:
            if levels[d] <= levels[s]:
                levels[d] = levels[s] + 1
            waiting[d] -= 1
            if not waiting[d]:
                ready.append(d)
    return levels if done == nsig else None


def signature_schedule(a: GraphView) -> Plan | None:
    """Every signature's nodes as one group, the groups in order of the signatures' levels
    (see above): a whole plan where the recorded columns allow one; None where a signature
    reads itself, or where nobatch nodes give nodes group keys of their own."""
    if a.n == 0 or a.keys() is not None:
        return None
    levels = signature_levels(a)
    if levels is None:
        return None
    whole = _whole_plan(a, levels) if hasattr(a, "columns") else None
    return whole if whole is not None else plan_by_level(levels[a.sig], a.sig, len(a.count))


def _whole_plan(a: Any, levels: np.ndarray) -> Plan | None:
    """The plan with each node column's rows named (see above), or None where a column
    needs the general gathers."""
    by_level: dict[int, list[Group]] = {}
    for sid, (_op, kinds) in enumerate(a.signatures):
        if LIST in kinds:
            return None
        if any(map(any_shape, kinds)) and not one_shape(a.rows(sid), kinds):
            return None  # literal tensors of several shapes: the executor runs them in parts
        inputs: list[Input | Pieces | None] = [None] * len(kinds)
        if NODE in kinds:
            _cols, node_js, hmat, _decoded = a.columns(sid)
            for c, j in enumerate(node_js):
                inputs[j] = _column(a, hmat[:, c])
        group = Group(sid, SignatureNodes(sid, a.count[sid]), tuple(inputs))
        by_level.setdefault(int(levels[sid]), []).append(group)
    return Plan([Step(by_level[k]) for k in sorted(by_level)], whole=True)


def _column(a: Any, handles: np.ndarray) -> Input | Pieces:
    """What a node column of handles reads: one output (whole and in order, or some of its
    rows), or pieces of several."""
    ids = node_id(handles)
    src = a.sig[ids]
    rows = a.pos[ids]
    low = handles & LOW_MASK
    key = src * (LOW_MASK + 1) + low  # (signature, output of which split) per member
    if (key == key[0]).all():
        sid, bits = int(src[0]), int(low[0])
        n, first = len(rows), int(rows[0])
        if int(rows[-1]) - first == n - 1 and bool((np.diff(rows) == 1).all()):
            # a contiguous run: the output whole, or a view of it (no copy)
            run = None if n == a.count[sid] else slice(first, first + n)
            return Input(sid, out_index(bits), split_count(bits), run)
        return Input(sid, out_index(bits), split_count(bits), rows)
    order = np.argsort(key, kind="stable")
    sk = key[order]
    cuts = (np.flatnonzero(sk[1:] != sk[:-1]) + 1).tolist()
    parts = []
    for lo, hi in zip([0, *cuts], [*cuts, len(order)]):
        first = int(order[lo])
        bits = int(low[first])
        parts.append(Input(int(src[first]), out_index(bits), split_count(bits), rows[order[lo:hi]]))
    where = np.empty(len(order), np.int64)
    where[order] = np.arange(len(order))
    return Pieces(tuple(parts), where)
