"""Recording: the :class:`Fold` graph, its :class:`Node` handles, and the eager :class:`Unfold`.

Recording is the user's inner loop, so :meth:`Fold.add` finds the node's signature with one
dict lookup keyed by the argument types, inserts the arguments (as plain ints and numbers)
into that signature's memo dict, which is also its node list, and returns an int handle;
:meth:`Fold.op` recorders do the same with less overhead per call.  Nothing is computed until
:meth:`Fold.apply`, which converts the graph to arrays (``fold.layout``), asks a scheduler
(``fold.scheduler``) for a plan and hands it to the executor (``fold.executor``).
"""

from __future__ import annotations

import itertools
import math
import numbers
import operator
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fold.errors import FoldError
from fold.scheduler import SCHEDULERS

__all__ = ["Fold", "Node", "Unfold", "node_id", "op_name"]

# Argument kind codes stored in a node's signature.  A literal tensor's kind is the tuple
# (shape[1:], dtype) instead, so nodes whose literal tensors differ in shape never share a group.
NODE, INT, FLOAT, BOOL = 0, 1, 2, 3
KIND_NAMES = {NODE: "node", INT: "int", FLOAT: "float", BOOL: "bool"}
_SCALAR_KINDS = {int: INT, float: FLOAT, bool: BOOL}

# A Node is an int laid out as below, of a Node subclass made for its Fold.
#   bits 0-6    output index k of a split output (0 for the whole node)
#   bit  7      set on split outputs
#   bits 8-15   n of the split(n) that made the handle (0 for the whole node)
#   bits 16-43  node id
#   bits 44-    depth (highest, so the max of some handles is the deepest one; unbounded)
# Why an int: hashing and comparison run in C, add() finds the depth of all its arguments with
# one max(), and the executor turns a column of handles into rows with a few numpy operations.
# Why a class per Fold: add() looks its fast path up by argument types, so a Node of another
# Fold misses it and is rejected on the slow path without any per-argument check on the fast
# one.  The split count travels in the handle, so split() writes nothing into the graph; apply
# checks each handle it reads against the number of outputs the op returned.
OUT_MASK = (1 << 7) - 1
SPLIT = 1 << 7
NSPLIT_SHIFT = 8
NSPLIT_MASK = (1 << 8) - 1
LOW_MASK = (1 << 16) - 1  # output index, split flag and split count
ID_SHIFT = 16
ID_MASK = (1 << 28) - 1
DEPTH_SHIFT = 44
MAX_SPLIT = OUT_MASK + 1


def op_name(op: Any) -> str:
    """A readable name for an op: the method name, or a callable's qualified name."""
    if isinstance(op, str):
        return op
    return getattr(op, "__qualname__", None) or getattr(op, "__name__", None) or repr(op)


def node_id(h: int) -> int:
    """The node id of a handle."""
    return (h >> ID_SHIFT) & ID_MASK


def _plain_key(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` with Node handles as plain ints, as the graph keeps them.

    A Node is an object the garbage collector tracks; a tuple holding one stays tracked, and
    ten thousand of them in a graph's memo reach the oldest generation and set off full
    collections of the whole heap (15 ms per TreeLSTM recording, measured).  A tuple of plain
    ints is untracked at its first collection.  Equal as keys: a Node hashes as its int.
    """
    return tuple([int(a) if isinstance(a, Node) else a for a in args])


def _depth_of(args: tuple[Any, ...], where: Any) -> int:
    """The depth bits of a new node: 1 + the deepest node argument's (0 without any)."""
    if where is None:
        return 0
    hi = max(args) if where is True else args[where] if type(where) is int else max(where(args))
    return ((hi >> DEPTH_SHIFT) + 1) << DEPTH_SHIFT


_MISSING = object()


class _NegZero(float):
    """``-0.0`` as a memo key: equal to ``0.0`` as a float, yet a different value (``1 / x``
    is ``-inf``), so it must not share ``0.0``'s node.  Only equal to itself; converts to
    ``-0.0`` wherever a float is read (numpy, ``array``, torch)."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return type(other) is _NegZero

    def __ne__(self, other: object) -> bool:
        return type(other) is not _NegZero

    def __hash__(self) -> int:
        return 0x2D30  # not hash(0.0) == 0

    def __repr__(self) -> str:
        return "-0.0"


_NEG_ZERO = _NegZero(-0.0)


def _float_key(x: Any) -> float:
    """A float argument as the memo keeps it: itself, except ``-0.0`` (see ``_NegZero``).

    NaNs need nothing: a NaN equals no other float, so each NaN object is its own node."""
    x = float(x)
    return _NEG_ZERO if x == 0.0 and math.copysign(1.0, x) < 0 else x


def _no_recorder() -> None:
    """What a recorder's weak reference to its specialised version returns before one exists."""
    return None


# (op name, *argument types) -> (tensor positions, kinds of the others) for adds of literal
# tensors and numbers, shared by all Folds.
_TENSOR_TEMPLATES: dict[tuple[Any, ...], tuple[tuple[int, ...], tuple[Any, ...]]] = {}
_RECORDER_CODE: dict[str, Any] = {}


def _specialised_recorder(
    generic: Callable[..., Any],
    types: tuple[type, ...],
    memo: dict[Any, int],
    where: Any,
    ids: Any,
    node_type: type,
    code: int,
    n: int,
) -> Callable[..., Any]:
    """A recorder with the fast path of ``generic`` unrolled for one arity and argument types.

    Positional parameters and one ``type(x) is t`` test per argument cost about a third less
    than packing ``*args`` and looking the argument types up.  Any other call (other types or
    arity) goes to ``generic``, which classifies and records it exactly as ``Fold.add`` does.
    The source is built from fixed templates and integer constants only.
    """
    k = len(types)
    names = [f"a{i}" for i in range(k)]
    params = ", ".join(f"{a}=_MISSING" for a in names)
    checks = " and ".join(f"type({a}) is t{i}" for i, a in enumerate(names))
    packed = "(" + ", ".join(names) + ("," if k == 1 else "") + ")"
    # The memo keeps plain ints, not Node objects: a tuple of plain ints stops being tracked
    # by the garbage collector at its first collection, while one holding Nodes (tracked
    # objects) would stay in the oldest generation and set off full collections of the heap.
    plain = [f"{a} | 0" if t is node_type else a for a, t in zip(names, types)]
    key = "(" + ", ".join(plain) + ("," if k == 1 else "") + ")"
    if where is None:
        depth = "0"
    elif where is True:
        deepest = "a0" if k == 1 else "max(args)"
        depth = f"((({deepest}) >> {DEPTH_SHIFT}) + 1) << {DEPTH_SHIFT}"
    elif type(where) is int:  # one node argument among numbers
        depth = f"(((a{where}) >> {DEPTH_SHIFT}) + 1) << {DEPTH_SHIFT}"
    else:
        depth = "_depth_of(args, where)"
    if n == 2:
        ret = "b = h | code\n        return T(b), T(b | 1)"
    elif n == 0:
        ret = "return T(h)"
    else:
        ret = "b = h | code\n        return tuple([T(b | j) for j in range(n)])"
    src = (
        f"def record({params}, *rest):\n"
        f"    if {checks} and not rest:\n"
        f"        args = {key}\n"
        f"        h = memo.get(args)\n"
        f"        if h is None:\n"
        f"            h = memo[args] = {depth} | next(ids) << {ID_SHIFT}\n"
        f"        {ret}\n"
        f"    return generic(*[a for a in {packed} if a is not _MISSING], *rest)\n"
    )
    env: dict[str, Any] = {f"t{i}": t for i, t in enumerate(types)}
    env.update(
        _MISSING=_MISSING,
        memo=memo,
        where=where,
        ids=ids,
        T=node_type,
        code=code,
        n=n,
        generic=generic,
        _depth_of=_depth_of,
    )
    code = _RECORDER_CODE.get(src)
    if code is None:  # the templates are few: compile each once per process
        code = _RECORDER_CODE[src] = compile(src, "<fold recorder>", "exec")
    exec(code, env)
    fn = env.pop("record")  # not left in its own globals: no reference cycle
    fn.__name__ = fn.__qualname__ = generic.__name__
    fn.__doc__ = generic.__doc__
    fn.generic = generic  # type: ignore[attr-defined]
    return fn


def _refuse_arithmetic(self: Node, *_: Any) -> Any:
    raise FoldError(
        f"{self!r} is a handle on a recorded value, not a value: arithmetic on it does not "
        "record anything. Fix: record the computation as an op, f.add('my_op', node, ...)."
    )


class Node(int):
    """A handle on one recorded value, returned by :meth:`Fold.add` and :meth:`Node.split`.

    Handles are ints (see the layout above); equal handles of one Fold denote the same value.
    """

    __slots__ = ()
    _fold_ref: Callable[[], Fold | None] = staticmethod(lambda: None)

    @property
    def fold(self) -> Fold:
        """The Fold that recorded this node."""
        f = self._fold_ref()
        if f is None:
            raise FoldError(f"node {self.id}: the Fold that recorded it no longer exists.")
        return f

    @property
    def id(self) -> int:
        """The index of the recorded node in its Fold."""
        return (self >> ID_SHIFT) & ID_MASK

    @property
    def depth(self) -> int:
        """The step the depth scheduler runs the node at."""
        return self >> DEPTH_SHIFT

    @property
    def index(self) -> int | None:
        """The output index of a split output; None for a whole node."""
        return self & OUT_MASK if self & SPLIT else None

    def split(self, n: int) -> tuple[Node, ...]:
        """Handles on the ``n`` outputs of a multi-output op: ``h, c = f.add("cell", x).split(2)``.

        Nothing is written into the graph: ``apply`` checks that the op returns ``n`` outputs
        when a handle is used (a FoldError names the node and the count the op returned).
        """
        if n == 2 and not self & LOW_MASK:  # the common case, kept short
            t = type(self)
            b = self | _SPLIT2
            return t(b), t(b | 1)
        if self & SPLIT:
            raise FoldError(
                f"Node.split({n}) on output {self & OUT_MASK} of node {self.id}, which is "
                "already one output of a split. Fix: split the node itself once, and have its "
                "op return a flat tuple."
            )
        if type(n) is not int or not 1 <= n <= MAX_SPLIT:
            raise FoldError(
                f"Node.split({n!r}) on node {self.id}: n must be an int from 1 to {MAX_SPLIT}, "
                "the number of tensors the op returns."
            )
        t = type(self)
        b = self | SPLIT | n << NSPLIT_SHIFT
        return tuple([t(b | k) for k in range(n)])

    def nobatch(self) -> Node:
        """Pass this node's value whole to every consumer instead of one row per consumer.

        The node runs in a group of its own (its output need not have one row), and consumers
        are grouped only with consumers of the same nobatch node::

            table = f.add("embed_table").nobatch()   # (vocab, dim), shared by every lookup
            f.add("lookup", table, word_id)
        """
        self.fold.nobatch_ids.add(self.id)
        return self

    def __repr__(self) -> str:
        fold = self._fold_ref()
        op = f", op={op_name(fold.op_of(self.id))!r}" if fold is not None else ""
        suffix = f"[{self & OUT_MASK}]" if self & SPLIT else ""
        return f"Node({self.id}{suffix}{op}, depth={self.depth})"

    __str__ = __repr__
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse_arithmetic
    __truediv__ = __rtruediv__ = __matmul__ = __rmatmul__ = __neg__ = __pow__ = _refuse_arithmetic


_SPLIT2 = SPLIT | 2 << NSPLIT_SHIFT


# Node classes are pooled: a class costs tens of microseconds to make and is cyclic garbage
# once dropped (a per-sample training loop makes a Fold per step).  A pooled class serves a
# new Fold only when nothing but the pool refers to it: no Fold, no recorder, and no handle
# (each instance holds a reference to its class), so a handle of a dropped Fold can never be
# mistaken for a handle of the new one.
_NODE_TYPES: list[type[Node]] = []
_POOL_SIZE = 16


def _make_node_type() -> type[Node]:
    return type("Node", (Node,), {"__slots__": ()})


def _unused_refcount() -> int:
    """The reference count of a pooled class nothing uses, read as _node_type_for reads it."""
    probe = [_make_node_type()]
    for cls in probe:
        return sys.getrefcount(cls)
    raise AssertionError


_UNUSED = _unused_refcount()


def _node_type_for(fold: Fold) -> type[Node]:
    for cls in _NODE_TYPES:
        if sys.getrefcount(cls) == _UNUSED:
            break
    else:
        cls = _make_node_type()
        if len(_NODE_TYPES) < _POOL_SIZE:
            _NODE_TYPES.append(cls)
    cls._fold_ref = weakref.ref(fold)
    return cls


def _arg_kind(op: Any, pos: int, a: Any) -> tuple[Any, Any]:
    """The slow path of argument classification: (kind, normalised value), or FoldError."""
    if isinstance(a, torch.Tensor):
        if a.dim() == 0 or a.shape[0] != 1:
            raise FoldError(
                f"Fold.add({op_name(op)!r}, ...): argument {pos} is a tensor of shape "
                f"{tuple(a.shape)}; tensor arguments are batch-of-one values of shape (1, ...), "
                "concatenated along dim 0 across a group. Fix: pass x.unsqueeze(0) for one "
                "value, a Python number for a scalar, or compute a shared table in a node "
                "marked .nobatch()."
            )
        return (tuple(a.shape[1:]), a.dtype), a
    if isinstance(a, Node):
        raise FoldError(
            f"Fold.add({op_name(op)!r}, ...): argument {pos} is a Node of another Fold "
            f"({a!r}). Nodes can only be combined within the Fold that recorded them. Fix: "
            "record the whole computation in one Fold."
        )
    if isinstance(a, (bool, np.bool_)):  # numpy's bool is no numbers.Integral
        return BOOL, bool(a)
    if isinstance(a, numbers.Integral):
        return INT, int(a)
    if isinstance(a, numbers.Real):
        return FLOAT, _float_key(a)
    shown = repr(a)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    raise FoldError(
        f"Fold.add({op_name(op)!r}, ...): argument {pos} is a {type(a).__name__} ({shown}); "
        "expected a Node of this Fold, an int/float/bool, or a batch-of-one torch.Tensor of "
        "shape (1, ...). Fix: convert it to a tensor, or give the op's object an attribute "
        "holding it."
    )


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
        strategy: the scheduler. ``"depth"`` (default) groups same-signature nodes at equal
            depth; ``"agenda"`` runs ready nodes DyNet-style, merging same-signature nodes of
            different depths (e.g. a classifier on sequences of different lengths) into fewer
            groups, at a higher planning cost.  See ``fold.scheduler``.
    """

    def __init__(self, strategy: str = "depth") -> None:
        if strategy not in SCHEDULERS:
            raise FoldError(
                f"Fold(strategy={strategy!r}): unknown strategy; expected one of {sorted(SCHEDULERS)}."
            )
        self.strategy = strategy
        # Per signature (op, argument kinds): (op, kinds), and its nodes as a dict from
        # arguments to handle.  Insertion order is node order, so a signature's memo IS its
        # list of nodes, and recording a node is one dict lookup and one insertion.  Adds with
        # literal tensors key the memo by tensor identity and keep their arguments in _targs.
        self.signatures: list[tuple[Any, tuple[Any, ...]]] = []
        self._memos: list[dict[Any, int]] = []
        self._targs: list[list[tuple[Any, ...]] | None] = []
        self._sig_ids: dict[tuple[Any, tuple[Any, ...]], int] = {}
        # (op, *argument types) -> (memo, where the node arguments are, per-argument
        # normalisers or None); memo None marks the literal-tensor path.  See add().
        self._fast: dict[tuple[Any, ...], tuple[Any, Any, Any]] = {}
        self._ids = itertools.count()  # node ids, a topological order
        self.nobatch_ids: set[int] = set()
        # Per group of the last apply: (step, op name, size, (shape, dtype) of each argument).
        self.last_run: list[tuple[int, str, int, tuple[Any, ...]]] | None = None
        self._node_type: type[Node] = _node_type_for(self)
        self._recorders: dict[tuple[Any, int | None], Callable[..., Any]] = {}
        self._flat_cache: tuple[int, list[Any], list[int], list[int]] | None = None
        self._arrays_cache: Any = None
        self._plan_cache: Any = None  # ((nodes, strategy, nobatch nodes), plan)

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
        # Fast path: ops whose arguments are this Fold's nodes and Python numbers, found by
        # argument types (a Node of another Fold is another type, so it takes the slow path).
        n = len(args)
        try:  # built directly for one or two arguments: a third of the cost of map
            entry = self._fast.get(
                (op, type(args[0]))
                if n == 1
                else (op, type(args[0]), type(args[1]))
                if n == 2
                else (op, *map(type, args))
            )
        except TypeError:  # an unhashable op: _add_slow says so
            entry = None
        if entry is None:  # a get, not a KeyError: a Fold's first add is a miss
            return self._add_slow(op, args)
        memo, where, plain = entry
        if plain is not None:
            if memo is None:  # literal tensors
                if n == 1:  # one tensor (a per-sample image): _record_tensors inline
                    a = args[0]
                    entry = plain[2].get((a.shape, a.dtype))  # only valid shapes get in
                    if entry is not None:
                        memo, targs = entry
                        key = (id(a),)
                        h = memo.get(key)
                        if h is None:
                            h = memo[key] = next(self._ids) << ID_SHIFT
                            targs.append(args)
                        return self._node_type(h)
                return self._add_tensors(op, args, plain)
            args = tuple(map(operator.call, plain, args))
        h = memo.get(args)
        if h is None:  # a new node; a memo hit has the same arguments, so the same depth
            if where is True:  # node arguments only
                d = ((max(args) >> DEPTH_SHIFT) + 1) << DEPTH_SHIFT
                h = memo[tuple(map(int, args))] = d | next(self._ids) << ID_SHIFT
            elif type(where) is int:  # one node argument among numbers (a per-sample loss)
                a = args[where] | 0  # the plain int
                key = list(args)
                key[where] = a
                d = ((a >> DEPTH_SHIFT) + 1) << DEPTH_SHIFT
                h = memo[tuple(key)] = d | next(self._ids) << ID_SHIFT
            else:
                d = _depth_of(args, where)
                h = memo[_plain_key(args)] = d | next(self._ids) << ID_SHIFT
        return self._node_type(h)

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
        fast: dict[tuple[type, ...], tuple[dict[Any, int], Any]] = {}
        # No strong reference to the Fold: it caches its recorders, and a cycle through them
        # would keep a dropped graph alive until the next full garbage collection.
        fold_ref, general, ids, T = weakref.ref(self), self._fast, self._ids, self._node_type
        code = 0 if outputs is None else SPLIT | outputs << NSPLIT_SHIFT
        n = outputs or 0

        # Once the recorder has seen its argument types, a specialised recorder does the work
        # (see _specialised_recorder); `box` holds a weak reference to it, so that the
        # recorder a caller keeps reaches it too, and the specialised one (which the Fold
        # keeps, and whose fallback is `slow`) forms no reference cycle with `slow`.
        box: list[Callable[[], Any]] = [_no_recorder]

        def record(*args: Any) -> Any:
            s = box[0]()
            return slow(*args) if s is None else s(*args)

        def slow(*args: Any) -> Any:
            types = tuple(map(type, args))
            entry = fast.get(types)
            if entry is None:
                f = fold_ref()
                if f is None:
                    raise FoldError(
                        f"recorder of {op_name(op)!r}: its Fold no longer exists. Fix: keep the "
                        "Fold alive while recording, or take a recorder from the new Fold."
                    )
                h = f.add(op, *args)  # classifies (or rejects) the arguments
                e = general.get((op, *types))
                if e is not None and e[0] is not None and e[2] is None:
                    fast[types] = (e[0], e[1])  # node and number arguments: cache the memo
                    key = (op, outputs)
                    current = f._recorders.get(key)
                    if (
                        current is not None
                        and not hasattr(current, "generic")
                        and 0 < len(types) <= 8
                    ):
                        spec = _specialised_recorder(slow, types, e[0], e[1], ids, T, code, n)
                        f._recorders[key] = spec
                        box[0] = weakref.ref(spec)
                elif e is not None and e[0] is None:
                    fast[types] = (None, e[2])  # literal tensors: cache the tensor path
            elif entry[0] is None:
                h = fold_ref()._add_tensors(op, args, entry[1])  # type: ignore[union-attr]
            else:
                memo, where = entry
                h = memo.get(args)
                if h is None:
                    if where is True:
                        d = ((max(args) >> DEPTH_SHIFT) + 1) << DEPTH_SHIFT
                    else:
                        d = _depth_of(args, where)
                    h = memo[_plain_key(args)] = d | next(ids) << ID_SHIFT
            if n == 2:
                b = h | code
                return T(b), T(b | 1)
            if n == 0:
                return T(h)
            b = h | code
            return tuple([T(b | k) for k in range(n)])

        slow.__name__ = slow.__qualname__ = f"record_{op_name(op)}"
        record.__name__ = record.__qualname__ = slow.__name__
        self._recorders[(op, outputs)] = record
        return record

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

    def _check_args(self, op: Any, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], list[Any], int]:
        """Classify every argument: (normalised args, kinds, depth bits), or a FoldError."""
        kinds: list[Any] = []
        hi = -1
        for pos, a in enumerate(args):
            t = type(a)
            if t is self._node_type:
                hi = max(hi, a)
                kinds.append(NODE)
            elif t in _SCALAR_KINDS:
                kinds.append(_SCALAR_KINDS[t])
                if t is float and a == 0.0:  # -0.0 keeps its own node (see _NegZero)
                    args = args[:pos] + (_float_key(a),) + args[pos + 1 :]
            elif t is torch.Tensor and a.ndim and a.shape[0] == 1:
                kinds.append((a.shape[1:], a.dtype))
            else:
                kind, value = _arg_kind(op, pos, a)
                if value is not a:
                    args = args[:pos] + (value,) + args[pos + 1 :]
                kinds.append(kind)
        depth = 0 if hi < 0 else ((hi >> DEPTH_SHIFT) + 1) << DEPTH_SHIFT
        return args, kinds, depth

    def _add_slow(self, op: Any, args: tuple[Any, ...]) -> Node:
        types = tuple(map(type, args))
        if type(op) is str:
            tmpl = _TENSOR_TEMPLATES.get((op, *types))
            if tmpl is not None:  # seen by an earlier Fold: skip classifying the arguments
                spec = (tmpl[0], list(tmpl[1]), {})
                self._fast[(op, *types)] = (None, None, spec)
                return self._add_tensors(op, args, spec)
        self._check_op(op)
        args, kinds, depth = self._check_args(op, args)
        ktuple = tuple(kinds)
        if len(self._fast) > 4096:  # bounded: e.g. a new lambda recorded per add
            self._fast.clear()
        if any(type(k) is tuple for k in ktuple):
            # Literal tensors: their shapes are part of the signature, so later adds of these
            # types take the tensor path, which looks the signature up by tensor shapes.
            if all(t is torch.Tensor for t, k in zip(types, ktuple) if type(k) is tuple):
                tpos = tuple(i for i, k in enumerate(ktuple) if type(k) is tuple)
                base = [NODE if k == NODE else None if type(k) is tuple else k for k in ktuple]
                self._fast[(op, *types)] = (None, None, (tpos, base, {}))
                if type(op) is str and all(t is torch.Tensor or t in _SCALAR_KINDS for t in types):
                    # No node argument: the classification holds for every Fold (a per-sample
                    # loop makes a Fold per step).  Keyed by name only, so no object is kept.
                    if len(_TENSOR_TEMPLATES) > 1024:
                        _TENSOR_TEMPLATES.clear()
                    _TENSOR_TEMPLATES[(op, *types)] = (tpos, tuple(base))
            return self._add_classified(op, args, ktuple, depth)
        sid = self._signature(op, ktuple)
        memo = self._memos[sid]
        # Arguments of node and number kinds only: later adds of these types take the fast path.
        where: Any = [i for i, k in enumerate(ktuple) if k == NODE]
        if not where:
            where = None
        elif len(where) == len(ktuple):
            where = True
        elif len(where) == 1:
            where = where[0]
        else:
            where = operator.itemgetter(*where)
        plain: Any = None
        if FLOAT in ktuple or not all(t is self._node_type or t in _SCALAR_KINDS for t in types):
            # e.g. numpy integers: normalised to the Python number of their kind; floats
            # through _float_key, so that -0.0 is not 0.0's node
            plain = tuple(
                int if k in (NODE, INT) else _float_key if k == FLOAT else bool for k in ktuple
            )
        self._fast[(op, *types)] = (memo, where, plain)
        h = memo.get(args)
        if h is None:
            h = memo[_plain_key(args)] = depth | next(self._ids) << ID_SHIFT
        return self._node_type(h)

    def _add_tensors(self, op: Any, args: tuple[Any, ...], spec: Any) -> Node:
        """An add with literal tensors among its arguments (the per-sample MNIST loop)."""
        tpos, base, sigs = spec
        if len(args) == 1:  # one tensor, e.g. an image: kept short
            a = args[0]
            shape = a.shape
            if not shape or shape[0] != 1:
                _arg_kind(op, 0, a)  # raises: not a batch-of-one tensor
            # Keyed by the whole shape, as add() looks entries up before calling here.
            skey = (shape, a.dtype)
            kinds = ((shape[1:], a.dtype),)
            entry = sigs.get(skey)
            if entry is None:
                sid = self._signature(op, kinds)
                entry = sigs[skey] = (self._memos[sid], self._targs[sid])
            return self._record_tensors(entry, args, kinds, 0)
        kinds = list(base)
        for p in tpos:
            a = args[p]
            if not a.ndim or a.shape[0] != 1:
                _arg_kind(op, p, a)  # raises: not a batch-of-one tensor
            kinds[p] = (a.shape[1:], a.dtype)
        kt = tuple(kinds)
        if NODE in base:  # nodes of this Fold (guaranteed by the type lookup): depth
            args, _, depth = self._check_args(op, args)
        else:
            depth = 0
        entry = sigs.get(kt)
        if entry is None:
            sid = self._signature(op, kt)
            entry = sigs[kt] = (self._memos[sid], self._targs[sid])
        return self._record_tensors(entry, args, kt, depth)

    def _add_classified(
        self, op: Any, args: tuple[Any, ...], kinds: tuple[Any, ...], depth: int
    ) -> Node:
        sid = self._signature(op, kinds)
        return self._record_tensors((self._memos[sid], self._targs[sid]), args, kinds, depth)

    def _record_tensors(
        self, entry: Any, args: tuple[Any, ...], kinds: tuple[Any, ...], depth: int
    ) -> Node:
        # Tensors compare elementwise; memoise literal tensors by identity instead (the graph
        # holds them, so their ids stay unique).
        memo, targs = entry
        if FLOAT in kinds:  # -0.0 keeps its own node (see _NegZero)
            args = tuple([_float_key(a) if k == FLOAT else a for a, k in zip(args, kinds)])
        key = tuple([id(a) if type(k) is tuple else a for a, k in zip(args, kinds)])
        h = memo.get(key)
        if h is None:
            nodes = NODE in kinds
            h = memo[_plain_key(key) if nodes else key] = depth | next(self._ids) << ID_SHIFT
            targs.append(_plain_key(args) if nodes else args)
        return self._node_type(h)

    def _signature(self, op: Any, kinds: tuple[Any, ...]) -> int:
        sig_key = (op, kinds)
        sid = self._sig_ids.get(sig_key)
        if sid is None:
            sid = self._sig_ids[sig_key] = len(self.signatures)
            self.signatures.append(sig_key)
            self._memos.append({})
            # Literal tensors: memo keys are tensor ids, so the arguments are kept here.
            self._targs.append([] if any(type(k) is tuple for k in kinds) else None)
        return sid

    def __len__(self) -> int:
        return sum(map(len, self._memos))

    # ------------------------------------------------------------------ flat views
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
                for a, h in zip(memo if rows is None else rows, memo.values()):
                    nid = (h >> ID_SHIFT) & ID_MASK
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
        return [h >> DEPTH_SHIFT for h in self.handles]

    def arrays(self) -> Any:
        """The graph as numpy arrays (:class:`fold.layout.GraphArrays`), as apply reads it."""
        n = len(self)
        cache = self._arrays_cache
        if cache is None or cache.n != n:
            if n > ID_MASK:
                raise FoldError(f"Fold: the graph has {n} nodes, more than {ID_MASK}.")
            from fold.layout import GraphArrays

            cache = self._arrays_cache = GraphArrays(self, n)
        return cache

    def op_of(self, nid: int) -> Any:
        """The op recorded as node ``nid``."""
        return self.signatures[self.sig[nid]][0]

    def node_args(self, nid: int) -> list[tuple[int, int]]:
        """(argument position, handle) of every node argument of node ``nid``."""
        kinds = self.signatures[self.sig[nid]][1]
        return [(pos, a) for pos, (a, k) in enumerate(zip(self.args[nid], kinds)) if k == NODE]

    # ------------------------------------------------------------------ execution
    def plan(self) -> Any:
        """The schedule of this graph (a :class:`fold.scheduler.Plan`), as ``apply`` runs it.

        Kept until the graph changes (a node recorded or marked nobatch, or another
        strategy), so applying one graph again (evaluation, a model at a time) plans once.
        """
        key = (len(self), self.strategy, len(self.nobatch_ids))
        cached = self._plan_cache
        if cached is None or cached[0] != key:
            cached = self._plan_cache = (key, SCHEDULERS[self.strategy](self))
        return cached[1]

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
        if max_rows is not None or max_bytes is not None or offload is not None:
            _check_limits(max_rows, max_bytes, offload)
            if isinstance(max_rows, Mapping):
                self._check_limit_ops(obj, max_rows)
            if offload == "cpu":
                with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
                    return self.apply(obj, lists, max_rows=max_rows, max_bytes=max_bytes)
        if max_rows is None and max_bytes is None:
            done = _executor.run_chain(self, obj, lists)  # e.g. a per-sample loop: op after op
            if done is not None:
                return done
        specs = _classify_lists(lists)
        plan = self.plan()
        limits = {"max_rows": max_rows, "max_bytes": max_bytes}
        chunk = obj.fold_chunk() if hasattr(obj, "fold_chunk") else None
        if chunk is None or chunk >= obj.batch:
            return self._run(obj, plan, specs, None, limits)
        # A BatchModule run a chunk of its models at a time: one graph, one plan, the executor
        # once per chunk; node outputs are concatenated along the model dim.
        parts = [
            self._run(obj, plan, specs, cut.stop - cut.start, limits) for cut in obj.chunks(chunk)
        ]
        return [
            torch.cat([p[i] for p in parts], 0) if kind == _NODES else parts[0][i]
            for i, (kind, _) in enumerate(specs)
        ]

    def _check_limit_ops(self, obj: Any, max_rows: Mapping[Any, int]) -> None:
        """Every key of a ``max_rows`` dict names an op: of ``obj``, or recorded here."""
        ops = {op for op, _ in self.signatures}
        ops |= {op_name(op) for op in ops}
        model = getattr(obj, "template", obj)  # a BatchModule: the model's own methods
        for key in max_rows:
            if key in ops or (type(key) is str and callable(getattr(model, key, None))):
                continue
            known = sorted({op_name(op) for op, _ in self.signatures})
            raise FoldError(
                f"apply: max_rows has a limit for {op_name(key)!r}, which is not an op of the "
                f"{type(obj).__name__} given to apply nor of this graph (its ops: {known}); "
                "a misspelt key would leave its op without a limit. Fix: key max_rows by op "
                "name, e.g. max_rows={'node': 64}."
            )

    def _run(
        self,
        obj: Any,
        plan: Any,
        specs: list[tuple[str, list[Any]]],
        models: int | None,
        limits: dict[str, Any],
    ) -> list[torch.Tensor]:
        """One executor pass over ``plan``; its report stays inspectable even if it fails."""
        ex = _executor.Executor(self, obj, models=models, **limits)
        try:
            ex.run(plan)
            return [ex.output(kind, items, i) for i, (kind, items) in enumerate(specs)]
        finally:
            self.last_run = ex.report

    # ------------------------------------------------------------------ inspection
    def summary(self) -> str:
        """The schedule: per step, each group's op, size and argument kinds or shapes.

        After an ``apply`` it shows the groups as they ran, with runtime argument shapes;
        before, the planned groups with their static argument kinds.
        """
        lines = [f"Fold: {len(self.sig)} nodes, strategy={self.strategy!r}"]
        if self.last_run is not None:
            describe = _executor.describe
            lines[0] += ", last apply:"
            rows = [
                (s, name, n, tuple(describe(*m) for m in metas))
                for s, name, n, metas in self.last_run
            ]
        else:
            lines[0] += ", planned:"
            rows = []
            for s, step in enumerate(self.plan().steps):
                for g in step.groups:
                    op, kinds = self.signatures[self.sig[g.nodes[0]]]
                    rows.append((s, op_name(op), len(g.nodes), tuple(_kind_str(k) for k in kinds)))
        nsteps = 1 + max((r[0] for r in rows), default=-1)
        lines[0] += f" {nsteps} steps, {len(rows)} groups"
        last = -1
        for s, name, size, shapes in rows:
            if s != last:
                lines.append(f"step {s}:")
                last = s
            lines.append(f"  {name} x{size} ({', '.join(shapes)})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return f"Fold({len(self.sig)} nodes, strategy={self.strategy!r})"

    def to_networkx(self) -> Any:
        """The graph as a ``networkx.DiGraph``.

        Node attributes: ``op`` (name), ``depth``, ``split`` (the n of ``split(n)`` its
        consumers use it with; 0 if they use it whole or it has none), ``nobatch``.  Edge
        attributes: ``arg`` (argument position) and ``out`` (the output index of the source
        that is used).
        """
        import networkx as nx

        g = nx.DiGraph()
        _, _, _, handles = self._flat()
        for nid, h in enumerate(handles):
            g.add_node(
                nid,
                op=op_name(self.op_of(nid)),
                depth=h >> DEPTH_SHIFT,
                split=0,
                nobatch=nid in self.nobatch_ids,
            )
        for nid in range(len(handles)):
            for pos, a in self.node_args(nid):
                src = node_id(a)
                g.add_edge(src, nid, arg=pos, out=a & OUT_MASK)
                if a & SPLIT:
                    g.nodes[src]["split"] = (a >> NSPLIT_SHIFT) & NSPLIT_MASK
        return g

    def draw(self, path: str) -> None:
        """Write a PNG of the graph to ``path``, nodes placed and coloured by step.

        Needs matplotlib (``pip install torch-fold[draw]``).
        """
        # A Figure with its own Agg canvas, not pyplot: the caller's global backend (an
        # interactive one in a notebook) is left as it is.
        try:
            import matplotlib
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError as err:
            raise FoldError(
                "Fold.draw needs matplotlib. Fix: pip install 'torch-fold[draw]'."
            ) from err
        import networkx as nx

        g = self.to_networkx()
        steps = max(self.depth, default=0) + 1
        pos = nx.multipartite_layout(g, subset_key="depth") if len(g) else {}
        fig = Figure(figsize=(max(4.0, 1.2 * steps), max(3.0, 0.15 * len(g) + 2)))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        colors = [g.nodes[n]["depth"] for n in g.nodes]
        nx.draw_networkx(
            g,
            pos,
            ax=ax,
            node_color=colors,
            cmap=matplotlib.colormaps["viridis"],
            labels={n: g.nodes[n]["op"] for n in g.nodes},
            font_size=7,
            node_size=300,
            arrowsize=8,
        )
        ax.set_title(f"fold graph: {len(g)} nodes in {steps} steps (colour = step)")
        ax.axis("off")
        fig.tight_layout()
        fig.savefig(path, dpi=100)


def _check_limits(max_rows: Any, max_bytes: Any, offload: Any) -> None:
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


def _kind_str(k: Any) -> str:
    if type(k) is tuple:
        shape, dtype = k
        return (
            f"tensor(1, {', '.join(map(str, shape))}){str(dtype).replace('torch.', ' ')}".replace(
                "(1, )", "(1,)"
            )
        )
    return KIND_NAMES[k]


_NODES, _NUMBERS, _TENSORS, _COLUMN = "nodes", "numbers", "tensors", "column"


def _classify_lists(lists: Any) -> list[tuple[str, Any]]:
    """Check the ``lists`` argument of apply: each a list of nodes, numbers or batch-of-one
    tensors, or a 1-D tensor (one number per example, as a list of numbers)."""
    if isinstance(lists, (Node, torch.Tensor)) or not isinstance(lists, (list, tuple)):
        raise FoldError(
            f"apply(obj, lists): lists is a {type(lists).__name__}; expected a list of lists, "
            "e.g. apply(model, [roots, labels])."
        )
    specs: list[tuple[str, Any]] = []
    for i, items in enumerate(lists):
        if isinstance(items, torch.Tensor):
            specs.append((_COLUMN, _check_column(items, i)))
            continue
        if isinstance(items, Node) or not isinstance(items, (list, tuple)):
            raise FoldError(
                f"apply(obj, lists): lists[{i}] is a {type(items).__name__}; each entry must be "
                "a list of nodes, numbers or batch-of-one tensors, or a 1-D tensor. Fix: wrap "
                "a single node in a list, e.g. apply(model, [[root]])."
            )
        if not items:
            raise FoldError(
                f"apply(obj, lists): lists[{i}] is empty; there is no value to return for it."
            )
        # Common cases first, in C: all nodes of one Fold, or all ints.
        types = set(map(type, items))
        if len(types) == 1:
            t = types.pop()
            if issubclass(t, (Node, Unfold.Node)):
                specs.append((_NODES, list(items)))
                continue
            if t in _SCALAR_KINDS:
                specs.append((_NUMBERS, list(items)))
                continue
        kinds = set()
        for x in items:
            if isinstance(x, (Node, Unfold.Node)):
                kinds.add(_NODES)
            elif isinstance(x, torch.Tensor):
                kinds.add(_TENSORS)
            elif isinstance(x, (numbers.Real, bool, np.bool_)):
                kinds.add(_NUMBERS)
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
        if kind == _TENSORS:
            _check_tensor_list(items, i)
            items = list(items)
        elif kind == _NUMBERS:  # numpy numbers as the Python numbers of their kind
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
    metas = {(tuple(t.shape[1:]), t.dtype) for t in items}
    if len(metas) > 1:
        shown = ", ".join(sorted(f"{s} {str(d).replace('torch.', '')}" for s, d in metas))
        raise FoldError(
            f"apply(obj, lists): lists[{i}] holds tensors of different shapes or dtypes "
            f"({shown}); they cannot be concatenated along dim 0. Fix: convert them to one "
            "dtype, or put each shape in its own list."
        )


class Unfold:
    """The eager twin of :class:`Fold`: every ``add`` runs its op at once on a batch of one.

    Same ``add`` / ``split`` / ``nobatch`` / ``apply`` API; use it to debug a model and as the
    reference that Fold results are compared with::

        u = Unfold(model)
        h, c = u.add("leaf", 3).split(2)
        (out,) = u.apply(model, [[h]])
    """

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.device = _executor.device_of(obj)

    class Node:
        """A computed value, with the same ``split`` / ``nobatch`` methods as Fold's Node."""

        __slots__ = ("unfold", "value", "op")

        def __init__(self, unfold: Unfold, value: Any, op: Any) -> None:
            self.unfold = unfold
            self.value = value
            self.op = op

        def split(self, n: int) -> tuple[Unfold.Node, ...]:
            v = self.value
            if isinstance(v, torch.Tensor):
                v = (v,)
            if type(n) is not int or len(v) != n:
                raise FoldError(
                    f"Node.split({n!r}): op {op_name(self.op)!r} returned {len(v)} output(s). "
                    f"Fix: call .split({len(v)})."
                )
            return tuple(Unfold.Node(self.unfold, x, self.op) for x in v)

        def nobatch(self) -> Unfold.Node:
            return self

        def get(self) -> torch.Tensor:
            v = self.value
            if isinstance(v, tuple):
                if len(v) != 1:
                    raise FoldError(
                        f"op {op_name(self.op)!r} returned {len(v)} outputs and its node is used "
                        f"whole. Fix: call .split({len(v)}) on the node and use its outputs."
                    )
                v = v[0]
            return v

    def add(self, op: str | Callable[..., Any], *args: Any) -> Unfold.Node:
        """Run ``op(*args)`` now, on batch-of-one arguments, and return its value's handle."""
        vals = []
        for pos, a in enumerate(args):
            if type(a) is Unfold.Node:
                if a.unfold is not self:
                    raise FoldError(
                        f"Unfold.add({op_name(op)!r}, ...): argument {pos} is a Node of another "
                        "Unfold. Fix: record the whole computation in one Unfold."
                    )
                vals.append(a.get())
                continue
            value = a if type(a) in (int, float, bool) else _arg_kind(op, pos, a)[1]
            if isinstance(value, torch.Tensor):
                vals.append(value.to(self.device))
            elif isinstance(value, bool):
                vals.append(torch.tensor([value], dtype=torch.bool, device=self.device))
            elif isinstance(value, int):
                vals.append(torch.tensor([value], dtype=torch.long, device=self.device))
            else:
                vals.append(
                    torch.tensor([value], dtype=torch.get_default_dtype(), device=self.device)
                )
        fn = op if not isinstance(op, str) else getattr(self.obj, op, None)
        if fn is None or not callable(fn):
            raise FoldError(
                f"Unfold.add({op_name(op)!r}, ...): {type(self.obj).__name__} has no op "
                f"{op_name(op)!r}. Fix: define def {op_name(op)}(self, ...) on it."
            )
        out = fn(*vals)
        if isinstance(out, list):
            out = tuple(out)
        return Unfold.Node(self, out, op)

    def apply(self, obj: Any, lists: Sequence[Sequence[Any]]) -> list[torch.Tensor]:
        """Concatenate the values of each list, as :meth:`Fold.apply` returns them."""
        if obj is not self.obj:
            raise FoldError(
                "Unfold.apply(obj, lists): obj is not the object this Unfold was built with; "
                "its ops already ran. Fix: pass the same object, or build a new Unfold(obj)."
            )
        res = []
        for i, (kind, items) in enumerate(_classify_lists(lists)):
            if kind == _NODES:
                res.append(torch.cat([n.get() for n in items], 0))
            else:
                res.append(_executor.literal_output(kind, items, i, self.device))
        return res


# Last: the executor reads this module's names (an import cycle that resolves once both exist).
from fold import executor as _executor  # noqa: E402
