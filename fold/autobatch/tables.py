"""The torch function and module tables: which calls run directly on stacked values (and
with which dims moved past the batch dim), which modules are batch-polymorphic, and which
calls change a tensor in place."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fold.autobatch.common import _DIRECT, _MODELS, _RNN, _VMAP
from fold.autobatch.ops import _LOSSES, _Slot, _slots, _tensors
from fold.autobatch.values import _Meta
from fold.executor import ModelBatched


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


_GETITEM = torch.Tensor.__getitem__


def _basic_index(i: Any) -> bool:
    """An int, a slice of ints, None or Ellipsis: it selects within one example's dims alike
    for every example (no tensors, lists or bools)."""
    if type(i) is int or i is None or i is Ellipsis:
        return True
    return type(i) is slice and all(type(v) in (int, type(None)) for v in (i.start, i.stop, i.step))


_MATMUL = _functions("matmul __matmul__", torch, torch.Tensor)


_FLATTEN = _functions("flatten", torch, torch.Tensor)


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
    if fn is _GETITEM:  # x[i], x[1:3], x[..., 0], x[:, None]: the batch dim kept first
        if len(args) != 2 or kwargs or type(args[0]) is not _Slot or not args[0].meta.ndim:
            return None
        index = args[1] if type(args[1]) is tuple else (args[1],)
        if not all(_basic_index(i) for i in index):
            return None
        return [args[0], (slice(None), *index)], {}
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
    if isinstance(module, nn.RNNBase) and _unbatched_sequence(args):
        return _RNN
    return _VMAP


def _unbatched_sequence(args: list[Any]) -> bool:
    """``rnn(x)``, ``rnn(x, h)`` or ``lstm(x, (h, c))`` on one unbatched sequence x (L, D)
    with states (layers, H): what a group of such calls stacks runs as one batched call."""
    if not 1 <= len(args) <= 2 or type(args[0]) is not _Slot or args[0].meta.ndim != 2:
        return False
    if len(args) == 1 or args[1] is None:
        return True
    hx = args[1] if type(args[1]) in (tuple, list) else (args[1],)
    return all(type(h) is _Slot and h.meta.ndim == 2 for h in hx)


def _pad_sequence_group(
    sequences: Any,
    batch_first: bool = False,
    padding_value: float = 0.0,
    padding_side: str = "right",
) -> torch.Tensor:
    """``torch._C._nn.pad_sequence`` for a group: each element is the group's stacked
    sequences (n, L_i, *rest); padded along dim 1 to the longest, then stacked where one
    example's result has its list dim (time-major (L, k, *rest): dim 2; batch first: dim 1)."""
    longest = max(s.shape[1] for s in sequences)
    padded = []
    for s in sequences:
        short = longest - s.shape[1]
        spec = [0, 0] * (s.dim() - 2) + ([0, short] if padding_side == "right" else [short, 0])
        padded.append(F.pad(s, spec, value=padding_value) if short else s)
    return torch.stack(padded, 1 if batch_first else 2)


# Torch functions autobatch refuses, with why and the fix.
_REFUSED: dict[Any, str] = {
    torch._pack_padded_sequence: (
        "pack_padded_sequence of recorded values: a packed batch's shapes depend on the "
        "lengths' values (the rows per step), and an RNN over it reads them, so it cannot "
        "be recorded per example and batched. Fix: call the RNN on each unbatched sequence "
        "(lstm(seq) with seq of shape (L, D)): autobatch batches those calls across "
        "sequences and examples; or pad with pad_sequence and mask."
    ),
}


# Torch functions whose group runs through a function of fold's own on the stacked values
# (where the function itself has no batching rule).
_GROUP_CALLS: dict[Any, Any] = {torch._C._nn.pad_sequence: _pad_sequence_group}


def _polymorphic_module(module: nn.Module) -> bool:
    if isinstance(module, nn.Sequential):
        return all(_polymorphic_module(m) for m in module)
    return isinstance(module, _POLYMORPHIC_MODULES)


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
