"""The driver: ``autobatch`` and ``record_examples`` (the per-example recording, with the
patches installed), the results stacked through one ``apply``, and the errors that name the
example."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable
from itertools import repeat
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils import _pytree as pytree

from fold._encoding import node_id, split_code
from fold.arrays import handles_array
from fold.autobatch import buffers, running
from fold.autobatch.common import (
    _BATCHED,
    _DIRECT,
    _LOCAL,
    _MISS,
    _MODELS,
    _PER_EXAMPLE,
    _RNN,
    _USUAL_MODE,
    _VMAP,
    HOOKS,
    _any_autocast,
    _current_mode,
    _in_mode,
    _rng_restore,
    _rng_states,
    pool_room,
    pool_take,
)
from fold.autobatch.ops import _Op, _op_device, _OpFailed, forget_combinations
from fold.autobatch.patches import _PLAIN, _installed
from fold.autobatch.recorder import (
    _INLINE,
    _KW_PARTS,
    _MODE_OPS,
    _OPS,
    _PADDED_OPS,
    _SEQUENCE_OPS,
    _SIZED_BY_DATA,
    _WHOLE,
    _Recorder,
    unguard,
)
from fold.autobatch.traced import (
    _LEAF_SPEC,
    _UNTRACEABLE,
    _WITH_MODULES,
    _call_programs,
    _flatten,
    _traced,
    forget_traces,
)
from fold.autobatch.values import _METAS, _ROWS, Lazy, _value_of
from fold.errors import FoldError, FoldOutOfMemoryError, describe
from fold.graph import Fold
from fold.ops import forget_masks
from fold.run import collector_paused, run_groups
from fold.scheduler.auto import facts_of
from fold.scheduler.chain import SignatureNodes


def clear_cache() -> None:
    """Forget every recorded op signature and its inferred shapes (and the modules and
    parameters they hold)."""
    _OPS.clear()
    _MODE_OPS.clear()
    _SEQUENCE_OPS.clear()
    _PADDED_OPS.clear()
    _SIZED_BY_DATA.clear()
    _INLINE.clear()
    _WHOLE.clear()
    _METAS.clear()
    _ROWS.clear()
    _KW_PARTS.clear()
    _UNTRACEABLE.clear()
    _WITH_MODULES.clear()
    forget_traces()
    _PLAIN.clear()
    facts_of(None).forget()  # the row sizes its rounds' ops measured (they key them)
    _POOL.clear()


class _DeviceAnchor(nn.Module):
    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.register_buffer("anchor", torch.empty(0, device=device))


def autobatch(
    fn: Callable[..., Any],
    *iterables: Iterable[Any],
    per_example: bool = False,
    stack: bool = True,
) -> Any:
    """Run ``fn`` once per example (the zip of ``iterables``) with recording on, then the
    recorded graph batched; returns the per-example results stacked along a new dim 0, in
    ``fn``'s output structure (tensor, tuple, list, dict).  See the docstring of
    fold/autobatch/__init__.py.

    Where ``fn`` reads a recorded value (``int(logits.argmax())``, ``if p > 0.5:``), that
    example pauses and the others run on; when all are paused, what was recorded runs as one
    batched round and each resumes with its value (see ``_Session``).  ``stack=False``
    returns a list of the per-example results, whose shapes (and structures) may differ
    (decoded sequences of their own lengths).

    Where every iterable is a tensor (the examples are its rows), ``fn`` is first recorded
    ONCE, on lazy rows standing for all examples, and each recorded call runs once on the
    whole batch (see "One recording for tensor rows" in the docstring of
    fold/autobatch/__init__.py); where that cannot be done (``fn`` reads a row, say) it
    records per example.  ``per_example=True`` always records per example (for a function
    whose per-call side effects matter).

    Records with the cyclic garbage collector paused, as ``Fold.apply`` runs: recording
    makes a few tracked objects per call (Lazy values, tuples), enough to set off full
    collections of the whole heap; they are freed by reference counting.
    """
    if _LOCAL.rec is not None:
        raise FoldError(
            "autobatch: called inside a function autobatch is running. Fix: call the inner "
            "function directly; it is recorded into the same graph."
        )
    # (the running statistics of norms in training: updated in eager order as it returns)
    with running.Updates() as updates:
        if stack and not per_example and iterables:
            updates.traced = True
            out = _traced(fn, iterables)  # installs the patches where it needs them
            updates.traced = False
            if out is not _MISS:
                return out
            updates.entries.clear()  # (a recording that gave way: recorded again below)
        # The collector stays paused until the call's own objects (every round's values,
        # by node) are freed: a collection started inside it would walk them all (1.4 ms a
        # call on the decoder of benchmarks/control_flow.py, every call).
        with collector_paused():
            with _installed():
                rec, results, specs = _record(fn, iterables, stack, pooled=True)
                if stack:
                    out = pytree.tree_unflatten(_stack(rec, results), specs[0])
                else:
                    out = _unstacked(rec, results, specs)
            _give_back(fn, rec)
            del rec, results, specs
    return out


# Folds of finished autobatch calls, each with its fast tables (see _Session.run_round), for
# the next call of the same function: the first call of an op in a new Fold makes the op's
# fast key and specialises the Fold's recorder (about 12 us a call, 150 calls of a decoder's
# first round over 24 source lengths); a kept Fold starts from all of that.  Kept per
# function (its code: a lambda made afresh per call is the same function), so that a Fold
# holds the signatures of one function's ops only (a renewed Fold's snapshot walks them
# all), at most _POOL_MAX per function and _POOL_FUNCTIONS functions; each emptied
# (``Fold._renew``) before it is kept.  Only a call that returned gives its Fold back, and a
# Fold or tables grown past _POOL_LIMIT are dropped instead.  What they hold (ops, modules,
# metas) is what ``_OPS`` holds; ``clear_cache`` empties the pool.
_POOL: dict[Any, list[tuple[Any, tuple[dict[Any, Any], ...]]]] = {}
_POOL_MAX = 2
_POOL_FUNCTIONS = 16
_POOL_LIMIT = 4096


def _pool_key(fn: Any) -> Any:
    return getattr(fn, "__code__", fn)


def _take_pooled(fn: Any) -> tuple[Any, tuple[dict[Any, Any], ...]] | None:
    return pool_take(_POOL, _pool_key(fn))


def _forget_pools() -> None:
    _POOL.clear()
    forget_traces()


HOOKS.forget_pools = _forget_pools


def _give_back(fn: Any, rec: _Recorder) -> None:
    """Keep the call's Fold and fast tables for the next call of ``fn`` (see ``_POOL``)."""
    kept, f = rec.kept, rec.fold
    if kept is None or type(f) is not Fold:
        return
    if len(f.signatures) > _POOL_LIMIT or sum(map(len, kept)) > _POOL_LIMIT:
        return
    folds = pool_room(_POOL, _pool_key(fn), _POOL_FUNCTIONS, _POOL_MAX)
    if folds is None:
        return
    rec.kept = rec.fold = None
    f._renew()
    folds.append((f, kept))


def _unstacked(rec: _Recorder, results: list[list[Any]], specs: list[Any]) -> list[Any]:
    """The per-example results as a list: the last round run too, each lazy value its row."""
    if len(rec.fold):
        rec.values = _materialize(rec)
    out = []
    for leaves, spec in zip(results, specs):
        if spec is _LEAF_SPEC:  # one tensor (a decoded sequence, a parse's heads)
            out.append(_row_or_lazy(leaves[0], None))
        else:
            out.append(pytree.tree_unflatten([_row_or_lazy(v, None) for v in leaves], spec))
    return out


class _Session:
    """The rounds of one autobatch call (data-dependent control flow).

    Each example runs as a greenlet (a coroutine of its own stack, so the user's Python stays
    plain Python).  A read of a lazy value whose round has not run (``bool``, ``int``,
    ``.item()``, ``if t:``) switches back here: the example pauses, and the next one runs.
    When every unfinished example is paused, the graph recorded since the last round runs
    as one batched round (``run_round``), and every paused example resumes with its value.
    So there are at most as many rounds as the most reads any one example makes.  Each round
    records a graph of its own (into the call's one Fold, emptied between rounds with its
    recorders kept: ``run_round``); values of earlier rounds enter later ones as literal rows
    of their outputs, so no round runs an earlier round's nodes again and gradients flow back
    across rounds.

    Where a round's groups held fewer than ``EAGER_GROUP`` nodes on average (few examples
    left, or examples whose shapes split every op into groups of their own: memories of
    different lengths), batching no longer pays for a round's fixed cost: the examples still
    paused then finish one after another as eager code (``eager``), each torch call run at
    once on the rows of earlier rounds.  Values and gradients are the same."""

    def __init__(self, fn: Any = None) -> None:
        # The modules the rounds' calls read, as recorder.note_state finds them, and the
        # classes of theirs guarded while the call runs (shared by the rounds' recorders,
        # made below; see recorder._guard_class).
        self.structures: dict[int, Any] = {}
        self.guarded: dict[type, Any] = {}
        # The grad mode the call began in: where it was off, no value the examples make
        # needs a gradient, unless one turns it on (buffers.write_lazy reads it).
        self.grad = torch.is_grad_enabled()
        # The seed of torch's generator as the call began (see _Recorder._seeded).
        self.seed = torch.initial_seed()
        # A Fold and fast tables kept from an earlier call of ``fn`` (see _POOL; None: a new
        # Fold): taken here, and given back by ``autobatch`` once its results are out
        # (``tables`` keeps the fast tables of the last round that recorded, where the
        # examples finished eagerly).
        self.tables: tuple[dict[Any, Any], ...] | None = None
        kept = _take_pooled(fn) if fn is not None else None
        if kept is None:
            self.current: _Recorder | None = _Recorder(session=self)
        else:
            f, tables = kept
            rec = self.current = _Recorder(session=self, fold=f)
            rec._fast, rec._fast_nograd, rec._recorders = tables
        self.running: Any = None  # the example greenlet running now
        self.rounds = 0
        self.eager = False  # the paused examples finish as eager code (see above)
        self.devices: dict[_Op, torch.device | None] = {}  # per op, see _device
        # Literal columns of padded rows the rounds made (a decoder's memories, read by every
        # step; ``fold.ops.padded_rows_of``), for the later rounds that read them again.
        self.columns: dict[Any, Any] = {}
        # Inference mode and autocast as the call found them: a read must find them so (see
        # pause).
        self.inference = torch.is_inference_mode_enabled()
        self.casts = _current_mode()[1] if _any_autocast() else ()
        # Methods of earlier rounds' values run at once, made once per value, method and
        # arguments (values._memoised): key -> the lazy value of the result.
        self.memo: dict[Any, Any] = {}
        # Tensors the examples made by a wrapped factory (id -> (a weak reference, the
        # example)), and the written buffers among them (id -> [the tensor, the value it
        # holds, the example]): see fold/autobatch/buffers.py.
        self.made: dict[int, tuple[Any, int]] = {}
        # (those made under inference mode by the address of their memory: their views keep
        # no base, see buffers._base_of)
        self.memories: dict[int, Any] = {}
        self.written: dict[int, list[Any]] = {}
        self.parts: dict[Any, Any] = {}  # (the parts views of them read: buffers.held)
        self.views: dict[Any, Any] = {}  # (the views made of them: buffers._views)

    def records(self) -> bool:
        """Whether the current round records (a value of an earlier round may be used)."""
        return self.current is not None and not self.current.closed

    def pause(self, x: Lazy) -> bool:
        """Pause the running example at a read of ``x`` until its round has run; False
        where no example runs as a coroutine (the read is an error then)."""
        me = self.running
        if me is None or _greenlet is None or _greenlet.getcurrent() is not me:
            return False
        if x.rec is not self.current:
            return False
        # Torch's grad mode is the thread's, not the coroutine's: an example that reads
        # inside ``with torch.no_grad():`` pauses with gradients off, and the rounds and the
        # other examples must not run so (they would record, and gather, without gradients).
        # The driver restores its own mode when the example pauses (_resume), and the
        # example gets its mode back here when it resumes.
        grad = torch.is_grad_enabled()
        if torch.is_inference_mode_enabled() is not self.inference or (
            _current_mode()[1] != self.casts if self.casts else _any_autocast()
        ):
            raise FoldError(
                f"autobatch: example {x.rec.example}: a read (bool, int, float, .item(), "
                "`if t:`) inside a torch.inference_mode() or torch.autocast() region that the "
                "function opened itself. Reads pause the example while the others run, and "
                "those modes belong to the thread, not to one example. Fix: read after the "
                "region ends, or open it around the autobatch call."
            )
        me.parent.switch(x.rec.example)  # the example paused; back here after its round
        if torch.is_grad_enabled() is not grad:
            torch._C._set_grad_enabled(grad)
        return True

    def run_round(self) -> None:
        """Run what the current round recorded; its values kept by node; a new round."""
        rec = self.current
        outer, _LOCAL.rec = _LOCAL.rec, None  # the round runs the calls: nothing records
        try:
            rec.values = _materialize(rec)
        finally:
            _LOCAL.rec = outer
        self.rounds += 1
        f = rec.fold
        # Calls, not groups: a padded call's parts (memories of several lengths) are listed
        # one by one in the report but ran as one call.
        groups = len({(step, name) for step, name, *_ in f.last_run or ()})
        if groups and len(f) < EAGER_GROUP * groups:
            self.eager = True
        # The next round records into the same Fold, emptied with its recorders kept, and
        # starts from this round's fast tables and op recorders: a step records the calls
        # of the step before, and the entries hold the Fold's recorders (a value of this
        # round is a literal row in the next, filed apart from a node by the C fast key).
        fast, nograd, recorders = rec._fast, rec._fast_nograd, rec._recorders
        rec._fast, rec._fast_nograd, rec._recorders = {}, {}, {}
        rec.close()
        f._renew()
        rec.fold = None  # its graph is the next round's now; its values are its own
        nxt = _Recorder(session=self, fold=f)
        if not self.eager:  # (eager, every call must miss the tables and run at once)
            nxt._fast, nxt._fast_nograd, nxt._recorders = fast, nograd, recorders
        elif self.tables is None:  # the last tables that recorded, for the next call (_POOL)
            self.tables = (fast, nograd, recorders)
        nxt.device = rec.device
        self.current = nxt


try:  # the coroutines of data-dependent control flow
    import greenlet as _greenlet_module

    _greenlet: Any = _greenlet_module
except ImportError:  # pragma: no cover  (a dependency; without it reads stay errors)
    _greenlet = None


# The average group size of a round below which the examples still paused finish as eager
# code: a group's fixed cost (its gathers, the op's dispatch, the executor's bookkeeping) is
# about what that many eager calls of its op on one example cost beyond recording them.
# Re-timed on 2026-11-26 (a ninth session), after attention's matrix-vector products took
# torch's fast kernel: 8 against 24, four interleaved runs of 9-15 calls each, one thread,
# medians: the parser 0.92-0.96, decode-long 0.94-1.00, decode-limit 0.97-0.99, the biased
# decode 1.00-1.03; 0 (every round batched) made the biased decode 1.38x slower, its last
# rounds a handful of examples.  A padded call over values of several lengths counts as
# one group.
EAGER_GROUP = 8


def _materialize(rec: _Recorder) -> dict[Any, tuple[torch.Tensor, int]]:
    """Every output of every node the round recorded, by handle: (the output of the group
    that computed it, its row there), read where it lies (no gather)."""
    f = rec.fold
    if not len(f):
        return {}
    rec.check_aliases()
    updates = running.active()
    if updates is not None:  # (whose nodes run: their examples, see running.Updates)
        updates.rec = rec
    device = _device(rec)
    obj = _DeviceAnchor(device) if device is not None and device.type != "cpu" else None
    try:
        with _call_programs(), _grad_for(f):
            groups = run_groups(f, obj, rec.session.columns if rec.session is not None else None)
    except FoldError as err:
        cause = err.__cause__
        if isinstance(cause, _OpFailed):
            raise _explained(
                err, _failing_example(cause, getattr(err, "members", None), rec)
            ) from (cause.__cause__)
        raise
    arrays = f.snapshot()
    handle = None  # node id -> its whole handle, where a group names its rows by node id
    out: dict[Any, tuple[torch.Tensor, int]] = {}
    for sid, outs, members, starts in groups:
        op = arrays.signatures[sid][0]
        if type(members) is SignatureNodes:  # every node of the signature, in order
            hs = arrays.handles(sid)
        else:
            if handle is None:
                handle = np.zeros(arrays.n, np.int64)
                for s in range(len(arrays.signatures)):
                    h = handles_array(arrays.handles(s))
                    handle[node_id(h)] = h
            hs = handle[members].tolist()
        if type(op) is _Op and not op.single:  # its outputs are read through split handles
            code = split_code(len(outs))
            for j, t in enumerate(outs):
                c = code | j
                first = 0 if starts is None else starts[j]
                rows = range(first, first + len(hs))
                out.update(zip([h | c for h in hs], zip(repeat(t), rows)))
        else:
            first = 0 if starts is None else starts[0]
            out.update(zip(hs, zip(repeat(outs[0]), range(first, first + len(hs)))))
    return out


def record_examples(fn: Callable[..., Any], *iterables: Iterable[Any]) -> tuple[Any, ...]:
    """The recording half of :func:`autobatch`: ``(recorder, per-example flat results,
    their structure)``; ``recorder.fold`` is the graph of the last round (of the only one
    where ``fn`` reads no value).  For benchmarks and inspection."""
    rec, results, specs = _record(fn, iterables, True)
    return rec, results, specs[0]


def _record(
    fn: Callable[..., Any], iterables: tuple[Any, ...], stack: bool, pooled: bool = False
) -> tuple[_Recorder, list[list[Any]], list[Any]]:
    """Every example recorded, each a coroutine paused at its reads while rounds run (see
    ``_Session``): ``(the last round's recorder, per-example flat results, per-example
    structures)``; with ``stack``, every example's structure is example 0's.  With
    ``pooled``, the call records into a Fold kept from an earlier call (see ``_POOL``), and
    the last recorder's ``kept`` holds the fast tables to give back with its Fold."""
    session = _Session(fn if pooled else None)
    rec = session.current
    updates = running.active()
    if updates is not None:
        updates.session = session
    results: list[Any] = []
    specs: list[Any] = []
    _LOCAL.rec = rec
    installed = _installed()
    installed.__enter__()
    runs: list[Any] = []
    try:
        iterables = tuple(
            rec.rows(it) if isinstance(it, torch.Tensor) and it.ndim else it for it in iterables
        )
        with collector_paused():
            examples = enumerate(zip(*iterables))
            if _greenlet is None:  # no coroutines: a read is an error
                for i, example in examples:
                    results.append(None)
                    specs.append(None)
                    rec.start_example(i)
                    _finished(_example(fn, example, i)(), i, results, specs)
            else:
                # One coroutine runs the examples one after another until one reads: it
                # stays paused with that example, and a new one goes on with the next (so a
                # function that never reads costs one coroutine, not one per example).
                def work() -> Any:
                    for i, example in examples:
                        results.append(None)
                        specs.append(None)
                        session.current.start_example(i)
                        _finished(_example(fn, example, i)(), i, results, specs)
                    return None

                paused: dict[int, Any] = {}
                while True:
                    g = _greenlet.greenlet(work)
                    runs.append(g)
                    i = _resume(session, g)
                    if i is None:
                        break
                    paused[i] = g
                while paused:
                    session.run_round()
                    for i, g in list(paused.items()):
                        session.current.start_example(i)
                        if _resume(session, g) is None:
                            del paused[i]
    except BaseException:
        # End the other examples' coroutines: nothing recorded outlives the call.  What one
        # raises while it ends is dropped: the error to raise is the first.  (An example
        # paused inside torch's C code may not end cleanly: torch's argument parser takes the
        # exit for "not an index" and goes on, and the example then fails to read.)  Each
        # ends in the driver's grad mode, as it would have resumed.  Nothing records while
        # they end (a lazy value used is a FoldError at once): recording may run torch
        # calls that fail by design (shape inference on zeros), and a C++ error raised in an
        # example resumed from here, inside torch's C code, can crash the process.
        _LOCAL.rec = None
        grad = torch.is_grad_enabled()
        for g in runs:
            if not g.dead:
                try:
                    g.throw(_greenlet.GreenletExit)
                except BaseException:
                    pass
                if torch.is_grad_enabled() is not grad:
                    torch._C._set_grad_enabled(grad)
        raise
    else:
        rec = session.current
        if pooled:  # the tables outlive this recorder (close empties its own)
            kept = session.tables or (rec._fast, rec._fast_nograd, rec._recorders)
            rec._fast, rec._fast_nograd, rec._recorders = {}, {}, {}
            rec.kept = kept
    finally:
        _LOCAL.rec = None
        session.running = None
        rec = session.current
        rec.close()
        # The session and its recorders refer to each other: no cycle left for the collector.
        session.current = None
        session.columns.clear()
        session.memo.clear()
        buffers.restore(session)
        forget_masks()
        forget_combinations()
        unguard(session.guarded)  # (see recorder._guard_class)
        installed.__exit__(None, None, None)
    if not results:
        raise FoldError("autobatch: no examples (the iterables are empty). Fix: pass at least one.")
    if stack:
        _check_structures(specs)
    if session.rounds:  # values of earlier rounds: their rows
        results = [[_row_or_lazy(v, rec) for v in leaves] for leaves in results]
    return rec, results, specs


def _example(fn: Callable[..., Any], example: tuple[Any, ...], i: int) -> Callable[[], Any]:
    def run() -> Any:
        try:
            return fn(*example)
        except (TypeError, ValueError, RuntimeError) as err:
            explained = _misuse(err, i)
            if explained is err:
                _name_example(err, i)
                raise
            raise explained from err
        except Exception as err:
            _name_example(err, i)
            raise

    return run


def _name_example(err: BaseException, i: int) -> None:
    """An exception of the user's code propagates from autobatch as it was raised, with a
    note naming the example that raised it (Python 3.11's ``add_note``: shown under the
    traceback), unless its message names the example already (fold's own errors)."""
    if hasattr(err, "add_note") and not re.search(rf"\bexample {i}\b", str(err)):
        err.add_note(f"autobatch: raised while running example {i}")


def _resume(session: _Session, g: Any) -> int | None:
    """Run coroutine ``g`` until it pauses at a read (the example's index) or ends (None)."""
    _LOCAL.rec = session.current
    session.running = g
    grad = torch.is_grad_enabled()
    try:
        out = g.switch()
    finally:
        session.running = None
        if torch.is_grad_enabled() is not grad:  # (the example paused with it changed)
            torch._C._set_grad_enabled(grad)
    return None if g.dead else out


def _finished(result: Any, i: int, results: list[Any], specs: list[Any]) -> None:
    """Example ``i``'s result, flat (a written buffer the value it holds), and its
    structure."""
    leaves, specs[i] = _flatten(result)
    for v in leaves:
        if type(v) not in _PLAIN_LEAVES and not isinstance(v, torch.Tensor):
            _check_opaque(v, i)
    rec = _LOCAL.rec
    results[i] = leaves if rec is None or rec.session is None else buffers.results_held(leaves, rec)


# Result leaves that hold no lazy value inside them (or are one).
_PLAIN_LEAVES = frozenset((Lazy, int, float, bool, str, bytes, type(None), complex))


def _check_opaque(v: Any, i: int) -> None:
    """A FoldError where result leaf ``v``, an object torch's pytree does not look into (a
    dataclass, an object of one's own), holds lazy values among its attributes: they would
    leave the call as lazy values, not as their rows (the first use a FoldError far from
    here)."""
    fields = getattr(v, "__dict__", None)
    if type(fields) is not dict:
        return
    inside = pytree.tree_leaves(list(fields.values()))
    if any(type(x) is Lazy for x in inside):
        name = type(v).__name__
        raise FoldError(
            f"autobatch: example {i} returned an object of type {name} holding lazy values "
            f"among its attributes, which autobatch cannot look into (torch's pytree does not "
            f"know the class), so they would leave the call uncomputed. Fix: return a tuple, "
            f"list, dict or namedtuple of them, or register the class with torch's pytree "
            f"(torch.utils._pytree.register_dataclass({name}) for a dataclass)."
        )


def _check_structures(specs: list[Any]) -> None:
    first = specs[0]
    for i, s in enumerate(specs):
        if s is not first and s != first:
            raise FoldError(
                f"autobatch: example {i} returned a structure {s} but example 0 returned "
                f"{first}; results are stacked per position, so every example must return "
                "the same structure. Fix: return one structure, or pass stack=False."
            )


def _row_or_lazy(v: Any, rec: _Recorder | None) -> Any:
    """A result leaf: a lazy value of an earlier round (of any, with ``None``) as its
    computed row."""
    if type(v) is Lazy and v.rec is not rec:
        value = _value_of(v)
        if value is not None:
            return value
    return v


def _misuse(err: Exception, i: int) -> Exception:
    """A FoldError for what torch raises where it meets a lazy value it cannot take
    (``err`` itself for any other error): an unbound tensor method, or ``torch.func.vmap``
    or another torch.func transform given a lazy value inside the per-example function."""
    text = str(err)
    if isinstance(err, FoldError) or "Lazy" not in text:
        return err
    if re.search(
        r"\b(grad_and_value|vjp|jvp|jacrev|jacfwd|hessian|linearize|transform API)\b", text
    ):
        fix = (
            "a torch.func transform (torch.func.grad, vjp, jacrev, ...) was given, or its "
            "function returned, a lazy value the function computed in this round; the "
            "transform runs its function at once, on tensors. Fix: compute the value inside "
            "the transformed function from its inputs, or read a value before the transform "
            "starts (after float(v.sum()), what was computed before it is a tensor)."
        )
    elif "vmap" in text:
        fix = (
            "torch.func.vmap (or torch.vmap) inside the function autobatch runs: autobatch "
            "already batches it. Fix: call the vmapped function on the example's values "
            "directly, or loop over them."
        )
    elif "descriptor" in text:
        fix = (
            "an unbound tensor method (torch.Tensor.add(x, 1)) was called on a lazy value, "
            "which is not a torch.Tensor. Fix: call it as a method (x.add(1)) or as a torch "
            "function (torch.add(x, 1))."
        )
    else:
        fix = (
            "a lazy value reached code that takes only torch.Tensor objects. Fix: use torch "
            "functions, tensor methods and operators on it."
        )
    return FoldError(f"autobatch: example {i}: {fix} ({type(err).__name__}: {text})")


def _stack(rec: _Recorder, results: list[list[Any]]) -> list[Any]:
    """Per output position, the examples' values stacked: lazy ones through one apply."""
    columns = list(zip(*results)) if results[0] else []
    lists: list[list[Any]] = []
    where: list[int | None] = []
    out: list[Any] = []
    for j, col in enumerate(columns):
        _check_column(rec, j, col)
        if all(type(v) is Lazy for v in col):
            where.append(len(lists))
            lists.append([v.node for v in col])
            out.append(None)
        elif all(isinstance(v, torch.Tensor) for v in col):
            where.append(None)
            with torch.enable_grad():  # results that carry gradients keep them (_grad_for)
                out.append(torch.stack(col))
        elif all(isinstance(v, (torch.Tensor, Lazy)) for v in col):
            where.append(len(lists))
            lists.append(
                [v.node if type(v) is Lazy else rec.fold.add(_same, v.unsqueeze(0)) for v in col]
            )
            out.append(None)
        elif all(v is None for v in col):
            where.append(None)
            out.append(None)
        elif all(type(v) in (int, float, bool) for v in col):
            where.append(None)
            out.append(torch.tensor(col))
        else:
            bad = next(v for v in col if not isinstance(v, (torch.Tensor, Lazy)))
            raise FoldError(
                f"autobatch: output {j} holds a {type(bad).__name__}; results are stacked, so "
                "they must be tensors (or numbers, or None throughout)."
            )
    if lists:
        rec.check_aliases()
        updates = running.active()
        if updates is not None:  # (whose nodes run: their examples, see running.Updates)
            updates.rec = rec
        device = _device(rec)
        obj = _DeviceAnchor(device) if device is not None and device.type != "cpu" else None
        try:
            with _call_programs(), _grad_for(rec.fold):
                values = rec.fold.apply(obj, lists)
        except FoldError as err:
            cause = err.__cause__
            if isinstance(cause, _OpFailed):  # chained to the user's exception, as apply is
                raise _explained(err) from cause.__cause__
            raise
        for j, w in enumerate(where):
            if w is not None:
                out[j] = values[w]
    return out


def _check_column(rec: _Recorder, j: int, col: tuple[Any, ...]) -> None:
    """Output ``j`` of every example: lazy values of this call, and one shape and dtype
    where they are tensors or lazy values (they are stacked); a FoldError naming the first
    example that differs."""
    first: Any = None
    for i, v in enumerate(col):
        t = type(v)
        if t is Lazy:
            if v.rec is not rec:
                raise FoldError(
                    f"autobatch: example {i} returned (as output {j}) a lazy value of an "
                    "earlier autobatch call, kept beyond it. Its value exists only in that "
                    "call's results. Fix: pass that call's result in as an input."
                )
            shape, dtype = v.meta.shape, v.meta.dtype
        elif isinstance(v, torch.Tensor):
            shape, dtype = v.shape, v.dtype
        else:
            continue
        if first is None:
            first = (i, shape, dtype)
        elif shape != first[1] or dtype != first[2]:
            raise FoldError(
                f"autobatch: example {i} returned {describe(shape, dtype)} as output {j}, "
                f"example {first[0]} {describe(first[1], first[2])}; results are stacked "
                "along a new dim 0, so every example's output must have one shape and dtype. "
                "Fix: pad or reduce to a common shape inside the function."
            )


def _device(rec: _Recorder) -> torch.device | None:
    """Where the graph's literals go: the device of the recorded calls' parameters (of
    modules called, or shared tensors), else of the tensors made per example."""
    # Per op, once per autobatch call (its parameters stay where they are): a module's
    # parameters walked every round cost a parser 20-40 us a round.
    seen = rec.session.devices if rec.session is not None else {}
    for op, _ in rec.fold.signatures:
        if type(op) is _Op:
            device = seen.get(op, _MISS)
            if device is _MISS:
                device = seen[op] = _op_device(op)
            if device is not None:
                return device
    return rec.device


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def _grad_for(f: Fold) -> Any:
    """Gradients on while ``f`` runs where one of its calls was recorded with them on and
    they are off now: the gathers between its groups run in the mode on now, and a call
    recorded inside ``torch.enable_grad()`` in a function that autobatch runs under
    ``torch.no_grad()`` must get its inputs' gradients, as eager code gives them (each call
    runs in the mode it was recorded in, see ``_Op._recorded``)."""
    if torch.is_grad_enabled():
        return contextlib.nullcontext()
    for op, _ in f.signatures:
        mode = op.recorded_in if type(op) is _Op else None
        if mode is None or mode[0]:
            return torch.enable_grad()
    return contextlib.nullcontext()


def _failing_example(cause: _OpFailed, members: Any, rec: _Recorder) -> tuple[int, Any] | None:
    """Where a round's batched call failed: the example whose own call fails, run alone on
    its values (row by row through the group's values, ``members`` their node ids), and
    what it raises; None where no row fails alone (the batched call itself failed), or it
    cannot be told.  Each row runs in the mode the call was recorded in, with the random
    stream and the module's buffers put back after it (an error's path: speed is no
    matter)."""
    op, values = cause.op, cause.values
    if members is None or not values or op.kind is _BATCHED:
        return None
    n = len(members)
    if any(not isinstance(v, torch.Tensor) or v.dim() == 0 or len(v) != n for v in values):
        return None
    state = op.buffers()
    rng = _rng_states()
    try:
        with _in_mode(op.recorded_in or _USUAL_MODE), torch.no_grad():
            with state.kept() if state is not None else contextlib.nullcontext():
                for i in range(n):
                    try:
                        op.per_example(*[v[i] for v in values])
                    except Exception as err:
                        example = rec.example_of(int(members[i]))
                        return None if example is None else (example, err)
    finally:
        _rng_restore(rng)
    return None


def _explained(err: FoldError, failing: tuple[int, Any] | None = None) -> FoldError:
    cause = err.__cause__
    if not isinstance(cause, _OpFailed):
        return err
    op, orig = cause.op, cause.__cause__
    if isinstance(orig, FoldError):  # (fold's own, which names the op and the fix)
        return FoldError(str(orig))
    shapes = ", ".join(
        describe(v.shape, v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__
        for v in cause.values
    )
    how = {
        _DIRECT: "directly on the stacked values",
        _VMAP: "under torch.func.vmap",
        _BATCHED: "directly (batched=True)",
        _MODELS: "with the models' rows merged",
        _RNN: "as one batch of sequences",
    }[op.mode]
    if op.mode is _VMAP:
        how = "under torch.func.vmap, then one call per example"
    fix = (
        "run the function eagerly on one example (outside autobatch) to debug it; under "
        "vmap, per-example code must not read values (.item()) or change tensors in place."
    )
    if op.kind is _PER_EXAMPLE and ".item()" in str(orig):
        fix = (
            "a @fold.batchable body runs batched, so it cannot read a value (bool, int, "
            "float, .item(), `if t:`): use torch.where (both branches, chosen per row), or "
            "read outside the @fold.batchable function, where a read pauses the example."
        )
    out_of_memory = isinstance(orig, torch.OutOfMemoryError)
    if out_of_memory:
        fix = (
            "give autobatch fewer examples per call (the calls of a group run as one batch), "
            "or use an explicit fold.Fold, whose apply takes max_rows= and offload='cpu'."
        )
    n = (
        cause.values[0].shape[0]
        if cause.values and isinstance(cause.values[0], torch.Tensor)
        else "?"
    )
    if failing is not None:
        example, alone = failing
        said = (
            f"autobatch: example {example}: its call of {op.name} (the op first recorded at "
            f"{op.where or '?'}) fails: run alone on its values it raises "
            f"{type(alone).__name__}: {alone}. (It ran in a round's group of {n} calls "
            f"{how}, stacked arguments {shapes}, which raised {type(orig).__name__}: {orig}.) "
            "Fix: the example's own values are at fault: run the function eagerly on example "
            f"{example} to see where they come from."
        )
    else:
        said = (
            f"autobatch: {op.name}, recorded at {op.where or '?'}, failed on a group of {n} "
            f"calls run {how} (stacked arguments {shapes}): {type(orig).__name__}: {orig}. "
            f"Fix: {fix}"
        )
    # Out of memory stays catchable as such (a training loop's handler), as in apply.
    return FoldOutOfMemoryError(said) if out_of_memory else FoldError(said)
