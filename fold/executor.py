"""Execution of a :class:`fold.scheduler.Plan` over a graph snapshot (``fold.arrays``).

Each group's outputs stay batched tensors (*sources*); a node's value is the pair (source,
row).  Gathering an argument column costs nothing when its rows are a whole source in order,
a ``narrow`` when they are a contiguous run of one source, and otherwise ONE
``index_select`` from a *value table*: the sources of one shape, dtype and output index in
one tensor, filled lazily the first time a column draws from several of them.  Where no
column is in order already, a group runs its nodes in the order of the rows they read
(``_read_order``), and a column that is then a few runs of whole sources or of classes is
gathered as those pieces and one ``cat``, with no table (``Values.pieces``).  So the number
of tensor ops grows with steps x groups x arguments, never with nodes, and autograd flows
back through the gathers unchanged.  A plan whose groups name their inputs (a chain of whole
outputs, ``Plan.whole``) passes those outputs as they are and indexes no rows at all.

The executor reads the snapshot and the plan only: never the Fold that recorded them.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from fold._encoding import (
    LIST,
    NODE,
    any_shape,
    is_tensor_kind,
    list_handles,
    list_lengths,
    node_id,
)
from fold.arrays import GraphArrays, handles_array, literal_column
from fold.errors import FoldError, describe, op_name
from fold.ops import (
    PaddedOutputs,
    PaddedRows,
    bad_split,
    check_outputs,
    device_of,
    literal_output,
    literal_value,
    op_failed,
    padded_literals,
    padded_part,
    padded_pieces,
    padded_rows_of,
    resolve_op,
    rows_of_padded,
)
from fold.ragged import ModelRagged, Ragged, element_shapes
from fold.scheduler.auto import facts_of
from fold.scheduler.chain import SignatureNodes, whole_output
from fold.scheduler.plan import Input, Pieces, Plan
from fold.values import How, Recipe, Values

__all__ = ["Executor", "ModelBatched"]


class ModelBatched:
    """What ``apply`` needs of an object that runs N models at once, one row per model in
    every node value (:class:`fold.batched_ops.BatchModule` implements it).

    ``batch`` is N; ``template`` one model (whose methods name the ops).  ``merged(op)`` is
    the op for rows of (node, model) pairs, model index fastest; ``fold_chunk()`` how many models one executor pass runs; ``chunks(size)``
    yields a slice of models per pass, each selected while the pass runs.
    """

    batch: int
    template: Any

    def merged(self, op: str) -> Callable[..., Any]:
        raise NotImplementedError

    def fold_chunk(self) -> int:
        raise NotImplementedError

    def chunks(self, size: int) -> Iterator[slice]:
        raise NotImplementedError


def _read_order(rows: np.ndarray) -> np.ndarray | None:
    """The order to run a group's nodes in, by the virtual rows they read (nodes x columns);
    None to keep theirs (recording order).

    A node's value is found by its row wherever the group puts it, so a group may run its
    nodes in any order.  Where no column is in order already, sorting the nodes by the rows
    they read in the first column makes each read a few runs: where each torch op is a
    node, a ``sigmoid`` of every cell's gates then reads each gate of the ``chunk`` before
    it whole, in turn, rather than four gates of one cell, then of the next (see
    ``Values.pieces``); and an ``index_select`` reads its rows in order.  A column in order
    already (a chain of whole sources: an RNN) keeps its order, and so its narrows.
    """
    if rows.shape[0] < 2:
        return None
    for col in rows.T:  # (numpy's all() along axis 0 of a row-major array is slow)
        if (col[1:] >= col[:-1]).all():
            return None
    return np.argsort(rows[:, 0], kind="stable")


_CHEAP = (How.SOURCE, How.PIECES)


# What runs a group on this thread now: the Executor in its ``run``, or a ``RowsOf`` where a
# graph of one op runs as one call (fold.run._one_call); see ``group_rows``.
_NOW = threading.local()


class RowsOf:
    """A group of nodes running as one call outside an executor, set for a ``with`` block:
    their handles in row order, their ids (``running``, as an executor's) made only where
    ``group_rows`` asks (a per-sample step's one call runs with it every step)."""

    __slots__ = ("arrays", "handles", "outer")

    def __init__(self, handles: Any) -> None:
        self.handles, self.arrays, self.outer = handles, None, None

    @property
    def running(self) -> np.ndarray:
        return np.fromiter((node_id(h) for h in self.handles), np.int64)

    def __enter__(self) -> RowsOf:
        self.outer, _NOW.running = getattr(_NOW, "running", None), self
        return self

    def __exit__(self, *exc: Any) -> None:
        _NOW.running = self.outer


def group_rows(n: int) -> np.ndarray | None:
    """The node ids of the rows of the group whose op is called now on this thread, in the
    order of its values, where it has ``n`` of them (an op run in chunks or padded parts
    sees fewer); None outside a group's call.  For an op that must know which calls its
    rows are: autobatch's norms in training, whose running statistics take the calls in the
    order eager code makes them (fold.autobatch.running)."""
    now = getattr(_NOW, "running", None)
    members = None if now is None else now.running
    if members is None:
        return None
    if type(members) is SignatureNodes:
        members = members.ids(now.arrays)
    members = np.asarray(members)
    return members if members.ndim == 1 and len(members) == n else None


_UNSEEN = object()  # a column key no group of the pass has read (see Executor._copies)
# Groups of at most this many nodes look their columns up (a node column's key is its rows'
# bytes, hashed: a few us; a list column's, the lists' memo keys, whose hashes are kept);
# larger groups gain little from it (their gathers are a small part of their work) and a
# TreeLSTM level of thousands of nodes would pay for hashing every column.
_COPY_ROWS = 512


class Arg(enum.Enum):
    """Where an argument value of a group comes from."""

    GATHER = 0  # rows of node values, by a Recipe
    WHOLE = 1  # a nobatch node's value, passed whole (a source index)
    INPUT = 2  # an earlier group's output as it is (a tensor)
    TENSORS = 3  # literal tensors, concatenated
    NUMBERS = 4  # literal numbers, as a 1-D tensor
    RAGGED = 5  # a list argument: its elements gathered by one Recipe, and the lengths


def _shapes_split(v: Values, rows: np.ndarray) -> list[int]:
    """The columns of ``rows`` (virtual rows, members x columns) whose values are of
    several shapes (rows of classes whose shapes differ)."""
    classes = Values.class_of(rows)
    split = []
    for c in np.flatnonzero((classes != classes[0]).any(axis=0)).tolist():
        shapes = {v.class_meta[k][0] for k in np.unique(classes[:, c]).tolist()}
        if len(shapes) > 1:
            split.append(c)
    return split


def _one_shape(column: list[torch.Tensor]) -> bool:
    shape = column[0].shape
    return all(t.shape == shape for t in column)


class _NotWhole(Exception):
    """A whole plan's column whose pieces differ in shape or dtype (see ``Executor.run``)."""


class _Mixed:
    """A group whose gathered columns (``mixed``: their virtual rows) or literal tensors span
    values of different shapes or dtypes (see ``Executor._run_mixed``)."""

    __slots__ = ("op", "sid", "members", "mixed", "alone", "labels")

    def __init__(
        self,
        op: Any,
        sid: int,
        members: np.ndarray,
        mixed: list[np.ndarray],
        alone: bool,
        labels: list[np.ndarray],
    ) -> None:
        self.op, self.sid, self.members, self.mixed, self.alone = op, sid, members, mixed, alone
        # per literal column of any shape, each member's shape (see Executor._shape_labels)
        self.labels = labels


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
        # The signature of each slot that names part of a signature's nodes (see
        # fold.scheduler.plan.Group), for errors.
        self._slot_sig: dict[int, int] = {}
        # Literal columns of several lengths made PaddedRows, by source and rows (see
        # fold.ops.padded_rows_of)
        self._padded: dict[Any, PaddedRows] = {}
        # The same across applies, where the caller sets a dict of its own (autobatch's
        # rounds: fold.run.run_groups; see padded_rows_of's ``kept``).
        self.kept_columns: dict[Any, Any] | None = None
        self.report: list[tuple[int, str, int, tuple[tuple[Any, torch.dtype], ...]]] = []
        # The node ids of the group running now (an array, or a whole plan's SignatureNodes)
        self.running: Any = None
        self._fns: dict[Any, Callable[..., Any]] = {}
        self._values: Values | None = None  # made when a group or an output reads rows
        # Signatures whose groups run in recording order, reading no pieces: those whose first
        # group gathered nothing cheaply (see _read_order, Values.pieces).
        self._plain: set[int] = set()
        self._rows_left = 0
        # (op, list argument position) -> (element shape, dtype), as the last group with
        # elements gave them, kept with obj across applies (see element_shapes).
        self._elements = element_shapes(obj)
        # Columns copied by gathers (node rows, list elements) in this pass, by their rows:
        # where later groups read the same rows (decoder steps reading their examples'
        # memories), they take the same tensor, not a copy each.  A column is kept from its
        # second read on (None after its first), only where gradients are on (the copies
        # are kept for backward anyway) and no memory limit is set.
        self._copies: dict[Any, Any] | None = (
            {} if torch.is_grad_enabled() and max_rows is None and max_bytes is None else None
        )
        # Bytes of a node's row per output, per signature, for auto's plan estimates.
        self._facts = facts_of(obj)
        self._facts.device = self.device.type
        self._sized: set[int] = set()
        # Where a caller sets it to a list: every group's (signature, outputs, the node ids of
        # their rows, per output the first row of them in it: None where every output's rows
        # start at 0), in the order they ran (autobatch's rounds read their values so; see
        # fold.run.run_groups).
        self.groups: list[tuple[int, tuple[torch.Tensor, ...], Any, Any]] | None = None

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
        outer, _NOW.running = getattr(_NOW, "running", None), self
        try:
            self._run_plan(plan)
        finally:
            _NOW.running = outer

    def _run_plan(self, plan: Plan) -> None:
        if plan.whole:  # nodes are read only if an output needs rows, after every group
            for s, step in enumerate(plan.steps):
                for g, group in enumerate(step.groups):
                    try:
                        self._run_inputs(s, group.nodes, group.key, group.inputs, group.slot)
                    except _NotWhole:
                        # Pieces of a column differ in shape: the rest on the general
                        # gathers, which run such a group in parts.
                        self._index_rows()
                        later = enumerate(plan.steps[s + 1 :], s + 1)
                        self._run_steps([(s, step.groups[g:])] + [(k, x.groups) for k, x in later])
                        return
            return
        self._run_steps(list(enumerate([step.groups for step in plan.steps])))

    def _run_steps(self, steps: list[tuple[int, list[Any]]]) -> None:
        """Groups on the general gathers, step by step (``(step index, groups)`` pairs)."""
        self._rows_left = sum(len(g.nodes) for _, groups in steps for g in groups)
        for s, groups in steps:
            for group in groups:
                nodes = group.nodes
                if type(nodes) is SignatureNodes:
                    nodes = nodes.ids(self.arrays)
                elif type(nodes) is not np.ndarray:
                    nodes = np.asarray(nodes, dtype=np.int64)
                key = group.key  # the signature id, unless nobatch arguments extend it
                self._run_group(s, nodes, key if type(key) is int else None)
                self._rows_left -= len(nodes)
                if self._values is not None:
                    self._values.rows_left = self._rows_left

    # ------------------------------------------------------------------ gathers
    def _run_group(self, step: int, members: np.ndarray, sid: int | None = None) -> None:
        """Run one group: its arguments gathered (its members perhaps reordered, see
        ``_read_order``), one batched call, its outputs registered.  A group whose gathered
        arguments differ in shape runs in parts of one shape each: one call per part, or one
        call for all where its op takes padded parts (see ``_run_padded``)."""
        got = self._gather(members, sid)
        if type(got) is _Mixed:
            self._run_mixed(step, got)
            return
        op, sid, values, plans, members, alone = got
        self.running = members  # (in its values' order: for an error's caller, run_groups)
        n = len(members)
        outs = self._call(step, op, values, plans, n, alone)
        self._store(sid, outs, members, alone)

    def _store(
        self, sid: int, outs: tuple[torch.Tensor, ...], members: np.ndarray, alone: bool
    ) -> None:
        """A group's outputs registered as the values of ``members``."""
        self._measure(sid, outs, len(members))
        self.values.add_sources(outs, alone, members)
        if self.groups is not None:
            self.groups.append((sid, outs, members, None))

    def _measure(self, sid: int, outs: tuple[torch.Tensor, ...], n: int) -> None:
        """The bytes of a node's row of each output, once per signature, for auto's
        estimates (see ``fold.scheduler.auto.Facts``)."""
        if sid not in self._sized:
            self._sized.add(sid)
            self._facts.measured(
                self.arrays.signatures[sid],
                tuple([o.numel() * o.element_size() // (n * self.models) for o in outs]),
            )

    def _gather(self, members: np.ndarray, sid: int | None) -> Any:
        """A group's argument values: ``(op, sid, values, plans, members, alone)``, its
        members perhaps reordered (see ``_read_order``); a ``_Mixed`` where gathered
        columns differ in shape or dtype across the members."""
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

        # Phase 1: plan every argument column (and find columns whose sources differ in shape):
        # the node columns first (they may reorder the members, see _read_order), then the
        # literal columns, in the members' order.
        idx: list[np.ndarray] = []
        plans: list[Any] = [None] * len(kinds)
        lists: dict[int, list[bytes]] = {}  # per list argument, the group's lists (memo keys)
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
                if n > 1 and getattr(op, "padded_call", None) is not None:
                    # An op that takes parts of several shapes: a column whose rows are of
                    # several shapes goes to the parts at once, without planning gathers.
                    split = _shapes_split(v, rows)
                    if split:
                        labels = self._shape_labels(kinds, cols, whole_sig, pos)
                        return _Mixed(op, sid, members, [rows[:, c] for c in split], alone, labels)
                arrange = sid not in self._plain
                order = _read_order(rows) if arrange else None
                if order is not None:
                    members, rows = members[order], rows[order]
                    pos = order if whole_sig else pos[order]
                    whole_sig = False
                recipes = v.recipes(rows, idx, arrange)
                if arrange and not any(r is not None and r.how in _CHEAP for r in recipes):
                    # Every read of the group a table's or an index_select: its signature's
                    # later groups (a TreeLSTM's levels) are not arranged.
                    self._plain.add(sid)
                mixed = [rows[:, c] for c, r in enumerate(recipes) if r is None]
                if mixed:  # (its literal columns may be mixed too: parts by both)
                    return _Mixed(
                        op,
                        sid,
                        members,
                        mixed,
                        alone,
                        self._shape_labels(kinds, cols, whole_sig, pos),
                    )
                for j, r in zip(gathered, recipes):
                    plans[j] = (Arg.GATHER, r)
        for j, k in enumerate(kinds):
            if k == NODE:
                continue
            if not (is_tensor_kind(k) or k == LIST):
                plans[j] = (Arg.NUMBERS, cols[j] if whole_sig else cols[j][pos])
                continue
            picked = cols[j] if whole_sig else list(map(cols[j].__getitem__, pos.tolist()))
            if k == LIST:  # every element of the group's lists: one gather, its index array
                # after the node columns'
                plans[j] = (Arg.RAGGED, self._plan_list(op, j, picked, idx))
                lists[j] = picked
            elif any_shape(k) and len({t.shape for t in picked}) > 1:
                # literal tensors of several shapes (an op that takes padded parts)
                labels = self._shape_labels(kinds, cols, whole_sig, pos)
                return _Mixed(op, sid, members, [], alone, labels)
            else:
                plans[j] = (Arg.TENSORS, picked)

        # Phase 2: index tensors, then the argument values; a column read before in this pass
        # (the same rows, or the same lists) is that value again (see _copies).
        itensors = v.index_tensors(idx)
        values: list[torch.Tensor] = []
        copies = self._copies
        for j, ((what, p), k) in enumerate(zip(plans, kinds)):
            key = None
            if copies is not None and n <= _COPY_ROWS:
                if what is Arg.GATHER and p.how is not How.SOURCE:
                    key = (NODE, rows[:, gathered.index(j)].tobytes())
                elif what is Arg.RAGGED and p[0] is not None:
                    key = (LIST, tuple(lists[j]))
                if key is not None:
                    got = copies.get(key, _UNSEEN)
                    if got is _UNSEEN:  # first read: nothing kept (most columns are read once)
                        copies[key] = None
                        key = None
                    elif got is not None:
                        values.append(got)
                        continue
            values.append(self._value(what, p, k, op, j, itensors))
            if key is not None:  # read a second time: kept for the reads after
                copies[key] = values[-1]
        return op, sid, values, plans, members, alone

    def _value(
        self, what: Arg, p: Any, k: Any, op: Any, j: int, itensors: list[torch.Tensor]
    ) -> Any:
        """The value of argument ``j`` of a group, by its plan."""
        v = self.values
        if what is Arg.GATHER:
            return v.gather(p, itensors)
        if what is Arg.WHOLE:
            return v.sources[p]
        if what is not Arg.RAGGED:
            return self._literal(k, p)
        recipe, lengths = p
        if recipe is not None:
            flat = v.gather(recipe, itensors)
            self._elements[(op, j)] = (flat.shape[1:], flat.dtype)
        else:  # every list empty: the elements' shape as any group of it gave it
            feature, dtype = self._elements.get((op, j), ((), torch.get_default_dtype()))
            flat = torch.zeros((0, *feature), dtype=dtype, device=self.device)
        if self.models > 1:
            return self._models_ragged(flat, lengths)
        out = Ragged(flat, torch.from_numpy(lengths).to(flat.device, non_blocking=True))
        out._host = lengths  # (its padded form and softmax read no lengths from the device)
        return out

    def _plan_list(
        self, op: Any, j: int, lists: list[bytes], idx: list[np.ndarray]
    ) -> tuple[Recipe | None, np.ndarray]:
        """The gather of a list column (the lists' memo keys, see ``list_handles``): every
        element of every list, in order, by one recipe; and the lists' lengths."""
        lengths = list_lengths(lists)
        v = self.values
        recipe = v.list_recipe(lists, idx)
        if recipe is not None:
            return recipe, lengths
        flat = list_handles(lists)
        if not len(flat):
            return None, lengths
        if self.nobatch and not self.nobatch.isdisjoint(node_id(flat).tolist()):
            raise FoldError(
                f"apply: op {op_name(op)!r}, argument {j}: a list holds a nobatch node; list "
                "elements are gathered by rows. Fix: pass the nobatch node as an argument of "
                "its own."
            )
        rows = v.rows(flat[:, None])
        (recipe,) = v.recipes(rows, idx)
        if recipe is None:
            classes = Values.class_of(rows[:, 0])
            metas = [v.class_meta[c][:2] for c in classes.tolist()]
            bad = next(i for i, m in enumerate(metas) if m != metas[0])
            ends = np.cumsum(lengths)
            which = int(np.searchsorted(ends, bad, side="right"))
            elem = bad - (int(ends[which - 1]) if which else 0)
            raise FoldError(
                f"apply: op {op_name(op)!r}, argument {j}: element {elem} of the list of the "
                f"group's node {which} has rows of {describe(*metas[bad], always_dtype=True)}, "
                f"the group's first element {describe(*metas[0], always_dtype=True)}; the "
                "elements of list arguments are concatenated, so they must agree in shape and "
                "dtype. Fix: make the listed nodes' ops return one shape and dtype."
            )
        v.keep_lists(lists, lengths, recipe, idx)
        return recipe, lengths

    def _models_ragged(self, flat: torch.Tensor, lengths: np.ndarray) -> ModelRagged:
        """A list column of N models: the gathered rows (element after element, the models'
        rows of each element together, model index fastest) as the lists of (node, model)
        pairs, list ``i * N + m`` holding node i's elements for model m."""
        m = self.models
        per_node = np.asarray(lengths, dtype=np.int64)
        node_of = np.repeat(np.arange(len(per_node)), per_node)  # per element
        starts = np.concatenate([[0], np.cumsum(per_node)[:-1]]) if len(per_node) else per_node
        position = np.arange(len(node_of)) - np.repeat(starts, per_node)  # per element
        model = np.tile(np.arange(m), len(node_of))
        segments = np.repeat(node_of, m) * m + model
        positions = np.repeat(position, m)
        t = torch.from_numpy(np.stack([segments, positions]))
        t = t.to(flat.device, non_blocking=True)
        host = np.repeat(per_node, m)
        lists = torch.from_numpy(host).to(flat.device, non_blocking=True)
        out = ModelRagged(flat, lists, t[0], t[1], m)
        out._host = host
        return out

    def _literal(self, kind: Any, column: Any) -> torch.Tensor:
        t = literal_value(kind, column, self.device)
        return t if self.models == 1 else t.repeat_interleave(self.models, 0)

    def _run_inputs(
        self,
        step: int,
        members: Any,
        sid: int,
        inputs: tuple[Input | None, ...],
        slot: int | None = None,
    ) -> None:
        """A group of a whole plan: all of signature ``sid``'s nodes (or, with a ``slot``,
        those of ``members``, an array of node ids), each node column an earlier group's
        output as it is (``inputs``); the literal columns as recorded."""
        a = self.arrays
        op, kinds = a.signatures[sid]
        n = len(members)
        self.running = members  # (for an error's caller: see run.run_groups)
        rows = None  # the recorded arguments, read where a literal column needs them
        values: list[Any] = []
        plans: list[Any] = []
        ragged = False
        for j, (k, src) in enumerate(zip(kinds, inputs)):
            if src is not None:
                v = self._input(src)
                ragged = ragged or type(v) is PaddedRows
                values.append(v)
                plans.append((Arg.INPUT, None))
                continue
            if rows is None:
                rows = a.rows(sid)
                if slot is not None:
                    rows = [rows[i] for i in a.pos[members].tolist()]
            picked = [r[j] for r in rows]
            if any_shape(k) and not _one_shape(picked):  # (an op that takes PaddedRows)
                v = (
                    padded_rows_of(picked, self.device, self._padded, self.kept_columns)
                    if self.models == 1
                    else None
                )
                if v is None:
                    raise _NotWhole
                ragged = True
                values.append(v)
                plans.append((Arg.TENSORS, None))
                continue
            column = literal_column(op, j, k, picked)
            values.append(self._literal(k, column))
            plans.append((Arg.TENSORS if is_tensor_kind(k) else Arg.NUMBERS, None))
        if ragged:
            outs = self._call_ragged(step, op, values, n)
        else:
            outs = self._call(step, op, values, plans, n, False)
        self._measure(sid, outs, n)
        if slot is None:
            slot = sid
        else:
            self._slot_sig[slot] = sid
        self._by_sig[slot] = outs
        self._unindexed.append((outs, members))
        if self.groups is not None:  # (the nodes of members, in order)
            self.groups.append((sid, outs, members, None))

    def _call_ragged(
        self, step: int, op: Any, values: list[Any], n: int
    ) -> tuple[torch.Tensor | PaddedRows, ...]:
        """The one call of a whole group with ``PaddedRows`` among its values (rows of
        several lengths), by the op's ``ragged_call``; ``_NotWhole`` where the op has none
        or declines (the general gathers then run the group in parts)."""
        call = getattr(op, "ragged_call", None)
        if (
            call is None
            or self.models > 1
            or self.max_rows is not None
            or self.max_bytes is not None
        ):
            raise _NotWhole
        try:
            outs = call(values)
        except Exception as err:
            plain = [v.data if type(v) is PaddedRows else v for v in values]
            raise op_failed(op, step, n, plain, err) from err
        if outs is None:
            raise _NotWhole
        for t in outs:
            if len(t) != n:
                raise FoldError(
                    f"apply: op {op_name(op)!r} (step {step}): its call on padded rows returned "
                    f"{len(t)} rows for a group of {n} node(s). Fix: return one row per node."
                )
        metas = [(v.data if type(v) is PaddedRows else v) for v in values]
        self.report.append((step, op_name(op), n, tuple([(t.shape, t.dtype) for t in metas])))
        return outs

    def _input(self, src: Input | Pieces) -> Any:
        """The output that an Input names (or its rows), checked against the split its
        handles make; the rows of Pieces, one ``index_select`` per part, their ``cat`` and
        its reorder (``_NotWhole`` where the parts differ in shape or dtype).  A ragged
        group's output (``PaddedRows``) gives its rows as ``PaddedRows``."""
        if type(src) is Pieces:
            parts = [self._input(p) for p in src.parts]
            if any(type(p) is PaddedRows for p in parts):
                # (rows of one op's groups of several lengths: one PaddedRows of them all)
                joined = padded_pieces(parts)
                if joined is None:
                    raise _NotWhole
                return joined.rows(src.order, self._index(src.order))
            first = parts[0]
            if any(p.shape[1:] != first.shape[1:] or p.dtype != first.dtype for p in parts):
                raise _NotWhole
            return torch.cat(parts, 0).index_select(0, self._index(src.order))
        outs = self._by_sig[src.sid]
        if len(outs) != (src.nsplit or 1):
            nid = node_id(self.arrays.first_handle(self._slot_sig.get(src.sid, src.sid)))
            raise bad_split(self.arrays, nid, src.nsplit, len(outs))
        out = outs[src.out]
        rows = src.rows
        if rows is None:
            return out
        if type(out) is PaddedRows:
            return out.rows(rows, None if type(rows) is slice else self._index(rows))
        if type(rows) is slice:  # a contiguous run of rows: a view
            m = self.models
            return out[rows.start * m : rows.stop * m]
        return out.index_select(0, self._index(rows))

    def _index(self, rows: np.ndarray) -> torch.Tensor:
        """Rows of node values (N rows each with N models) as an index tensor on the
        device."""
        m = self.models
        if m > 1:
            rows = (rows[:, None] * m + np.arange(m)).ravel()
        t = torch.from_numpy(rows)
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

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
            unknown = [
                j
                for j, v in enumerate(values)
                if isinstance(v, Ragged) and v.values.dim() == 1 and not v.values.numel()
            ]
            if unknown:  # the lists were all empty and nothing told their elements' shape
                raise FoldError(
                    f"apply: op {op_name(op)!r} failed at step {step} on a group of {n} node(s) "
                    f"whose list argument {unknown[0]} is empty in every node, and no group of "
                    "it had elements before, so the elements' shape and dtype are unknown (its "
                    f"values are (0,)): {type(err).__name__}: {err}. Fix: give the shape where "
                    "the op reads it: children.sum(feature=(hidden,)), .mean/.amax/.padded "
                    "take feature= and dtype= too; or test len(children.values) == 0."
                ) from err
            raise op_failed(op, step, n, values, err) from err
        outs = check_outputs(op, step, n * self.models, out, alone)
        # Shapes are kept raw; summaries format them only when asked.
        metas = [(v.values if isinstance(v, Ragged) else v) for v in values]
        self.report.append((step, op_name(op), n, tuple([(t.shape, t.dtype) for t in metas])))
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
            per_node = 0
            for v, (what, _) in zip(values, plans):
                if what is Arg.RAGGED:  # the average list's elements
                    t = v.values
                    per_node += -(-t.numel() * t.element_size() // max(len(v), 1))
                elif what is not Arg.WHOLE:
                    per_node += v[: self.models].numel() * v.element_size()
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
                v
                if what is Arg.WHOLE
                else v.lists(start * m, size * m)
                if what is Arg.RAGGED and m > 1
                else v.lists(start, size)
                if what is Arg.RAGGED
                else v.narrow(0, start * m, size * m)
                for v, (what, _) in zip(values, plans)
            ]
            parts.append(fn(*args))
        first = parts[0]
        if isinstance(first, torch.Tensor):
            return torch.cat(parts, 0)
        if isinstance(first, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in first):
            return tuple(torch.cat([p[i] for p in parts], 0) for i in range(len(first)))
        return first  # not tensors: check_outputs reports it

    @staticmethod
    def _shape_labels(
        kinds: tuple[Any, ...], cols: list[Any], whole_sig: bool, pos: Any
    ) -> list[np.ndarray]:
        """Per literal column of any shape (see ``fold._encoding.any_shape``), a label per
        member: which of the column's shapes its tensor has."""
        labels = []
        for j, k in enumerate(kinds):
            if any_shape(k):
                picked = cols[j] if whole_sig else list(map(cols[j].__getitem__, pos.tolist()))
                seen: dict[Any, int] = {}
                labels.append(np.array([seen.setdefault(t.shape, len(seen)) for t in picked]))
        return labels

    def _run_mixed(self, step: int, got: _Mixed) -> None:
        """A group whose gathered arguments differ in shape or dtype, split into parts of one
        shape and dtype each: one call per part, or one call for all of them where the op
        takes padded parts (``padded_call``, see ``_run_padded``)."""
        # One key per member, its columns' classes and labels in lexicographic order (as
        # np.unique(axis=1) would order them, at a 1-D unique's cost); the parts in key
        # order, each its members in order.
        columns = [Values.class_of(rows) for rows in got.mixed] + got.labels
        key, bound = columns[0], int(columns[0].max()) + 1
        for labels in columns[1:]:
            size = int(labels.max()) + 1
            bound *= size
            key = key * size + labels
        if bound < 1 << 62:
            _, part = np.unique(key, return_inverse=True)
        else:  # (too many columns for one int64 key)
            _, part = np.unique(np.stack(columns), axis=1, return_inverse=True)
        part = part.reshape(-1)
        order = np.argsort(part, kind="stable")
        cuts = np.cumsum(np.bincount(part))[:-1].tolist()
        members, sid = got.members, got.sid
        parts = np.split(members[order], cuts)
        padded = getattr(got.op, "padded_call", None)
        if (
            padded is None
            or got.alone
            or self.models > 1
            or self.max_rows is not None
            or self.max_bytes is not None
        ):
            for p in parts:
                self._run_group(step, p, sid)
            return
        self._run_padded(step, sid, parts, padded)

    def _run_padded(self, step: int, sid: int, parts: list[np.ndarray], padded: Any) -> None:
        """The parts of a group (each of one shape: sequences of one length) run as one call:
        ``padded(per part its values)`` returns per part its outputs (an RNN's sequences
        padded and packed into one batch inside, the outputs cut back to each part's
        shapes), registered part by part as any group's; or a ``PaddedOutputs``, whose
        outputs of one shape across the parts are one tensor each (``_store_padded``)."""
        op = self.arrays.signatures[sid][0]
        gathered = None if self.nobatch else self._gather_parts(sid, parts)
        if gathered is None:  # (nobatch sources, lists: each part gathered as a group)
            gathered = []
            for p in parts:
                got = self._gather(p, sid)
                if type(got) is _Mixed:  # (parts are of one class per column: not expected)
                    for q in parts:
                        self._run_group(step, q, sid)
                    return
                gathered.append((got[2], got[4]))
        n = sum(len(members) for _, members in gathered)
        self.running = gathered[0][1]  # (the first part's: its values go with an error)
        try:
            outs = padded([values for values, _ in gathered])
        except Exception as err:
            raise op_failed(op, step, n, gathered[0][0], err) from err
        # The report shows each part as the group of its shape (each costs a group's
        # bookkeeping, though the op ran once).
        name = op_name(op)
        for values, members in gathered:
            self.report.append(
                (step, name, len(members), tuple([(t.shape, t.dtype) for t in values]))
            )
        if type(outs) is PaddedOutputs:
            self._store_padded(step, op, sid, [members for _, members in gathered], outs.outputs)
            return
        for (_, members), out in zip(gathered, outs):
            self._store(sid, check_outputs(op, step, len(members), out, False), members, False)

    def _store_padded(
        self, step: int, op: Any, sid: int, parts: list[np.ndarray], outputs: list[Any]
    ) -> None:
        """A padded call's ``PaddedOutputs`` registered: an output of one tensor for all
        the parts as one source, an output of per part tensors as one source per part."""
        members = np.concatenate(parts)
        sizes = [len(p) for p in parts]
        for k, out in enumerate(outputs):
            if type(out) is list:
                if len(out) != len(parts):
                    raise FoldError(
                        f"apply: op {op_name(op)!r} (step {step}): its padded call returned "
                        f"{len(out)} tensors for output {k} of {len(parts)} parts. Fix: return "
                        "one per part, or one tensor of all the parts' rows."
                    )
                for t, rows in zip(out, sizes):
                    check_outputs(op, step, rows, t, False)
            else:
                check_outputs(op, step, len(members), out, False)
        if sid not in self._sized:  # the first part's outputs, measured once per signature
            first = [o[0] if type(o) is list else o.narrow(0, 0, sizes[0]) for o in outputs]
            self._measure(sid, tuple(first), sizes[0])
        self.values.add_parts(outputs, parts, members)
        if self.groups is not None:
            start = 0
            for i, p in enumerate(parts):
                outs = tuple([o[i] if type(o) is list else o for o in outputs])
                starts = tuple([0 if type(o) is list else start for o in outputs])
                self.groups.append((sid, outs, p, starts))
                start += len(p)

    def _gather_parts(
        self, sid: int, parts: list[np.ndarray]
    ) -> list[tuple[list[Any], np.ndarray]] | None:
        """Per part of a group, its argument values (and its members): a node column whose
        rows are of one shape is gathered once for all parts and cut per part; a column of
        several shapes is gathered part by part; literal columns are made per part.  None
        where the group has a list argument (the caller gathers each part as a group)."""
        a = self.arrays
        _op, kinds = a.signatures[sid]
        if LIST in kinds:
            return None
        cols, node_js, hmat, decoded = a.columns(sid)
        pos = a.pos[np.concatenate(parts)]
        ends = np.cumsum([len(p) for p in parts]).tolist()
        spans = list(zip([0, *ends[:-1]], ends))
        values: list[list[Any]] = [[None] * len(kinds) for _ in parts]
        if node_js:
            v = self.values
            rows = v.rows(hmat[pos], decoded[:, pos])
            for c, j in enumerate(node_js):
                column = rows[:, c : c + 1]
                idx: list[np.ndarray] = []
                (recipe,) = v.recipes(column, idx, False)
                if recipe is not None:  # one shape: one gather, a view per part
                    whole = v.gather(recipe, v.index_tensors(idx))
                    for vals, (s, e) in zip(values, spans):
                        vals[j] = whole[s:e]
                    continue
                # Part by part; a part whose rows are a run of one source (the parts of an
                # earlier group of several shapes, read in order: a memory's attention
                # after its encoder) is that source, or a view of it, with no recipe made.
                flat = column[:, 0]
                steps = (np.diff(flat) == 1).tolist()
                starts = flat.tolist()
                for vals, (s, e) in zip(values, spans):
                    run = v.run(starts[s], e - s) if all(steps[s : e - 1]) else None
                    if run is None:
                        idx = []
                        (recipe,) = v.recipes(column[s:e], idx, False)
                        if recipe is None:  # (a part is of one shape: not expected)
                            return None
                        run = v.gather(recipe, v.index_tensors(idx))
                    vals[j] = run
        for j, k in enumerate(kinds):
            if k == NODE:
                continue
            if is_tensor_kind(k):
                picked = [cols[j][i] for i in pos.tolist()]
                # Sequences of several lengths (each example's token ids; an earlier round's
                # memories, rows of its encoder's padded outputs): padded together once, a
                # view per part (which the padded call reads as that one tensor).
                whole = None
                if self.models == 1:
                    whole = rows_of_padded(picked)
                    if whole is None:
                        whole = padded_literals(picked, self.device)
                for vals, (s, e) in zip(values, spans):
                    if whole is None:
                        vals[j] = self._literal(k, picked[s:e])
                    else:
                        vals[j] = padded_part(whole, s, e, picked[s])
            else:
                numbers = cols[j][pos]
                for vals, (s, e) in zip(values, spans):
                    vals[j] = self._literal(k, numbers[s:e])
        return list(zip(values, parts))

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
            src = whole_output(self.arrays, items)
            if (
                src is not None
                and src.sid in self._by_sig
                and type(self._by_sig[src.sid][src.out]) is not PaddedRows
            ):
                return self._model_major(self._input(src))
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
            ids = members.ids(self.arrays) if type(members) is SignatureNodes else members
            if any(type(o) is PaddedRows for o in outs):
                self.values.add_padded(outs, ids)
                continue
            self.values.add_sources(outs, False, ids)
        self._unindexed.clear()
