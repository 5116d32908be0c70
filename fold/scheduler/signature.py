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
    depth_of,
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


def _levels(nsig: int, pairs: np.ndarray) -> np.ndarray | None:
    """Per signature, its level in the graph of signatures given by ``pairs`` (read * nsig
    + reader, distinct): 0 where it reads no node, else 1 + the highest level of the
    signatures it reads; None where some signature reads itself, directly or through
    others.  A walk over the signatures (not the nodes)."""
    if not len(pairs):
        return np.zeros(nsig, np.int64)
    levels = [0] * nsig
    waiting = [0] * nsig  # per signature, the signatures it reads that have no level yet
    after: list[list[int]] = [[] for _ in range(nsig)]
    for s, d in zip((pairs // nsig).tolist(), (pairs % nsig).tolist()):
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
    return np.array(levels, np.int64) if done == nsig else None


def signature_levels(a: GraphView) -> np.ndarray | None:
    """Per signature, its level in the graph of signatures (see ``_levels``), from the
    graph's edges."""
    nsig = len(a.count)
    src, dst = a.edges()
    sig = a.sig
    return _levels(nsig, distinct(sig[src] * nsig + sig[dst]) if len(src) else src)


def signature_schedule(a: GraphView, split: bool = False) -> Plan | None:
    """Every signature's nodes as one group, the groups in order of the signatures' levels
    (see above): a whole plan where the recorded columns allow one; None where a signature
    reads itself, or where nobatch nodes give nodes group keys of their own.

    With ``split``, where signatures read themselves (a decoder's first round: the ``cat``
    before its cell and the one after it are one op) and the graph has no list arguments,
    the signatures on such cycles are split by depth and the others kept whole: a whole
    plan still (see ``_split_schedule``), for a round whose ops take rows of several lengths
    at once, which the general gathers would run in parts."""
    if a.n == 0 or a.keys() is not None:
        return None
    nsig = len(a.count)
    if not hasattr(a, "columns"):
        levels = signature_levels(a)
        return None if levels is None else plan_by_level(levels[a.sig], a.sig, nsig)
    if hasattr(a, "node_columns") and not any(LIST in kinds for _, kinds in a.signatures):
        fused = _fused_schedule(a, nsig, split)
        if fused is not _SLOW:
            return fused  # type: ignore[return-value]
    return _per_signature(a, nsig)


def _per_signature(a: Any, nsig: int) -> Plan | None:
    """``signature_schedule`` of a recorded graph, signature by signature (list arguments;
    handles to check)."""
    # Recorded columns: what each signature reads, from its handles (no edge list), and
    # per node column its sources, each signature's columns at once.
    sig, pos = a.sig, a.pos
    found: list[np.ndarray] = []
    reads: list[Any] = []
    whole = True
    for sid, (_op, kinds) in enumerate(a.signatures):
        lists = [j for j, k in enumerate(kinds) if k == LIST]
        if NODE not in kinds and not lists:
            reads.append(None)
            continue
        cols, node_js, hmat, decoded = a.columns(sid)
        src = sig[decoded[0]] if node_js else None
        parts = [src.ravel()] if src is not None else []
        for j in lists:
            parts.append(sig[node_id(list_handles(cols[j]))])
        read = np.concatenate(parts) if len(parts) > 1 else parts[0]
        if len(read):
            found.append(distinct(read) * nsig + sid)
        reads.append((node_js, hmat, src, pos[decoded[0]]) if src is not None else None)
        whole = whole and not lists
    levels = _levels(nsig, np.concatenate(found) if found else np.zeros(0, np.int64))
    if levels is None:
        return None
    plan = _whole_plan(a, levels, reads) if whole else None
    return plan if plan is not None else plan_by_level(levels[sig], sig, nsig)


_SLOW = object()


def _fused_schedule(a: Any, nsig: int, split: bool = False) -> Plan | None | object:
    """``signature_schedule`` of a graph without list arguments, every node column of every
    signature at once: the columns one after another in one array, each step of the
    per-signature path one array operation over all of them (an autobatch round plans a
    dozen signatures, and numpy's cost per call was most of its planning).  The same plan as
    the per-signature path (tests/test_scheduler.py compares them); ``_SLOW`` where a
    handle is not one this graph made (that path names it)."""
    sig, pos, depth = a.sig, a.pos, a.depth
    reading = [s for s, (_op, kinds) in enumerate(a.signatures) if NODE in kinds]
    if not reading:
        levels = np.zeros(nsig, np.int64)
        return (
            _assemble(a, levels, {}) if _shapes_allow(a) else plan_by_level(levels[sig], sig, nsig)
        )
    counts = a.count
    widths = [sum(k == NODE for k in a.signatures[s][1]) for s in reading]
    handles = np.concatenate([a.node_columns(s) for s in reading])
    # One segment per node column: its signature's count of handles.
    seg_sig = np.repeat(np.asarray(reading, np.int64), widths)
    seg_len = np.asarray(counts, np.int64)[seg_sig]
    ends = np.cumsum(seg_len)
    starts = ends - seg_len
    ids = node_id(handles)
    if (handles < 0).any() or (ids >= a.n).any() or (depth_of(handles) != depth[ids]).any():
        return _SLOW
    src = sig[ids]
    rows = pos[ids]
    low = handles & LOW_MASK
    key = src * (LOW_MASK + 1) + low  # (signature, output of which split)
    single = np.logical_and.reduceat(key == np.repeat(key[starts], seg_len), starts)
    ok = np.empty(len(rows), bool)
    np.equal(rows[1:] - rows[:-1], 1, out=ok[:-1])
    ok[ends - 1] = True  # a column's last row has no next in it
    steps = np.logical_and.reduceat(ok, starts)
    # (read, reader) pairs: a column of one source gives one, any other each of its rows'.
    pairs = [src[starts] * nsig + seg_sig]
    if not single.all():
        mixed = np.repeat(~single, seg_len)
        pairs.append(src[mixed] * nsig + np.repeat(seg_sig, seg_len)[mixed])
    found = distinct(np.concatenate(pairs))
    levels = _levels(nsig, found)
    if levels is None:
        if split and _shapes_allow(a):
            return _split_schedule(a, nsig, _cyclic(nsig, found), reading, widths)
        return None
    if not _shapes_allow(a):
        return plan_by_level(levels[sig], sig, nsig)
    inputs: dict[int, list[Input | Pieces | None]] = {}
    seg = 0
    for s in reading:
        kinds = a.signatures[s][1]
        got: list[Input | Pieces | None] = [None] * len(kinds)
        n = counts[s]
        for j in (j for j, k in enumerate(kinds) if k == NODE):
            lo = int(starts[seg])
            cut = slice(lo, lo + n)
            got[j] = _column_input(
                counts, src[cut], rows[cut], low[cut], key[cut], single[seg], steps[seg]
            )
            seg += 1
        inputs[s] = got
    return _assemble(a, levels, inputs)


def _cyclic(nsig: int, pairs: np.ndarray) -> np.ndarray:
    """Per signature, whether it lies on a cycle of the graph of signatures ``pairs`` (read
    * nsig + reader): reads itself, directly or through others.  Those are the signatures
    that both reach and are reached by one they read (a walk over the signatures)."""
    after: list[list[int]] = [[] for _ in range(nsig)]
    before: list[list[int]] = [[] for _ in range(nsig)]
    for s, d in zip((pairs // nsig).tolist(), (pairs % nsig).tolist()):
        after[s].append(d)
        before[d].append(s)

    def reach(start: list[int], edges: list[list[int]]) -> set[int]:
        seen: set[int] = set()
        todo = list(start)
        while todo:
            x = todo.pop()
            if x not in seen:
                seen.add(x)
                todo.extend(edges[x])
        return seen

    out = np.zeros(nsig, bool)
    for s in range(nsig):
        if out[s]:
            continue
        reached = reach(after[s], after)
        if s in reached:  # s reaches itself: its cycle's signatures also reach s
            out[list(reached & reach(before[s], before))] = True
    return out


def _split_schedule(
    a: Any, nsig: int, cyclic: np.ndarray, reading: list[int], widths: list[int]
) -> Plan | None:
    """The whole plan of a graph whose ``cyclic`` signatures read themselves: each of those
    signatures' nodes grouped by depth, each other signature whole; a group of part of a
    signature's nodes is named by a slot (see :class:`~fold.scheduler.plan.Group`) from
    ``nsig`` on.  Its groups read only groups of lower levels: along an edge a split group's
    depth grows, and no whole signature lies on a cycle."""
    sig, pos, depth = a.sig, a.pos, a.depth
    n = a.n
    vid = sig.copy()  # per node its group's slot
    split = cyclic[sig]
    pieces = sig[split] * (int(depth.max()) + 1) + depth[split]
    uniq, inv = np.unique(pieces, return_inverse=True)
    vid[split] = nsig + inv
    nv = nsig + len(uniq)
    vcount = np.bincount(vid, minlength=nv)
    order = np.argsort(vid, kind="stable")  # per slot its nodes, in node order
    first = np.cumsum(vcount) - vcount
    posv = np.empty(n, np.int64)
    posv[order] = np.arange(n) - np.repeat(first, vcount)
    slot_sig = np.concatenate([np.arange(nsig), uniq // (int(depth.max()) + 1)])
    counts = vcount.tolist()
    columns = {s: (a.node_columns(s), w) for s, w in zip(reading, widths)}
    inputs: dict[int, list[Input | Pieces | None]] = {}
    members: dict[int, np.ndarray] = {}
    # Every node column of every slot one after another in one array (a segment per
    # column), each step below one array operation over all of them, as _fused_schedule
    # does (the translation tutorial's rounds plan some 30 columns each).
    reads: list[tuple[int, int]] = []  # per slot that reads nodes: (slot, its signature)
    flats: list[np.ndarray] = []
    seg_len: list[int] = []
    for v in np.flatnonzero(vcount).tolist():
        s = int(slot_sig[v])
        ids = order[first[v] : first[v] + counts[v]]
        members[v] = ids
        if s not in columns:
            continue
        flat, width = columns[s]
        cols = flat.reshape(width, a.count[s])
        flats.append((cols if v < nsig else cols[:, pos[ids]]).ravel())
        seg_len += [counts[v]] * width
        reads.append((v, s))
    found = np.zeros(0, np.int64)
    if flats:
        h = np.concatenate(flats)
        lens = np.asarray(seg_len, np.int64)
        ends = np.cumsum(lens)
        starts = ends - lens
        src_ids = node_id(h)
        src, rows, low = vid[src_ids], posv[src_ids], h & LOW_MASK
        key = src * (LOW_MASK + 1) + low
        single = np.logical_and.reduceat(key == np.repeat(key[starts], lens), starts).tolist()
        ok = np.empty(len(rows), bool)
        np.equal(rows[1:] - rows[:-1], 1, out=ok[:-1])
        ok[ends - 1] = True  # a column's last row has no next in it
        steps = np.logical_and.reduceat(ok, starts).tolist()
        seg_slot = np.repeat(np.asarray([v for v, s in reads for _ in range(columns[s][1])]), lens)
        found = distinct(src * nv + seg_slot)
        seg = 0
        for v, s in reads:
            kinds = a.signatures[s][1]
            got: list[Input | Pieces | None] = [None] * len(kinds)
            for j in (j for j, k in enumerate(kinds) if k == NODE):
                lo = int(starts[seg])
                cut = slice(lo, lo + counts[v])
                got[j] = _column_input(
                    counts, src[cut], rows[cut], low[cut], key[cut], single[seg], steps[seg]
                )
                seg += 1
            inputs[v] = got
    levels = _levels(nv, found)
    if levels is None:  # (cannot be: see above; the caller then plans by depth)
        return None
    pieces = {v: (int(slot_sig[v]), ids) for v, ids in members.items() if v >= nsig}
    return _assemble(a, levels, inputs, pieces)


def _assemble(
    a: Any,
    levels: np.ndarray,
    inputs: dict[int, list[Any]],
    pieces: dict[int, tuple[int, np.ndarray]] | None = None,
) -> Plan:
    """The whole plan of per-signature ``inputs`` (none for a signature that reads no node),
    its groups by level; with ``pieces`` (slot -> its signature and node ids: the groups
    of the signatures split by depth, see ``_split_schedule``), those in place of their
    signatures' groups, ``inputs`` and ``levels`` by slot."""
    split = {sid for sid, _ in pieces.values()} if pieces else set()
    groups = [
        (sid, sid, SignatureNodes(sid, a.count[sid]), None)
        for sid in range(len(a.signatures))
        if sid not in split
    ]
    groups += [(slot, sid, ids, slot) for slot, (sid, ids) in (pieces or {}).items()]
    by_level: dict[int, list[Group]] = {}
    for key, sid, nodes, slot in groups:
        got = inputs.get(key)
        kinds = a.signatures[sid][1]
        group = Group(sid, nodes, tuple(got) if got is not None else (None,) * len(kinds), slot)
        by_level.setdefault(int(levels[key]), []).append(group)
    return Plan([Step(by_level[k]) for k in sorted(by_level)], whole=True)


def _shapes_allow(a: Any) -> bool:
    """Whether every literal column of any shape holds one shape, where its op runs several
    in parts (see ``_whole_plan``)."""
    return all(
        not any(map(any_shape, kinds))
        or getattr(op, "ragged_call", None) is not None
        or one_shape(a.rows(sid), kinds)
        for sid, (op, kinds) in enumerate(a.signatures)
    )


def _whole_plan(a: Any, levels: np.ndarray, reads: list[Any]) -> Plan | None:
    """The plan with each node column's rows named (see above), or None where a column
    needs the general gathers."""
    if not _shapes_allow(a):
        # Literal tensors of several shapes: the executor runs them in parts (or whole,
        # where the op takes rows of several lengths at once: ``ragged_call``).
        return None
    inputs: dict[int, list[Input | Pieces | None]] = {}
    for sid, (_op, kinds) in enumerate(a.signatures):
        if reads[sid] is None:
            continue
        node_js, hmat, src, rows = reads[sid]
        low = hmat & LOW_MASK
        key = src * (LOW_MASK + 1) + low  # (signature, output of which split)
        single = (key == key[0]).all(axis=0).tolist()
        steps = (np.diff(rows, axis=0) == 1).all(axis=0).tolist()
        got: list[Input | Pieces | None] = [None] * len(kinds)
        for c, j in enumerate(node_js):
            got[j] = _column_input(
                a.count, src[:, c], rows[:, c], low[:, c], key[:, c], single[c], steps[c]
            )
        inputs[sid] = got
    return _assemble(a, levels, inputs)


def _column_input(
    counts: list[int],
    src: np.ndarray,
    rows: np.ndarray,
    low: np.ndarray,
    key: np.ndarray,
    single: bool,
    step: bool,
) -> Input | Pieces:
    """One node column of a whole plan, from its members' source signatures, rows in them,
    low handle bits and (signature, output) keys: the output it reads whole, a run of it,
    its rows, or where it reads several outputs, their ``Pieces``."""
    if not single:
        return _pieces(src, rows, low, key)
    source, bits, first = int(src[0]), int(low[0]), int(rows[0])
    if step:  # a contiguous run: the output whole, or a view of it
        n = len(rows)
        run = None if n == counts[source] else slice(first, first + n)
        return Input(source, out_index(bits), split_count(bits), run)
    return Input(source, out_index(bits), split_count(bits), rows.copy())


def _pieces(src: np.ndarray, rows: np.ndarray, low: np.ndarray, key: np.ndarray) -> Pieces:
    """A node column that reads several outputs: per output the rows it reads, and where
    each member's row lies in their concatenation."""
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
