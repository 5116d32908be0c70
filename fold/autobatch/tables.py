"""The torch function and module tables: which calls run directly on stacked values (and
with which dims moved past the batch dim), which modules are batch-polymorphic, and which
calls change a tensor in place."""

from __future__ import annotations

import functools
import logging
import math
import weakref
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fold.autobatch import buffers, running
from fold.autobatch.common import _DIRECT, _MODELS, _RNN, _VMAP
from fold.autobatch.ops import _LOSSES, _fill, _Slot, _slots, _tensors
from fold.autobatch.patches import (
    _READ_FUNCTIONS,
    _call_module,
    _eager_batch_norm,
    _eager_instance_norm,
    batch_norm_forward,
    batch_norm_rewrite,
    instance_norm_rewrite,
    running_norm,
)
from fold.autobatch.values import _Meta
from fold.errors import FoldError
from fold.executor import ModelBatched
from fold.ops import PaddedOutputs


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
    "__xor__ __invert__ __floordiv__ __mod__ masked_fill",
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
    ("logsumexp", 1, None),
    ("all", 1, None),
    ("any", 1, None),
    ("gather", 1, None),  # (its index per example too, of the input's number of dims)
    ("max", 1, None),  # (with a dim: values and indices; without, see _GROUP_CALLS)
    ("min", 1, None),
    ("topk", 2, -1),  # (a decoder's ``logits.topk(1)``: values and indices)
    ("kthvalue", 2, -1),
    ("sort", 1, -1),
    ("argsort", 1, -1),
    ("mode", 1, -1),
    ("median", 1, None),  # (with a dim: values and indices; without, one number: vmap)
    ("nanmedian", 1, None),
    ("cumprod", 1, None),
    ("cummax", 1, None),
    ("cummin", 1, None),
    ("logcumsumexp", 1, None),
    ("nansum", 1, None),
    ("nanmean", 1, None),
    ("count_nonzero", 1, None),
    ("glu", 1, -1),
    ("diff", 2, -1),
):
    for _f in _functions(_name, torch, torch.Tensor, F):
        _DIM_OPS[_f] = (_pos, "dims" if _name == "flip" else "dim", _default)


# The ops of _DIM_OPS whose dim counts the output's dims, one more than the input's.
_RANK_UP = _functions("stack unsqueeze", torch, torch.Tensor)


_GETITEM = torch.Tensor.__getitem__


def _basic_index(i: Any) -> bool:
    """An int, a slice of ints, None or Ellipsis: it selects within one example's dims alike
    for every example (no tensors, lists or bools)."""
    if type(i) is int or i is None or i is Ellipsis:
        return True
    return type(i) is slice and all(type(v) in (int, type(None)) for v in (i.start, i.stop, i.step))


_MATMUL = _functions("matmul __matmul__", torch, torch.Tensor)
# F.linear as fold found it at import: while autobatch runs, ``F.linear`` is its wrapper
# (patches._DIRECT_FUNCTIONAL), and a call reaches the recorder as this function.
_LINEAR = F.linear


_FLATTEN = _functions("flatten", torch, torch.Tensor)
_TRANSPOSE = _functions("transpose swapaxes swapdims", torch, torch.Tensor)
_SQUEEZE = _functions("squeeze", torch, torch.Tensor)
_PERMUTE = _functions("permute", torch, torch.Tensor)


# Torch functions whose group may hold calls on values of several shapes (an attention's
# scores over memories of several lengths), run as one call on the values padded to the
# largest shape, each part's outputs cut back to its own (see ``_Op._padded_parts``): how a
# part is padded.  "zeros": every dim with zeros (elementwise ops and row-wise ones compute
# each position from its own; a matmul's padded rows and columns are cut away and a padded
# contraction adds nothing; a sum adds nothing); "softmax": zeros, and -inf along the op's
# dim (exp(-inf) is 0: each row's sum is its own; the largest of a row is its own);
# "mean": zeros, each part's mean rescaled from the padded length to its own.  Whatever a
# padded position computes (inf, nan) stays in the padding: it is cut away, and the
# padding's backward drops its gradient.
_PADDED: dict[Any, str] = {f: "zeros" for f in _MATMUL}
_PADDED.update(
    {
        f: "zeros"
        for f in _functions(
            "add sub mul div true_divide neg exp tanh sigmoid relu sum unsqueeze squeeze "
            "transpose permute t mv mm bmm dot einsum linear __add__ __radd__ __sub__ __rsub__ "
            "__mul__ __rmul__ __truediv__ __rtruediv__ __neg__",
            torch,
            torch.Tensor,
            F,
        )
    }
)
_PADDED.update(
    {f: "softmax" for f in _functions("softmax log_softmax amax", torch, torch.Tensor, F)}
)
# The least of a dim: its padding filled with the dtype's greatest value.
_PADDED.update({f: "least" for f in _functions("amin", torch, torch.Tensor)})
# The index of a dim's greatest (least) value: its padding filled with the least (greatest)
# value, so that no padding wins, nor ties with a value before it (the first index wins);
# over a whole value only where it has one dim (a padded value's flat index is its own).
_ARG_EXTREMES = _functions("argmax argmin", torch, torch.Tensor)
_PADDED.update({f: "softmax" if f.__name__ == "argmax" else "least" for f in _ARG_EXTREMES})
# The greatest (least) along a dim, its values and indices (two outputs of one shape, see
# recorder._group_padded): the padding filled as argmax's (argmin's).
_PADDED.update(
    {
        f: "softmax" if f.__name__ == "max" else "least"
        for f in _functions("max min", torch, torch.Tensor)
    }
)
_TWO_OUTPUTS = _functions("max min", torch, torch.Tensor)
# A value cut into pieces of one shape along a dim (a fused projection's query, key and
# value: ``qkv(x).chunk(3, -1)``): each piece of the padded value is the piece of each
# value, where the dim cut is none the values differ in (checked when the group runs, see
# _Op._ragged_run).  Pieces of several shapes (``split([d, 2 * d])``) stay a group per shape.
_SPLITS = _functions("chunk split unbind", torch, torch.Tensor)
_PADDED.update({f: "split" for f in _SPLITS})
# A mask's padding is False: masked_fill keeps the value's padding.
_PADDED.update({f: "zeros" for f in _functions("masked_fill", torch, torch.Tensor)})
_PADDED.update({f: "mean" for f in _functions("mean", torch, torch.Tensor)})
# torch.cat whose list ends with the one per-example value, after shared tensors (a parser's
# root row before a sentence's states): zeros pad the value's end, which is the output's
# end ("cat", see recorder._group_padded); and an index of a value by one non-negative int
# (a row of an encoder's output), which reads no padding ("index").
_PADDED[torch.cat] = "cat"
_PADDED[_GETITEM] = "index"


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


def _shift_dim(d: Any, rank: int) -> Any:
    """A per-example dim (or dims) of a value of ``rank`` dims as the dim past the batch
    dim; _MISSING for anything else, for no dims at all (``torch.amax(h, ())`` reduces every
    dim, which past the batch dim would reduce the batch too), and for a dim outside
    ``-rank .. rank - 1``.  Torch takes dim 0 or -1 of a 0-dim tensor as the tensor itself
    (``torch.softmax(score, -1)`` of one number is 1, ``cumsum`` and ``flip`` give it back),
    and stacked, -1 is the batch dim: such calls, and dims out of range (eager's
    IndexError), are left to vmap.  ``rank`` counts the output's dims where the op adds
    one (``unsqueeze``, ``stack``: ``s.unsqueeze(-1)`` of a number is ``(1,)``)."""
    if type(d) is int:
        if not -rank <= d < rank:
            return _MISSING
        return d + 1 if d >= 0 else d
    if type(d) in (tuple, list) and d and all(type(x) is int for x in d):
        dims = [_shift_dim(x, rank) for x in d]
        return _MISSING if _MISSING in dims else type(d)(dims)
    return _MISSING


_MISSING = object()


def _aligned_elementwise(
    fn: Any, args: list[Any], kwargs: dict[str, Any], outs: list[_Meta]
) -> Any:
    """For an elementwise torch function whose per-example arguments differ in rank (``x +
    b``, x (T, D) and b (D,) both per example; ``emb[None] + pos``): the group's call, each
    stacked argument given 1-dims after its batch dim up to the output's rank, so that they
    line up as broadcasting lines them up in each example (``_direct_template`` takes the
    calls whose per-example arguments all have the output's rank).  None where an argument
    is batched inside a container or keyword, or has no dims (a 0-dim tensor takes no part
    in type promotion in eager code, but would stacked), or the output is not one tensor."""
    if len(outs) != 1 or _slots(kwargs):
        return None
    rank = outs[0].ndim
    pads = []
    for a in args:
        if type(a) is _Slot:
            if a.ragged or a.meta.ndim == 0 or a.meta.ndim > rank:
                return None
            pads.append(rank - a.meta.ndim)
        elif type(a) in (list, tuple, dict) and _slots(a):
            return None
        else:
            pads.append(0)
    if not any(pads):
        return None
    return functools.partial(_aligned_call, fn, tuple(pads))


def _aligned_call(fn: Any, pads: tuple[int, ...], *args: Any, **kwargs: Any) -> Any:
    return fn(
        *[a.view(a.shape[0], *[1] * p, *a.shape[1:]) if p else a for a, p in zip(args, pads)],
        **kwargs,
    )


_LAYOUTS = (torch.channels_last, torch.channels_last_3d)
_CONTIGUOUS = torch.Tensor.contiguous


def _any_layout(
    fn: Any, args: list[Any], kwargs: dict[str, Any]
) -> tuple[list[Any], dict[str, Any]]:
    """``contiguous``/``to``/``clone`` asking for a layout of the example's rank (channels
    last), which the stacked values (one dim more) cannot take: the values are the same in
    any layout, so the stacked ones keep the usual one."""
    if kwargs.get("memory_format") in _LAYOUTS:
        usual = torch.contiguous_format if fn is _CONTIGUOUS else torch.preserve_format
        kwargs = {**kwargs, "memory_format": usual}
    return args, kwargs


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
            return _any_layout(fn, args, kwargs)
        return None
    if fn in _MATMUL or fn is _LINEAR:
        rest = [a for a in args[1:]] + list(kwargs.values())
        if type(args[0]) is _Slot and not _slots(rest) and args[0].meta.ndim >= 1:
            w = args[1] if len(args) > 1 else kwargs.get("weight", kwargs.get("other"))
            if fn is _LINEAR or (isinstance(w, torch.Tensor) and w.dim() == 2):
                return args, kwargs
        return None
    if fn in _LOSSES:
        # One example's mean loss over a (classes,) input is its 'none' loss (without class
        # weights, which a mean divides out); over a batch of its own, (N, classes) with N
        # class indices (a model called on x[None]), the mean of its N (see ops._loss);
        # ignored targets are handled in _loss.
        x, t = (args[0], args[1]) if len(args) >= 2 else (None, None)
        if (
            len(args) >= 2
            and type(x) is _Slot
            and type(t) is _Slot
            and (
                (x.meta.ndim == 1 and t.meta.ndim == 0)
                or (
                    x.meta.ndim == 2
                    and t.meta.ndim == 1
                    and x.meta.shape[0] == t.meta.shape[0]
                    and not t.meta.dtype.is_floating_point  # (class indices, not probabilities)
                )
            )
            and kwargs.get("weight") is None
            and kwargs.get("size_average") is None  # the legacy arguments override reduction
            and kwargs.get("reduce") is None
            and kwargs.get("reduction", "mean") in ("mean", "sum")
            and len(args) == 2
        ):
            return args, kwargs
        return None
    if fn is _GETITEM:  # x[i], x[1:3], x[..., 0], x[:, None]: the batch dim kept first
        if len(args) != 2 or kwargs or type(args[0]) is not _Slot:
            return None
        index = args[1] if type(args[1]) is tuple else (args[1],)
        if not all(_basic_index(i) for i in index):
            return None
        if not args[0].meta.ndim and not all(i is None or i is Ellipsis for i in index):
            return None  # (of a number: new dims alone, y[None] of a label)
        return [args[0], (slice(None), *index)], {}
    if fn in _TRANSPOSE or fn in _PERMUTE:  # dims moved past the batch dim
        if len(slots) != 1 or type(args[0]) is not _Slot or kwargs:
            return None
        dims = args[1:]
        if fn in _PERMUTE and len(dims) == 1 and type(dims[0]) in (tuple, list, torch.Size):
            dims = tuple(dims[0])
        if not all(type(d) is int for d in dims) or (fn in _TRANSPOSE and len(dims) != 2):
            return None
        ndim = args[0].meta.ndim
        if fn in _PERMUTE:  # (every dim, each made non-negative: the batch dim first)
            return [args[0], (0, *[d % ndim + 1 if ndim else 0 for d in dims])], {}
        moved = [_shift_dim(d, ndim) for d in dims]
        return None if _MISSING in moved else ([args[0], *moved], {})
    if fn in _FLATTEN:  # two dims: start_dim and end_dim, both moved past the batch dim
        if len(slots) != 1 or type(args[0]) is not _Slot or args[0].meta.ndim == 0:
            return None
        dims = {"start_dim": 0, "end_dim": -1}
        dims.update(zip(dims, args[1:]))
        dims.update(kwargs)
        shifted = {k: _shift_dim(d, args[0].meta.ndim) for k, d in dims.items()}
        if len(shifted) != 2 or any(type(d) is not int for d in shifted.values()):
            return None
        return [args[0]], shifted
    if fn in _SQUEEZE and len(args) == 1 and not kwargs and type(args[0]) is _Slot:
        # squeeze() of every dim of size 1 in one example's shape (its batch dim kept)
        shape = args[0].meta.shape
        return [args[0], tuple([d + 1 for d, n in enumerate(shape) if n == 1])], {}
    spec = _DIM_OPS.get(fn)
    if spec is None:
        return None
    ndims = {s.meta.ndim for s in slots}
    if len(ndims) != 1 or _tensors((args, kwargs)):
        return None
    pos, name, default = spec
    rank = ndims.pop() + (fn in _RANK_UP)
    args, kwargs = list(args), dict(kwargs)
    if name in kwargs:
        d = _shift_dim(kwargs[name], rank)
        if d is _MISSING:
            return None
        kwargs[name] = d
    elif len(args) > pos:
        # (flip's dims may be given one by one, ``h.flip(0, 1)``: each moved)
        given = args[pos:] if name == "dims" else [args[pos]]
        shifted = [_shift_dim(d, rank) for d in given]
        if _MISSING in shifted:
            return None
        args[pos : pos + len(shifted)] = shifted
    elif default is not None:
        d = _shift_dim(default, rank)
        if d is _MISSING:
            return None
        kwargs[name] = d
    elif fn in _WHOLE_REDUCTIONS and rank:  # (x.sum(): over all of each example)
        kwargs[name] = tuple(range(1, rank + 1))
    else:
        return None
    return args, kwargs


# Reductions that take a tuple of dims: over a whole per-example value (no dim given), the
# dims past the batch dim.  (A 0-dim value keeps vmap: torch reads dim=() as every dim.)
_WHOLE_REDUCTIONS = _functions(
    "sum mean amax amin nansum nanmean count_nonzero", torch, torch.Tensor
)


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


def _merged_batch_call(module: nn.Module, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """For a recurrent module or cell called on a batch of the example's own (a tensor with a
    batch dim, as per-example code written after a batched model keeps: a GRU's input
    ``x.view(1, 1, -1)`` and states ``(layers, 1, H)``, a cell's ``(1, D)``): the function
    that runs a group of such calls as ONE call, the examples' batches merged into one
    (``_merged_rnn``); None where the call is not such (torch.func.vmap has no batching rule
    for the recurrent modules: each call would run on its own)."""
    if kwargs or not 1 <= len(args) <= 2:
        return None
    if type(module) in _BATCH_NORMS:
        x = args[0]
        if len(args) == 1 and type(x) is _Slot and not x.ragged and x.meta.ndim >= 2:
            return functools.partial(_merged_batch_norm, module)
        return None
    if type(module) in _INSTANCE_NORMS:  # (in training, with running statistics)
        x = args[0]
        if (
            module.training
            and module.track_running_stats
            and len(args) == 1
            and type(x) is _Slot
            and not x.ragged
            and x.meta.ndim >= 2
        ):
            return functools.partial(_merged_instance_norm, module)
        return None
    if type(module) in _CONVS:
        x = args[0]
        spatial = _CONVS[type(module)]
        if len(args) == 1 and type(x) is _Slot and not x.ragged:
            if x.meta.ndim == spatial + 2:  # (N, C, *S): the examples' batches merged
                return functools.partial(_merged_conv, module)
            if x.meta.ndim == spatial + 1:  # (C, *S) unbatched: the group is a batch
                return module
        return None
    if isinstance(module, nn.RNNBase):
        dims = 3
    elif isinstance(module, _CELLS):
        dims = 2
    else:
        return None
    x = args[0]
    if type(x) is not _Slot or x.ragged or x.meta.ndim != dims:
        return None
    hx = args[1] if len(args) > 1 else None
    states = () if hx is None else hx if type(hx) in (tuple, list) else (hx,)
    if not all(type(h) is _Slot and not h.ragged and h.meta.ndim == dims for h in states):
        return None
    return functools.partial(_merged_rnn, module, dims == 3)


# torch.nn's convolutions (these classes exactly), by their number of spatial dims.
_CONVS = {
    nn.Conv1d: 1,
    nn.Conv2d: 2,
    nn.Conv3d: 3,
    nn.ConvTranspose1d: 1,
    nn.ConvTranspose2d: 2,
    nn.ConvTranspose3d: 3,
}


def _merged_conv(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A group of calls of a convolution, each on a batch of its example's own ``(N, C,
    *S)`` (an image as ``(1, C, H, W)``): ONE call on the examples' batches merged, ``(n *
    N, C, *S)``; each sample's output is computed from it alone."""
    return _call_module(module, x.flatten(0, 1)).unflatten(0, x.shape[:2])


def _merged_rnn(module: nn.Module, sequences: bool, x: torch.Tensor, hx: Any = None) -> Any:
    """A group of calls of a recurrent module (``sequences``) or cell, each on a batch of
    its example's own, as ONE call: the group's stacked values (n, *one example's) reshaped
    so that the examples' batches follow one another in the module's batch dim (time-major
    ``(L, N, D)`` per example: ``(L, n * N, D)``; batch first and cells: ``(n * N, ...)``),
    states ``(layers, N, H)`` alike; the outputs reshaped back, n first.  Each row of the
    merged batch is computed from its own row alone, so every example's values are its
    eager call's."""
    n = x.shape[0]
    time_major = sequences and not module.batch_first

    def merge(t: torch.Tensor, batch_dim: int) -> torch.Tensor:
        # (n, ..., N at batch_dim + 1, ...) -> (..., n * N, ...)
        t = t.movedim(0, batch_dim)
        return t.reshape(*t.shape[:batch_dim], -1, *t.shape[batch_dim + 2 :])

    def split(t: torch.Tensor, batch_dim: int) -> torch.Tensor:
        t = t.reshape(*t.shape[:batch_dim], n, -1, *t.shape[batch_dim + 1 :])
        return t.movedim(batch_dim, 0)

    state_dim = 1 if sequences else 0
    if hx is not None:
        hx = (
            tuple(merge(h, state_dim) for h in hx)
            if type(hx) in (tuple, list)
            else merge(hx, state_dim)
        )
    out = _call_module(module, merge(x, 1 if time_major else 0), hx)
    if not sequences:  # a cell: its new state (or an LSTMCell's (h, c))
        if type(out) is tuple:
            return tuple(split(t, 0) for t in out)
        return split(out, 0)
    out, h = out
    h = tuple(split(t, 1) for t in h) if type(h) is tuple else split(h, 1)
    return split(out, 1 if time_major else 0), h


_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_INSTANCE_NORMS = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


def _merged_batch_norm(module: nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> torch.Tensor:
    """A group of calls of a batch norm (these classes exactly, or a subclass's
    ``super().forward``: patches.batch_norm_forward), each on a batch of its example's own
    ``(N, C, *S)``, as ONE computation on the stacked ``(n, N, C, *S)``.  In eval mode
    (running statistics) the examples' batches merged into one call.  Where the norm uses
    the batch's statistics (training mode), each example normalised by its own (see
    ``_own_statistics``), and the running statistics updated as the group's calls one after
    another would update them (``_update_running``); the count grows by k.  (One call per
    example under the loop did the same, at an eager call's cost each.)"""
    n, per = x.shape[0], x.shape[1:]
    uses_batch = module.training or (module.running_mean is None and module.running_var is None)
    if not uses_batch:
        # (a subclass's super().forward, recorded in training: its base forward alone)
        forward = _call_module if type(module) in _BATCH_NORMS else batch_norm_forward
        return forward(module, x.flatten(0, 1)).unflatten(0, (n, per[0]))
    out, means, var, count = _own_statistics(x, module.weight, module.bias, module.eps, False)
    if module.training and module.track_running_stats:
        running = (module.running_mean, module.running_var)
        _update_running(*running, module.num_batches_tracked, module.momentum, means, var, count)
    return out


def _merged_instance_norm(module: nn.modules.instancenorm._InstanceNorm, x: torch.Tensor) -> Any:
    """A group of calls of an instance norm (these classes exactly) in training mode with
    running statistics: each example's instances normalised by their own statistics, the
    running statistics updated as the calls one after another would (``_own_statistics``,
    ``_update_running``); an unbatched example ``(C, *S)`` as a batch of one."""
    unbatched = x.dim() - 1 == module._get_no_batch_dim()
    if unbatched:
        x = x.unsqueeze(1)
    momentum = module.momentum if module.momentum is not None else 0.0
    out, means, var, count = _own_statistics(x, module.weight, module.bias, module.eps, True)
    _update_running(module.running_mean, module.running_var, None, momentum, means, var, count)
    return out.squeeze(1) if unbatched else out


def _running_norm_group(
    x: torch.Tensor, weight: Any, bias: Any, momentum: float, eps: float, stats: Any
) -> torch.Tensor:
    """A group of ``patches.running_norm`` calls (``F.batch_norm`` in training, or
    ``F.instance_norm``, on running statistics ``stats``), each on its example's ``(N, C,
    *S)``: as ``_merged_instance_norm`` does for a module."""
    out, means, var, count = _own_statistics(x, weight, bias, eps, stats.kind == "instance")
    _update_running(*stats.tensors(), None, momentum, means, var, count)
    return out


def _own_statistics(
    x: torch.Tensor, weight: Any, bias: Any, eps: float, instance: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Each example of the stacked ``(n, N, C, *S)`` normalised as a batch norm in training
    normalises it alone (over its N and S), or with ``instance``, each of its N instances
    alone (over S), by one call of torch's kernel (the groups' channels taken as channels
    of their own: a reduction over the dims around C, as var_mean would take it, cost 3-4x
    more), the affine parameters repeated per group.  Returns the output, and per example
    its statistics per channel (an instance norm's: the mean over its instances, as torch
    takes them into the running statistics), the biased variance, and how many values
    each statistic is over."""
    n, channels = x.shape[0], x.shape[2]
    if instance:
        groups = n * x.shape[1]
        flat = x.reshape(1, groups * channels, -1)
    else:
        groups = n
        flat = x.movedim(2, 1).reshape(1, n * channels, -1)  # (n, C, N, *S) flattened
    count = flat.shape[-1]
    if count <= 1:
        what = "spatial element" if instance else "value per channel"
        raise ValueError(
            f"Expected more than 1 {what} when training, got input size {tuple(x.shape[1:])}"
        )
    weight = None if weight is None else weight.repeat(groups)
    bias = None if bias is None else bias.repeat(groups)
    out, mean, invstd = torch.native_batch_norm(flat, weight, bias, None, None, True, 0.0, eps)
    var = invstd.detach().pow(-2) - eps  # (the biased variance)
    means = mean.detach().reshape(n, -1, channels).mean(1)
    var = var.reshape(n, -1, channels).mean(1)
    if instance:
        return out.reshape(x.shape), means, var, count
    moved = (n, channels, x.shape[1], *x.shape[3:])
    return out.reshape(moved).movedim(1, 2), means, var, count


def _update_running(
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    calls: torch.Tensor | None,
    momentum: float | None,
    means: torch.Tensor,
    var: torch.Tensor,
    count: int,
) -> None:
    """The running statistics (and call count ``calls``, None where there is none) after a
    group of k calls whose batches' statistics are ``means`` (k, C) and biased ``var`` over
    ``count`` values each: kept to be applied in eager order when the autobatch call ends
    (fold.autobatch.running), or where the group's rows cannot be told, at once in the
    order of its rows."""
    with torch.no_grad():
        variances = var.to(running_var.dtype) * (count / (count - 1))
    updates = running.active()
    keys = None if updates is None else updates.group_keys(means.shape[0])
    if keys is not None:
        updates.add(keys, running_mean, running_var, calls, momentum, means, variances)
        return
    before = int(calls) if calls is not None else 0
    if calls is not None:
        calls.add_(means.shape[0])
    running.update(running_mean, running_var, momentum, before, means, variances)


def _norm_forward_fits(args: list[Any], kwargs: dict[str, Any]) -> bool:
    """A batch norm's forward on a batch of each example's own (see _merged_batch_norm)."""
    return (
        not kwargs
        and len(args) == 2
        and isinstance(args[0], nn.modules.batchnorm._BatchNorm)
        and type(args[1]) is _Slot
        and not args[1].ragged
        and args[1].meta.ndim >= 2
    )


def _running_norm_fits(args: list[Any], kwargs: dict[str, Any]) -> bool:
    """A running_norm call on each example's ``(N, C, *S)`` (``S`` not empty for an
    instance norm), its affine parameters shared or None."""
    if kwargs or len(args) != 6:
        return False
    x, weight, bias, stats = args[0], args[1], args[2], args[5]
    return (
        type(x) is _Slot
        and not x.ragged
        and x.meta.ndim >= (3 if stats.kind == "instance" else 2)
        and all(p is None or isinstance(p, torch.Tensor) for p in (weight, bias))
    )


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


def _eager_lengths(lengths: Any, what: str) -> torch.Tensor:
    if not isinstance(lengths, torch.Tensor):
        raise FoldError(
            f"autobatch: {what} with lengths or batch sizes that are recorded values: the "
            "packed shapes depend on their values. Fix: compute the lengths from the "
            "example's structure (Python ints, len(seq)), as they are known while recording."
        )
    return lengths


def _pack_padded(input: Any, lengths: Any, batch_first: bool) -> tuple[Any, torch.Tensor]:
    """``torch._pack_padded_sequence`` where the lengths are known while recording (Python
    ints or an eager tensor, as ``pack_padded_sequence`` makes them): the batch sizes are
    computed at once, and the packed data is recorded as ops that batch (a flatten and one
    index_select of the rows each step keeps, in the packed order: step-major)."""
    lengths = _eager_lengths(lengths, "pack_padded_sequence").to("cpu", torch.int64)
    if lengths.numel() and (lengths <= 0).any():
        raise FoldError(
            "pack_padded_sequence: every length must be greater than 0, as torch requires."
        )
    if lengths.numel() > 1 and (lengths[1:] > lengths[:-1]).any():
        raise FoldError(
            "pack_padded_sequence: `lengths` must be sorted in decreasing order when "
            "`enforce_sorted` is True, as torch requires. Fix: pass enforce_sorted=False."
        )
    steps = int(lengths[0]) if lengths.numel() else 0
    mask = torch.arange(steps).unsqueeze(1) < lengths.unsqueeze(0)  # (steps, batch)
    rows = mask.flatten().nonzero().squeeze(1)
    x = input.transpose(0, 1) if batch_first else input
    data = x[:steps].flatten(0, 1).index_select(0, rows.to(input.device))
    return data, mask.sum(1)


def _pad_packed(
    data: Any, batch_sizes: Any, batch_first: bool, padding_value: float, total_length: int
) -> tuple[Any, torch.Tensor]:
    """``torch._pad_packed_sequence`` where the batch sizes are known while recording (those
    of a packed sequence made inside the function, which an RNN passes through): each
    padded position reads its packed row, or a row of ``padding_value``, by one
    index_select."""
    batch_sizes = _eager_lengths(batch_sizes, "pad_packed_sequence").to("cpu", torch.int64)
    steps, batch = int(total_length), int(batch_sizes[0]) if batch_sizes.numel() else 0
    lengths = (batch_sizes.unsqueeze(0) > torch.arange(batch).unsqueeze(1)).sum(1)
    mask = torch.arange(steps).unsqueeze(1) < lengths.unsqueeze(0)  # (steps, batch)
    n = int(mask.sum())
    where = torch.full((steps * batch,), n, dtype=torch.int64)
    where[mask.flatten()] = torch.arange(n)
    pad = torch.full((1, *data.shape[1:]), padding_value, dtype=data.dtype, device=data.device)
    rows = torch.cat([data, pad]).index_select(0, where.to(data.device))
    padded = rows.reshape(steps, batch, *data.shape[1:])
    return (padded.transpose(0, 1) if batch_first else padded), lengths


# Argument positions of torch functions whose tensors are sizes, part of the op by value (and
# passed whole), not per-example data: a packed sequence's batch sizes, in the RNN functions
# an nn.RNN/GRU/LSTM calls on one (in their padded form that position holds the state, not a
# tensor of sizes).
_VALUE_ARGS: dict[Any, frozenset[int]] = {
    f: frozenset({1}) for f in (torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu)
}


def _packed_rnn_group(fn: Any) -> Any:
    """``fn`` (``torch.lstm`` and kin, packed form) for a group whose examples share their
    batch sizes (part of the op by value): the n examples' packed sequences merged into
    one packed batch of n times the sequences, each step's rows example-fastest (an
    example's packed row s becomes row s * n + i), states (n, layers, B, H) as
    (layers, B * n, H); one call, outputs back per example."""

    def run(data: Any, batch_sizes: torch.Tensor, hx: Any, *rest: Any) -> Any:
        n, size = data.shape[0], data.shape[1]
        merged = data.transpose(0, 1).reshape(size * n, *data.shape[2:])
        states = hx if type(hx) in (tuple, list) else (hx,)
        states = [h.permute(1, 2, 0, 3).reshape(h.shape[1], -1, h.shape[3]) for h in states]
        out = fn(merged, batch_sizes * n, states if type(hx) in (tuple, list) else states[0], *rest)
        output, *hs = out
        output = output.reshape(size, n, *output.shape[1:]).transpose(0, 1)
        hs = [h.reshape(h.shape[0], -1, n, h.shape[2]).permute(2, 0, 1, 3) for h in hs]
        return (output, *hs)

    return run


_PACKED_RNNS = {f: _packed_rnn_group(f) for f in _VALUE_ARGS}


# Torch functions whose result's shape depends on their arguments' values (which rows a mask
# keeps, which values are distinct, the largest count), or that return a Python value:
# a call with a lazy argument of the round recording now reads it (see
# recorder._Recorder._read_call), as ``int(t)`` does.  ``_reads`` adds the calls that read
# by their arguments: ``torch.where(cond)`` with the condition alone, ``x[mask]`` with a
# boolean mask, ``x[:n]`` with a bound not a plain number, ``repeat_interleave`` with a
# tensor of repeats, ``tensor_split`` at a tensor's positions, ``F.one_hot`` without
# ``num_classes``.  (A call that a one-number integer argument sizes, ``x.repeat(n)``, is
# found by its shapes: recorder._Recorder._infer.)
_READS = _functions(" ".join(["unique unique_consecutive", *_READ_FUNCTIONS]), torch, torch.Tensor)
_REPEAT_INTERLEAVE = _functions("repeat_interleave", torch, torch.Tensor)
# (As torch has them at import: while autobatch runs, torch.where and F.one_hot are
# wrappers, see patches._DIRECT_TORCH, and the recorder is given the functions they wrap.)
_WHERE, _ONE_HOT = torch.where, F.one_hot
_TENSOR_SPLIT = _functions("tensor_split", torch, torch.Tensor)
_MASKS = frozenset((torch.bool, torch.uint8))


def _reads(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether torch function ``fn`` on these arguments reads its lazy arguments' values
    (see ``_READS``)."""
    if fn in _READS:
        return True
    if fn is _GETITEM:
        i = args[1] if len(args) > 1 else None
        return any(_is_mask(x) or _lazy_bound(x) for x in (i if type(i) in (tuple, list) else (i,)))
    if fn is _WHERE:
        return len(args) + len(kwargs) == 1
    if fn in _REPEAT_INTERLEAVE:
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return repeats is None or not isinstance(repeats, int)
    if fn in _TENSOR_SPLIT:  # at the positions a tensor holds
        at = (
            args[1]
            if len(args) > 1
            else kwargs.get("indices", kwargs.get("tensor_indices_or_sections"))
        )
        return at is not None and not isinstance(at, int) and hasattr(at, "shape")
    if fn is _ONE_HOT:  # without num_classes, the largest value's
        classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
        return classes == -1
    return False


def _lazy_bound(x: Any) -> bool:
    """A slice with a bound that is not a plain number (``x[:n]`` of a recorded ``n``): the
    result's length is data."""
    return type(x) is slice and any(
        b is not None and type(b) is not int for b in (x.start, x.stop, x.step)
    )


def _is_mask(x: Any) -> bool:
    """A boolean index (a lazy, known or plain tensor): which rows it keeps is data, which
    may differ by example (an input's mask)."""
    if isinstance(x, torch.Tensor):
        return x.dtype in _MASKS
    meta = getattr(x, "meta", None)
    return type(meta) is _Meta and meta.dtype in _MASKS


# Torch functions recorded as other calls, made at record time: their shapes depend on
# values known while recording (lengths), which the recorded calls then carry.
# A rewrite may decline a call (``_MISS``): it is recorded as it is.
_REWRITES: dict[Any, Any] = {
    torch._pack_padded_sequence: _pack_padded,
    torch._pad_packed_sequence: _pad_packed,
    # A norm call that updates running statistics, recorded with them by identity.
    F.batch_norm: batch_norm_rewrite,
    F.instance_norm: instance_norm_rewrite,
    # (the same while autobatch runs: torch's dispatch to a lazy value names the function
    # torch.nn.functional holds then, patches._eager_batch_norm)
    _eager_batch_norm: batch_norm_rewrite,
    _eager_instance_norm: instance_norm_rewrite,
}


def _sparse_matmul_group(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for a group where an operand is a sparse matrix per example (a graph's
    adjacency, stacked: a sparse ``(n, m, k)``), whose stack ``matmul`` cannot broadcast:
    ``bmm`` of the sparse stack on the left of the dense one (a vector as a column); a sparse
    right operand through the transposes; anything else one product per example."""
    if b.layout is torch.strided and a.layout is not torch.strided and a.dim() == 3:
        if b.dim() == 2:
            return torch.bmm(_coo(a), b.unsqueeze(-1)).squeeze(-1)
        if b.dim() == 3:
            return torch.bmm(_coo(a), b)
    if a.layout is torch.strided and b.layout is not torch.strided and b.dim() == 3:
        if a.dim() == 2:
            return torch.bmm(_coo(b).transpose(1, 2), a.unsqueeze(-1)).squeeze(-1)
        if a.dim() == 3:
            return torch.bmm(_coo(b).transpose(1, 2), a.transpose(1, 2)).transpose(1, 2)
    return torch.stack([torch.matmul(x, y) for x, y in zip(a.unbind(0), b.unbind(0))])


def _coo(t: torch.Tensor) -> torch.Tensor:
    return t if t.layout is torch.sparse_coo else t.to_sparse_coo()


def _matmul_group(a: torch.Tensor, b: torch.Tensor, cpu: bool | None = None) -> torch.Tensor:
    """``a @ b`` for a group whose two operands are both per example (stacked, n first):
    vectors and matrices (or stacks of matrices) as one batched call (``mem @ query`` and
    ``weights @ mem`` of attention), with the batch dim kept first.

    Matrices times a vector on the CPU take the fastest form of torch's kernels: without
    gradients, the vector on the left of the transposed matrices (torch's CPU batched
    matmul is 4-9x slower for ``(n, L, H) @ (n, H, 1)`` than for ``(n, 1, H) @ (n, H, L)``:
    253 against 35 us at n 64, L 30, H 128); with gradients, a product and a sum, whose
    backward avoids the slow outer products (183 against 816 us forward and backward).
    Values equal the per-example matmul up to the order of the sum.  ``cpu``: which forms
    to take, by ``a``'s device where None (tests take the GPU's on the CPU)."""
    if a.layout is not torch.strided or b.layout is not torch.strided:
        return _sparse_matmul_group(a, b)
    da, db = a.dim() - 1, b.dim() - 1
    if da == 1 and db == 1:
        return (a * b).sum(-1)
    n = a.shape[0]
    if db == 1:  # matrices @ a vector: the vector broadcast over every matrix of a stack
        if not (a.device.type == "cpu" if cpu is None else cpu):
            return torch.matmul(a, b.reshape(n, *[1] * (da - 2), b.shape[-1], 1)).squeeze(-1)
        if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
            return (a * b.reshape(n, *[1] * (da - 1), b.shape[-1])).sum(-1)
        row = b.reshape(n, *[1] * (da - 2), 1, b.shape[-1])
        return torch.matmul(row, a.transpose(-1, -2)).squeeze(-2)
    if da == 1:  # a vector @ matrices
        return torch.matmul(a.reshape(n, *[1] * (db - 2), 1, a.shape[-1]), b).squeeze(-2)
    return torch.matmul(a, b)


def _two_batched_operands(args: list[Any], kwargs: dict[str, Any]) -> bool:
    """matmul of two per-example operands whose batch dims line up: vectors, or matrices
    (stacks of them) of one rank."""
    if kwargs or len(args) != 2 or not all(type(x) is _Slot for x in args):
        return False
    da, db = args[0].meta.ndim, args[1].meta.ndim
    return bool(da and db) and (da == 1 or db == 1 or da == db)


def _put_fits(args: list[Any], kwargs: dict[str, Any]) -> bool:
    """``_put(x, index, value)`` of a per-example ``x`` at a basic index (ints, slices,
    None, Ellipsis), its value a number, a shared tensor or a per-example value of the
    written part's rank (stacked, the batch dims line up)."""
    if kwargs or len(args) != 3 or type(args[0]) is not _Slot or args[0].meta.ndim == 0:
        return False
    x, index, value = args
    index = index if type(index) is tuple else (index,)
    if not all(_basic_index(i) for i in index):
        return False
    if type(value) is not _Slot:
        return not _slots(value)
    try:
        part = torch.empty(x.meta.shape, device="meta")[index]
    except (IndexError, TypeError, RuntimeError):
        return False
    return not value.ragged and value.meta.ndim == part.dim()


def _put_group(x: torch.Tensor, index: Any, value: Any) -> torch.Tensor:
    """``buffers._put`` for a group: the stacked buffers copied, then written past the
    batch dim."""
    index = index if type(index) is tuple else (index,)
    out = x.clone()
    out[(slice(None), *index)] = value
    return out


def _region_fits(args: list[Any], kwargs: dict[str, Any]) -> bool:
    """``_region(x, shape, stride, offset)`` or ``_put_region(..., value)`` of a
    per-example buffer value ``x``, its value (where written) a number, a shared tensor or
    a per-example value of the part's shape."""
    if kwargs or len(args) not in (4, 5) or type(args[0]) is not _Slot or args[0].ragged:
        return False
    if len(args) == 4:
        return True
    value = args[4]
    if type(value) is not _Slot:
        return not _slots(value)
    return not value.ragged and tuple(value.meta.shape) == tuple(args[1])


def _stacked_part(x: torch.Tensor, shape: Any, stride: Any, offset: int) -> torch.Tensor:
    # (x contiguous, the examples' buffers one after another)
    return x.as_strided((x.shape[0], *shape), (x.stride(0), *stride), x.storage_offset() + offset)


def _region_group(x: torch.Tensor, shape: Any, stride: Any, offset: int) -> torch.Tensor:
    """``buffers._region`` for a group: each example's part of its stacked buffer."""
    return _stacked_part(x.contiguous(), shape, stride, offset)


def _put_region_group(
    x: torch.Tensor, shape: Any, stride: Any, offset: int, value: Any
) -> torch.Tensor:
    """``buffers._put_region`` for a group: the stacked buffers copied, each example's
    part written."""
    out = x.contiguous().clone()
    _stacked_part(out, shape, stride, offset).copy_(value)
    return out


def _two_batched_stacks(args: list[Any], kwargs: dict[str, Any]) -> bool:
    """bmm of two per-example operands, each a stack of matrices (n, b, m) and (n, b, p)
    once stacked: matmul runs them as bmm would, past the batch dim."""
    return _two_batched_operands(args, kwargs) and args[0].meta.ndim == 3


def _arg_extreme_fits(args: list[Any], kwargs: dict[str, Any]) -> bool:
    """``argmax``/``argmin`` of one per-example value, over all of it or along an int dim,
    with or without keepdim (over all of it, keepdim keeps every dim as 1: torch's vmap
    returns one dim there, ``(n, 1)`` for values of two, where eager per example gives
    ``(1, 1)``; so the direct call takes these)."""
    if len(args) > 3 or not args or type(args[0]) is not _Slot or set(kwargs) - {"dim", "keepdim"}:
        return False
    given = dict(zip(("dim", "keepdim"), args[1:]), **kwargs)
    dim, keepdim = given.get("dim"), given.get("keepdim", False)
    return (dim is None or type(dim) is int) and type(keepdim) is bool


def _extreme_group(fn: Any) -> Any:
    """``fn`` (torch.argmax, argmin, amax, amin, all or any) for a group: over each
    example's values (flattened past the batch dim: ``argmax()``, and ``max()``, ``min()``,
    ``all()``, ``any()``, whose NaN propagates as there), or along its dim moved past the
    batch dim."""

    def run(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
        if dim is None:
            out = fn(x.reshape(x.shape[0], math.prod(x.shape[1:])), 1)
            return out.view(x.shape[0], *[1] * (x.dim() - 1)) if keepdim else out
        return fn(x, dim + 1 if dim >= 0 else dim, keepdim)

    return run


def _t_group(x: torch.Tensor) -> torch.Tensor:
    """A group of ``t()`` calls: each example's matrix transposed (a vector kept)."""
    return x.transpose(1, 2) if x.dim() == 3 else x


def _reshape_fits(args: list[Any], kwargs: dict[str, Any]) -> bool:
    """``reshape``/``view`` of one per-example value to a shape of ints (as ints, or one
    tuple, list or Size of them; one may be -1)."""
    if kwargs or len(args) < 2 or type(args[0]) is not _Slot or args[0].ragged:
        return False
    shape = args[1] if len(args) == 2 and type(args[1]) in (tuple, list, torch.Size) else args[1:]
    return all(type(d) is int for d in shape)


def _reshape_group(x: torch.Tensor, *shape: Any) -> torch.Tensor:
    """A group of ``reshape``/``view`` calls: each example's value to the shape, the batch
    dim kept first (reshape: a view where the stacked values allow one, as view needs)."""
    if len(shape) == 1 and type(shape[0]) in (tuple, list, torch.Size):
        shape = tuple(shape[0])
    return x.reshape(x.shape[0], *shape)


def _broadcast_fits(args: list[Any], kwargs: dict[str, Any]) -> Any:
    """``torch.broadcast_tensors`` of per-example values and shared tensors: the group's
    function, told which are per example (``_broadcast_group``)."""
    if kwargs or not any(type(a) is _Slot for a in args):
        return False
    if not all((type(a) is _Slot and not a.ragged) or isinstance(a, torch.Tensor) for a in args):
        return False
    ranks = [a.meta.ndim if type(a) is _Slot else a.dim() for a in args]
    return functools.partial(_broadcast_group, tuple(type(a) is _Slot for a in args), max(ranks))


def _broadcast_group(stacked: tuple[bool, ...], rank: int, *tensors: torch.Tensor) -> Any:
    """A group of ``torch.broadcast_tensors`` calls: each value given the per-example
    ``rank`` of the largest (ones in front of its own dims, as broadcasting prepends them),
    a batch dim first (a shared tensor's of one), then broadcast as one call."""
    aligned = []
    for per, t in zip(stacked, tensors):
        if per:
            aligned.append(t.reshape(t.shape[0], *[1] * (rank + 1 - t.dim()), *t.shape[1:]))
        else:
            aligned.append(t.reshape(1, *[1] * (rank - t.dim()), *t.shape))
    return tuple(torch.broadcast_tensors(*aligned))


def _whole_extreme_fits(args: list[Any], kwargs: dict[str, Any]) -> bool:
    """One per-example value alone: ``max``/``min``/``all``/``any`` over all of it (``p.max()
    > 0.5``, ``mask.all()``: one number; with a dim, see _DIM_OPS), ``t()``."""
    return len(args) == 1 and not kwargs and type(args[0]) is _Slot


def _cat_shared_fits(args: list[Any], kwargs: dict[str, Any]) -> bool:
    """``torch.cat`` of per-example values and shared tensors (a parameter: a parser's root
    row before a sentence's encoder states), along an int dim."""
    if not args or type(args[0]) not in (list, tuple) or set(kwargs) - {"dim"} or len(args) > 2:
        return False
    parts = args[0]
    if not any(type(t) is _Slot for t in parts):
        return False
    if not all(type(t) is _Slot or isinstance(t, torch.Tensor) for t in parts):
        return False
    ndims = {t.meta.ndim if type(t) is _Slot else t.dim() for t in parts}
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    return len(ndims) == 1 and ndims != {0} and type(dim) is int


def _cat_shared_group(tensors: Any, dim: int = 0) -> torch.Tensor:
    """``torch.cat`` for a group whose list holds stacked per-example values (n, ...) and
    shared tensors (one rank less): the shared ones expanded over the group, the dim moved
    past the batch dim."""
    nd = max(t.dim() for t in tensors)
    n = next(t.shape[0] for t in tensors if t.dim() == nd)
    parts = [t if t.dim() == nd else t.unsqueeze(0).expand(n, *t.shape) for t in tensors]
    return torch.cat(parts, dim + 1 if dim >= 0 else dim)


# Torch functions whose group runs through a function of fold's own on the stacked values
# (where the function itself has no batching rule, or vmap's costs more): fn -> (whether a
# call's argument template fits, the group's function; or a fits that gives the group's
# function, made for the template).
_GROUP_CALLS: dict[Any, Any] = {
    **{f: (_cat_shared_fits, _cat_shared_group) for f in _functions("cat concat", torch)},
    **{
        f: (_arg_extreme_fits, _extreme_group(torch.argmax))
        for f in _functions("argmax", torch, torch.Tensor)
    },
    **{
        f: (_arg_extreme_fits, _extreme_group(torch.argmin))
        for f in _functions("argmin", torch, torch.Tensor)
    },
    **{
        f: (_whole_extreme_fits, _extreme_group(torch.amax))
        for f in _functions("max", torch, torch.Tensor)
    },
    **{
        f: (_whole_extreme_fits, _extreme_group(torch.amin))
        for f in _functions("min", torch, torch.Tensor)
    },
    **{
        f: (_whole_extreme_fits, _extreme_group(getattr(torch, f.__name__)))
        for f in _functions("all any", torch, torch.Tensor)
    },
    # (torch.distributions' argument checks: whether every value holds, one bool)
    torch._is_all_true: (_whole_extreme_fits, _extreme_group(torch.all)),
    torch._is_any_true: (_whole_extreme_fits, _extreme_group(torch.any)),
    torch._C._nn.pad_sequence: (lambda args, kwargs: True, _pad_sequence_group),
    # A batch norm subclass's super().forward(x) in training mode (patches._norm_forward),
    # a norm call that updates running statistics (patches.running_norm).
    batch_norm_forward: (_norm_forward_fits, _merged_batch_norm),
    running_norm: (_running_norm_fits, _running_norm_group),
    **{f: (_two_batched_operands, _matmul_group) for f in _MATMUL},
    # A write into a buffer, out of place (buffers._put), at an int or slice index; the part
    # of a buffer a view sees, and a write through it (buffers._region, _put_region).
    **{f: (_reshape_fits, _reshape_group) for f in _functions("reshape view", torch, torch.Tensor)},
    torch.broadcast_tensors: (_broadcast_fits, None),  # (fits gives the group's function)
    **{f: (_whole_extreme_fits, _t_group) for f in _functions("t", torch, torch.Tensor)},
    buffers._put: (_put_fits, _put_group),
    buffers._region: (_region_fits, _region_group),
    buffers._put_region: (_region_fits, _put_region_group),
    # bmm of two per-example stacks of matrices (attention written for a batch of one,
    # ``torch.bmm(w.unsqueeze(0), mem.unsqueeze(0))``): matmul's batched call is bmm's.
    **{f: (_two_batched_stacks, _matmul_group) for f in _functions("bmm", torch, torch.Tensor)},
}


def _padded_module(module: nn.Module) -> bool:
    """Whether calls of ``module`` on values of several shapes may share a group that runs
    padded with zeros (see ``_PADDED``): modules that compute each row on its own (these
    classes exactly: a subclass may compute otherwise)."""
    if type(module) is nn.Embedding:
        return module.max_norm is None  # (max_norm renormalises the rows it looks up)
    if type(module) is nn.Sequential:  # (a feed-forward block of such modules)
        return len(module) > 0 and all(_padded_module(m) for m in module)
    if type(module) in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
        # Zeros at the end of a sequence (an image's height and width) are what the conv's
        # own zero padding reads there: each position an example's output keeps reads its
        # input and that padding alone, whatever its stride, dilation or groups.
        return module.padding_mode == "zeros" or not any(module._reversed_padding_repeated_twice)
    return type(module) in (nn.Linear, nn.LayerNorm, nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Identity)


def _polymorphic_module(module: nn.Module) -> bool:
    if isinstance(module, nn.Sequential):
        return all(_polymorphic_module(m) for m in module)
    return isinstance(module, _POLYMORPHIC_MODULES)


# torch.nn's transformer modules (these classes exactly: a subclass may compute otherwise),
# called per example on a batch of one (``enc(src[None])``, ``dec(tgt, mem, tgt_mask=m)``,
# ``model(src[None], tgt[None], tgt_mask=m)``, batch first or not): per class its sequences,
# the one its output is shaped as, the one whose length may differ between examples
# (padded, the keys of some attention), the attention masks that then mask the padding
# (each with the sequence its queries come from), the attention masks that must be one
# value for the whole group, and the causal hints that must be off where it pads.
_ENCODER = (("src",), "src", "src")
_DECODER = (("tgt", "memory"), "tgt", "memory", (("memory_mask", "tgt"),), ("tgt_mask",))
_TRANSFORMERS: dict[type, tuple[Any, ...]] = {
    nn.TransformerEncoderLayer: (*_ENCODER, (("src_mask", "src"),), ("src_mask",), ("is_causal",)),
    nn.TransformerEncoder: (*_ENCODER, (("mask", "src"),), ("mask",), ("is_causal",)),
    nn.TransformerDecoderLayer: (*_DECODER, ("memory_is_causal",)),
    nn.TransformerDecoder: (*_DECODER, ("memory_is_causal",)),
    nn.Transformer: (
        ("src", "tgt"),
        "tgt",
        "src",
        (("src_mask", "src"), ("memory_mask", "tgt")),
        ("src_mask", "tgt_mask", "memory_mask"),
        ("src_is_causal", "memory_is_causal"),
    ),
}
_FORWARD_NAMES: dict[type, tuple[str, ...]] = {}
# The modules whose calls ran one per example for their masks (said once each).
_SAID_MASKS: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_LOG = logging.getLogger("fold.autobatch.ops")


class _Transformer:
    """How a group of calls of a torch.nn transformer module runs as ONE call (see
    ``_transformer_layout`` and ``_TRANSFORMERS``): the module, its forward's argument
    names, the batch dim (0: batch first), the number of heads, and its class's layout."""

    __slots__ = (
        "batch_dim",
        "causal",
        "heads",
        "keyed",
        "masks",
        "module",
        "names",
        "out",
        "pads",
        "seqs",
    )

    def __init__(
        self, module: nn.Module, names: tuple[str, ...], batch_dim: int, heads: int
    ) -> None:
        self.module, self.names, self.batch_dim, self.heads = module, names, batch_dim, heads
        spec = _TRANSFORMERS[type(module)]
        self.seqs, self.out, self.keyed, self.pads, self.masks, self.causal = spec

    def bind(self, args: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        bound = dict(zip(self.names, args))
        bound.update(kwargs)
        return bound

    def output_like(self, args: list[Any], kwargs: dict[str, Any]) -> torch.Tensor:
        """An empty tensor of the shape a call of the module on one example's values (the
        op's template: slots in place of its sequences) returns: its ``out`` sequence's."""
        meta = self.bind(args, kwargs)[self.out].meta
        return torch.empty(meta.shape, dtype=meta.dtype, device=meta.device)

    def merge(self, t: torch.Tensor) -> torch.Tensor:
        """A group's stacked sequences, each a batch of one (n, 1, L, D) or (n, L, 1, D), as
        one batch: (n, L, D) batch first, else (L, n, D)."""
        return t.flatten(0, 1) if self.batch_dim == 0 else t.squeeze(2).transpose(0, 1)

    def split(self, out: torch.Tensor) -> torch.Tensor:
        """``merge`` undone on the module's output: n first, each a batch of one."""
        return out.unsqueeze(1) if self.batch_dim == 0 else out.transpose(0, 1).unsqueeze(2)

    def call(
        self, bound: dict[str, Any], n: int, padding: tuple[str, ...] = ()
    ) -> torch.Tensor | None:
        """The module's one call on the group's ``bound`` values (sequences merged; each
        attention mask the one value all examples gave, but those named in ``padding``, the
        masks of the padding made for the merged batch), split back; None where the
        examples' masks differ."""
        kwargs = {}
        for name, v in bound.items():
            if name in self.seqs:
                v = self.merge(v)
            elif name in padding:
                pass
            elif name in self.masks and isinstance(v, torch.Tensor) and v.dim() == 3:
                if not bool((v == v[:1]).all()):
                    return None
                v = v[0]
            kwargs[name] = v
        return self.split(_call_module(self.module, **kwargs))

    def per_example(self, bound: dict[str, Any], n: int) -> torch.Tensor:
        """The group's calls one by one (masks that differ between examples), said once
        per module."""
        if self.module not in _SAID_MASKS:
            _SAID_MASKS.add(self.module)
            _LOG.warning(
                "autobatch: %s: its examples' attention masks differ; its groups run one "
                "call per example (a mask that every example makes alike runs them as one "
                "call)",
                type(self.module).__name__,
            )
        return torch.stack(_one_by_one(self.module, bound, self.seqs, n))

    def merged(self, op: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """A group of calls of the module (``op``'s), each on a batch of one, as ONE call:
        the examples' sequences merged into one batch (every row's output is computed from
        its own sequences alone), their attention mask the one they all gave (else one call
        per example)."""
        bound = self.bind(args, kwargs)
        n = bound[self.seqs[0]].shape[0]
        out = self.call(bound, n)
        return self.per_example(bound, n) if out is None else out

    def parts(self, op: Any, parts: list[tuple[Any, ...]]) -> Any:
        """``padded_call`` of ``op``'s group whose parts differ in the length of the
        sequence attention reads as keys (a decoder's memories, an encoder's sources): that
        sequence padded with zeros to the longest, an attention mask per example and head
        past each one's length, ONE call; the outputs cut back to each part's length (an
        encoder's) or one tensor of all the parts' rows (a decoder's, whose outputs are its
        targets' shape).  Per part its own call where anything else differs between the
        parts, the causal hint is set, or padding would more than double the sequences."""
        binds = [self.bind(*_fill(op.run_args, values)) for values in parts]
        keyed, dim = self.keyed, 2 if self.batch_dim == 0 else 1  # (L in the stacked values)
        first = binds[0]
        lengths = [b[keyed].shape[dim] for b in binds]
        counts = [b[keyed].shape[0] for b in binds]
        big = max(lengths)
        if (
            not _alike(binds, (keyed,), self.seqs)
            or any(first.get(mask) is not None for mask, _ in self.pads)
            or any(first.get(hint) for hint in self.causal)
            or big * sum(counts) > 2 * sum(k * n for k, n in zip(counts, lengths)) + 64
        ):
            return [(op._run(values),) for values in parts]
        bound = dict(first)
        for name in self.seqs:
            column = [b[name] for b in binds]
            bound[name] = torch.cat(
                [_padded(t, dim, big) for t in column] if name == keyed else column
            )
        # The padding masked where attention reads the keyed sequence: an attention mask per
        # example and head (True: not read), not a key padding mask (torch checks one through
        # its symbolic shapes, which import sympy on their first use: a quarter second).
        device = bound[keyed].device
        for mask, query in self.pads:
            queries = bound[query].shape[dim]
            bound[mask] = _keys_mask(lengths, counts, self.heads, queries, device)
        out = self.call(bound, sum(counts), tuple(mask for mask, _ in self.pads))
        if out is None:  # (masks that differ between the examples of one part)
            return [(op._run(values),) for values in parts]
        if self.out != keyed:  # the targets' shape: one output of all the parts' rows
            return PaddedOutputs([out])
        return PaddedOutputs([_cut(out, counts, [(dim, n) for n in lengths])])


def _transformer_layout(
    module: nn.Module, args: list[Any], kwargs: dict[str, Any]
) -> _Transformer | None:
    """A ``_Transformer`` for a call of one of ``_TRANSFORMERS`` whose sequences are each a
    per-example value that is a batch of one (3-D, 1 in the module's batch dim), whose
    attention masks are none, a shared tensor or a per-example matrix, whose other masks
    (key padding, memory) are not given, and whose causal hints are bools; None for any
    other call (it runs under vmap)."""
    t = type(module)
    if t not in _TRANSFORMERS:
        return None
    names = _FORWARD_NAMES.get(t)
    if names is None:
        import inspect

        names = _FORWARD_NAMES[t] = tuple(inspect.signature(t.forward).parameters)[1:]
    if len(args) > len(names) or any(k not in names or k in names[: len(args)] for k in kwargs):
        return None
    first = module
    if t is nn.Transformer:  # (its own encoder's first layer: of torch's own, or not merged)
        if (
            type(module.encoder) is not nn.TransformerEncoder
            or type(module.decoder) is not nn.TransformerDecoder
        ):
            return None
        module_ = module.encoder
    else:
        module_ = module
    if isinstance(module_, (nn.TransformerEncoder, nn.TransformerDecoder)):
        if not len(module_.layers):  # (it returns its input itself, or its norm of it)
            return None
        first = module_.layers[0]
    attn = first.self_attn
    layout = _Transformer(module, names, 0 if attn.batch_first else 1, attn.num_heads)
    bound = layout.bind(args, kwargs)
    for name in layout.seqs:
        s = bound.get(name)
        if (
            type(s) is not _Slot
            or s.ragged
            or s.meta.ndim != 3
            or s.meta.shape[layout.batch_dim] != 1
        ):
            return None
    for name, v in bound.items():
        if name in layout.seqs:
            continue
        if name in layout.masks:
            if v is None or (isinstance(v, torch.Tensor) and v.dim() == 2):
                continue
            if type(v) is _Slot and not v.ragged and v.meta.ndim == 2:
                continue
            return None
        if name.endswith("is_causal"):
            if v is None or type(v) is bool:
                continue
            return None
        if v is not None:  # (key padding masks and memory masks of the user's own)
            return None
    return layout


def _one_by_one(
    module: nn.Module, bound: dict[str, Any], seqs: tuple[str, ...], n: int
) -> list[Any]:
    """A transformer module's or attention's group run one call per example (masks that
    differ between examples): per example its sequences' rows and its own mask (a
    per-example mask is stacked, 3-D; a shared one is 2-D), the other arguments as given;
    the calls' results."""
    outs = []
    for i in range(n):
        one = {
            name: v[i] if isinstance(v, torch.Tensor) and (name in seqs or v.dim() == 3) else v
            for name, v in bound.items()
        }
        outs.append(_call_module(module, **one))
    return outs


def _alike(binds: list[dict[str, Any]], free: tuple[str, ...], seqs: tuple[str, ...]) -> bool:
    """Whether the parts' bound values (``binds``) agree in all but the sequences ``free``
    (whose lengths may differ): the other sequences in shape, masks in value, the rest
    equal."""
    first = binds[0]
    for name, v in first.items():
        if name in free:
            continue
        others = [b[name] for b in binds[1:]]
        if isinstance(v, torch.Tensor):
            if name in seqs:
                if any(o.shape[1:] != v.shape[1:] for o in others):
                    return False
            else:  # an attention mask: one value in every part
                row = v[0] if v.dim() == 3 else v
                if any(o.shape[-2:] != row.shape or not bool((o == row).all()) for o in others):
                    return False
        elif any(o != v for o in others):
            return False
    return True


def _padded(t: torch.Tensor, dim: int, big: int) -> torch.Tensor:
    """``t`` with zeros after its end along ``dim``, to ``big``."""
    n = t.shape[dim]
    if n >= big:
        return t
    shape = list(t.shape)
    shape[dim] = big - n
    return torch.cat([t, t.new_zeros(shape)], dim)


def _keys_mask(
    lengths: list[int], counts: list[int], heads: int, queries: int, device: Any
) -> torch.Tensor:
    """An attention mask for a merged batch of parts whose keys were padded: per example
    and head (``counts[p]`` examples of part p, keys ``lengths[p]`` long), True (not read)
    past its keys' length; ``(examples * heads, queries, longest)``."""
    big, total = max(lengths), sum(counts)
    rows = torch.tensor([n for n, k in zip(lengths, counts) for _ in range(k)])
    past = (torch.arange(big)[None, :] >= rows[:, None]).to(device)
    return past[:, None, None, :].expand(total, heads, queries, big).reshape(-1, queries, big)


def _cut(out: torch.Tensor, counts: list[int], cuts: list[Any]) -> list[torch.Tensor]:
    """The rows of each part (``counts[p]`` of them, in order), each cut back to its part's
    length along a dim (``cuts[p]``: ``(dim, length)``, or a list of such)."""
    results, start = [], 0
    for k, cut in zip(counts, cuts):
        t = out[start : start + k]
        for d, n in cut if type(cut) is list else [cut]:
            t = t.narrow(d, 0, n)
        results.append(t)
        start += k
    return results


# nn.MultiheadAttention's forward's argument names.
_ATTENTION_NAMES = (
    "query",
    "key",
    "value",
    "key_padding_mask",
    "need_weights",
    "attn_mask",
    "average_attn_weights",
    "is_causal",
)


class _Attention:
    """How a group of ``nn.MultiheadAttention`` calls runs as ONE call (see
    ``_attention_layout``): query, key and value per example, each a batch of one (batch
    first or not) or unbatched (L, E); queries, and keys with their values, of several
    lengths padded to the longest, an attention mask per example and head past its keys'
    length; the outputs (and weights) cut back to each example's lengths."""

    __slots__ = ("batch_dim", "heads", "module", "unbatched")

    seqs = ("query", "key", "value")

    def __init__(self, module: nn.MultiheadAttention, unbatched: bool) -> None:
        self.module, self.unbatched = module, unbatched
        self.batch_dim = 0 if module.batch_first else 1
        self.heads = module.num_heads

    def bind(self, args: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        bound = dict(zip(_ATTENTION_NAMES, args))
        bound.update(kwargs)
        return bound

    def output_like(self, args: list[Any], kwargs: dict[str, Any]) -> None:
        return None  # (its shapes are inferred on zeros: its weights' shape varies)

    @property
    def seq_dim(self) -> int:
        """The dim of a sequence's length in the group's stacked per-example values."""
        return 1 if self.unbatched or self.batch_dim == 1 else 2

    def merge(self, t: torch.Tensor) -> torch.Tensor:
        """Stacked per-example sequences as one batch: (n, L, E) batch first, else (L, n, E)."""
        if not self.unbatched:
            t = t.flatten(0, 1) if self.batch_dim == 0 else t.squeeze(2)
        return t if self.batch_dim == 0 else t.transpose(0, 1)

    def split(self, out: torch.Tensor) -> torch.Tensor:
        if self.batch_dim == 1:
            out = out.transpose(0, 1)
        if self.unbatched:
            return out
        return out.unsqueeze(1) if self.batch_dim == 0 else out.unsqueeze(2)

    def call(self, bound: dict[str, Any], padding: bool = False) -> tuple[torch.Tensor, ...] | None:
        """The module's one call on the group's ``bound`` values (sequences merged, the
        attention mask the one value all examples gave, or with ``padding`` the mask made
        for the merged batch), its outputs split back (None given up: the weights not asked
        for); None where the examples' masks differ."""
        kwargs = {}
        for name, v in bound.items():
            if name in self.seqs:
                v = self.merge(v)
            elif name == "attn_mask" and not padding and isinstance(v, torch.Tensor):
                if v.dim() == 3:  # (a per-example mask, stacked)
                    if not bool((v == v[:1]).all()):
                        return None
                    v = v[0]
            kwargs[name] = v
        out, weights = _call_module(self.module, **kwargs)
        out = self.split(out)
        if weights is None:
            return (out,)
        return out, weights if self.unbatched else weights.unsqueeze(1)

    def merged(self, op: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        """A group of calls of the module (``op``'s) on values of one shape as ONE call
        (one call per example where their attention masks differ)."""
        bound = self.bind(args, kwargs)
        got = self.call(bound)
        if got is not None:
            return got
        outs = [
            [t for t in out if t is not None]
            for out in _one_by_one(self.module, bound, self.seqs, bound["query"].shape[0])
        ]
        return tuple(torch.stack([o[j] for o in outs]) for j in range(len(outs[0])))

    def parts(self, op: Any, parts: list[tuple[Any, ...]]) -> Any:
        """``padded_call`` of ``op``'s group whose parts differ in their queries' or keys'
        lengths (self-attention over each example's own sequence): queries padded with
        zeros to the longest, keys and values too, an attention mask per example and head
        past its keys' length, ONE call; each part's outputs cut back to its lengths.  Per
        part its own call where an attention mask or the causal hint is given, or padding
        would more than double the sequences."""
        binds = [self.bind(*_fill(op.run_args, values)) for values in parts]
        first, dim = binds[0], self.seq_dim
        queries = [b["query"].shape[dim] for b in binds]
        keys = [b["key"].shape[dim] for b in binds]
        counts = [b["query"].shape[0] for b in binds]
        lq, lk = max(queries), max(keys)
        held = sum(k * (q + s) for k, q, s in zip(counts, queries, keys))
        if (
            not _alike(binds, self.seqs, ())
            or any(
                b[name].shape[1:dim] + b[name].shape[dim + 1 :]
                != first[name].shape[1:dim] + first[name].shape[dim + 1 :]
                for b in binds
                for name in self.seqs
            )
            or first.get("attn_mask") is not None
            or first.get("is_causal")
            or (lq + lk) * sum(counts) > 2 * held + 64
        ):
            return [op._run(values) for values in parts]
        bound = dict(first)
        for name in self.seqs:
            big = lq if name == "query" else lk
            bound[name] = torch.cat([_padded(b[name], dim, big) for b in binds])
        bound["attn_mask"] = _keys_mask(keys, counts, self.heads, lq, bound["key"].device)
        got = self.call(bound, padding=True)
        if got is None:
            return [op._run(values) for values in parts]
        outs = [
            got[0] if len(set(queries)) == 1 else _cut(got[0], counts, [(dim, q) for q in queries])
        ]
        if len(got) > 1:  # the weights: (..., queries, keys)
            outs.append(_cut(got[1], counts, [[(-2, q), (-1, s)] for q, s in zip(queries, keys)]))
        return PaddedOutputs(outs)


def _attention_layout(
    module: nn.Module, args: list[Any], kwargs: dict[str, Any]
) -> _Attention | None:
    """An ``_Attention`` for a call of ``nn.MultiheadAttention`` (that class exactly) whose
    query, key and value are per-example values, all a batch of one (3-D, 1 in the batch
    dim) or all unbatched (2-D), without a key padding mask of the user's own, its
    attention mask none, shared or a per-example matrix; None for any other call (it runs
    under vmap)."""
    if type(module) is not nn.MultiheadAttention or len(args) > len(_ATTENTION_NAMES):
        return None
    if any(k not in _ATTENTION_NAMES or k in _ATTENTION_NAMES[: len(args)] for k in kwargs):
        return None
    bound = dict(zip(_ATTENTION_NAMES, args))
    bound.update(kwargs)
    seqs = [bound.get(name) for name in _Attention.seqs]
    if any(type(s) is not _Slot or s.ragged for s in seqs):
        return None
    ranks = {s.meta.ndim for s in seqs}
    if ranks == {2}:
        layout = _Attention(module, True)
    elif ranks == {3}:
        layout = _Attention(module, False)
        if any(s.meta.shape[layout.batch_dim] != 1 for s in seqs):
            return None
    else:
        return None
    if bound.get("key_padding_mask") is not None:
        return None
    mask = bound.get("attn_mask")
    if not (
        mask is None
        or (isinstance(mask, torch.Tensor) and mask.dim() == 2)
        or (type(mask) is _Slot and not mask.ragged and mask.meta.ndim == 2)
    ):
        return None
    for name in ("need_weights", "average_attn_weights", "is_causal"):
        if name in bound and type(bound[name]) is not bool:
            return None
    return layout
