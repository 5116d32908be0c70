"""The default schedule, ``strategy="auto"``: depth, or the agenda where it makes fewer groups.

Both schedules run every node once, so they do the same arithmetic; what differs is how many
batched calls (groups) that work is split into, and every group costs a fixed amount
(argument gathers, the op's own kernel launches, their backward), 0.3-3 ms on a CPU for the
models of ``benchmarks/dynamic.py``.  So:

1. plan by depth (cheap: a sort, about 0.5 ms for 5k nodes);
2. if that plan has one group per signature, no schedule can have fewer: take it (trees
   with list arguments, message passing, MNIST);
3. else plan the agenda too, and take it if it has fewer groups; on a tie, depth.

The cost of ``auto`` is the depth plan's, plus the agenda's where step 3 runs (2-15 ms for
2.5k-8k nodes); a plan is made once per recorded graph and kept for its later applies.  The
rule's figures (``auto`` against the better of depth and agenda on each model) are in
docs/benchmarks.md.
"""

from __future__ import annotations

from fold.scheduler.agenda import agenda_schedule
from fold.scheduler.depth import depth_schedule
from fold.scheduler.plan import GraphView, Plan

__all__ = ["auto_schedule", "group_count"]


def group_count(plan: Plan) -> int:
    """The number of batched calls a plan makes."""
    return sum(len(step.groups) for step in plan.steps)


def auto_schedule(a: GraphView) -> Plan:
    """Plan ``a`` by depth, or by the agenda where that makes fewer groups (see above)."""
    plan = depth_schedule(a)
    groups = group_count(plan)
    if groups <= len(a.count):  # one group per signature: nothing left to merge
        return plan
    other = agenda_schedule(a)
    return other if group_count(other) < groups else plan
