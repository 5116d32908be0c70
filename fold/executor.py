"""Execution of a :class:`fold.scheduler.Plan`.

Each group's outputs stay batched tensors (*sources*); a node's value is the pair (source,
row).  Gathering an argument column costs nothing when its rows are a whole source in order,
a ``narrow`` when they are a contiguous run of one source, and otherwise ONE
``index_select`` from a *value table*: the sources of one shape, dtype and output index in
one tensor, filled lazily the first time a column draws from several of them.  So the number
of tensor ops grows with steps x groups x arguments, never with nodes, and autograd flows
back through the gathers unchanged.
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Callable, Mapping
from itertools import repeat
from typing import Any

import numpy as np
import torch

from fold.errors import FoldError
from fold.graph import (
    _SCALAR_KINDS,
    DEPTH_SHIFT,
    FLOAT,
    ID_MASK,
    ID_SHIFT,
    LOW_MASK,
    NODE,
    NSPLIT_MASK,
    NSPLIT_SHIFT,
    OUT_MASK,
    Fold,
    node_id,
    op_name,
)
from fold.layout import decode, handles_array, number_column, numbers_tensor
from fold.scheduler.plan import Plan

__all__ = ["Executor", "device_of"]


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


def describe(shape: Any, dtype: Any) -> str:
    """``(4, 7)``, with the dtype when it is not the default one: ``(4,) int64``."""
    dt = "" if dtype == torch.get_default_dtype() else f" {str(dtype).replace('torch.', '')}"
    return f"{tuple(shape)}{dt}"


def _describe(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return describe(t.shape, t.dtype)
    return type(t).__name__


# How to gather an argument column: (source or -1 - class table, start row, length, index
# position).  An index position >= 0 means index_select with that index; otherwise the source
# whole or a narrow of it.
_Recipe = tuple[int, int, int, int]

# Every source has a virtual offset: its shape class in the high bits, its first row in the
# class's value table below.  A node output's virtual row is that offset plus its row, kept in
# an array indexed by (output index, node id): a column of handles becomes its rows in a few
# numpy operations, and their min/max tell whether they share a class or a source.
_CLASS_SHIFT = 40
_ROW_MASK = (1 << _CLASS_SHIFT) - 1
_MIXED = -(1 << 30)  # a recipe "source" for rows of several classes of one shape


class Executor:
    """Runs one ``apply``: executes a plan's groups, then gathers the requested outputs.

    Value tables: the sources of one class (``shape[1:]``, dtype, output index) share one
    preallocated table, filled lazily (see ``_fill_table``) when a column first needs rows of
    several of them.  A TreeLSTM level gathers its children (leaves and nodes of all lower
    levels) with one ``index_select`` per argument, as hand-written level batching does.
    """

    def __init__(
        self,
        graph: Fold,
        obj: Any,
        models: int | None = None,
        max_rows: int | Mapping[Any, int] | None = None,
        max_bytes: int | None = None,
    ) -> None:
        self.graph = graph
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self.obj = obj
        self.device = device_of(obj)
        self.on_cpu = self.device.type == "cpu"
        # N models of a BatchModule: every node value has N rows, (node, model) order.
        self.model_dim = _is_batch_module(obj)  # node outputs come back (models, len, ...)
        if models is None:
            models = int(obj.batch) if self.model_dim else 1
        self.models = models
        if self.model_dim and graph.nobatch_ids:
            raise FoldError(
                "apply: nobatch nodes are not supported with a BatchModule yet. "
                "Fix: compute the shared value inside the op, or apply each model separately."
            )
        self._expand = torch.arange(self.models, device=self.device) if self.models > 1 else None
        self.arrays = graph.arrays()
        n = self.arrays.n
        # Per (output index, node id): the virtual row of the value (see _CLASS_SHIFT); per
        # node: how many outputs its op returned (0: not run, or nobatch).
        self.vrow = np.zeros((1, n), np.int64)
        self.nout = np.zeros(n, np.int64)
        self.whole: dict[tuple[int, int, int], int] = {}  # nobatch (id, split n, k) -> source
        self.sources: list[torch.Tensor] = []
        self._classes: dict[tuple[Any, torch.dtype, int], int] = {}
        self._class_starts: list[list[int]] = []  # per class: virtual offsets of its sources
        self._class_srcs: list[list[int]] = []  # per class: its sources, in table order
        self._class_rows: list[int] = []
        self._tables: list[torch.Tensor | None] = []
        self._in_table: list[int] = []  # per class: how many of its sources the table holds
        self._class_meta: list[tuple[Any, ...]] = []  # per class: (shape[1:], dtype, output)
        self._mixed: list[list[int]] = []  # rows of mixed-class gathers
        self._outs_per_row: list[int] = []  # per class: outputs of it per node, last seen
        self._rows_left = 0  # nodes of the plan not run yet
        self.report: list[tuple[int, str, int, tuple[tuple[Any, torch.dtype], ...]]] = []
        self._fns: dict[Any, Callable[..., Any]] = {}

    # ------------------------------------------------------------------ ops
    def _resolve(self, op: Any) -> Callable[..., Any]:
        fn = self._fns.get(op)
        if fn is None:
            fn = self._fns[op] = resolve_op(self.obj, op, self.model_dim)
        return fn

    def run(self, plan: Plan) -> None:
        self._rows_left = sum(len(g.nodes) for step in plan.steps for g in step.groups)
        for s, step in enumerate(plan.steps):
            for group in step.groups:
                nodes = group.nodes
                if type(nodes) is not np.ndarray:
                    nodes = np.asarray(nodes, dtype=np.int64)
                key = group.key  # the signature id, unless nobatch arguments extend it
                self._run_group(s, nodes, key if type(key) is int else None)
                self._rows_left -= len(nodes)

    # ------------------------------------------------------------------ gathers
    def _rows(self, handles: Any, decoded: Any = None) -> np.ndarray:
        """The virtual row of every handle (an int64 array of handles).

        Each handle is checked against its node's op: a whole handle needs one output, a
        handle of ``split(n)`` needs ``n``.  ``decoded`` is ``decode(handles)`` where the
        caller has it already; then ``handles`` may be a function returning them (only an
        error reads them).
        """
        nid, out, want = decode(handles) if decoded is None else decoded
        if (want != self.nout[nid]).any():
            self._bad_handle(handles() if callable(handles) else handles, want, nid)
        if self.vrow.shape[0] == 1:
            return self.vrow[0][nid]  # a row, then 1-D indexing: numpy's fast path
        return self.vrow[out, nid]

    def _rows_one(self, handles: list[int]) -> list[int]:
        """``_rows`` for the handles of one node, as plain ints."""
        nout, vrow = self.nout, self.vrow
        rows = []
        for h in handles:
            nid = (h >> ID_SHIFT) & ID_MASK
            want = (h >> NSPLIT_SHIFT) & NSPLIT_MASK or 1
            if nout[nid] != want:
                self._bad_handle(np.array([h]), np.array([want]), np.array([nid]))
            rows.append(int(vrow[h & OUT_MASK, nid]))
        return rows

    def _bad_handle(self, handles: np.ndarray, want: np.ndarray, nid: np.ndarray) -> None:
        handles, want, nid = handles.ravel(), want.ravel(), nid.ravel()
        i = int(np.flatnonzero(want != self.nout[nid])[0])
        h, node = int(handles[i]), int(nid[i])
        raise bad_split(self.graph, node, (h >> NSPLIT_SHIFT) & NSPLIT_MASK, int(self.nout[node]))

    def _recipes(self, rows: np.ndarray, idx: list[np.ndarray]) -> list[_Recipe | None]:
        """Plan the gather of each column of virtual ``rows`` (nodes x columns); None for a
        column whose rows span shape classes of different shapes or dtypes.

        A handful of array operations serve all the columns of a group at once.
        """
        n = rows.shape[0]
        los, his = rows.min(axis=0).tolist(), rows.max(axis=0).tolist()
        recipes: list[_Recipe | None] = []
        for col, (lo, hi) in enumerate(zip(los, his)):
            c = lo >> _CLASS_SHIFT
            if hi >> _CLASS_SHIFT != c:
                column = rows[:, col]
                classes = np.unique(column >> _CLASS_SHIFT).tolist()
                if len({self._class_meta[x][:2] for x in classes}) > 1:
                    recipes.append(None)  # different shapes or dtypes: split the group
                    continue
                self._mixed.append(column)  # one shape, several output indices: per class
                recipes.append((_MIXED, 0, n, len(self._mixed) - 1))
                continue
            starts = self._class_starts[c]
            j = bisect.bisect_right(starts, lo) - 1
            start = starts[j]
            src = self._class_srcs[c][j]
            if hi < start + self.sources[src].shape[0] // self.models:  # all from one source
                # A column in order, one row after another (a group's own nodes): a narrow.
                if hi - lo == n - 1 and (n == 1 or (np.diff(rows[:, col]) == 1).all()):
                    recipes.append((src, lo - start, n, -1))
                    continue
                idx.append(rows[:, col] - start)
                recipes.append((src, 0, n, len(idx) - 1))
                continue
            self._fill_table(c)
            idx.append(rows[:, col] - (c << _CLASS_SHIFT))
            recipes.append((-1 - c, 0, n, len(idx) - 1))
        return recipes

    def _fill_table(self, c: int) -> None:
        """Copy every source of class ``c`` not yet in its value table into it.

        The table is preallocated (for the rows of this class so far plus an estimate of those
        still to come) and written in place, one ``copy_`` per call; it is only ever read by
        ``index_select``, which saves its index and not its input for backward, so the
        in-place writes never invalidate a tensor autograd saved.  Sources are copied lazily,
        when a column first needs rows of several of them: a chain of single-source gathers
        (an RNN) never copies anything.
        """
        srcs = self._class_srcs[c]
        k = self._in_table[c]
        if k == len(srcs):
            return
        sources = self.sources
        m = self.models  # tensor rows per node row
        need = self._class_rows[c] * m
        start = (self._class_starts[c][k] & _ROW_MASK) * m
        table = self._tables[c]
        if table is None or table.shape[0] < need:
            last = sources[srcs[-1]]
            cap = need + self._rows_left * self._outs_per_row[c] * m
            grown = last.new_empty((cap, *last.shape[1:]))
            if table is not None:
                grown.narrow(0, 0, start).copy_(table.narrow(0, 0, start))
            table = self._tables[c] = grown
        block = [sources[s] for s in srcs[k:]]
        table.narrow(0, start, need - start).copy_(
            block[0] if len(block) == 1 else torch.cat(block, 0)
        )
        self._in_table[c] = len(srcs)

    def _gather_mixed(self, rows: np.ndarray) -> torch.Tensor:
        """Rows of several classes of one shape: one index_select per class, a cat, a permutation."""
        classes = rows >> _CLASS_SHIFT
        parts, order = [], []
        for c in np.unique(classes).tolist():
            self._fill_table(c)
            table = self._tables[c]
            assert table is not None
            positions = np.flatnonzero(classes == c)
            index = torch.from_numpy(rows[positions] & _ROW_MASK)
            index = self._rows_of(index.to(table.device, non_blocking=True))
            parts.append(table.index_select(0, index))
            order.append(positions)
        perm = torch.from_numpy(np.argsort(np.concatenate(order)))
        perm = self._rows_of(perm.to(parts[0].device, non_blocking=True))
        return torch.cat(parts, 0).index_select(0, perm)

    def _rows_of(self, index: torch.Tensor) -> torch.Tensor:
        """Node rows -> tensor rows: each node has one row per model, model index fastest."""
        if self._expand is None:
            return index
        return (index.unsqueeze(1) * self.models + self._expand).view(-1)

    def _index_tensors(self, idx: list[np.ndarray]) -> list[torch.Tensor]:
        """All index arrays of a group as tensors: one host tensor, one transfer."""
        if not idx:
            return []
        if self.on_cpu:  # nothing to transfer: each array is its tensor
            views = [torch.from_numpy(a) for a in idx]
        else:
            flat = torch.from_numpy(idx[0] if len(idx) == 1 else np.concatenate(idx))
            flat = flat.to(self.device, non_blocking=True)
            views = [flat] if len(idx) == 1 else list(flat.split([len(a) for a in idx]))
        if self._expand is not None:
            views = [self._rows_of(v) for v in views]
        return views

    def _gather(self, recipe: _Recipe, itensors: list[torch.Tensor]) -> torch.Tensor:
        src, start, length, ix = recipe
        if src == _MIXED:
            return self._gather_mixed(self._mixed[ix])
        t = self._tables[-1 - src] if src < 0 else self.sources[src]
        if ix >= 0:
            return t.index_select(0, itensors[ix])
        m = self.models
        if start == 0 and length * m == t.shape[0]:
            return t
        return t.narrow(0, start * m, length * m)

    # ------------------------------------------------------------------ groups
    def _run_group(self, step: int, members: np.ndarray, sid: int | None = None) -> None:
        g = self.graph
        a = self.arrays
        nid0 = int(members[0])
        if sid is None:
            sid = int(a.sig[nid0])
        op, kinds = g.signatures[sid]
        fn = self._resolve(op)
        nobatch = g.nobatch_ids
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
            elif type(k) is tuple:  # literal tensors
                plans.append(
                    ("tensors", cols[j] if whole_sig else [cols[j][i] for i in pos.tolist()])
                )
            else:  # numbers
                plans.append(("numbers", cols[j] if whole_sig else cols[j][pos]))
        if node_js and n == 1 and not nobatch:
            # One node (an RNN step, the top of a tree): each argument is one row of one
            # source, a narrow; plain ints are far cheaper than arrays at this size.
            hs = hmat[0 if whole_sig else int(pos[0])].tolist()
            for j, row in zip(node_js, self._rows_one(hs)):
                c = row >> _CLASS_SHIFT
                starts = self._class_starts[c]
                i = bisect.bisect_right(starts, row) - 1
                plans[j] = ("gather", (self._class_srcs[c][i], row - starts[i], 1, -1))
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
                        plans[j] = ("whole", self._whole_source(h0))
                    else:
                        keep.append(c)
                gathered = [node_js[c] for c in keep]
                if len(keep) < len(node_js):
                    handles = handles[:, keep]
                    decoded = decoded[:, :, keep]
            if gathered:
                rows = self._rows(handles, decoded)
                recipes = self._recipes(rows, idx)
                mixed = [rows[:, c] for c, r in enumerate(recipes) if r is None]
                if mixed:
                    self._run_subgroups(step, members, mixed)
                    return
                for j, r in zip(gathered, recipes):
                    plans[j] = ("gather", r)

        # Phase 2: index tensors, then the argument values.
        itensors = self._index_tensors(idx)
        values: list[torch.Tensor] = []
        for (what, p), k in zip(plans, kinds):
            if what == "gather":
                values.append(self._gather(p, itensors))
            elif what == "whole":
                values.append(self.sources[p])
            else:  # literal tensors or numbers
                t = literal_value(k, p, self.device)
                values.append(t if self.models == 1 else t.repeat_interleave(self.models, 0))

        # Phase 3: the batched call (in chunks of rows where a memory limit asks for it).
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
        self._add_sources(outs, alone, members)
        # Shapes are kept raw; Fold.summary formats them only when asked.
        self.report.append((step, op_name(op), n, tuple([(v.shape, v.dtype) for v in values])))

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
                if what != "whole"
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
                v if what == "whole" else v.narrow(0, start * m, size * m)
                for v, (what, _) in zip(values, plans)
            ]
            parts.append(fn(*args))
        first = parts[0]
        if isinstance(first, torch.Tensor):
            return torch.cat(parts, 0)
        if isinstance(first, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in first):
            return tuple(torch.cat([p[i] for p in parts], 0) for i in range(len(first)))
        return first  # not tensors: check_outputs reports it

    def _add_sources(
        self, outs: tuple[torch.Tensor, ...], alone: bool, members: np.ndarray
    ) -> None:
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
            c = self._classes.get(meta)
            if c is None:
                c = self._classes[meta] = len(self._class_rows)
                self._class_starts.append([])
                self._class_srcs.append([])
                self._class_rows.append(0)
                self._tables.append(None)
                self._in_table.append(0)
                self._outs_per_row.append(0)
                self._class_meta.append(meta)
            seen[c] = seen.get(c, 0) + 1
            self._outs_per_row[c] = seen[c]
            voff = c << _CLASS_SHIFT | self._class_rows[c]
            self._class_rows[c] += n
            self._class_starts[c].append(voff)
            self._class_srcs[c].append(s)
            if n == 1:
                self.vrow[k, members[0]] = voff
            else:
                self.vrow[k][members] = np.arange(voff, voff + n)  # row view, 1-D index
        if not alone:
            self.nout[members[0] if n == 1 else members] = m

    def _whole_source(self, h: int) -> int:
        nid = node_id(h)
        src = self.whole.get((nid, (h >> NSPLIT_SHIFT) & NSPLIT_MASK, h & OUT_MASK))
        if src is None:
            raise FoldError(
                f"apply: nobatch node {nid} ({op_name(self.graph.op_of(nid))!r}) is used "
                "with a split that does not match the outputs of its op. Fix: use it whole if "
                "its op returns one tensor, else the handles of .split(n), n its outputs."
            )
        return src

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
        if set(map(type, items)) != {self.graph._node_type}:
            raise FoldError(
                f"apply: lists[{i}] holds nodes that this Fold did not record. Fix: pass nodes "
                "returned by this Fold's add()."
            )
        nobatch = self.graph.nobatch_ids
        if nobatch and any(node_id(h) in nobatch for h in items):
            return torch.cat([self._value(h) for h in items], 0)
        if len(items) == 1 and not self.model_dim:  # e.g. the root of one tree: its row
            return self._value(items[0])
        rows = self._rows(handles_array(items)[:, None])
        idx: list[np.ndarray] = []
        (recipe,) = self._recipes(rows, idx)
        if recipe is None:
            metas = {
                f"{tuple(v.shape[1:])} {str(v.dtype).replace('torch.', '')}"
                for v in map(self._value, items)
            }
            raise FoldError(
                f"apply: lists[{i}] holds output nodes of different shapes or dtypes "
                f"({', '.join(sorted(metas))} per row); they cannot be concatenated along "
                "dim 0. Fix: put nodes of each shape and dtype in their own list, or convert "
                "the values to one dtype in the ops."
            )
        out = self._gather(recipe, self._index_tensors(idx))
        if self.model_dim:  # (k*N, ...) -> (N, k, ...): one slice per model
            out = out.view(-1, self.models, *out.shape[1:]).transpose(0, 1)
        return out

    def _value(self, h: int) -> torch.Tensor:
        """One node's value (slow path): its row, or the whole value of a nobatch node."""
        if node_id(h) in self.graph.nobatch_ids:
            return self.sources[self._whole_source(h)]
        (v,) = self._rows_one([h])
        c = v >> _CLASS_SHIFT
        j = bisect.bisect_right(self._class_starts[c], v) - 1
        return self.sources[self._class_srcs[c][j]].narrow(0, v - self._class_starts[c][j], 1)


_BATCH_MODULE: Any = None


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
                stacklevel=4,
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


def bad_split(graph: Fold, node: int, n: int, m: int) -> FoldError:
    """The FoldError for a handle of ``node`` made by ``split(n)`` (``n`` 0: the whole node)
    where its op returned ``m`` outputs (0: the node has no value of its own)."""
    op = op_name(graph.op_of(node))
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


def _head(h: Any, first: dict[int, int]) -> tuple[int, int] | None:
    """(signature, low bits) of a column whose first handle is ``h``, if ``h`` is the first
    node of a signature (whole, or output k of a split); else None."""
    h0 = int(h)  # Nodes refuse arithmetic (it would not record); plain ints from here
    low = h0 & LOW_MASK
    t = first.get(h0 - low)
    return None if t is None else (t, low)


def _in_order(col: Any, t: int, low: int, handles: list[list[int]]) -> bool:
    """Whether ``col`` holds every node of signature ``t`` in recording order, each with the
    low bits ``low`` (its output index and split)."""
    # The nodes' own handles have no low bits, so the column equals theirs after subtracting
    # the first one's low bits only if all of its handles carry the same low bits.
    return (list(col) if low == 0 else list(map(int.__sub__, col, repeat(low)))) == handles[t]


def run_chain(graph: Fold, obj: Any, lists: Any) -> Any:
    """``apply`` of a graph where each op runs as one group on whole outputs of earlier ones,
    in order; None where that does not hold (``apply`` then checks the lists and runs the
    general executor).  Per-sample training loops record such graphs: ``f.add("forward",
    image)`` per sample, often followed by ``f.add("loss", logits, label)``.

    The conditions: no nobatch node, no BatchModule; every node argument column of a
    signature is all the nodes of one earlier signature in recording order (whole, or output
    k of the same split), so every node of a signature sits at one depth and the depth
    scheduler would make each signature one group; and every list in ``lists`` is such a
    column or Python numbers of one type.  Then each signature is one call of its op on the
    earlier outputs themselves (no gather, no index), its literals concatenated, and each list
    of nodes is an op output itself: the general executor's groups, values and gradients,
    without its planning and bookkeeping, which for a graph of a few groups cost more than the
    groups (all of it is Python on cold caches, paid every training step).  The lists are
    read here, before apply's full check of them, for the same reason.
    """
    memos = graph._memos
    if graph.nobatch_ids or type(lists) not in (list, tuple) or _is_batch_module(obj):
        return None
    counts = list(map(len, memos))
    first = {next(iter(memo.values())): t for t, memo in enumerate(memos)}
    # A cheap pass on the first node of each column and list: most graphs that are not
    # chains (trees, sequences) fail here, before any column is read whole.
    heads: list[list[Any]] = []
    for s, (_op, kinds) in enumerate(graph.signatures):
        row0 = graph._targs[s][0] if graph._targs[s] else next(iter(memos[s]))
        head: list[Any] = [None] * len(kinds)
        for j, k in enumerate(kinds):
            if k == NODE:
                head[j] = _head(row0[j], first)
                if head[j] is None or head[j][0] >= s or counts[head[j][0]] != counts[s]:
                    return None
        heads.append(head)
    node_type = graph._node_type
    wanted: list[Any] = []
    for items in lists:
        if type(items) is torch.Tensor and items.dim() == 1:  # labels as a tensor
            wanted.append(_COLUMN)
            continue
        if type(items) is not list or not items or len(set(map(type, items))) != 1:
            return None
        kind = type(items[0])
        if kind is node_type:
            w = _head(items[0], first)
            if w is None or counts[w[0]] != len(items):
                return None
            wanted.append(w)
        elif kind in _SCALAR_KINDS:
            wanted.append(None)
        else:
            return None
    # The whole columns and lists.
    handles = [list(memo.values()) for memo in memos]
    columns: list[list[Any]] = []
    for s, (_op, kinds) in enumerate(graph.signatures):
        cols = list(zip(*(graph._targs[s] or memos[s]))) if kinds else []
        for col, head in zip(cols, heads[s]):
            if head is not None and not _in_order(col, *head, handles):
                return None
        columns.append(cols)
    for items, w in zip(lists, wanted):
        if type(w) is tuple and not _in_order(items, *w, handles):
            return None

    device = device_of(obj)
    outs: list[tuple[torch.Tensor, ...]] = []
    report = []
    for s, (op, kinds) in enumerate(graph.signatures):
        fn = resolve_op(obj, op, False)
        n = len(handles[s])
        step = handles[s][0] >> DEPTH_SHIFT
        values = []
        for j, (k, col, head) in enumerate(zip(kinds, columns[s], heads[s])):
            if head is not None:
                values.append(_source_output(graph, outs, handles, head))
                continue
            literals = col if type(k) is tuple else number_column(op, j, k, col)
            values.append(literal_value(k, literals, device))
        try:
            out = fn(*values)
        except Exception as err:
            raise op_failed(op, step, n, values, err) from err
        outs.append(check_outputs(op, step, n, out, False))
        report.append((step, op_name(op), n, tuple([(v.shape, v.dtype) for v in values])))
    # The executor reports groups by step; signatures of one step keep recording order.
    graph.last_run = sorted(report, key=lambda r: r[0])
    return [
        literal_output("numbers" if w is None else w, items, i, device)
        if type(w) is not tuple
        else _source_output(graph, outs, handles, w)
        for i, (items, w) in enumerate(zip(lists, wanted))
    ]


def _source_output(
    graph: Fold, outs: list[tuple[torch.Tensor, ...]], handles: list[list[int]], src: Any
) -> torch.Tensor:
    """The output of signature t that a column with low bits ``low`` reads (``src``: (t,
    low)), checked against the split its handles name."""
    t, low = src
    k, nsplit = low & OUT_MASK, (low >> NSPLIT_SHIFT) & NSPLIT_MASK
    m = len(outs[t])
    if m != (nsplit or 1):
        raise bad_split(graph, node_id(handles[t][0]), nsplit, m)
    return outs[t][k]


_COLUMN = "column"  # a 1-D tensor given as a list of numbers (see graph._classify_lists)


def _is_batch_module(obj: Any) -> bool:
    global _BATCH_MODULE
    if _BATCH_MODULE is None:  # imported late: fold.batched_ops imports the executor's package
        from fold.batched_ops import BatchModule

        _BATCH_MODULE = BatchModule
    return isinstance(obj, _BATCH_MODULE)


def _describe_output(out: Any) -> str:
    if isinstance(out, (tuple, list)):
        inner = ", ".join(type(x).__name__ for x in out)
        return f"a {type(out).__name__} of ({inner})"
    return f"a {type(out).__name__}"
