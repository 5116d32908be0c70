"""Recorded ops: one call signature (the function, its argument template with shared values in
place and slots for the batched ones, its per-example outputs) and how a group of its calls
runs on the stacked values (directly, under vmap, as a batched function, with N models'
rows merged, or as the calls a ``@batchable`` function makes)."""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.prune import BasePruningMethod as _PruningMethod
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.nn.utils.spectral_norm import SpectralNorm as _SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm as _WeightNorm
from torch.utils import _pytree as pytree

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
    _in_mode,
)
from fold.autobatch.patches import KEEPS_STATE, STATE_ARGS, _call_module
from fold.autobatch.values import Lazy, _Meta
from fold.errors import FoldError
from fold.ops import (
    PaddedOutputs,
    PaddedRows,
    cut_to,
    mark_zero_past,
    pad_ends,
    version_of,
    zero_past,
)

_LOG = logging.getLogger(__name__)

# The modules of which a call failed under vmap: every call of theirs runs example by example
# (``_Op._run``), in the modes the failures were in (``_Op._verdict``: a batch norm loops in
# training mode, not in eval mode).
_LOOPED_MODULES: weakref.WeakKeyDictionary[nn.Module, set[Any]] = weakref.WeakKeyDictionary()


_HOOKS = torch.nn.modules.module


def _hooked(module: nn.Module) -> bool:
    """Whether a call of ``module`` runs hooks that may read or change the call's values:
    a forward or backward hook of it or of a submodule, or a global module hook, but
    torch's own pre-hooks that make a weight from the module's parameters (spectral and
    weight norm, pruning).  A hook sees one call's values: on a group's call it would see
    every example's at once (``out - out.mean()`` centred over all of them, silently), so
    the module's calls run one per example, as eager code runs them."""
    if (
        _HOOKS._global_forward_hooks
        or _HOOKS._global_forward_pre_hooks
        or _HOOKS._global_backward_hooks
        or _HOOKS._global_backward_pre_hooks
    ):
        return True
    if not module._modules:  # (a leaf module: itself alone, without modules()' walk)
        return _hooks_of(module)
    return any(_hooks_of(m) for m in module.modules())


def _say_hooked(module: nn.Module) -> None:
    """Log, once per module, that its calls run one per example for its hooks."""
    if module not in _SAID_HOOKED:
        _SAID_HOOKED.add(module)
        _LOG.warning(
            "autobatch: %s has hooks (its own, a submodule's, or global module hooks): its "
            "calls run one per example, as eager code runs them, since a hook sees one "
            "call's values",
            type(module).__name__,
        )


_SAID_HOOKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _hooks_of(m: nn.Module) -> bool:
    """Whether module ``m`` itself has hooks ``_hooked`` counts."""
    if m._forward_hooks or m._backward_hooks or m._backward_pre_hooks:
        return True
    pre = m._forward_pre_hooks
    return bool(pre) and not all(isinstance(h, _WEIGHT_HOOKS) for h in pre.values())


_WEIGHT_HOOKS = (_SpectralNorm, _WeightNorm, _PruningMethod)


def _one_value(v: Any) -> bool:
    """Whether ``v``, a group's argument (n first), holds one value in every row and needs
    no gradient: given as that one value, every example's call is its eager call."""
    return (
        type(v) is torch.Tensor
        and v.dim() > 0
        and v.shape[0] > 1  # (a group of one: every argument would be unbatched)
        and not v.requires_grad
        and bool((v == v[:1]).all())
    )


@contextlib.contextmanager
def vmap_quietly() -> Any:
    """torch's warning that vmap runs an op without a batching rule example by example kept
    from the user (for the length of the ``with``): the eager code fold runs raises none."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_VMAP_FALLBACK)
        yield


# The start of that warning.
_VMAP_FALLBACK = "There is a performance drop because we have not yet implemented the batching"


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


# Modules whose forward changes no state of theirs (no running statistics): their shapes
# are inferred on zeros first (see _stateless).
_STATELESS_MODULES = frozenset(
    {
        nn.Linear,
        nn.Bilinear,
        nn.GRU,
        nn.LSTM,
        nn.RNN,
        nn.GRUCell,
        nn.LSTMCell,
        nn.RNNCell,
        nn.LayerNorm,
        nn.Conv1d,
        nn.Conv2d,
        nn.Dropout,
        nn.ReLU,
        nn.Tanh,
        nn.Sigmoid,
        nn.GELU,
        nn.Softmax,
        nn.LogSoftmax,
        nn.Identity,
        nn.Flatten,
    }
)


def _stateless_module(m: nn.Module) -> bool:
    t = type(m)
    if t in _STATELESS_MODULES:
        return True
    if t is nn.Embedding or t is nn.EmbeddingBag:
        return m.max_norm is None
    # Any other module of torch.nn's own (its exact type) but those that change a tensor of
    # theirs when called (running statistics; a lazy module's parameters, made on its first
    # call from the random stream), whose submodules are all stateless: nn.Sequential, a
    # transformer layer (nn.MultiheadAttention, nn.LayerNorm, nn.Dropout), a pooling.
    if not t.__module__.startswith("torch.nn.modules.") or issubclass(t, KEEPS_STATE):
        return False
    return all(_stateless_module(c) for c in m.children())


class _Changed(Exception):
    """A group's call under vmap changed a buffer of its module (undone: see ``_Buffers``)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class _Buffers:
    """The buffers of a module call's module and its submodules, by owner and name (a forward
    may rebind one), for a module that may change them when called: not one of torch.nn's
    stateless modules (``_stateless_module``).

    A group's call under vmap runs the module once for all its examples, so a change it
    makes to a buffer (BatchNorm's running statistics and call count in training mode, a
    counter of one's own) would happen once, not once per example as in eager code; a call
    that fails under vmap (BatchNorm in training mode) may have made one before it failed;
    and shape inference runs the module on zeros where fake tensors cannot.  ``guarded``
    runs such a call from a copy of the buffers and undoes what it changed; ``kept`` puts
    them back after a call that must change nothing."""

    __slots__ = ("clean", "slots")

    def __init__(self, slots: list[tuple[nn.Module, str]]) -> None:
        self.slots = slots
        # The training flags of the owners under which a batched call changed nothing: its
        # later calls so are checked (identity and version of each buffer), not copied.
        self.clean: set[tuple[bool, ...]] = set()

    @staticmethod
    def of(op: Any) -> _Buffers | None:
        """The buffers ``op``, a call, may change; None for a call that can change none."""
        module = op.fn
        if op.kind == "torch":  # a function given what it changes (patches.STATE_ARGS)
            at = STATE_ARGS.get(op.fn)
            if at is None:
                return None
            module = op.args[at]
        elif op.kind != "module" or not isinstance(module, nn.Module):
            return None
        elif _stateless_module(module):
            return None
        slots: list[tuple[nn.Module, str]] = []
        _buffer_slots(module, 0, slots)
        return _Buffers(slots) if slots else None

    def key(self) -> tuple[bool, ...]:
        return tuple([m.training for m, _ in self.slots])

    def marks(self) -> list[tuple[Any, int | None]]:
        out = []
        for m, name in self.slots:
            b = m._buffers.get(name)
            out.append((b, None if b is None else version_of(b)))
        return out

    def copy(self) -> list[tuple[Any, int | None, Any]]:
        """The buffers now: per slot (the tensor, its version, a copy of its value)."""
        with torch.no_grad():
            return [(b, v, None if b is None else b.clone()) for b, v in self.marks()]

    def changed(self, marks: list[tuple[Any, int | None]], copy: Any = None) -> str | None:
        """The name of a buffer changed since ``marks`` (rebound, or changed in place); one
        without a version counter (an inference tensor) is compared with ``copy``."""
        for i, ((m, name), (b, v)) in enumerate(zip(self.slots, marks)):
            now = m._buffers.get(name)
            if now is not b:
                return name
            if b is None:
                continue
            if v is None:
                if copy is not None and not torch.equal(b, copy[i][2]):
                    return name
            elif b._version != v:
                return name
        return None

    def restore(self, copy: list[tuple[Any, int | None, Any]]) -> None:
        """The buffers put back as ``copy`` holds them (their own tensors, their values)."""
        for (m, name), (b, v, value) in zip(self.slots, copy):
            if m._buffers.get(name) is not b:
                m._buffers[name] = b
            if b is None or (v is not None and b._version == v):
                continue
            with torch.inference_mode() if b.is_inference() else torch.no_grad():
                b.copy_(value)

    @contextlib.contextmanager
    def kept(self) -> Any:
        """The body's changes to the buffers undone (shape inference, vmap's trial)."""
        copy = self.copy()
        try:
            yield
        finally:
            self.restore(copy)

    def guarded(self, op: Any, run: Callable[..., Any], *args: Any) -> Any:
        """``run(*args)``, a group's one call of ``op``: where it changes a buffer, the
        change undone and ``_Changed`` raised; where it raises, what it changed undone.  A
        copy is taken while the call is not known to change nothing under the owners'
        training flags; after that, a change is a FoldError (it cannot be undone)."""
        key = self.key()
        copy = None if key in self.clean else self.copy()
        marks = self.marks()
        try:
            out = run(*args)
        except BaseException:
            if copy is not None:
                self.restore(copy)
            raise
        name = self.changed(marks, copy)
        if name is None:
            self.clean.add(key)
            return out
        if copy is None:
            raise FoldError(
                f"autobatch: {op.name} at {op.where or '?'} changed its buffer {name!r} in a "
                "batched call, where its earlier calls in this training mode changed none; a "
                "batched call changes it once for all examples, not once per example as eager "
                "code does. Fix: change buffers in every call or in none (a flag of the "
                "module's own decides here), or change them outside the module's forward."
            )
        self.restore(copy)
        raise _Changed(name)


def _buffer_slots(m: nn.Module, depth: int, out: list[tuple[nn.Module, str]]) -> None:
    # (Walked by hand, as recorder._find_random: a module's own __hash__ may do anything.)
    for name in m._buffers:
        out.append((m, name))
    if depth < 32:
        for c in m._modules.values():
            if c is not None:
                _buffer_slots(c, depth + 1, out)


_LOSSES = {F.cross_entropy, F.nll_loss}


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
        # The arguments that vmap takes unbatched (one value in every example; set where
        # vmap fails on them batched, see _run), and its functions per such pattern.
        self.shared: tuple[int, ...] = ()
        self._shared_vmaps: dict[tuple[Any, ...], Callable[..., Any]] = {}
        # Set once a group of it could not run under vmap: its groups run one call per
        # example (see _run), in every mode (True) or in one (see _verdict).
        self.looped: Any = False
        # The buffers a group's call may change (``_Buffers``; None: none), found once
        # (``buffers``).
        self._state: Any = _MISS
        # The grad/autocast mode the calls were recorded in (see _current_mode), None for the
        # usual one; a group runs in it (a target network under torch.no_grad(), a region
        # under torch.autocast).
        self.recorded_in: tuple[Any, ...] | None = None
        # The op the node is recorded as: itself, or for an RNN over one unbatched sequence
        # the first op of its sequence group (the same call on sequences of another length,
        # see ``recorder._group_sequences``), whose groups then hold every length and run
        # as one packed call (``padded_call``, which fold's executor calls with the parts of
        # a group, one part per length).
        self.fold_op: _Op = self
        self.padded_call: Callable[[list[tuple[Any, ...]]], list[Any]] | None = None
        # A group op of calls on values of several shapes (see recorder._group_padded): how
        # its parts are padded (tables._PADDED) and the op's dim (None: no dim), and per
        # part's per-example argument shapes, its outputs' shapes.
        self.padding: tuple[str, int | None] | None = None
        # and, set with it, the call of a whole group whose rows are PaddedRows (_ragged)
        self.ragged_call: Callable[[list[Any]], tuple[Any, ...] | None] | None = None
        # A torch.nn transformer module's call as one merged call (tables._Transformer).
        self.transformer: Any = None
        # The leaves of a module call's result that are None beside its tensors (an
        # attention's weights not asked for), set by shape inference: its calls give their
        # tensors alone, its values have the Nones back in place (see _wrapper).
        self.none_at: tuple[int, ...] = ()
        self.part_outs: dict[tuple[Any, ...], tuple[torch.Size, ...]] = {}
        self.ragged_outs: dict[Any, Any] = {}  # see _ragged_outs
        # Whether a call draws random numbers (set by shape inference): each call is then a
        # node of its own (see recorder._record_fresh and variant).
        self.random = False
        # The modules inside a module call that draw in training mode, where none was
        # training when it was first recorded: the call is random while one of them is.
        self.random_modules: tuple[nn.Module, ...] = ()
        # Whether an output shares memory with an argument in eager code (a view: x[0],
        # x.view(...), x.detach(); or the argument itself: nn.Identity, x.contiguous()), set
        # by shape inference: its calls are logged (recorder ``views``), so that an
        # in-place change of a value shared with another one in use is refused
        # (buffers.write_lazy).
        self.aliases = False
        self._variant: _Op | None = None
        self.vmap_checked = False  # (see _vmap_holds)

    def variant(self) -> _Op:
        """A copy of this op, grouped apart from it (fold groups ops by identity), made
        once: a random call on the same arguments as an earlier call of this op is recorded
        as a variant, so that it draws its own numbers.  It runs its groups on its own, not
        as part of another op's padded or packed group."""
        if self._variant is None:
            v = copy.copy(self)
            v.fold_op, v._variant = v, None
            v.padded_call = v.ragged_call = v.padding = None
            v.part_outs, v.ragged_outs = {}, {}
            v._vmapped, v._shared_vmaps = None, {}
            v._state = _MISS
            self._variant = v
        return self._variant

    def __repr__(self) -> str:
        return f"<autobatch op {self.__qualname__}>"

    # -------------------------------------------------------------- per example
    def per_example(self, *values: Any) -> Any:
        args, kwargs = _fill((self.args, self.kwargs), values)
        if self.none_at:  # (its tensors alone: see none_at)
            leaves = pytree.tree_leaves(self.call(*args, **kwargs))
            return tuple([t for t in leaves if t is not None])
        return self.call(*args, **kwargs)

    def __call__(self, *values: Any) -> Any:
        run = self._loop if self._hooked() else self._run
        out = self._recorded(run, values, values)
        if self.single:
            return out
        return tuple(pytree.tree_leaves(out))

    def _hooked(self) -> bool:
        """Whether the op is a call of a module with hooks (``_hooked``): its groups run one
        call per example, on every path (said once per module)."""
        if self.kind == "module" and _hooked(self.fn):
            _say_hooked(self.fn)
            return True
        return False

    def _recorded(self, run: Callable[[Any], Any], arg: Any, values: Any) -> Any:
        """``run(arg)`` in the grad/autocast mode the calls were recorded in; what it raises
        as an ``_OpFailed`` carrying ``values`` (a group's, or its first part's)."""
        try:
            mode = self.recorded_in or _USUAL_MODE
            if not mode[1] and mode[0] == torch.is_grad_enabled() and not _any_autocast():
                return run(arg)  # the mode on now is the one recorded in
            with _in_mode(mode):
                return run(arg)
        except Exception as err:
            raise _OpFailed(self, values) from err

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
        if mode is _RNN:
            return self._rnn(values)
        if self.kind is _PER_EXAMPLE or (
            self.kind == "module" and not self.shared and self.buffers() is None
        ):
            # (a module of one's own recorded whole: its forward recorded once for the
            # group's rows too, each call run on the batch, where vmap would run them all
            # with its per-op cost; a module whose buffers may change keeps vmap's guard)
            programs = _LOCAL.programs
            if programs is None:  # not inside an autobatch call's run: for this group only
                programs = {}
            program = programs.get(self)
            if program is None:
                program = programs[self] = HOOKS.compile(self)
            if program is not False:
                try:
                    return program(values)
                except Exception as err:  # vmap gives the same values, or the error
                    programs[self] = False
                    _LOG.debug("autobatch: %s recorded once failed (%s); vmap runs it", self, err)
        self.buffers()
        looped = self.looped
        if looped is not False and (looped is True or looped == self._verdict()):
            return self._loop(values)
        if self.kind == "module":
            modes = _LOOPED_MODULES.get(self.fn)
            if modes is not None and (True in modes or self._verdict() in modes):
                # (another call of the module, other shapes: see below)
                self.looped = self._verdict()
                return self._loop(values)
        if self.shared:
            try:
                out = self._vmap_shared(values, self.shared)
            except _Changed as changed:
                return self._changes(values, changed)
            return self._loop(values) if out is _MISS else out
        if self._vmapped is None:
            self._vmapped = torch.func.vmap(self.per_example, randomness="different")
        try:
            with vmap_quietly():
                if self._state is None:
                    out = self._vmapped(*values)
                    if self.vmap_checked or self._vmap_holds(values, out):
                        return out
                    out = self._loop(values)
                    self._looped()
                    _LOG.warning(
                        "autobatch: %s under torch.func.vmap gives outputs of other shapes "
                        "than one call of it; its groups run one call per example",
                        self,
                    )
                    return out
                return self._state.guarded(self, self._vmapped, *values)
        except _Changed as changed:
            return self._changes(values, changed)
        except FoldError:
            raise
        except Exception as err:
            if self.kind is _PER_EXAMPLE:
                raise  # a @batchable body runs batched: a read in it stays an error
            # An argument that holds one value in every example (a transformer decoder's
            # causal mask, made alike by each example, which the module compares by value:
            # a read under vmap) may run unbatched, as one value: vmap then runs.
            shared = tuple(j for j, v in enumerate(values) if _one_value(v))
            out = _MISS
            if shared:
                try:
                    out = self._vmap_shared(values, shared)
                except Exception:
                    out = _MISS
            if out is not _MISS:
                self.shared = shared
                return out
            if len(values) and type(values[0]) is torch.Tensor and len(values[0]) == 1:
                return self._loop(values)  # (a group of one: its call, and no verdict)
            # vmap cannot run this torch function or module (an op with no batching rule, a
            # read of a value inside a module): one call per example, as eager code runs it.
            # Where that fails too, its error is the user's, and it is raised.
            out = self._loop(values)
            self._looped()
            _LOG.warning(
                "autobatch: %s does not run under torch.func.vmap (%s: %s); its groups run one "
                "call per example",
                self,
                type(err).__name__,
                str(err).split("\n")[0],
            )
            return out

    def _vmap_holds(self, values: tuple[Any, ...], out: Any) -> bool:
        """Whether ``out``, the op's first group's result under vmap, has the shapes and
        dtypes of one call of it on the group's first example (checked once per op, but for
        random ops, whose extra call would draw numbers): a batching rule of torch's that
        gives another shape (``torch.argmax(h, keepdim=True)`` gave ``(n, 1)`` for per-example
        matrices, where one call gives ``(1, 1)``) would be a silent wrong result."""
        self.vmap_checked = True
        if self.random or self.random_modules:
            return True
        try:
            with torch.no_grad():
                one = self.per_example(*[v[0] for v in values])
        except Exception:  # (vmap ran it: its values stand)
            return True
        mine, theirs = pytree.tree_leaves(out), pytree.tree_leaves(one)
        return len(mine) == len(theirs) and all(
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape[1:] == b.shape
            and a.dtype == b.dtype
            for a, b in zip(mine, theirs)
        )

    def buffers(self) -> _Buffers | None:
        """The buffers the op's calls may change (``_Buffers``; None: none), found once."""
        if self._state is _MISS:
            self._state = _Buffers.of(self)
        return self._state

    def _verdict(self) -> Any:
        """The mode a verdict that the op's groups loop holds in: for a module with buffers,
        its buffers' owners' training flags (a batch norm cannot run under vmap in training
        mode, and can in eval mode); else True, every mode."""
        return True if self._state is None or self._state is _MISS else self._state.key()

    def _looped(self) -> None:
        """The verdict: the op's groups loop in this mode, and so do the module's calls on
        other shapes (other ops: a decoder's growing prefix, a round each), without trying
        vmap again, or saying so again."""
        mode = self._verdict()
        self.looped = mode
        if self.kind == "module":
            modes = _LOOPED_MODULES.get(self.fn)
            if modes is None:
                modes = _LOOPED_MODULES[self.fn] = set()
            modes.add(mode)

    def _changes(self, values: tuple[Any, ...], changed: _Changed) -> Any:
        """The group of a module that changed a buffer when called (running statistics; the
        change undone): one call per example, each on what the one before left, as eager
        code runs them; so every later call of the module."""
        self._looped()
        _LOG.warning(
            "autobatch: %s changes its buffer %r when called; its groups run one call per "
            "example, as eager code runs them",
            self,
            changed.name,
        )
        return self._loop(values)

    def _vmap_shared(self, values: tuple[Any, ...], shared: tuple[int, ...]) -> Any:
        """The group under vmap with the arguments at ``shared`` given unbatched, as their
        first row, where each holds one value in every row (``_one_value``); ``_MISS``
        where one does not (the caller runs the group one call per example)."""
        if not all(_one_value(values[j]) for j in shared):
            return _MISS
        dims = tuple(None if j in shared else 0 for j in range(len(values)))
        run = self._shared_vmaps.get(dims)
        if run is None:
            run = torch.func.vmap(self.per_example, in_dims=dims, randomness="different")
            self._shared_vmaps[dims] = run
        args = [v[0] if d is None else v for v, d in zip(values, dims)]
        with vmap_quietly():
            return run(*args) if self._state is None else self._state.guarded(self, run, *args)

    def _loop(self, values: tuple[Any, ...]) -> Any:
        """The group's calls one by one, each on its example's values, outputs stacked."""
        outs = [self.per_example(*[v[i] for v in values]) for i in range(len(values[0]))]
        leaves = [pytree.tree_flatten(o) for o in outs]
        spec = leaves[0][1]
        stacked = [torch.stack([lv[0][j] for lv in leaves]) for j in range(len(leaves[0][0]))]
        return pytree.tree_unflatten(stacked, spec)

    def _rnn(self, values: tuple[Any, ...]) -> Any:
        """A group of nn.RNN/GRU/LSTM calls on unbatched sequences (L, D), all of one length:
        the stacked (n, L, D) run as one batch (time-major unless the module is batch
        first), states (layers, H) stacked as (layers, n, H); outputs back per example."""
        args, _ = _fill((self.args, self.kwargs), values)
        x, hx = args[0], args[1] if len(args) > 1 else None
        first = self.fn.batch_first
        if hx is not None:
            hx = (
                tuple(h.transpose(0, 1).contiguous() for h in hx)
                if type(hx) in (tuple, list)
                else hx.transpose(0, 1).contiguous()
            )
        out, h = self.call(x if first else x.transpose(0, 1), hx)
        h = tuple(t.transpose(0, 1) for t in h) if type(h) is tuple else h.transpose(0, 1)
        return out if first else out.transpose(0, 1), h

    def _packed_parts(self, parts: list[tuple[Any, ...]]) -> list[tuple[torch.Tensor, ...]]:
        """``padded_call`` of an RNN's sequence group: the parts of a group (per part its
        stacked sequences (n, L, D), all of one length, and states) as ONE call: the
        sequences padded to the longest and packed (as hand-batched code runs an encoder),
        states in the same order; per part its outputs, cut back to its length."""
        if self._hooked():  # (one call per example)
            return [self(*values) for values in parts]
        return self._recorded(self._packed, parts, parts[0])

    def _packed(self, parts: list[tuple[Any, ...]]) -> list[tuple[torch.Tensor, ...]]:
        filled = [_fill((self.args, self.kwargs), values)[0] for values in parts]
        xs = [args[0] for args in filled]
        sizes = [x.shape[0] for x in xs]
        lengths = [x.shape[1] for x, k in zip(xs, sizes) for _ in range(k)]
        if not lengths or min(lengths) == 0:  # (pack refuses empty sequences)
            return [tuple(pytree.tree_leaves(self._rnn(values))) for values in parts]
        longest = max(lengths)
        # The parts of an earlier padded call (an embedding of the sequences) as that call
        # left them; what lies past a sequence's length is never read (packed).
        x = _tiled_base(xs, [sum(sizes), longest, *xs[0].shape[2:]])
        if type(x) is _Padded:
            x = x.base
        elif x is None:
            x = torch.cat([F.pad(x, (0, 0, 0, longest - x.shape[1])) for x in xs])
        states = None
        if len(filled[0]) > 1 and filled[0][1] is not None:  # states (n, layers, H) per part
            per_part = [a[1] if type(a[1]) in (tuple, list) else (a[1],) for a in filled]
            states = tuple(torch.cat([s[j] for s in per_part]) for j in range(len(per_part[0])))
            if type(filled[0][1]) not in (tuple, list):
                states = states[0]
        # The final states, of one shape for every part: one output of all the parts' rows.
        out, hs = self._run_packed(x, lengths, states)
        seqs, start = [], 0
        for x, k in zip(xs, sizes):
            seqs.append(out[start : start + k, : x.shape[1]])
            start += k
        return PaddedOutputs([seqs, *hs])

    def _packed_ragged(self, values: list[Any]) -> tuple[Any, ...] | None:
        """``ragged_call`` of an RNN's sequence group: a whole group whose sequences arrive
        as ``PaddedRows`` (an embedding of each example's tokens, run as one padded call) as
        ONE packed call, as ``_packed`` runs a group's parts, with no parts: the outputs as
        ``PaddedRows`` of the same lengths (zeros past each), the final states one tensor.
        None where the sequences are no ``PaddedRows`` along their time dim, a state is, or
        a sequence is empty (pack refuses it): the caller then runs the group in parts."""
        if self._hooked():
            return None
        return self._recorded(
            self._packed_rows, values, [v.data if type(v) is PaddedRows else v for v in values]
        )

    def _packed_rows(self, values: list[Any]) -> tuple[Any, ...] | None:
        args, _ = _fill((self.args, self.kwargs), values)
        x = args[0]
        if type(x) is not PaddedRows or x.dims != (1,) or x.data.dim() != 3:
            return None
        states = args[1] if len(args) > 1 else None
        parts = states if type(states) in (tuple, list) else (states,)
        if any(type(s) is PaddedRows for s in parts) or any(
            type(a) is PaddedRows for a in args[2:]
        ):
            return None
        lengths = x.lengths
        if not len(lengths) or int(lengths.min()) == 0:
            return None
        out, hs = self._run_packed(x.data, lengths.tolist(), states)
        return (PaddedRows(out, 1, lengths, zero=True), *hs)

    def _run_packed(
        self, x: torch.Tensor, lengths: list[int], states: Any
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The RNN on ``x`` (n, L, D), padded batch first, packed by ``lengths``, from
        ``states`` (None, or (n, layers, H), a tuple or list of them where the module takes
        several): its outputs padded batch first, and its final states (n, layers, H).
        The outputs batch first in memory (pad_packed_sequence gives a transposed view):
        each example's are then rows of it in order, which later padded calls read in place
        (``_tiled_base``), its zero padding known (``_zero_past``)."""
        packed = pack_padded_sequence(
            x, torch.tensor(lengths), batch_first=True, enforce_sorted=False
        )
        hx = None
        if states is not None:
            several = type(states) in (tuple, list)
            hx = tuple(s.transpose(0, 1).contiguous() for s in (states if several else (states,)))
            if not several:
                hx = hx[0]
        out, h = self.call(packed, hx)
        out = pad_packed_sequence(out, batch_first=True, total_length=max(lengths))[0].contiguous()
        mark_zero_past(out, 1, lengths)
        hs = h if type(h) is tuple else (h,)
        return out, [t.transpose(0, 1) for t in hs]

    def _padded_parts(self, parts: list[tuple[Any, ...]]) -> list[tuple[torch.Tensor, ...]]:
        """``padded_call`` of a group op (``padding`` set): the parts of a group, each of one
        shape (attention scores over memories of one length), as ONE call on the values
        padded to the largest shape (``tables._PADDED`` says with what); per part its
        outputs cut back to its shapes."""
        if self._hooked():
            return [_outputs(self(*values)) for values in parts]
        return self._recorded(self._pad_run, parts, parts[0])

    def _pad_run(self, parts: list[tuple[Any, ...]]) -> list[tuple[torch.Tensor, ...]]:
        shapes = [tuple(tuple(v.shape[1:]) for v in values) for values in parts]
        outs = [self.part_outs.get(key) for key in shapes]
        columns = [[values[j] for values in parts] for j in range(len(parts[0]))]
        bigs = [
            [max(v.shape[d] for v in column) for d in range(column[0].dim())] for column in columns
        ]
        held = sum(v.numel() for column in columns for v in column)
        padded_size = sum(
            v.shape[0] * math.prod(big[1:]) for column, big in zip(columns, bigs) for v in column
        )
        how, dim = self.padding  # type: ignore[misc]
        if (
            any(o is None for o in outs)
            or not _worth_padding(held, padded_size, len(parts))
            or (how == "split" and _differ_in(columns[0], dim))  # (see _ragged_run)
        ):
            return [_outputs(self._run(values)) for values in parts]
        merged = []
        for j, (column, big) in enumerate(zip(columns, bigs)):
            fill = _REDUCED_FILL.get(how) if j == 0 and dim is not None else None
            d = _batched_dim(dim, column[0]) if fill else -1  # the op's dim, past the batch
            base = _tiled_base(column, big)
            if base is not None:  # the parts of an earlier padded call, in its order
                if type(base) is _Padded:  # (-inf past the values along softmax's dim)
                    base = base.fill(fill(base.base.dtype) if base.dim == d else 0)
                merged.append(base)
                continue
            padded = []
            for v in column:
                short = [b - n for b, n in zip(big, v.shape)]
                if fill:
                    cut, short[d] = short[d], 0
                    v = pad_ends(v, short, 0.0)
                    short = [0] * v.dim()
                    short[d] = cut
                    v = pad_ends(v, short, fill(v.dtype))
                else:
                    v = pad_ends(v, short, 0.0)
                padded.append(v)
            merged.append(torch.cat(padded))
        out = self._run(tuple(merged))
        if how == "mean":  # a mean over the padded length: rescaled to each part's own
            d = _batched_dim(dim, parts[0][0])  # type: ignore[arg-type]
            scale = [
                merged[0].shape[d] / v[0].shape[d] for v in parts for _ in range(v[0].shape[0])
            ]
            out = out * torch.tensor(scale, dtype=out.dtype, device=out.device).view(
                -1, *[1] * (out.dim() - 1)
            )
        # (max and min along a dim: values and indices, each cut as the values are)
        first = outs[0][0]
        if all(shape[0] == first for shape in outs):
            # One output shape for every part (a context vector read from memories of several
            # lengths): one output of all the parts' rows.
            cut = (slice(None), *[slice(0, n) for n in first])
            return PaddedOutputs([t if t.shape[1:] == first else t[cut] for t in _outputs(out)])
        # Each part's rows split off first, then cut to its shape: the backward of a cut of
        # the whole output (rows and dims at once) makes a gradient of the whole output's
        # size per part; a split's makes one for all the parts.
        sizes = [values[0].shape[0] for values in parts]
        results: list[list[torch.Tensor]] = []
        for t in _outputs(out):
            pieces = t.split(sizes)
            results.append(
                [
                    piece
                    if piece.shape[1:] == shape[0]
                    else piece[(slice(None), *map(slice, shape[0]))]
                    for piece, shape in zip(pieces, outs)
                ]
            )
        return PaddedOutputs(results)

    def _ragged(self, values: list[Any]) -> tuple[Any, ...] | None:
        """A whole group of a padding op (``padding`` set) whose columns hold rows of
        several lengths as ``PaddedRows`` (an earlier ragged group's output, or literal
        memories padded together): ONE call on the padded values, with no parts, as
        ``_pad_run`` runs a group's parts.  Its output a tensor where every row's output has
        one shape (a context vector), else ``PaddedRows`` (attention scores).  None where
        the rows' shapes were not all recorded, their outputs differ in more than one dim,
        or padding would more than double the values: the caller then runs the group in
        parts."""
        if self._hooked():
            return None
        return self._recorded(
            self._ragged_run, values, [v.data if type(v) is PaddedRows else v for v in values]
        )

    def _ragged_run(self, values: list[Any]) -> tuple[Any, ...] | None:
        # Each column of rows padded to its own longest: rows taken from a group whose
        # other rows were longer (a ReLU of sequences and of their convolution, one padded
        # call) keep that group's padding, which another column of the same rows lacks.
        values = [_tight(v) if type(v) is PaddedRows else v for v in values]
        ragged = [j for j, v in enumerate(values) if type(v) is PaddedRows]
        shapes: list[Any] = [
            list(v.data.shape[1:]) if type(v) is PaddedRows else tuple(v.shape[1:]) for v in values
        ]
        how, dim = self.padding  # type: ignore[misc]
        if how == "split":  # (pieces along a dim the values differ in: not their pieces)
            first = values[0]
            if type(first) is PaddedRows and _batched_dim(dim, first.data) in first.dims:
                return None
        combos, inv = _combinations([values[j].lengths for j in ragged])
        held = padded = 0
        for j in ragged:
            v = values[j]
            shape = v.data.shape
            per_step = math.prod(shape[1:]) // math.prod([shape[d] for d in v.dims])
            held += int((v.lengths ** len(v.dims)).sum()) * per_step
            padded += v.data.numel()
        if not _worth_padding(held, padded, len(combos)):
            return None
        # Per combination its output's shape (as recorded), once per op and combinations.
        dims = tuple([values[j].dims for j in ragged])
        known = (tuple(map(tuple, shapes)), tuple(ragged), dims, tuple(combos))
        found = self.ragged_outs.get(known)
        if found is None:
            found = self._ragged_outs(values, ragged, shapes, combos)
            if found is None:  # (not kept: the shapes may be recorded later)
                return None
            if len(self.ragged_outs) > 64:
                self.ragged_outs.clear()
            self.ragged_outs[known] = found
        varying, big, out_lengths = found
        merged = []
        as_is = self.fn in _POSITIONWISE
        for j, v in enumerate(values):
            if type(v) is not PaddedRows:
                merged.append(v)
                continue
            if as_is:  # (what lies past a row's length stays there: see _POSITIONWISE)
                merged.append(v.data)
                continue
            fill = _REDUCED_FILL.get(how) if j == 0 else None
            d = _batched_dim(dim, v.data) if fill else -1
            # (several ragged dims: the reduction's fill past the length along its dim,
            # zeros past it in the others alone; see PaddedRows.filled)
            merged.append(v.filled(fill(v.data.dtype), d) if d in v.dims else v.filled(0))
        out = self._run(tuple(merged))
        if how == "mean":  # a mean over the padded length: rescaled to each row's own
            v = values[0]
            d = _batched_dim(dim, merged[0])  # type: ignore[arg-type]
            if type(v) is PaddedRows and d in v.dims:
                scale = torch.from_numpy(v.data.shape[d] / v.lengths).to(out.device, out.dtype)
                out = out * scale.view(-1, *[1] * (out.dim() - 1))
        cut = (slice(None), *[slice(0, n) for n in big])  # (max and min: values and indices)
        outs = [t if list(t.shape[1:]) == big else t[cut] for t in _outputs(out)]
        if varying is None:
            return tuple(outs)
        lengths = out_lengths[inv]
        dims_out = tuple([k + 1 for k in varying])
        # A softmax along the one ragged dim, of rows that each hold a value, is exactly 0
        # past each length (exp(-inf)): said so, a product with it (attention's weights @
        # memory) takes it as it is, not filled with zeros again.  Only outside autograd:
        # there that fill also keeps a nan of a later op's gradient off the padding.
        zero = (
            self.fn in _SOFTMAXES
            and not outs[0].requires_grad
            and len(ragged) == 1
            and values[ragged[0]].dims == dims_out
            and type(dim) is int
            and _batched_dim(dim, merged[0]) in dims_out
            and bool(lengths.min() > 0)
        )
        return tuple([PaddedRows(t, dims_out, lengths, zero) for t in outs])

    def _ragged_outs(
        self, values: list[Any], ragged: list[int], shapes: list[Any], combos: list[tuple[int, ...]]
    ) -> Any:
        """Per combination of the rows' lengths, the output's recorded shape: ``(the dims it
        differs in (None: none), the largest shape, per combination its length in those
        dims)``; None where a combination was not recorded, or outputs differ in dims of
        lengths of their own (scores of queries and keys of two lengths: (m, n))."""
        outs = []
        for combo in combos:
            key = list(shapes)
            for j, n in zip(ragged, combo):
                s = list(shapes[j])
                for d in values[j].dims:
                    s[d - 1] = n
                key[j] = tuple(s)
            got = self.part_outs.get(tuple(key))
            if got is None:
                return None
            outs.append(tuple(got[0]))
        first = outs[0]
        if any(len(o) != len(first) for o in outs):
            return None
        varying = [k for k in range(len(first)) if any(o[k] != first[k] for o in outs)]
        if any(o[k] != o[varying[0]] for o in outs for k in varying[1:]):
            return None  # (dims of lengths of their own: a query's and a memory's)
        big = [max(o[k] for o in outs) for k in range(len(first))]
        if not varying:
            return None, big, None
        return varying, big, np.array([o[varying[0]] for o in outs], np.int64)

    def _models(self, values: tuple[Any, ...]) -> Any:
        """A BatchModule call: per example (N, b, ...) values; the group's (n, N, b, ...)
        become (N, n * b, ...), one call, and back."""
        n = values[0].shape[0]
        if n > 1 and not self.fn.rows_kept("forward", *[v[0] for v in values]):
            # Code that may mix the rows of a batch (or not yet seen): one call per example
            # (its first call finds which).
            outs = [self.per_example(*[v[i] for v in values]) for i in range(n)]
            return pytree.tree_map(lambda *ts: torch.stack(ts), *outs)
        merged = [v.movedim(0, 1).flatten(1, 2) for v in values]
        out = self.per_example(*merged)
        return pytree.tree_map(lambda t: t.unflatten(1, (n, -1)).movedim(1, 0), out)


# What a call per part costs beyond its values, in elements of padding that cost as much
# (torch's dispatch of the part's call and of its backward, fold's cut of the part and its
# place in the output: 20-40 us a part on a CPU, where 16384 floats' ReLU takes 5-10 us).
_PART_ELEMENTS = 16384


def _worth_padding(held: int, padded: int, parts: int) -> bool:
    """Whether ONE call on values padded to ``padded`` elements costs less than a call per
    part on the ``held`` elements they hold: where the padding adds no more than the values
    hold, plus what the calls per part would cost beyond their values.  One memory far
    longer than the others (a few parts, mostly padding) runs per part; graphs of 5-29
    nodes, adjacency (n, n) in 24 parts, pad (twice the values, against 24 calls)."""
    return padded <= 2 * held + _PART_ELEMENTS * parts


def _outputs(out: Any) -> tuple[torch.Tensor, ...]:
    """A call's output as the tuple of its tensors (pieces of a split, max's values and
    indices: several)."""
    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


def _differ_in(column: list[torch.Tensor], dim: int) -> bool:
    """Whether the per-example values of ``column`` (batch dim first) differ in their
    ``dim``."""
    d = _batched_dim(dim, column[0])
    return any(v.shape[d] != column[0].shape[d] for v in column)


def _batched_dim(dim: int, batched: Any) -> int:
    """A per-example dim (negative ones counted from the end) as the dim of ``batched``, a
    tensor of the group's values with the batch dim first."""
    return dim % (batched.dim() - 1) + 1


def _tight(v: PaddedRows) -> PaddedRows:
    """``v`` padded to its longest row alone (cut where it holds more padding)."""
    n = int(v.lengths.max()) if len(v.lengths) else 0
    if all(v.data.shape[d] == n for d in v.dims):
        return v
    return PaddedRows(cut_to(v.data, v.dims, n), v.dims, v.lengths, v.zero)


def _tiled_base(column: list[torch.Tensor], big: list[int]) -> Any:
    """The padded tensor of a column of parts, where the parts are views that tile one
    tensor row after row, as an earlier padded call left its outputs (``_pad_run``, a packed
    RNN's): that tensor, its padding filled as padding this column would fill it (one
    ``masked_fill`` where one dim of the values differs, none where none does, or where the
    padding holds zeros already, see ``_zero_past``), instead of a pad per part and their
    cat.  Parts of a view of that tensor (scores squeezed out of a matmul's output) are read
    through a strided view of it, where no gradient is needed.  None for any other column
    (or where several dims differ)."""
    first = column[0]
    b = first._base
    if b is None or first.dim() != len(big):
        return None
    stride, start, rows = first.stride(), first.storage_offset(), 0
    for v in column:
        if (
            v._base is not b
            or v.stride() != stride
            or v.storage_offset() != start + rows * stride[0]
        ):
            return None
        rows += v.shape[0]
    varying = [k for k in range(1, len(big)) if any(v.shape[k] != big[k] for v in column)]
    if len(varying) > 1:
        return None
    whole = (
        b.dim() == len(big)
        and list(b.shape[1:]) == big[1:]
        and b.stride() == stride
        and b.storage_offset() == start
    )
    if whole:
        base = b if rows == b.shape[0] else b.narrow(0, 0, rows)
    else:
        last = (
            start + (rows - 1) * stride[0] + sum((n - 1) * x for n, x in zip(big[1:], stride[1:]))
        )
        if (
            (b.requires_grad and torch.is_grad_enabled())
            or min(stride) < 0
            or last >= b.untyped_storage().nbytes() // b.element_size()
        ):
            return None
        base = b.as_strided((rows, *big[1:]), stride, start)
    if not varying:
        return base
    k = varying[0]
    padded = _Padded(base, column, k, big[k])
    padded.zero = whole and _zero_past(b, column, k)
    return padded


def _zero_past(b: torch.Tensor, column: list[torch.Tensor], k: int) -> bool:
    """Whether the column's parts, which tile ``b`` row after row, each end in dim ``k``
    where its rows' values end and zeros begin: ``b`` marked so (``fold.ops.zero_past``: a
    packed RNN's padded outputs, literal sequences padded together).  A part cut shorter
    than its rows' values (a user's slice of them) would leave values in the padding: False
    then."""
    known = zero_past(b)
    if known is None or known[0] != k:
        return False
    lengths, row = known[1], 0
    for v in column:
        n = v.shape[0]
        if any(x != v.shape[k] for x in lengths[row : row + n]):
            return False
        row += n
    return True


class _Padded:
    """A padded column taken from an earlier padded call: the tensor, and the parts whose
    values it holds, which differ in dim ``dim``; ``fill(value)`` sets the rest (past each
    row's values in that dim, the earlier call's padding), with one ``masked_fill``; nothing
    to do for zeros where ``zero`` (the padding holds zeros already)."""

    __slots__ = ("base", "column", "dim", "big", "zero")

    def __init__(self, base: torch.Tensor, column: list[torch.Tensor], dim: int, big: int) -> None:
        self.base, self.column, self.dim, self.big = base, column, dim, big
        self.zero = False

    def fill(self, value: Any) -> torch.Tensor:
        if self.zero and value == 0:
            return self.base
        k = self.dim
        extent = np.array([v.shape[k] for v in self.column for _ in range(v.shape[0])], np.int64)
        return PaddedRows(self.base, k, extent).filled(value)


# _combinations' results by the lengths' dtypes and bytes (at most 64; emptied when full, and
# when an autobatch call ends): a decoder's steps read memories of the same lengths round
# after round.
_COMBINATIONS: dict[tuple[Any, ...], tuple[list[tuple[int, ...]], np.ndarray]] = {}


def forget_combinations() -> None:
    """Drop what ``_combinations`` keeps."""
    _COMBINATIONS.clear()


def _combinations(lengths: list[np.ndarray]) -> tuple[list[tuple[int, ...]], np.ndarray]:
    """The distinct combinations of the rows' lengths (one array per ragged column), sorted,
    and per row the index of its combination."""
    key = tuple((x.dtype.str, x.tobytes()) for x in lengths)
    got = _COMBINATIONS.get(key)
    if got is not None:
        return got
    first = lengths[0]
    if first.dtype.kind in "iu" and all(
        x is first or np.array_equal(x, first) for x in lengths[1:]
    ):
        # One column, or columns of the same lengths (a memory and its scores): the
        # lengths present, by a count of each (small non-negative ints), not a sort.
        present = np.bincount(first) > 0
        uniq = np.flatnonzero(present)
        inv = (np.cumsum(present) - 1)[first]
        combos = [(x,) * len(lengths) for x in uniq.tolist()]
    else:
        stacked = np.stack(lengths)
        bound = int(stacked.max()) + 1
        code = np.zeros(stacked.shape[1], np.int64)
        for row in stacked:
            code = code * bound + row
        _, first, inv = np.unique(code, return_index=True, return_inverse=True)
        combos = [tuple(c) for c in stacked[:, first].T.tolist()]
    inv.flags.writeable = False  # shared by every call with these lengths
    if len(_COMBINATIONS) >= 64:
        _COMBINATIONS.clear()
    got = _COMBINATIONS[key] = (combos, inv)
    return got


def _lowest(dtype: torch.dtype) -> Any:
    """The value no other of ``dtype`` is below: -inf, or an integer type's least (amax of
    integers), False for bool."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("-inf")
    if dtype is torch.bool:
        return False
    return torch.iinfo(dtype).min


def _highest(dtype: torch.dtype) -> Any:
    """The value no other of ``dtype`` is above: inf, an integer type's greatest, True."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("inf")
    if dtype is torch.bool:
        return True
    return torch.iinfo(dtype).max


# What a padded op that reduces a dim (tables._PADDED: softmax, amax and argmax; amin and
# argmin) fills its first value's padding in that dim with: a value that never wins.
_REDUCED_FILL = {"softmax": _lowest, "least": _highest}


# Ops each of whose output positions is one input position's, moved or ReLU of it, and
# whose backward hands each position's gradient to that input position alone, as it is or
# zeroed: a group of rows of several lengths takes them padded with whatever lies past
# each row's length (its output is cut to each row's own; a gradient of 0 there stays 0,
# where a product with what lies there could make it nan).  Other padded ops take the
# padding filled (zeros, or a reduction's identity), which also stops such a nan.
_POSITIONWISE = frozenset(
    (
        torch.t,
        torch.Tensor.t,
        torch.transpose,
        torch.Tensor.transpose,
        torch.unsqueeze,
        torch.Tensor.unsqueeze,
        torch.Tensor.__getitem__,  # (padded only where it reads no padding: _index_from_start)
        torch.relu,
        torch.Tensor.relu,
        F.relu,
        torch.chunk,  # (padded only along a dim the values share: see _ragged_run)
        torch.Tensor.chunk,
        torch.split,
        torch.Tensor.split,
        torch.unbind,
        torch.Tensor.unbind,
    )
)


# The softmaxes (not log_softmax, nor the other reductions ``_REDUCED_FILL`` pads for).
_SOFTMAXES = frozenset((torch.softmax, torch.Tensor.softmax, F.softmax))


def _no_wrap(node: Any, rec: Any) -> Any:  # pragma: no cover  (replaced by _infer)
    raise AssertionError("op used before its outputs were inferred")


def _loss(fn: Any, args: list[Any], kwargs: dict[str, Any]) -> torch.Tensor:
    """A per-example mean/sum classification loss over a group, one value per example: of
    one (classes,) input each, or of a batch of the example's own (N, classes), whose N
    losses its mean averages over the targets not ignored."""
    kwargs = dict(kwargs)
    reduction = kwargs.get("reduction", "mean")
    kwargs["reduction"] = "none"
    x, target = args[0], args[1]
    if x.dim() == 3 and x.shape[1] == 1:  # (n, 1, classes): a batch of one, the loss of one
        x, target = x.squeeze(1), target.squeeze(1)
        args = [x, target, *args[2:]]
    if x.dim() == 3:  # (n, N, classes): the examples' batches as one
        n = x.shape[0]
        out = fn(x.flatten(0, 1), target.flatten(0, 1), *args[2:], **kwargs).view(n, -1)
        if reduction != "mean":
            return out.sum(1)  # (an ignored target's loss is 0)
        kept = target != kwargs.get("ignore_index", -100)
        # All of an example's targets ignored: 0 / 0, nan, as eager gives.
        return out.sum(1) / kept.sum(1).to(out.dtype)
    out = fn(*args, **kwargs)
    if reduction != "mean":
        return out  # a sum over nothing is 0, as 'none' gives an ignored target
    # One example whose target is ignored averages nothing: nan, as eager gives.  (On the
    # CPU the targets are read at no cost: where none is ignored, the loss as it is, with
    # no fill in forward nor backward.)
    ignored = target == kwargs.get("ignore_index", -100)
    if target.device.type == "cpu" and not ignored.any():
        return out
    return out.masked_fill(ignored, float("nan"))


def _wrapper(
    single: bool, metas: list[_Meta], treedef: Any, none_at: tuple[int, ...] = ()
) -> Callable[[Any, Any], Any]:
    """How an op's recorded node (or split nodes) becomes its Lazy outputs (``None`` at the
    leaves ``none_at`` of the structure, where the call returns None beside its tensors)."""
    if none_at:
        n = len(metas) + len(none_at)

        def build(nodes: Any, rec: Any) -> Any:
            lazies = iter([Lazy(h, m, rec) for h, m in zip(nodes, metas)])
            return pytree.tree_unflatten(
                [None if i in none_at else next(lazies) for i in range(n)], treedef
            )

        return build
    if single:
        m = metas[0]
        return lambda node, rec: Lazy(node, m, rec)
    if treedef == pytree.tree_flatten(tuple(range(len(metas))))[1]:
        if len(metas) == 2:  # an LSTM cell's (h, c): unrolled
            m0, m1 = metas
            return lambda nodes, rec: (Lazy(nodes[0], m0, rec), Lazy(nodes[1], m1, rec))
        return lambda nodes, rec: tuple([Lazy(h, m, rec) for h, m in zip(nodes, metas)])
    build = _tuple_builder(pytree.tree_unflatten(list(range(len(metas))), treedef))
    if build is not None:  # nested tuples (an LSTM's (out, (h, c))): built directly
        return lambda nodes, rec: build([Lazy(h, m, rec) for h, m in zip(nodes, metas)])
    return lambda nodes, rec: pytree.tree_unflatten(
        [Lazy(h, m, rec) for h, m in zip(nodes, metas)], treedef
    )


def _tuple_builder(template: Any) -> Callable[[list[Any]], Any] | None:
    """A function that puts a list of leaves into ``template``'s structure, where that is
    plain tuples nested (leaf ``i`` at the int ``i``): what ``pytree.tree_unflatten`` gives,
    without its walk of the spec per call.  None for any other structure."""
    if type(template) is int:
        return lambda leaves: leaves[template]
    if type(template) is not tuple:
        return None
    parts = [_tuple_builder(t) for t in template]
    if any(p is None for p in parts):
        return None
    return lambda leaves: tuple([p(leaves) for p in parts])


class _OpFailed(Exception):
    """A batched call raised; carries the op for autobatch's message."""

    def __init__(self, op: _Op, values: tuple[Any, ...]) -> None:
        super().__init__(op.__qualname__)
        self.op = op
        self.values = values


def _op_device(op: _Op) -> torch.device | None:
    """The device of an op's shared tensors or of its module's parameters, if it has any."""
    for t in _tensors((op.args, op.kwargs)):
        return t.device
    for x in (op.fn, *op.args):
        if isinstance(x, nn.Module):
            for t in x.parameters():
                return t.device
    return None
