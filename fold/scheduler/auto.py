"""The default schedule, ``strategy="auto"``: depth, or the agenda where it makes fewer groups.

Both schedules run every node once, so they do the same arithmetic; what differs is how many
batched calls (groups) that work is split into, and every group costs a fixed amount
(argument gathers, the op's own kernel launches, their backward), 0.3-3 ms on a CPU for the
models of ``benchmarks/dynamic.py``.  So:

1. plan by depth (cheap: a sort, about 0.5 ms for 5k nodes);
2. if that plan has one group per signature, no schedule can have fewer: take it (trees
   with list arguments, message passing, MNIST);
3. else plan the agenda too, and take it if it has fewer groups; on a tie, depth.

Step 3 costs the agenda's planning (2-16 ms for 1k-8k nodes: +7% on a TreeLSTM batch at
hidden 32, where depth is already optimal), so its outcome is remembered per model: graphs
of the same signatures (ops and argument kinds) take the remembered schedule, and step 3
runs again every ``RECHECK``-th such graph, in case the graphs changed character.  So in a
training loop ``auto`` costs the chosen schedule's planning plus, amortised, 1/``RECHECK`` of
the other's.  The rule's figures (``auto`` against the better of depth and agenda on each
model) are in docs/benchmarks.md.
"""

from __future__ import annotations

from typing import Any

from fold.scheduler.agenda import agenda_schedule
from fold.scheduler.depth import depth_schedule
from fold.scheduler.plan import GraphView, Plan

__all__ = ["RECHECK", "auto_schedule", "group_count"]

RECHECK = 32
# signatures of a graph -> [the schedule step 3 chose, graphs planned with it since]
_CHOSEN: dict[Any, list[Any]] = {}


def group_count(plan: Plan) -> int:
    """The number of batched calls a plan makes."""
    return sum(len(step.groups) for step in plan.steps)


def auto_schedule(a: GraphView) -> Plan:
    """Plan ``a`` by depth, or by the agenda where that makes fewer groups (see above)."""
    sigs = getattr(a, "signatures", None)  # a recorded graph's; a hand-built one has none
    key = tuple(sigs) if sigs is not None else None
    known = _CHOSEN.get(key) if key is not None else None
    if known is not None and known[1] < RECHECK:
        known[1] += 1
        return known[0](a)
    plan = depth_schedule(a)
    groups = group_count(plan)
    if groups <= len(a.count):  # one group per signature: nothing left to merge
        return plan
    other = agenda_schedule(a)
    better = group_count(other) < groups
    if key is not None:
        if len(_CHOSEN) > 256:
            _CHOSEN.clear()
        _CHOSEN[key] = [agenda_schedule if better else depth_schedule, 0]
    return other if better else plan
