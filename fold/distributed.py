"""Data-parallel fold on PyTorch's own engine (torch.distributed, DistributedDataParallel)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fold.graph import Fold

__all__ = ["FoldModule"]


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
