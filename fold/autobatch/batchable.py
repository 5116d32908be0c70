"""``fold.batchable``: a function or method recorded as one node per call inside autobatch,
and plain eager code outside it (a ``batched=True`` function gets a batch of one)."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fold.autobatch.common import _BATCHED, _C, _LOCAL, _PER_EXAMPLE
from fold.ragged import Ragged


class _PyBatchableBase:
    """The call and descriptor of ``batchable`` where the C ones (fold/_clazy.c, which take
    the fast path of ``_Recorder.record`` first) are not built."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)  # type: ignore[attr-defined]

    def __get__(self, obj: Any, cls: Any = None) -> Any:
        if obj is None:
            return self
        return types.MethodType(self, obj)


class batchable(_PyBatchableBase if _C is None else _C.BatchableBase):  # type: ignore[misc]  # noqa: N801
    """Mark a function or method as one recorded node per call inside :func:`autobatch`.

    ``@fold.batchable`` on code written for ONE example (no batch dim): a group runs the
    calls it makes, recorded once, each on the whole group (under ``torch.func.vmap`` where
    the function cannot be recorded so; see "How a group runs" in the docstring of fold/autobatch/__init__.py).
    ``@fold.batchable(batched=True)`` on code written for a batch
    in dim 0, like an explicit fold op: a group runs it directly, a ``list`` of Lazy values
    arrives as a :class:`fold.Ragged`, and a call outside autobatch gets a batch of one (its
    tensors unsqueezed, lists as a one-list Ragged, outputs squeezed).  Outside autobatch the
    per-example form is the plain function.
    """

    fn: Callable[..., Any] | None
    _kind: str

    def __init__(self, fn: Callable[..., Any] | None = None, *, batched: bool = False) -> None:
        self.batched = batched
        self.fn = fn
        self._kind = _BATCHED if batched else _PER_EXAMPLE
        if fn is not None:
            functools.update_wrapper(self, fn)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        """A call (the C base's fast path aside, see fold/_clazy.c)."""
        if self.fn is None:  # @batchable(batched=True) receiving the function
            (fn,) = args
            return batchable(fn, batched=self.batched)
        rec = _LOCAL.rec
        if rec is None or rec.paused or _LOCAL.running:
            if self.batched and not _LOCAL.running:
                return _batch_of_one(self.fn, args, kwargs)
            return self.fn(*args, **kwargs)
        return rec.record(self.fn, self._kind, args, kwargs)

    def __repr__(self) -> str:
        return f"<fold.batchable {getattr(self.fn, '__qualname__', self.fn)!r}>"


def _batch_of_one(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A ``batched=True`` function called on one example: tensors unsqueezed, lists of
    tensors as a one-list Ragged, outputs squeezed."""
    args, kwargs = pytree.tree_map(_one, (args, kwargs), is_leaf=_is_list_of_tensors)
    _LOCAL.running += 1
    try:
        out = fn(*args, **kwargs)
    finally:
        _LOCAL.running -= 1
    return pytree.tree_map(_unbatch, out)


def _is_list_of_tensors(x: Any) -> bool:
    return type(x) is list and all(isinstance(t, torch.Tensor) for t in x)


def _one(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.unsqueeze(0)
    if _is_list_of_tensors(x):
        if not x:  # no elements, so no shape: as fold gives a group of empty lists
            return Ragged(torch.zeros(0), torch.zeros(1, dtype=torch.long))
        return Ragged(torch.stack(x), torch.tensor([len(x)]))
    return x


def _unbatch(x: Any) -> Any:
    return x.squeeze(0) if isinstance(x, torch.Tensor) else x
