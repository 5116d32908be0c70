"""Buffers an example made and writes recorded values into in place.

Per-example code often fills a tensor it made itself: ``encoder_outputs = torch.zeros(
MAX_LENGTH, H)``, then ``encoder_outputs[ei] = out[0, 0]`` at each step (PyTorch's
translation tutorial encodes so).  A recorded value has no numbers yet, so the write cannot
happen in the tensor's memory.  Where the tensor is the example's own, the write is
recorded out of place instead (``_put``: a copy with the rows written), and the tensor
becomes a *written buffer*: its class is set to ``_Written`` for the rest of the call, whose
``__torch_function__`` hands every torch call on it the recorded value it now holds, and
records every later write the same way.  The tensor object stays the one the example holds,
so every alias of it sees the writes, as in eager code.

A write through a view of such a tensor (``buf[ei] += out``: Python writes into the view
``buf[ei]``, then sets it back) writes the buffer's part the view sees (``_put_region``),
and the view becomes a written buffer whose value is that part (``_region``), read from
the buffer's value at each use.  So does every view of a written buffer (``buf[t]``,
``buf.T``, ``buf[1:3]``, ``buf.view(-1)``: ``_views``): writing into it (``buf[t].mul_(2)``)
writes the buffer, as in eager code.

A tensor is the example's own where it was made during the call by a factory autobatch
wraps (``torch.zeros``, ``ones``, ``full``, ``empty``, ``rand``, ``randn``, ``randint``,
``eye``, ``arange``, ``linspace``, ``logspace``, ``zeros_like``, ``ones_like``,
``empty_like``, ``full_like`` (of a recorded value too: made from its shape alone),
``Tensor.new_zeros`` and kin; noted by ``note_made``) by the example that writes it, is no
view itself, has no view but the one written through, and needs no gradient.  Any other
eager tensor written with a recorded value stays a FoldError (``values._inplace_call``): a
tensor shared by the examples, or one made before the call, would be written by every
example at once, and a view taken before the write would keep the old values.

When the call ends, each written buffer gets its class back (``restore``); a buffer the
function returns is its recorded value among the results.  The tensor itself keeps what it
held before its first recorded write: its values exist only in the call's results.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch

from fold._encoding import node_id
from fold.autobatch import values
from fold.autobatch.common import _C, _INPLACE, _LOCAL, _MISS, _is_inplace
from fold.autobatch.values import _FOREIGN, _ITEM_OPERATOR, Lazy
from fold.errors import FoldError
from fold.graph import Fold

# torch.where as fold found it at import: while autobatch runs, ``torch.where`` is its
# wrapper (patches._DIRECT_TORCH), which the tables do not know.
_WHERE = torch.where
_SETITEM = torch.Tensor.__setitem__
_F = torch.nn.functional
_NO_SUBCLASS = torch._C.DisableTorchFunctionSubclass


def _put(x: torch.Tensor, index: Any, value: Any) -> torch.Tensor:
    """``x`` with ``x[index] = value`` done on a copy: a write into a buffer, out of place."""
    out = x.clone()
    out[index] = value
    return out


def _region(x: torch.Tensor, shape: Any, stride: Any, offset: int) -> torch.Tensor:
    """The part of buffer value ``x`` that a view of the buffer sees: its ``shape`` and
    ``stride`` at ``offset`` elements into the (contiguous) buffer."""
    x = x.contiguous()
    return x.as_strided(shape, stride, x.storage_offset() + offset)


def _put_region(x: torch.Tensor, shape: Any, stride: Any, offset: int, value: Any) -> torch.Tensor:
    """``x`` with the part a view sees (see ``_region``) set to ``value``, on a copy: a write
    through a view of a buffer (``buf[t] += h``), out of place."""
    out = x.contiguous().clone()
    out.as_strided(shape, stride, out.storage_offset() + offset).copy_(value)
    return out


class _View:
    """What a written buffer that views another holds: that buffer's part, read from the
    other's value at each use, and written through to it (``_put_region`` at the part's
    place in ``base``, the buffer viewed).  Where the view was made of a written buffer
    (``_views``), ``read`` makes the part from ``parent``'s value (the view call itself, on
    the value: ``encoder_outputs.unsqueeze(0)`` reads as the value's ``unsqueeze(0)``);
    else (a view written through before its buffer was, ``write``) ``_region`` does."""

    __slots__ = ("base", "shape", "stride", "offset", "parent", "read")

    def __init__(
        self,
        base: Any,
        shape: Any,
        stride: Any,
        offset: int,
        parent: Any = None,
        read: Any = None,
    ) -> None:
        self.base, self.shape, self.stride, self.offset = base, shape, stride, offset
        self.parent, self.read = parent, read


class _Written(torch.Tensor):
    """The class of a written buffer while its autobatch call runs (see the module's
    docstring): every torch call on it takes the recorded value it holds."""

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        rec = _LOCAL.rec
        if rec is None or rec.session is None:  # a round runs, or fold's own bookkeeping
            with _NO_SUBCLASS():
                return func(*args, **kwargs)
        session = rec.session
        table = session.written
        if args and type(args[0]) is _Written:
            if not kwargs and func in _VIEWS:
                # The view made before by the same call (``encoder_outputs.unsqueeze(0)``
                # at every step), found first: see _views.
                got = _view_again(session, table, rec, func, args)
                if got is not None:
                    return got
            if _INPLACE[func]:
                return _write(rec, table, func, args, kwargs)
            name = getattr(func, "__name__", None)
            if name == "__get__":  # an attribute (.shape, .T)
                name = func.__self__.__name__
                if name in _OWN:  # (the tensor's own: fold's checks of an argument)
                    with _NO_SUBCLASS():
                        return func(*args, **kwargs)
                if name in _VIEW_ATTRIBUTES:
                    return _views(rec, table, func, args, kwargs)
                return getattr(held(args[0], table, rec), name)
            if func in _VIEWS and not _lazy_among((args[1:], kwargs)):
                return _views(rec, table, func, args, kwargs)
            if name is not None and getattr(torch.Tensor, name, None) is func:
                # A method (repr, len, iteration, .tolist()): the value's own.
                rest = _held(args[1:], table, rec)
                # (torch's own defaults a protocol method passes on: __repr__'s
                # tensor_contents=None)
                kw = {k: _held(v, table, rec) for k, v in kwargs.items() if v is not None}
                return getattr(held(args[0], table, rec), name)(*rest, **kw)
        args = _held(args, table, rec)
        kwargs = {k: _held(v, table, rec) for k, v in kwargs.items()}
        for a in (*args, *kwargs.values()):  # a method (unsqueeze) reaches a lazy value
            if type(a) is Lazy or (type(a) in (tuple, list) and any(type(x) is Lazy for x in a)):
                return Lazy.__torch_function__(func, (Lazy,), args, kwargs)
        return func(*args, **kwargs)


# Calls that give a view of a tensor (its memory, read and written through): on a written
# buffer each gives a written buffer of its own, the part of the buffer it views (see
# _views), so that writing into it writes the buffer, as in eager code.
_VIEW_NAMES = (
    "__getitem__ view view_as reshape reshape_as narrow select unsqueeze squeeze flatten "
    "unflatten t transpose swapaxes swapdims permute movedim moveaxis expand expand_as "
    "diagonal as_strided unbind split chunk tensor_split hsplit vsplit unfold detach alias"
).split()
_VIEWS = frozenset(
    f
    for space in (torch.Tensor, torch)
    for f in (getattr(space, n, None) for n in _VIEW_NAMES)
    if f is not None
)
_VIEW_ATTRIBUTES = frozenset(("T", "mT", "H", "mH", "data"))


def _lazy_among(a: Any) -> bool:
    """Whether a lazy or known value (a recorded index) is in ``a``, however nested."""
    t = type(a)
    if t in _NOT_LAZY:
        return False
    if t is Lazy or t is _Written or (t is not torch.Tensor and isinstance(a, torch.Tensor)):
        return True
    if t is tuple or t is list:
        for x in a:
            if _lazy_among(x):
                return True
        return False
    if t is dict:
        return _lazy_among(tuple(a.values()))
    return False


_NOT_LAZY = frozenset((int, float, bool, type(None), slice, str, torch.Tensor))


def _view_again(session: Any, table: dict[int, list[Any]], rec: Any, func: Any, args: Any) -> Any:
    """The view ``func(*args)`` of written buffer ``args[0]`` where the same call made it
    before (its other arguments plain ints, see _views) and it is still that buffer's view
    of the recording example; else None (``_views`` makes it, with ``held``'s checks)."""
    buf = args[0]
    key = _again_key(buf, func, args[1:])
    if key is None:
        return None
    entry = table.get(id(buf))
    if entry is None or entry[0] is not buf or entry[2] != rec.example:
        return None
    got = session.views.get(key)
    if got is not None and got[0] is buf and table.get(id(got[1]), (None,))[0] is got[1]:
        return got[1]
    return None


def _again_key(buf: Any, func: Any, rest: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The key under which a view call of written buffer ``buf`` whose other arguments are
    plain ints is kept (``session.views``); None for any other call."""
    for a in rest:
        if type(a) is not int:
            return None
    return (id(buf), func, *rest)


def _views(rec: Any, table: dict[int, list[Any]], func: Any, args: Any, kwargs: Any) -> Any:
    """A view of written buffer ``args[0]`` (``buf[t]``, ``buf.view(-1)``, ``buf.T``): the
    view torch gives of the tensor's memory (which no write changes: only its geometry is
    read), a written buffer of its own that holds the part it views (``_View``); a result
    that is no view of the memory (a reshape that copies), the call on the held value."""
    buf = args[0]
    held(buf, table, rec)  # (the checks)
    views = rec.session.views
    rest = args[1:]
    # The view made by a call with plain int arguments (``encoder_outputs.unsqueeze(0)``
    # at every step) is kept under the call, found again without torch's call
    # (_view_again, in __torch_function__).
    again = None if kwargs else _again_key(buf, func, rest)
    session = rec.session
    with _NO_SUBCLASS():
        base = _base_of(session, buf)
        root = buf if base is None else base
        out = func(*args, **kwargs)
        outs = out if type(out) in (tuple, list) else (out,)
        viewed = all(type(t) is torch.Tensor and _base_of(session, t) is root for t in outs)
    if not viewed:
        if type(out) in (tuple, list) or type(out) is torch.Tensor:
            value = held(buf, table, rec)
            rest = _held(args[1:], table, rec)
            if type(value) is Lazy:
                return Lazy.__torch_function__(func, (Lazy,), (value, *rest), kwargs)
            return func(value, *rest, **kwargs)  # (the eager finish: the value's row)
        return out
    made = []
    single = type(out) is torch.Tensor  # (before its class is set below)
    with _NO_SUBCLASS():  # (the geometry of the memory, read as plain tensors)
        start = root.storage_offset()
        for i, t in enumerate(outs):
            geometry = (tuple(t.shape), tuple(t.stride()), t.storage_offset() - start)
            # A view of the same part made again (``encoder_outputs.unsqueeze(0)`` at every
            # step) is the view made before: one object, as two views of one memory see the
            # same writes.
            key = (id(root), *geometry)
            got = views.get(key)
            if got is not None and got[0] is root and table.get(id(got[1]), (None,))[0] is got[1]:
                made.append(got[1])
                continue
            read = _reader(func, args[1:], kwargs, i if not single else None)
            table[id(t)] = [t, _View(root, *geometry, buf, read), rec.example]
            t.__class__ = _Written
            views[key] = (root, t)
            made.append(t)
    if single and again is not None:
        views[again] = (buf, made[0])
    return made[0] if single else type(out)(made)


def _reader(func: Any, rest: tuple[Any, ...], kwargs: Any, index: int | None) -> Any:
    """How a view call reads its part of a value: the call itself, on the value (a tensor
    method as the value's method, so that a recorded value's pure methods are made once,
    see ``values._memoised``; an attribute as the value's attribute), the ``index``-th of its
    results where it gives several (``unbind``)."""
    name = getattr(func, "__name__", None)
    if name == "__get__":
        attribute = func.__self__.__name__

        def read(value: Any) -> Any:
            return getattr(value, attribute)

    elif name is not None and getattr(torch.Tensor, name, None) is func:

        def read(value: Any) -> Any:
            out = getattr(value, name)(*rest, **kwargs)
            return out if index is None else out[index]

    else:

        def read(value: Any) -> Any:
            out = func(value, *rest, **kwargs)
            return out if index is None else out[index]

    return read


# Attributes a written buffer answers as the eager tensor it is (autograd's bookkeeping,
# read by fold's own checks of an argument: a leaf that requires grad is a parameter).
_OWN = frozenset(
    "requires_grad is_leaf grad_fn _base _version grad _cdata output_nr _backward_hooks".split()
)


def _held(a: Any, table: dict[int, list[Any]], rec: Any) -> Any:
    """``a`` with every written buffer in it (in lists and tuples too) the value it holds."""
    t = type(a)
    if t is _Written:
        return held(a, table, rec)
    if t is tuple or t is list:
        return t(_held(x, table, rec) for x in a)
    return a


def held_by(buf: Any, rec: Any) -> Any:
    """The value written buffer ``buf`` holds now, for recorder ``rec``'s example."""
    if rec.session is None:
        raise FoldError(
            f"autobatch: example {rec.example}: a buffer written with recorded values was "
            "given to a function recorded once for a whole group (@fold.batchable). Fix: "
            "pass it as buf.clone(), or write it out of place."
        )
    return held(buf, rec.session.written, rec)


values._WRITTEN[:] = [_Written, held_by]
if _C is not None:  # (the C fast key refuses a written buffer at once)
    _C.configure_written(_Written)


def held(buf: Any, table: dict[int, list[Any]], rec: Any) -> Any:
    """The value written buffer ``buf`` holds now, for the example recording (``rec``)."""
    entry = table.get(id(buf))
    if entry is None or entry[0] is not buf:
        raise FoldError(
            f"autobatch: example {rec.example}: a buffer written with recorded values in an "
            "earlier autobatch call was used again. Its values exist only in that call's "
            "results. Fix: return it from the function and use the result."
        )
    if entry[2] != rec.example:
        raise FoldError(
            f"autobatch: example {rec.example}: uses a buffer that example {entry[2]} made "
            "and wrote recorded values into (kept in a global, a list or an attribute). The "
            "examples run interleaved, so it would read that example's writes so far. Fix: "
            "make the buffer inside the function, per example."
        )
    value = entry[1]
    if type(value) is _View:  # (a view of another buffer: its part of that one's value)
        v = value
        source = held(v.base if v.read is None else v.parent, table, rec)
        # One part per view and value of what it views: a view made and read at every step
        # (``encoder_outputs.unsqueeze(0)``, the same view object each time, see _views)
        # reads the same part until the buffer is written.
        parts = rec.session.parts
        key = (id(buf), id(source))
        got = parts.get(key)
        if got is not None and got[0] is source and got[1] is buf:
            return got[2]
        if v.read is not None:
            part = v.read(source)
        else:
            part = rec.record(_region, "torch", (source, v.shape, v.stride, v.offset), {})
        if len(parts) >= _PARTS:
            parts.clear()
        parts[key] = (source, buf, part)
        return part
    return value


_PARTS = 256  # (the most parts a call keeps: see held)


def _write(
    rec: Any, table: dict[int, list[Any]], func: Any, args: tuple[Any, ...], kwargs: Any
) -> Any:
    """An in-place call on written buffer ``args[0]``: recorded out of place, the buffer's
    value replaced."""
    buf = args[0]
    entry = table.get(id(buf))
    value = held(buf, table, rec)  # (and the checks)
    rest = _held(args[1:], table, rec)
    kw = {k: _held(v, table, rec) for k, v in kwargs.items()}
    new = _out_of_place(rec, func, value, rest, kw, value.shape, value.dtype)
    view = entry[1]
    if type(view) is _View:  # written through to the buffer it views
        base = table[id(view.base)]
        base[1] = rec.record(
            _put_region, "torch", (base[1], view.shape, view.stride, view.offset, new), {}
        )
    else:
        entry[1] = new
    return None if func is _SETITEM else buf


def write(rec: Any, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An in-place torch call writing a recorded value into an eager tensor (``args[0]``):
    where the tensor is the example's own (see the module's docstring), the write recorded
    out of place and the tensor a written buffer from now on (what the call returns); else
    ``_MISS`` (the caller's FoldError)."""
    session = rec.session
    buf = args[0] if args else None
    if session is not None and type(buf) is _Written:
        return _write(rec, session.written, fn, args, kwargs)
    if session is None or "out" in kwargs or type(buf) is not torch.Tensor:
        return _MISS
    base = _base_of(session, buf)
    own = _own(session, rec, buf if base is None else base, 2 if base is None else 3)
    if not own:
        return _MISS
    if base is None:
        value = _out_of_place(rec, fn, buf, args[1:], kwargs, buf.shape, buf.dtype)
        session.written[id(buf)] = [buf, value, rec.example]
        buf.__class__ = _Written
        return None if fn is _SETITEM else buf
    # A write through a view of the buffer (``buf[t] += h``: Python writes into ``buf[t]``,
    # then sets it back): its part of the buffer written, the view a written buffer too.
    if not base.is_contiguous():
        return _MISS
    shape, stride = tuple(buf.shape), tuple(buf.stride())
    offset = buf.storage_offset() - base.storage_offset()
    part = rec.record(_region, "torch", (base, shape, stride, offset), {})
    new = _out_of_place(rec, fn, part, args[1:], kwargs, buf.shape, buf.dtype)
    value = rec.record(_put_region, "torch", (base, shape, stride, offset, new), {})
    session.written[id(base)] = [base, value, rec.example]
    session.written[id(buf)] = [buf, _View(base, shape, stride, offset), rec.example]
    base.__class__ = buf.__class__ = _Written
    return None if fn is _SETITEM else buf


def _base_of(session: Any, t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of (``t._base``; None where it is no view).  Torch keeps
    none for a view of an inference tensor (made under torch.inference_mode()): there, the
    tensor an example made on the same memory (``note_made``), if any.  ``t`` a plain
    tensor, or read under ``_NO_SUBCLASS`` (a written buffer answers as its value)."""
    base = t._base
    if base is not None or not session.memories or not t.is_inference():
        return base
    ref = session.memories.get(t.untyped_storage().data_ptr())
    base = None if ref is None else ref()
    return None if base is t else base


def _own(session: Any, rec: Any, t: torch.Tensor, refs: int) -> bool:
    """Whether ``t`` is a tensor the recording example made (see the module's docstring)
    that no view of it but the one at hand sees (``refs``: the references its memory may
    have: itself and the one asking, and the view being written through)."""
    if type(t) is not torch.Tensor or t._base is not None or (t.requires_grad and t.is_leaf):
        # (a leaf that needs a gradient is shared, like a parameter; a tensor that has a
        # gradient history, written eagerly with a computed value, is the example's own)
        return False
    made = session.made.get(id(t))
    if made is None or made[0]() is not t or made[1] != rec.example:
        return False
    if _USE_COUNT is None:  # (torch's count of a memory's users: without it, refused)
        return False
    return _USE_COUNT(t.untyped_storage()._cdata) <= refs


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def write_lazy(
    rec: Any,
    fn: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    operator: int,
    plain: tuple[Any, str] | None = None,
) -> Any:
    """An in-place torch call, method or operator ``fn`` on a lazy value (``args[0]``:
    ``x.masked_fill_(m, v)``, ``x[i] = v``, ``torch.relu_(x)``, ``x += y``): recorded out
    of place, and the lazy value becomes the node of its new value (the same object: every
    name and list that holds it sees the change, as in eager code).  What it returns (the
    value; None for ``x[i] = v``).  ``plain``: the call's out-of-place form and kind, where
    its name does not give it (``values.in_place_form``: an activation with
    ``inplace=True``, a module holding one).

    Only for a value that shares memory with no other value in use, which eager code would
    change too: of the round recording, no view itself (``x[0]``, ``x.view(...)``,
    ``x.detach()``, ``nn.Identity``; see ``_Op.aliases``) and no view of it held
    (``_Recorder.views``); of an earlier round, no value it may share memory with in use
    (``values.in_use``), and not a view kept once for every use (the value becomes one of
    the round recording); of a function recorded once for every row, no row and nothing
    in its view log.  Else a FoldError naming why and the fix; for an operator
    (``operator`` true) on a value outside the examples' recording, or on a view an
    augmented assignment to an item sets back (``h[i] += v``: ``operator`` is
    ``values._ITEM_OPERATOR``), ``_MISS``, and the caller records ``x = x + y`` (a new
    value, the name rebound; set back by ``h[i] = ...``)."""
    x = args[0]
    earlier = False
    if (
        plain is not None
        and rec is not None
        and x.rec is rec
        and not rec.view_log
        and type(rec.fold) is Fold
        and type(x.node) is rec.fold._node_type
        and not rec.closed
    ):
        # An activation's inplace=True on a value of the round where the example took no
        # view in the round (the common case): nothing shares its memory (_unwritable's
        # checks pass), without their cost.
        why = None
    elif earlier := _of_an_earlier_round(rec, x):
        why = _shared_earlier(rec, x)
    elif rec is not None and x.rec is rec and type(rec.fold) is not Fold and not rec.closed:
        why = _untraceable_write(rec, x)
    else:
        why = _unwritable(rec, x)
    if operator and (why is _OUTSIDE or (why is not None and operator == _ITEM_OPERATOR)):
        # (h[i] += v of a view that cannot change in place: h[i] + v, set back by h[i] = ...)
        return _MISS
    if why is not None:
        name = getattr(fn, "__name__", None) or type(fn).__name__
        what = "__setitem__ (x[...] = v)" if fn is _SETITEM else f".{name}()"
        raise FoldError(
            f"autobatch: example {getattr(rec, 'example', '?')}: in-place {what} on a lazy "
            f"value {_OUTSIDE_WHY if why is _OUTSIDE else why}"
        )
    if rec.session is not None and rec.session.written:
        table = rec.session.written
        rest = _held(args[1:], table, rec)
        kw = {k: _held(v, table, rec) for k, v in kwargs.items()}
    else:  # (no buffer written in the call: none among the arguments; none in a recording
        # once for every row)
        rest, kw = args[1:], kwargs
    new = _out_of_place(rec, fn, x, rest, kw, x.shape, x.dtype, "a lazy value", plain)
    if not torch.is_grad_enabled() and (rec.session is None or rec.session.grad):
        # Under no_grad eager code changes the value and keeps its graph: the gradient flows
        # back through it as if unchanged.  (Where the call began with gradients off, no
        # value needs one.)
        with torch.enable_grad():
            new = rec.record(_changed_without_grad, "torch", (x, new), {})
    if type(new) is Lazy and new.rec is rec:
        _SET(x, "node", new.node)
        if earlier:  # (a value of the round recording now)
            _SET(x, "rec", rec)
    else:  # run at once on earlier rounds' rows (all its lazy arguments are of those)
        _SET(x, "node", values._memo_wrap(x.rec, new, object(), rec.session.memo, None).node)
    return None if fn is _SETITEM else x


def _changed_without_grad(x: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``x`` changed in place to ``new`` under no_grad, as eager code changes it: ``new``'s
    value, and ``x``'s gradient (the change is not recorded by autograd)."""
    return x + (new - x).detach()


def _untraceable_write(rec: Any, x: Lazy) -> str | None:
    """Why ``x``, a value of a function recorded once for a batch of rows (``traced``),
    cannot be changed in place there: it is a row (eager code would change the caller's
    tensor), or a view or a value a view was taken of (any in the recording's view log);
    None where it can.  A FoldError there records the function per example instead."""
    inputs = getattr(rec.fold, "inputs", None)  # (a traced._Trace's; a handle's index, i)
    if inputs is None:
        return _OUTSIDE
    if getattr(x.node, "i", -1) < inputs:
        return "that is a row of the examples (eager code would change the caller's tensor)"
    if values.in_use(x):  # (an array of its value read)
        return "that shares memory with a value in use (recorded once for every row)"
    for out, args in rec.view_log:
        for y in _entry_values(out, args):
            if y is x:
                return "that shares memory with a view (recorded once for every row)"
    return None


def _of_an_earlier_round(rec: Any, x: Lazy) -> bool:
    """Whether ``x`` is a value computed by an earlier round of ``rec``'s call (its row made,
    or a value a method made of one at once), while ``rec`` records."""
    return (
        rec is not None
        and x.rec is not rec
        and not rec.closed
        and rec.session is not None
        and type(rec.fold) is Fold
        and rec._earlier(x)
    )


def _shared_earlier(rec: Any, x: Lazy) -> str | None:
    """Why ``x``, a value of an earlier round, cannot be changed in place: a value that may
    share memory with it is in use (``values.in_use``), or it is a view kept once for every
    use (``_Recorder.fixed``); None where it can."""
    absorb_views(rec)  # (views of it taken in this round)
    if x.node not in x.rec.fixed and not values.in_use(x):
        return None
    return (
        "of an earlier round that shares memory with another value in use: a view of it "
        "(x[i], x.view(...), x.detach(), x.unbind(), torch.narrow(x, ...), x.numpy()) is "
        "held, or it is a view itself. Eager code would change those too, which autobatch does not "
        "follow once a round has run. Fix: change a copy (x = x.clone(), then change x), "
        "take the view after the change, or compute out of place (x = x + y, "
        "x = x.masked_fill(...))."
    )


def absorb_views(rec: Any) -> None:
    """Note the lazy values and tensors of each call in the running example's view log (from
    ``rec.view_absorbed`` on) whose view is in use (``_views_in_use``) as sharing memory
    (``values._share``: a view and the values it was taken of).  The log is emptied as
    another example runs (``forget_views``), after which its values are of an earlier
    round; an in-place change of one reads the notes."""
    log = rec.view_log
    start = rec.view_absorbed
    rec.view_absorbed = len(log)
    if start == len(log):
        return
    for j in _C.views_in_use(log, start) if _C is not None else _views_in_use(log, start):
        out, args = log[j]
        found = [
            x for x in _entry_values(out, args) if type(x) is Lazy or isinstance(x, torch.Tensor)
        ]
        for k, x in enumerate(found):
            for y in found[k + 1 :]:
                values._share(x, y)


def _entry_values(out: Any, args: tuple[Any, ...]) -> Any:
    """The values of a view log entry: its outputs (the parts of a tuple of them) and its
    arguments (the items of a list or tuple argument)."""
    for a in (*(out if type(out) is tuple else (out,)), *args):
        yield from a if type(a) is list or type(a) is tuple else (a,)


def _views_in_use(log: list[tuple[Any, tuple[Any, ...]]], start: int) -> list[int]:
    """The indices, in order, of the entries of view log ``log`` from ``start`` on whose
    views may share memory with a value in use: the entries joined through their
    participants (the views, parts of a tuple of them, the arguments, items of a list or
    tuple argument: lazy values and tensors; a view and what it was taken of, views of
    views) into a group with two participants or more held beyond the log (its entries and
    the containers in it that nothing else holds).  A view taken and let go in one line
    (``h[0]``), or one of a value nothing else holds, shares memory with nothing in use.
    The C path (``views_in_use``) gives the same."""
    n = len(log)
    parts: list[Any] = []  # (the unique participants; every count below allows for this list)
    at: dict[int, int] = {}
    parent: list[int] = []
    first: list[int] = []
    containers: list[Any] = []  # (unique)
    held: dict[int, int] = {}

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for j in range(start, n):
        e = log[j]
        f = -1
        for a in (e[0], *e[1]):
            many = type(a) is list or type(a) is tuple
            if many and id(a) not in held:
                held[id(a)] = len(containers)
                containers.append(a)
            for o in a if many else (a,):
                if type(o) is not Lazy and not isinstance(o, torch.Tensor):
                    continue
                i = at.get(id(o))
                if i is None:
                    i = at[id(o)] = len(parts)
                    parts.append(o)
                    parent.append(i)
                if f < 0:
                    f = i
                else:
                    r1, r2 = root(f), root(i)
                    if r1 != r2:
                        parent[r2] = r1
        first.append(f)
    e = a = o = None  # (the loop's names hold nothing counted below)

    def by_log(x: Any) -> int:  # (the entries' own references: views, argument tuples)
        return sum((log[j][0] is x) + sum(y is x for y in log[j][1]) for j in range(start, n))

    # A container held beyond the log (its entry or argument tuples; ``containers`` and
    # getrefcount's argument: 2 beside them) holds its items for someone else too.
    free = [
        k
        for k in range(len(containers))
        if sys.getrefcount(containers[k]) - 2 <= by_log(containers[k])
    ]
    alive = [0] * len(parts)
    for i in range(len(parts)):
        # (``parts`` and getrefcount's argument: 2 beside the log's)
        refs = sys.getrefcount(parts[i]) - 2 - by_log(parts[i])
        refs -= sum(sum(y is parts[i] for y in containers[k]) for k in free)
        if refs > 0:
            alive[root(i)] += 1
    return [
        j for j in range(start, n) if first[j - start] >= 0 and alive[root(first[j - start])] >= 2
    ]


# Why an in-place change of a lazy value is refused where the value is not one the example
# records now nor one of an earlier round of its call (a value kept beyond its call, of
# another call, or of a round not run): an operator records ``x = x + y`` then.
_OUTSIDE = "outside"
_OUTSIDE_WHY = (
    "outside the examples' own recording (kept from another autobatch call, or of a round "
    "not run yet). Fix: change a copy made now (x = x.clone(), then change x), or compute "
    "out of place (x = x.masked_fill(...), torch.where)."
)


_SET = object.__setattr__  # (Lazy's own __setattr__ refuses: its node is set here alone)


def _unwritable(rec: Any, x: Lazy) -> str | None:
    """Why lazy value ``x`` cannot be changed in place (see ``write_lazy``); None where it
    can."""
    if (
        rec is None
        or x.rec is not rec
        or rec.closed
        or rec.session is None
        or type(rec.fold) is not Fold
        or type(x.node) is not rec.fold._node_type
    ):
        return _OUTSIDE
    i = node_id(x.node)
    roots, holders, refs = rec.views()
    mine = roots.get(i)  # (x a view: the values whose memory it shares)
    if mine is not None and _FOREIGN in mine:
        return (
            "that is a view of a value computed in an earlier round or of a tensor the "
            "function did not record (x = h[i], h.view(...), h.detach()): eager code would "
            "change that value too, which autobatch does not follow. Fix: change a copy "
            "(x = x.clone())."
        )
    for r in (i,) if mine is None else mine:
        for j, where, node in holders.get(r, ()):
            v = rec.held(j, where)
            # In use: held beyond the log's own references, this name and getrefcount's
            # argument; and not changed in place since (a new value then).
            if (
                v is not x
                and v.node == node
                and sys.getrefcount(v)
                > 2
                + refs.get(id(v), 0)
                + (type(where) is tuple and where[0] == -2 and _dropped(rec.view_log[j][0], v))
            ):
                if mine is None:
                    return (
                        "while a view of it is in use (v = x[i], x.view(...), x.detach() kept "
                        "in a name): eager code would change the view too, which autobatch "
                        "does not follow. Fix: take the view after the change, or change a "
                        "copy (x = x.clone())."
                    )
                return (
                    "that is a view of another value, which is still in use, or another view "
                    "of it is (x = h[i], h.view(...), h.t(), h.detach(), or a module that "
                    "returns its input): eager code would change those too, which autobatch "
                    "does not follow. Fix: change the value itself (h[i] = ..., "
                    "h.masked_fill_(...)), or a copy (x = x.clone())."
                )
    return None


def _dropped(out: Any, v: Any) -> bool:
    """Whether ``out``, the outputs of a logged call (a tuple: ``torch.split``'s parts), is
    held by the log alone (its entry, this name and getrefcount's argument), and holds
    ``v`` itself: its reference to ``v`` is then the log's too."""
    return type(out) is tuple and any(o is v for o in out) and sys.getrefcount(out) <= 3


def _out_of_place(
    rec: Any,
    fn: Any,
    x: Any,
    rest: tuple[Any, ...],
    kwargs: dict[str, Any],
    shape: torch.Size,
    dtype: torch.dtype,
    what: str = "a buffer written with recorded values",
    plain: tuple[Any, str] | None = None,
) -> Any:
    """In-place ``fn`` on value ``x`` (of ``what``, of ``shape`` and ``dtype``: a buffer, a
    lazy value), recorded out of place (as ``plain``, the function and kind, where given):
    its result, the new value."""
    if plain is not None:
        out = _MISS
        session = rec.session
        if (  # (a call seen before; not where the examples finish as eager code)
            _C is not None
            and not kwargs
            and len(rest) < _C.MAX_FAST
            and (session is None or not session.eager)
        ):
            out = _C.fast(rec, plain[0], plain[1], (x, *rest))
        if out is _MISS:
            out = rec.record(plain[0], plain[1], (x, *rest), kwargs)
        return out if out.dtype == dtype else out.to(dtype)
    name = getattr(fn, "__name__", "?")
    if fn is _SETITEM:
        index, value = rest if len(rest) == 2 else (None, None)
        if (
            (type(index) is Lazy or type(index) is torch.Tensor)
            and index.dtype is torch.bool
            and index.shape == shape
            and (type(value) in (int, float, bool) or (type(value) is Lazy and not value.ndim))
        ):
            # x[mask] = v, a mask of x's shape and one number (logits[banned] = -inf): a
            # torch.where, which runs as one call a group (a boolean index does not under
            # vmap: its groups would run one call per example).
            out = rec.record(_WHERE, "torch", (index, value, x), {})
            return out if out.dtype == dtype else out.to(dtype)
        return rec.record(_put, "torch", (x, *rest), {})
    if name == "copy_" and len(rest) == 1 and not kwargs:
        return rec.record(_put, "torch", (x, Ellipsis, rest[0]), {})
    if name == "fill_" and len(rest) == 1 and not kwargs:
        return rec.record(_put, "torch", (x, Ellipsis, rest[0]), {})
    if name == "zero_" and not rest and not kwargs:
        return rec.record(_put, "torch", (x, Ellipsis, 0), {})
    plain = "__" + name[3:] if name.startswith("__i") else name[:-1]
    other = getattr(torch.Tensor, plain, None)
    if other is None and getattr(_F, name, None) is fn:  # F.leaky_relu_: F.leaky_relu
        other = getattr(_F, plain, None)
    if not callable(other) or _is_inplace(other):
        raise FoldError(
            f"autobatch: example {rec.example}: {name} on {what} has no out-of-place form "
            "autobatch knows. Fix: compute the new value out of place and rebind the name "
            "(x = torch.rand_like(x) for a random fill; x = x.clamp(...) for x.clamp_(...)), "
            "or write it with x[...] = value."
        )
    out = rec.record(other, "torch", (x, *rest), kwargs)
    if out.shape != shape:
        raise FoldError(
            f"autobatch: example {rec.example}: {name} on {what} of shape {tuple(shape)} "
            f"would give shape {tuple(out.shape)}; an in-place op keeps its tensor's shape "
            "(eager code raises too)."
        )
    return out if out.dtype == dtype else out.to(dtype)


def note_made(out: Any) -> None:
    """Note a tensor a wrapped factory made while an example records (see the module's
    docstring): it may become a written buffer of that example."""
    rec = _LOCAL.rec
    if rec is not None and type(out) is torch.Tensor and rec.session is not None:
        ref = weakref.ref(out)
        rec.session.made[id(out)] = (ref, rec.example)
        if out.is_inference():  # (its views keep no base: found by memory, see _base_of)
            memory = out.untyped_storage().data_ptr()
            if memory:
                rec.session.memories[memory] = ref


def restore(session: Any) -> None:
    """The written buffers of ``session``'s call their class back (the call ends)."""
    for buf, *_ in session.written.values():
        buf.__class__ = torch.Tensor
    session.written.clear()
    session.made.clear()
    session.memories.clear()
    session.parts.clear()
    session.views.clear()


def results_held(leaves: list[Any], rec: Any) -> list[Any]:
    """An example's result leaves, each written buffer the value it holds."""
    if not rec.session.written or not any(type(x) is _Written for x in leaves):
        return leaves
    return [held(x, rec.session.written, rec) if type(x) is _Written else x for x in leaves]
