"""Schedulers: pure functions from a :class:`GraphView` to a :class:`Plan`.

Add one by writing ``my_schedule(view) -> Plan`` over the :class:`GraphView` interface
(test it on an :class:`ArrayGraph` built by hand) and registering it in ``SCHEDULERS``;
``Fold(strategy="my")`` then uses it.  :func:`make_plan` tries the chain planner first.
"""

from __future__ import annotations

from collections.abc import Callable

from fold.scheduler.agenda import agenda_schedule as agenda_schedule
from fold.scheduler.auto import auto_schedule as auto_schedule
from fold.scheduler.chain import chain_plan as chain_plan
from fold.scheduler.depth import depth_schedule as depth_schedule
from fold.scheduler.lockstep import lockstep_schedule as lockstep_schedule
from fold.scheduler.plan import ArrayGraph as ArrayGraph
from fold.scheduler.plan import GraphView as GraphView
from fold.scheduler.plan import Group as Group
from fold.scheduler.plan import Input as Input
from fold.scheduler.plan import Plan as Plan
from fold.scheduler.plan import RecordedView as RecordedView
from fold.scheduler.plan import Step as Step

SCHEDULERS: dict[str, Callable[[GraphView], Plan]] = {
    "auto": auto_schedule,
    "depth": depth_schedule,
    "agenda": agenda_schedule,
    "lockstep": lockstep_schedule,
}


def make_plan(view: RecordedView, strategy: str) -> Plan:
    """The plan ``apply`` runs: a chain of whole outputs where the graph is one (the same
    groups every strategy would make, with their inputs known), else ``strategy``'s."""
    plan = chain_plan(view)
    return plan if plan is not None else SCHEDULERS[strategy](view)


__all__ = [
    "SCHEDULERS",
    "ArrayGraph",
    "GraphView",
    "Group",
    "Input",
    "Plan",
    "RecordedView",
    "Step",
    "agenda_schedule",
    "auto_schedule",
    "chain_plan",
    "depth_schedule",
    "lockstep_schedule",
    "make_plan",
]
