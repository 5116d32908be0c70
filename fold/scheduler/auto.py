"""The default schedule, ``strategy="auto"``: depth, the agenda or lockstep, whichever is
estimated to cost less.

All three schedules run every node once, so they do the same arithmetic.  What differs is how
many batched calls (groups) the work is split into, and how much data the argument columns
of those groups copy:

- every group costs a fixed amount: its argument gathers, the op's own kernel launches,
  their backward (0.3-3 ms on a CPU for the models of ``benchmarks/dynamic.py``, tens of
  microseconds for one small layer);
- a column that is not one earlier group's output in order (or a contiguous run of it) is
  copied: a ``cat`` of pieces or an ``index_select`` from a value table, and its gradient
  is scattered back in backward;
- a column that reads one source row several times (decoder steps reading their example's
  memory) materialises every copy: the group's working set grows with the readers, not with
  the data, and its backward accumulates the copies one by one.  The agenda makes such
  groups where it merges nodes of many steps: 1600 steps reading eight (1000, 16) memories
  become one group of 100 MB, where depth's groups read the eight memories in place.

So a plan's cost is estimated as (:func:`plan_cost`)::

    groups * GROUP + bytes copied * COPY + bytes copied more than once * REPEAT

with per-device constants (``COSTS``; the CPU's measured on ``benchmarks/dynamic.py``'s
memory graph, the GPU's from launch latency and memory bandwidth).  Bytes per row of each
signature's outputs come from earlier applies of the same object (the executor records
them in :class:`Facts`, kept with the object); before the first apply every row counts
``DEFAULT_ROW_BYTES``.  The estimate costs a few array operations over the graph's edges
(about 1 ms for 10k edges), no Python work per node.

The rule:

0. where an op of the graph that takes literal rows of several lengths at once
   (fold.autobatch's ops that pad, ``ragged_call``) is given rows of several lengths
   (attention over memories of several lengths, an encoder over sentences of several
   lengths), plan one group per signature as a whole plan (see step 3), where the columns
   allow one: no plan has fewer groups, and each such group runs as one call on its rows
   padded, where the general gathers would run it in parts, one per length.  Signatures
   that read themselves (a decoder's first round, whose ``cat`` before its cell and after it
   are one op) are split by depth there, the rest kept whole (``signature_schedule`` with
   ``split``);
1. plan by depth (cheap: a sort, about 0.5 ms for 5k nodes);
2. if that plan has one group per signature, no schedule can have fewer, and depth reads
   every column from its source in order where one exists: take it (trees with list
   arguments, message passing, MNIST);
3. else plan one group per signature where no signature reads itself
   (``fold.scheduler.signature``: an autobatch round, whose ops sit at several depths where
   examples take different branches), the agenda, and lockstep (``fold.scheduler.lockstep``:
   the examples' programs advancing one step of each op's chain at a time, as hand-written
   batching of a shift-reduce parser does); estimate them all, and take the cheapest; on a
   tie, depth, then one group per signature, then the agenda.

Step 3 costs the other plans and their estimates (2-16 ms for 1k-8k nodes), so its
outcome is remembered per model: graphs of the same signatures (ops and argument kinds)
applied to the same object take the remembered schedule, and step 3 runs again every
``RECHECK``-th such graph, in case the graphs changed character.  A choice made while some
signature's row size was still unknown is not remembered: the next graph decides again with
the sizes the first apply measured.  So in a training loop ``auto`` costs the chosen
schedule's planning plus, amortised, 1/``RECHECK`` of the other's.  The rule's figures
(``auto`` against the better of depth and agenda on each model) are in docs/benchmarks.md.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fold._encoding import LIST, NODE, OUT_MASK, any_shape, list_handles, list_lengths, node_id
from fold.scheduler.agenda import agenda_schedule
from fold.scheduler.chain import SignatureNodes, one_shape
from fold.scheduler.depth import depth_schedule
from fold.scheduler.lockstep import lockstep_schedule
from fold.scheduler.plan import GraphView, Plan
from fold.scheduler.signature import signature_schedule

__all__ = [
    "COSTS",
    "DEFAULT_ROW_BYTES",
    "RECHECK",
    "Facts",
    "auto_schedule",
    "facts_of",
    "group_count",
    "plan_cost",
]

RECHECK = 32
# Seconds per group, per byte copied, per byte copied again (a repeated read), by device
# type.  CPU: on benchmarks/dynamic.py's memory graph, one thread, forward and backward
# (pieces cost about 0.4 ns a byte; the agenda's repeated reads 1.5 ns more).  GPU: about
# ten kernel launches a group, copies at about 1 TB/s; not measured here.
COSTS = {"cpu": (50e-6, 0.5e-9, 1.5e-9), "cuda": (30e-6, 1e-12, 3e-12)}
DEFAULT_ROW_BYTES = 512
# Graphs planned without an object (Fold.plan(), a hand-built graph): signatures -> [the
# schedule step 3 chose, graphs planned with it since].
_CHOSEN: dict[Any, list[Any]] = {}


@dataclass(eq=False)
class Facts:
    """What applies of one object have shown, for ``auto``: per signature ``(op, kinds)``
    the bytes of one node's row of each output, the device type, and the choices made."""

    row_bytes: dict[Any, tuple[int, ...]] = field(default_factory=dict)
    device: str = "cpu"
    chosen: dict[Any, list[Any]] = field(default_factory=dict)

    def measured(self, signature: Any, row_bytes: tuple[int, ...]) -> None:
        """Keep the row size an apply measured (at most ``4096`` signatures: a graph of a new
        callable per node, for one, would make them without end)."""
        if len(self.row_bytes) >= 4096:
            self.row_bytes.clear()
        self.row_bytes[signature] = row_bytes

    def forget(self) -> None:
        """Drop what was measured and chosen (and the ops the keys hold)."""
        self.row_bytes.clear()
        self.chosen.clear()


_FACTS: weakref.WeakKeyDictionary[Any, Facts] = weakref.WeakKeyDictionary()


_NO_OBJECT = Facts()  # applies with no object (callable ops, autobatch's rounds on the CPU)


def facts_of(obj: Any) -> Facts:
    """The facts kept with ``obj``: one set for all applies with ``None`` (their ops are
    callables, which key their signatures themselves), fresh ones for this apply alone
    where ``obj`` cannot be weakly referenced."""
    if obj is None:
        return _NO_OBJECT
    try:
        got = _FACTS.get(obj)
        if got is None:
            got = _FACTS[obj] = Facts()
        return got
    except TypeError:
        return Facts()


def group_count(plan: Plan) -> int:
    """The number of batched calls a plan makes."""
    return sum(len(step.groups) for step in plan.steps)


def plan_cost(a: GraphView, plan: Plan, facts: Facts | None = None) -> tuple[float, bool]:
    """The estimated seconds of ``plan`` (forward and backward, see above), and whether every
    signature's row size was known.  A graph without recorded columns (an ``ArrayGraph``)
    is estimated by its groups alone."""
    group_s, copy_s, repeat_s = COSTS.get(facts.device if facts else "cpu", COSTS["cpu"])
    groups = [
        g.nodes.ids(a) if type(g.nodes) is SignatureNodes else g.nodes
        for step in plan.steps
        for g in step.groups
    ]
    cost = len(groups) * group_s
    signatures = getattr(a, "signatures", None)
    if signatures is None or not groups or a.n == 0:
        return cost, True
    sizes = np.fromiter(map(len, groups), np.int64, len(groups))
    gid = np.empty(a.n, np.int64)
    pos = np.empty(a.n, np.int64)
    members = np.concatenate([np.asarray(g, np.int64) for g in groups])
    gid[members] = np.repeat(np.arange(len(groups)), sizes)
    pos[members] = np.arange(len(members)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    table, known = _row_bytes(signatures, facts)

    # Every read of a node value by a group: (column key, source node, output index), a
    # column being one argument position of one group.
    keys, srcs, outs = [], [], []
    offset = 0
    for sid, (_op, kinds) in enumerate(signatures):
        if NODE not in kinds and LIST not in kinds:
            continue
        cols, node_js, _hmat, decoded = a.columns(sid)
        cg = gid[a.ids(sid)]
        if node_js:
            width = len(node_js)
            keys.append((cg[:, None] * width + np.arange(width)).ravel() + offset)
            srcs.append(decoded[0].ravel())
            outs.append(decoded[1].ravel())
            offset += len(groups) * width
        for j, k in enumerate(kinds):
            if k == LIST:
                h = list_handles(cols[j])
                keys.append(np.repeat(cg, list_lengths(cols[j])) + offset)
                srcs.append(node_id(h))
                outs.append(h & OUT_MASK)
                offset += len(groups)
    if not keys:
        return cost, known
    key, src, out = np.concatenate(keys), np.concatenate(srcs), np.concatenate(outs)
    if not len(key):
        return cost, known
    nbytes = table[a.sig[src], np.minimum(out, table.shape[1] - 1)]
    read = src * (OUT_MASK + 1) + out
    order = np.lexsort((read, key))
    key, read, nbytes, src = key[order], read[order], nbytes[order], src[order]
    new = np.empty(len(key), bool)
    new[0] = True
    np.not_equal(key[1:], key[:-1], out=new[1:])
    starts = np.flatnonzero(new)
    again = ~new
    again[1:] &= read[1:] == read[:-1]  # the column read this row already
    rows = np.diff(np.append(starts, len(key)))
    sg, sp = gid[src], pos[src]
    one_source = np.minimum.reduceat(sg, starts) == np.maximum.reduceat(sg, starts)
    span = np.maximum.reduceat(sp, starts) - np.minimum.reduceat(sp, starts) + 1
    repeats = np.add.reduceat(again, starts)
    in_place = one_source & (repeats == 0) & (span == rows)  # a narrow, or a whole source
    copied = float(np.add.reduceat(nbytes, starts)[~in_place].sum())
    repeated = float(nbytes[again].sum())
    return cost + copied * copy_s + repeated * repeat_s, known


def _row_bytes(signatures: list[Any], facts: Facts | None) -> tuple[np.ndarray, bool]:
    """Per signature and output index, the bytes of one node's row (``DEFAULT_ROW_BYTES``
    where no apply measured it); and whether every signature was measured."""
    if facts is None:
        return np.full((len(signatures), 1), DEFAULT_ROW_BYTES, np.float64), True
    got = [facts.row_bytes.get(s) for s in signatures]
    width = max((len(g) for g in got if g), default=1)
    table = np.full((len(signatures), width), DEFAULT_ROW_BYTES, np.float64)
    for sid, g in enumerate(got):
        if g:
            table[sid, : len(g)] = g
    return table, all(got)


def _ragged_columns(a: Any) -> bool:
    """Whether a signature whose op takes rows of several lengths at once has a literal
    column of several shapes (which the general gathers would run in parts)."""
    return any(
        getattr(op, "ragged_call", None) is not None
        and any(map(any_shape, kinds))
        and not one_shape(a.rows(sid), kinds)
        for sid, (op, kinds) in enumerate(a.signatures)
    )


def auto_schedule(a: GraphView) -> Plan:
    """Plan ``a`` by depth, or by the agenda or lockstep where one of them is estimated to
    cost less (see above)."""
    facts: Facts | None = getattr(a, "facts", None)
    sigs = getattr(a, "signatures", None)  # a recorded graph's; a hand-built one has none
    if sigs is not None and hasattr(a, "columns") and getattr(a, "rounds", False):
        # An autobatch round (``fold.run.run_groups``), whose every node's value is read
        # where its group put it: a whole plan (one group per signature, those that read
        # themselves split by depth: depth's groups) where the columns allow one, whose
        # groups read their inputs where they lie, without the general gathers' value
        # tables (about 50 us a group less; the translation tutorial's decoder, whose two
        # cats are one op, decodes 10% faster).
        whole = signature_schedule(a, split=True)
        if whole is not None and whole.whole:
            return whole
    key = tuple(sigs) if sigs is not None else None
    chosen = facts.chosen if facts is not None else _CHOSEN
    known = chosen.get(key) if key is not None else None
    if known is not None and known[1] < RECHECK:
        plan = known[0](a)
        if plan is not None:  # (None: the signatures read themselves now)
            known[1] += 1
            return plan
    if sigs is not None and hasattr(a, "columns") and _ragged_columns(a):
        # An op takes literal rows of several lengths at once (an autobatch round's attention
        # over memories of several lengths: ``ragged_call``): one group per signature as a
        # whole plan, where the columns allow one; each such group is then one call on its
        # rows padded, not a call in parts as the general gathers make it.
        whole = signature_schedule(a, split=True)
        if whole is not None and whole.whole:
            return whole
    plan = depth_schedule(a)
    if group_count(plan) <= len(a.count):  # one group per signature: nothing left to merge
        return plan
    best, (best_cost, sized) = depth_schedule, plan_cost(a, plan, facts)
    for schedule in (signature_schedule, agenda_schedule, lockstep_schedule):
        other = schedule(a)
        if other is None:
            continue
        cost, _ = plan_cost(a, other, facts)
        if cost < best_cost:
            best, best_cost, plan = schedule, cost, other
    if key is not None and sized:
        if len(chosen) > 256:
            chosen.clear()
        chosen[key] = [best, 0]
    return plan
