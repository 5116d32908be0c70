"""A recorded graph as numpy arrays: the one view of a graph that schedulers and the
executor read.

Recording keeps Python objects (per signature, a dict from arguments to handle); running
needs whole columns of them.  :class:`GraphArrays` converts each signature's nodes once per
``apply``, in C (``array``/``numpy``), so that scheduling and gathering cost a few array
operations per group instead of Python work per node.  It is built from the recorded lists
a Fold hands over (``Fold.snapshot``), never from a Fold's private fields.
"""

from __future__ import annotations

import array
import itertools
from operator import itemgetter
from typing import Any

import numpy as np
import torch

from fold._encoding import (
    ID_MASK,
    INT,
    LIST,
    NODE,
    NUMBER_DTYPES,
    decode,
    depth_of,
    is_tensor_kind,
    key_rows,
    list_handles,
    list_lengths,
    node_id,
    packed,
    packed_matrix,
)
from fold.errors import FoldError, op_name

__all__ = [
    "GraphArrays",
    "distinct",
    "handles_array",
    "runs_of",
    "stable_order",
    "literal_column",
    "number_column",
    "numbers_tensor",
]


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


def distinct(x: np.ndarray) -> np.ndarray:
    """The distinct values of a 1-D array, sorted: ``np.unique(x)`` by one sort and one
    comparison of neighbours.  (numpy 2's ``np.unique`` hashes before it sorts: on 40k int64
    values that took 6.7 ms against 0.4 for this, and the edges of a graph with list
    arguments are that many.)"""
    s = np.sort(x)
    if len(s) < 2:
        return s
    keep = np.empty(len(s), bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


def stable_order(x: np.ndarray, bound: int) -> np.ndarray:
    """``np.argsort(x, kind="stable")`` of non-negative ints below ``bound``.  numpy sorts
    8- and 16-bit ints by radix, so keys that fit are sorted as such: for 45k keys 0.7 ms
    against 3 ms as int64 (the agenda sorts a graph's edges twice per plan)."""
    for small in (np.uint8, np.uint16):
        if bound <= np.iinfo(small).max + 1:
            return np.argsort(x.astype(small), kind="stable")
    return np.argsort(x, kind="stable")


def runs_of(keys: np.ndarray, bound: int) -> list[np.ndarray]:
    """The positions of each distinct key (non-negative ints below ``bound``), key after key
    in increasing order, each run in position order: one stable sort (``stable_order``).
    A scheduler walks a graph's edges so, level by level."""
    order = stable_order(keys, bound)
    sk = keys[order]
    cuts = (np.flatnonzero(sk[1:] != sk[:-1]) + 1).tolist()
    return [order[lo:hi] for lo, hi in zip([0, *cuts], [*cuts, len(order)])]


def handles_array(handles: Any) -> np.ndarray:
    """Handles (Nodes or ints; a sized collection, a memo's ``values()``) as an int64 array,
    converted in C: ``np.fromiter`` with the count given reads a dict's values about 3x
    faster than ``array.array`` (2.3 against 8.5 ms for 100k)."""
    try:
        return np.fromiter(handles, dtype=np.int64, count=len(handles))
    except OverflowError:
        raise FoldError(
            "apply: the graph is deeper than int64 handles can describe (about 500k steps). "
            "Fix: split the computation into several Folds."
        ) from None


def number_column(op: Any, pos: int, kind: int, values: Any) -> np.ndarray:
    """Python numbers of one argument position as a numpy array of their kind's dtype."""
    try:
        return np.array(values, dtype=NUMBER_DTYPES[kind])
    except OverflowError:
        raise FoldError(
            f"apply: op {op_name(op)!r}, argument {pos}: an int does not fit in torch.long "
            "(int64). Fix: pass a smaller int, or a float."
        ) from None


def literal_column(op: Any, pos: int, kind: Any, values: Any) -> Any:
    """One literal argument column as the executor takes it: literal tensors as a sequence
    (concatenated by ``fold.ops.literal_value``), numbers as a numpy array of their kind's
    dtype.  The one place a literal kind's column is converted."""
    if is_tensor_kind(kind):
        return values
    return number_column(op, pos, kind, values)


class _Chained:
    """The handles of several memos, one after another, with their number (for
    ``handles_array``)."""

    __slots__ = ("memos", "total")

    def __init__(self, memos: list[dict[Any, int]], total: int) -> None:
        self.memos, self.total = memos, total

    def __len__(self) -> int:
        return self.total

    def __iter__(self) -> Any:
        return itertools.chain.from_iterable([m.values() for m in self.memos])


class GraphArrays:
    """A snapshot of a recorded graph, read through arrays; what schedulers and the executor
    take (it satisfies :class:`fold.scheduler.GraphView`).

    Per node id: ``sig`` (signature id), ``pos`` (index among its signature's nodes) and
    ``depth``, built on first use; per signature: ``count``, ``signatures`` (op, kinds) and,
    on demand, its argument ``columns``.  ``flat``: no node has node arguments.  Node ids
    are a topological order; within a signature, positions follow node ids.

    Built by ``Fold.snapshot`` from the Fold's recorded lists: per signature ``(op, kinds)``,
    a dict from argument keys to handles (insertion order is node order) and, for signatures
    with literal tensors, the argument tuples themselves (their memo keys hold tensor ids).
    ``plans`` caches the plans of this snapshot per strategy.
    """

    def __init__(
        self,
        signatures: list[tuple[Any, tuple[Any, ...]]],
        memos: list[dict[Any, int]],
        targs: list[list[tuple[Any, ...]] | None],
        nobatch: set[int],
        node_type: type,
        n: int,
    ) -> None:
        if n > ID_MASK:
            raise FoldError(f"Fold: the graph has {n} nodes, more than {ID_MASK}.")
        self.n = n
        self.signatures = signatures
        self._memos = memos
        self._targs = targs
        self.nobatch = nobatch
        self.node_type = node_type
        self.count: list[int] = list(map(len, memos))
        self.plans: dict[Any, Any] = {}
        # What applies of the object being applied have shown (``fold.scheduler.auto``).
        self.facts: Any = None
        self._handles: dict[int, list[int]] = {}
        self._first: dict[int, int] | None = None
        self._per_node: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._columns: list[Any] = [None] * len(self.count)
        self._node_columns: dict[int, np.ndarray] = {}  # (see node_columns)

    @property
    def flat(self) -> bool:
        """Whether no node has node arguments or list arguments (all nodes at depth 0)."""
        return not any(NODE in kinds or LIST in kinds for _, kinds in self.signatures)

    # ------------------------------------------------------------ per signature
    def handles(self, sid: int) -> list[int]:
        """The whole handles of signature ``sid``'s nodes, in node order (plain ints; a list
        kept with the snapshot, not to be changed)."""
        got = self._handles.get(sid)
        if got is None:
            got = self._handles[sid] = list(self._memos[sid].values())
        return got

    def first_nodes(self) -> dict[int, int]:
        """The whole handle of each signature's first node -> that signature."""
        if self._first is None:
            self._first = {self.first_handle(t): t for t in range(len(self.count))}
        return self._first

    def first_handle(self, sid: int) -> int:
        """The whole handle of signature ``sid``'s first node."""
        return next(iter(self._memos[sid].values()))

    def rows(self, sid: int) -> list[tuple[Any, ...]]:
        """The recorded arguments of signature ``sid``'s nodes, in node order; node arguments
        as plain-int handles, literal tensors as themselves."""
        rows = self._targs[sid]
        return key_rows(self._memos[sid], self.signatures[sid][1]) if rows is None else rows

    def first_row(self, sid: int) -> tuple[Any, ...]:
        """The recorded arguments of signature ``sid``'s first node."""
        rows = self._targs[sid]
        if rows is None:
            return key_rows([next(iter(self._memos[sid]))], self.signatures[sid][1])[0]
        return rows[0]

    def op_of(self, nid: int) -> Any:
        """The op recorded as node ``nid``."""
        return self.signatures[int(self.sig[nid])][0]

    # ------------------------------------------------------------ per node
    def _nodes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._per_node is None:
            n = self.n
            if len(self._memos) == 1:  # one signature: node ids are its positions
                h = handles_array(self._memos[0].values())
                per_node = (np.zeros(n, np.int64), np.arange(n), depth_of(h))
            else:  # every signature's handles in one array, then three scatters
                sig, pos, depth = (np.empty(n, np.int64) for _ in range(3))
                counts = np.asarray(self.count, np.int64)
                total = int(counts.sum())
                h = handles_array(_Chained(self._memos, total))
                ids = node_id(h)
                sig[ids] = np.repeat(np.arange(len(counts)), counts)
                pos[ids] = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
                depth[ids] = depth_of(h)
                per_node = (sig, pos, depth)
            depth = per_node[2]
            if depth.size and depth.min() < 0:  # made from a forged (negative) handle
                nid = int(np.argmin(depth))
                raise FoldError(
                    f"apply: op {op_name(self.signatures[int(per_node[0][nid])][0])!r} was recorded "
                    "with a node argument that is not a handle this Fold recorded (a Node made "
                    "from a negative int). Fix: pass the nodes add() returns."
                )
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

    def ids(self, sid: int) -> np.ndarray:
        """The node ids of signature ``sid``'s nodes, in node order."""
        return node_id(handles_array(self._memos[sid].values()))

    def edges(self) -> tuple[np.ndarray, np.ndarray]:
        """(source, consumer) node ids: one edge per distinct node argument (or list
        element) of a consumer, signature after signature."""
        srcs, dsts = [], []
        for sid in range(len(self.count)):
            cols, node_js, _hmat, decoded = self.columns(sid)
            list_js = [j for j, k in enumerate(self.signatures[sid][1]) if k == LIST]
            if list_js:  # elements of lists too; distinct pairs by sorting
                ids = self.ids(sid)
                src_parts = [decoded[0].ravel()] if node_js else []
                dst_parts = [np.repeat(ids, len(node_js))] if node_js else []
                for j in list_js:
                    src_parts.append(node_id(list_handles(cols[j])))
                    dst_parts.append(np.repeat(ids, list_lengths(cols[j])))
                pair = distinct(np.concatenate(dst_parts) * self.n + np.concatenate(src_parts))
                srcs.append(pair % self.n)
                dsts.append(pair // self.n)
                continue
            if not node_js:
                continue
            src = decoded[0]  # count x node positions
            dst = np.broadcast_to(self.ids(sid)[:, None], src.shape)
            if src.shape[1] > 1:  # a node read at two positions is one edge
                src = np.sort(src, axis=1)
                keep = np.ones(src.shape, bool)
                keep[:, 1:] = src[:, 1:] != src[:, :-1]
                src, dst = src[keep], dst[keep]
            srcs.append(src.ravel())
            dsts.append(dst.ravel())
        if not srcs:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(srcs), np.concatenate(dsts)

    def keys(self) -> list[Any] | None:
        """Per node, the key that decides which nodes may share a group; None where that is
        the signature id of every node.

        Nobatch nodes change it: a nobatch node gets a key of its own (it runs alone and its
        output is passed whole), and a consumer's key also names the nobatch handles it
        reads (position, handle), since a batched call takes one whole value per argument.
        """
        nobatch = self.nobatch
        if not nobatch:
            return None
        keys: list[Any] = self.sig.tolist()
        marked = np.fromiter(nobatch, np.int64, len(nobatch))
        for sid in range(len(self.count)):
            _cols, node_js, hmat, decoded = self.columns(sid)
            if not node_js:
                continue
            reads = np.isin(decoded[0], marked)
            for i in np.flatnonzero(reads.any(axis=1)).tolist():
                shared = tuple(
                    (node_js[c], int(hmat[i, c])) for c in np.flatnonzero(reads[i]).tolist()
                )
                nid = int(self.ids(sid)[i])
                keys[nid] = (keys[nid], shared)
        for nid in nobatch:
            keys[nid] = ("nobatch", nid)
        return keys

    # ------------------------------------------------------------ argument columns
    def columns(self, sid: int) -> tuple[list[Any], list[int], np.ndarray | None, Any]:
        """The arguments of signature ``sid``'s nodes, in node order: per argument position a
        numpy array (numbers) or a list (literal tensors), None at node positions; the node
        positions; the node arguments' handles as one int64 array (nodes x positions); and
        those handles decoded (``decode``), stacked in one (3, nodes, positions) array so that
        a group takes its rows of all three with one index, once for all the groups."""
        entry = self._columns[sid]
        if entry is None:
            op, kinds = self.signatures[sid]
            node_js = [j for j, k in enumerate(kinds) if k == NODE]
            if packed(kinds):  # node arguments only: one buffer
                hmat = packed_matrix(self._memos[sid], len(kinds))
                entry = ([None] * len(kinds), node_js, hmat, np.stack(decode(hmat)))
                self._check_handles(sid, hmat, entry[3][0])
                self._columns[sid] = entry
                return entry
            rows = self.rows(sid)
            if node_js and all(k == INT for k in kinds if k != NODE):
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
                # Column by column: zip(*rows) would make an iterator per row, thousands of
                # short-lived tracked objects that a collection can promote to the oldest
                # generation (and so bring its full collection nearer).
                raw = [list(map(itemgetter(j), rows)) for j in range(len(kinds))]
                cols: list[Any] = [
                    None
                    if k == NODE
                    else raw[j]  # a list argument: per node, its key (see list_handles)
                    if k == LIST
                    else literal_column(op, j, k, raw[j])
                    for j, k in enumerate(kinds)
                ]
                hmat = (
                    np.stack([handles_array(raw[j]) for j in node_js], axis=1) if node_js else None
                )
                entry = (cols, node_js, hmat, None if hmat is None else np.stack(decode(hmat)))
            if entry[2] is not None:
                self._check_handles(sid, entry[2], entry[3][0])
            self._columns[sid] = entry
        return entry

    def node_columns(self, sid: int) -> np.ndarray:
        """The node arguments' handles of signature ``sid``'s nodes as one int64 array, one
        column per node position, positions after one another (column-major: column c is
        ``[c * count : (c + 1) * count]``), not checked (see ``columns``).  Made once per
        snapshot (the split plans of a round read it after the fused plan tried), read-only."""
        got = self._node_columns.get(sid)
        if got is None:
            got = self._node_columns[sid] = self._make_node_columns(sid)
            got.flags.writeable = False
        return got

    def _make_node_columns(self, sid: int) -> np.ndarray:
        entry = self._columns[sid]
        if entry is not None:
            return np.ascontiguousarray(entry[2].T).ravel()
        kinds = self.signatures[sid][1]
        if packed(kinds):
            if len(kinds) == 1:  # one column: the keys as they are
                return np.frombuffer(b"".join(self._memos[sid]), dtype=np.int64)
            return np.ascontiguousarray(packed_matrix(self._memos[sid], len(kinds)).T).ravel()
        rows = self.rows(sid)
        return np.concatenate(
            [
                handles_array(list(map(itemgetter(j), rows)))
                for j, k in enumerate(kinds)
                if k == NODE
            ]
        )

    def _check_handles(self, sid: int, hmat: np.ndarray, ids: np.ndarray) -> None:
        """Node arguments are handles this Fold made: a handle forged from an int (a
        negative one, an id beyond the graph, or another node's depth) is a FoldError, where
        it would read another node's value or run before its source."""
        if not hmat.size:
            return
        bad = (hmat < 0) | (ids >= self.n)
        if not bad.any():
            bad = depth_of(hmat) != self.depth[ids]
            if not bad.any():
                return
        op = self.signatures[sid][0]
        h = int(hmat[np.nonzero(bad)][0])
        raise FoldError(
            f"apply: op {op_name(op)!r} has a node argument {h} that is not a handle this Fold "
            "recorded (a Node made from an int). Fix: pass the nodes add() returns."
        )
