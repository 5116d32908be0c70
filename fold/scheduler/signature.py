"""One group per signature, where the graph allows it: the plan with the fewest groups.

A graph whose signatures never read themselves, directly or through one another, can run
each signature's nodes as ONE group, in a topological order of the signatures: every node
a group reads belongs to a signature run before it.  No plan has fewer groups.  Depth makes
more where a signature's nodes sit at several depths: an autobatch round in which one
example's feature row is a padding vector made one op earlier and another's an encoder row
read at once puts the ``cat`` of the features, and every op after it, at two depths, and
each op runs twice.  The agenda would merge them too, but plans node by node.

Recursive graphs (a tree's cells, a sequence's steps) have a signature that reads itself
and get no plan here.
"""

from __future__ import annotations

import numpy as np

from fold.arrays import distinct
from fold.scheduler.depth import plan_by_level
from fold.scheduler.plan import GraphView, Plan

__all__ = ["signature_levels", "signature_schedule"]


def signature_levels(a: GraphView) -> np.ndarray | None:
    """Per signature, its level in the graph of signatures (0 where it reads no node, else
    1 + the highest level of the signatures it reads); None where some signature reads
    itself, directly or through others.  A few array operations over the graph's edges,
    then a walk over the signatures (not the nodes)."""
    nsig = len(a.count)
    src, dst = a.edges()
    levels = np.zeros(nsig, np.int64)
    if not len(src):
        return levels
    sig = a.sig
    pairs = distinct(sig[src] * nsig + sig[dst])
    reads, readers = (pairs // nsig).tolist(), (pairs % nsig).tolist()
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
    (see above); None where a signature reads itself, or where nobatch nodes give nodes
    group keys of their own."""
    if a.n == 0 or a.keys() is not None:
        return None
    levels = signature_levels(a)
    if levels is None:
        return None
    return plan_by_level(levels[a.sig], a.sig, len(a.count))
