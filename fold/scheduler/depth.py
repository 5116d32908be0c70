"""Depth scheduling (TorchFold, TensorFlow Fold): a node runs at step 1 + the deepest of its
node arguments; per step, nodes of one signature form one group."""

from __future__ import annotations

from typing import Any

import numpy as np

from fold.arrays import stable_order
from fold.scheduler.plan import GraphView, Group, Plan, Step

__all__ = ["depth_schedule", "plan_by_level"]


def depth_schedule(a: GraphView) -> Plan:
    """Plan every node of ``a`` by depth.  Iterative; one stable sort of all nodes.

    A group's nodes come in node-id order, as an int64 array (a list where nobatch nodes
    make group keys of their own).
    """
    keys = a.keys()
    if keys is not None:
        return _depth_schedule_keys(a, keys)
    if a.n == 0:
        return Plan([])
    nsig = len(a.count)
    if nsig == 1 and a.flat:  # e.g. one op per sample: one group
        return Plan([Step([Group(0, np.arange(a.n))])])
    return plan_by_level(a.depth, a.sig, nsig)


def plan_by_level(level: np.ndarray, sig: np.ndarray, nsig: int) -> Plan:
    """A plan of one step per distinct ``level`` (in increasing order), one group per
    signature in it, its nodes in node-id order (one stable sort of all nodes): depth's plan
    of its depths, lockstep's of its (time, sub) levels.  No edge may join two nodes of one
    level."""
    key = level * nsig + sig
    order = stable_order(key, (int(level.max()) + 1) * nsig)
    sk = key[order]
    cuts = (np.flatnonzero(sk[1:] != sk[:-1]) + 1).tolist()
    steps: list[Step] = []
    last = -1
    for lo, hi, k in zip([0, *cuts], [*cuts, len(key)], sk[[0, *cuts]].tolist()):
        if k // nsig != last:
            steps.append(Step())
            last = k // nsig
        steps[-1].groups.append(Group(k % nsig, order[lo:hi]))
    return Plan(steps)


def _depth_schedule_keys(a: GraphView, keys: list[Any]) -> Plan:
    """Depth scheduling over per-node keys (graphs with nobatch nodes)."""
    buckets: dict[tuple[int, Any], list[int]] = {}
    depth = a.depth.tolist()
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
