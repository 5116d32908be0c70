"""The base class and registry of model-batched layers, and the row layout they share.

N models of one architecture run as one module.  Inside, the rows of the N models are merged
into one leading dim in ``(b g)`` order -- row ``r`` belongs to sample ``r // N`` of model
``r % N`` -- so user code written for an ordinary ``(rows, features)`` batch (``x.view(-1,
784)``, ``torch.relu``) runs unchanged, and only layers with parameters, or that mix rows,
need batched versions.  With model index fastest, a convolution's input ``(b*N, C, H, W)`` is
the same memory as ``(b, N*C, H, W)``: one grouped convolution runs all N models.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fold.errors import FoldError

__all__ = [
    "AbstractBatchModule",
    "from_merged",
    "model_index",
    "register_batch_module",
    "registry",
    "to_merged",
]

registry: dict[type[nn.Module], type[AbstractBatchModule]] = {}

_THREAD = threading.local()  # per thread: {id(layer): (chunk, parameter splits)}

T = TypeVar("T", bound="type[AbstractBatchModule]")


def register_batch_module(cls: T) -> T:
    """Register a batched layer for its ``base_class`` (usable as a class decorator).

    Example::

        @register_batch_module
        class BatchScale(AbstractBatchModule):
            base_class = Scale                       # the user's layer: y = x * self.weight

            def __init__(self, modules):
                super().__init__(len(modules))
                self.weight = self.stack(modules, "weight")

            def forward(self, x):                    # x: (b*N, ...) in (b g) order
                return (self.split_models(x) * self.p("weight")).flatten(0, 1)
    """
    base = getattr(cls, "base_class", None)
    if not (isinstance(base, type) and issubclass(base, nn.Module)):
        raise FoldError(
            f"register_batch_module({cls.__name__}): set base_class to the nn.Module subclass "
            "it batches, e.g. base_class = nn.Linear."
        )
    registry[base] = cls
    return cls


class AbstractBatchModule(nn.Module):
    """A layer that runs N models' copies of ``base_class`` at once on ``(b*N, ...)`` rows.

    Subclasses build themselves from the N modules (``__init__(modules)``), keep parameters
    and buffers stacked along a leading model dim under the base class's names, and compute
    on them directly.  The default state-dict helpers index that leading dim.
    """

    base_class: ClassVar[type[nn.Module]]

    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch = batch

    # The chunk a call runs, and the parameter splits of that pass, live in thread-local
    # state, not on the module: one BatchModule applied from several threads at once runs
    # each thread's chunks with that thread's own views of the weights.
    def _chunk_state(self) -> tuple[tuple[int, int], dict[str, tuple[torch.Tensor, ...]]] | None:
        table = getattr(_THREAD, "chunks", None)
        return None if table is None else table.get(id(self))

    def set_chunk(self, chunk: tuple[int, int] | None) -> None:
        """Run the models of chunk ``(size, index)`` from now on in this thread (None: all)."""
        table = getattr(_THREAD, "chunks", None)
        if table is None:
            table = _THREAD.chunks = {}
        if chunk is None:
            table.pop(id(self), None)
            return
        state = table.get(id(self))
        # A new pass (chunk 0) splits the parameters afresh.
        parts = {} if state is None or chunk[1] == 0 else state[1]
        table[id(self)] = (chunk, parts)

    @property
    def chunk(self) -> tuple[int, int] | None:
        """(chunk size, chunk index) of the models this thread's calls run; None for all."""
        state = self._chunk_state()
        return None if state is None else state[0]

    @property
    def n(self) -> int:
        """The number of models this call runs (all N, or the current chunk's)."""
        state = self._chunk_state()
        if state is None:
            return self.batch
        size, index = state[0]
        return min(size, self.batch - size * index)

    def p(self, name: str) -> Any:
        """Parameter or buffer ``name`` for the models this call runs (a view).

        Chunks take the pieces of ONE ``split`` per pass, so backward concatenates their
        gradients once instead of scattering each chunk's into a zero tensor of full size.
        """
        t = getattr(self, name)
        state = self._chunk_state()
        if t is None or state is None:
            return t
        (size, index), cache = state
        parts = cache.get(name)
        if parts is None:
            parts = cache[name] = t.split(size, 0)
        return parts[index]

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module]) -> AbstractBatchModule:
        return cls(modules)  # type: ignore[call-arg]

    @staticmethod
    def stack(modules: Sequence[nn.Module], name: str, buffer: bool = False) -> Any:
        """``modules[i].<name>`` stacked along a new leading dim, as a Parameter (or buffer)."""
        values = [getattr(m, name) for m in modules]
        if values[0] is None:
            return None
        stacked = torch.stack([v.detach() for v in values]).clone()
        if buffer:
            return stacked
        return nn.Parameter(stacked, requires_grad=values[0].requires_grad)

    def row_dims(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int | None]:
        """The dim of the merged rows in each tensor of ``forward``'s arguments, in the
        order ``torch.utils._pytree`` lists them (``BatchModule``'s row check holds the
        model's code to it): the leading dim unless the layer says otherwise; None for a
        tensor the layer takes as the same for every model."""
        return [0] * count_tensors((args, kwargs))

    def result_row_dims(self, out: Any) -> list[int]:
        """The dim of the merged rows in each tensor of ``forward``'s result (pytree
        order): the leading dim unless the layer says otherwise."""
        return [0] * count_tensors(out)

    def split_models(self, x: torch.Tensor) -> torch.Tensor:
        """``(b*N, ...)`` -> ``(b, N, ...)`` (a view)."""
        return x.view(-1, self.n, *x.shape[1:])

    def state_of(self, i: int) -> dict[str, torch.Tensor]:
        """Model ``i``'s state dict, with the base class's keys."""
        return {k: v[i] for k, v in self.state_dict().items()}

    def grads_of(self, i: int) -> dict[str, torch.Tensor | None]:
        """Model ``i``'s parameter gradients, with the base class's names."""
        return {k: None if p.grad is None else p.grad[i] for k, p in self.named_parameters()}

    def load_state_of(self, i: int, state: dict[str, torch.Tensor]) -> None:
        """Copy model ``i``'s state (base class keys) into the stacked tensors."""
        with torch.no_grad():
            for k, v in self.state_dict(keep_vars=True).items():
                v[i].copy_(state[k])


def model_index(i: Any, n: int, where: str) -> int:
    """``i`` as the index of one of ``n`` models, or a FoldError: an int (numpy ints too, not
    bools) in ``[0, n)``; negative indices are refused, not counted from the end."""
    try:
        k = operator.index(i)
    except TypeError:
        k = None
    if k is None or isinstance(i, bool) or not 0 <= k < n:
        raise FoldError(
            f"{where}({i!r}): expected the index of a model, an int from 0 to {n - 1} "
            f"(there are {n} models)."
        )
    return k


def to_merged(x: torch.Tensor, batch: int, where: str, dim: int = 0) -> torch.Tensor:
    """``(N, b, ...)`` -> ``(b*N, ...)`` in ``(b g)`` order; with ``dim``, each model's rows
    are its dim ``dim`` (an RNN's states ``(N, layers, b, H)``: ``dim=1``)."""
    if x.dim() < 2 + dim or x.shape[0] != batch:
        raise FoldError(
            f"{where}: expected an input of shape (N={batch}, b, ...), one slice per model, "
            f"got {tuple(x.shape)}. Fix: stack the models' inputs along dim 0, or use "
            "x.expand(N, *x.shape) to give every model the same batch."
        )
    if dim:
        return x.movedim(0, dim + 1).flatten(dim, dim + 1)
    return x.transpose(0, 1).reshape(-1, *x.shape[2:])


def from_merged(y: torch.Tensor, batch: int, dim: int = 0) -> torch.Tensor:
    """``(b*N, ...)`` -> ``(N, b, ...)`` (rows in ``dim``); for one model, any result (a
    scalar too) gets its model dim."""
    if batch == 1:
        return y.unsqueeze(0)
    if dim:
        return y.unflatten(dim, (-1, batch)).movedim(dim + 1, 0)
    return y.view(-1, batch, *y.shape[1:]).transpose(0, 1)


def count_tensors(value: Any) -> int:
    """How many tensors ``value`` holds, anywhere in its ``torch.utils._pytree`` tree (the
    order ``row_dims`` lists them in)."""
    return sum(1 for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors of a tensor, or of a tuple, list or dict of them (nested), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_of(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_of(v)]
    return []


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """Apply ``fn`` to every tensor of a tensor, tuple, list or dict; other values pass
    through."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        if hasattr(value, "_fields"):  # a namedtuple
            return type(value)(*(map_tensors(fn, v) for v in value))
        return type(value)(map_tensors(fn, v) for v in value)
    if isinstance(value, dict):
        return _same_kind(value, {k: map_tensors(fn, v) for k, v in value.items()})
    return value


def _same_kind(like: dict[Any, Any], items: dict[Any, Any]) -> dict[Any, Any]:
    """``items`` as a dict of ``like``'s type, where that type is built from a dict (a
    ``defaultdict`` is not: a plain dict then)."""
    try:
        return type(like)(items)
    except TypeError:
        return items
