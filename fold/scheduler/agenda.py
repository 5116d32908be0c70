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
   members into one group, as DyNet's agenda lets such ops wait.

Every step of the plan holds one group.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from fold.scheduler.depth import group_keys
from fold.scheduler.plan import Graph, Group, Plan, Step

__all__ = ["agenda_schedule"]


def agenda_schedule(graph: Graph) -> Plan:
    """Plan every node of ``graph`` with the agenda rule above.  Iterative, no recursion."""
    from fold.graph import ID_MASK, ID_SHIFT, NODE

    keys = group_keys(graph)
    n = len(keys)
    sig, args = graph.sig, graph.args
    node_pos = [tuple(i for i, k in enumerate(kinds) if k == NODE) for _, kinds in graph.signatures]
    # Consumers as flat int lists (CSR), not a list per node: thousands of small lists would
    # set off full garbage collections of the whole heap.
    waiting = [0] * n  # distinct node arguments not computed yet
    edge_src: list[int] = []
    edge_dst: list[int] = []
    for nid in range(n):
        pos = node_pos[sig[nid]]
        if not pos:
            continue
        a = args[nid]
        if len(pos) == 1:
            edge_src.append((a[pos[0]] >> ID_SHIFT) & ID_MASK)
            edge_dst.append(nid)
            waiting[nid] = 1
            continue
        srcs = {(a[p] >> ID_SHIFT) & ID_MASK for p in pos}
        waiting[nid] = len(srcs)
        edge_src.extend(srcs)
        edge_dst.extend([nid] * len(srcs))
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
    for nid in range(n):
        if waiting[nid] == 0:
            k = keys[nid]
            ready.setdefault(k, []).append(nid)
            total[k] = total.get(k, 0) + ahead[nid]
    steps: list[Step] = []
    while ready:
        key = _choose(ready, remaining, total)
        nodes = sorted(ready.pop(key))
        del total[key]
        remaining[key] -= len(nodes)
        steps.append(Step([Group(key, nodes)]))
        for nid in nodes:
            for c in adj[first[nid] : first[nid + 1]]:
                waiting[c] -= 1
                if waiting[c] == 0:
                    k = keys[c]
                    ready.setdefault(k, []).append(c)
                    total[k] = total.get(k, 0) + ahead[c]
    return Plan(steps)


def _choose(ready: dict[Any, list[int]], remaining: dict[Any, int], total: dict[Any, int]) -> Any:
    best, best_score = None, None
    for key, nodes in ready.items():
        score = (len(nodes) != remaining[key], -total[key] / len(nodes))
        if best_score is None or score < best_score:
            best, best_score = key, score
    return best
