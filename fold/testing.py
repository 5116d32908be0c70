"""Checks users run on their own architectures: ``check_model_batching``."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fold.batched_ops import BatchModule
from fold.batched_ops.core import map_tensors, tensors_of
from fold.errors import FoldError

__all__ = ["BatchingMismatch", "check_model_batching"]


class BatchingMismatch(FoldError, AssertionError):
    """``check_model_batching`` found differences; the message lists every one.

    A FoldError like every error fold raises, and an AssertionError, so that a test calling
    ``check_model_batching`` fails as an assertion does."""


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> str | None:
    try:
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    except AssertionError as err:
        return str(err).splitlines()[0] + " " + " ".join(str(err).splitlines()[1:3])
    return None


def check_model_batching(
    module_factory: Callable[[], nn.Module],
    make_inputs: Callable[[int], tuple[Any, ...]],
    batch: int = 3,
    method: str = "forward",
    modes: tuple[str, ...] = ("train", "eval"),
    dtype: torch.dtype = torch.float64,
    rtol: float = 1e-7,
    atol: float = 1e-9,
    chunk_size: int | None = None,
) -> BatchModule:
    """Check that ``BatchModule`` runs N models of your architecture exactly as N separate ones.

    ``module_factory()`` builds one model (fresh weights each call); ``make_inputs(N)``
    returns the arguments of ``method`` with a leading model dim ``(N, b, ...)``; ``chunk_size``
    runs the models that many at a time (as BatchModule does on a CPU).  Checked,
    in float64: outputs in train and eval mode; gradient isolation (backprop through model
    k's output alone leaves every other model's parameter and input gradients exactly zero,
    and model k's equal its standalone gradients); and a state-dict round trip.  Raises
    :class:`BatchingMismatch` listing every difference; returns the BatchModule otherwise.
    The check is of the models' rows merged: the row check that runs code mixing rows one
    model at a time (``BatchModule.method``) is off here, so such code is reported.

    Example::

        check_model_batching(lambda: MyNet(), lambda n: (torch.randn(n, 16, 3, 32, 32),))
    """
    torch.manual_seed(0)
    models = [module_factory().to(dtype) for _ in range(batch)]
    bm = BatchModule.from_modules(copy.deepcopy(models))
    bm.chunk_size = chunk_size
    bm.check_rows = False
    inputs = tuple(
        map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, a)
        for a in make_inputs(batch)
    )
    problems: list[str] = []

    def one(i: int, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(map_tensors(lambda t: t[i], a) for a in args)

    def run_separately(args: tuple[Any, ...]) -> list[Any]:
        return [getattr(m, method)(*one(i, args)) for i, m in enumerate(models)]

    for mode in modes:
        bm.train(mode == "train")
        for m in models:
            m.train(mode == "train")
        got = tensors_of(bm.method(method)(*inputs))
        refs = [tensors_of(r) for r in run_separately(inputs)]
        for j, g in enumerate(got):
            for i in range(batch):
                bad = _close(g[i], refs[i][j], rtol, atol)
                if bad:
                    problems.append(f"{mode} mode, output {j}, model {i}: {bad}")

    # Isolation: gradients flow into model k only, and equal model k's own.
    bm.train(modes[0] == "train")
    for m in models:
        m.train(modes[0] == "train")
    for k in sorted({0, batch - 1}):
        bm.zero_grad(set_to_none=True)
        leaves = tuple(
            map_tensors(lambda t: t.detach().requires_grad_(t.is_floating_point()), a)
            for a in inputs
        )
        outs = tensors_of(bm.method(method)(*leaves))
        loss = sum(
            (o[k] * torch.linspace(-1, 1, o[k].numel(), dtype=o.dtype).view_as(o[k])).sum()
            for o in outs
        )
        loss.backward()  # type: ignore[union-attr]
        for name, p in bm.named_parameters():
            if p.grad is not None and p.grad.dim() and p.grad.shape[0] == batch:
                others = torch.cat([p.grad[:k], p.grad[k + 1 :]])
                if others.numel() and bool(others.abs().max() > 0):
                    problems.append(
                        f"isolation: gradient leaked from model {k} into other models' {name}"
                    )
        for j, leaf in enumerate(tensors_of(leaves)):
            if leaf.grad is not None:
                others = torch.cat([leaf.grad[:k], leaf.grad[k + 1 :]])
                if others.numel() and bool(others.abs().max() > 0):
                    problems.append(
                        f"isolation: model {k}'s output has a gradient on input {j} of other models"
                    )
        model = models[k]
        model.zero_grad(set_to_none=True)
        ref_leaves = tuple(
            map_tensors(lambda t, k=k: t[k].detach().requires_grad_(t.is_floating_point()), a)
            for a in inputs
        )
        ref_outs = tensors_of(getattr(model, method)(*ref_leaves))
        ref_loss = sum(
            (o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum() for o in ref_outs
        )
        ref_loss.backward()  # type: ignore[union-attr]
        mine = bm.grads_of(k)
        for name, p in model.named_parameters():
            g, r = mine.get(name), p.grad
            if (g is None) != (r is None):
                problems.append(
                    f"gradient of {name} (model {k}): batched {g is not None}, separate {r is not None}"
                )
            elif g is not None and r is not None:
                bad = _close(g, r, rtol, atol)
                if bad:
                    problems.append(f"gradient of {name} (model {k}): {bad}")
        for j, (a, b) in enumerate(zip(tensors_of(leaves), tensors_of(ref_leaves))):
            if a.grad is not None and b.grad is not None:
                bad = _close(a.grad[k], b.grad, rtol, atol)
                if bad:
                    problems.append(f"input gradient {j} (model {k}): {bad}")

    # State dicts: round trip into a new BatchModule and back out through unbatch().
    states = bm.state_dicts()
    other = BatchModule(module_factory().to(dtype), batch)
    other.load_state_dicts(states)
    for i, (a, b) in enumerate(zip(states, other.state_dicts())):
        for key in a:
            if not torch.equal(a[key], b[key]):
                problems.append(f"state dict round trip: model {i}, {key} differs")
    for i in (0, batch - 1):
        plain = other.unbatch(i).state_dict()
        for key, v in states[i].items():
            if not torch.equal(plain[key], v):
                problems.append(f"unbatch({i}): {key} differs from the batched model's")
    if problems:
        raise BatchingMismatch(
            f"BatchModule does not run {type(models[0]).__name__} like {batch} separate models:\n  "
            + "\n  ".join(problems)
        )
    return bm
