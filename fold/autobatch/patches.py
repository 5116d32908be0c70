"""What autobatch installs in torch for the length of a call, and only then: the wrapper over
``nn.Module.__call__`` that records module calls, and the one over ``torch.tensor`` that
records data holding lazy values.  Never left behind, never dropping another library's
wrapper (see ``_Patches``)."""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import weakref
from math import copysign as _copysign
from numbers import Number
from typing import Any

import torch
from torch import nn
from torch.nn import functional as _F

from fold.autobatch import running
from fold.autobatch.buffers import note_made
from fold.autobatch.common import _C, _LOCAL, _MISS
from fold.autobatch.values import (
    Known,
    Lazy,
    RowNumber,
    _as_number,
    _eager_value,
    _is_count,
    _meta,
    in_place_form,
)
from fold.errors import FoldError


# What autobatch installs in torch for the length of a call, and only then: a wrapper over
# ``nn.Module.__call__`` that records module calls, and over ``torch.tensor`` for data that
# holds lazy values.  Installed by the first of the calls running at once (threads; nested
# uses such as ``record_examples`` inside ``autobatch``), put back by the last one.  A wrapper
# that another library installs over ours while a call runs is never dropped: ours then stays
# beneath it, passing every call through, and the next call installs a new one on top.
# Setting ``nn.Module.__call__`` invalidates the method caches of every nn.Module subclass:
# installing and restoring costs about 45 us per autobatch call.
class _Patches:
    users = 0
    module_call: Any = None  # the installed wrapper, None while none is
    token: object = None  # the installed wrapper's identity (see _make_module_call)
    inner: Any = None  # what it passes through to
    tensor: Any = None  # torch.tensor as found
    as_tensor: Any = None  # torch.as_tensor as found
    # The users of the wrappers over torch.tensor and torch.as_tensor: every user of the
    # others (``_installed``), and a function recorded once without them whose rows hold
    # numbers (``tensor_installed``).
    tensor_users = 0
    # (module or class, name) -> the function as found there (_INHERITED: none, the class
    # inherits it), where a wrapper of _WRAPPERS is installed
    wrapped: dict[tuple[Any, str], Any] = {}
    # (module, name) -> the torch function as found, where _DIRECT_TORCH's wrapper is
    # installed
    direct: dict[tuple[Any, str], Any] = {}


_PATCH_LOCK = threading.Lock()
_INHERITED = object()  # (an attribute a class inherits: see _install)


def _install(where: Any, name: str, wrapper: Any) -> Any:
    """Set ``where.name`` to ``wrapper``; what ``where`` held under that name itself
    (``_INHERITED`` where it inherits it: torch.Tensor's ``new_full`` from its C base)."""
    found = where.__dict__.get(name, _INHERITED)
    setattr(where, name, wrapper)
    return found


def _put_back(where: Any, name: str, wrapper: Any, found: Any) -> None:
    """Undo ``_install`` where ``wrapper`` is still in place (a wrapper another library
    set over it stays): ``found`` again, or the name deleted, leaving the class as it was."""
    if where.__dict__.get(name) is wrapper:
        if found is _INHERITED:
            delattr(where, name)
        else:
            setattr(where, name, found)


_PATCHES = _Patches()


# nn.Module.__call__ as fold found it at import: runs a module call's op where no wrapper of
# autobatch's is installed (a graph from record_examples applied later).
_MODULE_CALL = nn.Module.__call__


def _make_module_call(inner: Any, token: object) -> Any:
    # The wrapper knows itself by ``token`` (installed with it): a reference to itself would
    # make a reference cycle, left for the collector at the end of every call.
    if _C is not None:  # the same, in C (fold/_clazy.c, ModuleCall): every module call
        return _C.ModuleCall(inner, token, _PATCHES, functools.partial(_eager_call, inner))

    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
        rec = _LOCAL.rec
        if rec is None or rec.paused or _PATCHES.token is not token:
            return inner(self, *args, **kwargs)
        session = rec.session
        if session is not None and session.eager:  # the examples finish as eager code
            for a in args:
                if type(a) in _CONVERTED:
                    break
            else:
                if not kwargs:  # (tensors and numbers: nothing to convert)
                    return inner(self, *args)
            return _eager_call(inner, self, *args, **kwargs)
        if _fast is not None and not kwargs and 0 < len(args) <= _FAST_MAX:
            # The C fast path at once (as rec.record would reach it): a call seen before.
            out = _fast(rec, self, "module", args)
            if out is not _MISS:
                return out
        return rec.record(self, "module", args, kwargs)

    __call__.__qualname__ = "Module.__call__ (recording under fold.autobatch)"
    return __call__


def _eager_call(inner: Any, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A module call while the examples finish as eager code, its lazy and known arguments
    (in lists and tuples too) converted to their rows and tensors."""
    rec = _LOCAL.rec
    if args and type(args[0]) is Lazy and in_place_form(module, "module", args, kwargs):
        return rec.record(module, "module", args, kwargs)  # (nn.ReLU(inplace=True)(h))
    session = rec.session
    return inner(
        module,
        *[_eager_value(a, session) for a in args],
        **{k: _eager_value(v, session) for k, v in kwargs.items()},
    )


# The C fast path of a recorded call (fold/_clazy.c: its table for the grad and autocast
# mode on now, a miss in any other), and how many arguments it takes.
_fast = None if _C is None else _C.fast
_FAST_MAX = 0 if _C is None else _C.MAX_FAST


# What the eager finish converts in a module call's arguments (see values._eager_value).
_CONVERTED = frozenset((Lazy, Known, list, tuple))


def _module_inner() -> Any:
    """The ``nn.Module.__call__`` a module call runs through unrecorded: what autobatch's
    wrapper wraps, while one is installed."""
    inner = _PATCHES.inner
    return _MODULE_CALL if inner is None else inner


def _call_module(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A module called as ``nn.Module.__call__`` calls it (forward and hooks), not through a
    subclass's own ``__call__``: what such an override does around ``super().__call__`` was
    recorded around the module's node."""
    return _module_inner()(module, *args, **kwargs)


@contextlib.contextmanager
def _installed() -> Any:
    """Install autobatch's wrappers for the length of the ``with`` (see ``_Patches``)."""
    p = _PATCHES
    with _PATCH_LOCK:
        if p.users == 0:
            p.inner = nn.Module.__call__
            p.token = object()
            p.module_call = _make_module_call(p.inner, p.token)
            nn.Module.__call__ = p.module_call  # type: ignore[method-assign]
            _tensor_enter(p)
            # (torch.Tensor inherits new_full and new_tensor from its C base: their wrappers
            # are set on torch.Tensor and deleted again, leaving the class as it was.)
            p.wrapped = {key: _install(*key, wrapper) for key, wrapper in _WRAPPERS.items()}
            p.direct = {}
            for key, wrapper in _DIRECT_WRAPPERS.items():
                where, name = key
                if getattr(where, name) is wrapper.__wrapped__:  # (as fold found it)
                    p.direct[key] = wrapper.__wrapped__
                    setattr(where, name, wrapper)
        p.users += 1
    try:
        with _apply_installed, recorded_calls:
            yield
    finally:
        with _PATCH_LOCK:
            p.users -= 1
            if p.users == 0:
                if nn.Module.__call__ is p.module_call:
                    nn.Module.__call__ = p.inner  # type: ignore[method-assign]
                _tensor_exit(p)
                for key, found in p.wrapped.items():
                    _put_back(*key, _WRAPPERS[key], found)
                p.wrapped = {}
                for (where, name), found in p.direct.items():
                    if getattr(where, name) is _DIRECT_WRAPPERS[where, name]:
                        setattr(where, name, found)
                p.direct = {}
                p.module_call = p.inner = p.token = None


def _tensor_enter(p: _Patches) -> None:
    """Install the wrappers over torch.tensor and torch.as_tensor (held, with
    ``_PATCH_LOCK``)."""
    if p.tensor_users == 0:
        p.tensor = torch.tensor
        torch.tensor = _TENSOR_WRAPPER
        p.as_tensor = torch.as_tensor
        torch.as_tensor = _recording_as_tensor
    p.tensor_users += 1


def _tensor_exit(p: _Patches) -> None:
    """The last user puts back what ``_tensor_enter`` found (held, with ``_PATCH_LOCK``)."""
    p.tensor_users -= 1
    if p.tensor_users == 0:
        if torch.tensor is _TENSOR_WRAPPER:
            torch.tensor = p.tensor
        if torch.as_tensor is _recording_as_tensor:
            torch.as_tensor = p.as_tensor
        p.tensor = p.as_tensor = None


@contextlib.contextmanager
def tensor_installed() -> Any:
    """The wrappers over torch.tensor and torch.as_tensor alone, for the length of the
    ``with``: a function recorded once for rows that hold a number per row
    (``values.RowNumber``: ``torch.tensor([label])``), without the other wrappers."""
    p = _PATCHES
    with _PATCH_LOCK:
        _tensor_enter(p)
    try:
        yield
    finally:
        with _PATCH_LOCK:
            _tensor_exit(p)


# Torch functions that per-example code calls on lazy values at every step (a decoder's
# torch.cat and F.softmax): while autobatch runs, each is a wrapper that hands a call whose
# first argument (or any element of its first, a list: torch.cat([self.root, states])) is
# lazy straight to Lazy.__torch_function__, as torch's dispatch would, without the argument
# parsing that finds it (recording torch.cat([h, c]) took 3.7 us, F.softmax(h, 0) 6.1,
# h.tanh() 0.9).
# A functional's arguments reach the recorder as given (torch's own path spells out every
# keyword: F.softmax(h, 0) as dim=0, _stacklevel=3, dtype=None; the same call either way).
# Any other call, and any call while a torch-function mode is on or torch functions are
# disabled, goes to the function itself.
# Also the torch functions that read their lazy arguments (recorder._read_call): the
# example pauses in Python, not inside torch's C dispatch, where a C++ error raised after
# the pause (a mask of the wrong shape) took its backtrace across the coroutine's stack and
# crashed the process.  (torch.where's three-argument form gains the speed.)
# The functions that always read (tables._READS, with torch.unique and unique_consecutive,
# which torch dispatches from Python already).
_READ_FUNCTIONS = "nonzero argwhere masked_select bincount equal allclose is_nonzero".split()
_DIRECT_TORCH = [
    *"cat stack softmax log_softmax tanh sigmoid relu exp".split(),
    *"where repeat_interleave tensor_split".split(),  # (reads for some of their arguments)
    *_READ_FUNCTIONS,
]
_DIRECT_FUNCTIONAL = (
    "one_hot",
    "softmax",
    "log_softmax",
    "relu",
    "gelu",
    "silu",
    "leaky_relu",
    "elu",
    "dropout",
    "linear",
    "normalize",
)


# Of those, the functions whose second parameter is ``dim``: ``f(x, dim=d)`` reaches the
# recorder as ``f(x, d)``, the same call, which the recorder's fast path takes (it takes
# no keywords).
_DIM_SECOND = frozenset(("cat", "stack", "softmax", "log_softmax"))


def _direct_wrapper(fn: Any) -> Any:
    """``fn`` while autobatch is installed: a call whose first argument is a lazy value (or a
    list or tuple holding one) goes to ``Lazy.__torch_function__`` at once; every other call
    to ``fn``.  In C (``_C.Direct``) where it was built."""
    dispatch = Lazy.__torch_function__
    types = (Lazy,)
    modes_on = torch._C._is_torch_function_mode_enabled
    enabled = torch._C._is_torch_function_enabled  # (False where all are disabled, too)
    dim_second = fn.__name__ in _DIM_SECOND
    if _C is not None:
        direct = _C.Direct(fn, dispatch, modes_on, enabled, dim_second)
        functools.update_wrapper(direct, fn)
        return direct

    def call(*args: Any, **kwargs: Any) -> Any:
        if args:
            a = args[0]
            t = type(a)
            if (
                (t is Lazy or ((t is list or t is tuple) and _holds_lazy_value(a)))
                and not modes_on()
                and enabled()
            ):
                if dim_second and len(args) == 1 and len(kwargs) == 1 and "dim" in kwargs:
                    return dispatch(fn, types, (a, kwargs["dim"]), {})
                return dispatch(fn, types, args, kwargs)
        return fn(*args, **kwargs)

    functools.update_wrapper(call, fn)
    return call


def _holds_lazy_value(a: list[Any] | tuple[Any, ...]) -> bool:
    """Whether a list argument holds a lazy value (``torch.cat([self.root, states])``, a
    parameter first: torch's own dispatch finds the lazy value after parsing every argument,
    about 3 us a call)."""
    for x in a:
        if type(x) is Lazy:
            return True
    return False


_DIRECT_WRAPPERS = {
    (where, name): _direct_wrapper(getattr(where, name))
    for where, names in ((torch, _DIRECT_TORCH), (torch.nn.functional, _DIRECT_FUNCTIONAL))
    for name in names
}


class _PythonOf(dict):  # type: ignore[type-arg]
    """dtype -> the Python type its known numbers are: bool, int, else float."""

    def __missing__(self, dtype: torch.dtype) -> Any:
        out = self[dtype] = (
            bool if dtype is torch.bool else float if dtype.is_floating_point else int
        )
        return out


_TORCH_TENSOR = torch.tensor
_TORCH_AS_TENSOR = torch.as_tensor
_TORCH_NEW_TENSOR = torch.Tensor.new_tensor
_CPU = torch.device("cpu")
_modes_on = torch._C._is_torch_function_mode_enabled
_default_dtype = torch.get_default_dtype


_SEQUENCES = (list, tuple)


def _recording_tensor(
    data: Any,
    dtype: torch.dtype | None = None,
    device: Any = None,
    requires_grad: bool = False,
    pin_memory: bool = False,
) -> Any:
    """``torch.tensor`` while autobatch runs, in the function it runs: a Python number or
    a list of them is a known value (``values.Known``: no tensor unless one is needed, read
    back at once), data holding lazy values (``torch.tensor([a, b])`` of recorded scalars)
    is recorded; anything else, and every call outside that function, goes to torch."""
    rec = _LOCAL.rec
    if rec is not None and not rec.paused and not requires_grad and not pin_memory:
        t = type(data)
        if t in _SCALARS and rec.session is not None and rec.session.eager:
            # The examples finish as eager code: a tensor, as torch makes it.
            return (_PATCHES.tensor or _TORCH_TENSOR)(data, dtype=dtype, device=device)
        if t in _SCALARS:
            if dtype is None and device is None and not _modes_on():  # torch.tensor(word)
                # (type, default dtype) -> (meta, travels as a number, Python type)
                key = (t, _default_dtype())
                plain = _PLAIN.get(key)
                if plain is None:
                    d = _SCALARS[t] or key[1]
                    number = _as_number(d)
                    plain = _PLAIN[key] = (_meta((), d, _CPU), number, _PYTHON_OF[d])
                meta, number, py = plain
                return Known(py(data) if number else data, meta, number)
            if dtype is None:
                dtype = _SCALARS[t] or torch.get_default_dtype()
            if device is None:
                # torch.get_default_device costs ~3 us; a default device other than the CPU
                # is a torch-function mode (torch.set_default_device), found in ~0.04 us.
                device = torch.get_default_device() if _modes_on() else _CPU
            elif type(device) is not torch.device:
                device = torch.device(device)
            if dtype.is_complex:
                return (_PATCHES.tensor or _TORCH_TENSOR)(data, dtype=dtype, device=device)
            number = _as_number(dtype)
            value = _PYTHON_OF[dtype](data) if number else data
            return Known(value, _meta((), dtype, device), number)
        if t is Lazy:  # as torch.tensor copies a tensor: its values, without history
            out = data.detach()
            return out.to(dtype=dtype, device=device) if dtype or device else out.clone()
        if t is RowNumber:  # a number per row (see values.RowNumber): the rows' values
            return data.tensor_row(dtype, device)
        if t is Known:  # torch's own conversion must never meet a known value (_unknown)
            data = data.tensor()
        elif t in _SEQUENCES:
            known = _known_numbers(data, dtype, device)
            if known is not None:
                return known
            if len(data) == 1 and type(data[0]) is RowNumber:  # torch.tensor([label])
                return data[0].tensor_row(dtype, device).unsqueeze(0)
            tensor = _PATCHES.tensor or _TORCH_TENSOR
            data = _unknown(data)
            if rec.lockstep is not None:  # (numbers per row live in such recordings alone)
                data = _row_numbers(data)
            if _holds_lazy(data):
                return _tensor_of_lazy(tensor, data, dtype, device)
            made = tensor(data, dtype=dtype, device=device)
            return Known(made, _meta(made.shape, made.dtype, made.device), False, made)
    return (_PATCHES.tensor or _TORCH_TENSOR)(
        data, dtype=dtype, device=device, requires_grad=requires_grad, pin_memory=pin_memory
    )


# The dtype torch.tensor gives a Python scalar (None: the default float dtype), and the
# Python type a known number of each number dtype travels as.
_SCALARS: dict[type, torch.dtype | None] = {bool: torch.bool, int: torch.long, float: None}
_PYTHON_OF: Any = _PythonOf()
# (Python type, default dtype) -> (meta, travels as a number, its Python type) of a scalar
# made with no dtype or device given, on the CPU (emptied with the metas by clear_cache).
_PLAIN: dict[tuple[type, torch.dtype], Any] = {}


# Ints at or beyond this magnitude do not fit torch.long: torch.tensor raises at once for them.
_INT_RANGE = 1 << 63


def _known_numbers(data: Any, dtype: torch.dtype | None, device: Any) -> Known | None:
    """``torch.tensor(data)`` of a flat list or tuple of Python numbers (an action mask made
    per step: ``torch.tensor([0.0 if ok else -inf for ok in legal])``) as a known value that
    holds the numbers, not a tensor: its dtype and shape are the ones torch.tensor gives
    (all bools: bool; a float among them: the default dtype; else long), its tensor made
    only where one is needed (a recorded call takes its row, shared by equal lists: see
    ``Known.row``).  None where torch.tensor must run now: nested data, other types, ints
    beyond int64 (torch raises), a device other than the CPU, a torch-function mode, or a
    dtype given that is neither floating nor the one inferred (a conversion that may
    raise)."""
    if device is not None and device != "cpu" and device != _CPU:
        return None
    floats = False
    ints = False
    plain = True  # no NaN, no -0.0 (see Known.row)
    for x in data:
        tx = type(x)
        if tx is float:
            floats = True
            if x != x or (x == 0.0 and _copysign(1.0, x) < 0):
                plain = False
        elif tx is int:
            if not -_INT_RANGE <= x < _INT_RANGE:
                return None
            ints = True
        elif tx is not bool:
            return None
    if _modes_on():
        return None
    inferred = _default_dtype() if floats or not data else torch.long if ints else torch.bool
    if dtype is None:
        dtype = inferred
    elif dtype is not inferred and not (dtype.is_floating_point and not dtype.is_complex):
        return None
    return Known(tuple(data), _meta((len(data),), dtype, _CPU), False, plain=plain)


def _recording_as_tensor(data: Any, dtype: Any = None, device: Any = None) -> Any:
    """``torch.as_tensor`` while autobatch runs: of a lazy value, the value converted (as
    ``as_tensor`` of a tensor gives; torch would read it as a sequence); of a known value,
    its tensor; of a list, ``torch.tensor``'s (``_recording_tensor``); anything else goes to
    torch."""
    as_tensor = _PATCHES.as_tensor or _TORCH_AS_TENSOR
    t = type(data)
    if t is Lazy:
        return data.to(device=device, dtype=dtype) if dtype or device else data
    if t is RowNumber:
        return data.tensor_row(dtype, device)
    if t is Known:
        data = data.tensor()
    elif t in _SEQUENCES:  # a new tensor of the data, as torch.tensor makes it
        return _recording_tensor(data, dtype=dtype, device=device)
    return as_tensor(data, dtype=dtype, device=device)


def _unknown(data: Any, counts: bool = False) -> Any:
    """``data`` with every known value in it (in lists and tuples too) its tensor.  A known
    value passes torch's own test for a tensor (``isinstance``, by its ``__class__``) without
    being one: torch's C conversion (``torch.tensor``, ``Tensor.new_tensor``) would read it
    as a tensor's memory.  With ``counts``, every recorded count (a one-number integer lazy
    value) its Python int too, a flag its bool: a read (see ``_known_safe``)."""
    t = type(data)
    if t is Known:
        return data.tensor()
    if t is Lazy:
        if counts and _is_count(data.meta):  # (a fill value keeps its dtype)
            return bool(data) if data.meta.dtype is torch.bool else int(data)
        return data
    if t in _SEQUENCES and any(
        type(x) is Known or type(x) in _SEQUENCES or (counts and type(x) is Lazy) for x in data
    ):
        return t(_unknown(x, counts) for x in data)
    return data


def _recording_new_tensor(self: torch.Tensor, data: Any, *args: Any, **kwargs: Any) -> Any:
    """``Tensor.new_tensor`` while autobatch runs: of a lazy value, its values converted
    without history (as of a tensor); known values their tensors (see ``_unknown``)."""
    t = type(data)
    if (t is Lazy or t is RowNumber) and not args and set(kwargs) <= {"dtype", "device"}:
        dtype = kwargs.get("dtype") or self.dtype
        device = kwargs.get("device") or self.device
        if t is RowNumber:  # (a number per row: its rows' values)
            return data.tensor_row(dtype, device)
        return data.detach().to(dtype=dtype, device=device)
    return _TORCH_NEW_TENSOR(self, _unknown(data), *args, **kwargs)


def _known_safe(fn: Any) -> Any:
    """``fn``, a torch function whose arguments are numbers or sizes (torch's dispatch
    never hands it to a known value's ``__torch_function__``), with every known value among
    them its tensor and every recorded count (``torch.ones(n, 2)``, ``x.expand(n, 3)``) read
    here, in Python (``_unknown``).  Torch's argument parser would call the count's
    ``__index__`` itself: the example would pause inside torch's C code, and torch then
    refuses a value with ``__torch_function__`` among sizes given one by one (a TypeError
    whose C++ backtrace, taken on the example's coroutine stack, crashed the process)."""

    local = _LOCAL
    plain = _PLAIN_ARGS
    made = fn.__name__ not in ("reshape", "expand")  # (views)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if local.rec is None:  # (a round, or another thread: nothing is recorded)
            return fn(*args, **kwargs)
        for a in args:  # (sizes and numbers, the usual call: nothing to convert)
            t = type(a)
            if t not in plain and not (t is tuple and all(type(x) is int for x in a)):
                break
        else:
            if not kwargs or all(type(v) in plain for v in kwargs.values()):
                out = fn(*args, **kwargs)
                if made:  # (a tensor of the example's own: it may become a written buffer)
                    note_made(out)
                return out
        out = fn(
            *[_unknown(a, True) for a in args], **{k: _unknown(v, True) for k, v in kwargs.items()}
        )
        if made:
            note_made(out)
        return out

    return call


# Arguments of a factory that hold no known value and no recorded count (see _known_safe).
_PLAIN_ARGS = frozenset(
    (int, float, bool, str, type(None), torch.Size, torch.dtype, torch.device, torch.Tensor)
)


# Wrappers installed while autobatch runs ((module or class, name) -> wrapper).  Torch
# functions that take a known value where eager code passes a tensor for a number
# (``torch.full((n,), torch.tensor(0.5))``, ``torch.arange(torch.tensor(5))``) or for data
# (``x.new_tensor(t)``), or a recorded count for a size (``torch.ones(n, 2)``): they hand
# torch the known values' tensors and the counts' ints (torch.tensor and
# torch.as_tensor: _recording_tensor, _recording_as_tensor; autograd.Function.apply:
# _apply_installed).
_WRAPPERS = {
    (where, name): _known_safe(getattr(where, name))
    for where, names in (
        (
            torch,
            (
                "full arange linspace logspace zeros ones empty rand randn randint eye reshape"
            ).split(),
        ),
        (torch.Tensor, ("new_full", "new_zeros", "new_ones", "new_empty", "expand")),
    )
    for name in names
}
_WRAPPERS[torch.Tensor, "new_tensor"] = _recording_new_tensor


def _like_safe(fn: Any) -> Any:
    """``torch.zeros_like`` and kin while autobatch runs: of a lazy value, the tensor made
    from its shape, dtype and device alone (all they read of it), at once, as eager code
    makes it, not a recorded call; its other arguments as ``_known_safe`` takes them.  So
    the result is a tensor the example made (``out = torch.zeros_like(h)``, then ``out[t] =
    ...``: see fold/autobatch/buffers.py)."""
    local = _LOCAL
    safe = _known_safe(fn)

    @functools.wraps(fn)
    def call(input: Any, *args: Any, **kwargs: Any) -> Any:
        if local.rec is not None and type(input) is Lazy:
            m = input.meta
            input = torch.empty(m.shape, dtype=m.dtype, device=m.device)
        return safe(input, *args, **kwargs)

    return call


_WRAPPERS.update(
    {
        (torch, name): _like_safe(getattr(torch, name))
        for name in ("zeros_like", "ones_like", "empty_like", "full_like")
    }
)


class _Installed:
    """Wrappers set for the length of a ``with``: nested or concurrent users share them,
    the first installing them and the last putting back what it found (see ``_install``).
    A class, not a generator: the patches below run on every autobatch call, in under a
    microsecond each (a module's global is set in its dict: 0.03 us, where setattr on a
    class costs 0.3 us)."""

    __slots__ = ("classes", "dicts", "found", "held", "name", "users", "wrapper")

    def __init__(
        self,
        *classes: tuple[Any, str, Any],
        modules: Any = (),
        name: str = "",
        wrapper: Any = None,
    ) -> None:
        """``classes``: triples (class, name, wrapper); and in each of ``modules``, the
        global ``name`` set to ``wrapper`` (a function the modules imported by name)."""
        self.classes = classes
        self.users = 0
        self.found: list[Any] = []
        self.dicts = [m.__dict__ for m in modules]
        self.name, self.wrapper = name, wrapper
        self.held: list[Any] = []

    def __enter__(self) -> None:
        with _PATCH_LOCK:
            if self.users == 0:
                self.found = [_install(*patch) for patch in self.classes]
                if self.dicts:
                    name, wrapper = self.name, self.wrapper
                    self.held = [d[name] for d in self.dicts]
                    for d in self.dicts:
                        d[name] = wrapper
            self.users += 1

    def __exit__(self, *exc: Any) -> None:
        with _PATCH_LOCK:
            self.users -= 1
            if self.users == 0:
                for patch, found in zip(self.classes, self.found):
                    _put_back(*patch, found)
                self.found = []
                name, wrapper = self.name, self.wrapper
                for d, found in zip(self.dicts, self.held):
                    if d.get(name) is wrapper:  # (a wrapper another library set stays)
                        d[name] = found
                self.held = []


# The class whose ``apply`` Function.apply's ``super().apply`` finds first, and what it finds
# there without autobatch (torch's C entry: a method descriptor, bound per class).
_APPLY_CLASS: Any = torch.autograd.function._SingleLevelFunction
_C_APPLY = torch._C._FunctionBase.__dict__["apply"]
# Per autograd.Function subclass, the function its calls on lazy values are recorded as (one
# object per class: part of the op's key).
_APPLIES: weakref.WeakKeyDictionary[type, Any] = weakref.WeakKeyDictionary()


def _recording_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    """A custom ``torch.autograd.Function``'s call while autobatch runs.  Torch calls its
    ``forward`` with gradients off and hands anything that is not a tensor through untouched:
    on lazy values its ops would be recorded without gradients, and its ``backward`` never
    used (a gradient reversal or a straight-through estimator silently lost).  With a lazy
    argument the call is recorded whole, as a torch function is: its group runs under
    ``torch.func.vmap`` where the Function allows that (``setup_context`` and a vmap rule),
    else one call per example on the examples' rows, as eager code runs it.  Known values go
    in as their tensors."""
    rec = _LOCAL.rec
    if rec is not None and not rec.paused and _holds_lazy((*args, *kwargs.values())):
        recorded = _APPLIES.get(cls)
        if recorded is None:
            recorded = _APPLIES[cls] = _apply_of(cls)
        return rec.record(recorded, "torch", args, kwargs)
    return _C_APPLY.__get__(None, cls)(
        *map(_unknown, args), **{k: _unknown(v) for k, v in kwargs.items()}
    )


def _apply_of(cls: Any) -> Any:
    def apply(*args: Any, **kwargs: Any) -> Any:
        if _holds_lazy((*args, *kwargs.values())):
            # Recorded through (a group's program, see traced._compile), its forward would
            # run without gradients: its groups run under vmap, or per example, instead.
            raise _ThroughFunction(f"{cls.__qualname__}.apply is not recorded through")
        return cls.apply(*args, **kwargs)

    apply.__name__ = apply.__qualname__ = f"{cls.__qualname__}.apply"
    return apply


_RECORDING_APPLY = classmethod(_recording_apply)

# Autobatch's ``autograd.Function`` call (``_recording_apply``) installed for the length of a
# ``with _apply_installed:``: with the other wrappers (``_installed``), and alone where a
# function is recorded once without them (``traced._record_once``).  It goes where
# ``Function.apply`` hands the call to torch's C code (``super().apply``, found on
# ``_SingleLevelFunction``, which inherits it from the C base), so that an ``apply`` taken
# before the call (``grad_reverse = GradReverse.apply`` at import) reaches it too; set there
# and deleted again, leaving the class as it was.
_apply_installed = _Installed((_APPLY_CLASS, "apply", _RECORDING_APPLY))


class _ThroughFunction(Exception):
    """A custom autograd.Function called on lazy values by what records a program of calls
    (see ``_apply_of``)."""


def _row_numbers(data: Any) -> Any:
    """``data`` (nested lists) with each number per row (``values.RowNumber``) its rows'
    values as torch.tensor makes the number (a 0-d lazy row), for ``_tensor_of_lazy``."""
    t = type(data)
    if t is RowNumber:
        return data.tensor_row(None, None)
    if t in _SEQUENCES and any(type(x) is RowNumber or type(x) in _SEQUENCES for x in data):
        return t(_row_numbers(x) for x in data)
    return data


def _holds_lazy(data: Any) -> bool:
    for x in data:
        t = type(x)
        if t is Lazy or (t in _SEQUENCES and _holds_lazy(x)):
            return True
    return False


def _tensor_of_lazy(
    tensor: Any,
    data: Any,
    dtype: torch.dtype | None = None,
    device: Any = None,
    requires_grad: bool = False,
    pin_memory: bool = False,
) -> Any:
    """``torch.tensor(data)`` for nested lists holding lazy values: their elements stacked,
    in the dtype torch infers (the promotion of the elements' dtypes, Python numbers as
    torch.tensor makes them), without autograd history, as torch.tensor gives."""
    if requires_grad:
        raise FoldError(
            "autobatch: torch.tensor(..., requires_grad=True) of recorded values: a new leaf "
            "per example cannot be batched. Fix: make the parameter outside the function."
        )

    def convert(x: Any) -> Any:
        if type(x) is Lazy:
            if x.meta.ndim:
                raise FoldError(
                    f"autobatch: example {x.rec.example}: torch.tensor of a list holding a "
                    f"lazy value of shape {tuple(x.meta.shape)}; torch.tensor takes numbers "
                    "and 0-d tensors. Fix: torch.stack(values)."
                )
            return x
        if type(x) in _SEQUENCES:
            return [convert(e) for e in x]
        return x if type(x) is torch.Tensor else tensor(x)

    def dtypes(x: Any) -> list[torch.dtype]:
        return [d for e in x for d in dtypes(e)] if type(x) is list else [x.dtype]

    def stack(x: Any, want: torch.dtype) -> Any:
        if type(x) is list:
            return torch.stack([stack(e, want) for e in x])
        return x if x.dtype == want else x.to(want)

    converted = convert(data)
    want = dtype or functools.reduce(torch.promote_types, dtypes(converted))
    out = stack(converted, want).detach()
    return out if device is None else out.to(device)


# torch.nn's modules that change a tensor of their own when called: batch and instance norms
# (running statistics and a call count, in training mode), lazy modules (their parameters,
# made on the first call).
KEEPS_STATE = (torch.nn.modules.batchnorm._NormBase, torch.nn.modules.lazy.LazyModuleMixin)


_BATCH_NORM = torch.nn.modules.batchnorm._BatchNorm
_BATCH_NORM_FORWARD = _BATCH_NORM.__dict__["forward"]


def _norm_forward(self: Any, input: Any) -> Any:
    """``_BatchNorm.forward`` while autobatch records: a batch norm in training mode called on
    a lazy value is recorded as one call that normalises and counts, so that its forward
    does not run as eager code, which would count the call (``num_batches_tracked``) once
    where the function is recorded once for a whole batch of rows (``traced._record_once``,
    without autobatch's module wrapper), and would hand its running statistics to the call
    as data, updated in a copy.  A module of these classes exactly is recorded as a call of
    itself (as the wrapper records it); a subclass whose forward reaches this one
    (``super().forward(x)``) as a call of ``batch_norm_forward`` on it, whose group is one
    call that counts every example (see tables._merged_batch_norm)."""
    rec = _LOCAL.rec
    if (
        type(input) is Lazy
        and rec is not None
        and not rec.paused
        and self.training
        and self.track_running_stats
    ):
        if type(self).forward is _norm_forward:
            return rec.record(self, "module", (input,), {})
        self._check_input_dim(input)
        return rec.record(batch_norm_forward, "torch", (self, input), {})
    if rec is not None and type(input) is torch.Tensor:
        # Run at once by an example (finishing as eager code): its update kept, to be
        # made in eager order when the call ends, its call count too (_kept).
        self._check_input_dim(input)
        out = _kept(
            input,
            self.running_mean,
            self.running_var,
            self.training and self.track_running_stats,
            (self.weight, self.bias, self.momentum, self.eps),
            "batch",
            self.num_batches_tracked,
        )
        if out is not _MISS:
            return out
    return _BATCH_NORM_FORWARD(self, input)


def batch_norm_forward(module: Any, input: Any) -> Any:
    """``_BatchNorm.forward`` of ``module`` (a subclass's ``super().forward(x)``): what a
    call recorded by ``_norm_forward`` runs for one example."""
    return _BATCH_NORM_FORWARD(module, input)


class RunningStats:
    """The running statistics a norm call of a function updates in place (``F.batch_norm``
    in training, ``F.instance_norm`` with ``use_input_stats``: the tensors the caller holds,
    a module's buffers), as a recorded call takes them: by identity, not as data (a copy
    per example, updated in the copy).  It holds them as a module holds buffers
    (``_buffers``, ``training``), so that what guards a module's buffers guards them (see
    ops._Buffers).  One per tensors (``of``): the calls of every example on the same
    statistics share it, and so their op."""

    __slots__ = ("_buffers", "_modules", "kind", "training")

    def __init__(self, kind: str, mean: torch.Tensor, var: torch.Tensor) -> None:
        self.kind = kind  # "batch" or "instance"
        self._buffers = {"running_mean": mean, "running_var": var}
        self._modules: dict[str, Any] = {}
        self.training = True

    def __repr__(self) -> str:
        return f"{self.kind} norm running statistics"

    @staticmethod
    def of(kind: str, mean: torch.Tensor, var: torch.Tensor) -> RunningStats:
        key = (kind, id(mean), id(var))
        stats = _RUNNING.get(key)
        held = None if stats is None else stats.tensors()
        if held is None or held[0] is not mean or held[1] is not var:  # (an id reused)
            if len(_RUNNING) >= 4096:
                _RUNNING.clear()
            stats = _RUNNING[key] = RunningStats(kind, mean, var)
        return stats

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._buffers["running_mean"], self._buffers["running_var"]


_RUNNING: dict[tuple[str, int, int], RunningStats] = {}


def running_norm(
    input: Any, weight: Any, bias: Any, momentum: float, eps: float, stats: RunningStats
) -> Any:
    """``F.batch_norm`` in training, or ``F.instance_norm`` with ``use_input_stats``, that
    updates ``stats``: what such a call is recorded as (``batch_norm_rewrite``,
    ``instance_norm_rewrite``), a torch function of its own (its group:
    tables._running_norm_group)."""
    if torch.overrides.has_torch_function_variadic(input, weight, bias):
        return torch.overrides.handle_torch_function(
            running_norm, (input, weight, bias), input, weight, bias, momentum, eps, stats
        )
    mean, var = stats.tensors()
    rec = _LOCAL.rec
    if rec is not None and rec.paused:  # shape inference, on zeros: the statistics untouched
        mean, var = mean.clone(), var.clone()
    # (torch.nn.functional's, looked up now: while autobatch runs, _eager_batch_norm and
    # _eager_instance_norm, which keep the update of a call an example runs at once)
    norm = _F.instance_norm if stats.kind == "instance" else _F.batch_norm
    return norm(input, mean, var, weight, bias, True, momentum, eps)


def _updates(training: Any, mean: Any, var: Any) -> bool:
    """Whether a norm call updates running statistics ``mean`` and ``var`` (eager tensors)."""
    return (
        type(training) in (bool, int)
        and bool(training)
        and type(mean) is torch.Tensor
        and type(var) is torch.Tensor
        and not (mean.requires_grad or var.requires_grad)
    )


def batch_norm_rewrite(
    input: Any,
    running_mean: Any,
    running_var: Any,
    weight: Any = None,
    bias: Any = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Any:
    """``F.batch_norm`` while recording: in training, with running statistics, recorded as
    ``running_norm``; else as it is (``_MISS``)."""
    if not _updates(training, running_mean, running_var):
        return _MISS
    stats = RunningStats.of("batch", running_mean, running_var)
    return running_norm(input, weight, bias, momentum, eps, stats)


def instance_norm_rewrite(
    input: Any,
    running_mean: Any = None,
    running_var: Any = None,
    weight: Any = None,
    bias: Any = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Any:
    """``F.instance_norm`` while recording: with running statistics that it updates
    (``use_input_stats``), recorded as ``running_norm``; else as it is (``_MISS``)."""
    if not _updates(use_input_stats, running_mean, running_var):
        return _MISS
    stats = RunningStats.of("instance", running_mean, running_var)
    return running_norm(input, weight, bias, momentum, eps, stats)


_BATCH_NORM_F = _F.batch_norm
_INSTANCE_NORM_F = _F.instance_norm


def _kept(
    input: Any,
    mean: Any,
    var: Any,
    stats: Any,
    args: tuple[Any, ...],
    kind: str,
    calls: torch.Tensor | None = None,
) -> Any:
    """A norm call in training on running statistics that an example runs at once on a
    tensor (its input, a value computed at once): its output, its update kept for the
    call's end, in eager order (fold.autobatch.running); ``_MISS`` for any other call.
    ``stats``: whether the call uses the batch's statistics (``training``,
    ``use_input_stats``); ``args``: weight, bias, momentum, eps; ``calls``: a module's call
    count, grown with the update."""
    rec = _LOCAL.rec
    if (
        rec is None
        or rec.paused
        or type(input) is not torch.Tensor
        or not _updates(stats, mean, var)
    ):
        return _MISS
    out = running.eager_norm(rec, input, mean, var, calls, *args, kind == "instance")
    return _MISS if out is None else out


def _eager_batch_norm(
    input: Any,
    running_mean: Any,
    running_var: Any,
    weight: Any = None,
    bias: Any = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Any:
    """``F.batch_norm`` while autobatch runs: a call in training on running statistics that
    an example runs at once keeps its update for the call's end (``_kept``); any other call
    as it is (one on a lazy value is recorded: batch_norm_rewrite)."""
    args = (weight, bias, momentum, eps)
    out = _kept(input, running_mean, running_var, training, args, "batch")
    if out is _MISS:
        out = _BATCH_NORM_F(input, running_mean, running_var, weight, bias, training, momentum, eps)
    return out


def _eager_instance_norm(
    input: Any,
    running_mean: Any = None,
    running_var: Any = None,
    weight: Any = None,
    bias: Any = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Any:
    """``F.instance_norm`` while autobatch runs: as ``_eager_batch_norm``."""
    args = (weight, bias, momentum, eps)
    out = _kept(input, running_mean, running_var, use_input_stats, args, "instance")
    if out is _MISS:
        out = _INSTANCE_NORM_F(
            input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps
        )
    return out


# (named as torch's: a call recorded of them names the op so)
functools.update_wrapper(_eager_batch_norm, _BATCH_NORM_F)
functools.update_wrapper(_eager_instance_norm, _INSTANCE_NORM_F)


# Torch functions recorded with the module (or statistics) they change, by the argument's
# position: its buffers are guarded as a module call's are (ops._Buffers).
STATE_ARGS = {batch_norm_forward: 0, running_norm: 5}


# --------------------------------------------------------------------- torch.distributions
# A lazy value is no instance of torch.Tensor (isinstance holds for a known value, whose
# tensor torch's C code may read; a lazy value reaches C code everywhere, which would read
# its memory as a tensor's where a number may stand: torch.full((2,), v)).  Two places of
# torch.distributions test it: a sample's validation (log_prob of a recorded value raised
# "must be a Tensor"), and broadcast_all, which makes a number argument a tensor of the
# first tensor's dtype and device (Normal(mu, 0.1): of the default dtype and the CPU, where
# mu was float64 or on a GPU).  While autobatch runs, both take a lazy value as a tensor.
_DISTRIBUTION = torch.distributions.Distribution
_VALIDATE_SAMPLE = _DISTRIBUTION.__dict__["_validate_sample"]
_BROADCAST_ALL = torch.distributions.utils.broadcast_all


def _validate_sample(self: Any, value: Any) -> None:
    """``Distribution._validate_sample`` while autobatch runs: a lazy value is checked as
    torch checks a tensor (its shape against the distribution's event and batch shapes,
    its values against the support: a read, as in eager code), others by torch itself."""
    if type(value) is not Lazy:
        return _VALIDATE_SAMPLE(self, value)
    shape, event = value.shape, self._event_shape
    if shape[len(shape) - len(event) :] != event:
        raise ValueError(
            f"The right-most size of value must match event_shape: {shape} vs {event}."
        )
    wanted = self._batch_shape + event
    if any(i != 1 and j != 1 and i != j for i, j in zip(reversed(shape), reversed(wanted))):
        raise ValueError(
            f"Value is not broadcastable with batch_shape+event_shape: {shape} vs {wanted}."
        )
    try:
        support = self.support
    except NotImplementedError:  # (torch warns, and checks nothing)
        return _VALIDATE_SAMPLE(self, torch.empty(shape, dtype=value.dtype, device="meta"))
    if not torch._is_all_true(support.check(value)):
        raise ValueError(
            f"Expected value argument (a recorded value of shape {tuple(shape)}) to be within "
            f"the support ({support!r}) of the distribution {self!r}, but found invalid values"
        )
    return None


def _broadcast_all(*values: Any) -> Any:
    """``torch.distributions.utils.broadcast_all`` while autobatch runs: numbers among lazy
    values made tensors of the dtype and device of the first tensor or lazy value, as
    torch makes them of the first tensor's."""
    first = next((v for v in values if type(v) is Lazy or isinstance(v, torch.Tensor)), None)
    if type(first) is not Lazy or not any(isinstance(v, Number) for v in values):
        return _BROADCAST_ALL(*values)
    kind = {"dtype": first.dtype, "device": first.device}
    return _BROADCAST_ALL(
        *[_TORCH_TENSOR(v, **kind) if isinstance(v, Number) else v for v in values]
    )


def _users_of(fn: Any) -> list[Any]:
    """The modules of torch.distributions that imported ``fn`` by name."""
    return [
        module
        for name, module in list(sys.modules.items())
        if name.startswith("torch.distributions")
        and module is not None
        and module.__dict__.get(fn.__name__) is fn
    ]


# ``_norm_forward`` and the patches of torch.distributions, installed for the length of a
# ``with recorded_calls:`` (class or module attributes that are no slots: setting each costs
# about 0.1 us, where a ``__call__`` on the norms' base class cost 5 us, and more in the
# calls after it).
recorded_calls = _Installed(
    (_BATCH_NORM, "forward", _norm_forward),
    (_F, "batch_norm", _eager_batch_norm),
    (_F, "instance_norm", _eager_instance_norm),
    (_DISTRIBUTION, "_validate_sample", _validate_sample),
    modules=_users_of(_BROADCAST_ALL),
    name="broadcast_all",
    wrapper=_broadcast_all,
)


# What torch.tensor is while autobatch runs: ``_recording_tensor``, with its path for one
# Python number (``torch.tensor(word)`` at every leaf of a tree) in C where the extension is
# built (``_C.Tensorize``: the same known value, without the wrapper's frame; 0.58 us a
# call in the wrapper), which keeps no copy of ``_PLAIN`` (emptied in place).
_TENSOR_WRAPPER: Any = (
    functools.update_wrapper(_C.Tensorize(_recording_tensor, _PLAIN, _modes_on), _TORCH_TENSOR)
    if _C is not None and hasattr(_C, "Tensorize")
    else _recording_tensor
)
