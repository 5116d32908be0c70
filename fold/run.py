"""Applying a recorded graph: check the lists, plan (cached per snapshot), execute, with
memory limits, offload, and model chunks of an object that runs N models.

``Fold.apply`` calls :func:`apply`; this module reads a Fold only through its public
``snapshot()``, ``strategy`` and ``last_run``.
"""

from __future__ import annotations

import gc
import numbers
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from fold._encoding import LIST, NODE, SCALAR_KINDS, key_rows, node_id
from fold.arrays import GraphArrays, literal_column
from fold.errors import FoldError, describe, op_name
from fold.executor import Executor, ModelBatched, RowsOf
from fold.node import Node, UnfoldNode
from fold.ops import (
    bad_split,
    check_outputs,
    device_of,
    literal_output,
    literal_value,
    op_failed,
    resolve_op,
)
from fold.scheduler import Plan, make_plan
from fold.scheduler.auto import facts_of
from fold.scheduler.chain import SignatureNodes, one_shape, whole_output
from fold.scheduler.plan import Input

__all__ = ["apply", "check_limits", "classify_lists", "plan_of"]


def plan_of(arrays: GraphArrays, strategy: str) -> Plan:
    """The plan of a snapshot for ``strategy``, made once per snapshot (a Fold makes a new
    snapshot when a node is recorded or marked nobatch), so that applying one graph again
    (evaluation, a model at a time) plans once."""
    plan = arrays.plans.get(strategy)
    if plan is None:
        plan = arrays.plans[strategy] = make_plan(arrays, strategy)
    return plan


@contextmanager
def collector_paused() -> Iterator[None]:
    """Run the body with Python's cyclic garbage collector off (if it was on).

    An apply allocates tracked objects by the thousand (tensors, plan steps, argument lists)
    and frees them all when it returns; a collection in the middle finds them alive and
    promotes them, and every promotion to the oldest generation brings a full collection of
    the whole heap nearer (about 0.1 s with torch imported), so a training loop would pay one
    every few dozen steps that hand-written code never pays.  Nothing an apply makes is
    cyclic garbage, so deferring the collection to its end costs nothing; an op's own cyclic
    garbage is collected then.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def apply(
    fold: Any,
    obj: Any,
    lists: Sequence[Sequence[Any]],
    max_rows: int | Mapping[Any, int] | None = None,
    max_bytes: int | None = None,
    offload: str | None = None,
) -> list[torch.Tensor]:
    """``fold.apply(obj, lists, ...)``; see :meth:`fold.Fold.apply`.  Runs with the cyclic
    garbage collector paused (see :func:`collector_paused`), but for a graph of one op on
    literal arguments, which makes few objects (see ``_one_call``)."""
    specs = None  # classify_lists' (the general path's, not _plain_specs' uncopied lists)
    sid = _one_sig(fold) if max_rows is None and max_bytes is None and offload is None else None
    if sid is not None:
        plain = _plain_specs(lists, fold._node_type)
        if plain is None:
            specs = classify_lists(lists)
        outs = _one_call(fold, obj, plain if specs is None else specs, sid, plain is not None)
        if outs is not None:
            return outs
    with collector_paused():
        return _apply(fold, obj, lists, max_rows, max_bytes, offload, specs)


def _apply(
    fold: Any,
    obj: Any,
    lists: Sequence[Sequence[Any]],
    max_rows: int | Mapping[Any, int] | None,
    max_bytes: int | None,
    offload: str | None,
    specs: list[tuple[str, Any]] | None = None,
) -> list[torch.Tensor]:
    arrays = fold.snapshot()
    if max_rows is not None or max_bytes is not None or offload is not None:
        check_limits(max_rows, max_bytes, offload)
        if isinstance(max_rows, Mapping):
            check_limit_ops(arrays.signatures, obj, max_rows)
        if offload == "cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
                return _apply(fold, obj, lists, max_rows, max_bytes, None)
    if specs is None:
        specs = classify_lists(lists)
    arrays.facts = facts_of(obj)
    plan = plan_of(arrays, fold.strategy)
    limits = {"max_rows": max_rows, "max_bytes": max_bytes}
    chunk = obj.fold_chunk() if isinstance(obj, ModelBatched) else None
    if chunk is None or chunk >= obj.batch:
        return _run(fold, arrays, obj, plan, specs, None, limits)
    # N models run a chunk at a time: one graph, one plan, the executor once per chunk;
    # node outputs are concatenated along the model dim.
    parts = [
        _run(fold, arrays, obj, plan, specs, cut.stop - cut.start, limits)
        for cut in obj.chunks(chunk)
    ]
    return [
        torch.cat([p[i] for p in parts], 0) if kind == NODES else parts[0][i]
        for i, (kind, _) in enumerate(specs)
    ]


def run_groups(
    fold: Any, obj: Any, kept: dict[Any, Any] | None = None
) -> list[tuple[int, tuple[torch.Tensor, ...], Any, Any]]:
    """Run every node of ``fold`` and return its groups as they ran: per group its signature
    id, its outputs, the node ids of their rows (an array; a whole plan's
    ``SignatureNodes``: every node of the signature, in node order) and per output the first
    of those rows (None: all 0; a part of a padded call's output of all parts).  For a caller that needs
    every node's value (autobatch's rounds): each is a row of its group's output, read
    where it lies, where ``apply`` would gather the rows of the lists it is given.  No
    memory limits; the cyclic garbage collector paused, as in ``apply``.  ``kept``: a dict
    the caller keeps from one call to the next, for the literal columns of padded rows that
    later calls read again (``fold.ops.padded_rows_of``)."""
    with collector_paused():
        arrays = fold.snapshot()
        arrays.facts = facts_of(obj)
        arrays.rounds = True  # (auto plans a whole plan first: see auto_schedule)
        plan = plan_of(arrays, fold.strategy)
        ex = Executor(arrays, obj)
        ex.groups = []
        ex.kept_columns = kept
        try:
            ex.run(plan)
        except FoldError as err:
            # The node ids of the group that failed, in the order of its values, for the
            # caller's message (autobatch names the example whose call fails).
            members = ex.running
            err.members = members.ids(arrays) if type(members) is SignatureNodes else members
            raise
        finally:
            fold.last_run = ex.report
        return ex.groups


def _run(
    fold: Any,
    arrays: GraphArrays,
    obj: Any,
    plan: Plan,
    specs: list[tuple[str, Any]],
    models: int | None,
    limits: dict[str, Any],
) -> list[torch.Tensor]:
    """One executor pass over ``plan``; its report stays inspectable even if it fails."""
    ex = Executor(arrays, obj, models=models, **limits)
    try:
        ex.run(plan)
        return [ex.output(kind, items, i) for i, (kind, items) in enumerate(specs)]
    finally:
        fold.last_run = ex.report


def _one_call(
    fold: Any, obj: Any, specs: list[tuple[str, Any]], sid: int, plain: bool
) -> list[torch.Tensor] | None:
    """A graph of one op on literal arguments alone (a per-sample loop: one ``forward`` per
    image) whose node lists are each a whole output of it: the op called once on the
    literal columns, as the executor would call it, without a snapshot, plan or value store
    (what hand-written code does: stack the samples, call the model).  None for any other
    graph.  Read from the Fold's own lists: a training step records and applies one such
    graph, and each step's snapshot would cost more than the rest of this.  ``sid``: that
    op's signature (``_one_sig``); ``specs``: ``classify_lists``', or with ``plain``
    ``_plain_specs``' (whose node lists hold this Fold's nodes alone)."""
    if fold.nobatch_ids or isinstance(obj, ModelBatched):
        return None
    op, kinds = fold.signatures[sid]
    if NODE in kinds or LIST in kinds:
        return None
    memo = fold._memos[sid]
    n = len(memo)
    fold._check_intact(n)
    handles = None
    wanted: list[Any] = []
    arrays = None
    for kind, items in specs:
        if kind != NODES:
            wanted.append(None)
            continue
        if not plain and set(map(type, items)) != {fold._node_type}:
            return None  # the executor names the foreign nodes
        if handles is None:
            handles = list(memo.values())
        if items == handles:  # every node, whole, in order
            wanted.append(Input(0, 0, 0))
            continue
        arrays = fold.snapshot() if arrays is None else arrays
        src = whole_output(arrays, items)  # output k of a split, in order
        if src is None:
            return None
        wanted.append(src)
    rows = fold._targs[sid]
    if rows is None:  # numbers alone: their rows are the memo's keys
        rows = key_rows(memo, kinds)
    if not one_shape(rows, kinds):  # literal tensors of several shapes: the executor's parts
        return None
    device = device_of(obj)
    values = [
        literal_value(k, literal_column(op, j, k, [r[j] for r in rows]), device)
        for j, k in enumerate(kinds)
    ]
    fn = resolve_op(obj, op, False)
    fold.last_run = []
    try:
        with RowsOf(memo.values()):  # (the rows' nodes, for an op that asks: group_rows)
            out = fn(*values)
    except Exception as err:
        raise op_failed(op, 0, n, values, err) from err
    outs = check_outputs(op, 0, n, out, False)
    fold.last_run = [(0, op_name(op), n, tuple([(t.shape, t.dtype) for t in values]))]
    result = []
    for i, ((kind, items), src) in enumerate(zip(specs, wanted)):
        if src is None:
            result.append(literal_output(kind, items, i, device))
            continue
        if len(outs) != (src.nsplit or 1):
            raise bad_split(fold.snapshot(), node_id(int(items[0])), src.nsplit, len(outs))
        result.append(outs[src.out])
    return result


def _plain_specs(lists: Any, node_type: type) -> list[tuple[str, Any]] | None:
    """``classify_lists`` of what a per-sample training step gives apply (lists of this
    Fold's nodes, or of Python numbers of one type), in one pass over each list, the lists
    not copied (``_one_call`` reads them at once); None for anything else, which
    ``classify_lists`` checks."""
    if type(lists) is not list and type(lists) is not tuple:
        return None
    specs: list[tuple[str, Any]] = []
    for items in lists:
        if type(items) is not list or not items:
            return None
        types = set(map(type, items))
        if len(types) != 1:
            return None
        t = types.pop()
        if t is node_type:
            specs.append((NODES, items))
        elif t in SCALAR_KINDS:
            specs.append((NUMBERS, items))
        else:
            return None
    return specs


def _one_sig(fold: Any) -> int | None:
    """The one signature of a graph that has nodes of one signature only, else None (a
    renewed Fold, one that took a dropped Fold's recorders, keeps that Fold's signatures:
    they have no nodes now)."""
    memos = fold._memos
    if len(memos) == 1:
        return 0
    if not fold._renewed:
        return None
    found = None
    for i, memo in enumerate(memos):
        if memo:
            if found is not None:
                return None
            found = i
    return found


def check_limit_ops(signatures: list[Any], obj: Any, max_rows: Mapping[Any, int]) -> None:
    """Every key of a ``max_rows`` dict names an op: of ``obj``, or recorded here."""
    ops = {op for op, _ in signatures}
    ops |= {op_name(op) for op in ops}
    model = obj.template if isinstance(obj, ModelBatched) else obj  # the model's own methods
    for key in max_rows:
        if key in ops or (type(key) is str and callable(getattr(model, key, None))):
            continue
        known = sorted({op_name(op) for op, _ in signatures})
        raise FoldError(
            f"apply: max_rows has a limit for {op_name(key)!r}, which is not an op of the "
            f"{type(obj).__name__} given to apply nor of this graph (its ops: {known}); "
            "a misspelt key would leave its op without a limit. Fix: key max_rows by op "
            "name, e.g. max_rows={'node': 64}."
        )


def check_limits(max_rows: Any, max_bytes: Any, offload: Any) -> None:
    rows = max_rows.items() if isinstance(max_rows, Mapping) else [("", max_rows)]
    for op, k in rows:
        if k is not None and (type(k) is not int or k < 1):
            where = f"[{op_name(op)!r}]" if op else ""
            raise FoldError(
                f"apply: max_rows{where}={k!r}; expected a positive int, the most nodes an op is "
                "called on at once (or None for no limit)."
            )
    if max_bytes is not None and (type(max_bytes) is not int or max_bytes < 1):
        raise FoldError(
            f"apply: max_bytes={max_bytes!r}; expected a positive int (bytes), or None."
        )
    if offload not in (None, "cpu"):
        raise FoldError(f"apply: offload={offload!r}; expected None or 'cpu'.")


# The kinds of list given to apply (also the first element of each spec of classify_lists).
NODES, NUMBERS, TENSORS, COLUMN = "nodes", "numbers", "tensors", "column"


def classify_lists(lists: Any) -> list[tuple[str, Any]]:
    """Check the ``lists`` argument of apply: each a list of nodes, numbers or batch-of-one
    tensors, or a 1-D tensor (one number per example, as a list of numbers)."""
    # Exact type checks first: isinstance against torch.Tensor goes through its metaclass.
    if type(lists) not in (list, tuple) and (
        isinstance(lists, (Node, torch.Tensor)) or not isinstance(lists, (list, tuple))
    ):
        raise FoldError(
            f"apply(obj, lists): lists is a {type(lists).__name__}; expected a list of lists, "
            "e.g. apply(model, [roots, labels])."
        )
    specs: list[tuple[str, Any]] = []
    for i, items in enumerate(lists):
        if type(items) not in (list, tuple):
            if isinstance(items, torch.Tensor):
                specs.append((COLUMN, _check_column(items, i)))
                continue
            if isinstance(items, Node) or not isinstance(items, (list, tuple)):
                raise FoldError(
                    f"apply(obj, lists): lists[{i}] is a {type(items).__name__}; each entry "
                    "must be a list of nodes, numbers or batch-of-one tensors, or a 1-D "
                    "tensor. Fix: wrap a single node in a list, e.g. apply(model, [[root]])."
                )
        if not items:
            raise FoldError(
                f"apply(obj, lists): lists[{i}] is empty; there is no value to return for it."
            )
        # Common cases first, in C: all nodes of one Fold, or all ints.
        types = set(map(type, items))
        if len(types) == 1:
            t = types.pop()
            if issubclass(t, (Node, UnfoldNode)):
                specs.append((NODES, list(items)))
                continue
            if t in SCALAR_KINDS:
                specs.append((NUMBERS, list(items)))
                continue
        kinds = set()
        for x in items:
            if isinstance(x, (Node, UnfoldNode)):
                kinds.add(NODES)
            elif isinstance(x, torch.Tensor):
                kinds.add(TENSORS)
            elif isinstance(x, (numbers.Real, bool, np.bool_)):
                kinds.add(NUMBERS)
            else:
                raise FoldError(
                    f"apply(obj, lists): lists[{i}] holds a {type(x).__name__} ({x!r:.40}); "
                    "expected nodes, Python numbers or batch-of-one tensors."
                )
        if len(kinds) > 1:
            raise FoldError(
                f"apply(obj, lists): lists[{i}] mixes {' and '.join(sorted(kinds))}; each list "
                "must hold one kind. Fix: split it into one list per kind."
            )
        kind = kinds.pop()
        if kind == TENSORS:
            _check_tensor_list(items, i)
            items = list(items)
        elif kind == NUMBERS:  # numpy numbers as the Python numbers of their kind
            items = [bool(x) if isinstance(x, np.bool_) else x for x in items]
        specs.append((kind, list(items)))
    return specs


def _check_column(t: torch.Tensor, i: int) -> torch.Tensor:
    if t.dim() != 1:
        fix = (
            "t.view(1) for one number, or [t] for one batch-of-one value"
            if t.dim() == 0
            else "t.view(-1) for one number per example, or list(t.split(1)) for one "
            "batch-of-one value per example"
        )
        raise FoldError(
            f"apply(obj, lists): lists[{i}] is a tensor of shape {tuple(t.shape)}; a tensor "
            f"entry must be 1-D, one number per example (like a list of numbers). Fix: {fix}."
        )
    return t


def _check_tensor_list(items: Sequence[torch.Tensor], i: int) -> None:
    for j, t in enumerate(items):
        if t.dim() == 0 or t.shape[0] != 1:
            raise FoldError(
                f"apply(obj, lists): lists[{i}][{j}] is a tensor of shape {tuple(t.shape)}; "
                "tensors in a list are batch-of-one values of shape (1, ...), concatenated "
                "along dim 0. Fix: t.unsqueeze(0) for one value, a Python number for a "
                "scalar, or pass a 1-D tensor of numbers as the entry itself."
            )
    metas = {describe(t.shape[1:], t.dtype, always_dtype=True) for t in items}
    if len(metas) > 1:
        shown = ", ".join(sorted(metas))
        raise FoldError(
            f"apply(obj, lists): lists[{i}] holds tensors of different shapes or dtypes "
            f"({shown}); they cannot be concatenated along dim 0. Fix: convert them to one "
            "dtype, or put each shape in its own list."
        )
