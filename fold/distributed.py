"""Data-parallel fold and multi-process sweeps on PyTorch's own engine (torch.distributed).

Data parallel: wrap the model in :class:`FoldModule` and that in ``DistributedDataParallel``.
Sweeps: the N models of a sweep are split over the ranks with :func:`shard`; each rank
trains a ``BatchModule`` of its share with no gradient traffic between models;
:func:`gather_diagnostics` collects per-model diagnostics on rank 0 and :func:`save_sweep`
writes all N models from the shards.  Give the process group a ``timeout`` so that a rank
that fails makes the others fail instead of waiting forever.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fold._io import atomic_save
from fold.diagnostics import Diagnostic
from fold.errors import FoldError
from fold.graph import Fold

__all__ = ["FoldModule", "gather_diagnostics", "save_sweep", "shard"]


class FoldModule(nn.Module):
    """Wraps a model so that ``forward(graph, lists)`` runs ``graph.apply(model, lists)``.

    ``DistributedDataParallel`` synchronises gradients through hooks it arms in ``forward``;
    calling a model's op methods directly (as ``Fold.apply`` does) would bypass it.  Wrap the
    model, give each rank its share of the examples, and call the wrapper::

        ddp = DistributedDataParallel(FoldModule(model))
        f = fold.Fold()
        roots = [record_tree(f, t) for t in my_share_of_trees]
        (h,) = ddp(f, [roots])          # runs f.apply(model, [roots]) inside DDP's forward
        loss = model.loss(h, labels)     # gradients are averaged across ranks on backward
        loss.backward()

    As with any DDP model, a rank's loss should be a mean over its own examples and every
    rank should hold the same number of them, so that the average of the ranks' gradients is
    the gradient of the mean over all examples.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, graph: Fold, lists: Sequence[Sequence[Any]]) -> list[torch.Tensor]:
        return graph.apply(self.model, lists)


def shard(n_models: int, rank: int | None = None, world: int | None = None) -> slice:
    """The models of a sweep this rank trains: a contiguous share of ``range(n_models)``."""
    rank = dist.get_rank() if rank is None else rank
    world = dist.get_world_size() if world is None else world
    for name, v in (("n_models", n_models), ("world", world)):
        if type(v) is not int or v < 1:
            raise FoldError(f"shard: {name}={v!r}; expected a positive int.")
    if type(rank) is not int or not 0 <= rank < world:
        raise FoldError(
            f"shard: rank={rank!r}; expected an int in [0, world={world}). Fix: pass "
            "dist.get_rank(), or leave rank and world out inside an initialised process group."
        )
    if n_models < world:
        raise FoldError(
            f"shard: {n_models} models cannot be shared by {world} ranks; give each rank at least one."
        )
    return slice(rank * n_models // world, (rank + 1) * n_models // world)


def gather_diagnostics(diag: Diagnostic, dst: int = 0) -> Diagnostic | None:
    """Every rank's per-model diagnostics, concatenated in model order on rank ``dst``.

    Values shared by all models (a number or a 0-d tensor on every rank) are taken from rank
    ``dst``; any other value is per model, so a rank's share of one model gives its one
    value (a ``(1,)`` tensor).
    """
    parts: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == dst else []
    dist.gather_object(
        {g: {k: v.cpu() for k, v in vs.items()} for g, vs in diag.items()},
        parts if parts else None,
        dst=dst,
    )
    if dist.get_rank() != dst:
        return None
    out = Diagnostic()
    for group, values in parts[dst].items():
        out[group] = {
            k: v
            if all(p[group][k].dim() == 0 for p in parts)
            else torch.cat([p[group][k].reshape(-1) for p in parts])
            for k, v in values.items()
        }
    return out


def save_sweep(bm: Any, path: str | Path, dst: int = 0) -> None:
    """Save the state dicts of all N models of a sharded sweep, in model order, from rank ``dst``.

    Each rank holds a ``BatchModule`` of its shard; the file is a list of N state dicts
    (``torch.load(path, weights_only=True)``), written atomically.
    """
    states = [{k: v.cpu() for k, v in sd.items()} for sd in bm.state_dicts()]
    parts: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == dst else []
    dist.gather_object(states, parts if parts else None, dst=dst)
    if dist.get_rank() == dst:
        atomic_save([sd for part in parts for sd in part], path)
