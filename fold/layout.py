"""A recorded graph as numpy arrays: what the scheduler and the executor read per ``apply``.

Recording keeps Python objects (per signature, a dict from arguments to handle); running
needs whole columns of them.  :class:`GraphArrays` converts each signature's nodes once per
``apply``, in C (``array``/``numpy``), so that scheduling and gathering cost a few array
operations per group instead of Python work per node.
"""

from __future__ import annotations

import array
import itertools
from typing import Any

import numpy as np
import torch

from fold.errors import FoldError
from fold.graph import (
    BOOL,
    DEPTH_SHIFT,
    FLOAT,
    ID_MASK,
    ID_SHIFT,
    INT,
    NODE,
    NSPLIT_MASK,
    NSPLIT_SHIFT,
    OUT_MASK,
    op_name,
)

__all__ = ["GraphArrays", "decode", "handles_array", "number_column", "numbers_tensor"]


def decode(handles: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Handles -> (node ids, output indices, outputs each handle needs its op to return)."""
    return (
        (handles >> ID_SHIFT) & ID_MASK,
        handles & OUT_MASK,
        np.maximum((handles >> NSPLIT_SHIFT) & NSPLIT_MASK, 1),
    )


_NUMBER_NP = {INT: np.int64, FLOAT: np.float64, BOOL: np.bool_}


# array typecode and torch dtype of what torch.tensor makes of a list of one number type
_LIST_ARRAY = {int: ("q", torch.long), bool: ("B", torch.bool)}
_FLOAT_ARRAY = {torch.float32: ("f", torch.float32), torch.float64: ("d", torch.float64)}


def numbers_tensor(items: list[Any]) -> torch.Tensor:
    """``torch.tensor(items)`` for a list of Python numbers: the same dtype and values.

    Where all items share one type, built through ``array.array`` and ``torch.frombuffer``:
    a third faster than ``torch.tensor`` where it counts, right after a training step, when
    little of the conversion code is in the CPU's caches (numpy's is slower still there).
    Floats convert as C casts to the default dtype, as ``torch.tensor`` converts them.
    """
    kind = type(items[0]) if items else None
    code = _FLOAT_ARRAY.get(torch.get_default_dtype()) if kind is float else _LIST_ARRAY.get(kind)
    if code is not None and len(set(map(type, items))) == 1:
        try:
            buf = array.array(code[0], items)
        except OverflowError:
            return torch.tensor(items)  # an int beyond int64: torch.tensor raises its error
        return torch.frombuffer(buf, dtype=code[1])  # the tensor keeps buf alive
    return torch.tensor(items)


def handles_array(handles: Any) -> np.ndarray:
    """Handles (Nodes or ints) as an int64 array, converted in C."""
    try:
        return np.frombuffer(array.array("q", handles), dtype=np.int64)
    except OverflowError:
        raise FoldError(
            "apply: the graph is deeper than int64 handles can describe (about 500k steps). "
            "Fix: split the computation into several Folds."
        ) from None


def number_column(op: Any, pos: int, kind: int, values: Any) -> np.ndarray:
    """Python numbers of one argument position as a numpy array of their kind's dtype."""
    try:
        return np.array(values, dtype=_NUMBER_NP[kind])
    except OverflowError:
        raise FoldError(
            f"apply: op {op_name(op)!r}, argument {pos}: an int does not fit in torch.long "
            "(int64). Fix: pass a smaller int, or a float."
        ) from None


class GraphArrays:
    """Per node id: ``sig`` (signature id), ``pos`` (index among its signature's nodes) and
    ``depth``, built on first use; per signature: ``count`` and, on demand, its argument
    ``columns``.  ``flat``: no node has node arguments (every node is at depth 0).

    Node ids are a topological order; within a signature, positions follow node ids.
    """

    def __init__(self, fold: Any, n: int) -> None:
        self.n = n
        # The Fold's own lists, not the Fold: it caches this object, and a cycle would keep
        # every applied graph alive until a full garbage collection.
        self._signatures = fold.signatures
        self._memos = fold._memos
        self._targs = fold._targs
        self.count: list[int] = list(map(len, fold._memos))
        self.flat = not any(NODE in kinds for _, kinds in fold.signatures)
        self._per_node: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._columns: list[Any] = [None] * len(self.count)

    def _nodes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._per_node is None:
            n = self.n
            if len(self._memos) == 1:  # one signature: node ids are its positions
                h = handles_array(self._memos[0].values())
                per_node = (np.zeros(n, np.int64), np.arange(n), h >> DEPTH_SHIFT)
            else:
                sig, pos, depth = (np.empty(n, np.int64) for _ in range(3))
                for sid, memo in enumerate(self._memos):
                    h = handles_array(memo.values())
                    ids = (h >> ID_SHIFT) & ID_MASK
                    sig[ids] = sid
                    pos[ids] = np.arange(len(h))
                    depth[ids] = h >> DEPTH_SHIFT
                per_node = (sig, pos, depth)
            self._per_node = per_node
        return self._per_node

    @property
    def sig(self) -> np.ndarray:
        return self._nodes()[0]

    @property
    def pos(self) -> np.ndarray:
        return self._nodes()[1]

    @property
    def depth(self) -> np.ndarray:
        return self._nodes()[2]

    def columns(self, sid: int) -> tuple[list[Any], list[int], np.ndarray | None, Any]:
        """The arguments of signature ``sid``'s nodes, in node order: per argument position a
        numpy array (numbers) or a list (literal tensors), None at node positions; the node
        positions; the node arguments' handles as one int64 array (nodes x positions); and
        those handles decoded (``decode``), stacked in one (3, nodes, positions) array so that
        a group takes its rows of all three with one index, once for all the groups."""
        entry = self._columns[sid]
        if entry is None:
            op, kinds = self._signatures[sid]
            rows = self._targs[sid]
            if rows is None:
                rows = list(self._memos[sid])
            node_js = [j for j, k in enumerate(kinds) if k == NODE]
            if node_js and len(node_js) == len(kinds):  # node arguments only: one conversion
                hmat = handles_array(itertools.chain.from_iterable(rows)).reshape(
                    len(rows), len(kinds)
                )
                entry = ([None] * len(kinds), node_js, hmat, np.stack(decode(hmat)))
            elif node_js and all(k == INT for k in kinds if k != NODE):
                # Nodes and ints (an RNN step(h, word)): one int64 conversion for all of them.
                try:
                    flat = np.frombuffer(
                        array.array("q", itertools.chain.from_iterable(rows)), dtype=np.int64
                    ).reshape(len(rows), len(kinds))
                except OverflowError:  # an int beyond int64: the per-column path names it
                    flat = None
                if flat is not None:
                    cols = [
                        None if k == NODE else np.ascontiguousarray(flat[:, j])
                        for j, k in enumerate(kinds)
                    ]
                    hmat = np.ascontiguousarray(flat[:, node_js])
                    entry = (cols, node_js, hmat, np.stack(decode(hmat)))
            if entry is None:
                raw = list(zip(*rows)) if kinds else []
                cols: list[Any] = []
                for j, k in enumerate(kinds):
                    if k == NODE:
                        cols.append(None)
                    elif type(k) is tuple:
                        cols.append(raw[j])
                    else:
                        cols.append(number_column(op, j, k, raw[j]))
                hmat = (
                    np.stack([handles_array(raw[j]) for j in node_js], axis=1) if node_js else None
                )
                entry = (cols, node_js, hmat, None if hmat is None else np.stack(decode(hmat)))
            self._columns[sid] = entry
        return entry
