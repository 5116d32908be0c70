"""``fold.autobatch``: run unchanged per-example eager code batched.

The user's function is written for ONE example, with no batch dim, as under ``torch.vmap``::

    def encode(model, tree):
        if tree.is_leaf:
            return model.leaf(torch.tensor(tree.word))
        (lh, lc), (rh, rc) = encode(model, tree.left), encode(model, tree.right)
        return model.cell(lh, lc, rh, rc)

    h, c = fold.autobatch(lambda t: encode(model, t), trees)   # each (len(trees), hidden)

:func:`autobatch` calls it once per example with recording on.  Values that depend on a
recorded result are :class:`Lazy`: torch functions, tensor methods and operators on them
record one node each into a :class:`fold.Fold`; a ``@batchable`` function and an
``nn.Module`` call record one node per call.  Then the graph runs with fold's scheduler, every
group of same-signature calls as ONE batched call, and the per-example results come back
stacked along a new dim 0, values and gradients equal to running the function eagerly per
example and stacking.

How a call is recorded (the choices the contract leaves open):

- **Arguments.**  A Lazy value, and a tensor made per example (``torch.tensor(word)``, an
  image row), is a *batched* argument: the group receives the examples' values stacked along
  a new dim 0 (0-dim int64, bool and default-dtype tensors travel as Python numbers).  A leaf
  tensor that requires grad (a parameter) is *shared*: it is passed whole, and is part of
  the op, like every other argument: numbers, dims, shapes, dtypes, modules.  Calls whose
  shared arguments differ are different ops (``x * 0.5`` and ``x * 0.25`` never share a
  group); calls are grouped by op, shared arguments and the batched arguments' shapes.
- **What is recorded.**  A torch function, tensor method or operator is recorded when an
  argument is Lazy; otherwise it runs at once.  Inside ``autobatch`` an ``nn.Module`` call or
  a ``@batchable`` call is recorded whenever it has a batched argument, Lazy or made per
  example: ``model.embed(torch.tensor(word))`` run once per example is exactly the
  batch-of-one work autobatch removes.  A call with no batched argument runs at once.
- **How a group runs.**  Calls known to be batch-polymorphic run directly on the stacked
  arguments (elementwise ops, ``F.linear`` and ``nn.Linear``, ``nn.Embedding``, the RNN cells,
  activations, ``cat``/``chunk``/``softmax``-style ops with their dim moved past the batch
  dim, a ``BatchModule``'s rows merged into its batch).  A group of ``@batchable``
  per-example calls runs as the calls the function makes: the function is recorded once per
  op and autobatch call on lazy values standing for a group (it can only see their shapes,
  so the recording holds for every group of the call; the next call records it again, so
  Python state it reads, such as ``self.training``, is read afresh) and each call it makes
  runs once on the group's batch, in its own mode; a function that cannot be recorded so
  (it reads or changes a value, draws random numbers eagerly, returns one that depends on
  no argument) runs under vmap.  Every other call runs under ``torch.func.vmap``
  (``randomness="different"``), which gives vmap's semantics.
  ``@batchable(batched=True)`` declares a function already written for a batch in dim 0
  (an explicit fold op): it runs directly, and a ``list`` of Lazy values it is given becomes a
  :class:`fold.Ragged` (lists may differ in length across the group).
- **Shapes.**  Every recorded call's output shapes are inferred once per signature on fake
  tensors (no computation; a batch of one on zeros where fake tensors cannot run the op) and
  cached, so ``x.shape``, ``x.size()`` and ``len(x)`` are known while recording.  A shape
  error in the per-example code surfaces there, as a FoldError naming the line.
- **Gradient and autocast mode.**  A call recorded under ``torch.no_grad()`` (a target
  network, a stop-gradient) or in a ``torch.autocast`` region is another op than the same
  call recorded with gradients on and no autocast, and its group runs in the mode it was
  recorded in: no gradient reaches a no-grad call's parameters or flows through its
  results, and an autocast call computes in the autocast dtype, as in eager code.
- **Identical calls** on identical arguments share one node (fold memoises records): the
  functions are taken as pure.  Dropout inside a recorded call draws per row, as vmap does.
- **Reads.**  ``bool``, ``int``, ``float``, ``.item()``, ``.tolist()``, ``.numpy()`` of a Lazy
  value need its value before any is computed: FoldError naming the read, the example and the
  fix.  In-place ops on Lazy values are FoldErrors too.
- A Lazy value is not a ``torch.Tensor`` (``isinstance`` says False); it carries ``shape``,
  ``dtype``, ``device``, ``ndim`` and ``size()``.
- Errors inside a batched call name the user's source line that first recorded that call.
- Caches of ops and shapes live for the process (they hold the modules and parameters they
  name); :func:`clear_cache` empties them.
- **Recording in C.**  A call seen before in this autobatch call, with the same function,
  kind, modules, lazy arguments' metas and constant arguments (ints, bools, nonzero floats,
  None; lists or tuples of lazy values), is found by one lookup in the recorder's ``_fast``
  table: where ``fold/_clazy.c`` is built that lookup, the node's recording and the Lazy
  outputs run in C, from the ``batchable`` call, a Lazy method or ``__torch_function__``
  (``_C.fast``; ``_C.fast_key`` builds the key the slow path files each op under).  Every
  other call (keywords, another grad or autocast mode, a zero float, a new key) takes the
  Python slow path, ``_Recorder.record``, which alone builds op keys and raises errors.
  Without the extension (or with ``FOLD_RECORDER=python``) generated Python functions
  (``_fast_source``) do the lookup for lazy arguments, a module first, or a number tensor.
- **Module calls.**  For the length of an ``autobatch`` call (and only then),
  ``nn.Module.__call__`` is a wrapper that records module calls while autobatch records and
  passes every other call through, and ``torch.tensor`` one that records data holding lazy
  values (``torch.tensor([a, b])`` of recorded scalars: their stack, detached, in the dtype
  torch infers).  Both are put back when the call returns; a wrapper another library
  installs over them meanwhile is never dropped (see ``_Patches``).  Installing costs about
  45 us per call.  A module's op runs the module as ``nn.Module.__call__`` does (forward and
  hooks): a subclass that overrides ``__call__`` had what it does around
  ``super().__call__`` recorded around the module's node.
- **Examples from a tensor.**  A tensor passed as an iterable is split into its rows in one
  call (as iterating it gives), and each row's batched form (its batch-of-one view, or the
  Python number of a 0-dim row) is prepared with it, not per call.
- **One recording for tensor rows.**  Where every iterable is a tensor (``autobatch(loss,
  images, labels)``), the examples differ only in their rows' values, which the per-example
  code cannot read without a FoldError; so it records the same calls for every example.
  autobatch then calls ``fn`` ONCE, on lazy rows standing for all examples (row shape,
  dtype, device), and runs each recorded call once on the whole batch, in the same modes
  (direct, vmap, batched) a group of those calls runs in; values made inside ``fn`` that
  depend on no row are the same for every example and are repeated over the batch.  This
  is what ``torch.vmap(fn)(images, labels)`` computes, without vmap's per-op cost where a
  call runs directly.  It falls back to recording per example, which gives the same values
  (or the error naming the example), where ``fn`` reads a row (``int(label)``), changes one in
  place, draws random numbers eagerly (``torch.randn(3)`` with no lazy argument: one draw
  would be shared by every example; the random state is put back, so per example it draws
  what eager code draws), returns something other than tensors and numbers, gives a
  ``batched=True`` function an empty list, or a call's batched output disagrees with the
  shape inferred for it; that function (by its code) and row shapes then record per
  example from the start.  (Shape inference never draws from the random stream.)  Only
  torch's default generators are checked: a draw from Python's ``random`` or numpy inside
  ``fn`` (a coin flip for augmentation) is made once and shared by every row; checking
  their states costs 30-90 us a call, so such code should pass ``per_example=True``.
  Consequences: ``fn`` runs once, not once per example (its side effects happen once; as
  elsewhere the functions are taken as pure), and results may be views of the inputs where
  a call returns one (``x[0]``), as under vmap.  ``autobatch(..., per_example=True)`` always
  records per example.  Rows of unequal tensors pair up as ``zip`` pairs them.
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import logging
import os
import sys
import threading
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils import _pytree as pytree

from fold._encoding import float_key
from fold.errors import FoldError, describe
from fold.executor import ModelBatched
from fold.graph import Fold
from fold.ragged import Ragged
from fold.run import collector_paused

__all__ = ["Lazy", "autobatch", "batchable", "clear_cache"]

_LOG = logging.getLogger(__name__)

# The C hot path of recording (fold/_clazy.c), where it was compiled at install (setup.py
# builds it as an optional extension): Lazy values' storage, the fast-table lookup, and the
# calls of batchable functions, Lazy methods and __torch_function__.  Without it (or with
# FOLD_RECORDER=python) the Python below does the same, slower.
try:
    import fold._clazy as _C
except ImportError:  # not compiled
    _C = None  # type: ignore[assignment]
if os.environ.get("FOLD_RECORDER") == "python":
    _C = None  # type: ignore[assignment]


class _Local(threading.local):
    rec: _Recorder | None = None
    # > 0 while a batched=True function runs on a batch (a group, or a batch of one): the
    # batchable functions it calls run as they are, already on the batch.
    running = 0
    # While an autobatch call runs its calls: the @batchable functions recorded once for this
    # call (see _compile), by op; None outside.
    programs: dict[Any, Any] | None = None


_LOCAL = _Local()
_FOLD_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


# ---------------------------------------------------------------------------- metas
class _Meta:
    """The per-example shape, dtype and device of a batched value; one object per triple,
    so keys compare them by identity."""

    __slots__ = ("shape", "dtype", "device", "ndim")

    def __init__(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> None:
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.ndim = len(shape)

    def __repr__(self) -> str:
        return describe(self.shape, self.dtype)


_METAS: dict[tuple[Any, ...], _Meta] = {}


def _meta(shape: Any, dtype: torch.dtype, device: torch.device) -> _Meta:
    key = (tuple(shape), dtype, device)
    m = _METAS.get(key)
    if m is None:
        m = _METAS[key] = _Meta(torch.Size(key[0]), dtype, device)
    return m


# Key markers (tagged tuples in an op key; a bare tuple never appears in one).
_PARAM = "shared tensor"
_BY_ID = "module keyed by identity"
_RAGGED = "list of lazy values"
_KW = "keywords"
_NUMBER_DTYPES = (torch.long, torch.bool)


def _identity_keyed(m: Any) -> bool:
    """Whether module ``m`` hashes and compares by identity, as nn.Module does.  Keys hold
    such a module itself; any other (a custom ``__eq__``/``__hash__`` that may call two
    modules equal) is keyed by its id, never merged with another, and takes no fast path."""
    t = type(m)
    return t.__hash__ is object.__hash__ and t.__eq__ is object.__eq__


def _as_number(dtype: torch.dtype) -> bool:
    """Whether a 0-dim per-example tensor of ``dtype`` travels as a Python number (which
    fold batches into a tensor of the same dtype)."""
    return dtype in _NUMBER_DTYPES or dtype is torch.get_default_dtype()


class _Slot:
    """Where a batched argument goes in an op's argument template."""

    __slots__ = ("i", "meta", "ragged")

    def __init__(self, i: int, meta: _Meta | None, ragged: bool = False) -> None:
        self.i = i
        self.meta = meta
        self.ragged = ragged


def _fill(t: Any, values: Any) -> Any:
    """The template ``t`` with its slots replaced by ``values[slot.i]``."""
    tt = type(t)
    if tt is _Slot:
        return values[t.i]
    if tt is tuple or tt is list or tt is torch.Size:
        return tt([_fill(x, values) for x in t])
    if tt is dict:
        return {k: _fill(v, values) for k, v in t.items()}
    if tt is slice:
        return slice(_fill(t.start, values), _fill(t.stop, values), _fill(t.step, values))
    return t


def _leaves(t: Any, kind: type) -> list[Any]:
    """The values of type ``kind`` in a template, its containers walked in order."""
    if isinstance(t, kind):
        return [t]
    if type(t) in (tuple, list, torch.Size):
        return [s for x in t for s in _leaves(x, kind)]
    if type(t) is dict:
        return [s for v in t.values() for s in _leaves(v, kind)]
    return []


def _slots(t: Any) -> list[_Slot]:
    """The batched arguments' slots in a template."""
    return _leaves(t, _Slot)


def _tensors(t: Any) -> list[torch.Tensor]:
    """The shared tensors in a template."""
    return _leaves(t, torch.Tensor)


# ---------------------------------------------------------------------------- modes
_DIRECT, _VMAP, _BATCHED, _MODELS = "direct", "vmap", "batched", "model-batched"
_PER_EXAMPLE = "per-example"  # the kind of a @batchable (not batched=True) call


def _functions(names: str, *spaces: Any) -> set[Any]:
    out = set()
    for name in names.split():
        for space in spaces:
            f = getattr(space, name, None)
            if f is not None:
                out.add(f)
    return out


_ELEMENTWISE = _functions(
    "add sub mul div true_divide pow maximum minimum where clamp clip neg abs exp expm1 log "
    "log1p log2 sqrt rsqrt square reciprocal sigmoid tanh relu sin cos erf sign floor ceil "
    "round logical_not logical_and logical_or eq ne gt ge lt le float double half bfloat16 "
    "long int bool to clone detach contiguous type_as nan_to_num atan2 fmod remainder "
    "__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __pow__ "
    "__rpow__ __neg__ __abs__ __eq__ __ne__ __gt__ __ge__ __lt__ __le__ __and__ __or__ "
    "__xor__ __invert__ __floordiv__ __mod__",
    torch,
    torch.Tensor,
) | _functions(
    "relu gelu silu elu selu leaky_relu softplus softsign hardtanh tanh sigmoid logsigmoid "
    "mish hardswish hardsigmoid relu6 dropout",
    F,
)

# Ops with a dim argument: (position, keyword, default dim).  In direct mode a dim >= 0
# moves one to the right, past the batch dim.
_DIM_OPS: dict[Any, tuple[int, str, int | None]] = {}
for _name, _pos, _default in (
    ("cat", 1, 0),
    ("concat", 1, 0),
    ("stack", 1, 0),
    ("chunk", 2, 0),
    ("split", 2, 0),
    ("unbind", 1, 0),
    ("softmax", 1, None),
    ("log_softmax", 1, None),
    ("sum", 1, None),
    ("mean", 1, None),
    ("amax", 1, None),
    ("amin", 1, None),
    ("prod", 1, None),
    ("cumsum", 1, None),
    ("unsqueeze", 1, None),
    ("squeeze", 1, None),
    ("narrow", 1, None),
    ("select", 1, None),
    ("flip", 1, None),
    ("norm", 2, None),
):
    for _f in _functions(_name, torch, torch.Tensor, F):
        _DIM_OPS[_f] = (_pos, "dims" if _name == "flip" else "dim", _default)
_MATMUL = _functions("matmul __matmul__", torch, torch.Tensor)
_FLATTEN = _functions("flatten", torch, torch.Tensor)
_LOSSES = {F.cross_entropy, F.nll_loss}
_POLYMORPHIC_MODULES: tuple[type, ...] = (
    nn.Linear,
    nn.Embedding,
    nn.Identity,
    nn.Dropout,
    nn.LayerNorm,
    nn.ReLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.GELU,
    nn.SiLU,
    nn.ELU,
    nn.LeakyReLU,
    nn.Softplus,
)
_CELLS = (nn.LSTMCell, nn.GRUCell, nn.RNNCell)


def _shift_dim(d: Any) -> Any:
    if type(d) is int:
        return d + 1 if d >= 0 else d
    if type(d) in (tuple, list) and all(type(x) is int for x in d):
        return type(d)(_shift_dim(x) for x in d)
    return _MISSING


_MISSING = object()


def _direct_template(
    fn: Any, args: list[Any], kwargs: dict[str, Any], outs: list[_Meta]
) -> tuple[list[Any], dict[str, Any]] | None:
    """The arguments for running torch function ``fn`` directly on stacked values, or None
    where only vmap is known to be right."""
    slots = _slots((args, kwargs))
    if not slots or any(s.ragged for s in slots):
        return None
    if fn in _ELEMENTWISE:
        # Broadcasting aligns trailing dims: the batch dims line up only where every batched
        # argument has the output's number of dims.
        if len(outs) == 1 and all(s.meta.ndim == outs[0].ndim for s in slots):
            return args, kwargs
        return None
    if fn in _MATMUL or fn is F.linear:
        rest = [a for a in args[1:]] + list(kwargs.values())
        if type(args[0]) is _Slot and not _slots(rest) and args[0].meta.ndim >= 1:
            w = args[1] if len(args) > 1 else kwargs.get("weight", kwargs.get("other"))
            if fn is F.linear or (isinstance(w, torch.Tensor) and w.dim() == 2):
                return args, kwargs
        return None
    if fn in _LOSSES:
        # One example's mean loss over a (classes,) input is its 'none' loss (without class
        # weights, which a mean divides out); ignored targets are handled in _loss.
        if (
            len(args) >= 2
            and type(args[0]) is _Slot
            and args[0].meta.ndim == 1
            and type(args[1]) is _Slot
            and args[1].meta.ndim == 0
            and kwargs.get("weight") is None
            and kwargs.get("size_average") is None  # the legacy arguments override reduction
            and kwargs.get("reduce") is None
            and kwargs.get("reduction", "mean") in ("mean", "sum")
            and len(args) == 2
        ):
            return args, kwargs
        return None
    if fn in _FLATTEN:  # two dims: start_dim and end_dim, both moved past the batch dim
        if len(slots) != 1 or type(args[0]) is not _Slot or args[0].meta.ndim == 0:
            return None
        dims = {"start_dim": 0, "end_dim": -1}
        dims.update(zip(dims, args[1:]))
        dims.update(kwargs)
        shifted = {k: _shift_dim(d) for k, d in dims.items()}
        if len(shifted) != 2 or any(type(d) is not int for d in shifted.values()):
            return None
        return [args[0]], shifted
    spec = _DIM_OPS.get(fn)
    if spec is None:
        return None
    ndims = {s.meta.ndim for s in slots}
    if len(ndims) != 1 or _tensors((args, kwargs)):
        return None
    pos, name, default = spec
    args, kwargs = list(args), dict(kwargs)
    if name in kwargs:
        d = _shift_dim(kwargs[name])
        if d is _MISSING:
            return None
        kwargs[name] = d
    elif len(args) > pos:
        d = _shift_dim(args[pos])
        if d is _MISSING:
            return None
        args[pos] = d
    elif default is not None:
        kwargs[name] = default + 1
    else:
        return None
    return args, kwargs


def _module_mode(module: nn.Module, args: list[Any], kwargs: dict[str, Any]) -> str:
    slots = _slots((args, kwargs))
    if isinstance(module, ModelBatched):
        return _MODELS
    if kwargs or _tensors(args):
        return _VMAP
    if _polymorphic_module(module) and len(args) == 1 and type(args[0]) is _Slot:
        return _DIRECT
    if isinstance(module, _CELLS) and all(s.meta.ndim == 1 for s in slots):
        return _DIRECT
    return _VMAP


def _polymorphic_module(module: nn.Module) -> bool:
    if isinstance(module, nn.Sequential):
        return all(_polymorphic_module(m) for m in module)
    return isinstance(module, _POLYMORPHIC_MODULES)


# ---------------------------------------------------------------------------- ops
class _Op:
    """One recorded call signature: the function, its argument template (shared values in
    place, slots for the batched ones), how its group runs, and its per-example outputs.

    It is the op fold records (grouped by identity), and called by fold's executor with the
    group's stacked values."""

    def __init__(
        self,
        fn: Any,
        kind: str,
        args: list[Any],
        kwargs: dict[str, Any],
        where: str,
        name: str,
    ) -> None:
        self.fn = fn
        self.kind = kind
        # How the op's function is called: a module as nn.Module.__call__ calls it.
        self.call = functools.partial(_call_module, fn) if kind == "module" else fn
        self.args = args
        self.kwargs = kwargs
        self.where = where
        self.__qualname__ = self.__name__ = f"{name} ({where})" if where else name
        self.name = name
        self.mode = _VMAP
        self.run_args: tuple[list[Any], dict[str, Any]] = (args, kwargs)
        self.outs: list[_Meta] = []
        self.treedef: Any = None
        self.single = True
        self.wrap: Callable[[Any, Any], Any] = _no_wrap
        # The outputs' metas as the C fast path makes them (see _entry).
        self.fast_outs: Any = None
        self._vmapped: Callable[..., Any] | None = None
        # The grad/autocast mode the calls were recorded in (see _current_mode), None for the
        # usual one; a group runs in it (a target network under torch.no_grad(), a region
        # under torch.autocast).
        self.recorded_in: tuple[Any, ...] | None = None

    def __repr__(self) -> str:
        return f"<autobatch op {self.__qualname__}>"

    # -------------------------------------------------------------- per example
    def per_example(self, *values: Any) -> Any:
        args, kwargs = _fill((self.args, self.kwargs), values)
        return self.call(*args, **kwargs)

    def __call__(self, *values: Any) -> Any:
        try:
            if self.recorded_in is None and torch.is_grad_enabled() and not _any_autocast():
                out = self._run(values)
            else:  # run in the mode the calls were recorded in
                with _in_mode(self.recorded_in or _USUAL_MODE):
                    out = self._run(values)
        except Exception as err:
            raise _OpFailed(self, values) from err
        if self.single:
            return out
        return tuple(pytree.tree_leaves(out))

    def _run(self, values: tuple[Any, ...]) -> Any:
        mode = self.mode
        if mode is _BATCHED:
            args, kwargs = _fill(self.run_args, values)
            _LOCAL.running += 1
            try:
                return self.fn(*args, **kwargs)
            finally:
                _LOCAL.running -= 1
        if mode is _DIRECT:
            args, kwargs = _fill(self.run_args, values)
            if self.fn in _LOSSES:
                return _loss(self.fn, args, kwargs)
            return self.call(*args, **kwargs)
        if mode is _MODELS:
            return self._models(values)
        if self.kind is _PER_EXAMPLE:
            programs = _LOCAL.programs
            if programs is None:  # not inside an autobatch call's run: for this group only
                programs = {}
            program = programs.get(self)
            if program is None:
                program = programs[self] = _compile(self)
            if program is not False:
                try:
                    return program(values)
                except Exception as err:  # vmap gives the same values, or the error
                    programs[self] = False
                    _LOG.debug("autobatch: %s recorded once failed (%s); vmap runs it", self, err)
        if self._vmapped is None:
            self._vmapped = torch.func.vmap(self.per_example, randomness="different")
        return self._vmapped(*values)

    def _models(self, values: tuple[Any, ...]) -> Any:
        """A BatchModule call: per example (N, b, ...) values; the group's (n, N, b, ...)
        become (N, n * b, ...), one call, and back."""
        n = values[0].shape[0]
        merged = [v.movedim(0, 1).flatten(1, 2) for v in values]
        out = self.per_example(*merged)
        return pytree.tree_map(lambda t: t.unflatten(1, (n, -1)).movedim(1, 0), out)


def _no_wrap(node: Any, rec: Any) -> Any:  # pragma: no cover  (replaced by _infer)
    raise AssertionError("op used before its outputs were inferred")


def _loss(fn: Any, args: list[Any], kwargs: dict[str, Any]) -> torch.Tensor:
    """A per-example mean/sum classification loss over a group, one value per example."""
    kwargs = dict(kwargs)
    reduction = kwargs.get("reduction", "mean")
    kwargs["reduction"] = "none"
    out = fn(*args, **kwargs)
    if reduction != "mean":
        return out  # a sum over nothing is 0, as 'none' gives an ignored target
    target = args[1]
    ignore = kwargs.get("ignore_index", -100)
    # One example whose target is ignored averages nothing: nan, as eager gives.
    return torch.where(target == ignore, float("nan"), out)


def _wrapper(single: bool, metas: list[_Meta], treedef: Any) -> Callable[[Any, Any], Any]:
    """How an op's recorded node (or split nodes) becomes its Lazy outputs."""
    if single:
        m = metas[0]
        return lambda node, rec: Lazy(node, m, rec)
    if treedef == pytree.tree_flatten(tuple(range(len(metas))))[1]:
        if len(metas) == 2:  # an LSTM cell's (h, c): unrolled
            m0, m1 = metas
            return lambda nodes, rec: (Lazy(nodes[0], m0, rec), Lazy(nodes[1], m1, rec))
        return lambda nodes, rec: tuple([Lazy(h, m, rec) for h, m in zip(nodes, metas)])
    return lambda nodes, rec: pytree.tree_unflatten(
        [Lazy(h, m, rec) for h, m in zip(nodes, metas)], treedef
    )


class _OpFailed(Exception):
    """A batched call raised; carries the op for autobatch's message."""

    def __init__(self, op: _Op, values: tuple[Any, ...]) -> None:
        super().__init__(op.__qualname__)
        self.op = op
        self.values = values


_any_autocast = torch._C._is_any_autocast_enabled


def _autocast_devices() -> tuple[str, ...]:
    out = []
    for dt in ("cpu", "cuda", "xpu", "mps", "hpu"):
        try:
            torch.is_autocast_enabled(dt)
        except Exception:  # a device type this build has no autocast for
            continue
        out.append(dt)
    return tuple(out)


_AUTOCAST_DEVICES = _autocast_devices()
_USUAL_MODE: tuple[Any, ...] = (True, ())


def _current_mode() -> tuple[Any, ...]:
    """(gradients on?, ((device type, autocast dtype), ...) for each autocast region on)."""
    casts: tuple[Any, ...] = ()
    if _any_autocast():
        casts = tuple(
            (dt, torch.get_autocast_dtype(dt))
            for dt in _AUTOCAST_DEVICES
            if torch.is_autocast_enabled(dt)
        )
    return (torch.is_grad_enabled(), casts)


@contextlib.contextmanager
def _in_mode(mode: tuple[Any, ...]) -> Any:
    """Gradients and autocast set as ``mode`` says, whatever they are now."""
    grad, casts = mode
    want = dict(casts)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(grad))
        for dt in _AUTOCAST_DEVICES:
            if dt in want:
                stack.enter_context(torch.autocast(dt, dtype=want[dt]))
            elif torch.is_autocast_enabled(dt):
                stack.enter_context(torch.autocast(dt, enabled=False))
        yield


_OPS: dict[Any, _Op] = {}
# The same for calls recorded in another grad/autocast mode (torch.no_grad(), an autocast
# region): other ops, by mode.
_MODE_OPS: dict[tuple[Any, ...], dict[Any, _Op]] = {}
# Keyword arguments that are constants only (numbers, strings, None), as F.cross_entropy's
# defaults: (names, ids of the values) -> (the values, their key part), made once (see
# _Recorder.record).
_CONSTANTS = frozenset({int, float, bool, str, type(None)})
_KW_PARTS: dict[tuple[Any, ...], tuple[Any, ...]] = {}
_KW_PARTS_MAX = 4096


def clear_cache() -> None:
    """Forget every recorded op signature and its inferred shapes (and the modules and
    parameters they hold)."""
    _OPS.clear()
    _MODE_OPS.clear()
    _METAS.clear()
    _KW_PARTS.clear()
    _UNTRACEABLE.clear()


def _source_line() -> str:
    """``file:line`` of the innermost frame outside fold and torch (the user's call)."""
    f: Any = sys._getframe(1)
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if not (path.startswith(_FOLD_DIR) or path.startswith(_TORCH_DIR)):
            text = linecache.getline(f.f_code.co_filename, f.f_lineno).strip()
            rel = os.path.relpath(path)
            where = f"{path if rel.startswith('..') else rel}:{f.f_lineno}"
            return f"{where}: {text}" if text else where
        f = f.f_back
    return ""


def _fn_name(fn: Any, kind: str) -> str:
    if kind == "module":
        return f"{type(fn).__name__} call"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    if getattr(fn, "__module__", None) == "torch.nn.functional":
        return f"F.{name}"
    if name.startswith("_VariableFunctionsClass."):
        return f"torch.{name.split('.', 1)[1]}"
    if name.startswith("TensorBase.") or name.startswith("Tensor."):
        return f"Tensor.{name.split('.', 1)[1]}"
    mod = getattr(fn, "__module__", None)
    if mod in ("torch", "torch._C._VariableFunctions") or name in dir(torch):
        return f"torch.{name}"
    return name


# ---------------------------------------------------------------------------- lazy values
class _PyLazyBase:
    """The storage of a Lazy value where the C one (fold/_clazy.c) is not built; set once,
    by the constructor (Lazy refuses later changes, as the C storage's read-only fields do)."""

    __slots__ = ("node", "meta", "rec")

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
    return rec.record(func, "torch", args, kwargs or {})


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

    def size(self, dim: int | None = None) -> Any:
        return self.meta.shape if dim is None else self.meta.shape[dim]

    def dim(self) -> int:
        return self.meta.ndim

    def numel(self) -> int:
        return self.meta.shape.numel()

    nelement = numel

    def element_size(self) -> int:
        return torch.empty((), dtype=self.meta.dtype).element_size()

    def is_floating_point(self) -> bool:
        return self.meta.dtype.is_floating_point

    def __len__(self) -> int:
        if not self.meta.ndim:
            raise FoldError("len() of a 0-d lazy value: it has no dim 0. Fix: use .shape.")
        return self.meta.shape[0]

    def __iter__(self) -> Any:
        if not self.meta.ndim:
            raise FoldError("iterating over a 0-d lazy value. Fix: use .shape.")
        return iter(self.unbind(0))

    def __repr__(self) -> str:
        return f"Lazy({describe(self.meta.shape, self.meta.dtype)}, example {self.rec.example})"

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

    # -------------------------------------------------------------- reads
    def _read(self, what: str) -> Any:
        rec = self.rec
        raise FoldError(
            f"autobatch: example {rec.example}: {what} reads the data of a lazy value "
            f"{describe(self.meta.shape, self.meta.dtype)}, which is computed only after every "
            "example is recorded. Fix: branch on what is known while recording (the example's "
            "structure, shapes), or compute the value outside autobatch and pass it in; for "
            "builtin max()/min() and comparisons in `if`, use torch.maximum, torch.minimum or "
            "torch.where; data-dependent control flow is not batched yet."
        )

    def __bool__(self) -> bool:
        return self._read("bool()")

    def __int__(self) -> int:
        return self._read("int()")

    def __float__(self) -> float:
        return self._read("float()")

    def __complex__(self) -> complex:
        return self._read("complex()")

    def __index__(self) -> int:
        return self._read("using it as an index (__index__)")

    def item(self) -> Any:
        return self._read(".item()")

    def tolist(self) -> Any:
        return self._read(".tolist()")

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        return self._read(".numpy()")

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        return self._read("numpy conversion")

    def __contains__(self, item: Any) -> bool:
        return self._read("`in`")

    def backward(self, *args: Any, **kwargs: Any) -> None:
        raise FoldError(
            "autobatch: .backward() on a lazy value inside the per-example function. Fix: "
            "return the loss; autobatch returns the losses stacked, call .backward() on them "
            "(or their sum)."
        )

    def __setitem__(self, key: Any, value: Any) -> None:
        _inplace(self, "__setitem__ (x[...] = v)")


def _inplace(self: Lazy, name: str) -> None:
    raise FoldError(
        f"autobatch: example {self.rec.example}: in-place {name} on a lazy value; recorded "
        "values are immutable. Fix: use the out-of-place form (x = x.add(y), torch.where, "
        "index_put without underscore)."
    )


def _is_inplace(fn: Any) -> bool:
    """Whether torch function or method ``fn`` changes its first argument in place: a name
    ending in one underscore (``add_``, ``copy_``, ``nn.init.normal_``), an augmented
    assignment operator (``__iadd__``), or ``__setitem__``."""
    name = getattr(fn, "__name__", None)
    if type(name) is not str:
        return False
    if name.startswith("__") and name.endswith("__"):
        return name == "__setitem__" or (name.startswith("__i") and name[3:-2] in _AUGMENTED)
    return name.endswith("_") and not name.endswith("__")


_AUGMENTED = frozenset(
    "add sub mul truediv floordiv mod pow matmul and or xor lshift rshift".split()
)


class _InplaceTable(dict):  # type: ignore[type-arg]
    """fn -> whether it works in place, filled on first sight (see _is_inplace)."""

    def __missing__(self, fn: Any) -> bool:
        out = self[fn] = _is_inplace(fn)
        return out


_INPLACE = _InplaceTable()


def _inplace_call(rec: _Recorder, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A FoldError for an in-place torch call with a lazy argument.  On an eager tensor
    (``buf.add_(y)``, ``buf.copy_(y)``, ``acc += y``, ``buf[0] = y``, ``out=buf``) it would
    change nothing that the Fold computes: the tensor stays as it was, and every alias of it
    with it."""
    name = _fn_name(fn, "torch")
    target = kwargs.get("out", args[0] if args else None)
    if type(target) is Lazy:
        _inplace(target, name)
    what = "out=" if "out" in kwargs else name
    raise FoldError(
        f"autobatch: example {rec.example}: {what} writes a recorded value into an eager "
        "tensor in place. Inside autobatch a recorded value is computed only after every "
        "example is recorded, so the eager tensor (and every alias of it) would keep its old "
        "value. Fix: compute out of place and rebind the name: buf = buf + y (for buf.add_(y) "
        "or acc += y), buf = y (for buf.copy_(y)), torch.where or torch.cat (for buf[i] = y)."
    )


def _record_method(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A tensor method or operator called on a lazy value ``args[0]``: record it."""
    rec = getattr(args[0], "rec", None)
    if rec is None:
        raise _unfilled(_fn_name(func, "torch"))
    return rec.record(func, "torch", args, kwargs)


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
        return self.rec.record(func, "torch", (self, *args), kwargs)

    method.__name__ = func.__name__
    return method


def _inplace_method(name: str) -> Callable[..., Any]:
    def method(self: Lazy, *args: Any, **kwargs: Any) -> Any:
        _inplace(self, f".{name}()")

    method.__name__ = name
    return method


_OPERATORS = (
    "__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ "
    "__floordiv__ __rfloordiv__ __mod__ __rmod__ __pow__ __rpow__ __matmul__ __rmatmul__ "
    "__neg__ __pos__ __abs__ __invert__ __and__ __rand__ __or__ __ror__ __xor__ __rxor__ "
    "__lshift__ __rshift__ __eq__ __ne__ __lt__ __le__ __gt__ __ge__ __getitem__"
).split()
for _name in _OPERATORS:
    setattr(Lazy, _name, _method(getattr(torch.Tensor, _name)))
# No __iadd__ and kin: ``x += y`` rebinds x to ``x + y``, out of place.
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


# ---------------------------------------------------------------------------- recording
_MISS = object()


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
        "            elif type(a0) is Tensor and not a0.ndim and not a0.requires_grad:\n"
        "                e = rec._fast.get((fn, kind, a0.dtype, a0.device))\n"
        "                if e is not None:\n"
        "                    return e[2](e[0](a0.item()), rec)\n"
    ),
    2: (
        "        elif type(a1) is Tensor and isinstance(a0, Module):\n"
        "            if not a1.ndim and not a1.requires_grad:\n"
        "                e = rec._fast.get((fn, kind, a0, a1.dtype, a1.device))\n"
        "                if e is not None:\n"
        "                    return e[2](e[0](a1.item()), rec)\n"
    ),
}


def _make_fast(k: int) -> Callable[..., Any]:
    env: dict[str, Any] = {"Tensor": torch.Tensor}
    exec(compile(_fast_source(k), f"<autobatch fast recorder {k}>", "exec"), env)
    return env["make"](Lazy, nn.Module, _MISS)


def _entry(op: _Op, r: Callable[..., Any]) -> tuple[Any, Any, Any]:
    """A ``_fast`` table entry: (the op's recorder, its outputs' metas as the C path makes
    them: one meta, a tuple of them for a flat tuple, or None, wrap)."""
    return (r, op.fast_outs, op.wrap)


class _Recorder:
    """One autobatch call: its Fold, the example being recorded, the device."""

    def __init__(self, fold: Any = None) -> None:
        # A Fold, or a _Trace when autobatch records once on lazy rows (see _traced).
        self.fold = Fold() if fold is None else fold
        self.example = 0
        self.paused = False
        # Set when the autobatch call (or the recording made once) that this recorder serves
        # has ended: a lazy value kept beyond it records nothing (see close).
        self.closed = False
        self.device: torch.device | None = None
        self._recorders: dict[_Op, Callable[..., Any]] = {}
        # Op key -> record-and-wrap, for calls of lazy arguments only (see _fast_source).
        self._fast: dict[tuple[Any, ...], Callable[..., Any]] = {}
        # id(row) -> (row, version, batched value, meta): the examples of a tensor autobatch
        # iterates over, prepared in one call per tensor (see ``rows``).
        self._rows: dict[int, tuple[Any, int, Any, _Meta]] = {}

    def close(self) -> None:
        """End the recording: every later call on one of its lazy values is a FoldError.
        The fast table is emptied, so such a call misses it and the slow path says so."""
        self.closed = True
        self._fast.clear()

    def rows(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The examples of a tensor passed to autobatch: ``t.unbind(0)``, as iterating it
        gives, each prepared as a batched argument in one call for all: its batch-of-one view
        (from ``t.split(1)``), or the Python number a 0-dim int, bool or default-dtype row
        travels as.  ``_part`` takes a row from here while its version shows no in-place
        change; it computes anything else (a row changed in place, a new tensor) itself."""
        rows = t.unbind(0)
        if not rows or t.requires_grad:  # rows that carry gradients: the general path
            return rows
        if self.device is None:
            self.device = t.device
        if t.ndim == 1 and _as_number(t.dtype):
            values: Any = t.tolist()
        else:
            values = t.split(1)
        meta = _meta(t.shape[1:], t.dtype, t.device)
        version = t._version
        table = self._rows
        for row, value in zip(rows, values):
            table[id(row)] = (row, version, value, meta)
        return rows

    def record(self, fn: Any, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Record ``fn(*args, **kwargs)``: look its op up by key (made on first sight), add
        the node, and return its outputs as Lazy values.  The recording hot path: a call
        seen before whose arguments are all lazy values (a method's module first, perhaps)
        goes through ``_fast``; others build their key here."""
        try:
            return self._record(fn, kind, args, kwargs)
        except AttributeError:
            for a in (*args, *kwargs.values()):
                for x in a if type(a) in (list, tuple) else (a,):
                    if isinstance(x, Lazy) and not all(
                        hasattr(x, f) for f in ("node", "meta", "rec")
                    ):
                        raise _unfilled(_fn_name(fn, kind)) from None
            raise

    def _record(self, fn: Any, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # The grad/autocast mode the call is recorded in; None for the usual one (gradients
        # on, no autocast), the only one the fast table holds.
        mode = None if torch.is_grad_enabled() and not _any_autocast() else _current_mode()
        fast = not kwargs and mode is None and 0 < len(args) <= _FAST_MAX
        if fast:
            out = _fast_path(self, fn, kind, args)
            if out is not _MISS:
                return out
        if self.closed:
            raise FoldError(
                f"{_fn_name(fn, kind)}: a lazy value was used after the autobatch call that "
                "recorded it returned (kept in a list, a global or an attribute). Its value "
                "exists only in that call's results. Fix: return it from the function autobatch "
                "runs and use the result autobatch returns."
            )
        if kind == "torch" and (_INPLACE[fn] or "out" in kwargs):
            _inplace_call(self, fn, args, kwargs)
        # The fast key is taken from the arguments as given, before the call: shape inference
        # runs the function, which may change a list argument in place.
        fast_key = _C.fast_key(self, fn, kind, args) if fast and _C is not None else None
        fargs: list[Any] = []
        shared: list[torch.Tensor] = []
        parts: list[Any] = [fn, kind]
        if kind == "module" and not _identity_keyed(fn):
            parts[0] = (_BY_ID, id(fn))  # the op holds fn: the id stays its own
        append = parts.append
        lazies = 0
        for a in args:
            if type(a) is Lazy and a.rec is self:
                fargs.append(a.node)
                append(a.meta)
                lazies += 1
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
            op = ops[key] = self._new_op(key, len(args), fn, kind, shared)
            op.recorded_in = mode
        r = self._recorders.get(op)
        if r is None:  # the first call specialises Fold.op's recorder: keep that one
            outputs = None if op.single else len(op.outs)
            nodes = self.fold.op(op, outputs)(*fargs)
            r = self._recorders[op] = self.fold.op(op, outputs)
            out = op.wrap(nodes, self)
        else:
            out = op.wrap(r(*fargs), self)
        k = len(args)
        if mode is not None:
            return out
        if _C is not None:  # later calls of this op with the same fast key take the C path
            if fast_key is not None:
                self._fast[fast_key] = _entry(op, r)
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
        return out

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
        if t is Lazy:
            if a.rec is not self:
                raise FoldError(
                    f"autobatch: example {self.example}: a lazy value from another autobatch "
                    "call (or an earlier one) was passed in. Fix: return it from that call "
                    "and pass the result as an input."
                )
            fargs.append(a.node)
            return a.meta
        if t is int or t is str or a is None:
            return a
        if t is float:  # -0.0 keyed apart from 0.0 (1 / x tells them apart)
            return (t, float_key(a))
        if t is bool:
            return (t, a)
        if isinstance(a, torch.Tensor):
            row = self._rows.get(id(a))
            if (
                row is not None
                and row[0] is a
                and row[1] == a._version
                and not a.requires_grad  # requires_grad_() on the row: the general path
            ):
                fargs.append(row[2])
                return row[3]
            grad = a.requires_grad
            if grad and a.is_leaf:
                shared.append(a)
                return (_PARAM, id(a))
            dtype, device = a.dtype, a.device
            if self.device is None:
                self.device = device
            if not grad and not a.ndim and _as_number(dtype):
                fargs.append(a.item())
            else:
                fargs.append(a.unsqueeze(0))
            return _meta(a.shape, dtype, device)
        if isinstance(a, nn.Module):  # a module, a method's self: keyed by identity
            if _identity_keyed(a):
                return a
            shared.append(a)  # the op holds it (see _template): the id stays its own
            return (_BY_ID, id(a))
        if t is tuple or t is list or t is torch.Size:
            if ragged and t is list and all(type(x) is Lazy for x in a):
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
        try:
            hash(a)
        except TypeError:
            raise FoldError(
                f"autobatch: example {self.example}: an argument of type {t.__name__} cannot "
                "be part of a recorded call (it is not hashable, so calls cannot be grouped "
                "by it). Fix: pass tensors, numbers, tuples, lists or dicts of them."
            ) from None
        return a

    def _ragged(self, items: list[Lazy], fargs: list[Any]) -> Any:
        metas = {x.meta for x in items}
        if len(metas) > 1:
            first = items[0].meta
            bad = next(i for i, x in enumerate(items) if x.meta is not first)
            raise FoldError(
                f"autobatch: example {self.example}: element {bad} of a list passed to a "
                f"batched function is {items[bad].meta}, element 0 {first}; the elements of a "
                "list argument are concatenated, so they must agree in shape and dtype."
            )
        for x in items:
            if x.rec is not self:
                raise FoldError(
                    f"autobatch: example {self.example}: a list holds a lazy value from another "
                    "autobatch call. Fix: pass values of this call."
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
        where = _source_line()
        op = _Op(fn, kind, args, kwargs, where, _fn_name(fn, kind))
        self._infer(op)
        if kind == "torch":
            direct = _direct_template(fn, args, kwargs, op.outs)
            if direct is not None:
                op.mode, op.run_args = _DIRECT, direct
        elif kind == "module":
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
            if tag is _PARAM or tag is _BY_ID:
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
        slots = _slots((op.args, op.kwargs))
        self.paused = True
        running = op.kind == _BATCHED
        _LOCAL.running += running
        rng = _rng_states()  # inference draws nothing from the user's random stream
        try:
            try:
                out = self._run_fake(op, slots)
            except Exception:
                out = self._run_zeros(op, slots)
        except Exception as err:
            raise FoldError(
                f"autobatch: example {self.example}: {op.name} at {op.where or '?'} fails on "
                f"one example's shapes ({', '.join(repr(s.meta) for s in slots)}): "
                f"{type(err).__name__}: {err}"
            ) from err
        finally:
            self.paused = False
            _LOCAL.running -= running
            _rng_restore(rng)
        leaves, treedef = pytree.tree_flatten(out)
        if not leaves or not all(isinstance(t, torch.Tensor) for t in leaves):
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
            metas = [_meta(t.shape[1:], t.dtype, t.device) for t in leaves]
        else:
            metas = [_meta(t.shape, t.dtype, t.device) for t in leaves]
        op.outs = metas
        op.treedef = treedef
        op.single = isinstance(out, torch.Tensor)
        op.wrap = _wrapper(op.single, metas, treedef)
        if op.single:
            op.fast_outs = metas[0]
        elif treedef == pytree.tree_flatten(tuple(range(len(metas))))[1]:
            op.fast_outs = tuple(metas)

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
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode(allow_non_fake_inputs=True):
            values = self._inputs(
                op, slots, lambda sh, dt, dev: torch.empty(sh, dtype=dt, device=dev)
            )
            return op.per_example(*values)

    def _run_zeros(self, op: _Op, slots: list[_Slot]) -> Any:
        with torch.no_grad():
            values = self._inputs(
                op, slots, lambda sh, dt, dev: torch.zeros(sh, dtype=dt, device=dev)
            )
            return op.per_example(*values)


_FAST: dict[int, Callable[..., Any]] = {k: _make_fast(k) for k in range(1, 7)}


def _py_fast(rec: _Recorder, fn: Any, kind: str, args: tuple[Any, ...]) -> Any:
    return _FAST[len(args)](rec, fn, kind, args)


# The fast path of _Recorder.record (fold/_clazy.c's, or the generated Python recorders)
# and the most arguments it takes.
_fast_path = _py_fast if _C is None else _C.fast
_FAST_MAX = len(_FAST) if _C is None else _C.MAX_FAST


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
    )


# ---------------------------------------------------------------------------- patches
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


_PATCH_LOCK = threading.Lock()
_PATCHES = _Patches()
# nn.Module.__call__ as fold found it at import: runs a module call's op where no wrapper of
# autobatch's is installed (a graph from record_examples applied later).
_MODULE_CALL = nn.Module.__call__


def _make_module_call(inner: Any, token: object) -> Any:
    # The wrapper knows itself by ``token`` (installed with it): a reference to itself would
    # make a reference cycle, left for the collector at the end of every call.
    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
        rec = _LOCAL.rec
        if rec is None or rec.paused or _PATCHES.token is not token:
            return inner(self, *args, **kwargs)
        return rec.record(self, "module", args, kwargs)

    __call__.__qualname__ = "Module.__call__ (recording under fold.autobatch)"
    return __call__


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
            p.tensor = torch.tensor
            torch.tensor = _recording_tensor
        p.users += 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            p.users -= 1
            if p.users == 0:
                if nn.Module.__call__ is p.module_call:
                    nn.Module.__call__ = p.inner  # type: ignore[method-assign]
                if torch.tensor is _recording_tensor:
                    torch.tensor = p.tensor
                p.module_call = p.inner = p.tensor = p.token = None


_TORCH_TENSOR = torch.tensor
_SEQUENCES = (list, tuple)


def _recording_tensor(data: Any, *args: Any, **kwargs: Any) -> Any:
    """``torch.tensor`` while autobatch runs: data holding lazy values (``torch.tensor([a,
    b])`` of recorded scalars) is recorded; anything else goes to torch."""
    tensor = _PATCHES.tensor or _TORCH_TENSOR
    if type(data) in _SEQUENCES:
        rec = _LOCAL.rec
        if rec is not None and not rec.paused and _holds_lazy(data):
            return _tensor_of_lazy(tensor, data, *args, **kwargs)
    return tensor(data, *args, **kwargs)


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
        return tensor(x)

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


# ---------------------------------------------------------------------------- batchable
class _PyBatchableBase:
    """The call and descriptor of ``batchable`` where the C ones (fold/_clazy.c, which take
    the fast path of ``_Recorder.record`` first) are not built."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)  # type: ignore[attr-defined]

    def __get__(self, obj: Any, cls: Any = None) -> Any:
        if obj is None:
            return self
        return types.MethodType(self, obj)


class batchable(_PyBatchableBase if _C is None else _C.BatchableBase):  # type: ignore[misc]  # noqa: N801
    """Mark a function or method as one recorded node per call inside :func:`autobatch`.

    ``@fold.batchable`` on code written for ONE example (no batch dim): a group runs the
    calls it makes, recorded once, each on the whole group (under ``torch.func.vmap`` where
    the function cannot be recorded so; see "How a group runs" in :mod:`fold.lazy`).
    ``@fold.batchable(batched=True)`` on code written for a batch
    in dim 0, like an explicit fold op: a group runs it directly, a ``list`` of Lazy values
    arrives as a :class:`fold.Ragged`, and a call outside autobatch gets a batch of one (its
    tensors unsqueezed, lists as a one-list Ragged, outputs squeezed).  Outside autobatch the
    per-example form is the plain function.
    """

    fn: Callable[..., Any] | None
    _kind: str

    def __init__(self, fn: Callable[..., Any] | None = None, *, batched: bool = False) -> None:
        self.batched = batched
        self.fn = fn
        self._kind = _BATCHED if batched else _PER_EXAMPLE
        if fn is not None:
            functools.update_wrapper(self, fn)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        """A call (the C base's fast path aside, see fold/_clazy.c)."""
        if self.fn is None:  # @batchable(batched=True) receiving the function
            (fn,) = args
            return batchable(fn, batched=self.batched)
        rec = _LOCAL.rec
        if rec is None or rec.paused or _LOCAL.running:
            if self.batched and not _LOCAL.running:
                return _batch_of_one(self.fn, args, kwargs)
            return self.fn(*args, **kwargs)
        return rec.record(self.fn, self._kind, args, kwargs)

    def __repr__(self) -> str:
        return f"<fold.batchable {getattr(self.fn, '__qualname__', self.fn)!r}>"


def _batch_of_one(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A ``batched=True`` function called on one example: tensors unsqueezed, lists of
    tensors as a one-list Ragged, outputs squeezed."""
    args, kwargs = pytree.tree_map(_one, (args, kwargs), is_leaf=_is_list_of_tensors)
    _LOCAL.running += 1
    try:
        out = fn(*args, **kwargs)
    finally:
        _LOCAL.running -= 1
    return pytree.tree_map(_unbatch, out)


def _is_list_of_tensors(x: Any) -> bool:
    return type(x) is list and all(isinstance(t, torch.Tensor) for t in x)


def _one(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.unsqueeze(0)
    if _is_list_of_tensors(x):
        if not x:  # no elements, so no shape: as fold gives a group of empty lists
            return Ragged(torch.zeros(0), torch.zeros(1, dtype=torch.long))
        return Ragged(torch.stack(x), torch.tensor([len(x)]))
    return x


def _unbatch(x: Any) -> Any:
    return x.squeeze(0) if isinstance(x, torch.Tensor) else x


# ---------------------------------------------------------------------------- autobatch
class _DeviceAnchor(nn.Module):
    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.register_buffer("anchor", torch.empty(0, device=device))


def autobatch(fn: Callable[..., Any], *iterables: Iterable[Any], per_example: bool = False) -> Any:
    """Run ``fn`` once per example (the zip of ``iterables``) with recording on, then the
    recorded graph batched; returns the per-example results stacked along a new dim 0, in
    ``fn``'s output structure (tensor, tuple, list, dict).  See :mod:`fold.lazy`.

    Where every iterable is a tensor (the examples are its rows), ``fn`` is first recorded
    ONCE, on lazy rows standing for all examples, and each recorded call runs once on the
    whole batch (see "One recording for tensor rows" in :mod:`fold.lazy`); where that cannot
    be done it records per example.  ``per_example=True`` always records per example (for a
    function whose per-call side effects matter).

    Records with the cyclic garbage collector paused, as ``Fold.apply`` runs: recording
    makes a few tracked objects per call (Lazy values, tuples), enough to set off full
    collections of the whole heap; they are freed by reference counting.
    """
    if _LOCAL.rec is not None:
        raise FoldError(
            "autobatch: called inside a function autobatch is running. Fix: call the inner "
            "function directly; it is recorded into the same graph."
        )
    with _installed():
        if not per_example and iterables:
            out = _traced(fn, iterables)
            if out is not _MISS:
                return out
        rec, results, spec = record_examples(fn, *iterables)
        return pytree.tree_unflatten(_stack(rec, results), spec)


def record_examples(fn: Callable[..., Any], *iterables: Iterable[Any]) -> tuple[Any, ...]:
    """The recording half of :func:`autobatch`: ``(recorder, per-example flat results,
    their structure)``; ``recorder.fold`` is the graph.  For benchmarks and inspection."""
    rec = _Recorder()
    results: list[list[Any]] = []
    spec = None
    _LOCAL.rec = rec
    installed = _installed()
    installed.__enter__()
    try:
        iterables = tuple(
            rec.rows(it) if isinstance(it, torch.Tensor) and it.ndim else it for it in iterables
        )
        with collector_paused():
            for i, example in enumerate(zip(*iterables)):
                rec.example = i
                try:
                    result = fn(*example)
                except (TypeError, ValueError) as err:
                    explained = _misuse(err, i)
                    if explained is err:
                        raise
                    raise explained from err
                leaves, s = _flatten(result)
                if spec is None:
                    spec = s
                elif s is not spec and s != spec:
                    raise FoldError(
                        f"autobatch: example {i} returned a structure {s} but example 0 "
                        f"returned {spec}; results are stacked per position, so every example "
                        "must return the same structure."
                    )
                results.append(leaves)
    finally:
        _LOCAL.rec = None
        rec.close()
        installed.__exit__(None, None, None)
    if spec is None:
        raise FoldError("autobatch: no examples (the iterables are empty). Fix: pass at least one.")
    return rec, results, spec


def _misuse(err: Exception, i: int) -> Exception:
    """A FoldError for what torch raises where it meets a lazy value it cannot take
    (``err`` itself for any other error): an unbound tensor method, or ``torch.func.vmap``
    inside the per-example function."""
    text = str(err)
    if isinstance(err, FoldError) or "Lazy" not in text:
        return err
    if "vmap" in text:
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


# The structure of a result that is one tensor or Lazy value, and of flat tuples of them,
# by length: pytree.tree_flatten costs ~5 us a call and leaves a reference cycle behind (its
# recursive helper), which set off a collection after every autobatch call.
_LEAF_SPEC = pytree.tree_flatten(0)[1]
_TUPLE_SPECS: dict[int, Any] = {}


def _flatten(out: Any) -> tuple[list[Any], Any]:
    """``pytree.tree_flatten(out)``, without its cost for the common results."""
    t = type(out)
    if t is Lazy or t is torch.Tensor:
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
    return pytree.tree_flatten(out)


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
        device = _device(rec)
        obj = _DeviceAnchor(device) if device is not None and device.type != "cpu" else None
        try:
            with _call_programs():
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


# ---------------------------------------------------------------------------- tensor rows
def _rng_states() -> list[torch.Tensor]:
    """The default generators' states: the CPU's, and the current CUDA device's once CUDA
    is initialised.  A recording made once stands for many calls; a random draw made
    eagerly while recording would be shared by all of them, so a change between two of
    these marks such a recording as unusable (see ``_traced`` and ``_compile``)."""
    states = [torch.random.get_rng_state()]
    if torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return states


def _rng_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _rng_restore(states: list[torch.Tensor]) -> None:
    torch.random.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state(states[1])


class _Handle:
    """An output recorded by a :class:`_Trace`: its index in the trace's values."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


class _Untraceable(Exception):
    """A recording on lazy rows that cannot stand for every example (see ``_traced``)."""


class _Trace:
    """What a recorder records into, in place of a Fold, when autobatch records ``fn`` once
    on lazy rows: the calls in order, each with its arguments (handles of earlier outputs, or
    literals made while recording) and the handle of its first output."""

    def __init__(self, inputs: int) -> None:
        self.size = inputs
        self.calls: list[tuple[_Op, tuple[Any, ...], int, int | None]] = []

    def op(self, op: _Op, outputs: int | None) -> Callable[..., Any]:
        """A recorder like ``Fold.op``'s: ``record(*args)`` returns the output handle(s)."""
        calls = self.calls

        def record(*args: Any) -> Any:
            first = self.size
            calls.append((op, args, first, outputs))
            if outputs is None:
                self.size += 1
                return _Handle(first)
            self.size += outputs
            return tuple([_Handle(first + j) for j in range(outputs)])

        return record

    def run(self, inputs: list[torch.Tensor], n: int) -> list[Any]:
        """Every call once, on the whole batch of ``n`` examples, in recording order; the
        values of all handles.  Outputs are checked against the shapes inferred while
        recording (``_Untraceable`` where they differ)."""
        values: list[Any] = [*inputs, *([None] * (self.size - len(inputs)))]
        for op, args, first, outputs in self.calls:
            out = op(*[_batch_value(a, values, n, op, inputs) for a in args])
            outs = (out,) if outputs is None else out
            if len(outs) != len(op.outs):
                raise _Untraceable(f"{op.name} returned {len(outs)} outputs")
            for j, (t, meta) in enumerate(zip(outs, op.outs)):
                if t.shape[:1] != (n,) or t.shape[1:] != meta.shape or t.dtype != meta.dtype:
                    raise _Untraceable(
                        f"{op.name} returned {describe(t.shape, t.dtype)} for {n} examples of "
                        f"{meta}"
                    )
                values[first + j] = t
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
    raise _Untraceable(f"an argument of type {t.__name__}")


def _trace_output(v: Any, values: list[Any], n: int, rec: _Recorder) -> Any:
    """One leaf of ``fn``'s result for all ``n`` examples, as ``_stack`` stacks it."""
    if type(v) is Lazy and v.rec is rec:
        return values[v.node.i]
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


def _record_once(fn: Callable[..., Any], metas: list[_Meta]) -> tuple[_Recorder, _Trace, Any]:
    """``fn`` called once on lazy values of these metas, recorded into a :class:`_Trace`
    (the recording that stands for many calls: a whole batch of tensor rows, or every group
    of a batchable op): ``(recorder, trace, fn's result)``.  Raises what ``fn`` raises (a
    read, an in-place change), and ``_Untraceable`` where ``fn`` drew from torch's random
    generators eagerly, which would share one draw; the random state is then put back, so
    what runs ``fn`` instead draws what eager code draws."""
    trace = _Trace(len(metas))
    rec = _Recorder(trace)
    lazies = [Lazy(_Handle(i), m, rec) for i, m in enumerate(metas)]
    outer = _LOCAL.rec
    _LOCAL.rec = rec
    rng = _rng_states()
    try:
        with collector_paused(), _installed():
            out = fn(*lazies)
        if not _rng_same(rng, _rng_states()):
            raise _Untraceable("the function drew random numbers while recording")
    except Exception:
        _rng_restore(rng)
        raise
    finally:
        _LOCAL.rec = outer
        rec.close()
    return rec, trace, out


def _compile(op: _Op) -> Any:
    """A ``@batchable`` per-example function as a program of the calls it makes, recorded
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
        rec, trace, out = _record_once(op.per_example, [s.meta for s in slots])
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


# (fn's code, or the id of a callable object, and the metas of its rows) of calls that could
# not be traced: they record per example at once (cleared by clear_cache).  A reused id only
# sends another callable the per-example way, which gives the same results.
_UNTRACEABLE: set[tuple[Any, ...]] = set()
_UNTRACEABLE_MAX = 4096


def _traced(fn: Callable[..., Any], iterables: tuple[Any, ...]) -> Any:
    """``autobatch(fn, *iterables)`` by one recording, where every iterable is a tensor: the
    examples are the rows, so ``fn`` sees lazy rows standing for all of them (equal shapes,
    no values it can read) and records the same calls for every example; each runs once on
    the whole batch.  ``_MISS`` where the iterables are not all tensors, or ``fn`` cannot be
    recorded or run this way (it reads a row, changes one in place, returns something else
    than tensors or numbers, ...): autobatch then records per example, which gives the same
    results, or the error that names the example."""
    if not all(isinstance(t, torch.Tensor) and t.ndim for t in iterables):
        return _MISS
    n = min(len(t) for t in iterables)
    metas = [_meta(t.shape[1:], t.dtype, t.device) for t in iterables]
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    key = (id(fn) if code is None else code, *metas)
    if n == 0 or key in _UNTRACEABLE:
        return _MISS
    inputs = [t if len(t) == n else t[:n] for t in iterables]
    try:
        rec, trace, out = _record_once(fn, metas)
    except Exception as err:
        return _untraceable(key, "recording", err)
    leaves, spec = _flatten(out)
    try:
        with _call_programs():
            values = trace.run(inputs, n)
        out = [_trace_output(v, values, n, rec) for v in leaves]
    except Exception as err:
        return _untraceable(key, "running", err)
    return pytree.tree_unflatten(out, spec)


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


def _device(rec: _Recorder) -> torch.device | None:
    """Where the graph's literals go: the device of the recorded calls' parameters (of
    modules called, or shared tensors), else of the tensors made per example."""
    for op, _ in rec.fold.signatures:
        if type(op) is _Op:
            device = _op_device(op)
            if device is not None:
                return device
    return rec.device


def _op_device(op: _Op) -> torch.device | None:
    """The device of an op's shared tensors or of its module's parameters, if it has any."""
    for t in _tensors((op.args, op.kwargs)):
        return t.device
    for x in (op.fn, *op.args):
        if isinstance(x, nn.Module):
            for t in x.parameters():
                return t.device
    return None


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def _explained(err: FoldError) -> FoldError:
    cause = err.__cause__
    if not isinstance(cause, _OpFailed):
        return err
    op, orig = cause.op, cause.__cause__
    shapes = ", ".join(
        describe(v.shape, v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__
        for v in cause.values
    )
    how = {
        _DIRECT: "directly on the stacked values",
        _VMAP: "under torch.func.vmap",
        _BATCHED: "directly (batched=True)",
        _MODELS: "with the models' rows merged",
    }[op.mode]
    return FoldError(
        f"autobatch: {op.name}, recorded at {op.where or '?'}, failed on a group of "
        f"{cause.values[0].shape[0] if cause.values and isinstance(cause.values[0], torch.Tensor) else '?'} "
        f"calls run {how} (stacked arguments {shapes}): {type(orig).__name__}: {orig}. Fix: run "
        "the function eagerly on one example (outside autobatch) to debug it; under vmap, "
        "per-example code must not read values (.item()) or change tensors in place."
    )
