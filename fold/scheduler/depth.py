"""Depth scheduling (TorchFold, TensorFlow Fold): a node runs at step 1 + the deepest of its
node arguments; per step, nodes of one signature form one group."""

from __future__ import annotations

from typing import Any

import numpy as np

from fold.scheduler.plan import Graph, Group, Plan, Step

__all__ = ["depth_schedule", "group_keys"]


def group_keys(graph: Graph) -> list[Any]:
    """Per node, the key that decides which nodes may share a group.

    It is the signature id, except around nobatch nodes: a nobatch node gets a key of its own
    (it runs alone and its output is passed whole), and a consumer's key also names the
    nobatch nodes it reads, since a batched call takes one whole value per argument.
    """
    keys: list[Any] = graph.sig
    nobatch = graph.nobatch_ids
    if not nobatch:
        return keys
    from fold.graph import node_id

    keys = list(keys)
    for nid in range(len(graph.args)):
        if nid in nobatch:
            keys[nid] = ("nobatch", nid)
            continue
        shared = tuple((pos, a) for pos, a in graph.node_args(nid) if node_id(a) in nobatch)
        if shared:
            keys[nid] = (keys[nid], shared)
    return keys


def depth_schedule(graph: Graph) -> Plan:
    """Plan every node of ``graph`` by depth.  Iterative; one stable sort of all nodes.

    A group's nodes come in node-id order (an int64 array when the graph offers
    ``arrays()``, as a :class:`fold.Fold` does).
    """
    if graph.nobatch_ids or not hasattr(graph, "arrays"):
        return _depth_schedule_keys(graph)
    a = graph.arrays()
    if a.n == 0:
        return Plan([])
    nsig = len(a.count)
    if nsig == 1 and a.flat:  # e.g. one op per sample: one group
        return Plan([Step([Group(0, np.arange(a.n))])])
    key = a.depth * nsig + a.sig
    order = np.argsort(key, kind="stable")
    sk = key[order]
    cuts = np.flatnonzero(sk[1:] != sk[:-1]) + 1
    starts = [0, *cuts.tolist()]
    ends = [*cuts.tolist(), a.n]
    steps = [Step() for _ in range(int(a.depth.max()) + 1)]
    for lo, hi, k in zip(starts, ends, sk[starts].tolist()):
        steps[k // nsig].groups.append(Group(k % nsig, order[lo:hi]))
    return Plan(steps)


def _depth_schedule_keys(graph: Graph) -> Plan:
    """Depth scheduling over per-node keys (graphs with nobatch nodes)."""
    keys = group_keys(graph)
    buckets: dict[tuple[int, Any], list[int]] = {}
    depth = graph.depth
    for nid, dk in enumerate(zip(depth, keys)):
        b = buckets.get(dk)
        if b is None:
            buckets[dk] = [nid]
        else:
            b.append(nid)
    nsteps = max(depth, default=-1) + 1
    steps = [Step() for _ in range(nsteps)]
    for (d, key), nodes in buckets.items():
        steps[d].groups.append(Group(key, nodes))
    return Plan(steps)
