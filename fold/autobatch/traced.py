"""Recordings that stand for many calls: a function recorded once on lazy values standing for a
whole batch (tensor rows, ``_traced``) or for a group (a ``@batchable`` function's program,
``_compile``), and each recorded call run once on the batch."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fold.autobatch.common import (
    _C,
    _LOCAL,
    _MISS,
    _PER_EXAMPLE,
    _VMAP,
    HOOKS,
    _rng_restore,
    _rng_same,
    _rng_states,
    pool_room,
    pool_take,
)
from fold.autobatch.ops import _Op, _op_device, _slots
from fold.autobatch.patches import (
    _apply_installed,
    _installed,
    recorded_calls,
    tensor_installed,
)
from fold.autobatch.recorder import _Recorder
from fold.autobatch.values import Known, Lazy, RowNumber, _Meta, _meta
from fold.errors import describe
from fold.ragged import Ragged
from fold.run import collector_paused

_LOG = logging.getLogger(__name__)


# The structure of a result that is one tensor or Lazy value, and of flat tuples of them,
# by length: pytree.tree_flatten costs ~5 us a call and leaves a reference cycle behind (its
# recursive helper), which set off a collection after every autobatch call.
_LEAF_SPEC = pytree.tree_flatten(0)[1]


_TUPLE_SPECS: dict[int, Any] = {}


def _flatten(out: Any) -> tuple[list[Any], Any]:
    """``pytree.tree_flatten(out)``, without its cost for the common results; known values
    as their tensors."""
    t = type(out)
    if t is Lazy or t is torch.Tensor:
        return [out], _LEAF_SPEC
    if t is Known:  # torch.tensor(tokens) of a decoder: the tensor it stands for
        return [out.tensor()], _LEAF_SPEC
    if t is str or t is int or t is float or t is bool:  # (a decoded name, a count)
        return [out], _LEAF_SPEC
    if t is tuple and len(out) <= 8:
        for x in out:
            tx = type(x)
            if tx is not Lazy and tx is not torch.Tensor:
                break
        else:
            spec = _TUPLE_SPECS.get(len(out))
            if spec is None:
                spec = _TUPLE_SPECS[len(out)] = pytree.tree_flatten(out)[1]
            return list(out), spec
    leaves, spec = pytree.tree_flatten(out)
    # A known value (torch.tensor of data) returned: the tensor it stands for.
    return [x.tensor() if type(x) is Known else x for x in leaves], spec


class _Handle:
    """An output recorded by a :class:`_Trace`: its index in the trace's values."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


class _Untraceable(Exception):
    """A recording on lazy rows that cannot stand for every example (see ``_traced``)."""


class _Diverged(BaseException):
    """A read whose rows disagree, while a function is recorded once for a batch of rows
    (see ``_Lockstep``): ``answers``, the values every row read before it; ``groups``, per
    value read, one row's value and the rows that read it; ``calls`` and ``values``, the
    calls run for the read and the values of all rows they made.  A BaseException: the
    function's own ``except Exception`` must not take it."""

    def __init__(
        self,
        answers: list[Any],
        groups: list[tuple[Any, list[int]]],
        calls: list[Any],
        values: list[Any],
    ) -> None:
        super().__init__("the rows read different values")
        self.answers, self.groups, self.calls, self.values = answers, groups, calls, values


class _Lockstep:
    """The reads of a function recorded once for a batch of ``n`` rows (``_traced``): a read
    (``bool``, ``int``, ``.item()``, ``if t:``) runs the calls recorded so far on the batch
    and gives every row's value; where all rows read one value, the recording goes on with
    it (the rows in lockstep), else ``_Diverged``, and the caller records the function again
    for each group of rows that read one value, each read before answered as it was
    (``answers``: per read, one row's value, all rows' alike).  The function must be pure
    for that (as recording once takes it to be): given the same reads, the same calls."""

    __slots__ = ("trace", "inputs", "n", "answers", "values", "done", "reads", "prefix", "partial")

    def __init__(
        self,
        trace: _Trace,
        inputs: list[torch.Tensor],
        n: int,
        answers: list[Any],
        prefix: tuple[list[Any], list[Any]] | None = None,
    ) -> None:
        self.trace, self.inputs, self.n, self.answers = trace, inputs, n, answers
        self.values: list[Any] | None = None
        self.done = 0  # calls run so far
        self.reads = 0
        # (calls, these rows' values of them): where a recording for more rows ran the same
        # calls before its read diverged; their values are not made again (a call that
        # changes a module's state runs once per row).
        self.prefix = prefix
        self.partial = prefix is not None  # (a group of the rows)

    def run(self, final: bool = False) -> list[Any]:
        """The values of every handle recorded so far (the calls not run yet, run).  A call
        that may change a module's buffers (a batch norm in training) runs only in the last
        run of a recording that read no value its rows disagreed on (``final``, no
        ``answers`` a group of rows was given): anywhere else, the recording may yet give
        way to recording per example, which would run it again (``_Untraceable`` first)."""
        trace = self.trace
        if not final or self.partial:
            for call in trace.calls[self.done :]:
                if call[0].buffers() is not None:
                    raise _Untraceable(f"{call[0].name} may change buffers, and the rows read")
        if self.prefix is not None:
            calls, values = self.prefix
            self.prefix = None
            if not _same_calls(trace.calls[: len(calls)], calls):
                raise _Untraceable("given the same reads, the function recorded other calls")
            self.values, self.done = list(values), len(calls)
        if self.values is None or self.done < len(trace.calls) or len(self.values) < trace.size:
            # The calls run, nothing records (a module's call would record its inner calls).
            outer, _LOCAL.rec = _LOCAL.rec, None
            try:
                self.values = trace.run(self.inputs, self.n, self.values, self.done)
            finally:
                _LOCAL.rec = outer
            self.done = len(trace.calls)
            state = getattr(outer, "state", None)
            if state:  # (the calls noted have run: a change from here on meets later ones)
                state.clear()
                if _C is not None:
                    _C.forget_noted()
        return self.values

    def read(self, x: Lazy, convert: Callable[[Any], Any], numbers: bool) -> Any:
        """``convert`` of lazy value ``x``'s rows (numbers: one number per row, from one
        ``tolist``; else each row's tensor), where they agree."""
        k = self.reads
        self.reads += 1
        if k < len(self.answers):
            return convert(self.answers[k])
        v = self.run()[x.node.i]
        if v.requires_grad:
            v = v.detach()
        rows = v.reshape(self.n).tolist() if numbers else list(v.unbind(0))
        groups: dict[Any, list[int]] = {}
        for i, row in enumerate(rows):
            groups.setdefault(_hashable(convert(row)), []).append(i)
        if len(groups) > 1:
            raise _Diverged(
                self.answers,
                [(rows[g[0]], g) for g in groups.values()],
                self.trace.calls[: self.done],
                self.values,  # type: ignore[arg-type]
            )
        self.answers.append(rows[0])
        return convert(rows[0])


def _same_calls(mine: list[Any], theirs: list[Any]) -> bool:
    """Whether two recordings' calls are the same: ops, arguments (handles by index,
    literals by value) and outputs."""
    if len(mine) != len(theirs):
        return False
    for (op, args, first, outputs), (op2, args2, first2, outputs2) in zip(mine, theirs):
        if op is not op2 or first != first2 or outputs != outputs2 or not _same_arg(args, args2):
            return False
    return True


def _same_arg(x: Any, y: Any) -> bool:
    t = type(x)
    if t is not type(y):
        return False
    if t is _Handle:
        return x.i == y.i
    if t is list or t is tuple:
        return len(x) == len(y) and all(_same_arg(a, b) for a, b in zip(x, y))
    if isinstance(x, torch.Tensor):
        return x is y or (
            x.shape == y.shape and x.dtype == y.dtype and x.device == y.device and torch.equal(x, y)
        )
    try:
        return bool(x == y)
    except Exception:  # (a value without a plain equality)
        return False


def _hashable(value: Any) -> Any:
    """A read's value as a key that equal values share (lists as tuples, arrays by their
    bytes); ``_Untraceable`` for a value of another kind."""
    t = type(value)
    if t in (bool, int, float, complex, str) or value is None:
        return value
    if t in (list, tuple):
        return (t, tuple([_hashable(v) for v in value]))
    if t.__module__ == "numpy" or isinstance(value, torch.Tensor):
        a = value.numpy() if isinstance(value, torch.Tensor) else value
        if hasattr(a, "tobytes") and hasattr(a, "dtype"):
            return ("array", str(a.dtype), getattr(a, "shape", ()), a.tobytes())
    raise _Untraceable(f"a read of a {t.__name__}")


class _Trace:
    """What a recorder records into, in place of a Fold, when autobatch records ``fn`` once
    on lazy rows: the calls in order, each with its arguments (handles of earlier outputs, or
    literals made while recording) and the handle of its first output."""

    def __init__(self, inputs: int) -> None:
        # The count of handles, in a list of one that the op recorders share: they hold it
        # and ``calls``, not the trace (a trace kept with its tables, which hold the
        # recorders, makes no reference cycle; see _TRACES).
        self._size = [inputs]
        self.inputs = inputs  # (handles below it are the rows given)
        self.calls: list[tuple[_Op, tuple[Any, ...], int, int | None]] = []
        # The fast tables of the recorder that recorded into it last (see _TRACES).
        self.tables: tuple[dict[Any, Any], ...] | None = None

    @property
    def size(self) -> int:
        return self._size[0]

    def reset(self, inputs: int) -> None:
        """Empty, for another recording of the same function (its op recorders, which
        append to ``calls``, stay valid)."""
        self._size[0] = self.inputs = inputs
        self.calls.clear()

    def op(self, op: _Op, outputs: int | None) -> Callable[..., Any]:
        """A recorder like ``Fold.op``'s: ``record(*args)`` returns the output handle(s)."""
        calls, size = self.calls, self._size

        def record(*args: Any) -> Any:
            first = size[0]
            calls.append((op, args, first, outputs))
            if outputs is None:
                size[0] = first + 1
                return _Handle(first)
            size[0] = first + outputs
            return tuple([_Handle(first + j) for j in range(outputs)])

        return record

    def run(
        self, inputs: list[torch.Tensor], n: int, values: list[Any] | None = None, start: int = 0
    ) -> list[Any]:
        """Every call once, on the whole batch of ``n`` examples, in recording order; the
        values of all handles.  Outputs are checked against the shapes inferred while
        recording (``_Untraceable`` where they differ).  With ``values`` (what an earlier
        run returned), the calls from ``start`` on run, the earlier ones' values kept."""
        if values is None:
            values = [*inputs, *([None] * (self.size - len(inputs)))]
        else:
            values.extend([None] * (self.size - len(values)))
        handle = _Handle
        for op, args, first, outputs in self.calls[start:]:
            out = op(
                *[
                    values[a.i] if type(a) is handle else _batch_value(a, values, n, op, inputs)
                    for a in args
                ]
            )
            outs = (out,) if outputs is None else out
            if len(outs) != len(op.outs):
                raise _Untraceable(f"{op.name} returned {len(outs)} outputs")
            j = first
            for t, meta in zip(outs, op.outs):
                shape = t.shape
                if not shape or shape[0] != n or shape[1:] != meta.shape or t.dtype != meta.dtype:
                    raise _Untraceable(
                        f"{op.name} returned {describe(t.shape, t.dtype)} for {n} examples of "
                        f"{meta}"
                    )
                values[j] = t
                j += 1
        return values


_NUMBER_TYPES = {bool: torch.bool, int: torch.long}


def _batch_value(a: Any, values: list[Any], n: int, op: _Op, inputs: list[torch.Tensor]) -> Any:
    """An argument of ``op`` traced for all ``n`` examples: a handle's value; a list of
    handles as a Ragged of ``n`` equal lists; a literal (one example's number or
    batch-of-one tensor, the same for every example) repeated ``n`` times, numbers on the
    op's device (of its parameters, else of the inputs), as ``_stack`` places them."""
    t = type(a)
    if t is _Handle:
        return values[a.i]
    if t is list:
        if not a:
            raise _Untraceable("an empty list argument")
        flat = torch.stack([values[h.i] for h in a], 1).flatten(0, 1)
        return Ragged(flat, torch.full((n,), len(a), dtype=torch.long, device=flat.device))
    if t in (bool, int, float):
        dtype = _NUMBER_TYPES.get(t, torch.get_default_dtype())
        device = _op_device(op)
        return torch.full(
            (n,), a, dtype=dtype, device=inputs[0].device if device is None else device
        )
    if isinstance(a, torch.Tensor):  # a batch of one (see _Recorder._part)
        return a.expand(n, *a.shape[1:]).contiguous()
    raise _Untraceable(f"an argument of type {t.__name__}")  # (a RowNumber: per example)


def _trace_output(v: Any, values: list[Any], n: int, rec: _Recorder) -> Any:
    """One leaf of ``fn``'s result for all ``n`` examples, as ``_stack`` stacks it."""
    if type(v) is Lazy and v.rec is rec:
        return values[v.node.i]
    if type(v) is RowNumber and v.lazy.rec is rec:  # (as numbers returned are stacked)
        t = values[v.lazy.node.i]
        return t.to(torch.get_default_dtype()) if v.type is float else t.clone()
    if isinstance(v, torch.Tensor):  # the same tensor for every example
        return v.unsqueeze(0).expand(n, *v.shape).clone()
    if v is None:
        return None
    if type(v) in (int, float, bool):
        return torch.tensor([v] * n)
    raise _Untraceable(f"a result of type {type(v).__name__}")


@contextlib.contextmanager
def _call_programs() -> Any:
    """The scope of one autobatch call's run: @batchable functions are recorded once in it
    (``_compile``) and the recordings dropped at its end, so the next call records them
    afresh, reading the state they read then (``self.training``, a flag)."""
    outer = _LOCAL.programs
    _LOCAL.programs = {}
    try:
        yield
    finally:
        _LOCAL.programs = outer


def _record_once(
    fn: Callable[..., Any],
    metas: list[_Meta],
    modules: bool = True,
    rows: tuple[Any, ...] | None = None,
    pool: Any = None,
) -> tuple[_Recorder, _Trace, Any]:
    """``fn`` called once on lazy values of these metas, recorded into a :class:`_Trace`
    (the recording that stands for many calls: a whole batch of tensor rows, or every group
    of a batchable op): ``(recorder, trace, fn's result)``.  Raises what ``fn`` raises (a
    read, an in-place change), and ``_Untraceable`` where ``fn`` drew from torch's random
    generators eagerly, which would share one draw; the random state is then put back, so
    what runs ``fn`` instead draws what eager code draws.  ``modules``: module calls are
    recorded as one call each (the patches installed); without, as the torch calls their
    forward makes."""
    trace = pool_take(_TRACES, pool) if pool is not None else None
    if trace is None:
        trace = _Trace(len(metas))
        rec = _Recorder(trace)
    else:  # (the calls of the last recording found in its tables: the C fast path)
        trace.reset(len(metas))
        rec = _Recorder(trace)
        rec._fast, rec._fast_nograd, rec._recorders = trace.tables  # type: ignore[misc]
    if rows is not None:  # (the batch's inputs, its size, the reads answered before, ...)
        rec.lockstep = _Lockstep(trace, *rows)
    lazies = [Lazy(_Handle(i), m, rec) for i, m in enumerate(metas)]
    outer = _LOCAL.rec
    _LOCAL.rec = rec
    rng = _rng_states()
    try:
        if modules:
            with collector_paused(), _installed():
                out = fn(*lazies)
        elif getattr(fn, "row_numbers", False):  # (torch.tensor([label]): its wrapper too)
            with collector_paused(), _apply_installed, recorded_calls, tensor_installed():
                out = fn(*lazies)
        else:  # (a batch norm's forward would count its call once: see recorded_calls)
            with collector_paused(), _apply_installed, recorded_calls:
                out = fn(*lazies)
        if not _rng_same(rng, _rng_states()):
            raise _Untraceable("the function drew random numbers while recording")
    except BaseException:
        _rng_restore(rng)
        raise
    finally:
        _LOCAL.rec = outer
        # (kept with the trace; the closed recorder's own emptied, see _Recorder.close)
        trace.tables = (rec._fast, rec._fast_nograd, rec._recorders)
        rec._fast, rec._fast_nograd, rec._recorders = {}, {}, {}
        rec.close()
    return rec, trace, out


# Per function recorded once on lazy rows (the key of _traced, and whether module calls
# were recorded whole), traces of its earlier calls that ran, with their recorders' fast
# tables: the next call records into one, its calls found in the tables by the C fast path
# (about 1 us a call, where the slow path builds each op's key: 15-20 us), and runs it.  At
# most _TRACES_MAX per function and _TRACES_FUNCTIONS functions; tables grown past
# _TRACES_LIMIT are dropped.  Emptied by clear_cache, and where a module's calls are run
# through from then on (HOOKS.forget_pools).
_TRACES: dict[Any, list[_Trace]] = {}
_TRACES_MAX = 2
_TRACES_FUNCTIONS = 16
_TRACES_LIMIT = 4096


def _give_trace(pool: Any, trace: _Trace) -> None:
    """Keep ``trace`` (a recording that ran) for the next call of its function."""
    tables = trace.tables
    if tables is None or sum(map(len, tables)) > _TRACES_LIMIT:
        return
    traces = pool_room(_TRACES, pool, _TRACES_FUNCTIONS, _TRACES_MAX)
    if traces is not None:
        traces.append(trace)


def forget_traces() -> None:
    """Drop the traces kept for later calls (see ``_TRACES``)."""
    _TRACES.clear()


def _compile(op: _Op) -> Any:
    """A ``@batchable`` per-example function, or the forward of a module of the user's own
    recorded whole, as a program of the calls it makes, recorded
    once on lazy values standing for a group (the op's per-example shapes): run on a
    group's stacked values, each call runs once on the batch in its own mode (``cat`` with
    its dim moved, ``nn.Linear`` directly, ...), where ``torch.func.vmap`` would run the whole
    function with its per-op batching cost.  The recording depends only on the shapes (the
    function cannot read values) and on Python state the function reads (``self.training``),
    so it is made once per op and autobatch call (see ``_call_programs``).  False where the
    function cannot be recorded so (it reads or changes a value, returns a value that
    depends on no argument): the group runs under vmap."""
    slots = sorted(_slots((op.args, op.kwargs)), key=lambda s: s.i)
    if any(s.ragged or s.meta is None for s in slots):
        return False
    try:
        # (a module's forward as the calls it makes: with autobatch's wrapper over module
        # calls installed, the call would record the module itself again)
        modules = op.kind != "module"
        rec, trace, out = _record_once(op.per_example, [s.meta for s in slots], modules)
    except Exception as err:
        _LOG.debug("autobatch: %s cannot be recorded once (%s); vmap runs it", op, err)
        return False
    leaves = pytree.tree_leaves(out)
    if not all(type(v) is Lazy and v.rec is rec for v in leaves):
        return False
    handles = [v.node.i for v in leaves]
    single = op.single

    def program(values: tuple[Any, ...]) -> Any:
        got = trace.run(list(values), values[0].shape[0])
        return got[handles[0]] if single else tuple([got[h] for h in handles])

    return program


HOOKS.compile = _compile


# (fn's code, or the id of a callable object, and the metas of its rows) of calls that could
# not be traced: they record per example at once (cleared by clear_cache).  A reused id only
# sends another callable the per-example way, which gives the same results.
_UNTRACEABLE: set[tuple[Any, ...]] = set()


_UNTRACEABLE_MAX = 4096
# The same keys for functions recorded on lazy rows with module calls as one call each (see
# _traced).
_WITH_MODULES: set[tuple[Any, ...]] = set()


def _traced(fn: Callable[..., Any], iterables: tuple[Any, ...]) -> Any:
    """``autobatch(fn, *iterables)`` by one recording, where every iterable is a tensor, a
    list of tensors of one shape (see ``_same_rows``), or a list of samples alike, tuples or
    dicts of such tensors (``(x, y)`` as a Dataset yields them: ``_sample_fields``, each
    field stacked): the examples are the rows, so ``fn`` sees lazy rows standing for all of
    them (equal shapes, no values it can read) and records the same calls for every
    example; each runs once on the whole batch.  ``_MISS`` where the iterables are not all tensors, or ``fn`` cannot be
    recorded or run this way (it reads a row, changes one in place, returns something else
    than tensors or numbers, ...): autobatch then records per example, which gives the same
    results, or the error that names the example."""
    metas = []
    # Per iterable: None (its examples are its rows), or the structure of its samples
    # (tuples or dicts of tensors, as a Dataset yields (x, y)): their type and fields.
    structure: list[Any] = []
    fields_of: dict[int, list[Any]] = {}  # per iterable of samples, its fields' values
    for it in iterables:
        if isinstance(it, torch.Tensor):
            if not it.ndim:
                return _MISS
            metas.append(_meta(it.shape[1:], it.dtype, it.device))
            structure.append(None)
            continue
        row = _same_rows(it)
        if row is not None:
            metas.append(_meta(row.shape, row.dtype, row.device))
            structure.append(None)
            continue
        kind = _number_rows(it)
        if kind is not None:  # (a list of labels: numbers per row, see values.RowNumber)
            metas.append(_number_meta(kind))
            structure.append(kind)
            continue
        found = _sample_fields(it)
        if found is None:
            return _MISS
        fields, columns = found
        structure.append(fields)
        fields_of[len(structure) - 1] = columns
        metas += [
            _meta(c[0].shape, c[0].dtype, c[0].device) if kind is None else _number_meta(kind)
            for c, kind in zip(columns, fields[2])
        ]
    if all(type(fields) is type for fields in structure):
        return _MISS  # (numbers alone, no tensor: per example, where each is a number)
    n = min(len(t) for t in iterables)
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    key = (id(fn) if code is None else code, *metas, *structure)
    if n == 0 or key in _UNTRACEABLE:
        return _MISS
    inputs = []
    for j, (t, fields) in enumerate(zip(iterables, structure)):
        if fields is not None:  # numbers, one per row; or each field's values
            columns = [(t, fields)] if type(fields) is type else zip(fields_of[j], fields[2])
            for column, kind in columns:
                column = column[:n]
                stacked = _stacked(column) if kind is None else _stacked_numbers(column, kind)
                if stacked is None:
                    return _MISS
                inputs.append(stacked)
            continue
        if not isinstance(t, torch.Tensor):
            t = _stacked(t if len(t) == n else t[:n])
            if t is None:
                return _MISS
        inputs.append(t if len(t) == n else t[:n])
    if any(fields is not None for fields in structure):
        fn = _with_samples(fn, structure)
    # First without autobatch's wrapper over nn.Module.__call__ (installing it costs ~50 us
    # and the method caches of every module class): module calls record as the torch calls
    # their forward makes.  Where one of those has no direct form (it would run under vmap:
    # an nn.LSTM's _VF.lstm, an op without a batching rule), the function is recorded again
    # with module calls as one call each, and is remembered for the next calls.
    modules = key in _WITH_MODULES
    try:
        out, spec = _rows_run(fn, metas, modules, key, inputs, n, [], [_paths(n)])
    except Exception as err:
        return _untraceable(key, "recording or running", err)
    return out[0] if spec is _LEAF_SPEC else pytree.tree_unflatten(out, spec)


def _paths(n: int) -> int:
    """How many groups of rows, in all, a function recorded once for ``n`` rows may be
    recorded again for where its reads' rows disagree (see ``_partitioned``), before the
    examples are recorded one by one instead (each recording costs about what one example's
    costs)."""
    return max(2, n // 2)


def _rows_run(
    fn: Callable[..., Any],
    metas: list[_Meta],
    modules: bool,
    key: tuple[Any, ...],
    inputs: list[torch.Tensor],
    n: int,
    answers: list[Any],
    budget: list[int],
    prefix: tuple[list[Any], list[Any]] | None = None,
) -> tuple[list[Any], Any]:
    """``fn`` recorded once for the ``n`` rows of ``inputs`` and run: its results for all
    rows, flat, and their structure.  Its reads run what is recorded so far (see
    ``_Lockstep``; ``answers``: the values of the reads made before, every row's alike;
    ``prefix``: the calls run before them, for more rows); where the rows of a read
    disagree, ``_partitioned``.

    First without autobatch's wrapper over nn.Module.__call__ (installing it costs ~50 us and
    the method caches of every module class): module calls record as the torch calls their
    forward makes.  Where one of those has no direct form (it would run under vmap: an
    nn.LSTM's _VF.lstm, an op without a batching rule), the function is recorded again with
    module calls as one call each, and is remembered for the next calls."""
    pool = (key, modules) if prefix is None else None  # (see _TRACES)
    try:
        rec, trace, out = _record_once(fn, metas, modules, (inputs, n, list(answers), prefix), pool)
        if not modules and any(c[0].mode is _VMAP and c[0].kind == "torch" for c in trace.calls):
            if len(_WITH_MODULES) >= _UNTRACEABLE_MAX:
                _WITH_MODULES.clear()
            _WITH_MODULES.add(key)
            if prefix is None and not rec.lockstep.reads:  # (else calls ran: kept as they are)
                modules, pool = True, None  # (the first trace not kept)
                rec, trace, out = _record_once(fn, metas, True, (inputs, n, []))
    except _Diverged as diverged:
        return _partitioned(fn, metas, modules, key, inputs, diverged, budget)
    leaves, spec = _flatten(out)
    rec.check_aliases()  # (recording per example then names the example)
    # (the scope of @batchable programs only where one runs: it costs a few us a call)
    programs = any(c[0].kind is _PER_EXAMPLE for c in trace.calls)
    with _call_programs() if programs else contextlib.nullcontext():
        values = rec.lockstep.run(True)
    out = [_trace_output(v, values, n, rec) for v in leaves]
    if pool is not None:
        _give_trace(pool, trace)
    return out, spec


def _partitioned(
    fn: Callable[..., Any],
    metas: list[_Meta],
    modules: bool,
    key: tuple[Any, ...],
    inputs: list[torch.Tensor],
    diverged: _Diverged,
    budget: list[int],
) -> tuple[list[Any], Any]:
    """The results of ``fn`` for rows whose read disagreed: recorded and run again for each
    group of rows that read one value (their rows of the inputs), the groups' results put
    back in the rows' order.  ``_Untraceable`` where the groups would pass ``budget`` (see
    ``_paths``), or return results of different structures or shapes (stack=True: recorded
    per example, the error names the example)."""
    groups = diverged.groups
    budget[0] -= len(groups)
    if budget[0] < 0:
        raise _Untraceable("its reads split the rows into too many groups")
    device = inputs[0].device
    parts = []
    # (installed once for the groups' recordings, each of which would install it again)
    with _installed() if modules else contextlib.nullcontext():
        for row, members in groups:
            index = torch.tensor(members, device=device)
            # The group's rows of every value made so far, its inputs first.
            values = [None if v is None else v.index_select(0, index) for v in diverged.values]
            sub = values[: len(inputs)]
            answers = [*diverged.answers, row]
            prefix = (diverged.calls, values)
            parts.append(
                _rows_run(fn, metas, modules, key, sub, len(members), answers, budget, prefix)
            )
    spec = parts[0][1]
    if any(p[1] != spec for p in parts):
        raise _Untraceable("groups of rows returned results of different structures")
    order = torch.tensor([i for _, members in groups for i in members])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    out: list[Any] = []
    for j, first in enumerate(parts[0][0]):
        column = [p[0][j] for p in parts]
        if first is None:
            if any(c is not None for c in column):
                raise _Untraceable("groups of rows returned None and tensors")
            out.append(None)
            continue
        if any(
            c is None or c.shape[1:] != first.shape[1:] or c.dtype != first.dtype for c in column
        ):
            raise _Untraceable("groups of rows returned results of different shapes")
        out.append(torch.cat(column).index_select(0, inverse.to(first.device)))
    return out, spec


def _sample_fields(items: Any) -> tuple[tuple[type, Any, tuple[Any, ...]], list[Any]] | None:
    """The structure of a Dataset's samples, where each is a tuple (or list) or a dict of
    tensors and Python numbers (a label: ``(image, 3)``) and all are alike (their lengths or
    keys, each field's dtype, or its numbers' type): ``((their type, their length or keys,
    per field None for tensors or the numbers' type), per field its values)``; None else.
    Their shapes are checked by the ``torch.stack`` of each field (``_stacked``)."""
    if type(items) not in (list, tuple) or not items:
        return None
    first = items[0]
    t = type(first)
    if t is dict:
        keys: Any = tuple(first)
        for sample in items:
            if type(sample) is not dict or tuple(sample) != keys:
                return None
        columns: list[Any] = [[sample[k] for sample in items] for k in keys]
    elif t in (tuple, list):
        keys = len(first)
        for sample in items:
            if type(sample) is not t or len(sample) != keys:
                return None
        columns = list(zip(*items))
    else:
        return None
    if not columns:
        return None
    numbers: list[Any] = []
    for column in columns:
        if _same_rows(column) is not None:  # tensors of one dtype
            numbers.append(None)
            continue
        kind = _number_rows(column)  # numbers of one type
        if kind is None:
            return None
        numbers.append(kind)
    if None not in numbers:
        return None  # (numbers alone: no tensor to batch)
    return (t, keys, tuple(numbers)), columns


# The dtype of the rows of a number per row (``values.RowNumber``), by the numbers' type:
# floats as float64, the bits of each Python float (torch.tensor of one, in the function,
# converts to the default dtype as eager code's does).
_ROW_NUMBER_DTYPES: dict[type, torch.dtype] = {
    int: torch.long,
    bool: torch.bool,
    float: torch.float64,
}
_CPU = torch.device("cpu")


def _number_meta(kind: type) -> _Meta:
    """The meta of the rows of a number per row of Python type ``kind``."""
    return _meta((), _ROW_NUMBER_DTYPES[kind], _CPU)


def _number_rows(items: Any) -> type | None:
    """The type of a list or tuple of Python numbers of one type (int, float or bool: a
    Dataset's labels given beside the samples), else None."""
    if type(items) not in (list, tuple) or not items:
        return None
    kind = type(items[0])
    if kind not in _ROW_NUMBER_DTYPES:
        return None
    for x in items:
        if type(x) is not kind:
            return None
    return kind


def _stacked_numbers(column: Any, kind: type) -> torch.Tensor | None:
    """Python numbers of one type as one tensor (``_ROW_NUMBER_DTYPES``), None where torch
    cannot hold them (an int beyond int64)."""
    try:
        return torch.tensor(list(column), dtype=_ROW_NUMBER_DTYPES[kind])
    except (OverflowError, RuntimeError):
        return None


def _with_samples(fn: Callable[..., Any], structure: list[Any]) -> Callable[..., Any]:
    """``fn`` taking each iterable's values as its rows: one per iterable of rows, and for an
    iterable of samples (tuples or dicts of tensors) one per field, given to ``fn`` as the
    sample they stand for (``(x, y)`` of lazy rows)."""

    def call(*leaves: Any) -> Any:
        args: list[Any] = []
        i = 0
        for fields in structure:
            if fields is None:
                args.append(leaves[i])
                i += 1
                continue
            if type(fields) is type:  # a list of numbers: a number per row
                args.append(RowNumber(leaves[i], fields))
                i += 1
                continue
            t, keys, numbers = fields
            got = [
                x if kind is None else RowNumber(x, kind)
                for x, kind in zip(leaves[i : i + len(numbers)], numbers)
            ]
            i += len(numbers)
            args.append(dict(zip(keys, got)) if t is dict else t(got))
        return fn(*args)

    # (read by _record_once: torch.tensor's wrapper, for RowNumber, where no other is)
    call.row_numbers = any(  # type: ignore[attr-defined]
        type(f) is type or (f is not None and any(k is not None for k in f[2])) for f in structure
    )

    return call


def _same_rows(items: Any) -> torch.Tensor | None:
    """The first of a list or tuple of tensors of one dtype (what a Dataset's samples are),
    else None; their shapes and devices are checked by the ``torch.stack`` that makes them
    one tensor (``_stacked``).  Such a list carries what a tensor's rows carry for
    ``_traced``: the function can tell its examples apart only by values it cannot read, so
    the rows are recorded once; a function that cannot be recorded so gets the list's own
    tensors per example."""
    if type(items) not in (list, tuple) or not items:
        return None
    first = items[0]
    if type(first) is not torch.Tensor:
        return None
    dtype = first.dtype
    for t in items:
        if type(t) is not torch.Tensor or t.dtype is not dtype:
            return None
    return first


def _stacked(items: Any) -> torch.Tensor | None:
    """``torch.stack(items)``, None where their shapes or devices differ."""
    try:
        return torch.stack(items)
    except RuntimeError:
        return None


def _untraceable(key: tuple[Any, ...], stage: str, err: Exception) -> Any:
    if len(_UNTRACEABLE) >= _UNTRACEABLE_MAX:
        _UNTRACEABLE.clear()
    _UNTRACEABLE.add(key)
    _LOG.debug(
        "autobatch: %s %s on lazy rows failed (%s: %s); recording per example",
        key[0],
        stage,
        type(err).__name__,
        err,
    )
    return _MISS
