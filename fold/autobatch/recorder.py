"""The recorder of one autobatch call: op keys (the slow path, which alone builds keys and
raises errors), the fast table a call seen before is found in (in C where
``fold/_clazy.c`` is built, else generated Python), shape inference on fake tensors, and
the node recorded into the call's Fold."""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fold._encoding import float_key, node_id
from fold.autobatch import buffers
from fold.autobatch.batchable import _batch_of_one
from fold.autobatch.buffers import _Written
from fold.autobatch.common import (
    _BATCHED,
    _C,
    _CONSTANTS,
    _DIRECT,
    _INPLACE,
    _LOCAL,
    _MISS,
    _MODELS,
    _RNN,
    _VMAP,
    HOOKS,
    _any_autocast,
    _current_mode,
    _fn_name,
    _rng_restore,
    _rng_same,
    _rng_states,
    _source_line,
)
from fold.autobatch.ops import (
    _leaves,
    _Op,
    _Slot,
    _slots,
    _stateless_module,
    _tensors,
    _wrapper,
    vmap_quietly,
)
from fold.autobatch.patches import _PATCH_LOCK, _call_module
from fold.autobatch.tables import (
    _ARG_EXTREMES,
    _DIM_OPS,
    _ELEMENTWISE,
    _GETITEM,
    _GROUP_CALLS,
    _PACKED_RNNS,
    _PADDED,
    _REWRITES,
    _SPLITS,
    _TWO_OUTPUTS,
    _VALUE_ARGS,
    _aligned_elementwise,
    _attention_layout,
    _direct_template,
    _merged_batch_call,
    _module_mode,
    _padded_module,
    _reads,
    _transformer_layout,
)
from fold.autobatch.values import (
    _FOREIGN,
    Known,
    Lazy,
    RowNumber,
    _as_number,
    _eager_value,
    _foreign,
    _inplace_call,
    _integral,
    _is_count,
    _Meta,
    _meta,
    _note_shared,
    _unfilled,
    _value_of,
    in_place_form,
)
from fold.errors import FoldError
from fold.executor import ModelBatched
from fold.graph import Fold, _Counter
from fold.ops import PaddedRows, cut_to, version_of
from fold.ragged import Ragged

# Key markers (tagged tuples in an op key; a bare tuple never appears in one).
_PARAM = "shared tensor"


_BY_ID = "module keyed by identity"
_BY_VALUE = "tensor keyed by value"
# The mode of calls recorded with gradients off and no autocast (see _current_mode).
_NO_GRAD: tuple[Any, ...] = (False, ())


_RAGGED = "list of lazy values"


_KW = "keywords"


def _identity_keyed(m: Any) -> bool:
    """Whether module ``m`` hashes and compares by identity, as nn.Module does.  Keys hold
    such a module itself; any other (a custom ``__eq__``/``__hash__`` that may call two
    modules equal) is keyed by its id, never merged with another, and takes no fast path."""
    t = type(m)
    return t.__hash__ is object.__hash__ and t.__eq__ is object.__eq__


_OPS: dict[Any, _Op] = {}


# The same for calls recorded in another grad/autocast mode (torch.no_grad(), an autocast
# region): other ops, by mode.
_MODE_OPS: dict[tuple[Any, ...], dict[Any, _Op]] = {}


# Keyword arguments that are constants only (numbers, strings, None: _CONSTANTS), as
# F.cross_entropy's defaults: (names, ids of the values) -> (the values, their key part),
# made once (see _Recorder.record).
_KW_PARTS: dict[tuple[Any, ...], tuple[Any, ...]] = {}


_KW_PARTS_MAX = 4096


def _fast_source(k: int) -> str:
    """A fast recorder for calls of ``k`` positional arguments, every one a lazy value of
    the recorder but the first, which may be a module (a batchable method's ``self``, or a
    module's submodule): the op key is the function, the kind, the module and the lazy
    values' metas, looked up in the recorder's ``_fast`` table, filled by ``record``'s slow
    path; ``_MISS`` where the call does not fit or the key is new.  At ``k <= 2`` also a
    0-dim tensor made per example that travels as a number, after a module perhaps
    (``model.embed(torch.tensor(word))``, ``cells.leaf(torch.tensor(word))``), keyed by the
    module and the tensor's dtype and device (see ``_NUMBER_BRANCH``)."""
    names = [f"a{i}" for i in range(k)]
    lazy = " and ".join(f"type({a}) is Lazy and {a}.rec is rec" for a in names[1:]) or "True"
    metas = "".join(f", {a}.meta" for a in names[1:])
    nodes = ", ".join(f"{a}.node" for a in names[1:])
    return (
        "def make(Lazy, Module, MISS):\n"
        "    def fast(rec, fn, kind, args):\n"
        f"        {', '.join(names)}, = args\n"
        f"        if {lazy}:\n"
        "            if type(a0) is Lazy and a0.rec is rec:\n"
        f"                e = rec._fast.get((fn, kind, a0.meta{metas}))\n"
        "                if e is not None:\n"
        f"                    return e[2](e[0](a0.node{', ' if nodes else ''}{nodes}), rec)\n"
        "            elif isinstance(a0, Module):\n"
        f"                e = rec._fast.get((fn, kind, a0{metas}))\n"
        "                if e is not None:\n"
        f"                    return e[2](e[0]({nodes}), rec)\n"
        + _NUMBER_BRANCH.get(k, "")
        + "        return MISS\n"
        "    return fast\n"
    )


# The fast recorders' branch for a 0-dim tensor made per example that travels as a number,
# last: alone (a module call), or after a module (a batchable method's self).
_NUMBER_BRANCH = {
    1: (
        "            elif type(a0) is Known and a0.number:\n"
        "                e = rec._fast.get((fn, kind, Known, a0.meta))\n"
        "                if e is not None:\n"
        "                    return e[2](e[0](a0.value), rec)\n"
        "            elif type(a0) is Tensor and not a0.ndim and not a0.requires_grad:\n"
        "                e = rec._fast.get((fn, kind, a0.dtype, a0.device))\n"
        "                if e is not None:\n"
        "                    return e[2](e[0](a0.item()), rec)\n"
    ),
    2: (
        "        elif type(a1) is Known and a1.number and isinstance(a0, Module):\n"
        "            e = rec._fast.get((fn, kind, a0, Known, a1.meta))\n"
        "            if e is not None:\n"
        "                return e[2](e[0](a1.value), rec)\n"
        "        elif type(a1) is Tensor and isinstance(a0, Module):\n"
        "            if not a1.ndim and not a1.requires_grad:\n"
        "                e = rec._fast.get((fn, kind, a0, a1.dtype, a1.device))\n"
        "                if e is not None:\n"
        "                    return e[2](e[0](a1.item()), rec)\n"
    ),
}


def _make_fast(k: int) -> Callable[..., Any]:
    env: dict[str, Any] = {"Tensor": torch.Tensor, "Known": Known}
    exec(compile(_fast_source(k), f"<autobatch fast recorder {k}>", "exec"), env)
    return env["make"](Lazy, nn.Module, _MISS)


def _entry(op: _Op, r: Callable[..., Any]) -> tuple[Any, ...]:
    """A ``_fast`` table entry: (the op's recorder, its outputs' metas as the C path makes
    them: one meta, a tuple of them for a flat tuple, or None, wrap).  An op whose outputs
    share memory with its arguments (``_Op.aliases``) logs each call's outputs and
    arguments in the recorder's ``view_log`` (see ``_Recorder.views``): the C path, where
    the entry names that list fourth (the generated Python recorders file no entry for such
    an op: its calls take the slow path, which logs them)."""
    if not op.aliases:
        return (r, op.fast_outs, op.wrap)
    return (r, op.fast_outs, op.wrap, "view_log")


def _fresh_nodes(f: Any, op: _Op, fargs: Any) -> Any:
    """Record a call that draws random numbers into Fold ``f`` as a node of its own: the
    Fold gives a call on the same arguments as an earlier one that one's node (calls are
    taken as pure), so where it did, the call is recorded as the op's next variant (a copy
    of it: a signature of its own, a group of its own), until a node is new.  Its node ids;
    a variant's outputs are the op's.  (A recording made once, ``_Trace``, records every
    call.)"""
    outputs = None if op.single else len(op.outs)
    if type(f) is not Fold:
        return f.op(op.fold_op, outputs)(*fargs)
    v = op
    while True:
        before = len(f)
        nodes = f.op(v.fold_op, outputs)(*fargs)
        if len(f) > before:
            return nodes
        v = v.variant()


class _Watched:
    """The recorder of a fast table entry for a module call holding a Dropout (see
    ``_random_modules``): while one of its modules is training, a call draws, so it is
    recorded as a node of its own (``_fresh_nodes``); else as the pure call it is.  It holds
    its Fold (or trace) weakly: the table that holds it is the Fold's (a trace's ``tables``),
    and a reference back would be a cycle left for the collector at every call."""

    __slots__ = ("op", "record", "fold")

    def __init__(self, op: _Op, record: Callable[..., Any], fold: Any) -> None:
        self.op, self.record, self.fold = op, record, weakref.ref(fold)

    def __call__(self, *fargs: Any) -> Any:
        for m in self.op.random_modules:
            if m.training:
                return _fresh_nodes(self.fold(), self.op, fargs)
        return self.record(*fargs)


def _node_of(out: Any, rec: Any) -> bool:
    """Whether a call's result ``out`` is a lazy value of ``rec``'s round (the call became a
    node, which runs with the round), or holds one first."""
    t = type(out)
    if t is Lazy:
        return out.rec is rec
    if t is tuple or t is list:
        return bool(out) and _node_of(out[0], rec)
    return False


def _module_structure(module: nn.Module) -> tuple[frozenset[int], tuple[Any, ...], set[type]]:
    """The ids of the modules in ``module`` (itself too), the places of their parameters
    and buffers: (module, its table, the name), by identity (a module's own __hash__ is
    never called, see _identity_keyed), and their classes."""
    ids: set[int] = set()
    places: list[Any] = []
    classes: set[type] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        if id(m) in ids:
            continue
        ids.add(id(m))
        classes.add(type(m))
        d = m.__dict__
        todo.extend(c for c in reversed((d.get("_modules") or {}).values()) if c is not None)
        for table in (d.get("_parameters"), d.get("_buffers")):
            places.extend((m, table, k) for k in table or ())
    return frozenset(ids), tuple(places), classes


def _guard_class(cls: type, guarded: dict[type, Any]) -> None:
    """``cls.__setattr__`` checked while autobatch calls that read its modules run
    (``guarded``, the call's, names the classes to let go of: ``unguard``): a module set up
    per example after a recorded call of it in the round (``m.temperature = t``,
    ``m.train(flag)``: a plain attribute, a number, flag or string, set to a new value) is a
    FoldError as it is set, since the call runs with its round, once for the calls of all
    examples, and would read the new value where eager code read the old one (each set is
    seen: one set back before the round runs is refused too).  Set on the classes of the
    modules a round's calls read (a class's own attribute: setting nn.Module's would refresh
    the method caches of every module class, 0.1 ms a call), one guard per class however
    many calls (threads) use it, put back when the last ends (``_GUARDS``); a set on any
    other module, a private attribute, one the module does not have yet, or one made where
    nothing records per example (another thread), goes through."""
    with _PATCH_LOCK:
        entry = _GUARDS.get(cls)
        if entry is None:
            inner = cls.__setattr__
            own = cls.__dict__.get("__setattr__", _MISS)

            def __setattr__(self: Any, name: str, value: Any) -> None:  # noqa: N807
                rec = _LOCAL.rec
                if (
                    type(rec) is _Recorder
                    and rec.lockstep is None
                    and id(self) in rec.state_modules
                ):
                    _check_set(rec, self, name, value)
                inner(self, name, value)

            entry = _GUARDS[cls] = [own, __setattr__, 0]
            cls.__setattr__ = __setattr__  # type: ignore[method-assign,assignment]
        entry[2] += 1
        guarded[cls] = entry


# Per class guarded (_guard_class): [its own __setattr__ before (_MISS: none), the guard,
# the calls using it].
_GUARDS: dict[type, list[Any]] = {}


def _check_set(rec: Any, module: Any, name: str, value: Any) -> None:
    """The FoldError of ``_guard_class`` where ``module.name = value`` sets a plain
    attribute anew."""
    old = module.__dict__.get(name, _MISS)
    if (
        type(old) in _PLAIN_STATE
        and not name.startswith("_")
        and (type(old) is not type(value) or (old != value and not (old != old and value != value)))
    ):
        raise FoldError(
            f"autobatch: example {rec.example}: the attribute {name!r} of "
            f"{type(module).__name__} set to {value!r} after a recorded call read the module "
            "in this round: the call runs later, in its round, once for the calls of all "
            "examples, and would read the new value where eager code read the old one (an "
            "example setting a module up for itself: m.temperature = t, m.train()). Fix: "
            "pass what differs per example as an argument (m(x, t)), or set it before the "
            "autobatch call."
        )


def unguard(guarded: dict[type, Any]) -> None:
    """The guards of ``_guard_class`` a call used let go of (the last guarded first): a
    class no other call uses any more gets its ``__setattr__`` back, unless another wrapper
    was set over the guard meanwhile (that one stays)."""
    with _PATCH_LOCK:
        for cls, entry in reversed(list(guarded.items())):
            entry[2] -= 1
            if entry[2] > 0:
                continue
            own, guard, _ = _GUARDS.pop(cls)
            if cls.__dict__.get("__setattr__") is guard:
                if own is _MISS:
                    delattr(cls, "__setattr__")
                else:
                    cls.__setattr__ = own  # type: ignore[method-assign]
    guarded.clear()


def _tensor_state(places: tuple[Any, ...]) -> tuple[Any, ...]:
    """Per place of ``_module_structure`` the tensor there now and its version (None for an
    inference tensor, or no tensor)."""
    out = []
    for _, table, k in places:
        t = table.get(k)
        out.append((t, None if t is None else version_of(t)))
    return tuple(out)


# The attribute types a module set up per example is refused for (``_check_set``: numbers,
# flags, strings, None; a float NaN is a new value only where it was not NaN).
_PLAIN_STATE = frozenset((bool, int, float, str, type(None)))


def _state_changed(obj: Any, state: Any, structures: dict[int, Any]) -> str | None:
    """What of ``obj``'s state (see note_state) differs from ``state``, in words; None
    where nothing does: a parameter's version; a module's tensors (one set anew, or changed
    in place).  (Its plain attributes are seen as they are set: _guard_class.)"""
    if not isinstance(obj, nn.Module):
        if state is None or obj._version == state:
            return None
        return f"a parameter of shape {tuple(obj.shape)}"
    places = structures[id(obj)][2]
    for (m, table, k), (t, version) in zip(places, state):
        now = table.get(k)
        if now is not t or (t is not None and version is not None and t._version != version):
            where = type(obj).__name__ + ("" if m is obj else f"'s {type(m).__name__}")
            return f"the tensor {k!r} of {where}"
    return None


# The torch.func transform the thread runs inside of (its innermost level), None outside any:
# a call recorded there would run later, outside the transform (see _Recorder._in_transform).
_IN_TRANSFORM: Callable[[], Any] = getattr(
    getattr(torch._C, "_functorch", None), "peek_interpreter_stack", lambda: None
)


def _snapshot(a: torch.Tensor) -> bool:
    """Whether eager tensor ``a``, a call's literal argument, is taken as a copy of its value
    now: a view of any tensor but a leaf that needs a gradient (a row of a buffer the
    example fills, of its one-hot input, of an input tensor it was given, of a tensor it
    computed at once from an earlier round's values).  The call runs later, in its round;
    a change in place of the tensor viewed before then (``buf[0] = 7.0`` after ``h +
    buf[0]``) would reach it, and the views of one tensor share its version counter, so no
    check tells a change of this view from a change elsewhere in its tensor.  (A copy also
    leaves the tensor's memory to the example: a recorded write into a buffer it fills
    sees no view of it held.)  A tensor itself is checked by its version instead, see
    check_aliases; a view of a leaf that needs a gradient, ``self.pos[:n]`` of a
    parameter, is taken as it is: torch refuses to change such a leaf in place, and the
    example does not change parameters under ``torch.no_grad()``.  The C fast path
    (``note_alias``) takes the same rule."""
    base = a._base
    return base is not None and not (base.requires_grad and base.is_leaf)


def _computed(rec: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``(args, kwargs)`` with every lazy value its computed row (and every known value its
    tensor), where the call's lazy values (in lists and tuples too) are all of earlier
    rounds of ``rec``'s call; else None.  A torch function of such values runs at once, as
    eager code runs it (its result a tensor, read at once; autograd flows back into the
    rounds' outputs): recording it would cost a node, and a group per round, for what is an
    index or a cat of known rows."""
    for a in args:  # the common case first: a lazy value of this round among them
        if type(a) is Lazy and a.rec is rec:
            return None
    found = [False]
    new_args = _row_of(rec, list(args), found)
    values = _row_of(rec, list(kwargs.values()), found) if kwargs else []
    if new_args is _CURRENT or values is _CURRENT or not found[0]:
        return None
    return new_args, dict(zip(kwargs, values))


_CURRENT = object()  # a lazy value of the round recording now (see _computed)


class _SizedByData(Exception):
    """A call's one-number integer argument sizes its result (see ``_Recorder._infer``)."""


# Op keys whose calls are sized by a one-number argument: read, not recorded (bounded).
_SIZED_BY_DATA: set[Any] = set()
_SIZED_BY_DATA_MAX = 4096


class _Inline(Exception):
    """Raised by ``_new_op`` for a call of a module of the user's own that
    torch.func.vmap cannot run (a recurrent module inside it, on a batch of its own; a read
    of a value in its forward), or that returns Python values beside its tensors (a step
    module returning ``(h, int(h.argmax()))``): its calls are not recorded whole, but run
    through, each call inside its forward recorded as the function's own calls are."""


class _InlineTrial(_Inline):
    """``_Inline`` for a module recorded whole before on arguments of other shapes (see
    ``_shapes_vary``): run through on trial."""

    trial = True


_Inline.trial = False  # type: ignore[attr-defined]


# Such modules, by identity (id -> the module; emptied by clear_cache): every call of one
# is run through at once, before its arguments are keyed.
_INLINE: dict[int, Any] = {}
if _C is not None:  # (the C module wrapper runs their calls through at once too)
    _C.configure_inline(_INLINE)


# The key of the first call of each module of the user's own recorded whole (by identity:
# id -> (the module, the key; None: kept whole); emptied with _INLINE).
_WHOLE: dict[int, tuple[Any, Any]] = {}


def _shapes_vary(module: nn.Module, key: Any) -> bool:
    """Whether ``module`` (of the user's own, which vmap may run whole) was recorded whole
    before on arguments of other shapes, and so is run through on trial.  A call recorded
    whole makes a group per shape, each run under vmap (a sentence classifier over
    sentences of 20 lengths: 20 groups); run through, its calls are the function's own,
    whose groups hold calls of several shapes where torch's modules allow it (padded: a
    conv over sentences of several lengths, a Linear) and run directly (20.5 against 13.4
    ms for 64 sentences).  Where the call run through records no call that runs under vmap,
    the module is run through from then on (``_Recorder._trial``); where it does (an
    attention's ``scaled_dot_product_attention``: a group per length either way, and more
    ops for each), it is kept whole from then on.  Calls of one shape stay whole: one vmap
    call for the group."""
    if module._forward_hooks or module._forward_pre_hooks:
        return False  # (its calls run one per example: see ops._hooked)
    first = _WHOLE.get(id(module))
    if first is None or first[0] is not module:
        if len(_WHOLE) >= 4096:
            _WHOLE.clear()
        _WHOLE[id(module)] = (module, key)
        return False
    return first[1] is not None and first[1] != key


def _inlinable(module: Any) -> bool:
    """Whether a call of ``module`` may be run through instead of recorded whole: a module
    of a class not of torch's own (whose forward is torch's kernels, recorded as one call or
    not at all), or a Sequential."""
    t = type(module)
    return (
        isinstance(module, nn.Module)
        and not isinstance(module, ModelBatched)  # (N models' rows: merged, see _MODELS)
        and (t is nn.Sequential or not t.__module__.startswith("torch."))
    )


def _sized_by(out: Any, ones: Any) -> bool:
    """Whether the op's outputs on zeros (``out``) and with its one-number integer arguments
    ones (``ones``: the outputs, or the exception it raised) differ in structure or shape."""
    if isinstance(ones, Exception):
        return True
    a, spec_a = pytree.tree_flatten(out)
    b, spec_b = pytree.tree_flatten(ones)
    if spec_a != spec_b or len(a) != len(b):
        return True
    return any(
        isinstance(x, torch.Tensor) and (not isinstance(y, torch.Tensor) or x.shape != y.shape)
        for x, y in zip(a, b)
    )


def _flat_args(args: Any, depth: int = 0) -> Any:
    """The arguments of a call (``args``: its arguments and its keywords' values), the
    items of its list, tuple and dict arguments too, however nested."""
    for a in args:
        t = type(a)
        if (t is list or t is tuple) and depth < 32:
            yield from _flat_args(a, depth + 1)
        elif t is dict and depth < 32:
            yield from _flat_args(tuple(a.values()), depth + 1)
        else:
            yield a


def _same(x: Any) -> Any:
    return x


def _row_of(rec: Any, a: Any, found: list[bool]) -> Any:
    t = type(a)
    if t is Lazy:
        old = a.rec
        if old is rec or old.values is None or old.session is not rec.session:
            return _CURRENT
        found[0] = True
        return _value_of(a)
    if t is Known:
        return a.tensor()
    if t is list or t is tuple:
        out = []
        for x in a:
            v = _row_of(rec, x, found)
            if v is _CURRENT:
                return _CURRENT
            out.append(v)
        return t(out)
    return a


def _row_number_index(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``x[y]`` and ``x[0, y]`` of an int per row (``values.RowNumber``: a label) as the
    index by the rows' 0-d long values, which selects as the int does (its dim dropped)."""
    index = args[1]
    t = type(index)
    if t is RowNumber and index.type is int:
        return (args[0], index.tensor_row(None, None))
    if t is tuple and any(type(i) is RowNumber for i in index):
        return (
            args[0],
            tuple(
                [
                    i.tensor_row(None, None) if type(i) is RowNumber and i.type is int else i
                    for i in index
                ]
            ),
        )
    return args


class _Recorder:
    """One autobatch call: its Fold, the example being recorded, the device."""

    def __init__(self, fold: Any = None, session: Any = None) -> None:
        # A Fold, or a _Trace when autobatch records once on lazy rows (see _traced).
        self.fold = Fold() if fold is None else fold
        self.example = 0
        # The ops of the calls made while a module is run through on trial (_trial).
        self.trial: list[_Op] | None = None
        # (the Fold's next node id, example) as each example started or resumed in this
        # round: which example recorded a node (example_of)
        self.segments: list[tuple[int, int]] = []
        # (the Fold's C counter of node ids, read directly: see start_example)
        ids = getattr(self.fold, "_ids", None)
        self._ids = ids if _Counter is not None and type(ids) is _Counter else None
        # The seed of torch's generator as the call began (the session's, across rounds):
        # an example that seeds it anew meets a random call on a recorded value (_seeded).
        self.seed = session.seed if session is not None else torch.initial_seed()
        self.paused = False
        # Set when the autobatch call (or the recording made once) that this recorder serves
        # has ended: a lazy value kept beyond it records nothing (see close).
        self.closed = False
        # The autobatch call's rounds (driver._Session) where this recorder is one of them;
        # once its round has run, values: node -> (the round's output, row).
        self.session = session
        self.values: dict[Any, tuple[torch.Tensor, int]] | None = None
        # Where this recorder records a function once for a whole batch of rows whose reads
        # run the recording so far (traced._Lockstep): its reads' values come from there.
        self.lockstep: Any = None
        self.rows_of: dict[Any, torch.Tensor] = {}  # node -> its row of values, made once
        # node -> its row of values as a batch-of-one literal of a later round, made once
        self.literals: dict[Any, torch.Tensor] = {}
        # id(output) -> (output, None, or all its rows as views): see _split_rows.
        self._row_views: dict[int, tuple[torch.Tensor, Any]] = {}
        # (tensor, its version, example, the call's fn and kind) per eager tensor (not a
        # view) a call took as a literal row (a view of it): see check_aliases.
        self.aliases: list[tuple[torch.Tensor, int, int, Any, str]] = []
        self._calling: tuple[Any, str] = (None, "torch")
        # id(output) -> (output, output.tolist()): the numbers 0-dim integer reads take.
        self.numbers: dict[int, tuple[torch.Tensor, list[Any]]] = {}
        self.device: torch.device | None = None
        self._recorders: dict[_Op, Callable[..., Any]] = {}
        # Op key -> record-and-wrap, for calls of lazy arguments only (see _fast_source).
        self._fast: dict[tuple[Any, ...], Callable[..., Any]] = {}
        # The same for calls recorded with gradients off and no autocast (C path only).
        self._fast_nograd: dict[tuple[Any, ...], Callable[..., Any]] = {}
        # id(row) -> (row, version, batched value, meta): the examples of a tensor autobatch
        # iterates over, prepared in one call per tensor (see ``rows``).
        self._rows: dict[int, tuple[Any, int, Any, _Meta, list[Any]]] = {}
        # Per tensor ``rows`` prepared: [the tensor, its version then, whether a call took a
        # row as prepared] (see check_aliases).
        self.iterated: list[list[Any]] = []
        # id(module) -> (module, its state at its first recorded call of the round): see
        # note_state and check_aliases.
        self.state: dict[int, tuple[Any, tuple[Any, ...]]] = {}
        self.state_modules: set[int] = set()  # (the ids of the modules in ``state``'s)
        # id(module) -> (module, its modules' ids, its tensors' places): made once per
        # autobatch call (its rounds' recorders share the session's), see note_state.
        self.structures: dict[int, tuple[Any, ...]] = (
            session.structures if session is not None else {}
        )
        if _C is not None:  # (the C path's list of the objects it noted: of another round)
            _C.forget_noted()
        # The fast tables a finished autobatch call gives back with its Fold (driver._POOL).
        self.kept: tuple[dict[Any, Any], ...] | None = None
        # The views the running example made in this round (outputs of ops that alias,
        # ``_Op.aliases``): per call (its outputs, its recorder's arguments), logged as
        # recorded (the C fast path too), emptied as another example starts
        # (``forget_views``); read by ``views`` for an in-place change (buffers.write_lazy)
        # from ``view_seen`` on.
        self.view_log: list[tuple[Any, Any]] = []
        self.view_seen = 0
        self.view_absorbed = 0  # (the entries buffers.absorb_views has marked)
        # What may share memory with a value of this round (by node; values made of them
        # at once too, negative): its group of views and values views were taken of, held
        # weakly (values._share, from the view log); the views of it kept once per value,
        # held weakly (views_of, values._memo_wrap), whose nodes are in ``fixed``; the
        # tensors made of its row at once, held weakly (eager_of, values._mark_shared).
        # Once a round has run, an in-place change of a value is refused while one of those
        # is in use (values.in_use), and of a kept view always (buffers.write_lazy).
        self.shared: dict[Any, list[Any]] = {}
        self.views_of: dict[Any, list[Any]] = {}
        self.eager_of: dict[Any, list[Any]] = {}
        self.fixed: set[Any] = set()
        self.view_roots: dict[int, frozenset[int]] = {}
        self.viewers: dict[int, list[Any]] = {}
        self.view_refs: dict[int, int] = {}

    def row_literal(self, src: Any, row: int) -> Any:
        """Row ``row`` of ``src`` (an output of this recorder's round) as the batch-of-one
        view a later round's call takes (``_part``; the C path calls this too): a
        ``narrow`` of the first row asked of a tensor, then views of one ``split`` (see
        ``_split_rows``); ``src`` itself where it has one row (a value a method of an earlier
        round's value made at once, ``values._memo_wrap``; a group of one example)."""
        if type(src) is torch.Tensor and row == 0 and src.ndim and src.shape[0] == 1:
            return src
        if (src.data if type(src) is PaddedRows else src).requires_grad and (
            not torch.is_grad_enabled()
        ):
            with torch.enable_grad():  # (see row_of)
                return self.row_literal(src, row)
        if type(src) is not torch.Tensor:  # (PaddedRows, a tensor subclass)
            return src.narrow(0, row, 1)
        views = self._split_rows(src)
        return src.narrow(0, row, 1) if views is None else views[row]

    def row_of(self, src: Any, row: int) -> Any:
        """Row ``row`` of ``src`` (an output of this recorder's round, a tensor or
        ``PaddedRows``, cut to the row's length) as a value of its own: an example's result,
        or its value in the eager finish (``values._value_of``; the C path calls this too).
        An index of the first row asked of a tensor, then rows of one ``split`` (see
        ``_split_rows``): 64 encoder outputs read by index cost 1.3 ms of backward."""
        data = src.data if type(src) is PaddedRows else src
        if data.requires_grad and not torch.is_grad_enabled():
            # Made once and kept for every later use: a row first read under
            # torch.no_grad() (``with torch.no_grad(): x = h * 2``) must still carry the
            # gradient where a later use of it asks for one.
            with torch.enable_grad():
                return self.row_of(src, row)
        if type(data) is not torch.Tensor:  # (a tensor subclass)
            return src[row]
        views = self._split_rows(data)
        got = data[row] if views is None else views[row][0]
        if type(src) is PaddedRows:
            got = cut_to(got, [d - 1 for d in src.dims], int(src.lengths[row]))
        return got

    def _split_rows(self, src: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """The rows of ``src`` as batch-of-one views of one ``split``, from the second row
        asked of it on (None for the first: the caller takes that one alone).  A decoder's
        next step, or the results, read every example's row: a split costs about a third
        of as many narrows, and in backward it is one node, where each narrow or index
        makes a gradient the size of the whole output."""
        got = self._row_views.get(id(src))
        if got is None or got[0] is not src:
            self._row_views[id(src)] = (src, None)
            return None
        views = got[1]
        if views is None:
            views = src.split(1)
            self._row_views[id(src)] = (src, views)
        return views

    def write_lazy(
        self,
        fn: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        operator: int,
        plain: tuple[Any, str] | None = None,
    ) -> Any:
        """An in-place change of lazy value ``args[0]`` (see ``buffers.write_lazy``)."""
        return buffers.write_lazy(self, fn, args, kwargs, operator, plain)

    def start_example(self, i: int) -> None:
        """Example ``i`` runs (starts, or resumes after its round): it is the one recording,
        and the view log is its alone (``forget_views``)."""
        self.example = i
        ids = self._ids  # (the node ids it records from here on are its own)
        if ids is not None:
            self.segments.append((ids.issued, i))
        elif type(self.fold) is Fold:
            self.segments.append((self.fold.issued(), i))
        self.forget_views()

    def example_of(self, node: int) -> int | None:
        """The example that recorded node ``node`` of this round (the first, for a node
        several examples share), from the ids handed out as each example started or
        resumed; None where unknown."""
        found = None
        for start, i in self.segments:
            if start > node:
                break
            found = i
        return found

    def forget_views(self) -> None:
        """Empty the view log as another example starts or resumes: only the running
        example's values of this round can change in place (a paused one's are values of
        an earlier round when it resumes), so the log holds that example's views alone,
        and the lazy values it holds are let go as eager code lets them go.  In a call
        whose examples read (``session``; a recording once for every row has no later
        rounds), the views still in use are noted first, for in-place changes in later
        rounds (``buffers.absorb_views``)."""
        if self.view_log:
            if self.session is not None:
                buffers.absorb_views(self)
            self.view_log.clear()
            self.view_seen = self.view_absorbed = 0
            self.view_roots.clear()
            self.viewers.clear()
            self.view_refs.clear()

    def views(self) -> tuple[dict[int, frozenset[int]], dict[int, list[Any]], dict[int, int]]:
        """What the running example's views share, from ``view_log`` (its new calls read
        here, in order, once: recording pays for a log entry alone):

        - per view's node id the node ids of the values of this round whose memory it
          shares, through other views too (``_FOREIGN`` among them where it views a tensor
          of another round or an eager one);
        - per such node id every lazy value known to hold that memory, as logged: the
          values views were taken of (arguments) and the views (outputs), each as
          ``(entry, where, node)`` (the log entry, where in it: see ``held``, and its node
          then);
        - per lazy value (by id) the references the log holds to it, for ``held``."""
        log, known, holders, refs = self.view_log, self.view_roots, self.viewers, self.view_refs
        node = getattr(self.fold, "_node_type", None)
        for j in range(self.view_seen, len(log)):
            out, args = log[j]
            found: set[int] = set()
            for p, a in enumerate(args):
                many = type(a) is list or type(a) is tuple
                for k, x in enumerate(a if many else (a,)):
                    t = type(x)
                    if t is Lazy and x.rec is self and type(x.node) is node:
                        i = node_id(x.node)
                        roots = known.get(i)
                        if roots is None:
                            found.add(i)
                            holders.setdefault(i, []).append((j, (p, k) if many else p, x.node))
                        else:
                            found.update(roots)
                        if not many:  # (an element of a list the log holds through the list)
                            refs[id(x)] = refs.get(id(x), 0) + 1
                    elif t is Lazy or isinstance(x, torch.Tensor) or (t is Known and not x.number):
                        found.add(_FOREIGN)  # a view of another round's value, or a tensor
            roots = frozenset(found)
            leaves = [(-1, out)] if type(out) is Lazy else list(enumerate(pytree.tree_leaves(out)))
            for w, v in leaves:
                if type(v) is Lazy and type(v.node) is node:
                    known[node_id(v.node)] = roots
                    for i in roots:
                        holders.setdefault(i, []).append((j, -1 if w < 0 else (-2, w), v.node))
                    if w < 0:
                        refs[id(v)] = refs.get(id(v), 0) + 1
        self.view_seen = len(log)
        return known, holders, refs

    def held(self, j: int, where: Any) -> Any:
        """The lazy value of log entry ``j`` at ``where`` (see ``views``): an argument's
        position (``(p, k)``: element k of a list argument p), -1 the single output,
        ``(-2, w)`` output w of several."""
        out, args = self.view_log[j]
        if where == -1:
            return out
        if type(where) is tuple:
            p, k = where
            return pytree.tree_leaves(out)[k] if p == -2 else args[p][k]
        return args[where]

    def check_aliases(self) -> None:
        """A FoldError where an eager tensor that a recorded call took as an argument (a
        mask, a coverage vector made in the function) was changed in place after the call:
        the call runs with its round, and would read the new value where eager code read
        the old one.  Only tensors that are no view are checked: the views of one tensor
        share its version counter, so a change to one row would look like a change to all;
        a view of a tensor that needs no gradient is taken as a copy of its value at the
        call instead (``_snapshot``).  A row of a tensor autobatch iterates over is taken as
        ``rows`` prepared it while that tensor's version is unchanged (else as a copy): a
        change in place after a call took one is an error here."""
        for obj, state in self.state.values():
            changed = _state_changed(obj, state, self.structures)
            if changed is not None:
                raise FoldError(
                    f"autobatch: {changed} changed while the examples were recorded, after a "
                    "recorded call read it: the call runs later, in its round, once for the "
                    "calls of all examples, and would read the changed value where eager code "
                    "read the old one (an example setting a module up for itself: "
                    "m.temperature = t, m.train(), a buffer or weight changed in place). Fix: "
                    "pass what differs per example as an argument (m(x, t)), or set it before "
                    "the autobatch call."
                )
        for t, version, taken in self.iterated:
            if taken and t._version != version:
                raise FoldError(
                    f"autobatch: the tensor of shape {tuple(t.shape)} that autobatch iterates "
                    "over was changed in place after a recorded call took a row of it (an "
                    "example changed its row in place: x.mul_(2), x[0] = 0); the call runs "
                    "later, in its round, and would read the changed value where eager code "
                    "read the old one. Fix: change a copy (x = x.clone() before changing it), "
                    "or compute out of place (x = x * 2)."
                )
        for t, version, example, fn, kind in self.aliases:
            if t._version != version:
                raise FoldError(
                    f"autobatch: example {example}: a tensor of shape {tuple(t.shape)} was "
                    f"changed in place after a recorded call ({_fn_name(fn, kind)}) took it "
                    "as an argument; the call runs later, in its round, and would read the "
                    "changed value where eager code read the old one. Fix: change a copy "
                    "(t = t.clone() before changing it), or compute out of place (t = t + 1, "
                    "torch.where, torch.cat)."
                )

    def note_state(self, obj: Any) -> None:
        """The state of ``obj`` at its first recorded call of the round (the C fast path
        calls this too), for check_aliases: a module's tensors and their versions (its
        modules noted in ``state_modules`` for _guard_class's check), whose forward
        runs with the round and reads it then; a parameter's version, given to a call
        (``F.linear(x, W)``) that reads it then."""
        if isinstance(obj, nn.Module):
            got = self.structures.get(id(obj))
            if got is None or got[0] is not obj:
                got = self.structures[id(obj)] = (obj, *_module_structure(obj))
                session = self.session
                if session is not None:  # (recorded per example: its classes guarded)
                    for cls in got[3]:
                        if cls not in session.guarded:
                            _guard_class(cls, session.guarded)
            self.state[id(obj)] = (obj, _tensor_state(got[2]))
            self.state_modules.update(got[1])
        else:
            self.state[id(obj)] = (obj, version_of(obj))

    def _trial(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call of ``module`` run through on trial (see ``_shapes_vary``): its calls taken
        by the slow path, which notes their ops (the fast tables set aside meanwhile, and
        given what it adds); where none runs under vmap, the module is run through from
        then on, else it is kept whole."""
        fast, nograd = self._fast, self._fast_nograd
        self._fast, self._fast_nograd = {}, {}
        outer, self.trial = self.trial, []
        try:
            out = _call_module(module, *args, **kwargs)
        finally:
            ops, self.trial = self.trial or [], outer
            if outer is not None:  # (a trial inside a trial: its calls are the outer's too)
                outer.extend(ops)
            fast.update(self._fast)
            nograd.update(self._fast_nograd)
            self._fast, self._fast_nograd = fast, nograd
            if self.closed:  # (its round ran while the call paused: no fast path, see close)
                fast.clear()
                nograd.clear()
        if any(op.mode is _VMAP for op in ops):
            _WHOLE[id(module)] = (module, None)
        else:
            self._run_through(module)
        return out

    def _run_through(self, module: nn.Module) -> None:
        """Every call of ``module`` run through from now on (``_INLINE``), its calls recorded
        whole before included: their ops dropped, and the fast tables that lead to them
        (this recorder's, and those kept for later calls), so that the fast path misses
        them as the slow one does."""
        _INLINE[id(module)] = module
        for table in (_OPS, *_MODE_OPS.values()):
            for k in [k for k, op in table.items() if op.fn is module and op.kind == "module"]:
                del table[k]
        for fast in (self._fast, self._fast_nograd):
            for k in [k for k in fast if k[0] is module]:
                del fast[k]
        if HOOKS.forget_pools is not None:
            HOOKS.forget_pools()

    def close(self) -> None:
        """End the recording: every later call on one of its lazy values is a FoldError.
        The fast table is emptied, so such a call misses it and the slow path says so."""
        self.closed = True
        self._fast.clear()
        self._fast_nograd.clear()
        self.forget_views()  # (its lazy values refer to this recorder: no cycle left)

    def rows(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The examples of a tensor passed to autobatch: ``t.unbind(0)``, as iterating it
        gives, each prepared as a batched argument in one call for all: its batch-of-one view
        (from ``t.split(1)``), or the Python number a 0-dim int, bool or default-dtype row
        travels as.  ``_part`` takes a row from here while its version shows no in-place
        change; it computes anything else (a row changed in place, a new tensor) itself."""
        rows = t.unbind(0)
        if not rows or t.requires_grad or t.is_inference():
            # Rows that carry gradients, or of an inference tensor (no version counter to
            # see a change by): the general path.
            return rows
        if self.device is None:
            self.device = t.device
        if t.ndim == 1 and _as_number(t.dtype):
            values: Any = t.tolist()
        else:
            values = t.split(1)
        meta = _meta(t.shape[1:], t.dtype, t.device)
        version = t._version
        taken = [t, version, False]
        self.iterated.append(taken)
        table = self._rows
        for row, value in zip(rows, values):
            table[id(row)] = (row, version, value, meta, taken)
        return rows

    def record(self, fn: Any, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Record ``fn(*args, **kwargs)``: look its op up by key (made on first sight), add
        the node, and return its outputs as Lazy values.  The recording hot path: a call
        seen before whose arguments are all lazy values (a method's module first, perhaps)
        goes through ``_fast``; others build their key here."""
        session = self.session
        current = session.current if session is not None else None
        if _IN_TRANSFORM() is not None:  # inside torch.func.grad, vjp, jacrev, ...
            return (current or self)._in_transform(fn, kind, args, kwargs)
        if args and type(args[0]) is Lazy:
            form = in_place_form(fn, kind, args, kwargs)
            if form is not None:  # (F.relu(h, inplace=True), nn.ReLU(inplace=True)(h))
                rec = current if current is not None else self
                return rec.write_lazy(fn, form[2], form[3], 0, form[:2])
        if current is not None:  # (None: the call has ended; _record refuses the value)
            if session.eager:  # the rest runs as eager code
                if kind == "torch" and not kwargs:
                    given = [_eager_value(a, session) for a in args]
                    out = fn(*given)
                    _note_shared(fn, out, args, given)
                    return out
                return current._now(fn, kind, args, kwargs)
            if self.closed and self.values is not None and not current.closed:
                # A method of a value of an earlier round: the round recording now records it.
                return current.record(fn, kind, args, kwargs)
        if self.lockstep is not None and fn is _GETITEM:  # (recorded once for all rows)
            args = _row_number_index(args)
        if session is not None and session.rounds and kind == "torch":
            computed = _computed(self, args, kwargs)
            if computed is not None:  # only values of earlier rounds: eager, as they are
                out = fn(*computed[0], **computed[1])
                _note_shared(fn, out, (*args, *kwargs.values()), computed[0])
                return out
        try:
            out = self._record(fn, kind, args, kwargs)
        except AttributeError:
            for a in (*args, *kwargs.values()):
                for x in a if type(a) in (list, tuple) else (a,):
                    if isinstance(x, Lazy) and not all(
                        hasattr(x, f) for f in ("node", "meta", "rec")
                    ):
                        raise _unfilled(_fn_name(fn, kind)) from None
            raise
        if kind != _BATCHED and _node_of(out, self):  # (see note_state)
            self._note_call(fn, kind, args, kwargs)
        return out

    def _note_call(self, fn: Any, kind: str, args: Any, kwargs: dict[str, Any]) -> None:
        """The state a call recorded as a node of this round reads when it runs (see
        note_state): a module's, or the parameters among its arguments' (the C fast path
        notes its calls alike, ``note_call``)."""
        state = self.state
        if kind == "module" and not (_INLINE and _INLINE.get(id(fn)) is fn):
            if id(fn) not in state:
                self.note_state(fn)
        for a in (*args, *kwargs.values()):
            for x in a if type(a) is list or type(a) is tuple else (a,):
                if (
                    isinstance(x, torch.Tensor)
                    and x.requires_grad
                    and x.is_leaf
                    and x._base is None
                    and id(x) not in state
                ):
                    self.note_state(x)

    def _record(self, fn: Any, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if kind == "module" and _INLINE and _INLINE.get(id(fn)) is fn:
            return _call_module(fn, *args, **kwargs)
        for a in args:  # a written buffer: the value it holds, for the fast path's key
            if type(a) is _Written and not (kind == "torch" and _INPLACE[fn]):
                args = tuple(buffers.held_by(x, self) if type(x) is _Written else x for x in args)
                break
        # The grad/autocast mode the call is recorded in; None for the usual one (gradients
        # on, no autocast), the only one the fast table holds.
        mode = None if torch.is_grad_enabled() and not _any_autocast() else _current_mode()
        # The C fast path has a table for gradients off too (inference, decoding).
        fast = (
            not kwargs
            and (mode is None or (mode == _NO_GRAD and _C is not None))
            and 0 < len(args) <= _FAST_MAX
        )
        if fast:
            out = _fast_path(self, fn, kind, args)
            if out is not _MISS:
                return out
        if self.closed:
            session = self.session
            if session is not None and self.values is not None and session.records():
                # A value of an earlier round, used in a later one: recorded by that round.
                return session.current.record(fn, kind, args, kwargs)
            raise FoldError(
                f"{_fn_name(fn, kind)}: a lazy value was used after the autobatch call that "
                "recorded it returned (kept in a list, a global or an attribute). Its value "
                "exists only in that call's results. Fix: return it from the function autobatch "
                "runs and use the result autobatch returns."
            )
        if kind == "torch":
            if _INPLACE[fn] or kwargs.get("out") is not None:
                out = buffers.write(self, fn, args, kwargs)  # (a buffer of the example's own)
                if out is not _MISS:
                    return out
                return _inplace_call(self, fn, args, kwargs)
            rewrite = _REWRITES.get(fn)
            if rewrite is not None:
                out = rewrite(*args, **kwargs)
                if out is not _MISS:
                    return out
            if _reads(fn, args, kwargs):
                out = self._read_call(fn, args, kwargs)
                if out is not _MISS:
                    return out
        # The fast key is taken from the arguments as given, before the call: shape inference
        # runs the function, which may change a list argument in place.
        # (No fast key for a call with arguments that are part of its op by value, a packed
        # RNN's batch sizes: the C key holds a tensor's shape, not its values.)
        by_value = _VALUE_ARGS.get(fn) if kind == "torch" else None
        fast_key = (
            _C.fast_key(self, fn, kind, args)
            if fast and _C is not None and by_value is None
            else None
        )
        fargs: list[Any] = []
        shared: list[torch.Tensor] = []
        parts: list[Any] = [fn, kind]
        if kind == "module" and not _identity_keyed(fn):
            parts[0] = (_BY_ID, id(fn))  # the op holds fn: the id stays its own
        append = parts.append
        lazies = 0
        self._calling = (fn, kind)  # (for check_aliases, as _part notes a tensor)
        for i, a in enumerate(args):
            if type(a) is Lazy and a.rec is self:
                fargs.append(a.node)
                append(a.meta)
                lazies += 1
            elif by_value is not None and i in by_value and type(a) is torch.Tensor:
                # Sizes (a packed sequence's batch sizes): part of the op by value.
                shared.append(a)
                append((_BY_VALUE, tuple(a.tolist()), a.dtype, a.device))
            else:
                append(self._part(a, fargs, shared, kind is _BATCHED))
        if kwargs:
            values = tuple(kwargs.values())
            types = tuple(map(type, values))
            if _CONSTANTS.issuperset(types):  # numbers, strings, None: the part made once
                # Keyed by the objects' ids (equality would take -0.0 for 0.0, 1 for True);
                # the entry keeps the objects, so no id is reused while it lives.
                kk = (tuple(kwargs), *map(id, values))
                kw = _KW_PARTS.get(kk)
                if kw is None:
                    if len(_KW_PARTS) >= _KW_PARTS_MAX:  # values made afresh per call
                        _KW_PARTS.clear()
                    kw = _KW_PARTS[kk] = (values, self._kw_part(kwargs, fargs, shared, kind))
                append(kw[1])
            else:
                append(self._kw_part(kwargs, fargs, shared, kind))
        if not fargs:  # nothing batched: it runs now, as eager code
            return self._eager(fn, kind, args, kwargs)
        key = tuple(parts)
        ops = _OPS if mode is None else _MODE_OPS.setdefault(mode, {})
        op = ops.get(key)
        if op is None:
            if key in _SIZED_BY_DATA:
                return self._sized_read(fn, kind, args, kwargs)
            try:
                op = ops[key] = self._new_op(key, len(args), fn, kind, shared)
            except _SizedByData:
                if len(_SIZED_BY_DATA) >= _SIZED_BY_DATA_MAX:
                    _SIZED_BY_DATA.clear()
                _SIZED_BY_DATA.add(key)
                return self._sized_read(fn, kind, args, kwargs)
            except _Inline as inline:
                if not inline.trial:
                    _INLINE[id(fn)] = fn
                    return _call_module(fn, *args, **kwargs)
                return self._trial(fn, args, kwargs)
            op.recorded_in = mode
            if op.mode is _RNN:
                _group_sequences(op, key, mode)
            elif (
                (kind == "torch" and fn in _PADDED)
                or (kind == "module" and _padded_module(fn))
                or op.transformer is not None
            ):
                _group_padded(op, key, mode)
        if self.trial is not None:
            self.trial.append(op)
        if op.random:  # (no fast table entry: every call comes here)
            self._seeded(op)
            return self._logged(op, self._record_fresh(op, fargs), args)
        watched = op.random_modules
        if watched and any(m.training for m in watched):  # (eval mode: no draw, pure)
            self._seeded(op)
            return self._logged(op, self._record_fresh(op, fargs), args)
        r = self._recorders.get(op)
        if r is None:  # the first call specialises Fold.op's recorder: keep that one
            outputs = None if op.single else len(op.outs)
            # A round's Fold records the op of its group (calls of several shapes, see
            # _group_padded); a recording made once for tensor rows (_Trace) checks each
            # call's outputs against its own op.
            target = op.fold_op if type(self.fold) is Fold else op
            nodes = self.fold.op(target, outputs)(*fargs)
            r = self._recorders[op] = self.fold.op(target, outputs)
            out = op.wrap(nodes, self)
        else:
            out = op.wrap(r(*fargs), self)
        if op.aliases:  # (see views)
            self.view_log.append((out, args))
            if _C is None:  # (the generated Python recorders do not log: no entry)
                return out
        k = len(args)
        if watched:  # its modules' mode is looked at on every call, the fast path's too
            r = _Watched(op, r, self.fold)
        if mode is not None:
            if fast_key is not None and mode == _NO_GRAD:  # (C only, see fast above)
                self._fast_nograd[fast_key] = _entry(op, self._typed(op, r, fargs))
            return out
        if _C is not None:  # later calls of this op with the same fast key take the C path
            if fast_key is not None:
                self._fast[fast_key] = _entry(op, self._typed(op, r, fargs))
        elif any(type(p) is tuple and p and p[0] is _BY_ID for p in parts):
            pass  # keyed by identity: no fast key of the generated recorders holds that
        elif (
            0 < k <= _FAST_MAX
            and not kwargs
            and (
                lazies == k
                or (
                    lazies == k - 1 and type(args[0]) is not Lazy and isinstance(args[0], nn.Module)
                )
            )
        ):  # every argument lazy (but a module first): later calls take the fast path
            self._fast[key] = _entry(op, r)
        elif (
            k <= 2
            and not kwargs
            and not lazies
            and type(args[-1]) is torch.Tensor
            and type(fargs[-1]) in (int, float, bool)  # the 0-dim tensor travelled as a number
            and (k == 1 or isinstance(args[0], nn.Module))
        ):  # a number tensor, after a module perhaps (see _NUMBER_BRANCH)
            a = args[-1]
            self._fast[(fn, kind, *args[:-1], a.dtype, a.device)] = _entry(op, r)
        elif (
            k <= 2
            and not kwargs
            and not lazies
            and type(args[-1]) is Known
            and args[-1].number
            and (k == 1 or isinstance(args[0], nn.Module))
        ):  # a known number, after a module perhaps (see _NUMBER_BRANCH)
            self._fast[(fn, kind, *args[:-1], Known, args[-1].meta)] = _entry(op, r)
        return out

    def _read_call(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call whose result's shape depends on its arguments' values (``x[mask]``,
        ``nonzero``, ``unique``; see tables._READS), or that returns a Python value
        (``torch.equal``): a read of its lazy arguments of this round, as ``int(t)`` is.  The
        example pauses until their round has run, then the call runs at once on their rows,
        as eager code runs it (a tensor carrying autograd history back into the round);
        ``_MISS`` where no argument is a lazy value of this round."""
        for a in _flat_args((*args, *kwargs.values())):
            if type(a) is Lazy and a.rec is self:
                name = _fn_name(fn, "torch")
                a._read(f"{name} (its result's shape, or value, depends on the data)", _same)
                break
        else:
            return _MISS
        session = self.session
        computed = _computed(session.current, args, kwargs) if session is not None else None
        if computed is None:  # (the round ran: every value of this round has its row)
            return _MISS
        out = fn(*computed[0], **computed[1])
        _note_shared(fn, out, (*args, *kwargs.values()), computed[0])
        return out

    def _sized_read(self, fn: Any, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call that a one-number integer argument sizes (x.repeat(n), torch.arange(n),
        x.topk(k) of a recorded n: see _infer): a read of it, as x[:n] is."""
        out = self._read_call(fn, args, kwargs)
        if out is _MISS:  # (not met: the sizing value is one of this round's)
            raise FoldError(
                f"autobatch: example {self.example}: {_fn_name(fn, kind)} at "
                f"{_source_line() or '?'}: a recorded one-number value sizes its result, and "
                "it could not be read here. Fix: read it first (int(n)) and pass the number."
            )
        return out

    def _record_fresh(self, op: _Op, fargs: list[Any]) -> Any:
        """Record a call that draws random numbers as a node of its own (``_fresh_nodes``):
        two dropouts of one value, or Monte Carlo samples of one input, draw apart."""
        return op.wrap(_fresh_nodes(self.fold, op, fargs), self)

    def _logged(self, op: _Op, out: Any, args: tuple[Any, ...]) -> Any:
        """``out``, logged as views of ``args`` where ``op`` aliases (see ``views``)."""
        if op.aliases:
            self.view_log.append((out, args))
        return out

    def _typed(self, op: _Op, r: Any, fargs: list[Any]) -> Any:
        """The round Fold's recorder of ``op`` made for these arguments' types, for a fast
        table entry: the C fast key files a value of an earlier round (a literal row) apart
        from one of this round (a node), and each entry then records without the generated
        recorder's detour through another pattern.  ``r`` (the op's first recorder) where
        the Fold made none for these types."""
        f = self.fold
        if type(f) is not Fold:
            return r
        target = op.fold_op
        outputs = None if op.single else len(op.outs)
        if type(r) is _Watched:
            typed = f._generated.get((target, tuple(map(type, fargs)), outputs), r.record)
            return _Watched(op, typed, f)
        return f._generated.get((target, tuple(map(type, fargs)), outputs), r)

    def _kw_part(
        self, kwargs: dict[str, Any], fargs: list[Any], shared: list[Any], kind: str
    ) -> tuple[Any, ...]:
        """The key part of the keyword arguments."""
        part = self._part
        ragged = kind is _BATCHED
        return (
            _KW,
            tuple(kwargs),
            tuple([part(v, fargs, shared, ragged) for v in kwargs.values()]),
        )

    def _seeded(self, op: _Op) -> None:
        """A random call on a recorded value draws when its group runs, for every example
        at once: where an example seeded torch's generator anew (``torch.manual_seed(i)``
        inside the function: its seed differs from the one the call began with), the seed
        cannot give it eager's numbers, and a warning says so (once per new seed)."""
        seed = torch.initial_seed()
        if seed == self.seed:
            return
        self.seed = seed
        if self.session is not None:
            self.session.seed = seed
        warnings.warn(
            f"autobatch: example {self.example}: {op.name} draws random numbers from a "
            "recorded value after torch.manual_seed inside the function: it draws when its "
            "group runs, for every example at once, so the seed does not fix its numbers as "
            "eager code's (a draw with no recorded argument, torch.rand(3), runs at once and "
            "follows it). Fix: seed before the autobatch call; where each example's numbers "
            "must be eager's, draw them at once (torch.rand(h.shape) < p) and apply them.",
            stacklevel=2,
        )

    def _in_transform(
        self, fn: Any, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """A call made inside a torch.func transform the function opened (``torch.func.grad(
        loss)(x)``, ``vjp``, ``jacrev``): run at once, as eager code runs it, on the rows of
        earlier rounds' values; the transform differentiates (or maps) what it runs, so a
        recorded call, run later outside it, would escape it.  A value of the round
        recording has no row yet, and reading it would pause the example inside the
        transform, whose state belongs to the thread: a FoldError naming the fix.  Where
        the function is recorded once for every row (``traced``), a FoldError too: the
        examples are then recorded one by one, and their calls run so."""
        name = _fn_name(fn, kind)
        if self.lockstep is not None:
            raise FoldError(f"autobatch: {name} inside a torch.func transform, rows recorded once")
        if (
            args
            and type(args[0]) is Lazy
            and (
                in_place_form(fn, kind, args, kwargs) is not None
                or getattr(fn, "__name__", "").endswith("_")
            )
        ):
            raise FoldError(
                f"autobatch: example {self.example}: in-place {name} on a lazy value inside a "
                "torch.func transform. Fix: compute out of place (x = x.add(1), not x.add_(1))."
            )
        session = self.session

        def value(a: Any) -> Any:  # (values._eager_value, where none is of this round)
            t = type(a)
            if t is Lazy and a.rec.session is session and a.rec.values is None:
                raise FoldError(
                    f"autobatch: example {self.example}: {name} inside a torch.func "
                    "transform (torch.func.grad, vjp, jacrev, ...) was given a lazy value "
                    "the function computed in this round: the transform runs its "
                    "function at once, and the value is computed only when the round "
                    "runs. Fix: compute the value inside the transformed function from "
                    "its inputs, or read a value before the transform starts (after a "
                    "read such as float(v.sum()), what was computed before it is a value "
                    "of an earlier round, which the transform takes as a tensor)."
                )
            if t is list or t is tuple:
                return t([value(x) for x in a])
            if t is _Written:  # a buffer the example fills: the value it holds
                return value(buffers.held_by(a, self))
            return _eager_value(a, session)

        given = tuple([value(a) for a in args])
        kw = {k: value(v) for k, v in kwargs.items()} if kwargs else {}
        return self._eager(fn, kind, given, kw)

    def _now(self, fn: Any, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The call run at once as eager code, on the computed rows of earlier rounds' values
        (the session's examples finish eagerly: nothing of this round is lazy)."""
        session = self.session
        kw = {k: _eager_value(v, session) for k, v in kwargs.items()} if kwargs else {}
        given = tuple([_eager_value(a, session) for a in args])
        out = self._eager(fn, kind, given, kw)
        _note_shared(fn, out, (*args, *kwargs.values()), given)
        return out

    def _eager(self, fn: Any, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if kind == "module":
            return _call_module(fn, *args, **kwargs)
        if kind == _BATCHED:
            return _batch_of_one(fn, args, kwargs)
        return fn(*args, **kwargs)

    def _part(self, a: Any, fargs: list[Any], shared: list[Any], ragged: bool) -> Any:
        """The key part of one argument; batched values go to ``fargs``, shared tensors to
        ``shared`` (the key holds their ids)."""
        t = type(a)
        if t is _Written:  # a buffer of the example's own: the value it holds
            a = buffers.held_by(a, self)
            t = type(a)
        if t is Lazy:
            if a.rec is not self:
                if self._earlier(a):
                    # Computed by an earlier round: its row, a batch-of-one literal (autograd
                    # flows back through it into that round's output).
                    kept = a.rec.literals
                    literal = kept.get(a.node)
                    if literal is None:
                        src, row = a.rec.values[a.node]
                        literal = kept[a.node] = a.rec.row_literal(src, row)
                    fargs.append(literal)
                    return a.meta
                raise _foreign(self.example)
            fargs.append(a.node)
            return a.meta
        if t is int or t is str or a is None:
            return a
        if t is float:  # -0.0 keyed apart from 0.0 (1 / x tells them apart)
            return (t, float_key(a))
        if t is bool:
            return (t, a)
        if t is Known:  # torch.tensor(word): a number, or its batch-of-one tensor
            if self.device is None:
                self.device = a.meta.device
            fargs.append(a.value if a.number else a.row())
            return a.meta
        if isinstance(a, torch.Tensor):
            row = self._rows.get(id(a))
            if (
                row is not None
                and row[0] is a
                and row[1] == a._version
                and not a.requires_grad  # requires_grad_() on the row: the general path
            ):
                row[4][2] = True  # (a later change in place is an error: check_aliases)
                fargs.append(row[2])
                return row[3]
            grad = a.requires_grad
            # A parameter: shared, part of the op.  (A view of one taken under
            # torch.no_grad(), ``self.pos[:n]``, is a leaf that requires grad too, a new
            # tensor at every call: data, as any other tensor.)
            if grad and a.is_leaf and a._base is None:
                shared.append(a)
                return (_PARAM, id(a))
            dtype, device = a.dtype, a.device
            if self.device is None:
                self.device = device
            if not grad and not a.ndim and _as_number(dtype):
                fargs.append(a.item())
            elif a.is_inference() or _snapshot(a):
                # No version counter to check a later change by (an inference tensor), or
                # one that cannot tell a change of this view from a change elsewhere in its
                # tensor (``buf[0]`` of a buffer the example fills, its one-hot input's row):
                # its value now, as eager code reads it at the call.
                fargs.append(a.unsqueeze(0).clone())
            else:
                fargs.append(a.unsqueeze(0))
                if a._base is None:  # (a view of a tensor that needs a gradient: as it is)
                    self.aliases.append((a, a._version, self.example, *self._calling))
            return _meta(a.shape, dtype, device, a.layout)
        if isinstance(a, nn.Module):  # a module, a method's self: keyed by identity
            if _identity_keyed(a):
                return a
            shared.append(a)  # the op holds it (see _template): the id stays its own
            return (_BY_ID, id(a))
        if t is tuple or t is list or t is torch.Size:
            if (
                ragged
                and t is list
                and all(type(x) is Lazy or isinstance(x, torch.Tensor) for x in a)
            ):
                return self._ragged(a, fargs)
            return (t, tuple([self._part(x, fargs, shared, ragged) for x in a]))
        if t is dict:
            return (
                dict,
                tuple(a),
                tuple([self._part(v, fargs, shared, ragged) for v in a.values()]),
            )
        if t is slice:
            return (slice, (a.start, a.stop, a.step))
        if t is RowNumber and self.lockstep is None:
            raise FoldError(
                f"autobatch: example {self.example}: a number autobatch gave the function as "
                "one per row, while it recorded the function once for every row, was kept "
                "beyond that recording (set as a module's attribute or a global: "
                "m.temperature = t) and reached a call recorded per example. Fix: pass the "
                "number as an argument where it is used (m(x, t)), or set what differs per "
                "example before the autobatch call; autobatch(..., per_example=True) records "
                "per example from the start."
            )
        try:
            hash(a)
        except TypeError:
            raise FoldError(
                f"autobatch: example {self.example}: an argument of type {t.__name__} cannot "
                "be part of a recorded call (it is not hashable, so calls cannot be grouped "
                "by it). Fix: pass tensors, numbers, tuples, lists or dicts of them."
            ) from None
        return a

    def _earlier(self, a: Lazy) -> bool:
        """Whether ``a``, a lazy value of another recorder, was computed by an earlier round
        of this call (else it is another call's, or one not computed yet)."""
        old = a.rec
        return old.values is not None and old.session is not None and old.session is self.session

    def _element(self, x: Any) -> Lazy:
        """An element of a list given to a batched function as a lazy value of this round,
        a node: itself where it is one; a value of an earlier round (a decoder's memories,
        made before its first read) as the clone of its row (autograd flows back through it
        into that round's output); a tensor beside (or in place of) lazy values (a constant,
        the example's input, a parameter: ``[self.root, h]``) as its clone recorded on it as
        data of the example (a parameter through a view of itself, so that every example's
        list holds it and its gradient reaches it through the group's rows), as eager code's
        one-list Ragged holds them all."""
        if type(x) is Lazy:
            if x.rec is self:
                return x
            if not self._earlier(x):
                raise FoldError(
                    f"autobatch: example {self.example}: a list holds a lazy value from "
                    "another autobatch call. Fix: pass values of this call."
                )
            return self._record(torch.clone, "torch", (x,), {})
        if type(x) is not Known and x.requires_grad and x.is_leaf and x._base is None:
            x = x.view(x.shape)
        out = self._record(torch.clone, "torch", (x,), {})
        if type(out) is not Lazy:  # (nothing batched: cannot happen for a tensor argument)
            raise FoldError(
                f"autobatch: example {self.example}: a list given to a batched function holds "
                "a tensor that could not be recorded as a value of the example. Fix: pass "
                "values computed from the example's inputs."
            )
        return out

    def _ragged(self, items: list[Any], fargs: list[Any]) -> Any:
        items = [self._element(x) for x in items]
        metas = {x.meta for x in items}
        if len(metas) > 1:
            first = items[0].meta
            bad = next(i for i, x in enumerate(items) if x.meta is not first)
            raise FoldError(
                f"autobatch: example {self.example}: element {bad} of a list passed to a "
                f"batched function is {items[bad].meta}, element 0 {first}; the elements of a "
                "list argument are concatenated, so they must agree in shape and dtype."
            )
        fargs.append([x.node for x in items])
        return (_RAGGED, items[0].meta if items else None)

    # -------------------------------------------------------------- new ops
    def _new_op(self, key: Any, nargs: int, fn: Any, kind: str, shared: list[Any]) -> _Op:
        counter = [0]
        shared_iter = iter(shared)
        args = [self._template(p, counter, shared_iter) for p in key[2 : 2 + nargs]]
        kwargs: dict[str, Any] = {}
        if len(key) > 2 + nargs:
            _, names, parts = key[-1]
            kwargs = {n: self._template(p, counter, shared_iter) for n, p in zip(names, parts)}
        if kind == "module" and kwargs and isinstance(fn, _SEQUENCE_MODULES):
            args, kwargs = _positional(args, kwargs)
        where = _source_line()
        op = _Op(fn, kind, args, kwargs, where, _fn_name(fn, kind))
        if kind == "module" and _inlinable(fn) and _module_mode(fn, args, kwargs) is _VMAP:
            # (before its shapes are inferred: its forward runs as code; a batch norm in it
            # is then a call of its own, whose group runs as one, see tables._merged_batch_norm,
            # where the whole module's would run one call per example in training mode)
            if _holds_batch_norm(fn, 0) or _holds_recurrent(fn, 0):
                raise _Inline
            if _shapes_vary(fn, key):
                raise _InlineTrial
            if not self._vmaps(op):
                raise _Inline
        if kind == "module":
            op.transformer = _transformer_layout(fn, args, kwargs) or _attention_layout(
                fn, args, kwargs
            )
        # (states changed since they were noted: the example's doing, kept to be refused)
        changed = [
            k for k, (obj, st) in self.state.items() if _state_changed(obj, st, self.structures)
        ]
        self._infer(op)
        if self.state:
            # Shape inference ran calls (on fake tensors: a renormalising embedding's
            # in-place renorm counts a version on its real table, no value changed): the
            # other states noted are taken again (see note_state).
            for k, (obj, _) in list(self.state.items()):
                if k not in changed:
                    self.note_state(obj)
        if kind == "torch":
            direct = _direct_template(fn, args, kwargs, op.outs)
            if direct is not None:
                op.mode, op.run_args = _DIRECT, direct
            elif fn in _GROUP_CALLS and not any(s.ragged for s in _slots((args, kwargs))):
                fits, call = _GROUP_CALLS[fn]
                got = fits(args, kwargs)
                if got:
                    op.mode, op.call = _DIRECT, got if callable(got) else call
            elif fn in _ELEMENTWISE:
                aligned = _aligned_elementwise(fn, args, kwargs, op.outs)
                if aligned is not None:
                    op.mode, op.call = _DIRECT, aligned
            elif fn in _PACKED_RNNS and len(args) > 2 and isinstance(args[1], torch.Tensor):
                states = args[2] if type(args[2]) in (tuple, list) else (args[2],)
                # Batch sizes shared by value; data and states per example.
                if type(args[0]) is _Slot and all(type(h) is _Slot for h in states):
                    op.mode, op.call = _DIRECT, _PACKED_RNNS[fn]
        elif kind == "module":
            merged = _merged_batch_call(fn, args, kwargs)
            if op.transformer is not None:
                op.mode = _DIRECT
                op.call = functools.partial(op.transformer.merged, op)
            elif merged is not None:
                op.mode, op.call = _DIRECT, merged
            else:
                op.mode = _module_mode(fn, args, kwargs)
            if op.mode is _MODELS and not self._merges_models(op):
                op.mode = _VMAP
        elif kind == _BATCHED:
            op.mode = _BATCHED
        return op

    def _template(self, p: Any, counter: list[int], shared: Any) -> Any:
        if type(p) is _Meta:
            s = _Slot(counter[0], p)
            counter[0] += 1
            return s
        if type(p) is tuple:
            tag = p[0]
            if tag is _PARAM or tag is _BY_ID or tag is _BY_VALUE:
                return next(shared)
            if tag is _RAGGED:
                s = _Slot(counter[0], p[1], ragged=True)
                counter[0] += 1
                return s
            if tag is float:
                return float(p[1])  # a plain float again (see fold._encoding.float_key)
            if tag is bool:
                return p[1]
            if tag is slice:
                return slice(*p[1])
            if tag is dict:
                return {k: self._template(v, counter, shared) for k, v in zip(p[1], p[2])}
            return tag([self._template(x, counter, shared) for x in p[1]])
        return p

    def _merges_models(self, op: _Op) -> bool:
        slots = _slots((op.args, op.kwargs))
        if op.kwargs or _tensors(op.args) or not slots:
            return False
        rows = {s.meta.shape[1] if s.meta.ndim >= 2 else None for s in slots}
        rows |= {m.shape[1] if m.ndim >= 2 else None for m in op.outs}
        return len(rows) == 1 and None not in rows

    def _infer(self, op: _Op) -> None:
        """The op's per-example outputs, on fake tensors (a batch of one on zeros where
        fake tensors cannot run it); a FoldError naming the line where the call fails."""
        lazy = _uninitialised(op.fn, 0) if op.kind == "module" else None
        if lazy is not None:  # (its first call, on fake tensors, would break the module)
            raise FoldError(
                f"autobatch: example {self.example}: {op.name} at {op.where or '?'}: "
                f"{type(lazy).__name__} is a lazy module whose parameters are not made yet "
                "(torch makes them on its first call, and autobatch runs no call of it while "
                "recording). Fix: call the model once on one example before autobatch "
                "(model(xs[0])), or give its sizes (nn.Linear(in, out))."
            )
        slots = _slots((op.args, op.kwargs))
        # One-number integer arguments of a torch function: data (an index, a target) or a
        # size (x.repeat(n)); they are told apart by the shapes they give (_run_ones).
        counts = op.kind == "torch" and any(
            not s.ragged and s.meta is not None and _is_count(s.meta) for s in slots
        )
        self.paused = True
        running = op.kind == _BATCHED
        _LOCAL.running += running
        rng = _rng_states()  # inference draws nothing from the user's random stream
        self._drew = False
        # nor changes a buffer of the module (BatchNorm's running statistics, on zeros)
        state = op.buffers()
        copy = None if state is None else state.copy()
        try:
            # torch.nn's transformer modules give their sequence's shape (the targets' of a
            # decoder, the sources' of an encoder): no call needed, where a call on zeros
            # cost about 1 ms, once per target and memory length.
            known = op.transformer is not None
            out = op.transformer.output_like(op.args, op.kwargs) if known else None
            if out is None:
                out = self._run_shapes(op, slots)
            # A call that draws random numbers (dropout, rand_like): on zeros it moved the
            # generator, on fake tensors it ran an op tagged as seeded (_run_fake).
            op.random = self._drew or not _rng_same(rng, _rng_states())
            watched = _random_modules(op)
            if any(m.training for m in watched):
                op.random = True  # (what drew cannot be told apart: it stays random)
            else:  # in eval mode they draw nothing: random only while one is training
                op.random_modules = watched
            if counts and _sized_by(out, self._run_ones(op, slots)):
                raise _SizedByData
        except _SizedByData:
            raise
        except Exception as err:
            if counts:  # (split(x, n) on zeros, and on fake tensors a read of n)
                raise _SizedByData from err
            raise FoldError(
                f"autobatch: example {self.example}: {op.name} at {op.where or '?'} fails on "
                f"one example's shapes ({', '.join(repr(s.meta) for s in slots)}): "
                f"{type(err).__name__}: {err}"
            ) from err
        finally:
            self.paused = False
            _LOCAL.running -= running
            _rng_restore(rng)
            if state is not None:
                state.restore(copy)
        leaves, treedef = pytree.tree_flatten(out)
        nones = tuple(i for i, t in enumerate(leaves) if t is None)
        if nones and len(nones) < len(leaves) and op.kind == "module":
            # (nn.MultiheadAttention(..., need_weights=False) returns (output, None)): the
            # op's outputs are its tensors; its calls run without the Nones (vmap takes
            # tensors alone), and its values have them back in place.
            leaves = [t for t in leaves if t is not None]
            op.none_at = nones
        if not leaves or not all(isinstance(t, torch.Tensor) for t in leaves):
            if op.kind == "module" and _inlinable(op.fn):
                raise _Inline  # (a module of one's own returning Python values: run through)
            raise FoldError(
                f"autobatch: {op.name} at {op.where or '?'} returns "
                f"{type(out).__name__}, not tensors; a recorded call must return a tensor or "
                "a structure of tensors. Fix: compute Python values outside the recorded call."
            )
        if op.mode is _BATCHED or op.kind == _BATCHED:
            bad = [t for t in leaves if t.dim() == 0 or t.shape[0] != 1]
            if bad:
                raise FoldError(
                    f"autobatch: {op.name} at {op.where or '?'} is batchable(batched=True) but "
                    f"returned {tuple(bad[0].shape)} for a batch of one; a batched function keeps "
                    "the batch in dim 0. Fix: keep dim 0, or drop batched=True."
                )
            metas = [_meta(t.shape[1:], t.dtype, t.device, t.layout) for t in leaves]
        else:
            metas = [_meta(t.shape, t.dtype, t.device, t.layout) for t in leaves]
        op.outs = metas
        op.treedef = treedef
        op.single = isinstance(out, torch.Tensor)
        op.wrap = _wrapper(op.single, metas, treedef, op.none_at)
        if op.none_at:
            pass  # (no fast outputs: the slow path builds the structure with its Nones)
        elif op.single:
            op.fast_outs = metas[0]
        elif treedef == pytree.tree_flatten(tuple(range(len(metas))))[1]:
            op.fast_outs = tuple(metas)

    def _run_shapes(self, op: _Op, slots: list[_Slot]) -> Any:
        """``op`` run on one example's zeros first where it can change no tensor but its
        outputs (``_stateless``), on fake tensors first otherwise, each falling back to the
        other."""
        first, then = (
            (self._run_zeros, self._run_fake)
            if _stateless(op)
            else (self._run_fake, self._run_zeros)
        )
        try:
            return first(op, slots)
        except Exception:
            return then(op, slots)

    def _inputs(self, op: _Op, slots: list[_Slot], make: Callable[..., Any]) -> list[Any]:
        values: list[Any] = [None] * len(slots)
        batched = op.kind == _BATCHED
        for s in slots:
            if s.ragged:
                m = s.meta
                values[s.i] = (
                    Ragged(make((1, *m.shape), m.dtype, m.device), torch.ones(1, dtype=torch.long))
                    if m is not None
                    else Ragged(
                        make((0,), torch.get_default_dtype(), None),
                        torch.zeros(1, dtype=torch.long),
                    )
                )
            else:
                shape = (1, *s.meta.shape) if batched else s.meta.shape
                values[s.i] = make(shape, s.meta.dtype, s.meta.device)
        return values

    def _run_fake(self, op: _Op, slots: list[_Slot]) -> Any:
        if any(s.ragged for s in slots):
            raise NotImplementedError("lists run on zeros")
        with _fake_mode() as mode:
            values = self._inputs(
                op, slots, lambda sh, dt, dev: torch.empty(sh, dtype=dt, device=dev)
            )
            try:
                out = op.per_example(*values)
            finally:
                self._drew = mode.drew
            op.aliases = _aliasing(out, values)
            return out

    def _vmaps(self, op: _Op) -> bool:
        """Whether ``op``, a module call, runs under torch.func.vmap: tried once, on fake
        tensors (a batch of two; the module's buffers untouched, the random stream
        restored).  A call given lists is not tried (True)."""
        slots = _slots((op.args, op.kwargs))
        if any(s.ragged for s in slots):
            return True
        self.paused = True
        rng = _rng_states()
        state = op.buffers()
        try:
            with state.kept() if state is not None else contextlib.nullcontext(), _fake_mode():
                values = self._inputs(
                    op, slots, lambda sh, dt, dev: torch.empty((2, *sh), dtype=dt, device=dev)
                )
                with vmap_quietly():  # (as the groups run it)
                    torch.func.vmap(op.per_example, randomness="different")(*values)
            return True
        except Exception:
            return False
        finally:
            self.paused = False
            _rng_restore(rng)

    def _run_ones(self, op: _Op, slots: list[_Slot]) -> Any:
        """The op on zeros, but its one-number integer arguments ones (True for a bool);
        an exception where it fails so."""

        def make(shape: Any, dtype: torch.dtype, device: Any) -> torch.Tensor:
            if shape == () and _integral(dtype):
                return torch.ones(shape, dtype=dtype, device=device)
            return torch.zeros(shape, dtype=dtype, device=device)

        with torch.no_grad():
            try:
                return op.per_example(*self._inputs(op, slots, make))
            except Exception as err:
                return err

    def _run_zeros(self, op: _Op, slots: list[_Slot]) -> Any:
        with torch.no_grad():
            values = self._inputs(
                op, slots, lambda sh, dt, dev: torch.zeros(sh, dtype=dt, device=dev)
            )
            out = op.per_example(*values)
            op.aliases = _aliasing(out, values)
            return out


def _aliasing(out: Any, values: list[Any]) -> bool:
    """Whether an output of a per-example call (``out``, on fake tensors or zeros) shares
    memory with one of its per-example arguments (``values``): a view of it, or the argument
    itself (see ``_Op.aliases``); True where that cannot be told."""
    try:
        memory = set()
        for v in values:
            t = v.values if type(v) is Ragged else v
            if isinstance(t, torch.Tensor):
                memory.add(t.untyped_storage()._cdata)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata in memory:
                return True
        return False
    except Exception:  # (a tensor without storage of its own)
        return True


def _stateless(op: _Op) -> bool:
    """Whether ``op``'s shapes are inferred on zeros before fake tensors: where the call can
    change no tensor but its own outputs.

    - A module of torch.nn's own (its exact type: a subclass may change its forward) that
      changes no tensor of its own when called, whose submodules are all such modules
      (``_stateless_module``): not a batch or instance norm (running statistics), an
      ``nn.Embedding`` with ``max_norm`` (which renormalises the table in place) or a lazy
      module.
    - A torch function (in-place ones never come here: ``_inplace_call``), but one given a
      shared tensor that its name says it may update (``batch_norm``'s running statistics,
      ``embedding``'s ``max_norm``: any name with "norm" or "embedding"), or a module.

    Fake tensors cost 1-3 ms a call in Python and, on their first use in a process, 1.1 s of
    imports; a recurrent module runs step by step through their decompositions (100-140 ms
    for a GRU over 30 steps, 2 ms on zeros).  One example's zeros cost what one eager call
    of the op costs, once per op.  Zeros give the same shapes; where they fail (an index out
    of range of an empty dim, a Cholesky factor of zeros), fake tensors run.  The random
    stream is restored either way (``_infer``).  Other modules (a user's own, whose forward
    may change a buffer) run on fake tensors first, as before."""
    if op.kind == "module":
        return _stateless_module(op.fn)
    if op.kind != "torch":
        return False
    template = (op.args, op.kwargs)
    if _leaves(template, nn.Module):
        return False
    if not _tensors(template):
        return True
    name = getattr(op.fn, "__name__", None)
    return type(name) is str and "norm" not in name and "embedding" not in name


# Modules that draw random numbers in training mode: a module call holding one draws while
# one of them is training (looked at on every call: an op first recorded in eval mode may
# run in training mode later; see _random_modules).
_RANDOM_MODULES = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
    nn.RReLU,
)


def _holds_batch_norm(m: nn.Module, depth: int) -> bool:
    """Whether ``m`` is or holds a batch norm that updates running statistics (training
    mode), which vmap cannot run (walked by hand, as _find_random)."""
    if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
        return m.training and m.track_running_stats
    return depth < 32 and any(
        c is not None and _holds_batch_norm(c, depth + 1) for c in m._modules.values()
    )


def _holds_recurrent(m: nn.Module, depth: int) -> bool:
    """Whether ``m`` holds a recurrent module or cell (``nn.LSTM``, ``GRU``, ``RNN``, their
    cells), which torch.func.vmap runs badly or not at all (no batching rule for the
    recurrent ops and ``lstm_cell``; ``gru_cell`` and ``rnn_tanh_cell`` one call per example
    inside vmap's fallback): a module of the user's own holding one is run through at once,
    its calls recorded as the function's own, the cells' groups each one call (a decoder
    step module holding a GRUCell: 16.6 against 24.8 ms for 64 examples of 12 steps).  The
    try under vmap this skips runs on fake tensors, whose first use in a process imports
    torch's compiler (0.8 s: the translation tutorial's first call took 1.0 s against
    eager's 0.24).  A module whose forward does not call the one it holds is run through
    too, which gives the same values."""
    if isinstance(m, (nn.RNNBase, nn.RNNCellBase)):
        return True
    return depth < 32 and any(
        c is not None and _holds_recurrent(c, depth + 1) for c in m._modules.values()
    )


def _uninitialised(m: nn.Module, depth: int) -> nn.Module | None:
    """A lazy module in ``m`` (or ``m``) whose parameters are not made yet, else None."""
    if isinstance(m, torch.nn.modules.lazy.LazyModuleMixin) and m.has_uninitialized_params():
        return m
    if depth < 32:
        for c in m._modules.values():
            found = None if c is None else _uninitialised(c, depth + 1)
            if found is not None:
                return found
    return None


def _random_modules(op: _Op) -> tuple[nn.Module, ...]:
    """The modules inside ``op``, a module call, that draw random numbers in training mode
    (see above; a recurrent module with dropout between its layers too): ``op`` draws
    while one of them is training."""
    out: list[nn.Module] = []
    if op.kind == "module" and isinstance(op.fn, nn.Module):
        _find_random(op.fn, 0, out)
    return tuple(out)


def _find_random(m: nn.Module, depth: int, out: list[nn.Module]) -> None:
    # (Walked by hand: nn.Module.modules() hashes every module, and a module's own __hash__
    # may do anything, see _identity_keyed.)
    if isinstance(m, _RANDOM_MODULES) or (isinstance(m, nn.RNNBase) and m.dropout > 0):
        if not any(x is m for x in out):
            out.append(m)
    if depth < 32:
        for c in m._modules.values():
            if c is not None:
                _find_random(c, depth + 1, out)


_SEEDED_FAKE: list[Any] = []


@contextlib.contextmanager
def _fake_mode() -> Any:
    """``_seeded_fake_mode`` on (real tensors allowed in), with torch's log of a kernel
    that fails on fake tensors silenced: torch logs each as an error with its traceback,
    and fold's shape inference handles the failure (zeros, vmap judged unable, or a
    FoldError of its own)."""
    _FAKE_LOG.addFilter(_silent)
    try:
        with torch.compiler.set_stance("force_eager"):
            with _seeded_fake_mode()(allow_non_fake_inputs=True) as mode:
                yield mode
    finally:
        _FAKE_LOG.removeFilter(_silent)


_FAKE_LOG = logging.getLogger("torch._subclasses.fake_tensor")


def _silent(record: logging.LogRecord) -> bool:
    return False


def _seeded_fake_mode() -> Any:
    """FakeTensorMode, noting in ``drew`` whether it ran an op tagged as drawing from a
    random generator (made on first use: the import is slow)."""
    if not _SEEDED_FAKE:
        from torch._subclasses.fake_tensor import FakeTensorMode

        class _SeededFake(FakeTensorMode):
            drew = False

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if torch.Tag.nondeterministic_seeded in func.tags:
                    self.drew = True
                return super().__torch_dispatch__(func, types, args, kwargs)

        _SEEDED_FAKE.append(_SeededFake)
    return _SEEDED_FAKE[0]


# Per sequence group (an RNN call on one unbatched sequence, keyed without the sequence's
# length: mode, module, the sequence's (D,), dtype and device, the other arguments): its
# first op, which the calls of every length are recorded as (see _Op.fold_op).
_SEQUENCE_OPS: dict[tuple[Any, ...], _Op] = {}


def _group_sequences(op: _Op, key: tuple[Any, ...], mode: Any) -> None:
    """Record RNN op ``op`` (its key ``key``, made in grad/autocast ``mode``) as the op of
    its sequence group: calls on sequences of different lengths land in one group of the
    round, which runs as one packed call (``_Op._packed_parts``).  The op of each length
    keeps its own per-example outputs (shapes) and Lazy values."""
    x = key[2]
    if type(x) is not _Meta:
        return  # (no sequence of one example's own: left to a group per shape)
    group = (mode, key[0], key[1], (_SEQUENCE, x.shape[1:], x.dtype, x.device), *key[3:])
    first = _SEQUENCE_OPS.get(group)
    if first is None:
        first = _SEQUENCE_OPS[group] = op
        op.padded_call = op._packed_parts
        op.ragged_call = op._packed_ragged
    op.fold_op = first


_SEQUENCE = "a sequence of any length"


# Per group of calls that may differ in their values' shapes (tables._PADDED; keyed by mode,
# the key with each meta's sizes left out): its first op.
_PADDED_OPS: dict[tuple[Any, ...], _Op] = {}


def _group_padded(op: _Op, key: tuple[Any, ...], mode: Any) -> None:
    """Record ``op`` (a call of ``tables._PADDED``: matmul, softmax, mean) as the op of the
    calls that differ from it only in their values' sizes: attention over memories of
    several lengths then makes one group per step, which runs as one call on the values
    padded (``_Op._padded_parts``), not one group per length.  The op of each shape keeps its
    own outputs and Lazy values; the group op learns each shape's outputs here."""
    if op.mode not in (_DIRECT, _VMAP) or op.looped:
        return  # (a group under vmap runs on any sizes too)
    if not (
        op.single
        or op.transformer
        or (op.fn in _TWO_OUTPUTS and len(op.outs) == 2)
        or (op.fn in _SPLITS and len({m.shape for m in op.outs}) == 1)
    ):
        return
    slots = sorted(_slots((op.args, op.kwargs)), key=lambda s: s.i)
    if not slots or any(s.ragged or s.meta is None for s in slots):
        return
    if any(m.layout is not torch.strided for m in [*(s.meta for s in slots), *op.outs]):
        return  # (a sparse value cannot be padded)
    how = _PADDED[op.fn] if op.kind == "torch" else "keys" if op.transformer else "zeros"
    dim = None
    if how in ("cat", "index"):
        if not (_cat_pads_last(op) if how == "cat" else _index_from_start(op)):
            return  # (padding would land inside a value, or be read)
        how = "zeros"
    elif op.fn in _ARG_EXTREMES:
        given = dict(zip(("dim", "keepdim"), op.args[1:]), **op.kwargs)
        dim, keepdim = given.get("dim"), given.get("keepdim", False)
        if dim is None and slots[0].meta.ndim == 1 and keepdim is False:
            dim = 0  # (a value of one dim: its flat index is its index in that dim)
        if len(slots) != 1 or type(dim) is not int or type(keepdim) is not bool:
            return
    elif how == "split":
        pos, name, default = _DIM_OPS[op.fn]
        dim = op.kwargs.get(name, op.args[pos] if len(op.args) > pos else default)
        if type(dim) is not int or len(slots) != 1 or set(op.kwargs) - {name}:
            return
    elif how not in ("zeros", "keys"):
        pos, name, _ = _DIM_OPS[op.fn]
        dim = op.kwargs.get(name, op.args[pos] if len(op.args) > pos else None)
        rest = [a for i, a in enumerate(op.args) if i != pos and type(a) is not _Slot]
        # (F.softmax passes its _stacklevel and dtype=None on as keywords)
        keeps = how == "mean" or op.fn in _TWO_OUTPUTS
        allowed = {name, "_stacklevel"} | ({"keepdim"} if keeps else set())
        if (
            type(dim) is not int
            or not set(op.kwargs) - {"dtype"} <= allowed
            or op.kwargs.get("dtype") is not None
            or any(type(a) is not bool for a in rest)
        ):
            return  # (no dim, several dims, a dtype: left to a group per shape)
    parts = []
    for p in key:
        if type(p) is _Meta:
            parts.append((_SIZES, *_sizeless(p)))
        elif type(p) is tuple and len(p) == 2 and p[0] in (list, tuple) and type(p[1]) is tuple:
            # a list argument (torch.cat's): its values' metas without their sizes
            if any(type(x) is tuple and any(type(y) is _Meta for y in x) for x in p[1]):
                return  # (metas nested deeper)
            parts.append(
                (p[0], tuple([(_SIZES, *_sizeless(x)) if type(x) is _Meta else x for x in p[1]]))
            )
        elif type(p) is tuple and any(type(x) is _Meta for x in p):
            return  # (metas inside a list or tuple)
        else:
            parts.append(p)
    # Which dims are 1 is part of the key: a value that broadcasts in one call would be
    # padded in another (and not broadcast).  So are the outputs' ranks.
    group = (mode, op.mode, *parts, tuple([_sizeless(m) for m in op.outs]))
    first = _PADDED_OPS.get(group)
    if first is None:
        first = _PADDED_OPS[group] = op
        op.padding = (how, dim)
        if how == "keys":  # (no ragged call: rows of several lengths run in parts)
            op.padded_call = functools.partial(op.transformer.parts, op)
        else:
            op.padded_call = op._padded_parts
            op.ragged_call = op._ragged
    first.part_outs[tuple(s.meta.shape for s in slots)] = tuple(m.shape for m in op.outs)
    op.fold_op = first


_SIZES = "a value of any sizes"


def _cat_pads_last(op: _Op) -> bool:
    """Whether ``op`` is torch.cat of shared tensors and, last, one per-example value (along
    an int dim): padding that value at its end pads the output at its end."""
    args, kwargs = op.args, op.kwargs
    if not args or type(args[0]) not in (list, tuple) or set(kwargs) - {"dim"} or len(args) > 2:
        return False
    items = args[0]
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    return (
        type(dim) is int
        and bool(items)
        and type(items[-1]) is _Slot
        and all(isinstance(t, torch.Tensor) for t in items[:-1])
    )


def _index_from_start(op: _Op) -> bool:
    """Whether ``op`` is an index of a per-example value that reads no padding past a
    shorter value's end and keeps the padding at the end: ints >= 0 (``x[i]``, row i),
    new dims and Ellipsis (``x[None]``, ``x[..., None]``), and slices that start at 0 or
    further on, step forward and stop anywhere (``x[:, :d]``, the query part of a fused
    projection; ``x[1:]``, ``x[:-1]``: each value's own part of the padded value is a
    prefix of that part of it, cut to its recorded length).  Not a slice that starts from
    the end (``x[-2:]`` would read the padding), nor a tensor index."""
    args = op.args
    if len(args) != 2 or op.kwargs or type(args[0]) is not _Slot:
        return False
    index = args[1]
    parts = index if type(index) is tuple else (index,)
    for p in parts:
        if type(p) is int:
            if p < 0:
                return False
        elif type(p) is slice:
            start, stop, step = p.start, p.stop, p.step
            if (
                (start is not None and (type(start) is not int or start < 0))
                or (stop is not None and type(stop) is not int)
                or (step is not None and (type(step) is not int or step <= 0))
            ):
                return False
        elif p is not None and p is not Ellipsis:
            return False
    return True


def _sizeless(m: _Meta) -> tuple[Any, ...]:
    """A meta without its sizes: its rank, dtype, device and which dims are 1."""
    return (m.ndim, m.dtype, m.device, tuple([n == 1 for n in m.shape]))


_FAST: dict[int, Callable[..., Any]] = {k: _make_fast(k) for k in range(1, 7)}


def _py_fast(rec: _Recorder, fn: Any, kind: str, args: tuple[Any, ...]) -> Any:
    return _FAST[len(args)](rec, fn, kind, args)


# The fast path of _Recorder.record (fold/_clazy.c's, or the generated Python recorders)
# and the most arguments it takes.
_fast_path = _py_fast if _C is None else _C.fast


_FAST_MAX = len(_FAST) if _C is None else _C.MAX_FAST


# Modules whose forward is (input, hx=None): a call with keywords runs as the positional one.
_SEQUENCE_MODULES = (nn.RNNBase, nn.RNNCellBase)


def _positional(args: list[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """``rnn(x, hx=h)``, ``cell(input=x, hx=h)``: the call template as ``(x, h)`` (the same
    slots, so the recorded values keep their order), for the batched modes that read the
    input and state by position (a packed RNN, a cell's own batched call); as given where
    other keywords remain."""
    rest = dict(kwargs)
    new = list(args)
    if not new and "input" in rest:
        new.append(rest.pop("input"))
    if len(new) == 1 and "hx" in rest:
        new.append(rest.pop("hx"))
    return (new, rest) if not rest else (args, kwargs)
