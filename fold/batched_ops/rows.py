"""Whether a model's own code keeps the rows of a batch apart (``RowCheck``).

A ``BatchModule`` runs the model's own code (its ``forward``, written for one model's
``(b, ...)`` batch) on the rows of all N models merged into one leading dim.  That gives each
model its own result only where the code treats every row alone: ``relu(x)``, ``x.view(-1,
784)``, ``h @ w``, ``h.softmax(-1)``.  Code that reads across rows -- ``h - h.mean(0)``, a
loss reduced over the batch, attention between the samples of a batch, ``torch.cat([h, h[:1]])``
-- would mix the models' rows (silently: the shapes still fit).

``RowCheck`` is a torch function mode that watches the first call of each kind and judges
every torch call made on a tensor of rows: it keeps the rows apart (pointwise, along other
dims, per-row matrix products, views that keep the row dim first), or it may not.  Calls of
the batched layers (``AbstractBatchModule`` subclasses and fold's own helpers) are trusted:
they are written for merged rows.  A call it does not know counts as one that may mix rows, so
the verdict errs on the side of running one model at a time, which is always right.
"""

from __future__ import annotations

import math
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

__all__ = ["RowCheck"]

# Calls whose every output element depends on the elements at the same place of its inputs
# (broadcasting), and conversions: they keep rows apart where the rows are the leading dim of
# the result.  Their in-place forms (``add_``) and dunders (``__add__``) count too.
_POINTWISE = frozenset(
    """abs absolute acos arccos acosh asin arcsin asinh atan arctan atan2 arctan2 atanh add
    addcdiv addcmul angle bitwise_and bitwise_not bitwise_or bitwise_xor bitwise_left_shift
    bitwise_right_shift ceil clamp clamp_min clamp_max clip copysign cos cosh deg2rad div
    divide true_divide floor_divide eq ne lt le gt ge greater greater_equal less less_equal
    not_equal equal_nan erf erfc erfinv exp exp2 expm1 float_power floor frac fmod heaviside
    hypot i0 igamma igammac isfinite isinf isnan isneginf isposinf isreal lerp lgamma log
    log10 log1p log2 logaddexp logaddexp2 logical_and logical_not logical_or logical_xor logit
    maximum minimum fmax fmin mul multiply mvlgamma nan_to_num neg negative nextafter
    polygamma positive pow rad2deg reciprocal remainder round rsqrt sigmoid sign signbit sgn
    sin sinc sinh sqrt square sub subtract tan tanh trunc fix where masked_fill xlogy
    special_expit relu relu6 leaky_relu elu selu celu gelu silu mish softplus softsign
    hardtanh hardsigmoid hardswish hardshrink softshrink tanhshrink threshold logsigmoid
    rrelu prelu dropout alpha_dropout feature_alpha_dropout dropout1d dropout2d dropout3d
    bernoulli poisson bucketize
    real imag conj
    __add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__
    __truediv__ __rtruediv__ __itruediv__ __div__ __rdiv__ __idiv__ __floordiv__
    __rfloordiv__ __ifloordiv__ __mod__ __rmod__ __imod__ __pow__ __rpow__ __ipow__ __neg__
    __pos__ __abs__ __invert__ __and__ __rand__ __iand__ __or__ __ror__ __ior__ __xor__
    __rxor__ __ixor__ __lshift__ __rlshift__ __ilshift__ __rshift__ __rrshift__ __irshift__
    __eq__ __ne__ __lt__ __le__ __gt__ __ge__""".split()
)

# Calls whose result is their first argument's elements, converted or copied (the rest of
# their arguments give a type or a device): the rows stay where they are.
_CONVERT = frozenset(
    """float double half bfloat16 int long short bool byte char to type type_as contiguous
    clone detach detach_ requires_grad_ cpu cuda zero_ fill_ zeros_like ones_like empty_like
    full_like rand_like randn_like randint_like retain_grad pin_memory""".split()
)

# Calls that act along the dims they are given: they keep rows apart unless one of those
# dims is the rows' (or none is given: the whole tensor).  name -> (where the dim is given:
# positional index and keyword names, the default where none is given).  ``_REDUCING``
# remove the dims they act along (unless keepdim=True).
_ALONG: dict[str, tuple[int, tuple[str, ...], Any]] = {}
for _names, _pos, _kw, _default in (
    (
        "sum mean nansum nanmean prod amax amin all any std var std_mean var_mean "
        "count_nonzero logsumexp max min argmax argmin median nanmedian aminmax",
        1,
        ("dim",),
        None,
    ),
    ("softmax log_softmax softmin", 1, ("dim",), None),
    ("cumsum cumprod cummax cummin logcumsumexp diff sort argsort msort", 1, ("dim",), -1),
    ("kthvalue", 2, ("dim",), -1),
    ("mode", 1, ("dim",), -1),
    ("topk", 2, ("dim",), -1),
    ("normalize cosine_similarity", 2, ("dim",), 1),
    ("glu", 1, ("dim",), -1),
    ("gumbel_softmax", 4, ("dim",), -1),
    ("norm linalg_vector_norm linalg_norm", 2, ("dim",), None),
    ("take_along_dim", 2, ("dim",), None),
    ("flip", 1, ("dims",), None),
    ("roll", 2, ("dims",), None),
    (
        "unbind select narrow index_select gather scatter scatter_add scatter_reduce index_add "
        "index_copy index_fill",
        1,
        ("dim",),
        0,
    ),
    ("split chunk tensor_split", 2, ("dim",), 0),
    ("repeat_interleave", 2, ("dim",), None),
    ("tensor_unfold", 1, ("dimension",), None),
    ("tril triu", 99, (), (-2, -1)),
):
    for _name in _names.split():
        _ALONG[_name] = (_pos, _kw, _default)
_REDUCING = frozenset(
    """sum mean nansum nanmean prod amax amin all any std var std_mean var_mean count_nonzero
    logsumexp max min argmax argmin median nanmedian aminmax kthvalue mode norm
    linalg_vector_norm linalg_norm cosine_similarity unbind select""".split()
)
_JOIN = frozenset("cat concat concatenate stack".split())

# Calls that lay the elements out in another shape, in their order: the rows stay apart
# where the result has a dim of the rows' size after as many elements as came before it.
_RESHAPE = frozenset(
    "view reshape view_as reshape_as flatten unflatten squeeze unsqueeze ravel".split()
)
# Calls that repeat the elements: new dims before the old, and sizes that must leave the
# rows' dim alone.
_EXPAND = frozenset("expand expand_as broadcast_to repeat tile".split())
_TRANSPOSE = frozenset("t adjoint transpose swapaxes swapdims permute movedim moveaxis".split())

# Matrix products: per-row where the rows are a batch dim of the product.
_MATMUL = frozenset("matmul mm bmm __matmul__ __rmatmul__ dot vdot mv inner".split())

# Calls on a batch-first input (N, C, ...): the leading dim is the batch; the tensor needs as
# many dims as the batched form has.
_BATCH_FIRST = {
    **dict.fromkeys(
        "conv1d conv_transpose1d max_pool1d avg_pool1d lp_pool1d adaptive_max_pool1d "
        "adaptive_avg_pool1d max_pool1d_with_indices adaptive_max_pool1d_with_indices".split(),
        3,
    ),
    **dict.fromkeys(
        "conv2d conv_transpose2d max_pool2d avg_pool2d lp_pool2d adaptive_max_pool2d "
        "adaptive_avg_pool2d max_pool2d_with_indices adaptive_max_pool2d_with_indices "
        "pixel_shuffle pixel_unshuffle unfold fold grid_sample affine_grid".split(),
        4,
    ),
    **dict.fromkeys(
        "conv3d conv_transpose3d max_pool3d avg_pool3d adaptive_max_pool3d "
        "adaptive_avg_pool3d max_pool3d_with_indices".split(),
        5,
    ),
    "group_norm": 2,
    "local_response_norm": 3,
    "interpolate": 3,
    "upsample": 3,
    "scaled_dot_product_attention": 3,
    "embedding_bag": 2,
    "multinomial": 2,
    "cdist": 3,
}

# Losses: per row with reduction="none"; reduced over the batch otherwise.
_LOSSES = frozenset(
    """cross_entropy nll_loss mse_loss l1_loss smooth_l1_loss huber_loss binary_cross_entropy
    binary_cross_entropy_with_logits kl_div poisson_nll_loss gaussian_nll_loss
    soft_margin_loss multilabel_soft_margin_loss multilabel_margin_loss multi_margin_loss
    hinge_embedding_loss cosine_embedding_loss margin_ranking_loss triplet_margin_loss
    triplet_margin_with_distance_loss""".split()
)

# Calls that make a tensor from a size alone: the same in every row, wherever the rows are.
_FILLS = frozenset(
    "zeros ones full empty rand randn randint normal new_zeros new_ones new_full new_empty".split()
)

# Of those, the ones that also take values (a fill, bounds, a mean): their sizes come as a
# sequence, so a count given alone is a value.
_VALUED_FILLS = frozenset("full new_full randint normal".split())

# Calls that take sizes: the rows' size read from a tensor may be given to them.
_SIZES = _FILLS | frozenset(
    "view reshape expand broadcast_to unflatten repeat tile arange narrow".split()
)

# Calls that read no values: sizes, types, flags.
_METADATA = frozenset(
    """size dim numel __len__ is_floating_point is_complex is_contiguous element_size stride
    storage_offset data_ptr __format__ __repr__ __hash__ get_device nelement ndimension
    untyped_storage has_names""".split()
)

# Tensor properties: name -> the dim the rows go to, from (their dim, the tensor's dims).
_PROPERTIES: dict[str, Callable[[int, int], int]] = {
    "T": lambda d, n: n - 1 - d,
    "H": lambda d, n: n - 1 - d,
    "mT": lambda d, n: {n - 2: n - 1, n - 1: n - 2}.get(d, d),
    "mH": lambda d, n: {n - 2: n - 1, n - 1: n - 2}.get(d, d),
}

_ANYWHERE = -1  # a tensor the same in every row (zeros(R, h)): rows wherever the others' are
_NO_ROWS = -2  # a result that holds no rows (a size, a constant made of constants)


class RowCheck(TorchFunctionMode):
    """Watches the torch calls of a model's code, run on ``rows`` merged rows (``batch`` rows
    of each model), and keeps the first call that may mix rows in ``found`` (a description;
    None while none has).  Every tensor made from rows keeps the dim its rows are in (an
    RNN's states ``(layers, R, H)``: dim 1), so ``h[-1]``, ``h.transpose(0, 1)`` follow."""

    def __init__(
        self,
        rows: int,
        batch: int,
        inputs: Sequence[torch.Tensor],
        stacked: dict[int, str] | None = None,
    ) -> None:
        super().__init__()
        self.rows = rows  # merged: the rows of all the models the call runs
        self.batch = batch  # each model's
        self.found: str | None = None
        # The batched layers' parameters and buffers (id -> name), stacked (N, ...): the
        # model's own code must not read them (``stacked_use`` says where it did).
        self.stacked = stacked or {}
        self.stacked_use: str | None = None
        # id -> (a weak reference, the rows' dim); ids of dead tensors are reused: the
        # reference tells
        self._dims: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        for t in inputs:
            self.mark(t, 0)

    def entering(self, layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A batched layer's call (a forward pre-hook): its arguments' rows must be where
        the layer takes them (``row_dims``; None for a tensor it may take as the same for
        every model, such as the vmap fallback's keyword tensors)."""
        if self.found is not None:
            return
        name = type(layer).__name__
        for t, want in zip(_tensors((args, kwargs)), layer.row_dims(args, kwargs)):
            d = self.row_dim(t)
            at = 0 if want is None else want
            fits = t.dim() > at and t.shape[at] == self.rows
            if d is None and want is None and not _stranger(self, t, at):
                continue  # every model's (the fallback tells rows by their length)
            if d is None:
                why = "a tensor made another way, not of the batch's rows"
            elif d == _ANYWHERE:
                why = None if fits else "a tensor not of the batch's rows"
            else:
                why = None if d == at else f"rows in dim {d} where it takes them in dim {at}"
            if why is not None:
                self.found = f"gives {name} {why} ({_place()})"
                return

    def returning(self, out: Any) -> None:
        """The call's result: each tensor must hold rows in its dim 0 (its models' rows are
        split there)."""
        for t in _tensors(out):
            if self.found is not None:
                return
            d = self.row_dim(t)
            if d == 0 or d == _ANYWHERE and t.dim() and t.shape[0] == self.rows:
                continue
            where = "holds no rows" if d in (None, _ANYWHERE) else f"holds its rows in dim {d}"
            self.found = f"returns a tensor of shape {tuple(t.shape)} that {where}"

    def mark(self, t: Any, d: int) -> None:
        if not isinstance(t, torch.Tensor):
            return
        if d == _ANYWHERE or 0 <= d < t.dim() and t.shape[d] == self.rows:
            self._dims[id(t)] = (weakref.ref(t), d)

    def row_dim(self, t: Any) -> int | None:
        """The dim of ``t``'s rows; ``_ANYWHERE`` for a tensor the same in every row; None
        for a tensor not made from rows."""
        if not isinstance(t, torch.Tensor):
            return None
        entry = self._dims.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.found is not None:
            return out
        name = _name_of(func)
        trusted = _trusted()
        if name in (".shape", "size", "numel", "nelement", "__len__") and not trusted:
            d = self.row_dim(args[0]) if args else None
            if d is not None and d >= 0:
                if name == "__len__":  # (len() makes a plain int of it: h / len(x) unseen)
                    if d == 0:
                        self.found = f"reads the batch's size with len() ({_place()})"
                    return out
                return _counted(self, out, d, args, kwargs)
        if not trusted:
            if name not in _SIZES:  # h / x.size(0): a value, not a size
                values = pytree.tree_leaves((args, kwargs))
            elif name in _VALUED_FILLS:  # full((n, h), n): n as the fill is a value
                values = [a for a in args if not isinstance(a, (tuple, list))]
                values += [v for k, v in kwargs.items() if k != "size"]
            else:
                values = []
            if any(isinstance(v, _RowCount) for v in values):
                self.found = f"{_called(func, name)} uses the batch's size as a value ({_place()})"
                return out
        if self.stacked and not trusted and self.stacked_use is None:
            for t in pytree.tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and id(t) in self.stacked:
                    self.stacked_use = (
                        f"reads the layer's tensor {self.stacked[id(t)]} ({_called(func, name)} "
                        f"at {_place()})"
                    )
                    self.found = self.stacked_use
                    return out
        if name == "new_tensor":  # data of its own, a tensor's type and device
            return out
        if name in _FILLS:
            for t in pytree.tree_leaves(out):
                self.mark(t, _ANYWHERE)
            return out
        if trusted:  # a batched layer's: what it makes with a dim of R is rows
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and self.rows in t.shape:
                    self.mark(t, list(t.shape).index(self.rows))
            return out
        dims = [self.row_dim(t) for t in pytree.tree_leaves((args, kwargs))]
        if all(d is None for d in dims):
            if name in _EXPAND and any(isinstance(v, _RowCount) for v in pytree.tree_leaves(args)):
                self.mark(out, _ANYWHERE)  # arange(t).expand(x.size(0), t): the same every row
            return out
        if all(d is None or d == _ANYWHERE for d in dims):
            d: int | str = _ANYWHERE if name in _POINTWISE or name in _CONVERT else _NO_ROWS
        else:
            d = _judge(self, name, args, kwargs, out)
        if isinstance(d, str):
            self.found = f"{_called(func, name)} {d} ({_place()})"
            return out
        for t in pytree.tree_leaves(out):
            self.mark(t, d)
        return out


class _RowCount(int):
    """The size of the rows' dim as the model's code reads it (``x.shape[0]``): merged, it
    is all the models' rows, so arithmetic on it (``h / x.size(0)``, ``n - 1``, ``n == 1``)
    would differ from each model's; a size given to torch (``view(n, -1)``, ``zeros(n, h)``)
    or multiplied by another size (``view(n * t, -1)``) is fine."""

    check: RowCheck

    def __new__(cls, value: int, check: RowCheck) -> _RowCount:
        out = super().__new__(cls, value)
        out.check = check
        return out

    def _flag(self, op: str) -> None:
        if self.check.found is None:
            self.check.found = f"uses the batch's size in {op} ({_place()})"

    def __mul__(self, other: Any) -> Any:
        if isinstance(other, int) and not isinstance(other, bool):
            return _RowCount(_plain(self) * _plain(other), self.check)
        self._flag("a product")
        return _plain(self) * other

    __rmul__ = __mul__

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, _RowCount):
            self._flag("a comparison")
        return _plain(self) == other

    def __ne__(self, other: Any) -> bool:
        return not self.__eq__(other)

    __hash__ = int.__hash__


# The value of an int (a plain int of a _RowCount), without its __int__ (which flags).
_plain = int.__index__


def _arithmetic(op: str) -> Callable[..., Any]:
    plain = getattr(int, op)
    what = (
        "a comparison"
        if op in ("__lt__", "__le__", "__gt__", "__ge__")
        else "a conversion"
        if op in ("__int__", "__float__", "__round__", "__trunc__", "__floor__", "__ceil__")
        else "arithmetic"
    )

    def flagged(self: _RowCount, *other: Any) -> Any:
        self._flag(what)
        return plain(_plain(self), *other)

    flagged.__name__ = op
    return flagged


for _op in (
    "__add__ __radd__ __sub__ __rsub__ __truediv__ __rtruediv__ __floordiv__ __rfloordiv__ "
    "__mod__ __rmod__ __pow__ __rpow__ __divmod__ __rdivmod__ __neg__ __float__ __lt__ "
    "__le__ __gt__ __ge__ __lshift__ __rshift__ __and__ __rand__ __or__ __ror__ __xor__ "
    "__rxor__ __rlshift__ __rrshift__ __pos__ __abs__ __invert__ "
    # (int(n), round(n), math.floor(n): a plain int, whose later use would go unseen)
    "__int__ __round__ __trunc__ __floor__ __ceil__"
).split():
    setattr(_RowCount, _op, _arithmetic(_op))


def _counted(
    check: RowCheck, out: Any, d: int, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """A shape read of a tensor of rows: the rows' size as a ``_RowCount``."""
    if isinstance(out, torch.Size):
        return torch.Size([_RowCount(s, check) if k == d else s for k, s in enumerate(out)])
    if not args[1:] and "dim" not in kwargs:  # numel(): a multiple of the rows' size
        return _RowCount(out, check)
    dims = _dims(_arg(args, kwargs, 1, ("dim",), None), args[0].dim())
    return _RowCount(out, check) if dims == [d] else out


def _name_of(func: Callable[..., Any]) -> str:
    name = getattr(func, "__name__", "")
    if name == "unfold" and getattr(func, "__qualname__", "").startswith("TensorBase"):
        return "tensor_unfold"  # x.unfold(dim, size, step): windows along a dim (not F.unfold)
    if name == "__get__":  # a property: Tensor.T, Tensor.data
        owner = getattr(func, "__self__", None)
        return "." + getattr(owner, "__name__", "?")
    return name


def _called(func: Callable[..., Any], name: str) -> str:
    if name.startswith("."):
        return f"Tensor{name}"
    if (getattr(func, "__module__", None) or "").startswith("torch.nn.functional"):
        return f"F.{name}"
    owner = (getattr(func, "__qualname__", None) or "").partition(".")[0]
    return f"Tensor.{name}" if owner in ("TensorBase", "Tensor") else f"torch.{name}"


def _trusted() -> bool:
    """Whether the torch call being judged comes from a batched layer or fold's own helpers
    (written for merged rows): the first frame outside torch decides."""
    from fold.batched_ops.core import AbstractBatchModule

    f = sys._getframe(2)
    while f is not None:
        module = f.f_globals.get("__name__", "")
        if module != "torch" and not module.startswith("torch.") and module != __name__:
            break
        f = f.f_back
    if f is None:
        return False
    if f.f_globals.get("__name__", "").startswith("fold.batched_ops"):
        return True
    return isinstance(f.f_locals.get("self"), AbstractBatchModule)


def _place() -> str:
    """file:line of the model's code that made the call."""
    f = sys._getframe(2)
    while f is not None:
        module = f.f_globals.get("__name__", "")
        if module != "torch" and not module.startswith(("torch.", "fold.")):
            return f"{f.f_code.co_filename}:{f.f_lineno}"
        f = f.f_back
    return "?"


def _arg(
    args: Sequence[Any], kwargs: dict[str, Any], pos: int, names: Sequence[str], default: Any
) -> Any:
    for k in names:
        if k in kwargs:
            return kwargs[k]
    return args[pos] if len(args) > pos else default


def _dims(value: Any, ndim: int) -> list[int] | None:
    if value is None:
        return None
    items = list(value) if isinstance(value, (tuple, list, torch.Size)) else [value]
    try:
        return [int(d) % max(ndim, 1) for d in items]
    except (TypeError, ValueError):  # a named dim
        return None


def _stranger(check: RowCheck, t: torch.Tensor, j: int) -> bool:
    """Whether ``t`` is no tensor of rows yet has the rows' size in its dim ``j``: made
    another way (``arange(x.size(0))``), its dim ``j`` would be read as the models' rows."""
    return (
        check.row_dim(t) is None
        and 0 <= j < t.dim()
        and t.shape[j] == check.rows
        and check.rows > 1
    )


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _judge(
    check: RowCheck, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
) -> int | str:
    """The dim of the rows in the result of a call with tensors of rows among its arguments,
    or why the call may mix rows."""
    base = name[:-1] if name.endswith("_") and not name.endswith("__") else name
    if name in _CONVERT:  # (requires_grad_, zero_: in-place forms named as such)
        base = name
    first = args[0] if args else None
    d = check.row_dim(first)
    if name.startswith("."):
        if d is None or d == _ANYWHERE:
            return "reads rows out of another tensor"
        move = _PROPERTIES.get(name[1:])
        return d if move is None else move(d, first.dim())
    if base in _METADATA:
        return _NO_ROWS
    if base in _CONVERT:
        return "converts a tensor made another way to rows" if d is None else d
    if base in ("max", "min") and len(args) > 1 and isinstance(args[1], torch.Tensor):
        base = "maximum"  # max(a, b): elementwise
    if base in _POINTWISE:
        return _pointwise(check, _tensors((args, kwargs)))
    if base in _LOSSES:
        if _arg(args, kwargs, 99, ("reduction",), "mean") != "none":
            return "reduces over the batch (reduction='mean' or 'sum'; reduction='none' keeps rows)"
        return _batch_first(check, _tensors((args, kwargs)), 1)
    if base in _JOIN:
        return _join(check, base, args, kwargs)
    if base in _MATMUL or base in (
        "linear",
        "bilinear",
        "baddbmm",
        "addmm",
        "einsum",
        "outer",
        "kron",
        "tensordot",
        "addbmm",
    ):
        return _product(check, base, args, kwargs)
    if d is None or d == _ANYWHERE:
        return "uses rows in an argument past its first"
    if base in _ALONG:
        return _along(check, base, d, args, kwargs)
    if base == "squeeze" and check.batch == 1:  # one row a model: squeeze drops it
        dims = _dims(_arg(args, kwargs, 1, ("dim",), None), first.dim())
        if dims is None or d in dims:
            return "squeezes the rows' dim (one row a model)"
    if base in _RESHAPE:
        return _reshaped(check, d, first, out, base, args, kwargs)
    if base in _EXPAND:
        shift = out.dim() - first.dim()
        if base in ("repeat", "tile"):
            sizes = (
                args[1:]
                if len(args) > 1 and not isinstance(args[1], (list, tuple))
                else _arg(args, kwargs, 1, ("sizes", "dims"), ())
            )
            sizes = [1] * (out.dim() - len(sizes)) + list(sizes)
            return "repeats the rows" if sizes[d + shift] != 1 else d + shift
        return d + shift
    if base in _TRANSPOSE:
        return _transposed(d, first.dim(), base, args, kwargs)
    if base in ("__getitem__", "__setitem__"):
        return _indexed(
            check,
            d,
            first,
            args[1] if len(args) > 1 else None,
            args[2:] if base == "__setitem__" else (),
        )
    if base in _BATCH_FIRST:
        if first.dim() < _BATCH_FIRST[base]:
            return "treats the rows' dim as a feature dim (an input without its batch dim)"
        return _batch_first(check, _tensors((args, kwargs)), 0)
    if base in ("layer_norm", "rms_norm"):
        shape = _arg(args, kwargs, 1, ("normalized_shape",), ())
        n = len(shape) if isinstance(shape, (list, tuple, torch.Size)) else 1
        return d if d < first.dim() - n else "normalises over the rows' dim"
    if base in ("batch_norm", "instance_norm"):
        stats = _arg(args, kwargs, 1, ("running_mean",), None)
        training = _arg(args, kwargs, 5, ("training", "use_input_stats"), base == "instance_norm")
        if (training and base == "batch_norm") or (base == "instance_norm" and stats is not None):
            return "computes statistics over the batch"
        return _batch_first(check, _tensors(args[:1]), 0)
    if base == "embedding":
        return (
            d
            if check.row_dim(_arg(args, kwargs, 1, ("weight",), None)) is None
            else "uses rows as its table"
        )
    if base == "one_hot":
        if _arg(args, kwargs, 1, ("num_classes",), -1) == -1:
            return "counts its classes over all rows (give num_classes)"
        return d
    if base == "pad":
        pad = _arg(args, kwargs, 1, ("pad",), ())
        return d if d < first.dim() - len(pad) // 2 else "pads the rows' dim"
    return "is not known to keep rows apart"


def _pointwise(check: RowCheck, tensors: list[torch.Tensor]) -> int | str:
    ndim = max(t.dim() for t in tensors)
    at = {
        check.row_dim(t) + ndim - t.dim()
        for t in tensors
        if check.row_dim(t) not in (None, _ANYWHERE)
    }
    if len(at) > 1:
        return "pairs rows at different dims"
    (p,) = at
    for t in tensors:
        j = p - (ndim - t.dim())
        if _stranger(check, t, j):
            return "pairs the rows with a tensor of as many rows made another way"
    return p


def _batch_first(check: RowCheck, tensors: list[torch.Tensor], start: int) -> int | str:
    """Rows in dim 0 of every tensor from ``tensors[start]`` on (a loss's input and target,
    a convolution's input): the batch dim."""
    for t in tensors[start:]:
        d = check.row_dim(t)
        if _stranger(check, t, 0):
            return "pairs the rows with a tensor of as many rows made another way"
        if d is not None and d not in (0, _ANYWHERE):
            return "takes the rows' dim for another dim than the batch's"
    return 0


def _join(check: RowCheck, base: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | str:
    parts = [
        t
        for t in (args[0] if args and isinstance(args[0], (list, tuple)) else [])
        if isinstance(t, torch.Tensor)
    ]
    dims = {check.row_dim(t) for t in parts} - {_ANYWHERE}
    if None in dims:
        return "joins the rows with a tensor made another way"
    if len(dims) != 1:
        return "joins rows at different dims"
    (d,) = dims
    ndim = parts[0].dim() + (base == "stack")
    k = _dims(_arg(args, kwargs, 1, ("dim", "axis"), 0), ndim)
    if k is None:
        return "joins along a named dim"
    if base == "stack":
        return d + (k[0] <= d)
    return "joins tensors along the rows' dim" if k[0] == d else d


def _along(
    check: RowCheck, base: str, d: int, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> int | str:
    first = args[0]
    pos, kws, default = _ALONG[base]
    dims = _dims(_arg(args, kwargs, pos, kws, default), first.dim())
    if dims is None:
        return "acts on the whole tensor, rows included (give a dim)"
    if d in dims:
        return "acts along the rows' dim"
    for t in _tensors((args[1:], kwargs)):  # an index, a source: rows where first has them
        if t.dim() == first.dim():
            if _stranger(check, t, d) or check.row_dim(t) not in (None, d, _ANYWHERE):
                return "indexes with a tensor whose rows are not the input's"
    keep = _arg(args, kwargs, 99, ("keepdim",), False)
    if len(args) > pos + 1 and isinstance(args[pos + 1], bool):
        keep = args[pos + 1]
    if base in _REDUCING and not keep:
        return d - sum(1 for k in dims if k < d)
    return d


def _reshaped(
    check: RowCheck,
    d: int,
    first: torch.Tensor,
    out: Any,
    base: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> int | str:
    """A view or copy of ``first``'s elements in their order: its rows stay rows where the
    result has a dim of their size after as many elements as came before them, and where
    each model's own call asks for its rows' size there (the size read from a tensor, or
    -1; a number equal to all the models' rows by chance would not be each model's)."""
    if not isinstance(out, torch.Tensor):
        return "reshapes the rows"
    before = math.prod(first.shape[:d])
    seen, at = 1, None
    for k, s in enumerate(out.shape):
        if seen == before and s == check.rows:
            at = k
            break
        seen *= s
    if at is None:
        return "reshapes the rows' dim into others"
    if base in ("view", "reshape"):
        sizes = list(args[1:]) or list(kwargs.get("shape", kwargs.get("size", ())))
        if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
            sizes = list(sizes[0])
        if len(sizes) == out.dim() and not (isinstance(sizes[at], _RowCount) or sizes[at] == -1):
            return "reshapes to a size that equals the rows' by chance (use x.size(0) or -1)"
    if base in ("view_as", "reshape_as") and check.row_dim(args[1]) not in (at, _ANYWHERE):
        return "reshapes to the shape of a tensor whose rows are elsewhere"
    return at


def _transposed(
    d: int, ndim: int, base: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> int | str:
    if base in ("t", "adjoint"):
        return _PROPERTIES["T"](d, ndim) if base == "t" else _PROPERTIES["mT"](d, ndim)
    if base == "permute":
        order = (
            args[1:]
            if len(args) > 1 and not isinstance(args[1], (list, tuple))
            else _arg(args, kwargs, 1, ("dims",), ())
        )
        dims = _dims(order, ndim)
        return dims.index(d) if dims and d in dims else "permutes by named dims"
    a = _dims(_arg(args, kwargs, 1, ("dim0", "source", "axis0"), None), ndim)
    b = _dims(_arg(args, kwargs, 2, ("dim1", "destination", "axis1"), None), ndim)
    if a is None or b is None:
        return "moves named dims"
    if base in ("transpose", "swapaxes", "swapdims"):
        return b[0] if d == a[0] else a[0] if d == b[0] else d
    order: list[int | None] = [None] * ndim
    for src, dst in zip(a, b):
        order[dst] = src
    rest = iter(k for k in range(ndim) if k not in a)
    order = [next(rest) if k is None else k for k in order]
    return order.index(d)


def _indexed(
    check: RowCheck, d: int, t: torch.Tensor, index: Any, value: tuple[Any, ...]
) -> int | str:
    items = list(index) if isinstance(index, tuple) else [index]
    used = sum(
        (i.dim() if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1)
        for i in items
        if i is not None and i is not Ellipsis
    )
    tensor_like = [isinstance(i, (torch.Tensor, list)) for i in items]
    if any(tensor_like):  # ints index as tensors then; apart, the indexed dims go first
        spots = [k for k, i in enumerate(items) if tensor_like[k] or isinstance(i, int)]
        if spots[-1] - spots[0] + 1 != len(spots):
            return "indexes with tensors apart (torch puts their dims first)"
    src = out = 0
    at: int | None = None
    for i in items:
        if i is None:
            out += 1
            continue
        if i is Ellipsis:
            for _ in range(t.dim() - used):
                if src == d:
                    at = out
                src, out = src + 1, out + 1
            continue
        if (
            isinstance(i, (torch.Tensor, list))
            or hasattr(i, "__index__")
            and not isinstance(i, int)
        ):
            width = i.dim() if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1
            if src <= d < src + width:
                return "indexes the rows' dim"
            if isinstance(i, torch.Tensor) and check.row_dim(i) is not None:
                return "indexes with a tensor of rows"
            if at is None:
                return "indexes with a tensor before the rows' dim"
            src += width
            continue
        if isinstance(i, int):
            if src == d:
                return "indexes the rows' dim"
            src += 1
            continue
        if isinstance(i, slice):
            if src == d:
                if i != slice(None) and i != slice(0, None) and i != slice(None, None, 1):
                    return "slices the rows' dim"
                at = out
            src, out = src + 1, out + 1
            continue
        return "indexes with an object the check does not know"
    if at is None:
        at = out + (d - src)
    for v in value:  # t[index] = v: v's rows where the indexed part has them
        if isinstance(v, torch.Tensor) and v.dim():
            part = t[index]
            j = at - (part.dim() - v.dim())
            if _stranger(check, v, j) or check.row_dim(v) not in (None, j, _ANYWHERE):
                return "writes rows into other rows"
    return at


def _product(
    check: RowCheck, base: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> int | str:
    if base == "einsum":
        return _einsum(check, args)
    if base in ("baddbmm", "addmm"):
        added = args[0]
        args = args[1:]
    else:
        added = None
    if base in ("outer", "kron", "tensordot", "addbmm"):
        return "contracts or spreads the rows' dim"
    a, b = (tuple(args) + (None, None))[:2]
    if base == "__rmatmul__":
        a, b = b, a
    da, db = check.row_dim(a), check.row_dim(b)
    if base == "linear":
        if any(check.row_dim(t) not in (None, _ANYWHERE) for t in _tensors((args[1:], kwargs))):
            return "uses rows as weights"
        return da if da is not None and da < a.dim() - 1 else "contracts the rows' dim"
    if base == "bilinear":
        return (
            da if da == db and da is not None and da < a.dim() - 1 else "pairs rows of two inputs"
        )
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return "multiplies by a value the check does not know"
    if a.dim() < 2 and da not in (None, _ANYWHERE) or b.dim() < 2 and db not in (None, _ANYWHERE):
        return "contracts the rows' dim"
    n = max(a.dim(), b.dim(), 2)
    places = set()
    if da not in (None, _ANYWHERE):
        if da == a.dim() - 1:
            return "contracts the rows' dim"
        places.add(n - (a.dim() - da))
    if db not in (None, _ANYWHERE):
        if db == b.dim() - 2:
            return "contracts the rows' dim"
        if db == b.dim() - 1:
            places.add(n - 1)
        else:
            places.add(n - (b.dim() - db))
    if len(places) != 1 or n - 2 in places and n - 1 in places:
        return "multiplies rows by rows"
    (p,) = places
    for t, e in ((a, da), (b, db)):
        j = p - (n - t.dim())
        if e is None and j < t.dim() - 2 and _stranger(check, t, j):
            return "pairs the rows with a tensor of as many rows made another way"
    if added is not None and check.row_dim(added) not in (None, _ANYWHERE, p - (n - added.dim())):
        return "adds rows at another dim"
    return p


def _einsum(check: RowCheck, args: tuple[Any, ...]) -> int | str:
    equation = args[0] if args and isinstance(args[0], str) else None
    operands = args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if equation is None or "..." in equation or "->" not in equation:
        return "is an einsum whose rows cannot be followed (write it without '...', with '->')"
    ins, result = equation.replace(" ", "").split("->")
    terms = ins.split(",")
    letters = set()
    for term, t in zip(terms, operands):
        e = check.row_dim(t)
        if e is not None and e != _ANYWHERE:
            letters.add(term[e])
    if len(letters) != 1:
        return "is an einsum that pairs rows of its operands on different letters"
    (row,) = letters
    if row not in result:
        return "is an einsum that sums over the rows"
    for term, t in zip(terms, operands):
        if check.row_dim(t) is None and row in term and t.shape[term.index(row)] != 1:
            return "is an einsum that meets the rows' letter in a tensor made another way"
    return result.index(row)
