"""Schedulers: pure functions from a recorded graph to a :class:`Plan`."""

from __future__ import annotations

from collections.abc import Callable

from fold.scheduler.agenda import agenda_schedule as agenda_schedule
from fold.scheduler.depth import depth_schedule as depth_schedule
from fold.scheduler.plan import Graph as Graph
from fold.scheduler.plan import Group as Group
from fold.scheduler.plan import Plan as Plan
from fold.scheduler.plan import Step as Step

SCHEDULERS: dict[str, Callable[[Graph], Plan]] = {
    "depth": depth_schedule,
    "agenda": agenda_schedule,
}

__all__ = ["SCHEDULERS", "Graph", "Group", "Plan", "Step", "agenda_schedule", "depth_schedule"]
