"""Lazy values: what the per-example function holds in place of a tensor whose value depends
on a recorded call.  A node of the Fold being recorded, with its per-example shape, dtype and
device (a ``_Meta``); torch functions, tensor methods and operators on it record through its
recorder; reads, in-place changes and autograd attributes are FoldErrors naming the fix."""

from __future__ import annotations

import copy
import dis
import functools
import inspect
import math
import operator
import os
import struct
import sys
import weakref
from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fold.errors import FoldError, describe
from fold.ops import (
    _TENSOR,  # torch.tensor as fold found it at import
    version_of,
)

if TYPE_CHECKING:  # the recorder uses this module: names for annotations only
    from fold.autobatch.recorder import _Recorder
from fold.autobatch.common import (
    _BATCHED,
    _C,
    _CONSTANTS,
    _INPLACE,
    _LOCAL,
    _MISS,
    _any_autocast,
    _fn_name,
    _is_inplace,
)


class _Meta:
    """The per-example shape, dtype and device of a batched value (and its layout where it
    is not strided: a sparse matrix per example); one object per triple, so keys compare
    them by identity."""

    __slots__ = ("shape", "dtype", "device", "ndim", "layout")

    def __init__(
        self,
        shape: torch.Size,
        dtype: torch.dtype,
        device: torch.device,
        layout: torch.layout = torch.strided,
    ) -> None:
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.ndim = len(shape)
        self.layout = layout

    def __repr__(self) -> str:
        return describe(self.shape, self.dtype)


_METAS: dict[tuple[Any, ...], _Meta] = {}


def _meta(
    shape: Any, dtype: torch.dtype, device: torch.device, layout: torch.layout = torch.strided
) -> _Meta:
    key = (tuple(shape), dtype, device)
    if layout is not torch.strided:
        key += (layout,)
    m = _METAS.get(key)
    if m is None:
        m = _METAS[key] = _Meta(torch.Size(key[0]), dtype, device, layout)
    return m


class _PyLazyBase:
    """The storage of a Lazy value where the C one (fold/_clazy.c) is not built; set by the
    constructor (Lazy refuses later changes, as the C storage's read-only fields do; its
    node is set again by an in-place change, ``buffers.write_lazy``)."""

    __slots__ = ("node", "meta", "rec", "__weakref__")

    def __new__(cls, node: Any, meta: _Meta, rec: _Recorder) -> Any:
        self = object.__new__(cls)
        _set(self, "node", node)
        _set(self, "meta", meta)
        _set(self, "rec", rec)
        return self


_set = object.__setattr__


def _torch_function(
    cls: type, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
) -> Any:
    """``Lazy.__torch_function__`` (in C, its fast path first): record ``func``."""
    rec = _LOCAL.rec
    if rec is None or rec.paused:
        raise FoldError(
            f"{_fn_name(func, 'torch')}: a lazy value of autobatch was used outside the "
            "function autobatch runs (kept from an earlier call, or used while its graph "
            "runs). Fix: use the results autobatch returns."
        )
    if func is _AUTOGRAD_GRAD:
        return _autograd_grad(rec, args, kwargs or {})
    if kwargs:
        args, kwargs = _given(func, args, kwargs)
    written = _WRITTEN[0]
    if written is not None and not _INPLACE[func] and not (kwargs and "out" in kwargs):
        for a in args:
            if type(a) is written:
                # A buffer the example wrote (``torch.bmm(w, encoder_outputs.unsqueeze(0))``
                # at every step of the translation tutorial's decoder): the value it holds,
                # and the call again, which the C fast path now takes.
                held = _WRITTEN[1]
                args = tuple(held(x, rec) if type(x) is written else x for x in args)
                return Lazy.__torch_function__(func, (Lazy,), args, kwargs or {})
    return rec.record(func, "torch", args, kwargs or {})


# The class of a written buffer and ``held_by`` (fold/autobatch/buffers.py, which imports
# this module, sets them at import).
_WRITTEN: list[Any] = [None, None]


def _given(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A call with keyword arguments of a torch function or Tensor method (of one written in
    Python by its signature, torch.nn.functional's; of a builtin by
    ``_BUILTIN_POSITIONAL``) as the recorder's fast path takes it, which takes calls
    without keywords alone: the keywords that pass their parameter's default dropped
    (``F.relu(x)`` reaches ``__torch_function__`` as ``relu(x, inplace=False)``,
    ``F.cross_entropy(y, t)`` with its six defaults), and those left passed by position
    where they are numbers, strings or None, each parameter between them given its default
    where ``_FILLS`` has it (``F.softmax(x, dim=-1)`` as ``softmax(x, -1)``,
    ``F.normalize(x, dim=0)`` as ``normalize(x, 2.0, 0)``, ``h.sum(dim=0)`` as
    ``h.sum(0)``), as Python binds them.  A tensor passed by keyword stays so, and every
    keyword with it (the recorder looks at some by name: a norm's running statistics).
    The same call."""
    defaults = _KW_DEFAULTS.get(func, _MISS)
    if defaults is _MISS:
        found = _signature_of(func)
        if found is None:
            defaults = names = fills = None
        else:
            defaults, names, fills = found
        # (Entries are never dropped, nor replaced: the C path holds their values
        # borrowed while it makes a call.  Past the bound, a function's entry is made
        # anew at each call.)
        if len(_KW_DEFAULTS) < _KW_FUNCTIONS:
            _KW_DEFAULTS[func], _POSITIONAL[func], _FILLS[func] = defaults, names, fills
    else:
        names, fills = _POSITIONAL[func], _FILLS[func]
    if defaults is None:
        return args, kwargs
    given = {}
    for k, v in kwargs.items():
        d = defaults.get(k, _MISS)
        if type(v) is not type(d) or v != d:  # (-0.0 for 0.0 behaves alike)
            given[k] = v
    if given and names is not None:
        more: list[Any] = []
        filled: list[Any] = []  # defaults of parameters before the next one given
        taken = 0
        for name in names[len(args) :]:
            if name in given:
                if type(given[name]) not in _CONSTANTS:
                    break
                more += filled
                filled = []
                more.append(given[name])
                taken += 1
                if taken == len(given):
                    break
            elif name in fills:  # (not given, or given as its default)
                filled.append(fills[name])
            else:
                break
        if taken == len(given):  # (else some keyword stays one: all of them stay)
            args, given = (*args, *more), {}
    return args, given


def _signature_of(
    func: Any,
) -> tuple[dict[str, Any], tuple[str, ...], dict[str, Any]] | None:
    """For a Python function, the defaults of its parameters that are None, bools, ints,
    floats or strings, the names of its parameters that may be passed by position, in
    order, and the defaults ``_given`` may pass for a parameter not given: numbers alone
    (a None or a string may stand for "not given", which fold's own rules for some
    functions read by name: a loss's ``weight`` and ``reduction``); for a builtin of
    ``_BUILTIN_POSITIONAL``, no defaults to drop, its names, and the defaults it lists to
    pass; None for any other builtin, whose signature Python cannot read."""
    if getattr(func, "__code__", None) is None:
        params = _BUILTIN_POSITIONAL.get(getattr(func, "__name__", None))
        if params is None or not (
            getattr(torch, func.__name__, None) is func
            or getattr(torch.Tensor, func.__name__, None) is func
        ):
            return None
        # (No default dropped: where overloads differ, a keyword given as its default can
        # pick the overload, ``x.max(keepdim=False)`` is a TypeError where ``x.max()`` is
        # not; the listed ones only fill a gap before a parameter given.)
        names = ("input", *[p if type(p) is str else p[0] for p in params])
        return {}, names, {p[0]: p[1] for p in params if type(p) is tuple}
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return None
    defaults = {
        p.name: p.default
        for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and type(p.default) in _CONSTANTS
    }
    positional = []
    for p in params:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        positional.append(p.name)
    fills = {k: v for k, v in defaults.items() if type(v) in (bool, int, float)}
    return defaults, tuple(positional), fills


# Per torch function that reached ``__torch_function__`` with keyword arguments (see
# ``_given``; the C path reads all three): the defaults of its parameters a call may pass,
# name -> default; the names of its parameters that may be passed by position; the defaults
# passed for a parameter not given.  None for a builtin Python cannot read.
_KW_DEFAULTS: dict[Any, dict[str, Any] | None] = {}
_POSITIONAL: dict[Any, tuple[str, ...] | None] = {}
_FILLS: dict[Any, dict[str, Any] | None] = {}
_KW_FUNCTIONS = 1024  # (the most functions they hold)

# torch functions and Tensor methods written in C (no signature Python can read) whose
# parameters after the tensor, in this order, may be passed by position in every overload
# that names them: ``x.sum(dim=0)`` is ``x.sum(0)``, ``h.argmax(dim=-1)`` ``h.argmax(-1)``;
# (name, default) where a parameter's default may be passed for it (``h.clamp(max=1)`` is
# ``h.clamp(None, 1)``).  (Not std or var: their positional overload puts ``unbiased``
# before ``keepdim``; not norm: ``p`` comes first.)
_KEEPDIM = ("dim", ("keepdim", False))
_BUILTIN_POSITIONAL: dict[str, tuple[Any, ...]] = {
    **dict.fromkeys(
        ("sum", "mean", "prod", "argmax", "argmin", "amax", "amin", "logsumexp", "all", "any"),
        _KEEPDIM,
    ),
    **dict.fromkeys(("max", "min"), _KEEPDIM),
    **dict.fromkeys(("nansum", "median"), _KEEPDIM),
    **dict.fromkeys(
        ("softmax", "log_softmax", "cumsum", "cumprod", "squeeze", "unsqueeze"), ("dim",)
    ),
    "chunk": ("chunks", ("dim", 0)),
    "unbind": (("dim", 0),),
    "flatten": (("start_dim", 0), ("end_dim", -1)),
    "transpose": ("dim0", "dim1"),
    "narrow": ("dim", "start", "length"),
    "select": ("dim", "index"),
    "index_select": ("dim", "index"),
    "gather": ("dim", "index"),
    "topk": ("k", ("dim", -1), ("largest", True), ("sorted", True)),
    "sort": (("dim", -1), ("descending", False)),
    "argsort": (("dim", -1), ("descending", False)),
    "clamp": (("min", None), ("max", None)),
}


_AUTOGRAD_GRAD = torch.autograd.grad


def _autograd_grad(rec: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``torch.autograd.grad`` of lazy values inside the function (a MAML inner step, a
    gradient penalty): a read.  The example pauses until the round that computes them has
    run, then torch's grad runs on their rows, as eager code runs it: one backward per
    example through the round's batched graph, where only the example's rows get a
    gradient.  The graph is kept (``retain_graph``): it is every example's.  The gradients
    are eager tensors; made with ``create_graph``, the calls that take them carry their
    history back.  Gradients with respect to lazy values are a FoldError."""
    inputs = kwargs.get("inputs", args[1] if len(args) > 1 else None)
    if any(type(t) is Lazy for t in pytree.tree_leaves(inputs)):
        raise FoldError(
            f"autobatch: example {rec.example}: torch.autograd.grad with respect to a lazy "
            "value: it is a row of a group's output, whose graph holds every example. Fix: "
            "take gradients with respect to parameters or to tensors made outside the "
            "function (an input with requires_grad=True), or return the value and take "
            "gradients of the results autobatch returns."
        )

    def row(x: Any) -> Any:
        if type(x) is Known:
            return x.tensor()
        if type(x) is not Lazy:
            return x
        value = _value_of(x)
        if value is None and x.rec.session is not None and x.rec.session.pause(x):
            value = _value_of(x)
        if value is None:
            raise FoldError(
                f"autobatch: example {rec.example}: torch.autograd.grad of a lazy value "
                "where the example cannot pause for its round (see reads). Fix: return the "
                "loss and take gradients of the results autobatch returns."
            )
        return value

    args, kwargs = pytree.tree_map(row, (args, kwargs))
    kwargs["retain_graph"] = True
    return _AUTOGRAD_GRAD(*args, **kwargs)


def _eager_value(a: Any, session: Any) -> Any:
    """An argument of a call run as eager code once the examples of ``session`` finish so
    (see ``driver._Session``): a lazy value (of an earlier round: nothing is lazy in the
    rounds after) its row, a known value its tensor, in lists and tuples too.  A lazy value
    of another call is a FoldError, as the recorder says it."""
    t = type(a)
    if t is Lazy:
        if a.rec.session is not session or a.rec.values is None:
            raise _foreign()
        return _value_of(a)
    if t is Known:
        return a.tensor()
    if t is list or t is tuple:
        return t([_eager_value(x, session) for x in a])
    return a


def _foreign(example: int | None = None) -> FoldError:
    """The FoldError for a lazy value of another autobatch call (naming the example that
    passed it, where known)."""
    where = "" if example is None else f"example {example}: "
    return FoldError(
        f"autobatch: {where}a lazy value from another autobatch call (or an earlier one) was "
        "passed in. Fix: return it from that call and pass the result as an input."
    )


class Lazy(_PyLazyBase if _C is None else _C.LazyBase):  # type: ignore[misc]
    """A value that depends on a recorded call: a node of the Fold autobatch is recording,
    with its per-example shape, dtype and device.  Use it like a tensor; reading its data in
    Python raises a FoldError."""

    __slots__ = ()
    node: Any
    meta: _Meta
    rec: _Recorder

    __torch_function__ = classmethod(_torch_function if _C is None else _C.torch_function)

    # -------------------------------------------------------------- metadata
    @property
    def shape(self) -> torch.Size:
        return self.meta.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.meta.dtype

    @property
    def device(self) -> torch.device:
        return self.meta.device

    @property
    def ndim(self) -> int:
        return self.meta.ndim

    @property
    def is_cuda(self) -> bool:
        return self.meta.device.type == "cuda"

    @property
    def T(self) -> Lazy:  # noqa: N802  (torch's name)
        return self.permute(*range(self.meta.ndim - 1, -1, -1))

    @property
    def mT(self) -> Lazy:  # noqa: N802
        return self.transpose(-2, -1)

    @property
    def mH(self) -> Lazy:  # noqa: N802  (the conjugate of mT)
        return torch.adjoint(self)

    @property
    def H(self) -> Lazy:  # noqa: N802  (of a matrix, as torch's: a conjugate transpose)
        if self.meta.ndim != 2:
            raise FoldError(
                f"autobatch: example {self.rec.example}: .H of a lazy value of "
                f"{self.meta.ndim} dims; torch takes .H of matrices only. Fix: x.mH "
                "(the last two dims), or x.conj().permute(...)."
            )
        return torch.adjoint(self)

    # The real and imaginary parts of a complex value (torch.real of a real one is itself).
    real = property(lambda self: torch.real(self))
    imag = property(lambda self: torch.imag(self))

    @property
    def itemsize(self) -> int:
        return self.meta.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.meta.shape.numel() * self.meta.dtype.itemsize

    @property
    def is_cpu(self) -> bool:
        return self.meta.device.type == "cpu"

    def size(self, dim: int | None = None) -> Any:
        return self.meta.shape if dim is None else self.meta.shape[dim]

    def dim(self) -> int:
        return self.meta.ndim

    ndimension = dim

    def numel(self) -> int:
        return self.meta.shape.numel()

    nelement = numel

    def element_size(self) -> int:
        return torch.empty((), dtype=self.meta.dtype).element_size()

    def is_floating_point(self) -> bool:
        return self.meta.dtype.is_floating_point

    def is_complex(self) -> bool:
        return self.meta.dtype.is_complex

    def is_signed(self) -> bool:
        return self.meta.dtype.is_signed

    def get_device(self) -> int:
        d = self.meta.device
        return -1 if d.type == "cpu" else (d.index or 0)

    # A lazy value is dense and strided (a row of a batched output).
    layout = torch.strided
    is_sparse = is_sparse_csr = is_nested = is_mkldnn = False
    is_quantized = False
    is_meta = False

    def __len__(self) -> int:
        if not self.meta.ndim:
            raise FoldError("len() of a 0-d lazy value: it has no dim 0. Fix: use .shape.")
        return self.meta.shape[0]

    def __iter__(self) -> Any:
        if not self.meta.ndim:
            raise FoldError("iterating over a 0-d lazy value. Fix: use .shape.")
        return iter(self.unbind(0))

    def __repr__(self) -> str:
        # A value of an earlier round (an encoder's rows, ``enc[i]``) is computed: its numbers,
        # as a debugging print inside the function shows them in eager code.
        value = _value_of(self) if self.rec.values is not None else None
        if value is not None:
            return f"Lazy({value!r})"
        return f"Lazy({describe(self.meta.shape, self.meta.dtype)}, example {self.rec.example})"

    def __format__(self, spec: str) -> str:
        # As a tensor formats: a 0-d value as its number (``f"{loss:.3f}"``: a read, as
        # ``.item()`` is), others as their repr (and an error for a format spec).
        if self.meta.ndim == 0:
            return format(self._read_number("format()", _item, True), spec)
        return object.__format__(self, spec)

    __hash__ = object.__hash__

    # -------------------------------------------------------------- identity and autograd
    def __setattr__(self, name: str, value: Any) -> None:
        raise FoldError(
            f"autobatch: setting .{name} of a lazy value; recorded values are immutable. "
            "Fix: keep what you need beside it (a dict keyed by the value, or a tuple)."
        )

    def __delattr__(self, name: str) -> None:
        raise FoldError(
            f"autobatch: deleting .{name} of a lazy value; recorded values are immutable."
        )

    def __copy__(self) -> Lazy:
        # As copy.copy of an eager non-leaf tensor: the same values, cut from the history
        # (eager makes a new leaf sharing the storage: no gradient reaches what made it).
        return self.detach()

    def __deepcopy__(self, memo: Any) -> Any:
        raise FoldError(
            "autobatch: copy.deepcopy of a lazy value (a recorded result, not a graph leaf; "
            "eager torch refuses to deep-copy such tensors too). Fix: x.clone(), or "
            "x.detach().clone() for a copy that carries no gradient."
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise FoldError(
            "autobatch: pickling a lazy value; its value exists only once the graph runs. "
            "Fix: pickle the results autobatch returns."
        )

    @property
    def data(self) -> Lazy:
        """The value without its autograd history, as ``tensor.data`` reads (``.detach()``;
        writing through it is refused like every in-place change)."""
        return self.detach()

    def _autograd(self, what: str) -> Any:
        raise FoldError(
            f"autobatch: example {self.rec.example}: {what} of a lazy value: its autograd "
            "graph exists only once every example is recorded and the graph runs. Fix: read "
            "it on the results autobatch returns (or on the parameters), or compute with "
            "torch.no_grad() / .detach() instead of testing it."
        )

    requires_grad = property(lambda self: self._autograd(".requires_grad"))
    grad_fn = property(lambda self: self._autograd(".grad_fn"))
    grad = property(lambda self: self._autograd(".grad"))
    is_leaf = property(lambda self: self._autograd(".is_leaf"))
    retains_grad = property(lambda self: self._autograd(".retains_grad"))
    output_nr = property(lambda self: self._autograd(".output_nr"))

    # -------------------------------------------------------------- reads
    def _read(self, what: str, convert: Callable[[torch.Tensor], Any]) -> Any:
        """A read of the value: where it is computed (an earlier round), the value at once;
        inside an example that autobatch runs as a coroutine (see driver), the example
        pauses until the round that computes it; else a FoldError naming the fix."""
        rec = self.rec
        if rec.lockstep is not None:  # recorded once for all rows: the rows' value
            return rec.lockstep.read(self, convert, False)
        value = _value_of(self)
        if value is None and rec.session is not None and rec.session.pause(self):
            value = _value_of(self)
        if value is not None:
            # Without its history: a group may join rows that carry one with rows that do
            # not (x.detach().sum() beside h[1:].sum()), and eager code's conversion of this
            # example's value would neither warn nor refuse (.numpy()) where it carries none.
            return convert(value.detach() if value.requires_grad else value)
        fix = (
            _library_read()
            or _own_coroutine(rec.session)
            or (
                "branch on what is known while recording (the example's structure, shapes), "
                "or compute the value outside autobatch and pass it in; for builtin max()/min()"
                " and comparisons in `if`, use torch.maximum, torch.minimum or torch.where; "
                "inside a @fold.batchable body, which runs batched, use torch.where."
            )
        )
        raise FoldError(
            f"autobatch: example {rec.example}: {what} reads the data of a lazy value "
            f"{describe(self.meta.shape, self.meta.dtype)}, which is computed only after every "
            f"example is recorded. Fix: {fix}"
        )

    def _read_number(self, what: str, convert: Callable[[Any], Any], floats: bool = False) -> Any:
        """A read of a one-number integer or bool value (a decoder's token, a parser's action,
        ``if done:``), or with ``floats`` of a floating one (``float(loss)``, a halting
        probability): as ``_read``, but the number comes from one ``tolist`` of its round's
        output, made once for all examples (see ``_number_of``), not from a tensor per read.
        (``int`` and an index of a float keep the tensor's own conversion and its errors.)"""
        m = self.meta
        if (m.dtype in _INTEGRAL or (floats and m.dtype in _FLOATING)) and (
            m.ndim == 0 or m.shape.numel() == 1
        ):
            rec = self.rec
            if rec.lockstep is not None:  # recorded once for all rows: the rows' number
                return rec.lockstep.read(self, convert, True)
            if rec.values is None and rec.session is not None:
                rec.session.pause(self)
            if rec.values is not None:
                number = _number_of(rec, self.node)
                if number is not _MISS:
                    return convert(number)
        return self._read(what, convert)

    def __bool__(self) -> bool:
        return self._read_number("bool()", bool, True)

    def __int__(self) -> int:
        return self._read_number("int()", int)

    def __float__(self) -> float:
        return self._read_number("float()", float, True)

    def __complex__(self) -> complex:
        return self._read("complex()", complex)

    def __index__(self) -> int:
        return self._read_number("using it as an index (__index__)", _index)

    def item(self) -> Any:
        return self._read_number(".item()", _item, True)

    def tolist(self) -> Any:
        return self._read(".tolist()", lambda t: t.tolist())

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        return _array_noted(self, self._read(".numpy()", lambda t: t.numpy(*args, **kwargs)))

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        out = self._read("numpy conversion", lambda t: t.__array__(*args, **kwargs))
        return _array_noted(self, out)

    def __contains__(self, item: Any) -> bool:
        return self._read("`in`", lambda t: item in t)

    def backward(self, *args: Any, **kwargs: Any) -> None:
        raise FoldError(
            "autobatch: .backward() on a lazy value inside the per-example function. Fix: "
            "return the loss; autobatch returns the losses stacked, call .backward() on them "
            "(or their sum)."
        )

    def register_hook(self, hook: Any) -> Any:
        raise FoldError(
            f"autobatch: example {self.rec.example}: .register_hook() on a lazy value: its "
            "gradient flows only once the graph runs, through the rows of every example at "
            "once. Fix: register it on the results autobatch returns, or wrap the step in a "
            "torch.autograd.Function (recorded whole: its backward runs as in eager code)."
        )

    def retain_grad(self) -> None:
        raise FoldError(
            f"autobatch: example {self.rec.example}: .retain_grad() on a lazy value: it is a "
            "row of a batched result, made only once every example is recorded. Fix: return "
            "it from the function and call .retain_grad() on what autobatch returns."
        )

    def __setitem__(self, key: Any, value: Any) -> None:
        _write(_SETITEM, (self, key, value), {})


def _is_count(meta: _Meta) -> bool:
    """A one-number integer or bool value: a count, an index or a flag."""
    return meta.ndim == 0 and _integral(meta.dtype)


def _integral(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex


def _value_of(x: Lazy) -> torch.Tensor | None:
    """The value of a lazy value whose round has run (its row of the round's output), else
    None."""
    rec = x.rec
    values = rec.values
    if values is None:
        return None
    node = x.node
    got = rec.rows_of.get(node)
    if got is None:  # one view per value, however often it is read (a parser's encoder rows)
        src, row = values[node]
        got = rec.rows_of[node] = rec.row_of(src, row)
    return got


def _index(t: Any) -> int:
    return t.__index__()


def _item(t: Any) -> Any:
    return t if type(t) in (int, bool, float) else t.item()


# The dtypes whose 0-dim values ``_read_number`` reads from a list: the Python numbers
# ``tolist`` gives are what ``item`` gives, and int, bool, float and an index convert them as
# they convert the tensor.
_INTEGRAL = frozenset((torch.long, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool))
# Floating values' ``float``, ``bool`` and ``.item()`` from ``tolist`` too: it gives the
# Python float ``item`` gives (the value widened to a double), which ``bool`` tests as the
# tensor's ``bool`` does (NaN true, -0.0 false).
_FLOATING = frozenset((torch.float32, torch.float64, torch.float16, torch.bfloat16))


def _number_of(rec: Any, node: Any) -> Any:
    """The Python number of the one-number value ``node`` (0-dim, or of shape (1,), ...) of a
    round that has run: its row of the round's output, which is listed once (one ``tolist``,
    one device sync) for every read; _MISS where that output is not one number per row."""
    src, row = rec.values[node]
    got = rec.numbers.get(id(src))
    if got is None:
        n = src.shape[0] if src.ndim else -1
        if src.numel() != n:  # (a round's outputs are its rows stacked; never so, but be sure)
            return _MISS
        # (without history: see _read)
        flat = (src if src.ndim == 1 else src.reshape(n)).detach()  # rows (1,), (1, 1)
        got = rec.numbers[id(src)] = (src, flat.tolist())  # src kept: its id stays its own
    return got[1][row]


def _own_coroutine(session: Any) -> str:
    """Where a read happens inside a greenlet the function started itself, the fix ('' else):
    autobatch can pause only the example's own coroutine."""
    running = getattr(session, "running", None)
    if running is None:
        return ""
    import greenlet

    if greenlet.getcurrent() is running:
        return ""
    return (
        "the read runs inside a greenlet (or another coroutine) that the function started "
        "itself, and autobatch pauses only the example's own coroutine: read outside it, "
        "and pass the value in."
    )


def _library_read() -> str:
    """Where a read comes from a library's own check rather than the user's code, the fix that
    turns that check off ('' elsewhere)."""
    f: Any = sys._getframe(2)
    while f is not None:
        if "torch/distributions/" in f.f_code.co_filename.replace(os.sep, "/"):
            return (
                "the read is torch.distributions checking its arguments (validate_args): "
                "pass validate_args=False to the distribution, or call torch.distributions."
                "Distribution.set_default_validate_args(False) before autobatch."
            )
        f = f.f_back
    return ""


_SETITEM = torch.Tensor.__setitem__

# Among the node ids a view shares memory with (recorder ``views``): a value of another
# round, or a tensor autobatch did not record.
_FOREIGN = -1


def _write(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An in-place torch call or method ``fn`` on lazy value ``args[0]``: recorded out of
    place by the recorder, the value then its result (``buffers.write_lazy``, which refuses
    what it cannot take)."""
    rec = _LOCAL.rec
    if rec is None or rec.paused:
        name = "__setitem__ (x[...] = v)" if fn is _SETITEM else f".{fn.__name__}()"
        _inplace(args[0], name)
    return rec.write_lazy(fn, args, kwargs, False)


# The modules of torch.nn that change their input in place where built with
# ``inplace=True`` (an activation, a dropout).
_IN_PLACE_MODULES = frozenset(
    getattr(nn, name)
    for name in (
        "ReLU ReLU6 LeakyReLU ELU CELU SELU SiLU Mish Hardswish Hardsigmoid Hardtanh Threshold "
        "RReLU Dropout Dropout1d Dropout2d Dropout3d AlphaDropout FeatureAlphaDropout"
    ).split()
    if hasattr(nn, name)
)

# Per torch function, the index of its ``inplace`` parameter (None: it has none); and those
# of torch.nn.functional that have one, which the C path leaves to the recorder where
# ``inplace=True`` (``configure_in_place``).
_INPLACE_PARAMETER: dict[Any, int | None] = {}


def _inplace_index(fn: Any) -> int | None:
    index = _INPLACE_PARAMETER.get(fn, -1)
    if index == -1:
        try:
            names = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            names = []
        if len(_INPLACE_PARAMETER) > 4096:  # (functions made on the fly: kept bounded)
            _INPLACE_PARAMETER.clear()
        index = _INPLACE_PARAMETER[fn] = names.index("inplace") if "inplace" in names else None
    return index


_INPLACE_INDEX = {
    f: i
    for f in (getattr(torch.nn.functional, name) for name in dir(torch.nn.functional))
    if callable(f) and not isinstance(f, type) and (i := _inplace_index(f)) is not None
}

# Per module of ``_IN_PLACE_MODULES`` met with ``inplace=True``: (its settings then, a copy of
# it with ``inplace=False``, the recorder that last looked, held weakly), the copy recorded
# in its place (one op however many calls).  Its settings are compared once per recorder (a
# round's: within it, a module set anew after a call read it is refused,
# recorder._guard_class).
_OUT_OF_PLACE: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()


def _NO_RECORDER() -> None:
    return None


def in_place_form(
    fn: Any, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, str, tuple[Any, ...], dict[str, Any]] | None:
    """Where a call changes its first argument in place through an ``inplace=True`` flag
    (``F.relu(h, inplace=True)``; a module of ``_IN_PLACE_MODULES`` built with it,
    ``nn.ReLU(inplace=True)(h)``): its out-of-place form (function, kind, arguments,
    keywords), which the recorder records as an in-place change of the lazy value
    (``buffers.write_lazy``: the value object becomes the result, as the tensor does in
    eager code); else None."""
    if kind == "module":
        if type(fn) not in _IN_PLACE_MODULES or fn.__dict__.get("inplace") is not True:
            return None
        got = _OUT_OF_PLACE.get(fn)
        rec = _LOCAL.rec
        if got is None or got[2]() is not rec:
            settings = {k: v for k, v in fn.__dict__.items() if k != "inplace"}
            if got is None or got[0] != settings:
                twin = copy.copy(fn)
                twin.inplace = False
                got = _OUT_OF_PLACE[fn] = [settings, twin, None]
            got[2] = _NO_RECORDER if rec is None else weakref.ref(rec)  # (not kept alive)
        return got[1], kind, args, kwargs
    if kind != "torch":
        return None
    index = _inplace_index(fn)
    if index is None:
        return None
    if kwargs.get("inplace") is True:
        return fn, kind, args, {**kwargs, "inplace": False}
    if len(args) > index and args[index] is True:
        return fn, kind, (*args[:index], False, *args[index + 1 :]), kwargs
    return None


def _inplace(self: Lazy, name: str, out: bool = False) -> None:
    """The FoldError for an in-place change of a lazy value that autobatch cannot record:
    through ``out=`` (``out``), or outside the function it runs."""
    if out:
        raise FoldError(
            f"autobatch: example {self.rec.example}: in-place {name} on a lazy value through "
            "out=: autobatch records a value as a call's result only. Fix: compute out of "
            "place and rebind the name (x = torch.add(a, b) for torch.add(a, b, out=x))."
        )
    raise FoldError(
        f"autobatch: in-place {name} on a lazy value outside the function autobatch runs "
        "(kept from an earlier call, or used while its graph runs). Fix: use the results "
        "autobatch returns."
    )


def _inplace_call(rec: _Recorder, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An in-place torch call with a lazy argument: on a lazy value (but ``out=``), recorded
    (``buffers.write_lazy``); else a FoldError.  On an eager tensor
    (``buf.add_(y)``, ``buf.copy_(y)``, ``acc += y``, ``buf[0] = y``, ``out=buf``) it would
    change nothing that the Fold computes: the tensor stays as it was, and every alias of it
    with it."""
    name = _fn_name(fn, "torch")
    target = kwargs.get("out", args[0] if args else None)
    if type(target) is Lazy:
        if "out" not in kwargs:
            return rec.write_lazy(fn, args, kwargs, False)
        _inplace(target, name, out=True)
    what = "out=" if "out" in kwargs else name
    raise FoldError(
        f"autobatch: example {rec.example}: {what} writes a recorded value into an eager "
        "tensor in place that is not one the example made for it (one made before the call "
        "or by another example, by torch.tensor, or one with a view taken before the write). "
        "Inside autobatch a recorded value is computed only after every example is recorded, "
        "so the eager tensor (and every alias of it) would keep its old value. Fix: compute "
        "out of place and rebind the name: buf = buf + y (for buf.add_(y) or acc += y), "
        "buf = y (for buf.copy_(y)), torch.where or torch.cat (for buf[i] = y); or make the "
        "tensor inside the function with torch.zeros(...) or torch.zeros_like(...) and write "
        "into it there."
    )


def _record_method(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A tensor method or operator called on a lazy value ``args[0]``: record it.

    A method of an earlier round's value whose other arguments are plain numbers, slices or
    ``None`` (``enc[i]``, ``h[0]``, ``x.view(-1)``) runs at once on its row, as the recorder
    would run it (see ``recorder._computed``), without the recorder's walk of the
    arguments: a parser indexes its encoder's rows so at every step."""
    rec = getattr(args[0], "rec", None)
    if rec is None:
        raise _unfilled(_fn_name(func, "torch"))
    if kwargs:
        args, kwargs = _given(func, args, kwargs)
    if rec.values is not None and not kwargs:  # (in-place methods never come here)
        session = rec.session
        cur = session.current if session is not None else None
        # Only inside the call that made the value, while it records (a value kept beyond
        # its call is refused by the recorder's path), or its examples finish eagerly (as
        # the C path, ``earlier_method``, takes both).
        if cur is not None and cur is not rec and cur is _LOCAL.rec and session.rounds:
            for a in args[1:]:
                t = type(a)
                if t not in _PLAIN and not (t is tuple and all(type(x) in _PLAIN for x in a)):
                    break
            else:
                row = _value_of(args[0])
                if func in _PURE_METHODS and not _any_autocast():
                    return _memoised(session, func, args[0], row, args[1:])
                out = func(row, *args[1:])
                _note_shared(func, out, args, (row,))
                return out
        if cur is not None and session.eager and cur is _LOCAL.rec:
            # The examples finish as eager code: the method on the value's row, at once.
            row, given = _value_of(args[0]), [_eager_value(a, session) for a in args[1:]]
            out = func(row, *given)
            _note_shared(func, out, args, (row, *given))
            return out
    return rec.record(func, "torch", args, kwargs)


_PLAIN = frozenset((int, float, bool, type(None), slice, type(Ellipsis)))

# The methods of an earlier round's value that run at once memoised (see _memoised): pure and
# deterministic, so a call on the same value with the same plain arguments gives the same
# value.  A parser indexes its encoder's rows with the positions on its stack at every step
# (``enc[stack[-1]]``, ``enc[0] * 0``), most of them positions it indexed a step before.
_PURE_METHODS = frozenset(
    getattr(torch.Tensor, name)
    for name in (
        "__getitem__ __add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ "
        "__rtruediv__ __neg__ __pow__ __rpow__ view reshape flatten squeeze unsqueeze t "
        "transpose permute narrow select expand contiguous detach sum mean"
    ).split()
)

# Those whose result may share the value's memory (a view, or the value itself): it is kept
# once per value and arguments, as eager views of one slice share its memory, noted among
# the value's views (its recorder's ``views_of``: an in-place change of the value is refused
# while it is in use, ``in_use``) and never changed in place itself (``fixed``).  Any other
# result is a value of its own each call (an in-place change of one must not reach another).
_VIEW_METHODS = frozenset(
    getattr(torch.Tensor, name)
    for name in (
        "__getitem__ view reshape flatten squeeze unsqueeze t transpose permute narrow select "
        "expand contiguous detach"
    ).split()
)


def _array_noted(x: Lazy, out: Any) -> Any:
    """``out``, a numpy array of ``x``'s value (``.numpy()``, ``np.asarray``), which shares
    its memory as eager code's does: noted (``_note_tensor``), so that an in-place change of
    ``x`` while it lives is refused (eager code would change the array too)."""
    try:
        _note_tensor(x, out)
    except TypeError:  # (no weak reference to it: not an array of the row's memory)
        pass
    return out


def _note_shared(func: Any, out: Any, args: tuple[Any, ...], given: Any) -> None:
    """After ``func`` ran at once on the rows ``given`` of ``args``: where its result may share
    memory with one (see fold/_clazy.c, ``may_share``), the lazy values among ``args`` are
    marked (``_mark_shared``)."""
    if func is _DETACH or torch.is_inference_mode_enabled():
        _mark_shared(args, out)
        return
    outs = out if type(out) is tuple or type(out) is list else (out,)
    for o in outs:
        if isinstance(o, torch.Tensor) and (o._base is not None or any(o is g for g in given)):
            _mark_shared(args, out)
            return


_DETACH = torch.Tensor.detach


def _mark_shared(args: tuple[Any, ...], out: Any) -> None:
    """``out``, the result of a call run at once on the rows of earlier rounds' values among
    ``args`` (one level of lists and tuples too), may share memory with one (a view,
    ``detach``, the row itself: the C path and ``_note_shared`` call this where it may): its
    tensors are noted, held weakly, as sharing memory with those values (in their
    recorders' ``eager_of``; under inference mode, whose views keep no base, only those
    whose row's memory a tensor shares)."""
    outs = out if type(out) is tuple or type(out) is list else (out,)
    exact = torch.is_inference_mode_enabled()
    for a in args:
        for x in a if type(a) is list or type(a) is tuple else (a,):
            if type(x) is Lazy and getattr(x.rec, "values", None) is not None:
                memory = None
                if exact:
                    row = _value_of(x)
                    memory = None if row is None else row.untyped_storage().data_ptr()
                for o in outs:
                    if isinstance(o, torch.Tensor) and (
                        memory is None or o.untyped_storage().data_ptr() == memory
                    ):
                        _note_tensor(x, o)


def _note_tensor(x: Lazy, o: Any) -> None:
    """Note ``o`` (a tensor, a numpy array) as sharing lazy value ``x``'s memory: in its
    recorder's ``eager_of``, held weakly; where ``x`` is in a group (a view, or a value a view
    was taken of: ``_share``), in the group, which outlives ``x`` (``a = v.detach(); del v``
    still ties ``a`` to what ``v`` viewed)."""
    if x.rec.shared.get(x.node) is not None:
        _share(x, o)
    else:
        x.rec.eager_of.setdefault(x.node, []).append(weakref.ref(o))


def _share(a: Any, b: Any) -> None:
    """Note that ``a`` and ``b`` (lazy values or tensors) may share memory: they join one
    group of such values (through others too: a view of a view shares its base's memory
    after the view between is gone), which each lazy member finds in its recorder's
    ``shared`` by its node.  A group holds its members weakly, each with its node then (a
    member changed in place since is a value of its own).  An in-place change of a value of
    an earlier round reads it (``in_use``)."""
    ga, gb = _group_of(a), _group_of(b)
    if ga is None or gb is None or ga is gb:
        group = gb if ga is None else ga
        if group is None:
            group = []
    else:  # two groups: one, the members of the smaller found in the larger's
        group, other = (ga, gb) if len(ga) >= len(gb) else (gb, ga)
        for ref, node in other:
            o = ref()
            if o is not None:
                group.append((ref, node))
                if type(o) is Lazy and o.node is node:
                    o.rec.shared[node] = group
    for v, g in ((a, ga), (b, gb)):
        if g is None:
            lazy = type(v) is Lazy
            group.append((weakref.ref(v), v.node if lazy else None))
            if lazy:
                v.rec.shared[v.node] = group


def _group_of(v: Any) -> list[Any] | None:
    return v.rec.shared.get(v.node) if type(v) is Lazy else None


def in_use(x: Lazy) -> bool:
    """Whether a value that may share memory with lazy value ``x`` is still in use: through
    its group (``_share``), the views of it kept once per value (``_memo_wrap``, in its
    recorder's ``views_of``) and the tensors made of its row at once (``eager_of``), and
    theirs in turn: a tensor alive, or a lazy value held beyond autobatch's own references
    (a kept view is held by the memo too)."""
    seen = {id(x)}
    todo = [x]
    while todo:
        v = todo.pop()
        rec, node = v.rec, v.node
        for ref in rec.eager_of.get(node, ()):
            if ref() is not None:
                return True
        for ref in rec.views_of.get(node, ()):
            o = ref()
            if o is not None and id(o) not in seen:
                seen.add(id(o))
                # (this name, getrefcount's argument, the memo)
                if sys.getrefcount(o) > 3:
                    return True
                todo.append(o)
        for ref, stamp in rec.shared.get(node, ()):
            o = ref()
            if o is None or id(o) in seen:
                continue
            if type(o) is not Lazy:
                return True  # (a tensor: alive)
            if o.node is not stamp:
                continue  # changed in place since: a value of its own
            seen.add(id(o))
            if sys.getrefcount(o) > 2 + (o.node in o.rec.fixed):
                return True
            todo.append(o)
    return False


def _memoised(session: Any, func: Any, x: Lazy, row: torch.Tensor, rest: tuple[Any, ...]) -> Any:
    """``func(row, *rest)`` for a method of ``x``, a value of an earlier round (its row
    ``row``), with plain arguments ``rest``: at once, as eager code runs it, but made once
    per autobatch call for each value, method, arguments and grad mode (and version of the
    row: an in-place change to what it views makes it anew); the result is a lazy value of
    ``x``'s round, whose methods memoise alike (``enc[0] * 0``).  The C path
    (fold/_clazy.c, ``earlier_method``) builds the same key and shares the memo."""
    key = _memo_key(func, x, row, rest)
    if key is None:
        out = func(row, *rest)
        _note_shared(func, out, (x,), (row,))
        return out
    got = session.memo.get(key)
    if got is None:
        out = func(row, *rest)
        if type(out) is not torch.Tensor:
            return out
        return _memo_wrap(x.rec, out, key, session.memo, x)
    return got if func in _VIEW_METHODS else Lazy(got.node, got.meta, got.rec)


def _memo_key(func: Any, x: Lazy, row: torch.Tensor, rest: tuple[Any, ...]) -> Any:
    grad = torch.is_grad_enabled()
    # Under inference mode the rows are inference tensors (no version counter): None, a
    # row of fold's own, which only fold writes.  (Grad mode first: it is off there.)
    version = None if not grad and torch.is_inference_mode_enabled() else version_of(row)
    parts = [func, x.rec, x.node, version, grad]
    for a in rest:
        p = _memo_part(a, False)
        if p is _MISS:
            return None
        parts.append(p)
    return tuple(parts)


def _memo_part(a: Any, nested: bool) -> Any:
    """An argument as a memo key part: equal parts for equal arguments only (1, True and 1.0
    apart; -0.0 apart from 0.0, by its bits); _MISS for one that is not keyed."""
    t = type(a)
    if t is int or a is None or a is Ellipsis:
        return a
    if t is bool:
        return (bool, a)
    if t is float:
        return (float, _DOUBLE_BITS.unpack(_DOUBLE.pack(a))[0])
    if t is slice:
        parts = (_memo_part(a.start, True), _memo_part(a.stop, True), _memo_part(a.step, True))
        return _MISS if _MISS in parts else (slice, *parts)
    if t is tuple and not nested:
        parts = tuple(_memo_part(x, True) for x in a)
        return _MISS if _MISS in parts else (tuple, *parts)
    return _MISS


_DOUBLE, _DOUBLE_BITS = struct.Struct("<d"), struct.Struct("<q")


def _memo_wrap(rec: Any, out: torch.Tensor, key: Any, memo: dict[Any, Any], x: Any) -> Lazy:
    """``out``, a method's result on ``x``, a value of ``rec``'s round, as a lazy value of
    that round (a node of its own, after the round's: its row ``out``), kept in ``memo``
    under ``key`` (the method ``key[0]``).  What the caller gets: that value where the method
    is a view (noted among ``x``'s views, and ``fixed``), else a value of its own on the same
    node (see ``_VIEW_METHODS``).  An in-place change of a value of an earlier round makes its new
    value so too, under a key of its own (``buffers.write_lazy``, ``x`` None)."""
    node = -1 - len(memo)  # (the round's nodes are handles, >= 0)
    rec.values[node] = (out.unsqueeze(0), 0)
    rec.rows_of[node] = out
    got = memo[key] = Lazy(node, _meta(out.shape, out.dtype, out.device, out.layout), rec)
    if x is None:
        return got
    if key[0] in _VIEW_METHODS:
        rec.fixed.add(node)  # (an in-place change of the view itself is refused)
        x.rec.views_of.setdefault(x.node, []).append(weakref.ref(got))
        if x.rec.shared.get(x.node) is not None:  # (x a view, or viewed: see _note_tensor)
            _share(x, got)
        return got
    return Lazy(node, got.meta, rec)


def _unfilled(what: str) -> FoldError:
    return FoldError(
        f"{what}: a lazy value lacks its node, meta or recorder (made without autobatch, "
        "or cleared by the garbage collector). Fix: use the lazy values autobatch makes, "
        "inside the function it runs."
    )


def _method(func: Any) -> Callable[..., Any]:
    if _C is not None:
        return _C.Method(func)  # its fast path, then _record_method

    def method(self: Lazy, *args: Any, **kwargs: Any) -> Any:
        return _record_method(func, (self, *args), kwargs)

    method.__name__ = func.__name__
    return method


def _inplace_method(name: str) -> Callable[..., Any]:
    func = getattr(torch.Tensor, name)

    def method(self: Lazy, *args: Any, **kwargs: Any) -> Any:
        return _write(func, (self, *args), kwargs)

    method.__name__ = name
    return method


def _inplace_operator(name: str) -> Callable[..., Any]:
    """``x += y`` and kin on a lazy value: in place where the recorder can take it (see
    ``buffers.write_lazy``: the value object changes, so every name and list holding it sees
    the change, as in eager code), else ``x + y``, a new value (the name rebound)."""
    func = getattr(torch.Tensor, name)
    plain = getattr(Lazy, "__" + name[3:])

    def operator(self: Lazy, other: Any) -> Any:
        rec = _LOCAL.rec
        if rec is not None and not rec.paused:
            out = rec.write_lazy(func, (self, other), {}, _how_stored(sys._getframe(1)))
            if out is not _MISS:
                return out
        return plain(self, other)

    operator.__name__ = name
    return operator


# An augmented assignment to an item, ``h[i] += v``: Python takes the view ``h[i]``, changes
# it in place, and sets it back with ``h[i] = ...``, which writes ``h`` (see
# buffers.write_lazy: where the view cannot change in place, ``h[i] + v`` does the same).
_ITEM_OPERATOR = 2

# Per code object and instruction offset of an augmented assignment: False where its result
# is stored into a name or an attribute; where into an item (``h[i] += v``), how the
# container is loaded (an instruction's name, its name argument and the attributes read
# after it: ``LOAD_FAST self`` then ``.parts``), or None where it is loaded otherwise.
_STORED_INTO_ITEM: dict[tuple[Any, int], Any] = {}

# The instructions of jumps: an expression that holds one is not followed back (_start_of).
_BRANCHES = ("JUMP", "POP_JUMP", "FOR_ITER", "SEND")


def _how_stored(frame: Any) -> int:
    """How the augmented assignment ``frame`` runs stores its result (``write_lazy``'s
    ``operator``): ``_ITEM_OPERATOR`` into an item of a tensor or lazy value (``h[i] +=
    v``: Python sets the item back, which writes ``h``), or of a container it cannot tell;
    True into a name, an attribute, or an item of a list, tuple or dict (``lst[0] += v``:
    setting a list's item back writes no tensor, so a view there must change in place as
    ``v += 1`` would, or be refused)."""
    key = (frame.f_code, frame.f_lasti)
    how = _STORED_INTO_ITEM.get(key, _MISS)
    if how is _MISS:
        how = _item_loader(frame.f_code, frame.f_lasti)
        if len(_STORED_INTO_ITEM) > 4096:  # (code made on the fly: keep it bounded)
            _STORED_INTO_ITEM.clear()
        _STORED_INTO_ITEM[key] = how
    if how is False:
        return True
    if how is None:
        return _ITEM_OPERATOR
    op, name, attrs = how
    if op == "LOAD_GLOBAL":
        scopes: tuple[Any, ...] = (frame.f_globals, frame.f_builtins)
    elif op == "LOAD_NAME":
        scopes = (frame.f_locals, frame.f_globals, frame.f_builtins)
    else:  # (LOAD_FAST, LOAD_DEREF)
        scopes = (frame.f_locals,)
    scope = next((scope for scope in scopes if name in scope), None)
    if scope is None:
        return _ITEM_OPERATOR
    container = scope[name]
    for attr in attrs:  # (an object's own attributes only: a property may do anything)
        own = getattr(container, "__dict__", None)
        if type(own) is not dict or attr not in own:
            return _ITEM_OPERATOR
        container = own[attr]
    return True if type(container) in (list, tuple, dict) else _ITEM_OPERATOR


def _item_loader(code: Any, offset: int) -> Any:
    """For the augmented assignment at ``offset`` of ``code``: False where its result is not
    stored into an item; else how the container is loaded, where by a name and attributes
    of it (``(opname, name, attributes)``), else None.  Read from the instructions around
    it: ``<container> <index> COPY 2 COPY 2 BINARY_SUBSCR <operand> BINARY_OP ... SWAP
    STORE_SUBSCR``."""
    instructions = list(dis.get_instructions(code))
    at = next((k for k, ins in enumerate(instructions) if ins.offset == offset), None)
    if at is None:
        return False
    for ins in instructions[at + 1 :]:
        if ins.opname not in ("SWAP", "COPY", "ROT_THREE", "ROT_TWO", "DUP_TOP"):
            if ins.opname != "STORE_SUBSCR":
                return False
            break
    operand = _start_of(instructions, at)
    if operand is None or operand < 3:
        return None
    names = [instructions[operand - k].opname for k in (1, 2, 3)]
    if names != ["BINARY_SUBSCR", "COPY", "COPY"]:
        return None
    index = _start_of(instructions, operand - 3)
    container = None if index is None else _start_of(instructions, index)
    if container is None:
        return None
    ins, attrs = instructions[container], instructions[container + 1 : index]
    if ins.opname in ("LOAD_FAST", "LOAD_NAME", "LOAD_GLOBAL", "LOAD_DEREF") and all(
        a.opname == "LOAD_ATTR" for a in attrs
    ):  # (a name, and attributes of it: self.parts)
        return ins.opname, ins.argval, tuple(a.argval for a in attrs)
    return None


def _start_of(instructions: list[Any], end: int) -> int | None:
    """The index of the first of the instructions before ``end`` that leave one value on the
    stack (an expression's), followed back by their stack effects; None where a jump comes
    between or the effects do not add up."""
    total = 0
    for j in range(end - 1, -1, -1):
        ins = instructions[j]
        if ins.opname.startswith(_BRANCHES):
            return None
        try:
            total += dis.stack_effect(ins.opcode, ins.arg, jump=False)
        except (ValueError, TypeError):
            return None
        if total == 1:
            return j
        if total > 1:
            return None
    return None


_OPERATORS = (
    "__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ "
    "__floordiv__ __rfloordiv__ __mod__ __rmod__ __pow__ __rpow__ __matmul__ __rmatmul__ "
    "__neg__ __pos__ __abs__ __invert__ __and__ __rand__ __or__ __ror__ __xor__ __rxor__ "
    "__lshift__ __rshift__ __eq__ __ne__ __lt__ __le__ __gt__ __ge__ __getitem__"
).split()


for _name in _OPERATORS:
    if _name == "__getitem__" and _C is not None:
        # The C storage's subscript (fold/_clazy.c, lazy_subscript): a Python __getitem__
        # would make a lazy value a sequence to torch, whose indexing of a tensor by one
        # (W[idx]) then reads its items one by one, with a warning.
        _C.configure_subscript(_method(torch.Tensor.__getitem__))
        continue
    setattr(Lazy, _name, _method(getattr(torch.Tensor, _name)))


for _name in "iadd isub imul itruediv ifloordiv imod ipow iand ior ixor ilshift irshift".split():
    setattr(Lazy, f"__{_name}__", _inplace_operator(f"__{_name}__"))


for _name in dir(torch.Tensor):
    if _name.startswith("_") or hasattr(Lazy, _name):
        continue
    _attr = getattr(torch.Tensor, _name, None)
    if not callable(_attr):
        continue
    if _name.endswith("_") and not _name.endswith("__"):
        setattr(Lazy, _name, _inplace_method(_name))
    else:
        setattr(Lazy, _name, _method(_attr))


_NUMBER_DTYPES = (torch.long, torch.bool)


def _as_number(dtype: torch.dtype) -> bool:
    """Whether a 0-dim per-example tensor of ``dtype`` travels as a Python number (which
    fold batches into a tensor of the same dtype)."""
    return dtype in _NUMBER_DTYPES or dtype is torch.get_default_dtype()


# ---------------------------------------------------------------------------- known values
class Known:
    """A tensor made per example from Python values inside the function autobatch runs
    (``torch.tensor(word)``, ``torch.tensor([1, 2])``): its value is known while recording,
    so no tensor is made unless one is needed.  Passed to a recorded call it is a literal
    column of the graph (a number where it is 0-d and of a dtype that travels as one: long,
    bool, the default float dtype); read back (``int``, ``float``, ``.item()``,
    ``.tolist()``, an index) it gives the value at once; anything else (a torch function of
    no lazy value, a tensor method, an attribute) runs on the tensor ``torch.tensor`` makes
    of it, made once, as eager code would.  ``isinstance(known, torch.Tensor)`` holds (its
    ``__class__``); ``type(known)`` is ``Known``.  Torch's C code takes that test as proof of
    a tensor's memory where its dispatch does not reach ``__torch_function__`` (data and
    number arguments): while autobatch runs, ``torch.tensor``, ``torch.as_tensor``,
    ``Tensor.new_tensor`` and the factories that take numbers (``torch.full``, ``arange``,
    ``linspace``: ``patches._WRAPPERS``) are given its tensor instead; elsewhere pass the
    number (``k.item()``) where torch takes one."""

    __slots__ = ("value", "meta", "number", "_made", "_plain")

    # isinstance(known, torch.Tensor) holds, as for the tensor it stands for: libraries check
    # their arguments so (torch.distributions' validation).  type() still tells it apart.
    __class__ = property(lambda self: torch.Tensor)  # type: ignore[assignment]

    def __init__(
        self,
        value: Any,
        meta: _Meta,
        number: bool,
        made: torch.Tensor | None = None,
        plain: bool = False,
    ) -> None:
        # A scalar's Python value; a flat list's numbers as a tuple (torch.tensor([0.0,
        # -inf]): see patches._known_numbers); ``made`` for data of other shapes.
        self.value = value
        self.meta = meta
        self.number = number  # travels as a Python number (see _as_number)
        self._made = made
        # A tuple of numbers with no NaN and no -0.0: numbers equal as Python numbers make
        # equal tensor values, so the tuple itself keys its row (see row).
        self._plain = plain

    def tensor(self) -> torch.Tensor:
        """The tensor ``torch.tensor`` makes of the value (made on first use, then kept)."""
        t = self._made
        if t is None:
            m = self.meta
            t = self._made = _TENSOR(self.value, dtype=m.dtype, device=m.device)
        return t

    def row(self) -> torch.Tensor:
        """Its batch-of-one tensor, as a literal argument of a recorded call.  A flat list of
        numbers (an action mask made per step) takes a row made once per distinct value and
        meta, shared by every known value equal to it bit for bit: a literal row is only
        read (copied into its column, see ``fold.ops.literal_value``), so sharing it is
        safe, and a parser's masks make a tensor per distinct mask, not per step."""
        v = self.value
        if type(v) is not tuple or self._made is not None:
            # (Its tensor may change in place later, while the call waits for its round:
            # a copy of it as it is now.)
            return self.tensor().unsqueeze(0).clone()
        m = self.meta
        if self._plain:
            key: Any = (m, v)
        else:
            bits = _bits(v, m.dtype)
            if bits is None:
                return self.tensor().unsqueeze(0)
            key = (m, bits)
        r = _ROWS.get(key)
        if r is None:
            if len(_ROWS) >= _ROWS_MAX:
                _ROWS.clear()
            r = _ROWS[key] = _TENSOR(v, dtype=m.dtype, device=m.device).unsqueeze(0)
        return r

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        return _known_call(func, args, kwargs or {})

    # What is known without the tensor.
    shape = property(lambda self: self.meta.shape)
    dtype = property(lambda self: self.meta.dtype)
    device = property(lambda self: self.meta.device)
    ndim = property(lambda self: self.meta.ndim)

    def size(self, dim: int | None = None) -> Any:
        return self.meta.shape if dim is None else self.meta.shape[dim]

    def dim(self) -> int:
        return self.meta.ndim

    def numel(self) -> int:
        return self.meta.shape.numel()

    def item(self) -> Any:
        return self.value if self.number else self.tensor().item()

    def tolist(self) -> Any:
        return self.value if self.number else self.tensor().tolist()

    def __int__(self) -> int:
        return int(self.value) if self.number else int(self.tensor())

    def __float__(self) -> float:
        return float(self.value) if self.number else float(self.tensor())

    def __bool__(self) -> bool:
        return bool(self.value) if self.number else bool(self.tensor())

    def __index__(self) -> int:
        return self.tensor().__index__()

    def __len__(self) -> int:
        return len(self.tensor())

    def __iter__(self) -> Any:
        return iter(self.tensor())

    def __repr__(self) -> str:
        return repr(self.tensor())

    __hash__ = object.__hash__

    def __getattr__(self, name: str) -> Any:  # tensor methods and attributes: on the tensor
        got = getattr(self.tensor(), name)
        if _is_inplace(got):  # add_, zero_, fill_
            return functools.partial(_in_place, self, got)
        return got

    def __setitem__(self, key: Any, value: Any) -> None:
        self.tensor()[key] = value
        self._changed()

    def _changed(self) -> None:
        """Its tensor was changed in place (``t.add_(1)``, ``t[0] = 5``): from now on its
        value is the tensor's, not the Python value it was made of."""
        self.number = self._plain = False

    def __copy__(self) -> Known:  # (either may be changed in place later)
        if self._made is None:
            return Known(self.value, self.meta, self.number, None, self._plain)
        return Known(None, self.meta, False, self._made.clone())

    def __deepcopy__(self, memo: Any) -> Any:
        return self.tensor().clone()

    def __reduce_ex__(self, protocol: Any) -> Any:  # pickled (torch.save) as its tensor
        return self.tensor().__reduce_ex__(protocol)

    def __format__(self, spec: str) -> str:
        return self.tensor().__format__(spec)


def _in_place(known: Known, method: Any, *args: Any, **kwargs: Any) -> Any:
    """An in-place method of a known value's tensor: run, then the value is the tensor's."""
    out = method(*args, **kwargs)
    known._changed()
    return out


# (meta, the numbers, or their bits) -> the batch-of-one row of a known flat list (see
# Known.row); bounded, emptied by clear_cache.  Lists holding a NaN or -0.0 are keyed by
# their numbers' bits, so 0.0 and -0.0 (equal as numbers) and NaNs of any payload each keep
# their own row.
_ROWS: dict[tuple[Any, Any], torch.Tensor] = {}
_ROWS_MAX = 4096


def _bits(value: tuple[Any, ...], dtype: torch.dtype) -> bytes | None:
    """The numbers of a known flat list as bytes: doubles where the dtype is floating and
    every number a float, int64 where it is not and none is; None for a mix (a key that
    told equal rows apart exactly would cost more than the row)."""
    floating = dtype.is_floating_point
    for x in value:
        if (type(x) is float) is not floating:
            return None
    return array("d" if floating else "q", value).tobytes()


def _known_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A torch function or operator with a known value among its arguments: recorded where
    a lazy value is among them too (the known value a batched argument), else run at once
    on the known values' tensors, as eager code runs it."""
    for a in (*args, *kwargs.values()):
        if type(a) is Lazy:
            return a.rec.record(func, "torch", args, kwargs)
        if type(a) in (list, tuple):
            for x in a:
                if type(x) is Lazy:
                    return x.rec.record(func, "torch", args, kwargs)
    return func(*_tensors_of(args), **{k: _tensor_of(v) for k, v in kwargs.items()})


def _tensor_of(a: Any) -> Any:
    if type(a) is Known:
        return a.tensor()
    if type(a) in (list, tuple):
        return type(a)(_tensor_of(x) for x in a)
    return a


def _tensors_of(args: tuple[Any, ...]) -> list[Any]:
    return [_tensor_of(a) for a in args]


def _known_operator(func: Any) -> Callable[..., Any]:
    def operator(self: Known, *args: Any) -> Any:
        return _known_call(func, (self, *args), {})

    operator.__name__ = func.__name__
    return operator


for _name in _OPERATORS:
    setattr(Known, _name, _known_operator(getattr(torch.Tensor, _name)))


def _known_invert(self: Known) -> Any:
    """``~k`` of a known bool value (``~torch.tensor(ok)``, a parser's illegal actions):
    the known value of the negated flags, without a tensor; any other, as torch computes."""
    if self.meta.dtype is torch.bool and self._made is None:
        v = self.value
        if type(v) is tuple:
            return Known(tuple(not x for x in v), self.meta, False, plain=True)
        if self.number:
            return Known(not v, self.meta, True)
    return _known_call(torch.Tensor.__invert__, (self,), {})


Known.__invert__ = _known_invert  # type: ignore[method-assign]


def _known_inplace_operator(name: str) -> Callable[..., Any]:
    """``k += y`` and kin on a known value: in place on its tensor, as eager code changes
    the tensor every alias of it sees (without it, Python would rebind ``k`` to ``k + y``).
    With a lazy ``y`` (``loss = torch.tensor(0.0)``, then ``loss += step_loss``), Python
    rebinds ``k`` to the recorded ``k + y``, as before: the known value stays as it was."""

    def operator(self: Known, other: Any) -> Any:
        if type(other) is Lazy:
            return NotImplemented
        getattr(self.tensor(), name)(_tensor_of(other))
        self._changed()
        return self

    operator.__name__ = name
    return operator


for _name in (
    "__iadd__ __isub__ __imul__ __itruediv__ __ifloordiv__ __imod__ __ipow__ __iand__ "
    "__ior__ __ixor__ __ilshift__ __irshift__"
).split():
    setattr(Known, _name, _known_inplace_operator(_name))


class RowNumber:
    """A Python number that differs per example, where autobatch records the function once for
    every row (``traced._traced``): a Dataset's label, ``(image, 3)``, or a list of ints given
    beside the tensors.  ``lazy`` is the rows' numbers as a 0-d lazy row (long, bool, or
    float64, so that a Python float keeps its bits).  ``torch.tensor(y)``,
    ``torch.tensor([y])`` and ``torch.as_tensor(y)`` give the rows' values as torch.tensor
    gives the number (``patches._recording_tensor``); any other use (``int(y)``, ``y == 3``,
    ``range(y)``, an index of a list, arithmetic, ``str``) is a read: where every row holds
    one value it is that number, else the rows are recorded again per value
    (``traced._Lockstep``), so the function meets each row's own number, as in eager code.
    ``isinstance(y, int)`` holds (its ``__class__``); ``type(y)`` is ``RowNumber``.  A torch
    call given ``y`` itself (``x * y``) and a hash (a dict's key) make the batch fall back
    to recording per example, where ``y`` is the number."""

    __slots__ = ("lazy", "type")

    __class__ = property(lambda self: self.type)  # type: ignore[assignment]

    def __init__(self, lazy: Lazy, kind: type) -> None:
        self.lazy, self.type = lazy, kind

    def value(self) -> Any:
        """The number every row holds (a read), while the function is recorded; anywhere
        else (a recorded call given the number itself, run on the batch) a TypeError: the
        batch then falls back to recording per example."""
        x = self.lazy
        if _LOCAL.rec is not x.rec:
            raise TypeError(
                "autobatch: a number per row used outside the recording of its function"
            )
        return x.rec.lockstep.read(x, self.type, True)

    def __hash__(self) -> int:
        # Unhashable, as a list is: no table of autobatch's (an op's key) nor of the user's
        # may keep it; a dict lookup by it makes the batch record per example.
        raise TypeError("autobatch: a number per row is not hashable")

    def tensor_row(self, dtype: torch.dtype | None, device: Any) -> Lazy:
        """The rows as ``torch.tensor(number, dtype=dtype, device=device)`` makes each:
        the dtype torch infers for the number where none is given."""
        x = self.lazy
        meta = x.meta
        if dtype is None:
            dtype = torch.get_default_dtype() if self.type is float else meta.dtype
        if device is not None and torch.device(device) != meta.device:
            return x.to(dtype=dtype, device=device)
        if dtype is not meta.dtype:
            return x.to(dtype)
        # The rows' own value, held by a lazy value of its own (no call): an in-place
        # change of one rebinds it alone, as a change of a tensor torch.tensor made.
        return Lazy(x.node, meta, x.rec)


def _row_number_binary(fn: Callable[[Any, Any], Any], reflected: bool) -> Callable[..., Any]:
    """A binary operator of a number per row: ``fn`` of the number every row holds (a read)
    and the other operand, through Python's own dispatch (``y + 0.5`` as ``3 + 0.5``)."""
    if reflected:
        return lambda self, other: fn(other, self.value())
    return lambda self, other: fn(self.value(), other)


def _row_number_unary(fn: Callable[..., Any]) -> Callable[..., Any]:
    return lambda self, *args: fn(self.value(), *args)


for _name, _fn in (
    ("add", operator.add),
    ("sub", operator.sub),
    ("mul", operator.mul),
    ("truediv", operator.truediv),
    ("floordiv", operator.floordiv),
    ("mod", operator.mod),
    ("divmod", divmod),
    ("pow", operator.pow),
    ("and", operator.and_),
    ("or", operator.or_),
    ("xor", operator.xor),
    ("lshift", operator.lshift),
    ("rshift", operator.rshift),
):
    setattr(RowNumber, f"__{_name}__", _row_number_binary(_fn, False))
    setattr(RowNumber, f"__r{_name}__", _row_number_binary(_fn, True))
for _name, _fn in (
    ("eq", operator.eq),
    ("ne", operator.ne),
    ("lt", operator.lt),
    ("le", operator.le),
    ("gt", operator.gt),
    ("ge", operator.ge),
):
    setattr(RowNumber, f"__{_name}__", _row_number_binary(_fn, False))
for _name, _fn in (
    ("neg", operator.neg),
    ("pos", operator.pos),
    ("abs", abs),
    ("invert", operator.invert),
    ("bool", bool),
    ("int", int),
    ("float", float),
    ("complex", complex),
    ("index", operator.index),
    ("round", round),
    ("trunc", math.trunc),
    ("floor", math.floor),
    ("ceil", math.ceil),
    ("str", str),
    ("format", format),
):
    setattr(RowNumber, f"__{_name}__", _row_number_unary(_fn))


def _row_number_repr(self: RowNumber) -> str:
    """The number (a read) while its function is recorded; outside it (a traceback, a
    debugger), what it is."""
    if _LOCAL.rec is not self.lazy.rec:
        return f"<autobatch: a {self.type.__name__} per row>"
    return repr(self.value())


RowNumber.__repr__ = _row_number_repr  # type: ignore[method-assign,assignment]


if _C is not None:
    _C.configure(
        Lazy,
        nn.Module,
        torch.Tensor,
        _MISS,
        _LOCAL,
        torch.is_grad_enabled,
        _any_autocast,
        "torch",
        _record_method,
        _torch_function,
        _BATCHED,
        torch.long,
        torch.bool,
        torch.get_default_dtype,
        Known,
        torch.strided,
    )
    _C.configure_memo(
        _PURE_METHODS,
        _VIEW_METHODS,
        _memo_wrap,
        torch.is_inference_mode_enabled,
        _mark_shared,
        _DETACH,
    )
    _C.configure_defaults(_KW_DEFAULTS, _POSITIONAL, _FILLS)
    _C.configure_in_place(_INPLACE_INDEX, set(_IN_PLACE_MODULES))
