"""Lockstep scheduling: the examples' programs advance together, one step of each op's own
chain at a time, as hand-written batching of a transition system does.

Depth puts a node at 1 + its deepest argument. In a shift-reduce encoder (SPINN) the tracker
of transition t reads the stack's top, the output of a reduce whose depth grows with the
nesting of the tree, so the trackers of transition t sit at many depths and run as many
groups; the agenda merges some of them but splits others. Hand-written code runs every
sentence's transition t together: one tracker call, then one reduce call, per transition.

Lockstep gives each node a time: the latest time of its arguments, plus one where an
argument is of the node's own op (the next step of that op's chain). A tracker's time is
then its transition, and a reduce's the transition it happens at (its children come from
earlier reduces, one step before at least). Within a time, an argument of another op comes
first (a second key, ``sub``: 1 + the latest ``sub`` of its arguments of the same time).
Steps run in (time, sub) order, which every edge increases, so the plan is valid for any
graph; on a tree it is depth's plan, on sequences of different lengths it runs their steps
together as depth does. ``auto`` (``fold.scheduler.auto``) weighs it against depth and the
agenda. Cost: one pass of array operations per depth level (a few microseconds each).
"""

from __future__ import annotations

import numpy as np

from fold.arrays import runs_of
from fold.scheduler.depth import depth_schedule, plan_by_level
from fold.scheduler.plan import GraphView, Plan

__all__ = ["lockstep_schedule"]


def lockstep_schedule(a: GraphView) -> Plan:
    """Plan every node of ``a`` by (time, sub) as above; a graph whose group keys are not
    its signatures (nobatch nodes) is planned by depth."""
    if a.keys() is not None:
        return depth_schedule(a)
    n = a.n
    if n == 0:
        return Plan([])
    sig = a.sig
    time = np.zeros(n, np.int64)
    sub = np.zeros(n, np.int64)
    src, dst = a.edges()
    if len(dst):
        # Consumers level by level (an argument's depth is below its consumer's), so each
        # argument's time and sub are final when read.
        level = a.depth[dst]
        for e in runs_of(level, int(level.max()) + 1):
            s, d = src[e], dst[e]
            np.maximum.at(time, d, time[s] + (sig[s] == sig[d]))
            same = time[s] == time[d]
            if same.any():
                np.maximum.at(sub, d[same], sub[s[same]] + 1)
    return plan_by_level(time * (int(sub.max()) + 1) + sub, sig, len(a.count))
