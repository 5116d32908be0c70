"""Per-model losses and accuracies for ``(N, b, ...)`` outputs."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fold.errors import FoldError

__all__ = ["batch_loss", "batch_topk"]


def _check(outputs: torch.Tensor, targets: torch.Tensor, batch: int, where: str) -> None:
    if outputs.shape[0] != batch or targets.shape[0] != batch:
        raise FoldError(
            f"{where}: outputs {tuple(outputs.shape)} and targets {tuple(targets.shape)} must both "
            f"have the model dim N={batch} first. Fix: pass (N, b, ...) outputs and (N, b) targets."
        )


def batch_loss(
    outputs: torch.Tensor,
    targets: torch.Tensor,
    batch: int,
    loss_fn: Callable[..., torch.Tensor],
    reduction: str = "mean",
) -> torch.Tensor:
    """``(N,)`` losses: ``loss_fn`` on each model's ``(b, ...)`` outputs and targets.

    Example::

        losses = batch_loss(bm(x), y, N, F.cross_entropy, "mean")   # (N,)
        losses.sum().backward()                                      # every model its own gradient
    """
    _check(outputs, targets, batch, "batch_loss")
    if reduction not in ("mean", "sum"):
        raise FoldError(f"batch_loss: reduction must be 'mean' or 'sum', got {reduction!r}.")
    per = loss_fn(outputs.flatten(0, 1), targets.flatten(0, 1), reduction="none")
    per = per.view(batch, -1)
    return per.mean(1) if reduction == "mean" else per.sum(1)


def batch_topk(
    outputs: torch.Tensor, targets: torch.Tensor, batch: int, ks: Sequence[int] = (1,)
) -> torch.Tensor:
    """``(len(ks), N)`` top-k accuracies of each model's ``(b, classes)`` outputs."""
    _check(outputs, targets, batch, "batch_topk")
    top = outputs.topk(max(ks), dim=-1).indices  # (N, b, kmax)
    hit = top == targets.unsqueeze(-1)
    return torch.stack([hit[..., :k].any(-1).float().mean(-1) for k in ks])
