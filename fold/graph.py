"""Recording: the :class:`Fold` graph.

Recording is the user's inner loop.  A Fold keeps, per signature (op, argument kinds), a
dict from the arguments (as plain ints and numbers) to the node's handle: insertion order is
node order, so the memo IS the signature's node list, and recording a node is one dict
lookup and one insertion.  The code that does it is generated once per (op, argument types)
from ONE template (:func:`_recorder_source`): ``Fold.add`` dispatches to it by op, and
``Fold.op`` recorders are it, so every way of recording runs the same logic.  Where the C
fast path is built (``fold/_crecord.c``), a recorder of node, number and list arguments runs
that logic's common branch in C and hands every other call to the generated one.  Nothing is
computed until :meth:`Fold.apply` (``fold.run``); ``summary``/``to_networkx``/``draw`` are
``fold.inspect``'s.
"""

from __future__ import annotations

import array
import itertools
import os
import struct
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fold import inspect as _inspect
from fold import run as _run
from fold._encoding import (
    DEPTH_AFTER,
    ID_SHIFT,
    KEY_SOURCE,
    LIST,
    LIST_INLINE,
    MAX_SPLIT,
    NODE,
    SCALAR_KINDS,
    TENSOR,
    classify,
    convert,
    depth_of,
    float_key,
    is_tensor_kind,
    key_rows,
    list_handles,
    node_id,
    packed,
    split_code,
)
from fold.arrays import GraphArrays
from fold.errors import FoldError, op_name
from fold.node import _NODE_TYPES, _UNUSED, Node, foreign_node, node_type_for
from fold.scheduler import SCHEDULERS, Plan

__all__ = ["Fold"]

_MISSING = object()

# The C fast path of the generated recorders (fold/_crecord.c), where it was compiled at
# install (setup.py builds it as an optional extension): it runs the first branch of a
# recorder for node, number, list and literal tensor arguments and hands every other call
# to the Python recorder, so both give the same graph.  FOLD_RECORDER=python records
# without it.  Its kind of a literal tensor argument (TENSOR here is a string):
_C_TENSOR = 5
try:
    from fold._crecord import Counter as _Counter
    from fold._crecord import Recorder as _CRecorder
except ImportError:  # not compiled: the generated Python recorders alone
    _CRecorder = _Counter = None
if os.environ.get("FOLD_RECORDER") == "python":
    _CRecorder = _Counter = None
# Node ids: itertools.count(), or the C Counter, which a renewed Fold resets in place.
_ids_counter: Any = itertools.count if _Counter is None else _Counter


def _recorder_source(kinds: list[Any], exact: list[bool], outputs: int | None) -> str:
    """The source of a recorder for one argument pattern: THE recording logic.

    ``kinds`` per argument: NODE, INT, FLOAT, BOOL, LIST or TENSOR; ``exact[i]`` whether its
    type needs no conversion (a Node of this Fold, an ``int``/``float``/``bool``, a list, a
    tensor).  The
    function checks the argument types (anything else goes to ``generic``, which classifies
    it or raises), builds the memo key (node handles as plain ints, or, where every argument
    is a node, all of them packed into one bytes object: a tuple of plain ints is untracked
    by the garbage collector at its first collection, while one holding Nodes would stay in
    the oldest generation and set off full collections of the heap; ``-0.0``
    as its own key; a literal tensor as its id, the tensor itself kept in ``targs``), looks
    the node up, records it if new (depth: one step after the deepest node argument), and
    returns the handle, whole or split.  The source uses fixed templates and integer
    constants only; it defines ``make(state...)``, which returns the recorder over one
    Fold's state (its memo or signatures by shape, id counter, Node class).
    """
    k = len(kinds)
    names = [f"a{i}" for i in range(k)]
    lines: list[str] = []
    keys, fast, vals, nodes, lists, tensors = [], [], [], [], [], []
    for i, (kind, ex) in enumerate(zip(kinds, exact)):
        a = names[i]
        if kind == TENSOR:
            tensors.append(a)
            vals.append(a)
        else:
            vals.append(f"key[{i}]")
        if kind == NODE:
            nodes.append(i)
        elif kind == LIST:
            lists.append(i)
        # The key is built inline, in one tuple display: no local per argument.
        keys.append(KEY_SOURCE[kind].format(a=a, i=i) if ex else f"n{i}({a})")
        fast.append(LIST_INLINE.format(a=a, i=i) if kind == LIST else keys[-1])
    # Depth: one step after the deepest node argument or list element (an empty list adds
    # nothing: DEPTH_AFTER of -1 is 0).
    # (max's default= keyword costs more than the test of an empty list.)
    parts = [f"key[{i}]" for i in nodes]
    parts += [f"(max({names[i]}) if {names[i]} else -1)" for i in lists]
    if not parts:
        depth = "0"
    elif len(nodes) == k:  # node arguments only
        depth = DEPTH_AFTER.format(f"max({', '.join(names)})" if k > 1 else names[0])
    else:
        depth = DEPTH_AFTER.format(f"max({', '.join(parts)})" if len(parts) > 1 else parts[0])
    if tensors:  # the signature depends on the tensors' shapes: found per call by shape
        skey = ", ".join(f"{a}.shape, {a}.dtype" for a in tensors)
        lines += [
            f"e = sigs.get(({skey},))",
            "if e is None:",
            f"    e = new_sig(({', '.join(tensors)},))",
            "memo, targs = e",
        ]
    # The key: built the fast way; where that raises (an element that is no node of this
    # Fold, a handle beyond int64), the checked way, which raises a FoldError.
    comma = "," if k == 1 else ""
    if packed(kinds):  # one bytes object (see fold._encoding.packed)
        key, checked = f"pack({', '.join(names)})", f"deep({', '.join(names)})"
    else:
        key, checked = f"({', '.join(fast)}{comma})", f"({', '.join(keys)}{comma})"
    if key == checked:
        lines.append(f"key = {key}")
    else:
        lines += ["try:", f"    key = {key}", "except Exception:", f"    key = {checked}"]
    lines += ["h = memo.get(key)", "if h is None:"]
    lines.append(f"    h = memo[key] = {depth} | next(ids) << {ID_SHIFT}")
    if tensors:
        lines.append("    targs.append((" + ", ".join(vals) + ("," if k == 1 else "") + "))")
    if outputs is None:
        lines.append("return T(h)")
    elif outputs == 2:
        lines += ["b = h | code", "return T(b), T(b | 1)"]
    else:
        lines += ["b = h | code", f"return tuple([T(b | j) for j in range({outputs})])"]
    checks = " and ".join([f"type({a}) is t{i}" for i, a in enumerate(names)] + ["not rest"])
    params = "".join(f"{a}=_MISSING, " for a in names)
    given = "(" + ", ".join(names) + ("," if k == 1 else "") + ")"
    body = "\n".join("            " + line for line in lines)
    free = ["_MISSING", "ids", "T", "code", "generic", "fk"]
    free += [f"t{i}" for i in range(k)] + [f"n{i}" for i, ex in enumerate(exact) if not ex]
    free += [f"l{i}" for i in lists] + (["nodes_only", "q"] if lists else [])
    free += ["sigs", "new_sig"] if tensors else ["memo"]
    free += ["pack", "deep"] if packed(kinds) else []
    return (
        f"def make({', '.join(free)}):\n"
        f"    def record({params}*rest):\n"
        f"        if {checks}:\n"
        f"{body}\n"
        f"        return generic(*[a for a in {given} if a is not _MISSING], *rest)\n"
        f"    return record\n"
    )


_FACTORIES: dict[tuple[Any, ...], Callable[..., Any]] = {}
# (op name, argument types, outputs) -> (kinds, factory, converters): the classification of
# a call, kept for the next Fold (a training loop makes one per step).  The Fold's own Node
# class appears in the key as _THIS_FOLD.
_PATTERNS: dict[tuple[Any, ...], _Pattern] = {}
_THIS_FOLD = object()


class _Pattern:
    """What a recorder needs of its argument pattern (op, argument types, outputs), worked
    out once: the kinds, the generated recorder's factory, conversions, the positions of
    literal tensors and of lists, the packing of an all-node key, the split code, the name,
    and the C recorder's kinds (None where the C path does not take the pattern)."""

    __slots__ = ("kinds", "make", "convs", "tpos", "lists", "packing", "code", "name", "c_kinds")

    def __init__(
        self,
        op: Any,
        kinds: list[Any],
        exact: list[bool],
        types: tuple[type, ...],
        outputs: int | None,
    ) -> None:
        self.kinds = kinds
        self.make = _recorder_factory(kinds, exact, outputs)
        self.convs = tuple(convert(k) for k, ex in zip(kinds, exact) if not ex)
        self.tpos = tuple(i for i, k in enumerate(kinds) if k == TENSOR)
        self.lists = tuple(i for i, k in enumerate(kinds) if k == LIST)
        self.packing: tuple[Any, ...] = (
            (struct.Struct(f"{len(kinds)}q").pack, _too_deep) if packed(kinds) else ()
        )
        self.code = 0 if outputs is None else split_code(outputs)
        self.name = f"record_{op_name(op)}"
        fits = (
            not self.convs
            and 0 < len(kinds) <= 64
            and all(t is list for t, k in zip(types, kinds) if k == LIST)
        )
        self.c_kinds = tuple(_C_TENSOR if k == TENSOR else k for k in kinds) if fits else None


def _recorder_factory(kinds: list[Any], exact: list[bool], outputs: int | None) -> Any:
    """``make(*state)`` -> a recorder for this argument pattern over one Fold's state.

    Compiled once per pattern and process; a Fold's recorder is then one closure, cheap
    enough for a training loop that records a new Fold every step."""
    key = (tuple(kinds), tuple(exact), outputs)
    make = _FACTORIES.get(key)
    if make is None:
        env: dict[str, Any] = {}
        exec(compile(_recorder_source(kinds, exact, outputs), "<fold recorder>", "exec"), env)
        if len(_FACTORIES) > 1024:
            _FACTORIES.clear()
        make = _FACTORIES[key] = env["make"]
    return make


class Fold:
    """A dynamic-batching computation graph.

    Record per-example ops with :meth:`add`; :meth:`apply` runs the whole graph, executing
    each group of nodes that share a step and a signature (op, arity, argument kinds, literal
    tensor shapes/dtypes) as one batched call.

    Example::

        class Exp:
            def exp(self, x):
                return x * 2

        f = Fold()
        x = 1
        nodes = []
        for _ in range(4):
            x = f.add("exp", x)
            nodes.append(x)
        (out,) = f.apply(Exp(), [nodes])   # tensor([ 2,  4,  8, 16])

    Every node recorded in the Fold runs on ``apply``, whether or not an output list names it.

    Args:
        strategy: the scheduler. ``"auto"`` (default) takes the depth schedule, or the
            agenda's or lockstep's where one is estimated to cost less: fewer groups, unless
            its groups copy more (see ``fold.scheduler.auto``);
            ``"depth"`` groups same-signature nodes at equal depth; ``"agenda"`` runs ready
            nodes DyNet-style, merging same-signature nodes of different depths (e.g. a
            classifier on sequences of different lengths) into fewer groups, at a higher
            planning cost; ``"lockstep"`` advances the examples one step of each op's own
            chain at a time (a shift-reduce parser's transitions, as hand-written batching
            runs them).  See ``fold.scheduler``.
    """

    def __init__(self, strategy: str = "auto") -> None:
        if strategy not in SCHEDULERS:
            raise FoldError(
                f"Fold(strategy={strategy!r}): unknown strategy; expected one of {sorted(SCHEDULERS)}."
            )
        if _LEFT and type(self) is Fold:  # what a dropped Fold left (see __del__)
            try:
                left = _LEFT.pop()
            except IndexError:  # another thread took it
                left = None
            if left is not None and self._adopt(left, strategy):
                return
        self.strategy = strategy
        # Per signature (op, argument kinds): its nodes as a dict from arguments to handle
        # (see the module docstring), and for signatures with literal tensors (whose memo
        # keys hold tensor ids) the arguments themselves.
        self.signatures: list[tuple[Any, tuple[Any, ...]]] = []
        self._memos: list[dict[Any, int]] = []
        self._targs: list[list[tuple[Any, ...]] | None] = []
        self._sig_ids: dict[tuple[Any, tuple[Any, ...]], int] = {}
        self._ids = _ids_counter()  # node ids, a topological order
        self.nobatch_ids: set[int] = set()
        # Per group of the last apply: (step, op name, size, (shape, dtype) of each argument).
        self.last_run: list[tuple[int, str, int, tuple[Any, ...]]] | None = None
        self._node_type: type[Node] = node_type_for(self)
        # Generated recorders per (op, argument types, outputs); per op, the one add() tries
        # first; per (op, outputs), the recorder Fold.op hands out.
        self._generated: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self._by_op: dict[Any, Callable[..., Any]] = {}
        self._recorders: dict[tuple[Any, int | None], Callable[..., Any]] = {}
        self._flat_cache: tuple[int, list[Any], list[int], list[int]] | None = None
        self._snapshot: tuple[tuple[int, int], GraphArrays] | None = None
        self._renewed = False  # see _renew
        # The weak reference to this Fold its generated recorders call back through (one
        # cell: a Fold that takes a dropped Fold's recorders points them at itself, _adopt);
        # the boxes of the recorders Fold.op handed out before their first call; weak
        # references to the snapshots made (see __del__).
        self._me = [weakref.ref(self)]
        self._boxes: list[list[Any]] = []
        self._views: list[Any] = []
        # What a dropped Fold may leave (see __del__): every op a name; the references to
        # the Node class its kept recorders and _node_type hold; the recorders made again.
        self._named = True
        self._c = _CRecorder  # (tests compare the recorders with and without it)
        self._holds = 1
        self._remake: list[tuple[Any, ...]] = []
        global _OWN_STATE
        if _OWN_STATE is None:
            _OWN_STATE = frozenset(self.__dict__)

    # ------------------------------------------------------------------ kept recorders
    # A per-sample training loop makes a Fold per step, and each Fold's first call of each op
    # made its recorder (``_specialise``, ``_tensor_signatures``): with 32 MNIST samples a
    # step, 4% of the step.  So a dropped Fold leaves its signatures and the recorders of its
    # ops named by a string to the next Fold, emptied (``_renew``).  Only what no one else
    # can reach is kept: the Fold leaves nothing while a snapshot of it is alive (a
    # snapshot reads the lists that are emptied), and the next Fold takes what was left only
    # where nothing but the left state refers to its Node class (a handle of the dropped
    # Fold still alive) or to a kept recorder (one a caller of Fold.op still holds);
    # otherwise it starts afresh.  The recorders of ops with node or list arguments, whose
    # types and checks name the Node class, are made again.

    def __del__(self) -> None:
        try:
            if len(_LEFT) < _LEFT_MAX and type(self) is Fold:
                left = self._leave()
                if left is not None:
                    _LEFT.append(left)
        except Exception:  # (interpreter shutdown, a Fold whose __init__ raised): none left
            return

    def _leave(self) -> dict[str, Any] | None:
        """This dropped Fold's state, emptied, with the recorders the next Fold may take (see
        above); None where it has more than ``_LEFT_SIGNATURES`` signatures, an op that is
        not a name (a callable kept would keep its object alive), or a live snapshot."""
        if not self._named or len(self.signatures) > _LEFT_SIGNATURES:
            return None
        if not self.__dict__.keys() <= _OWN_STATE:  # (the caller's own attributes: not kept)
            return None
        self._snapshot = None
        for r in self._views:
            if r() is not None:
                return None
        if sys.getrefcount(self._memos) != 2:  # (a copy of this Fold holds them too)
            return None
        for box in self._boxes:  # Fold.op's recorders fall back to this Fold: it is gone
            box[0] = _no_recorder
        generated, by_op = self._generated, self._by_op
        for key in self._remake:  # node or list arguments: made again by the next Fold
            fn = generated.pop(key)
            if by_op.get(key[0]) is fn:
                del by_op[key[0]]
        self._renew()
        self._recorders, self._boxes, self._views, self._remake = {}, [], [], []
        return self.__dict__

    def _adopt(self, left: dict[str, Any], strategy: str) -> bool:
        """Take the state a dropped Fold left (``_leave``); False where its Node class or a
        kept recorder is referred to from elsewhere: this Fold starts afresh."""
        T = left["_node_type"]  # (+1 where the pool of Node classes holds it)
        if (
            left["_c"] is not _CRecorder
            or sys.getrefcount(T) != _UNUSED - (T not in _NODE_TYPES) + left["_holds"]
        ):
            return False
        firsts = set(map(id, left["_by_op"].values()))
        for fn in left["_generated"].values():
            # Held by _generated, _by_op where it is its op's first, the loop, the call.
            if sys.getrefcount(fn) != 3 + (id(fn) in firsts):
                return False
            if type(fn) is _CRecorder and fn.fallback is None:  # cleared by the collector
                return False
        left["strategy"] = strategy
        self.__dict__ = left
        ref = weakref.ref(self)
        left["_me"][0] = T._fold_ref = ref
        return True

    # ------------------------------------------------------------------ recording
    def add(self, op: str | Callable[..., Any], *args: Any) -> Node:
        """Record ``op(*args)`` and return a handle on its value.

        ``op`` is the name of a method of the object later given to :meth:`apply`, or a
        callable (grouped by identity).  Arguments are Nodes of this Fold, Python
        ``int``/``float``/``bool`` (batched into 1-D tensors; ints become ``torch.long``), or
        batch-of-one tensors of shape ``(1, ...)`` (concatenated along dim 0).  Recording the
        same op on the same arguments twice returns the same node.  In a hot loop,
        :meth:`op` records the same with less overhead per call.
        """
        try:
            rec = self._by_op.get(op)  # the op's recorder, for its first argument types
        except TypeError:  # an unhashable op: _record says so
            rec = None
        if rec is None:
            return self._record(op, None, args)
        return rec(*args)

    def op(self, op: str | Callable[..., Any], outputs: int | None = None) -> Callable[..., Any]:
        """A recorder bound to ``op``, for hot recording loops.

        ``rec = f.op("node", outputs=2)`` then ``h, c = rec(lh, lc, rh, rc)`` records the same
        node as ``f.add("node", lh, lc, rh, rc).split(2)``, with about half the Python
        overhead (no op lookup, no separate ``split`` call).  With ``outputs=None`` it returns
        the whole node like ``add``.  Nodes are shared with ``add``: both memoise into the
        same signature.
        """
        try:
            cached = self._recorders.get((op, outputs))
        except TypeError:
            cached = None  # an unhashable op: _check_op says so
        if cached is not None:
            return cached
        self._check_op(op)
        if outputs is not None and (type(outputs) is not int or not 1 <= outputs <= MAX_SPLIT):
            raise FoldError(
                f"Fold.op({op_name(op)!r}, outputs={outputs!r}): outputs must be None or an int "
                f"from 1 to {MAX_SPLIT}, the number of tensors the op returns."
            )
        # Until it has seen argument types, the recorder classifies; the first specialised
        # recorder replaces it in the cache, and `box` lets a caller that kept this one reach
        # that specialised one too (a weak reference: no cycle through the Fold's cache).
        box: list[Callable[[], Any]] = [_no_recorder]
        ref = weakref.ref(self)
        self._boxes.append(box)

        def record(*args: Any) -> Any:
            s = box[0]()
            if s is not None:
                return s(*args)
            return _alive(ref, op)._record(op, outputs, args, box)

        record.__name__ = record.__qualname__ = f"record_{op_name(op)}"
        self._recorders[(op, outputs)] = record
        return record

    def _record(
        self, op: Any, outputs: int | None, args: tuple[Any, ...], box: list[Any] | None = None
    ) -> Any:
        """Record through the generated recorder for these argument types, made on first use."""
        types = tuple(map(type, args))
        try:
            fn = self._generated.get((op, types, outputs))
        except TypeError:
            fn = None  # an unhashable op: _check_op says so
        if fn is None:
            fn = self._specialise(op, args, types, outputs)
        if box is not None and box[0] is _no_recorder:
            box[0] = weakref.ref(fn)
            self._recorders[(op, outputs)] = fn
        return fn(*args)

    def _specialise(
        self, op: Any, args: tuple[Any, ...], types: tuple[type, ...], outputs: int | None
    ) -> Callable[..., Any]:
        """Classify the arguments (a FoldError for bad ones) and generate their recorder.

        What depends on the pattern alone (op, argument types, outputs) is worked out once
        per process (``_Pattern``); per Fold, only its state is bound: a training loop makes
        a Fold per step, and its first ``add`` of each op comes here."""
        T = self._node_type
        # Kept by op name and types with this Fold's Node class as a marker: a key holding
        # the class would keep it from going back to the pool (a new class every step).
        pkey = (op, tuple([_THIS_FOLD if t is T else t for t in types]), outputs)
        pattern = _PATTERNS.get(pkey) if type(op) is str else None
        if pattern is None:
            self._check_op(op)
            kinds = [self._classify(op, pos, a) for pos, a in enumerate(args)]
            exact = [
                type(a) is T or type(a) in SCALAR_KINDS or k in (TENSOR, LIST)
                for a, k in zip(args, kinds)
            ]
            pattern = _Pattern(op, kinds, exact, types, outputs)
            if type(op) is str:  # for the next Fold (a training loop makes one per step)
                if len(_PATTERNS) > 1024:
                    _PATTERNS.clear()
                _PATTERNS[pkey] = pattern
        kinds = pattern.kinds
        me = self._me

        def generic(*a: Any) -> Any:  # other types or arity: classified afresh
            return _alive(me[0], op)._record(op, outputs, a)

        if pattern.tpos:
            sigs: dict[Any, Any] = {}
            new_sig = self._tensor_signatures(op, kinds, sigs, pattern.tpos)
            new_sig(tuple([args[i] for i in pattern.tpos]))  # these shapes' signature now
            tail: tuple[Any, ...] = (sigs, new_sig)
        else:
            tail = (self._memos[self._signature(op, tuple(kinds))],)
        checks: tuple[Any, ...] = tuple([self._list_key(op, i) for i in pattern.lists])
        if checks:  # the inline list key's type test and array constructor
            checks += (frozenset((T,)).issuperset, array.array)
        # The state, in the order of make's parameters (see _recorder_source).
        tail += pattern.packing
        code = pattern.code
        fn = pattern.make(
            _MISSING, self._ids, T, code, generic, float_key, *types, *pattern.convs, *checks, *tail
        )
        fn.__name__ = fn.__qualname__ = pattern.name
        if _CRecorder is not None and pattern.c_kinds is not None:
            if pattern.tpos:  # the memo of the tensors' shapes: in sigs (tail[0])
                fn = _CRecorder(
                    fn, pattern.c_kinds, types, T, {}, self._ids, outputs, code, pattern.name, sigs
                )
            else:
                fn = _CRecorder(
                    fn, pattern.c_kinds, types, T, tail[0], self._ids, outputs, code, pattern.name
                )
        if len(self._generated) > 4096:  # bounded: e.g. a new lambda recorded per add
            self._generated.clear()
            self._by_op.clear()
            self._holds, self._remake = 1, []
        self._generated[(op, types, outputs)] = fn
        if T in types or pattern.lists:  # its types or checks name T: see _leave
            self._remake.append((op, types, outputs))
        else:  # the Python recorder's T, and the C recorder's
            self._holds += 1 + (type(fn) is _CRecorder)
        if outputs is None:
            self._by_op.setdefault(op, fn)
        return fn

    def _list_key(self, op: Any, pos: int) -> Callable[[list[Any]], bytes]:
        """The memo key of a list argument at ``pos``: the bytes of its int64 handles (see
        ``KEY_SOURCE``), once every element is checked to be a node of this Fold (a
        FoldError names the element)."""
        ok = frozenset((self._node_type,))

        def list_key(a: list[Any]) -> bytes:
            if ok.issuperset(map(type, a)):
                try:
                    return array.array("q", a).tobytes()
                except OverflowError:  # as handles_array: a graph deeper than int64 holds
                    raise FoldError(
                        f"Fold.add({op_name(op)!r}, ...): argument {pos}: the graph is deeper "
                        "than int64 handles can describe (about 500k steps). Fix: split the "
                        "computation into several Folds."
                    ) from None
            j, x = next((j, x) for j, x in enumerate(a) if type(x) not in ok)
            what = (
                "a Node of another Fold" if isinstance(x, Node) else f"of type {type(x).__name__}"
            )
            raise FoldError(
                f"Fold.add({op_name(op)!r}, ...): argument {pos} is a list whose element {j} "
                f"is {what}; a list argument holds nodes of this Fold (any number, 0 "
                "included), received by the op as a fold.Ragged. Fix: pass the nodes this "
                "Fold's add() returned."
            )

        return list_key

    def _classify(self, op: Any, pos: int, a: Any) -> Any:
        """The kind of argument ``a``, TENSOR for any literal tensor; FoldError if bad."""
        t = type(a)
        if t is self._node_type:
            return NODE
        if t in SCALAR_KINDS:
            return SCALAR_KINDS[t]
        if isinstance(a, Node):
            raise foreign_node(op, pos, a)
        kind, _ = classify(op, pos, a)  # raises for anything fold cannot take
        if kind == LIST:
            self._list_key(op, pos)(a)  # raises for an element that is no node of this Fold
        return TENSOR if is_tensor_kind(kind) else kind

    def _tensor_signatures(
        self, op: Any, kinds: list[Any], sigs: dict[Any, Any], tpos: tuple[int, ...]
    ) -> Callable[[tuple[torch.Tensor, ...]], tuple[dict[Any, int], list[Any]]]:
        """For a recorder with literal tensors (at positions ``tpos``): the signature of given
        tensors' shapes.

        Its entries are keyed by the tensors' whole shapes and dtypes, and only shapes that
        pass the batch-of-one check get in, so the recorder checks nothing on a hit."""
        me = self._me

        # An op that takes a group's parts of several shapes at once (padded_call, see
        # fold.executor) keys its literal tensors by dtype alone: one signature for them all.
        any_shape = type(op) is not str and getattr(op, "padded_call", None) is not None

        def new_sig(tensors: tuple[torch.Tensor, ...]) -> tuple[dict[Any, int], list[Any]]:
            f = _alive(me[0], op)
            full = list(kinds)
            for p, t in zip(tpos, tensors):
                k = classify(op, p, t)[0]  # raises: not a batch-of-one tensor
                full[p] = (None, k[1]) if any_shape else k
            sid = f._signature(op, tuple(full))
            entry = (f._memos[sid], f._targs[sid])
            sigs[tuple(x for t in tensors for x in (t.shape, t.dtype))] = entry
            return entry

        return new_sig

    def _check_op(self, op: Any) -> None:
        if type(op) is not str and not callable(op):
            raise FoldError(
                f"Fold.add: op is a {type(op).__name__} ({op!r}); expected a method name (str) "
                "or a callable."
            )
        try:
            hash(op)
        except TypeError:
            raise FoldError(
                f"Fold.add: op {op_name(op)} is not hashable, so nodes of it cannot be grouped. "
                "Fix: pass a function, a bound method, or a method name."
            ) from None

    def _signature(self, op: Any, kinds: tuple[Any, ...]) -> int:
        sig_key = (op, kinds)
        sid = self._sig_ids.get(sig_key)
        if sid is None:
            sid = len(self.signatures)
            if type(op) is not str:
                self._named = False  # a dropped Fold leaves nothing: see _leave
            # Literal tensors: memo keys are tensor ids, so the arguments are kept here.
            targs = [] if any(map(is_tensor_kind, kinds)) else None
            try:  # the three lists in step, and the signature known, or none of it
                self.signatures.append(sig_key)
                self._memos.append({})
                self._targs.append(targs)
                self._sig_ids[sig_key] = sid
            except BaseException:  # KeyboardInterrupt, a signal handler's exception
                del self.signatures[sid:], self._memos[sid:], self._targs[sid:]
                self._sig_ids.pop(sig_key, None)
                raise
        return sid

    def __len__(self) -> int:
        return sum(map(len, self._memos))

    def _renew(self) -> None:
        """Empty the graph for a new one, keeping the signatures and generated recorders
        (autobatch's rounds, each recording the ops of the one before: a new Fold would make
        every op's recorder again).  Node ids start from 0 again, so the caller must hold
        none of the old graph's handles: one would name a node of the new graph."""
        for memo, targs in zip(self._memos, self._targs):
            if memo:  # (a round records a few of the signatures all rounds made)
                memo.clear()
                if targs is not None:
                    targs.clear()
        self.nobatch_ids.clear()
        self.last_run = None
        self._flat_cache = None
        self._snapshot = None
        self._renewed = True
        if type(self._ids) is not itertools.count:  # the C Counter every recorder holds
            self._ids.reset()
            return
        ids = self._ids = itertools.count()
        for fn in self._generated.values():
            if _CRecorder is not None and type(fn) is _CRecorder:
                fn.rebind(ids)
                fn = fn.fallback
            fn.__closure__[fn.__code__.co_freevars.index("ids")].cell_contents = ids

    # ------------------------------------------------------------------ views
    def snapshot(self) -> GraphArrays:
        """The graph as arrays (:class:`fold.arrays.GraphArrays`): what schedulers and the
        executor read.  Kept until a node is recorded or marked nobatch; it caches the plans
        made of it."""
        key = (len(self), len(self.nobatch_ids))
        cached = self._snapshot
        if cached is None or cached[0] != key:
            self._check_intact(key[0])
            sigs, memos, targs = self.signatures, self._memos, self._targs
            if self._renewed or not all(memos):
                # A call that raised after its signature was made (a list holding a node of
                # another Fold, a handle beyond int64) leaves it empty: it has no group; so
                # does a signature of an earlier graph of a renewed Fold (_renew), whose
                # signatures keep the order that graph made them in: the rest go in the
                # order of their first nodes (the chain plan takes each signature after
                # those it reads).
                keep = [i for i, m in enumerate(memos) if m]
                keep.sort(key=lambda i: node_id(next(iter(memos[i].values()))))
                sigs, memos, targs = ([x[i] for i in keep] for x in (sigs, memos, targs))
            arrays = GraphArrays(sigs, memos, targs, self.nobatch_ids, self._node_type, key[0])
            views = self._views = [r for r in self._views if r() is not None]
            views.append(weakref.ref(arrays))
            cached = self._snapshot = (key, arrays)
        return cached[1]

    def issued(self) -> int:
        """How many node ids this Fold handed out since it was made or emptied: the next
        node's id."""
        ids = self._ids  # (itertools.count's repr, "count(n)", names n, the next id it gives)
        return ids.issued if type(ids) is _Counter else int(repr(ids)[6:-1])

    def _check_intact(self, n: int) -> None:
        """Every node id handed out is a recorded node, and the per-signature lists are in
        step.  Recording from several threads at once breaks that (two threads that both miss
        the memo each take an id; one is lost), and so may an exception raised between a
        recorder's steps (a KeyboardInterrupt); the Fold cannot be applied then."""
        issued = self.issued()
        lists = {len(self.signatures), len(self._memos), len(self._targs), len(self._sig_ids)}
        if issued != n or len(lists) != 1:
            raise FoldError(
                f"apply: this Fold handed out {issued} node ids but holds {n} nodes: its "
                "recording was interrupted between two steps, or it was recorded from several "
                "threads at once. A Fold records from one thread at a time. Fix: record it "
                "again, one Fold per thread (or a lock around its add calls)."
            )

    def arrays(self) -> GraphArrays:
        """The same as :meth:`snapshot`."""
        return self.snapshot()

    def _flat(self) -> tuple[int, list[Any], list[int], list[int]]:
        """(nodes, args, sig, handles): per-node lists indexed by node id, built on demand."""
        n = len(self)
        cache = self._flat_cache
        if cache is None or cache[0] != n:
            args: list[Any] = [None] * n
            sig = [0] * n
            handles = [0] * n
            for sid, memo in enumerate(self._memos):
                rows = self._targs[sid]
                if rows is None:
                    rows = key_rows(memo, self.signatures[sid][1])
                for a, h in zip(rows, memo.values()):
                    nid = node_id(h)
                    args[nid] = a
                    sig[nid] = sid
                    handles[nid] = h
            cache = self._flat_cache = (n, args, sig, handles)
        return cache

    @property
    def args(self) -> list[tuple[Any, ...]]:
        """Per node id, its recorded arguments (node arguments as handles)."""
        return self._flat()[1]

    @property
    def sig(self) -> list[int]:
        """Per node id, its signature id (an index into ``signatures``)."""
        return self._flat()[2]

    @property
    def handles(self) -> list[int]:
        """Per node id, its whole handle (a plain int)."""
        return self._flat()[3]

    @property
    def depth(self) -> list[int]:
        """Per node, its depth: 0 without node arguments, else 1 + the deepest argument's."""
        return [depth_of(h) for h in self.handles]

    def op_of(self, nid: int) -> Any:
        """The op recorded as node ``nid``."""
        return self.signatures[self.sig[nid]][0]

    def node_args(self, nid: int) -> list[tuple[int, int]]:
        """(argument position, handle) of every node argument of node ``nid``, list elements
        included (one entry per element)."""
        kinds = self.signatures[self.sig[nid]][1]
        out = []
        for pos, (a, k) in enumerate(zip(self.args[nid], kinds)):
            if k == NODE:
                out.append((pos, a))
            elif k == LIST:
                out.extend((pos, x) for x in list_handles([a]).tolist())
        return out

    # ------------------------------------------------------------------ running
    def plan(self) -> Plan:
        """The schedule of this graph (a :class:`fold.scheduler.Plan`), as ``apply`` runs it.

        Kept until the graph changes (a node recorded or marked nobatch), per strategy, so
        applying one graph again (evaluation, a model at a time) plans once.
        """
        return _run.plan_of(self.snapshot(), self.strategy)

    def apply(
        self,
        obj: Any,
        lists: Sequence[Sequence[Any]],
        *,
        max_rows: int | Mapping[Any, int] | None = None,
        max_bytes: int | None = None,
        offload: str | None = None,
    ) -> list[torch.Tensor]:
        """Run the graph with the ops of ``obj`` and return one tensor per list in ``lists``.

        ``obj`` is any object with the op methods (an ``nn.Module`` or a plain class).  Each
        entry of ``lists`` is a list of nodes (result: their values concatenated along dim 0,
        in list order), a list of Python numbers (result: a 1-D tensor), or a list of
        batch-of-one tensors (result: their concatenation).  Results land on the device of
        ``obj``'s parameters (CPU if it has none).  Gradients flow back through the graph.

        Memory: ``max_rows`` (an int, or ``{op: int}``) runs every group in calls of at most
        that many nodes; ``max_bytes`` derives that number per group from the bytes of one
        node's arguments.  Values and gradients are the same.  ``offload="cpu"`` keeps the
        tensors autograd saves for backward in (pinned) host memory during the forward.
        """
        return _run.apply(self, obj, lists, max_rows, max_bytes, offload)

    # ------------------------------------------------------------------ inspection
    def summary(self) -> str:
        """The schedule: per step, each group's op, size and argument kinds or shapes.

        After an ``apply`` it shows the groups as they ran, with runtime argument shapes;
        before, the planned groups with their static argument kinds.
        """
        return _inspect.summary(self)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return f"Fold({len(self)} nodes, strategy={self.strategy!r})"

    def to_networkx(self) -> Any:
        """The graph as a ``networkx.DiGraph``.

        Node attributes: ``op`` (name), ``depth``, ``split`` (the n of ``split(n)`` its
        consumers use it with; 0 if they use it whole or it has none), ``nobatch``.  Edge
        attributes: ``arg`` (argument position) and ``out`` (the output index of the source
        that is used).
        """
        return _inspect.to_networkx(self)

    def draw(self, path: str) -> None:
        """Write a PNG of the graph to ``path``, nodes placed and coloured by step.

        Needs matplotlib (``pip install torch-fold[draw]``).
        """
        _inspect.draw(self, path)


# What dropped Folds left for the next ones (Fold.__del__, Fold._adopt).
_LEFT: list[dict[str, Any]] = []
# The names of a Fold's own state (set by the first Fold made): a dropped Fold that holds
# others (set by its caller: ``f.epoch = 3``, an ``apply`` wrapped) leaves nothing, so that
# they never reappear on the next Fold.
_OWN_STATE: frozenset[str] | None = None
_LEFT_MAX = 2
_LEFT_SIGNATURES = 64


def _too_deep(*args: Any) -> None:
    """Raised for node handles that do not fit a packed memo key (int64)."""
    raise FoldError(
        "Fold.add: the graph is deeper than int64 handles can describe (about 500k steps). "
        "Fix: split the computation into several Folds."
    )


def _no_recorder() -> None:
    """What a recorder's weak reference to its specialised version returns before one exists."""
    return None


def _alive(ref: Callable[[], Fold | None], op: Any) -> Fold:
    f = ref()
    if f is None:
        raise FoldError(
            f"recorder of {op_name(op)!r}: its Fold no longer exists. Fix: keep the Fold alive "
            "while recording, or take a recorder from the new Fold."
        )
    return f
