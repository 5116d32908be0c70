"""Depth scheduling (TorchFold, TensorFlow Fold): a node runs at step 1 + the deepest of its
node arguments; per step, nodes of one signature form one group."""

from __future__ import annotations

from typing import Any

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
    """Plan every node of ``graph`` by depth.  Iterative and linear in the number of nodes."""
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
