"""What every part of autobatch shares: the optional C extension (``fold/_clazy.c``), the
per-thread state of the autobatch call running in this thread, how a group runs (the modes),
the grad and autocast mode a call is recorded in, the random state a recording must not
change, and how calls and source lines are named in errors."""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import threading
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # the recorder uses this module: names for annotations only
    from fold.autobatch.recorder import _Recorder


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


class _Hooks:
    """What a part of autobatch calls that a part above it defines, set when that part is
    imported: the parts import only the ones below them (tests/test_architecture.py)."""

    # traced._compile: a @batchable function recorded once as a program of its calls, run
    # by ops._Op for a group of its per-example calls.
    compile: Any = None
    # driver._forget_pools: the fast tables kept for later calls dropped (a module's calls
    # recorded whole until now are run through from now on: recorder._shapes_vary).
    forget_pools: Any = None


HOOKS = _Hooks()


_FOLD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


_DIRECT, _VMAP, _BATCHED, _MODELS = "direct", "vmap", "batched", "model-batched"
# An nn.RNN/GRU/LSTM call on one unbatched sequence (L, D): the group's sequences run as
# one batched call (see ops._Op._rnn).
_RNN = "recurrent over the stacked sequences"


_PER_EXAMPLE = "per-example"  # the kind of a @batchable (not batched=True) call


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


_MISS = object()

# The types of constant arguments: numbers, strings, None (a keyword argument's value the
# recorder keys as it is, see recorder._KW_PARTS; one values._given may pass by position).
_CONSTANTS = frozenset({int, float, bool, str, type(None)})


def pool_room(pools: dict[Any, list[Any]], key: Any, keys: int, per_key: int) -> list[Any] | None:
    """The list of ``pools`` (what a function's earlier calls left for its next ones, by
    ``key``) that one more may go into: made for a new key (every key dropped first where
    ``keys`` are kept already), None where it holds ``per_key`` already or the key cannot be
    hashed (a callable without ``__hash__``)."""
    try:
        kept = pools.get(key)
    except TypeError:
        return None
    if kept is None:
        if len(pools) >= keys:
            pools.clear()
        kept = pools.setdefault(key, [])
    return kept if len(kept) < per_key else None


def pool_take(pools: dict[Any, list[Any]], key: Any) -> Any:
    """One of what ``pools`` keeps for ``key`` (taken out), or None."""
    try:
        return pools[key].pop()
    except (KeyError, IndexError, TypeError):  # (none kept; or an unhashable callable)
        return None


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
