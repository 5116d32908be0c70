"""``fold.Ragged``: a list argument of variable length, as an op receives it.

A Python list of nodes is ONE argument of any length (0 included): ``f.add("node", x,
[c1, c2, c3])``.  Nodes whose lists differ in length share a group, and the op receives the
group's lists as one :class:`Ragged`: the elements of every list, list after list, in one
tensor, with their lengths.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from fold.errors import FoldError

__all__ = ["Ragged"]


# obj -> {(op, list argument position): (element shape, dtype)}: what a group of an op whose
# lists were all empty gets as its elements' shape (a TreeLSTM's leaves run before any node
# with children: from the second apply on, the shape of the first apply's elements).
_ELEMENTS: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()


def element_shapes(obj: Any) -> dict[Any, Any]:
    """The element shapes kept with ``obj`` (a dict for this apply alone where ``obj``
    cannot be weakly referenced)."""
    try:
        got = _ELEMENTS.get(obj)
        if got is None:
            got = _ELEMENTS[obj] = {}
        return got
    except TypeError:
        return {}


class Ragged:
    """``n`` lists of values, stored flat: ``values`` is ``(total, *feature)``, the lists one
    after another in the group's node order; ``lengths`` is ``(n,)`` int64.

    Where every list of the group is empty, nothing tells the elements' shape or dtype:
    ``values`` is ``(0,)`` in the default dtype, and the reductions and ``padded`` take them
    from their ``feature=`` and ``dtype=`` arguments (``children.sum(feature=(hidden,),
    dtype=torch.float64)``); where any list has values, those arguments are ignored.
    """

    __slots__ = ("values", "lengths", "_offsets", "_segments", "_host", "_grid")

    def __init__(self, values: torch.Tensor, lengths: torch.Tensor) -> None:
        if lengths.dim() != 1 or lengths.dtype != torch.long:
            raise FoldError(
                f"Ragged(values, lengths): lengths must be a 1-D int64 tensor, got shape "
                f"{tuple(lengths.shape)} {lengths.dtype}."
            )
        self.values = values
        self.lengths = lengths
        self._offsets: torch.Tensor | None = None
        self._segments: torch.Tensor | None = None
        # The lengths as a host int64 array where they are at hand without a device read
        # (an apply's gathers set it; see ``_slots``), and the slots once computed.
        self._host: np.ndarray | None = None
        self._grid: tuple[int, torch.Tensor] | None = None

    @classmethod
    def from_lists(cls, lists: list[list[torch.Tensor]]) -> Ragged:
        """A Ragged of lists of batch-of-one tensors (each ``(1, *feature)``)."""
        lengths = torch.tensor([len(x) for x in lists], dtype=torch.long)
        flat = [t for x in lists for t in x]
        values = torch.cat(flat, 0) if flat else torch.zeros(0)
        return cls(values, lengths.to(values.device))

    @classmethod
    def empty_lists(cls, n: int, feature: Any, dtype: Any, device: Any = None) -> Ragged:
        """``n`` empty lists whose elements would be ``feature``-shaped, of ``dtype``."""
        return cls(
            torch.zeros((0, *feature), dtype=dtype, device=device),
            torch.zeros(n, dtype=torch.long, device=device),
        )

    def __len__(self) -> int:
        return self.lengths.shape[0]

    def __repr__(self) -> str:
        return (
            f"Ragged({len(self)} lists, {self.values.shape[0]} values of shape "
            f"{tuple(self.values.shape[1:])})"
        )

    def with_values(self, values: torch.Tensor) -> Ragged:
        """The same lists holding other ``values`` (one row per value, e.g. a function of
        ``self.values``), sharing this Ragged's offsets and segment ids once computed."""
        if values.shape[:1] != self.values.shape[:1]:
            raise FoldError(
                f"Ragged.with_values(values): values has shape {tuple(values.shape)}; expected "
                f"one row per value, ({self.values.shape[0]}, ...)."
            )
        out = Ragged(values, self.lengths)
        out._offsets, out._segments = self._offsets, self._segments
        out._host, out._grid = self._host, self._grid
        return out

    def lists(self, start: int, length: int) -> Ragged:
        """Lists ``start`` to ``start + length`` (out of place: a ``narrow`` of the values)."""
        lengths = self.lengths.narrow(0, start, length)
        first = int(self.lengths[:start].sum()) if start else 0
        return Ragged(self.values.narrow(0, first, int(lengths.sum())), lengths)

    @property
    def offsets(self) -> torch.Tensor:
        """``(n + 1,)``: list i is ``values[offsets[i]:offsets[i + 1]]``."""
        if self._offsets is None:
            self._offsets = torch.cat([self.lengths.new_zeros(1), self.lengths.cumsum(0)])
        return self._offsets

    @property
    def segment_ids(self) -> torch.Tensor:
        """``(total,)``: the list each value belongs to."""
        if self._segments is None:
            n = len(self)
            self._segments = torch.repeat_interleave(
                torch.arange(n, device=self.lengths.device),
                self.lengths,
                output_size=self.values.shape[0],
            )
        return self._segments

    def _host_lengths(self) -> np.ndarray | None:
        """The lengths on the host: as an apply gave them, or read from a CPU tensor; None
        where reading them would wait for the device."""
        if self._host is None and self.lengths.device.type == "cpu":
            self._host = self.lengths.numpy()
        return self._host

    def _slots(self) -> tuple[int, torch.Tensor] | None:
        """``(L, slot)``: the longest length, and each value's row in the lists padded to
        ``L`` and flattened (list i's element k at ``i * L + k``); None where the lengths
        are not on the host (see ``_host_lengths``)."""
        if self._grid is None:
            host = self._host_lengths()
            if host is None:
                return None
            longest = int(host.max()) if len(host) else 0
            starts = np.cumsum(host) - host
            slot = np.arange(int(host.sum()), dtype=np.int64)
            slot += np.repeat(np.arange(len(host), dtype=np.int64) * longest - starts, host)
            self._grid = (longest, torch.from_numpy(slot).to(self.values.device, non_blocking=True))
        return self._grid

    def _feature(self, feature: Any) -> tuple[int, ...]:
        if self.values.shape[0] or feature is None:
            return tuple(self.values.shape[1:])
        return tuple(feature)

    def _dtype(self, dtype: Any) -> torch.dtype:
        return self.values.dtype if self.values.shape[0] or dtype is None else dtype

    def _zeros(self, feature: Any, dtype: Any) -> torch.Tensor:
        shape = (len(self), *self._feature(feature))
        return self.values.new_zeros(shape, dtype=self._dtype(dtype))

    def sum(self, feature: Any = None, dtype: Any = None) -> torch.Tensor:
        """``(n, *feature)``: each list's sum; zeros for an empty list."""
        out = self._zeros(feature, dtype)
        if not self.values.shape[0]:
            return out
        return out.index_add(0, self.segment_ids, self.values)

    def mean(self, feature: Any = None, dtype: Any = None) -> torch.Tensor:
        """``(n, *feature)``: each list's mean; zeros for an empty list."""
        total = self.sum(feature, dtype)
        count = self.lengths.clamp(min=1).to(total.dtype)
        return total / count.view(-1, *([1] * (total.dim() - 1)))

    def amax(self, feature: Any = None, dtype: Any = None) -> torch.Tensor:
        """``(n, *feature)``: each list's elementwise max; zeros for an empty list."""
        out = self._zeros(feature, dtype)
        if not self.values.shape[0]:
            return out
        index = self.segment_ids.view(-1, *([1] * (self.values.dim() - 1))).expand_as(self.values)
        out = out.scatter_reduce(0, index, self.values, "amax", include_self=False)
        return out

    @property
    def mask(self) -> torch.Tensor:
        """``(n, L)`` bool, L the longest length: True where a list has a value."""
        host = self._host_lengths()
        if host is not None:
            longest = int(host.max()) if len(host) else 0
        else:
            longest = int(self.lengths.max()) if len(self) else 0
        steps = torch.arange(longest, device=self.lengths.device)
        return steps[None, :] < self.lengths[:, None]

    def padded(self, fill: float = 0.0, feature: Any = None, dtype: Any = None) -> torch.Tensor:
        """``(n, L, *feature)``: the lists padded with ``fill`` to the longest; see ``mask``."""
        grid = self._slots()
        if grid is None:
            mask = self.mask
            shape = (*mask.shape, *self._feature(feature))
            out = self.values.new_full(shape, fill, dtype=self._dtype(dtype))
            if not self.values.shape[0]:
                return out
            return out.index_put((mask.nonzero(as_tuple=True)), self.values)
        # Each value copied to its slot of the flat padded rows: one index_copy, no mask.
        longest, slot = grid
        feature = self._feature(feature)
        out = self.values.new_full((len(self) * longest, *feature), fill, dtype=self._dtype(dtype))
        if self.values.shape[0]:
            out = out.index_copy(0, slot, self.values)
        return out.view(len(self), longest, *feature)

    def softmax(self, scores: torch.Tensor) -> torch.Tensor:
        """``(total,)`` scores -> ``(total,)`` weights: a softmax within each list."""
        if scores.shape[:1] != self.values.shape[:1]:
            raise FoldError(
                f"Ragged.softmax(scores): scores has shape {tuple(scores.shape)}; expected one "
                f"score per value, ({self.values.shape[0]}, ...)."
            )
        if not scores.shape[0]:
            return scores
        grid = self._slots()
        if grid is not None:
            # The scores in their slots of the padded lists (-inf past each length), one
            # softmax along the lists, the values' slots read back: four ops, where the
            # segment form below takes seven (it reads nothing from the host).
            longest, slot = grid
            rest = scores.shape[1:]
            full = scores.new_full((len(self) * longest, *rest), float("-inf"))
            full = full.index_copy(0, slot, scores).view(len(self), longest, *rest)
            return full.softmax(1).view(len(self) * longest, *rest).index_select(0, slot)
        seg = self.segment_ids
        index = seg.view(-1, *([1] * (scores.dim() - 1))).expand_as(scores)
        top = scores.new_full((len(self), *scores.shape[1:]), float("-inf"))
        top = top.scatter_reduce(0, index, scores, "amax", include_self=True)
        e = (scores - top[seg]).exp()
        total = e.new_zeros((len(self), *scores.shape[1:])).index_add(0, seg, e)
        return e / total[seg]

    def nested(self) -> torch.Tensor:
        """The same data as a ``torch.nested`` jagged tensor ``(n, j, *feature)``."""
        return torch.nested.nested_tensor_from_jagged(self.values, offsets=self.offsets)


class ModelRagged(Ragged):
    """The lists of N models at once (a list argument of an op applied with a
    ``BatchModule``): list ``i * N + m`` is node i's list for model m, so reductions come
    back ``(n * N, *feature)`` in ``(node, model)`` order, as node arguments are.  ``values``
    keeps the rows as the models' batched layers read them, model index fastest (node i's
    element k for model m is a row of its own), so the lists are not contiguous: ``sum``,
    ``mean``, ``amax``, ``softmax``, ``padded``, ``mask`` and ``with_values`` work by each
    row's list and position; ``offsets`` and ``nested`` (which need contiguous lists) raise.
    """

    def __init__(
        self,
        values: torch.Tensor,
        lengths: torch.Tensor,
        segments: torch.Tensor,
        positions: torch.Tensor,
        models: int,
    ) -> None:
        super().__init__(values, lengths)
        self._segments = segments
        self._positions = positions
        self.models = models

    def with_values(self, values: torch.Tensor) -> Ragged:
        if values.shape[:1] != self.values.shape[:1]:
            super().with_values(values)  # raises, naming the shape
        out = ModelRagged(values, self.lengths, self._segments, self._positions, self.models)
        out._host, out._grid = self._host, self._grid
        return out

    def _slots(self) -> tuple[int, torch.Tensor] | None:
        """As ``Ragged._slots``, each row's slot from its list and position."""
        if self._grid is None:
            host = self._host_lengths()
            if host is None:
                return None
            longest = int(host.max()) if len(host) else 0
            assert self._segments is not None
            self._grid = (longest, self._segments * longest + self._positions)
        return self._grid

    def lists(self, start: int, length: int) -> Ragged:
        """Lists ``start`` to ``start + length``: whole nodes (multiples of the models)."""
        lengths = self.lengths.narrow(0, start, length)
        first = int(self.lengths[:start].sum()) if start else 0
        count = int(lengths.sum())
        segments = self._segments.narrow(0, first, count) - start
        positions = self._positions.narrow(0, first, count)
        values = self.values.narrow(0, first, count)
        return ModelRagged(values, lengths, segments, positions, self.models)

    @property
    def offsets(self) -> torch.Tensor:
        raise FoldError(
            "Ragged.offsets: the lists of N models (a BatchModule) are not contiguous in "
            "values (the models' rows alternate, as their layers read them). Fix: use "
            "segment_ids, sum, mean, amax, softmax or padded."
        )

    def nested(self) -> torch.Tensor:
        return self.offsets  # raises

    def padded(self, fill: float = 0.0, feature: Any = None, dtype: Any = None) -> torch.Tensor:
        mask = self.mask
        shape = (*mask.shape, *self._feature(feature))
        out = self.values.new_full(shape, fill, dtype=self._dtype(dtype))
        if not self.values.shape[0]:
            return out
        return out.index_put((self._segments, self._positions), self.values)
