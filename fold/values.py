"""The values of one executor pass: group outputs, the row of every node value, value
tables, and the gathers that read them (one ``index_select`` per source or table, a
``narrow`` for a contiguous run, nothing for a whole source in order)."""

from __future__ import annotations

import bisect
import enum
from typing import Any, NamedTuple

import numpy as np
import torch

from fold._encoding import decode, node_id, out_index, split_count, wanted_outputs
from fold.arrays import GraphArrays, distinct
from fold.errors import FoldError, op_name
from fold.ops import PaddedRows, bad_split

__all__ = ["How", "Recipe", "Values"]


class How(enum.Enum):
    """How a recipe reads its rows."""

    SOURCE = 0  # a source whole, or a narrow of it
    SELECT = 1  # index_select from one source
    TABLE = 2  # index_select from a class's value table
    MIXED = 3  # rows of several classes of one shape: one index_select per class
    PIECES = 4  # a few pieces read alone (each a recipe above), then a cat


class Recipe(NamedTuple):
    """How to gather one argument column: ``src`` is a source (SOURCE, SELECT) or a class
    (TABLE); rows ``start`` to ``start + length`` (SOURCE); ``index`` the position of its
    index array among the group's (SELECT, TABLE) or of its rows in ``_mixed`` (MIXED)."""

    how: How
    src: int
    start: int
    length: int
    index: int


# Every source has a virtual offset: its shape class in the high bits, its first row in the
# class's value table below.  A node output's virtual row is that offset plus its row, kept in
# an array indexed by (output index, node id): a column of handles becomes its rows in a few
# numpy operations, and their min/max tell whether they share a class or a source.
_CLASS_SHIFT = 40
_ROW_MASK = (1 << _CLASS_SHIFT) - 1
# A PIECES gather: at most this many pieces; a source read whole as a piece has at least
# _MIN_WHOLE rows (a shorter one is cheaper copied into a table with its neighbours).
_MAX_PIECES = 8
_MIN_WHOLE = 16


class _TableGrad:
    """The gradient of one class's value table in one backward pass, summed over its reads."""

    __slots__ = ("buf", "shape", "task")

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.shape: tuple[int, ...] = ()  # the table's, updated as it grows
        self.task = -1  # the backward pass (autograd graph task) ``buf`` belongs to

    def current(self) -> torch.Tensor | None:
        """The running backward pass's buffer; None before its first read.  A pass is
        autograd's graph task, as ``torch.utils.checkpoint`` tells passes apart."""
        return self.buf if self.task == torch._C._current_graph_task_id() else None

    def rows(self, like: torch.Tensor) -> torch.Tensor:
        """The running pass's buffer, zero-filled by the pass's first read to ask."""
        buf = self.current()
        if buf is None:
            self.task = torch._C._current_graph_task_id()
            buf = self.buf = like.new_zeros(self.shape)
        return buf


class _TableAnchor(torch.autograd.Function):
    """The autograd node of one fill of a value table: the anchor of the fill before (or
    None) and the sources copied in, which are rows ``spans`` of the table; see
    ``_TableRead``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        state: _TableGrad,
        spans: list[tuple[int, int]],
        prev: torch.Tensor | None,
        *sources: torch.Tensor,
    ) -> torch.Tensor:
        ctx.state, ctx.spans, ctx.first = state, spans, prev is None
        return sources[0].new_empty(0)

    @staticmethod
    def backward(ctx: Any, empty: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        state = ctx.state
        buf = state.current()
        need = ctx.needs_input_grad
        grads: list[Any] = [None, None, empty.new_empty(0) if need[2] else None]
        for i, (start, rows) in enumerate(ctx.spans, 3):
            grads.append(buf[start : start + rows].clone() if buf is not None and need[i] else None)
        if ctx.first:  # every other anchor and read of the table has run: free the buffer
            state.buf = None
        return tuple(grads)


class _TableRead(torch.autograd.Function):
    """``table.index_select(0, index)``, whose backward costs the rows read.

    A value table is filled by in-place copies; were the copies recorded by autograd, every
    fill would be a ``CopySlices`` node whose backward clones the whole table's gradient,
    and every ``index_select`` read's backward would zero-fill another one, so backward
    cost grew with fills times table size (an attention decoder's table of 2608 states
    took 32 fills and 32 reads).  So the table lives outside autograd.  Each fill records
    one ``_TableAnchor`` over the sources it copied in (and the fill before); a read hangs
    off the latest anchor, and its backward adds its rows into the class's one gradient
    buffer of the pass (zero-filled once, by the first read to run; see ``_TableGrad``)
    and passes the anchor an empty gradient.  The engine runs an anchor's backward only
    after every read and later fill that hangs off it, and by then its sources' rows of
    the buffer are complete (reads of earlier fills cannot hold them): it hands each
    source its rows (a copy: a source's backward may pass it unchanged to an earlier read).
    Under ``create_graph=True`` autograd records the in-place sums like any other op, so
    second-order gradients hold (tested).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, anchor: torch.Tensor, table: torch.Tensor, index: torch.Tensor, state: _TableGrad
    ) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.state = state
        return table.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None, None]:  # type: ignore[override]
        (index,) = ctx.saved_tensors
        state = ctx.state
        state.rows(grad).index_add_(0, index, grad)  # (recorded too under create_graph)
        return grad.new_empty(0), None, None, None


class Values:
    """The values of one executor pass: group outputs (*sources*), the virtual row of every
    node output, value tables, and the gathers that read them.

    Value tables: the sources of one class (``shape[1:]``, dtype, output index) that reads
    need share one preallocated table, filled lazily (see ``fill_table``) when a column
    first needs rows of several of them, packed in the order they were first needed
    (``table_rows`` translates a column's virtual rows).  A TreeLSTM level gathers its
    children (leaves and nodes of all lower levels) with one ``index_select`` per argument,
    as hand-written level batching does.
    """

    def __init__(
        self, arrays: GraphArrays, models: int, device: torch.device, rows_left: int
    ) -> None:
        self.arrays = arrays
        self.models = models
        self.device = device
        self.on_cpu = device.type == "cpu"
        self.expand = torch.arange(models, device=device) if models > 1 else None
        n = arrays.n
        # Per (output index, node id): the virtual row of the value (see _CLASS_SHIFT); per
        # node: how many outputs its op returned (0: not run, or nobatch).
        self.vrow = np.zeros((1, n), np.int64)
        self.nout = np.zeros(n, np.int64)
        self.whole: dict[tuple[int, int, int], int] = {}  # nobatch (id, split n, k) -> source
        self.sources: list[torch.Tensor] = []
        self.classes: dict[tuple[Any, torch.dtype, int], int] = {}
        self.class_starts: list[list[int]] = []  # per class: virtual offsets of its sources
        self.class_srcs: list[list[int]] = []  # per class: its sources, in table order
        self.class_rows: list[int] = []
        self.tables: list[torch.Tensor | None] = []  # outside autograd: see _TableRead
        self.anchors: list[torch.Tensor | None] = []  # per class: its latest fill's anchor
        self.table_grads: list[_TableGrad] = []
        # Per class, per node row: the rows of the source that starts there, else 0.
        self.first_rows: list[np.ndarray] = []
        # Per class, per source: its first row in the class's table (node rows), -1 where the
        # table does not hold it; and the tensor rows the table holds.
        self.table_off: list[list[int]] = []
        self.table_used: list[int] = []
        self.class_meta: list[tuple[Any, ...]] = []  # per class: (shape[1:], dtype, output)
        self.mixed: list[np.ndarray] = []  # rows of mixed-class gathers
        self.parts: list[list[Recipe]] = []  # the pieces of PIECES gathers
        self.outs_per_row: list[int] = []  # per class: outputs of it per node, last seen
        self.rows_left = rows_left  # nodes of the plan not run yet (sizes new tables)
        # Per list argument seen (its memo key): None once seen, then ``(class, its elements'
        # rows of the class's value table)`` once a group reads it a second time, for the
        # groups after (see ``list_recipe``).
        self.list_rows: dict[bytes, tuple[int, np.ndarray] | None] = {}

    @staticmethod
    def class_of(rows: np.ndarray) -> np.ndarray:
        """The shape class of each virtual row."""
        return rows >> _CLASS_SHIFT

    def _source_of(self, row: int) -> tuple[int, int]:
        """The source holding virtual row ``row``, and the row's position in it."""
        c = row >> _CLASS_SHIFT
        starts = self.class_starts[c]
        i = bisect.bisect_right(starts, row) - 1
        return self.class_srcs[c][i], row - starts[i]

    def one_row(self, row: int) -> Recipe:
        """The recipe of one node's value: a narrow of its source."""
        src, start = self._source_of(row)
        return Recipe(How.SOURCE, src, start, 1, -1)

    def run(self, first: int, length: int) -> torch.Tensor | None:
        """The values of ``length`` consecutive virtual rows from ``first``, where they all
        lie in one source (the source whole, or a narrow of it: as ``gather`` reads a
        SOURCE recipe, with no recipe made); else None."""
        src, start = self._source_of(first)
        t = self.sources[src]
        m = self.models
        if start + length > t.shape[0] // m:
            return None
        if start == 0 and length * m == t.shape[0]:
            return t
        return t.narrow(0, start * m, length * m)

    def rows(self, handles: Any, decoded: Any = None) -> np.ndarray:
        """The virtual row of every handle (an int64 array of handles).

        Each handle is checked against its node's op: a whole handle needs one output, a
        handle of ``split(n)`` needs ``n``.  ``decoded`` is ``decode(handles)`` where the
        caller has it already; then ``handles`` may be a function returning them (only an
        error reads them).
        """
        nid, out, want = decode(handles) if decoded is None else decoded
        if (want != self.nout[nid]).any():
            self.bad_handle(handles() if callable(handles) else handles, want, nid)
        if self.vrow.shape[0] == 1:
            return self.vrow[0][nid]  # a row, then 1-D indexing: numpy's fast path
        return self.vrow[out, nid]

    def rows_one(self, handles: list[int]) -> list[int]:
        """``_rows`` for the handles of one node, as plain ints."""
        nout, vrow = self.nout, self.vrow
        rows = []
        for h in handles:
            nid = node_id(h)
            want = wanted_outputs(h)
            if nout[nid] != want:
                self.bad_handle(np.array([h]), np.array([want]), np.array([nid]))
            rows.append(int(vrow[out_index(h), nid]))
        return rows

    def bad_handle(self, handles: np.ndarray, want: np.ndarray, nid: np.ndarray) -> None:
        handles, want, nid = handles.ravel(), want.ravel(), nid.ravel()
        i = int(np.flatnonzero(want != self.nout[nid])[0])
        h, node = int(handles[i]), int(nid[i])
        raise bad_split(self.arrays, node, split_count(h), int(self.nout[node]))

    def recipes(
        self, rows: np.ndarray, idx: list[np.ndarray], pieces: bool = True
    ) -> list[Recipe | None]:
        """Plan the gather of each column of virtual ``rows`` (nodes x columns); None for a
        column whose rows span shape classes of different shapes or dtypes.  ``pieces``:
        whether to try ``pieces`` (see ``recipe``).
        """
        los, his = rows.min(axis=0).tolist(), rows.max(axis=0).tolist()
        return [
            self.recipe(rows[:, col], lo, hi, idx, pieces)
            for col, (lo, hi) in enumerate(zip(los, his))
        ]

    def recipe(
        self, column: np.ndarray, lo: int, hi: int, idx: list[np.ndarray], pieces: bool = True
    ) -> Recipe | None:
        """The gather of one column of virtual rows (``lo``, ``hi`` its least and greatest):
        a source whole or a narrow of it; an ``index_select`` from one source; pieces (see
        ``pieces``); a read of its class's value table; or one read per class (MIXED); None
        where its classes differ in shape or dtype."""
        n = len(column)
        c = lo >> _CLASS_SHIFT
        if hi >> _CLASS_SHIFT != c:
            if pieces and (recipe := self.pieces(column, idx, False)) is not None:
                return recipe
            classes = distinct(column >> _CLASS_SHIFT).tolist()
            if len({self.class_meta[x][:2] for x in classes}) > 1:
                return None  # different shapes or dtypes: split the group
            self.mixed.append(column)  # one shape, several output indices: per class
            return Recipe(How.MIXED, -1, 0, n, len(self.mixed) - 1)
        starts = self.class_starts[c]
        j = bisect.bisect_right(starts, lo) - 1
        start = starts[j]
        src = self.class_srcs[c][j]
        if hi < start + self.sources[src].shape[0] // self.models:  # all from one source
            # A column in order, one row after another (a group's own nodes): a narrow.
            if hi - lo == n - 1 and (n == 1 or (np.diff(column) == 1).all()):
                return Recipe(How.SOURCE, src, lo - start, n, -1)
            idx.append(column - start)
            return Recipe(How.SELECT, src, 0, n, len(idx) - 1)
        if pieces and (recipe := self.pieces(column, idx, True)) is not None:
            return recipe
        idx.append(self.table_rows(c, column))
        return Recipe(How.TABLE, c, 0, n, len(idx) - 1)

    def list_recipe(self, lists: list[bytes], idx: list[np.ndarray]) -> Recipe | None:
        """The table read of the elements of ``lists`` (a group's list column, by memo key)
        where every list was read from one class's table by a group before: the rows kept
        then, with none of ``rows`` and ``recipe``'s work (a decoder's memories, read by
        each of its steps); else None, and ``keep_lists`` is to note the column's recipe."""
        kept = self.list_rows
        if not kept:
            return None
        got = []
        for k in lists:
            if k:  # (an empty list reads nothing)
                g = kept.get(k)
                if g is None:  # (a list read once at most: most lists of most graphs)
                    return None
                got.append(g)
        if not got:
            return None
        c = got[0][0]
        if any(g[0] != c for g in got):
            return None
        idx.append(np.concatenate([g[1] for g in got]))
        return Recipe(How.TABLE, c, 0, len(idx[-1]), len(idx) - 1)

    def keep_lists(
        self, lists: list[bytes], lengths: np.ndarray, recipe: Recipe, idx: list[np.ndarray]
    ) -> None:
        """Note the lists of a column just planned as a table read (``recipe``): a list seen
        for the first time as seen, one seen before with its elements' table rows (a column
        of another kind notes nothing)."""
        if recipe.how is not How.TABLE:
            return
        kept = self.list_rows
        before = [k in kept for k in lists]
        if not any(before):  # (the rows are cut per list only for lists read again)
            for k in lists:
                if k:
                    kept[k] = None
            return
        rows = np.split(idx[recipe.index], np.cumsum(lengths)[:-1])
        c = recipe.src
        for k, r, seen in zip(lists, rows, before):
            if seen:
                kept[k] = (c, r)
            elif k:
                kept[k] = None

    def pieces(self, column: np.ndarray, idx: list[np.ndarray], one_class: bool) -> Recipe | None:
        """The gather of a column of several sources as a few pieces, each read alone, then
        one ``cat``; None where that does not pay.

        The column is cut where its class changes, and around each run of rows that is a
        source whole, in order (each such piece is the source itself: nothing copied into a
        table, nothing zero-filled in backward).  Where each torch op is a node (autobatch
        with no annotation) and a group's nodes run in the order of the rows they read
        (``fold.executor``), a ``sigmoid`` of the gates of every cell reads each output of
        the gate ``chunk`` whole, one after another, and a product reads one operand whole
        beside values gathered from a table.  Pieces pay where every class change is a cut
        (the classes come in runs, at most ``_MAX_PIECES``) and, within one class
        (``one_class``), where a run is a source whole; else the caller reads a table (one
        class) or each class apart (MIXED).
        """
        n = len(column)
        if one_class:
            bounds = [0, n]
        else:
            classes = column >> _CLASS_SHIFT
            cuts = (np.flatnonzero(classes[1:] != classes[:-1]) + 1).tolist()
            if len(cuts) >= _MAX_PIECES:
                return None
            if len({self.class_meta[x][:2] for x in classes[[0, *cuts]].tolist()}) > 1:
                return None  # different shapes or dtypes: the caller splits the group
            bounds = [0, *cuts, n]
        spans: list[tuple[int, int]] = []
        at = 0  # where the next piece starts
        for a, b in zip(bounds[:-1], bounds[1:]):
            for s, e in self.whole_runs(column[a:b]):
                if a + s > at:
                    spans.append((at, a + s))
                spans.append((a + s, a + e))
                at = a + e
            if at < b:
                spans.append((at, b))
                at = b
            if len(spans) > _MAX_PIECES:
                return None
        if len(spans) < 2:
            return None
        subs = []
        for a, b in spans:
            part = column[a:b]
            sub = self.recipe(part, int(part.min()), int(part.max()), idx, pieces=False)
            assert sub is not None  # one class
            subs.append(sub)
        self.parts.append(subs)
        return Recipe(How.PIECES, -1, 0, n, len(self.parts) - 1)

    def whole_runs(self, vrows: np.ndarray) -> list[tuple[int, int]]:
        """The runs ``(start, end)`` of ``vrows`` (virtual rows of one class) that are a
        source of the class whole, in order, and at least ``_MIN_WHOLE`` rows long."""
        if len(vrows) < _MIN_WHOLE:
            return []
        c = int(vrows[0]) >> _CLASS_SHIFT
        # Where a row is a source's first: the source's length (see add_sources).
        length = self.first_rows[c][vrows - (c << _CLASS_SHIFT)]
        first = np.flatnonzero(length >= _MIN_WHOLE)
        if not len(first) or len(first) > 2 * _MAX_PIECES:
            return []  # none, or more than pieces pay for
        runs = []
        for i, k in zip(first.tolist(), length[first].tolist()):
            # Runs cannot overlap: each holds its own source's rows only.
            if i + k <= len(vrows) and vrows[i + k - 1] - vrows[i] == k - 1:
                if (np.diff(vrows[i : i + k]) == 1).all():
                    runs.append((i, i + k))
        return runs

    def table_rows(self, c: int, vrows: np.ndarray) -> np.ndarray:
        """The rows of class ``c``'s value table that hold virtual rows ``vrows`` (a column
        about to be read from it; node rows, an int64 array), copying in first the sources
        they come from that the table does not hold yet (see ``fill_table``)."""
        starts = np.asarray(self.class_starts[c], np.int64)
        off = self.table_off[c]
        off.extend([-1] * (len(starts) - len(off)))
        if len(starts) == 1:
            j = np.zeros(len(vrows), np.int64)
        else:
            j = np.searchsorted(starts, vrows, side="right") - 1
        missing = [x for x in distinct(j).tolist() if off[x] < 0]
        if missing:
            self.fill_table(c, missing)
        return np.asarray(off, np.int64)[j] + (vrows - starts[j])

    def fill_table(self, c: int, missing: list[int]) -> None:
        """Copy sources ``missing`` (positions among class ``c``'s sources) into its value
        table, after the rows it holds, in one ``copy_``.

        A table holds only the sources a read has needed, packed in the order they were
        first needed (``table_rows`` translates virtual rows): a class holds every output of
        its shape, and where each torch op is a node (autobatch with no annotation) most of
        them are intermediates (gates, products) read once, in order, straight from their
        source.  Copying them too, and zero-filling their rows of the table's gradient in
        backward, cost a third of such an apply and a fifth of its backward at hidden 150.

        The table is preallocated and written in place.  Its size follows the rows it holds:
        those so far plus an estimate of those still to come (the plan's remaining nodes
        times this class's outputs per node), but at most twice the rows so far, growing by
        doubling past that.  Backward zero-fills one gradient of the table's size per pass,
        so a table sized for rows it never holds would make backward cost follow the graph
        instead of the rows read.  The copies are not recorded by autograd: each fill
        records one ``_TableAnchor`` over the sources it copied (see ``_TableRead``), and a
        read never saves the table, so the in-place writes never invalidate a tensor
        autograd saved.  Sources are copied lazily, when a column first needs rows of
        several of them: a chain of single-source gathers (an RNN) never copies anything.
        """
        srcs = self.class_srcs[c]
        off = self.table_off[c]
        m = self.models  # tensor rows per node row
        block = [self.sources[srcs[x]] for x in missing]
        used = self.table_used[c]
        need = used + sum(t.shape[0] for t in block)
        table = self.tables[c]
        with torch.no_grad():
            if table is None or table.shape[0] < need:
                cap = min(need + self.rows_left * self.outs_per_row[c] * m, 2 * need)
                grown = block[-1].new_empty((cap, *block[-1].shape[1:]))
                if table is not None:
                    grown.narrow(0, 0, used).copy_(table.narrow(0, 0, used))
                table = self.tables[c] = grown
                self.table_grads[c].shape = tuple(grown.shape)
            table.narrow(0, used, need - used).copy_(
                block[0] if len(block) == 1 else torch.cat(block)
            )
        spans, row = [], used
        for x, t in zip(missing, block):
            off[x] = row // m
            spans.append((row, t.shape[0]))
            row += t.shape[0]
        self.table_used[c] = need
        if torch.is_grad_enabled() and any(t.requires_grad for t in block):
            self.anchors[c] = _TableAnchor.apply(
                self.table_grads[c], spans, self.anchors[c], *block
            )

    def read_table(self, c: int, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` of class ``c``'s value table (filled), differentiably where its
        sources require grad (see ``_TableRead``)."""
        table = self.tables[c]
        assert table is not None
        anchor = self.anchors[c]
        if anchor is None or not torch.is_grad_enabled():
            return table.index_select(0, index)
        return _TableRead.apply(anchor, table, index, self.table_grads[c])

    def gather_mixed(self, rows: np.ndarray) -> torch.Tensor:
        """Rows of several classes of one shape: one index_select per class, a cat, a permutation."""
        classes = rows >> _CLASS_SHIFT
        parts, order = [], []
        for c in distinct(classes).tolist():
            positions = np.flatnonzero(classes == c)
            index = torch.from_numpy(self.table_rows(c, rows[positions]))
            table = self.tables[c]
            assert table is not None
            index = self.rows_of(index.to(table.device, non_blocking=True))
            parts.append(self.read_table(c, index))
            order.append(positions)
        perm = torch.from_numpy(np.argsort(np.concatenate(order)))
        perm = self.rows_of(perm.to(parts[0].device, non_blocking=True))
        return torch.cat(parts, 0).index_select(0, perm)

    def rows_of(self, index: torch.Tensor) -> torch.Tensor:
        """Node rows -> tensor rows: each node has one row per model, model index fastest."""
        if self.expand is None:
            return index
        return (index.unsqueeze(1) * self.models + self.expand).view(-1)

    def index_tensors(self, idx: list[np.ndarray]) -> list[torch.Tensor]:
        """All index arrays of a group as tensors: one host tensor, one transfer."""
        if not idx:
            return []
        if self.on_cpu:  # nothing to transfer: each array is its tensor
            views = [torch.from_numpy(a) for a in idx]
        else:
            flat = torch.from_numpy(idx[0] if len(idx) == 1 else np.concatenate(idx))
            flat = flat.to(self.device, non_blocking=True)
            views = [flat] if len(idx) == 1 else list(flat.split([len(a) for a in idx]))
        if self.expand is not None:
            views = [self.rows_of(v) for v in views]
        return views

    def gather(self, recipe: Recipe, itensors: list[torch.Tensor]) -> torch.Tensor:
        how, src, start, length, ix = recipe
        if how is How.MIXED:
            return self.gather_mixed(self.mixed[ix])
        if how is How.PIECES:
            return torch.cat([self.gather(r, itensors) for r in self.parts[ix]])
        if how is How.TABLE:
            return self.read_table(src, itensors[ix])
        t = self.sources[src]
        if how is not How.SOURCE:
            return t.index_select(0, itensors[ix])
        m = self.models
        if start == 0 and length * m == t.shape[0]:
            return t
        return t.narrow(0, start * m, length * m)

    # ------------------------------------------------------------------ groups
    def add_sources(self, outs: tuple[torch.Tensor, ...], alone: bool, members: np.ndarray) -> None:
        """Register a group's outputs and the virtual rows of its nodes' values."""
        m = len(outs)
        self._grow(m)
        if alone:  # a nobatch value is only ever passed whole, never gathered by rows
            nid = int(members[0])
            for k, t in enumerate(outs):
                self.whole[(nid, m, k)] = len(self.sources)
                if m == 1:
                    self.whole[(nid, 0, 0)] = len(self.sources)
                self.sources.append(t)
            return
        seen: dict[int, int] = {}
        for k, t in enumerate(outs):
            self._count(seen, self.add_output(k, t, members))
        self.nout[members[0] if len(members) == 1 else members] = m

    def add_parts(self, outputs: list[Any], parts: list[np.ndarray], members: np.ndarray) -> None:
        """Register the outputs of a padded call over a group's ``parts`` (``members``
        their concatenation): per output, one tensor of every part's rows in order (outputs
        of one shape across the parts: one source) or a list of per part tensors (one
        source each)."""
        self._grow(len(outputs))
        seen: dict[int, int] = {}
        for k, out in enumerate(outputs):
            if type(out) is list:
                for c in {self.add_output(k, t, p) for t, p in zip(out, parts)}:
                    self._count(seen, c)
            else:
                self._count(seen, self.add_output(k, out, members))
        self.nout[members] = len(outputs)

    def add_padded(self, outs: tuple[Any, ...], members: np.ndarray) -> None:
        """Register the outputs of a whole plan's group some of which are ``PaddedRows`` (a
        ragged call's: attention scores over memories of several lengths, an RNN's outputs
        over sentences of several lengths beside its final states): such an output by its
        rows of each length (``PaddedRows.parts``, a source per length), any other whole."""
        self._grow(len(outs))
        seen: dict[int, int] = {}
        for k, out in enumerate(outs):
            if type(out) is PaddedRows:
                rows, parts = out.parts()
                for c in {self.add_output(k, t, members[r]) for t, r in zip(parts, rows)}:
                    self._count(seen, c)
            else:
                self._count(seen, self.add_output(k, out, members))
        self.nout[members] = len(outs)

    def _count(self, seen: dict[int, int], c: int) -> None:
        """One more output of class ``c`` per node (``seen``: per class, so far for the
        nodes being registered), kept as the class's ``outs_per_row``."""
        seen[c] = seen.get(c, 0) + 1
        self.outs_per_row[c] = seen[c]

    def _grow(self, m: int) -> None:
        """Room in ``vrow`` for ``m`` outputs per node."""
        if m > self.vrow.shape[0]:
            grown = np.zeros((m, self.vrow.shape[1]), np.int64)
            grown[: self.vrow.shape[0]] = self.vrow
            self.vrow = grown

    def add_output(self, k: int, t: torch.Tensor, members: np.ndarray) -> int:
        """Register ``t`` as output ``k`` of ``members`` (a source); its class."""
        n = len(members)
        s = len(self.sources)
        self.sources.append(t)
        # Output k of every op with this shape shares one class: a TreeLSTM's h values
        # (leaves and nodes) form one table and its c values another, so a gather's
        # backward touches only the table it read from.
        meta = (t.shape[1:], t.dtype, k)
        c = self.classes.get(meta)
        if c is None:
            c = self.classes[meta] = len(self.class_rows)
            self.class_starts.append([])
            self.class_srcs.append([])
            self.class_rows.append(0)
            self.tables.append(None)
            self.anchors.append(None)
            self.table_grads.append(_TableGrad())
            self.table_off.append([])
            self.table_used.append(0)
            self.outs_per_row.append(0)
            self.class_meta.append(meta)
            self.first_rows.append(np.zeros(max(n, 64), np.int64))
        row = self.class_rows[c]
        voff = c << _CLASS_SHIFT | row
        self.class_rows[c] += n
        first = self.first_rows[c]
        if len(first) < row + n:
            grown = np.zeros(max(2 * len(first), row + n), np.int64)
            grown[: len(first)] = first
            first = self.first_rows[c] = grown
        first[row] = n
        self.class_starts[c].append(voff)
        self.class_srcs[c].append(s)
        if n == 1:
            self.vrow[k, members[0]] = voff
        else:
            self.vrow[k][members] = np.arange(voff, voff + n)  # row view, 1-D index
        return c

    def whole_source(self, h: int) -> int:
        nid = node_id(h)
        src = self.whole.get((nid, split_count(h), out_index(h)))
        if src is None:
            raise FoldError(
                f"apply: nobatch node {nid} ({op_name(self.arrays.op_of(nid))!r}) is used "
                "with a split that does not match the outputs of its op. Fix: use it whole if "
                "its op returns one tensor, else the handles of .split(n), n its outputs."
            )
        return src

    def value(self, h: int) -> torch.Tensor:
        """One node's value (slow path): its row, or the whole value of a nobatch node."""
        if node_id(h) in self.arrays.nobatch:
            return self.sources[self.whole_source(h)]
        (v,) = self.rows_one([h])
        c = v >> _CLASS_SHIFT
        j = bisect.bisect_right(self.class_starts[c], v) - 1
        return self.sources[self.class_srcs[c][j]].narrow(0, v - self.class_starts[c][j], 1)
