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

from typing import Any

from fold.scheduler.depth import group_keys
from fold.scheduler.plan import Graph, Group, Plan, Step

__all__ = ["agenda_schedule"]


def agenda_schedule(graph: Graph) -> Plan:
    """Plan every node of ``graph`` with the agenda rule above.  Iterative, no recursion."""
    from fold.graph import node_id

    keys = group_keys(graph)
    n = len(keys)
    waiting = [0] * n  # node arguments not computed yet
    consumers: list[list[int]] = [[] for _ in range(n)]
    for nid in range(n):
        srcs = {node_id(a) for _, a in graph.node_args(nid)}
        waiting[nid] = len(srcs)
        for s in srcs:
            consumers[s].append(nid)
    ahead = [0] * n  # longest path from the node to a node nothing consumes
    for nid in range(n - 1, -1, -1):  # ids are a topological order
        for c in consumers[nid]:
            if ahead[c] + 1 > ahead[nid]:
                ahead[nid] = ahead[c] + 1
    remaining: dict[Any, int] = {}
    for k in keys:
        remaining[k] = remaining.get(k, 0) + 1
    ready: dict[Any, list[int]] = {}
    for nid in range(n):
        if waiting[nid] == 0:
            ready.setdefault(keys[nid], []).append(nid)
    steps: list[Step] = []
    while ready:
        key = _choose(ready, remaining, ahead)
        nodes = sorted(ready.pop(key))
        remaining[key] -= len(nodes)
        steps.append(Step([Group(key, nodes)]))
        for nid in nodes:
            for c in consumers[nid]:
                waiting[c] -= 1
                if waiting[c] == 0:
                    ready.setdefault(keys[c], []).append(c)
    return Plan(steps)


def _choose(ready: dict[Any, list[int]], remaining: dict[Any, int], ahead: list[int]) -> Any:
    best, best_score = None, None
    for key, nodes in ready.items():
        complete = len(nodes) == remaining[key]
        score = (not complete, -sum(ahead[i] for i in nodes) / len(nodes))
        if best_score is None or score < best_score:
            best, best_score = key, score
    return best
