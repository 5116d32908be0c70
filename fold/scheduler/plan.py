"""The records a scheduler produces and the executor consumes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["Graph", "Group", "Plan", "Step"]


class Graph(Protocol):
    """What a scheduler reads of a recorded graph (a :class:`fold.Fold` satisfies it)."""

    args: list[tuple[Any, ...]]
    sig: list[int]
    handles: list[int]

    @property
    def depth(self) -> list[int]: ...

    nobatch_ids: set[int]

    def node_args(self, nid: int) -> list[tuple[int, int]]: ...


@dataclass(slots=True, eq=False)
class Group:
    """Nodes that run as one batched call: same step, same signature.

    ``nodes`` are node ids (a list, or an int64 numpy array) in the order their rows take in
    the group's output.  ``key`` is the signature id, extended with the ids of nobatch
    arguments where there are any.
    """

    key: Any
    nodes: Any  # Sequence[int] | numpy.ndarray


@dataclass(slots=True, eq=False)
class Step:
    """Groups whose arguments are all computed by earlier steps."""

    groups: list[Group] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class Plan:
    """An execution order: steps run in order, groups of a step in any order."""

    steps: list[Step]

    @property
    def num_groups(self) -> int:
        return sum(len(s.groups) for s in self.steps)
