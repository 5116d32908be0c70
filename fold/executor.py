"""Execution of a :class:`fold.scheduler.Plan` over a graph snapshot (``fold.arrays``).

Each group's outputs stay batched tensors (*sources*); a node's value is the pair (source,
row).  Gathering an argument column costs nothing when its rows are a whole source in order,
a ``narrow`` when they are a contiguous run of one source, and otherwise ONE
``index_select`` from a *value table*: the sources of one shape, dtype and output index in
one tensor, filled lazily the first time a column draws from several of them.  So the number
of tensor ops grows with steps x groups x arguments, never with nodes, and autograd flows
back through the gathers unchanged.  A plan whose groups name their inputs (a chain of whole
outputs, ``Plan.whole``) passes those outputs as they are and indexes no rows at all.

The executor reads the snapshot and the plan only: never the Fold that recorded them.
"""

from __future__ import annotations

import bisect
import enum
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from fold._encoding import (
    FLOAT,
    LOW_MASK,
    NODE,
    decode,
    is_tensor_kind,
    node_id,
    out_index,
    split_count,
    wanted_outputs,
)
from fold.arrays import GraphArrays, handles_array, number_column, numbers_tensor
from fold.errors import FoldError, describe, op_name
from fold.scheduler.chain import in_order
from fold.scheduler.plan import Input, Plan

__all__ = [
    "Executor",
    "ModelBatched",
    "check_outputs",
    "device_of",
    "literal_output",
    "literal_value",
    "op_failed",
    "resolve_op",
]


class ModelBatched:
    """What ``apply`` needs of an object that runs N models at once, one row per model in
    every node value (:class:`fold.batched_ops.BatchModule` implements it).

    ``batch`` is N.  ``merged(op)`` is the op for rows of (node, model) pairs, model index
    fastest; ``fold_chunk()`` how many models one executor pass runs; ``chunks(size)``
    yields a slice of models per pass, each selected while the pass runs.
    """

    batch: int

    def merged(self, op: str) -> Callable[..., Any]:
        raise NotImplementedError

    def fold_chunk(self) -> int:
        raise NotImplementedError

    def chunks(self, size: int) -> Iterator[slice]:
        raise NotImplementedError


def device_of(obj: Any) -> torch.device:
    """The device of ``obj``'s first parameter (or buffer); CPU for plain objects."""
    if isinstance(obj, torch.nn.Module):
        # The order of parameters() then buffers(), without its generator machinery (this
        # runs on every apply).
        for attr in ("_parameters", "_buffers"):
            stack = [obj]
            while stack:
                m = stack.pop()
                for t in getattr(m, attr).values():
                    if t is not None:
                        return t.device
                stack.extend(reversed(m._modules.values()))
    return torch.device("cpu")


def _describe(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return describe(t.shape, t.dtype)
    return type(t).__name__


class How(enum.Enum):
    """How a recipe reads its rows."""

    SOURCE = 0  # a source whole, or a narrow of it
    SELECT = 1  # index_select from one source
    TABLE = 2  # index_select from a class's value table
    MIXED = 3  # rows of several classes of one shape: one index_select per class


class Recipe(NamedTuple):
    """How to gather one argument column: ``src`` is a source (SOURCE, SELECT) or a class
    (TABLE); rows ``start`` to ``start + length`` (SOURCE); ``index`` the position of its
    index array among the group's (SELECT, TABLE) or of its rows in ``_mixed`` (MIXED)."""

    how: How
    src: int
    start: int
    length: int
    index: int


class Arg(enum.Enum):
    """Where an argument value of a group comes from."""

    GATHER = 0  # rows of node values, by a Recipe
    WHOLE = 1  # a nobatch node's value, passed whole (a source index)
    INPUT = 2  # an earlier group's output as it is (a tensor)
    TENSORS = 3  # literal tensors, concatenated
    NUMBERS = 4  # literal numbers, as a 1-D tensor


# Every source has a virtual offset: its shape class in the high bits, its first row in the
# class's value table below.  A node output's virtual row is that offset plus its row, kept in
# an array indexed by (output index, node id): a column of handles becomes its rows in a few
# numpy operations, and their min/max tell whether they share a class or a source.
_CLASS_SHIFT = 40
_ROW_MASK = (1 << _CLASS_SHIFT) - 1


class Values:
    """The values of one executor pass: group outputs (*sources*), the virtual row of every
    node output, value tables, and the gathers that read them.

    Value tables: the sources of one class (``shape[1:]``, dtype, output index) share one
    preallocated table, filled lazily (see ``fill_table``) when a column first needs rows of
    several of them.  A TreeLSTM level gathers its children (leaves and nodes of all lower
    levels) with one ``index_select`` per argument, as hand-written level batching does.
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
        self.tables: list[torch.Tensor | None] = []
        self.in_table: list[int] = []  # per class: how many of its sources the table holds
        self.class_meta: list[tuple[Any, ...]] = []  # per class: (shape[1:], dtype, output)
        self.mixed: list[np.ndarray] = []  # rows of mixed-class gathers
        self.outs_per_row: list[int] = []  # per class: outputs of it per node, last seen
        self.rows_left = rows_left  # nodes of the plan not run yet (sizes new tables)

    def one_row(self, row: int) -> Recipe:
        """The recipe of one node's value: a narrow of its source."""
        c = row >> _CLASS_SHIFT
        starts = self.class_starts[c]
        i = bisect.bisect_right(starts, row) - 1
        return Recipe(How.SOURCE, self.class_srcs[c][i], row - starts[i], 1, -1)

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

    def recipes(self, rows: np.ndarray, idx: list[np.ndarray]) -> list[Recipe | None]:
        """Plan the gather of each column of virtual ``rows`` (nodes x columns); None for a
        column whose rows span shape classes of different shapes or dtypes.

        A handful of array operations serve all the columns of a group at once.
        """
        n = rows.shape[0]
        los, his = rows.min(axis=0).tolist(), rows.max(axis=0).tolist()
        recipes: list[Recipe | None] = []
        for col, (lo, hi) in enumerate(zip(los, his)):
            c = lo >> _CLASS_SHIFT
            if hi >> _CLASS_SHIFT != c:
                column = rows[:, col]
                classes = np.unique(column >> _CLASS_SHIFT).tolist()
                if len({self.class_meta[x][:2] for x in classes}) > 1:
                    recipes.append(None)  # different shapes or dtypes: split the group
                    continue
                self.mixed.append(column)  # one shape, several output indices: per class
                recipes.append(Recipe(How.MIXED, -1, 0, n, len(self.mixed) - 1))
                continue
            starts = self.class_starts[c]
            j = bisect.bisect_right(starts, lo) - 1
            start = starts[j]
            src = self.class_srcs[c][j]
            if hi < start + self.sources[src].shape[0] // self.models:  # all from one source
                # A column in order, one row after another (a group's own nodes): a narrow.
                if hi - lo == n - 1 and (n == 1 or (np.diff(rows[:, col]) == 1).all()):
                    recipes.append(Recipe(How.SOURCE, src, lo - start, n, -1))
                    continue
                idx.append(rows[:, col] - start)
                recipes.append(Recipe(How.SELECT, src, 0, n, len(idx) - 1))
                continue
            self.fill_table(c)
            idx.append(rows[:, col] - (c << _CLASS_SHIFT))
            recipes.append(Recipe(How.TABLE, c, 0, n, len(idx) - 1))
        return recipes

    def fill_table(self, c: int) -> None:
        """Copy every source of class ``c`` not yet in its value table into it.

        The table is preallocated (for the rows of this class so far plus an estimate of those
        still to come) and written in place, one ``copy_`` per call; it is only ever read by
        ``index_select``, which saves its index and not its input for backward, so the
        in-place writes never invalidate a tensor autograd saved.  Sources are copied lazily,
        when a column first needs rows of several of them: a chain of single-source gathers
        (an RNN) never copies anything.
        """
        srcs = self.class_srcs[c]
        k = self.in_table[c]
        if k == len(srcs):
            return
        sources = self.sources
        m = self.models  # tensor rows per node row
        need = self.class_rows[c] * m
        start = (self.class_starts[c][k] & _ROW_MASK) * m
        table = self.tables[c]
        if table is None or table.shape[0] < need:
            last = sources[srcs[-1]]
            cap = need + self.rows_left * self.outs_per_row[c] * m
            grown = last.new_empty((cap, *last.shape[1:]))
            if table is not None:
                grown.narrow(0, 0, start).copy_(table.narrow(0, 0, start))
            table = self.tables[c] = grown
        block = [sources[s] for s in srcs[k:]]
        table.narrow(0, start, need - start).copy_(
            block[0] if len(block) == 1 else torch.cat(block, 0)
        )
        self.in_table[c] = len(srcs)

    def gather_mixed(self, rows: np.ndarray) -> torch.Tensor:
        """Rows of several classes of one shape: one index_select per class, a cat, a permutation."""
        classes = rows >> _CLASS_SHIFT
        parts, order = [], []
        for c in np.unique(classes).tolist():
            self.fill_table(c)
            table = self.tables[c]
            assert table is not None
            positions = np.flatnonzero(classes == c)
            index = torch.from_numpy(rows[positions] & _ROW_MASK)
            index = self.rows_of(index.to(table.device, non_blocking=True))
            parts.append(table.index_select(0, index))
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
        t = self.tables[src] if how is How.TABLE else self.sources[src]
        if how is not How.SOURCE:
            return t.index_select(0, itensors[ix])
        m = self.models
        if start == 0 and length * m == t.shape[0]:
            return t
        return t.narrow(0, start * m, length * m)

    # ------------------------------------------------------------------ groups
    def add_sources(self, outs: tuple[torch.Tensor, ...], alone: bool, members: np.ndarray) -> None:
        """Register a group's outputs and the virtual rows of its nodes' values."""
        n = len(members)
        m = len(outs)
        seen: dict[int, int] = {}
        if m > self.vrow.shape[0]:
            grown = np.zeros((m, self.vrow.shape[1]), np.int64)
            grown[: self.vrow.shape[0]] = self.vrow
            self.vrow = grown
        for k, t in enumerate(outs):
            s = len(self.sources)
            self.sources.append(t)
            if alone:  # a nobatch value is only ever passed whole, never gathered by rows
                nid = int(members[0])
                self.whole[(nid, m, k)] = s
                if m == 1:
                    self.whole[(nid, 0, 0)] = s
                continue
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
                self.in_table.append(0)
                self.outs_per_row.append(0)
                self.class_meta.append(meta)
            seen[c] = seen.get(c, 0) + 1
            self.outs_per_row[c] = seen[c]
            voff = c << _CLASS_SHIFT | self.class_rows[c]
            self.class_rows[c] += n
            self.class_starts[c].append(voff)
            self.class_srcs[c].append(s)
            if n == 1:
                self.vrow[k, members[0]] = voff
            else:
                self.vrow[k][members] = np.arange(voff, voff + n)  # row view, 1-D index
        if not alone:
            self.nout[members[0] if n == 1 else members] = m

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


class Executor:
    """Runs one pass of ``apply``: executes a plan's groups, then returns the outputs.

    Per group: the argument values (gathered from :class:`Values`, an earlier group's output
    as it is, or literals), one batched call (in chunks under ``max_rows``/``max_bytes``),
    the outputs checked and registered.
    """

    def __init__(
        self,
        arrays: GraphArrays,
        obj: Any,
        models: int | None = None,
        max_rows: int | Mapping[Any, int] | None = None,
        max_bytes: int | None = None,
    ) -> None:
        self.arrays = arrays
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self.obj = obj
        self.device = device_of(obj)
        # N models: every node value has N rows, (node, model) order.
        self.model_dim = isinstance(obj, ModelBatched)  # outputs come back (models, len, ...)
        if models is None:
            models = int(obj.batch) if self.model_dim else 1
        self.models = models
        self.nobatch = arrays.nobatch
        if self.model_dim and self.nobatch:
            raise FoldError(
                "apply: nobatch nodes are not supported with a BatchModule yet. "
                "Fix: compute the shared value inside the op, or apply each model separately."
            )
        # A whole plan: per signature its group's outputs, and the groups whose rows are not
        # registered yet (only an output list that is no whole output needs them).
        self._by_sig: dict[int, tuple[torch.Tensor, ...]] = {}
        self._unindexed: list[tuple[tuple[torch.Tensor, ...], Any]] = []
        self.report: list[tuple[int, str, int, tuple[tuple[Any, torch.dtype], ...]]] = []
        self._fns: dict[Any, Callable[..., Any]] = {}
        self._values: Values | None = None  # made when a group or an output reads rows
        self._rows_left = 0

    # ------------------------------------------------------------------ ops
    def _resolve(self, op: Any) -> Callable[..., Any]:
        fn = self._fns.get(op)
        if fn is None:
            fn = self._fns[op] = resolve_op(self.obj, op, self.model_dim)
        return fn

    @property
    def values(self) -> Values:
        """The value store, made on first use (a whole plan may never need one)."""
        if self._values is None:
            self._values = Values(self.arrays, self.models, self.device, self._rows_left)
        return self._values

    def run(self, plan: Plan) -> None:
        if plan.whole:  # nodes are read only if an output needs rows, after every group
            for s, step in enumerate(plan.steps):
                for group in step.groups:
                    self._run_inputs(s, group.nodes, group.key, group.inputs)
            return
        self._rows_left = sum(len(g.nodes) for step in plan.steps for g in step.groups)
        for s, step in enumerate(plan.steps):
            for group in step.groups:
                nodes = group.nodes
                if type(nodes) is not np.ndarray:
                    nodes = np.asarray(nodes, dtype=np.int64)
                key = group.key  # the signature id, unless nobatch arguments extend it
                self._run_group(s, nodes, key if type(key) is int else None)
                self._rows_left -= len(nodes)
                if self._values is not None:
                    self._values.rows_left = self._rows_left

    # ------------------------------------------------------------------ gathers
    def _run_group(self, step: int, members: np.ndarray, sid: int | None = None) -> None:
        a = self.arrays
        nid0 = int(members[0])
        if sid is None:
            sid = int(a.sig[nid0])
        op, kinds = a.signatures[sid]
        nobatch = self.nobatch
        alone = bool(nobatch) and nid0 in nobatch
        n = len(members)
        cols, node_js, hmat, decoded = a.columns(sid)
        whole_sig = n == a.count[sid]  # members are all of the signature's nodes, in order
        pos = None if whole_sig else a.pos[members]

        # Phase 1: plan every argument column (and find columns whose sources differ in shape).
        idx: list[np.ndarray] = []
        plans: list[Any] = []
        for j, k in enumerate(kinds):
            if k == NODE:
                plans.append(None)  # below, all node columns at once
            elif is_tensor_kind(k):
                plans.append(
                    (Arg.TENSORS, cols[j] if whole_sig else [cols[j][i] for i in pos.tolist()])
                )
            else:
                plans.append((Arg.NUMBERS, cols[j] if whole_sig else cols[j][pos]))
        v = self.values
        if node_js and n == 1 and not nobatch:
            # One node (an RNN step, the top of a tree): each argument is one row of one
            # source, a narrow; plain ints are far cheaper than arrays at this size.
            hs = hmat[0 if whole_sig else int(pos[0])].tolist()
            for j, row in zip(node_js, v.rows_one(hs)):
                plans[j] = (Arg.GATHER, v.one_row(row))
        elif node_js:
            handles: Any = hmat if whole_sig else lambda: hmat[pos]  # read by errors only
            if not whole_sig:
                decoded = decoded[:, pos]
            gathered = node_js
            if nobatch:  # columns reading a nobatch node take its value whole
                handles = hmat if whole_sig else hmat[pos]
                keep = []
                for c, j in enumerate(node_js):
                    h0 = int(handles[0, c])
                    if node_id(h0) in nobatch:
                        plans[j] = (Arg.WHOLE, v.whole_source(h0))
                    else:
                        keep.append(c)
                gathered = [node_js[c] for c in keep]
                if len(keep) < len(node_js):
                    handles = handles[:, keep]
                    decoded = decoded[:, :, keep]
            if gathered:
                rows = v.rows(handles, decoded)
                recipes = v.recipes(rows, idx)
                mixed = [rows[:, c] for c, r in enumerate(recipes) if r is None]
                if mixed:
                    self._run_subgroups(step, members, mixed)
                    return
                for j, r in zip(gathered, recipes):
                    plans[j] = (Arg.GATHER, r)

        # Phase 2: index tensors, then the argument values.
        itensors = v.index_tensors(idx)
        values: list[torch.Tensor] = []
        for (what, p), k in zip(plans, kinds):
            if what is Arg.GATHER:
                values.append(v.gather(p, itensors))
            elif what is Arg.WHOLE:
                values.append(v.sources[p])
            else:
                values.append(self._literal(k, p))
        outs = self._call(step, op, values, plans, n, alone)
        v.add_sources(outs, alone, members)

    def _literal(self, kind: Any, column: Any) -> torch.Tensor:
        t = literal_value(kind, column, self.device)
        return t if self.models == 1 else t.repeat_interleave(self.models, 0)

    def _run_inputs(
        self, step: int, members: Any, sid: int, inputs: tuple[Input | None, ...]
    ) -> None:
        """A group of a whole plan: all of signature ``sid``'s nodes, each node column an
        earlier group's output as it is (``inputs``); the literal columns as recorded."""
        a = self.arrays
        op, kinds = a.signatures[sid]
        n = len(members)
        rows = a.rows(sid)
        values: list[torch.Tensor] = []
        plans: list[Any] = []
        for j, (k, src) in enumerate(zip(kinds, inputs)):
            if src is not None:
                values.append(self._input(src))
                plans.append((Arg.INPUT, None))
                continue
            column = [r[j] for r in rows]
            if not is_tensor_kind(k):
                column = number_column(op, j, k, column)
            values.append(self._literal(k, column))
            plans.append((Arg.NUMBERS, None))
        outs = self._call(step, op, values, plans, n, False)
        self._by_sig[sid] = outs
        self._unindexed.append((outs, members))

    def _input(self, src: Input) -> torch.Tensor:
        """The output that an Input names, checked against the split its handles make."""
        outs = self._by_sig[src.sid]
        if len(outs) != (src.nsplit or 1):
            nid = node_id(self.arrays.first_handle(src.sid))
            raise bad_split(self.arrays, nid, src.nsplit, len(outs))
        return outs[src.out]

    def _call(
        self, step: int, op: Any, values: list[torch.Tensor], plans: list[Any], n: int, alone: bool
    ) -> tuple[torch.Tensor, ...]:
        """The batched call of a group (in chunks of rows where a memory limit asks for it)."""
        fn = self._resolve(op)
        limit = (
            n
            if self.max_rows is None and self.max_bytes is None
            else self._limit(op, values, plans, n)
        )
        try:
            out = (
                fn(*values)
                if limit >= n or alone
                else self._call_in_chunks(fn, values, plans, n, limit)
            )
        except Exception as err:
            raise op_failed(op, step, n, values, err) from err
        outs = check_outputs(op, step, n * self.models, out, alone)
        # Shapes are kept raw; summaries format them only when asked.
        self.report.append((step, op_name(op), n, tuple([(v.shape, v.dtype) for v in values])))
        return outs

    def _limit(self, op: Any, values: list[torch.Tensor], plans: list[Any], n: int) -> int:
        """Nodes per call for this group under ``max_rows`` / ``max_bytes``."""
        limit = n
        rows = self.max_rows
        if isinstance(rows, Mapping):
            rows = rows.get(op, rows.get(op_name(op)))
        if rows is not None:
            limit = min(limit, rows)
        if self.max_bytes is not None:
            per_node = sum(
                v[: self.models].numel() * v.element_size()
                for v, (what, _) in zip(values, plans)
                if what is not Arg.WHOLE
            )
            if per_node > self.max_bytes:
                raise FoldError(
                    f"apply: op {op_name(op)!r} needs {per_node} bytes of arguments for a single "
                    f"node, more than max_bytes={self.max_bytes}. Fix: raise max_bytes to at least "
                    f"{per_node}, or use max_rows."
                )
            if per_node:
                limit = min(limit, self.max_bytes // per_node)
        return limit

    def _call_in_chunks(
        self,
        fn: Callable[..., Any],
        values: list[torch.Tensor],
        plans: list[Any],
        n: int,
        limit: int,
    ) -> Any:
        """The op on at most ``limit`` nodes at a time; outputs concatenated along dim 0.

        Out of place (``narrow`` and ``cat``), so values and gradients equal one call's.
        """
        m = self.models
        parts = []
        for start in range(0, n, limit):
            size = min(limit, n - start)
            args = [
                v if what is Arg.WHOLE else v.narrow(0, start * m, size * m)
                for v, (what, _) in zip(values, plans)
            ]
            parts.append(fn(*args))
        first = parts[0]
        if isinstance(first, torch.Tensor):
            return torch.cat(parts, 0)
        if isinstance(first, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in first):
            return tuple(torch.cat([p[i] for p in parts], 0) for i in range(len(first)))
        return first  # not tensors: check_outputs reports it

    def _run_subgroups(self, step: int, members: np.ndarray, mixed: list[np.ndarray]) -> None:
        """Split a group whose gathered arguments differ in shape or dtype, and run each part."""
        classes = np.stack([rows >> _CLASS_SHIFT for rows in mixed])
        _, part = np.unique(classes, axis=1, return_inverse=True)
        part = part.reshape(-1)
        sid = int(self.arrays.sig[members[0]])
        for p in range(int(part.max()) + 1):
            self._run_group(step, members[part == p], sid)

    # ------------------------------------------------------------------ results
    def output(self, kind: str, items: list[Any], i: int) -> torch.Tensor:
        """The value of one list given to apply."""
        if kind != "nodes":
            return literal_output(kind, items, i, self.device)
        if set(map(type, items)) != {self.arrays.node_type}:
            raise FoldError(
                f"apply: lists[{i}] holds nodes that this Fold did not record. Fix: pass nodes "
                "returned by this Fold's add()."
            )
        if self._by_sig:  # a whole plan: a list that is a whole output is that output
            a = self.arrays
            h0 = int(items[0])
            low = h0 & LOW_MASK
            sid = a.first_nodes().get(h0 - low)
            if (
                sid is not None
                and a.count[sid] == len(items)
                and in_order(items, a.handles(sid), low)
            ):
                return self._model_major(self._input(Input(sid, out_index(low), split_count(low))))
            self._index_rows()
        v = self.values
        nobatch = self.nobatch
        if nobatch and any(node_id(h) in nobatch for h in items):
            return torch.cat([v.value(h) for h in items], 0)
        if len(items) == 1 and not self.model_dim:  # e.g. the root of one tree: its row
            return v.value(items[0])
        rows = v.rows(handles_array(items)[:, None])
        idx: list[np.ndarray] = []
        (recipe,) = v.recipes(rows, idx)
        if recipe is None:
            metas = {describe(x.shape[1:], x.dtype, always_dtype=True) for x in map(v.value, items)}
            raise FoldError(
                f"apply: lists[{i}] holds output nodes of different shapes or dtypes "
                f"({', '.join(sorted(metas))} per row); they cannot be concatenated along "
                "dim 0. Fix: put nodes of each shape and dtype in their own list, or convert "
                "the values to one dtype in the ops."
            )
        return self._model_major(v.gather(recipe, v.index_tensors(idx)))

    def _model_major(self, out: torch.Tensor) -> torch.Tensor:
        """(k*N, ...) rows of (node, model) pairs -> (N, k, ...): one slice per model."""
        if not self.model_dim:
            return out
        return out.view(-1, self.models, *out.shape[1:]).transpose(0, 1)

    def _index_rows(self) -> None:
        """Register the rows of a whole plan's groups, for outputs read by rows."""
        for outs, members in self._unindexed:
            self.values.add_sources(outs, False, members.ids(self.arrays))
        self._unindexed.clear()


def resolve_op(obj: Any, op: Any, model_dim: bool) -> Callable[..., Any]:
    """The function an op name or callable stands for, given the object passed to apply."""
    if isinstance(op, str) and model_dim:
        return obj.merged(op)  # the model's own method, on (node, model) rows
    if isinstance(op, str):
        if (
            op != "forward"
            and type(obj).__name__ == "OptimizedModule"
            and hasattr(obj, "_orig_mod")
        ):
            warnings.warn(
                f"apply: {type(obj._orig_mod).__name__} was given to apply as torch.compile's "
                f"wrapper, which compiles forward only: op {op!r} runs uncompiled. Fix: compile "
                f"the op itself (model.{op} = torch.compile(model.{op})) and pass the module, "
                "or pass the uncompiled module to silence this.",
                stacklevel=5,
            )
        fn = getattr(obj, op, None)
        if fn is None or not callable(fn):
            raise FoldError(
                f"apply: op {op!r} is not a method of the {type(obj).__name__} given to apply. "
                f"Fix: define def {op}(self, ...) on {type(obj).__name__}, or record a callable "
                "instead of a name."
            )
        return fn
    return op


def op_failed(op: Any, step: int, n: int, values: list[Any], err: Exception) -> FoldError:
    """The FoldError for an op that raised, naming the op, step, group size and shapes."""
    return FoldError(
        f"apply: op {op_name(op)!r} failed at step {step} on a group of {n} node(s) "
        f"with arguments ({', '.join(_describe(v) for v in values)}): "
        f"{type(err).__name__}: {err}. Fix: run the same graph with fold.Unfold(obj) to "
        "debug the op on one example; a batched op must treat dim 0 as the batch."
    )


def check_outputs(op: Any, step: int, rows: int, out: Any, alone: bool) -> tuple[torch.Tensor, ...]:
    """An op's result as a tuple of tensors of ``rows`` rows each (any rows if ``alone``)."""
    if isinstance(out, torch.Tensor):
        outs: tuple[torch.Tensor, ...] = (out,)
    elif isinstance(out, (tuple, list)) and out and all(isinstance(t, torch.Tensor) for t in out):
        outs = tuple(out)
    else:
        raise FoldError(
            f"apply: op {op_name(op)!r} (step {step}) returned {_describe_output(out)}; an op "
            "must return a tensor or a tuple of tensors. Fix: return torch tensors, e.g. "
            "torch.as_tensor(value)."
        )
    if not alone:
        for k, t in enumerate(outs):
            if t.dim() == 0 or t.shape[0] != rows:
                raise FoldError(
                    f"apply: op {op_name(op)!r} (step {step}) returned output {k} of shape "
                    f"{tuple(t.shape)} for a group of {rows} node(s); outputs must have one row "
                    "per node in dim 0. Fix: keep the batch dim (no .sum() or .view(-1) over "
                    "it), or mark a node whose value is shared with .nobatch()."
                )
    return outs


def literal_value(kind: Any, column: Any, device: torch.device) -> torch.Tensor:
    """One argument column of literals as a tensor on ``device``: batch-of-one tensors (kind a
    (shape, dtype) tuple) concatenated, or numbers (a numpy array; floats in the default
    dtype)."""
    # Always a fresh tensor: the graph keeps its literals for the next apply (and for the
    # next chunk of a BatchModule's models), so an op that changes an argument in place, or
    # a caller that changes a result that is an argument, must not reach them.
    if type(kind) is tuple:
        if len(column) > 1:
            t = torch.cat(column, 0)
        else:
            return column[0].to(device, non_blocking=True, copy=True)
    else:
        dtype = torch.get_default_dtype() if kind == FLOAT else None
        t = torch.tensor(column, dtype=dtype)
    return t if t.device == device else t.to(device, non_blocking=True)


def literal_output(kind: str, items: Any, i: int, device: torch.device) -> torch.Tensor:
    """The value of a list of numbers (a 1-D tensor), of batch-of-one tensors (their cat), or
    of a 1-D tensor given as the list (itself, on ``device``); ``items`` checked by
    ``_classify_lists``."""
    if kind == "numbers":
        try:
            t = numbers_tensor(items)
        except (OverflowError, RuntimeError, TypeError, ValueError) as err:
            raise FoldError(
                f"apply: lists[{i}] holds numbers torch cannot put in one tensor "
                f"({type(err).__name__}: {err}); ints must fit in torch.long (int64). Fix: "
                "pass smaller ints, or floats."
            ) from None
        return t if device.type == "cpu" else t.to(device, non_blocking=True)
    if kind == "column":
        return items.to(device, non_blocking=True)
    return torch.cat([t.to(device, non_blocking=True) for t in items], 0)


def bad_split(arrays: GraphArrays, node: int, n: int, m: int) -> FoldError:
    """The FoldError for a handle of ``node`` made by ``split(n)`` (``n`` 0: the whole node)
    where its op returned ``m`` outputs (0: the node has no value of its own)."""
    op = op_name(arrays.op_of(node))
    if m == 0:
        return FoldError(
            f"apply: node {node} ({op!r}) has no value here: a nobatch node can only be an "
            "argument of the ops that read it whole, or an output of its own list."
        )
    if n == 0:
        return FoldError(
            f"apply: op {op!r} returned {m} outputs, but node {node} ({op!r}) is used whole, "
            f"without split. Fix: use the handles of its split, h = f.add({op!r}, ...)"
            f".split({m})."
        )
    return FoldError(
        f"apply: node {node} ({op!r}) was split with .split({n}), but op {op!r} returned "
        f"{m} output(s). Fix: call .split({m}), or return {n} tensors."
    )


def _describe_output(out: Any) -> str:
    if isinstance(out, (tuple, list)):
        inner = ", ".join(type(x).__name__ for x in out)
        return f"a {type(out).__name__} of ({inner})"
    return f"a {type(out).__name__}"
