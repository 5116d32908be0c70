"""Agenda scheduling (after DyNet's autobatching): run ready nodes, not levels.

Depth scheduling puts every node at step 1 + its deepest argument, so nodes of one signature
at different depths never share a group: the classifier on the final state of sequences of
different lengths runs once per length.  The agenda keeps, per group key, the nodes whose
arguments are all computed, and repeatedly launches one key's ready nodes as a group:

1. a key none of whose nodes is still waiting (all ready) goes first: waiting cannot make
   its group any larger;
2. otherwise the key whose ready nodes have the longest average path still ahead of them
   (critical path first).  Ops near the outputs, such as a classifier head, have the
   shortest paths ahead, so they wait while the long chains run and gather all their
   members into one group, as DyNet's agenda lets such ops wait;
3. ties go to the key holding the oldest ready node (the lowest node id).

Every step of the plan holds one group.  Two implementations of the one rule: a per-node
loop for narrow graphs (a few nodes per launch, where plain ints are cheapest) and one with
a few array operations per launch for wide ones (thousands of nodes, tens of launches: a
batch of sequences).  They give the same plan; a property test holds them to it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from fold.arrays import distinct, runs_of, stable_order
from fold.scheduler.plan import GraphView, Group, Plan, Step

__all__ = ["agenda_schedule"]

# Average nodes per depth level from which the array implementation is used.
WIDE = 16


def agenda_schedule(a: GraphView) -> Plan:
    """Plan every node of ``a`` with the agenda rule above.  Iterative, no recursion."""
    if a.n and a.n >= WIDE * (int(a.depth.max()) + 1):
        return _agenda_arrays(a)
    return _agenda_nodes(a)


def _agenda_nodes(a: GraphView) -> Plan:
    """The agenda, one node at a time (plain ints and lists)."""
    keys = a.keys()
    if keys is None:
        keys = a.sig.tolist()
    n = len(keys)
    # Consumers as flat int lists (CSR), not a list per node: thousands of small lists would
    # set off full garbage collections of the whole heap.  Edges in consumer order.
    src, dst = a.edges()
    order = stable_order(dst, n)
    edge_src: list[int] = src[order].tolist()
    edge_dst: list[int] = dst[order].tolist()
    waiting = np.bincount(dst, minlength=n).tolist()  # distinct node arguments not computed yet
    first = [0] * (n + 1)  # consumers of node i: adj[first[i]:first[i + 1]]
    for s in edge_src:
        first[s + 1] += 1
    for i in range(n):
        first[i + 1] += first[i]
    fill = first[:-1]
    adj = [0] * len(edge_src)
    for s, d in zip(edge_src, edge_dst):
        adj[fill[s]] = d
        fill[s] += 1
    ahead = [0] * n  # longest path from the node to a node nothing consumes
    # Edges come in increasing consumer order: walked backwards, a consumer's path is final
    # before any of its sources reads it.
    for s, d in zip(reversed(edge_src), reversed(edge_dst)):
        v = ahead[d] + 1
        if v > ahead[s]:
            ahead[s] = v
    remaining = Counter(keys)
    ready: dict[Any, list[int]] = {}
    total: dict[Any, int] = {}  # per key: sum of `ahead` over its ready nodes
    oldest: dict[Any, int] = {}  # per key: its lowest ready node id

    def make_ready(nid: int) -> None:
        k = keys[nid]
        nodes = ready.get(k)
        if nodes is None:
            ready[k] = [nid]
            total[k] = ahead[nid]
            oldest[k] = nid
        else:
            nodes.append(nid)
            total[k] += ahead[nid]
            if nid < oldest[k]:
                oldest[k] = nid

    for nid in range(n):
        if waiting[nid] == 0:
            make_ready(nid)
    steps: list[Step] = []
    while ready:
        key = min(
            ready,
            key=lambda k: (len(ready[k]) != remaining[k], -total[k] / len(ready[k]), oldest[k]),
        )
        nodes = sorted(ready.pop(key))
        del total[key], oldest[key]
        remaining[key] -= len(nodes)
        steps.append(Step([Group(key, nodes)]))
        for nid in nodes:
            for c in adj[first[nid] : first[nid + 1]]:
                waiting[c] -= 1
                if waiting[c] == 0:
                    make_ready(c)
    return Plan(steps)


def _agenda_arrays(a: GraphView) -> Plan:
    """The agenda with array operations per launch."""
    n = a.n
    keys = a.keys()
    if keys is None:  # the keys are the signature ids (no per-node Python lists)
        key_of, key_objs = a.sig, list(range(len(a.count)))
    else:
        ids: dict[Any, int] = {}
        key_of = np.array([ids.setdefault(k, len(ids)) for k in keys], np.int64)
        key_objs = list(ids)
    nkeys = len(key_objs)

    src, dst = a.edges()  # one edge per distinct argument node of a consumer
    waiting = np.bincount(dst, minlength=n)
    order = stable_order(src, n)
    adj = dst[order]  # consumers of node i: adj[first[i]:first[i + 1]]
    first = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(src, minlength=n), out=first[1:])

    # ahead: the longest path to a node nothing consumes, one depth level at a time from the
    # deepest (a consumer is deeper than its arguments, so its path is final when read).
    ahead = np.zeros(n, np.int64)
    if len(dst):
        level = a.depth[dst]
        deepest = int(level.max())
        for e in runs_of(deepest - level, deepest + 1):
            np.maximum.at(ahead, src[e], ahead[dst[e]] + 1)

    # Per key, as plain ints (there are few keys): its nodes not yet launched, and of its
    # ready nodes their arrays, count, sum of `ahead` and lowest id.
    remaining = np.bincount(key_of, minlength=nkeys).tolist()
    ready: dict[int, list[np.ndarray]] = {}
    count: dict[int, int] = {}
    total: dict[int, int] = {}
    oldest: dict[int, int] = {}

    def make_ready(nodes: np.ndarray) -> None:  # distinct, in increasing id order
        k = key_of[nodes]
        k0 = int(k[0])
        if k0 == int(k[-1]) and (k == k0).all():
            parts: Any = ((k0, nodes),)
        else:
            parts = [(key, nodes[k == key]) for key in distinct(k).tolist()]
        for key, part in parts:
            s = int(ahead[part].sum())
            if key in ready:
                ready[key].append(part)
                count[key] += len(part)
                total[key] += s
                oldest[key] = min(oldest[key], int(part[0]))
            else:
                ready[key] = [part]
                count[key] = len(part)
                total[key] = s
                oldest[key] = int(part[0])

    # A consumer reads two nodes of one launch only where some node has two node arguments.
    repeats = bool(len(waiting)) and int(waiting.max()) > 1
    make_ready(np.flatnonzero(waiting == 0))
    steps: list[Step] = []
    while ready:
        key = min(ready, key=lambda k: (count[k] != remaining[k], -total[k] / count[k], oldest[k]))
        parts = ready.pop(key)
        nodes = parts[0] if len(parts) == 1 else np.sort(np.concatenate(parts))
        del count[key], total[key], oldest[key]
        remaining[key] -= len(nodes)
        steps.append(Step([Group(key_objs[key], nodes)]))
        # The consumers of every launched node: adj[first[i]:first[i + 1]] of each.
        if len(nodes) == 1:
            i = int(nodes[0])
            consumers = adj[first[i] : first[i + 1]]
        else:
            lo = first[nodes]
            sizes = first[nodes + 1] - lo
            ends = np.cumsum(sizes)
            if not len(ends) or not ends[-1]:
                continue
            consumers = adj[np.repeat(lo - ends + sizes, sizes) + np.arange(int(ends[-1]))]
        if not len(consumers):
            continue
        np.subtract.at(waiting, consumers, 1)
        done = consumers[waiting[consumers] == 0]
        if len(done):
            done = np.sort(done)
            if repeats and len(done) > 1:
                done = done[np.concatenate(([True], done[1:] != done[:-1]))]
            make_ready(done)
    return Plan(steps)
