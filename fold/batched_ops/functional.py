"""Per-model losses and accuracies for ``(N, b, ...)`` outputs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fold.errors import FoldError

__all__ = ["batch_loss", "batch_topk"]


def _models(outputs: Any, targets: Any, batch: int | None, where: str) -> int:
    """N: ``batch`` if given (checked), else the outputs' dim 0; targets must agree."""
    if not isinstance(outputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise FoldError(
            f"{where}: outputs and targets must be tensors of shape (N, b, ...), got "
            f"{type(outputs).__name__} and {type(targets).__name__}."
        )
    if batch is not None and (type(batch) is not int or batch < 1):
        raise FoldError(f"{where}: batch={batch!r}; expected the number of models, a positive int.")
    n = outputs.shape[0] if batch is None and outputs.dim() >= 2 else batch
    if n is None or outputs.dim() < 2 or outputs.shape[0] != n or targets.shape[:1] != (n,):
        raise FoldError(
            f"{where}: outputs {tuple(outputs.shape)} and targets {tuple(targets.shape)} must both "
            f"have the model dim{'' if n is None else f' N={n}'} first. Fix: pass (N, b, ...) "
            "outputs and (N, b) targets; targets shared by all models: y.expand(N, -1)."
        )
    return n


def batch_loss(
    outputs: torch.Tensor,
    targets: torch.Tensor,
    *args: Any,
    batch: int | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """``(N,)`` losses: ``loss_fn`` on each model's ``(b, ...)`` outputs and targets.

    N is the outputs' dim 0.  Called as ``batch_loss(outputs, targets, loss_fn, reduction)``;
    the older ``batch_loss(outputs, targets, N, loss_fn, reduction)`` is accepted too (N is
    then checked against the outputs).

    Example::

        losses = batch_loss(bm(x), y, F.cross_entropy)   # (N,)
        losses.sum().backward()                          # every model its own gradient
    """
    rest = list(args)
    if rest and (type(rest[0]) is int or rest[0] is None):  # the older form: N third
        batch = rest.pop(0)
    if rest:
        loss_fn = rest.pop(0)
    if rest:
        reduction = rest.pop(0)
    if rest or loss_fn is None or not callable(loss_fn):
        raise FoldError(
            "batch_loss(outputs, targets, loss_fn, reduction='mean'): give a loss function "
            "that takes reduction='none', e.g. F.cross_entropy."
        )
    n = _models(outputs, targets, batch, "batch_loss")
    if reduction not in ("mean", "sum"):
        raise FoldError(f"batch_loss: reduction must be 'mean' or 'sum', got {reduction!r}.")
    per = loss_fn(outputs.flatten(0, 1), targets.flatten(0, 1), reduction="none")
    per = per.view(n, -1)
    return per.mean(1) if reduction == "mean" else per.sum(1)


def batch_topk(
    outputs: torch.Tensor,
    targets: torch.Tensor,
    batch: int | None = None,
    ks: Sequence[int] = (1,),
) -> torch.Tensor:
    """``(len(ks), N)`` top-k accuracies of each model's ``(b, classes)`` outputs; N is the
    outputs' dim 0 (``batch``, if given, is checked against it)."""
    _models(outputs, targets, batch, "batch_topk")
    top = outputs.topk(max(ks), dim=-1).indices  # (N, b, kmax)
    hit = top == targets.unsqueeze(-1)
    return torch.stack([hit[..., :k].any(-1).float().mean(-1) for k in ks])
