"""What running an op needs around it: the device of the object, looking an op up,
literal argument and output values, and the errors an op's call or result raises."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from fold._encoding import FLOAT
from fold.arrays import GraphArrays, numbers_tensor
from fold.errors import FoldError, FoldOutOfMemoryError, describe, op_name
from fold.ragged import Ragged

__all__ = [
    "PaddedOutputs",
    "PaddedRows",
    "bad_split",
    "check_outputs",
    "device_of",
    "forget_masks",
    "literal_output",
    "literal_value",
    "op_failed",
    "resolve_op",
]


def device_of(obj: Any) -> torch.device:
    """The device of ``obj``'s first parameter (or buffer); CPU for plain objects."""
    if isinstance(obj, torch.nn.Module):
        # The first parameter in parameters()' order: the module's own, else (most models)
        # its first child's own, found without the walk below (this runs on every apply).
        for t in obj._parameters.values():
            if t is not None:
                return t.device
        for m in obj._modules.values():
            if m is not None:
                for t in m._parameters.values():
                    if t is not None:
                        return t.device
                break
        # The order of parameters() then buffers(), without its generator machinery (a child
        # set to None, an optional layer left out, holds none).
        for attr in ("_parameters", "_buffers"):
            stack = [obj]
            while stack:
                m = stack.pop()
                for t in getattr(m, attr).values():
                    if t is not None:
                        return t.device
                stack.extend([c for c in reversed(m._modules.values()) if c is not None])
    return torch.device("cpu")


def _describe(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return describe(t.shape, t.dtype)
    if isinstance(t, Ragged):  # (a ModelRagged too: N models' lists)
        return f"Ragged of {len(t)} lists, values {describe(t.values.shape, t.values.dtype)}"
    return type(t).__name__


def resolve_op(obj: Any, op: Any, model_dim: bool) -> Callable[..., Any]:
    """The function an op name or callable stands for, given the object passed to apply."""
    if isinstance(op, str) and model_dim:
        return obj.merged(op)  # the model's own method, on (node, model) rows
    if isinstance(op, str):
        if (
            op != "forward"
            and type(obj).__name__ == "OptimizedModule"
            and hasattr(obj, "_orig_mod")
        ):
            warnings.warn(
                f"apply: {type(obj._orig_mod).__name__} was given to apply as torch.compile's "
                f"wrapper, which compiles forward only: op {op!r} runs uncompiled. Fix: compile "
                f"the op itself (model.{op} = torch.compile(model.{op})) and pass the module, "
                "or pass the uncompiled module to silence this.",
                stacklevel=5,
            )
        fn = getattr(obj, op, None)
        if fn is None or not callable(fn):
            raise FoldError(
                f"apply: op {op!r} is not a method of the {type(obj).__name__} given to apply. "
                f"Fix: define def {op}(self, ...) on {type(obj).__name__}, or record a callable "
                "instead of a name."
            )
        return fn
    return op


def op_failed(op: Any, step: int, n: int, values: list[Any], err: Exception) -> FoldError:
    """The FoldError for an op that raised, naming the op, step, group size and shapes (a
    FoldOutOfMemoryError, which is also a torch.OutOfMemoryError, where the op ran out of
    memory)."""
    said = (
        f"apply: op {op_name(op)!r} failed at step {step} on a group of {n} node(s) "
        f"with arguments ({', '.join(_describe(v) for v in values)}): {type(err).__name__}: {err}"
    )
    if isinstance(err, torch.OutOfMemoryError):
        return FoldOutOfMemoryError(
            f"{said}. Fix: bound the rows an op takes at a time with apply(..., max_rows=K) "
            "(or max_bytes=B), and keep what backward needs in host memory with "
            "offload='cpu'; values and gradients stay the same."
        )
    return FoldError(
        f"{said}. Fix: run the same graph with fold.Unfold(obj) to debug the op on one "
        "example; a batched op must treat dim 0 as the batch."
    )


class PaddedOutputs:
    """What an op's ``padded_call`` may return instead of per part its outputs: per output,
    ONE tensor holding every part's rows in the parts' order (an output of one shape
    across the parts, as a context vector read from memories of several lengths: fold
    registers it as one source, which later groups read as one), or a list of per part
    tensors (an output whose shape follows its part's, as attention weights)."""

    __slots__ = ("outputs",)

    def __init__(self, outputs: list[Any]) -> None:
        self.outputs = outputs


# PaddedRows.mask's masks, (rows, length) bools, by the dtype and bytes of the rows' lengths, the
# length and the device (at most 16; emptied when full, and by forget_masks).
_MASKS: dict[tuple[str, bytes, int, torch.device], torch.Tensor] = {}


def forget_masks() -> None:
    """Drop the masks ``PaddedRows.mask`` keeps (an autobatch call does when it ends, so that
    no device memory outlives it)."""
    _MASKS.clear()


def pad_ends(v: torch.Tensor, short: list[int], value: Any = 0.0) -> torch.Tensor:
    """``v`` padded with ``value`` at the end of each dim by ``short[d]`` (dim 0, the batch,
    never)."""
    if not any(short):
        return v
    if value != 0 and not (v.is_floating_point() or v.is_complex()):
        # (F.pad takes its value as a float: an int64's greatest would come back its least)
        out = v.new_full([n + k for n, k in zip(v.shape, short)], value)
        out[tuple([slice(0, n) for n in v.shape])] = v
        return out
    spec: list[int] = []
    for n in reversed(short[1:]):  # F.pad takes the last dim first
        spec += [0, n]
    return F.pad(v, spec, value=value)


def pad_dims(t: torch.Tensor, dims: Any, widths: Any) -> torch.Tensor:
    """``t`` padded with zeros at the end of each of ``dims`` to its width in ``widths``."""
    short = [0] * t.dim()
    for d, width in zip(dims, widths):
        short[d] = width - t.shape[d]
    return pad_ends(t, short)


def cut_to(t: torch.Tensor, dims: Any, n: int) -> torch.Tensor:
    """``t`` cut to length ``n`` in each of ``dims`` (a view)."""
    for d in dims:
        t = t.narrow(d, 0, n)
    return t


class PaddedRows:
    """Rows whose values differ in length along ONE dim (attention scores over memories of
    several lengths), held as one tensor padded to the longest: row ``i``'s value is
    ``data[i]`` cut to ``lengths[i]`` in dim ``dim`` (of ``data``, the batch dim 0).  What
    lies past a row's length is unspecified, zeros where ``zero``; ``filled`` sets it.

    ``dim`` may also be a tuple of dims that each row's length holds in all at once: a
    graph's adjacency (n, n), self-attention's scores (L, L), padded in both; ``dims`` is
    that tuple (one dim: ``(dim,)``) and ``dim`` its first.  An op that reads rows of one
    ragged dim only checks ``len(dims) == 1`` and declines others.

    A group of a whole plan whose op takes such rows (``ragged_call``: fold.autobatch's ops
    that pad) reads and returns them: one call, no parts.  As a group's output its rows are
    read like a tensor's (``rows[i]``, ``rows.narrow(0, i, 1)``: views cut to the row's
    length)."""

    __slots__ = ("_filled", "_mask", "data", "dim", "dims", "lengths", "zero")

    def __init__(
        self, data: torch.Tensor, dim: int | tuple[int, ...], lengths: Any, zero: bool = False
    ) -> None:
        self.dims = (dim,) if type(dim) is int else tuple(dim)  # type: ignore[arg-type]
        self.data, self.dim, self.lengths, self.zero = data, self.dims[0], lengths, zero
        self._filled: tuple[Any, torch.Tensor] | None = None
        self._mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        return cut_to(self.data[i], [d - 1 for d in self.dims], int(self.lengths[i]))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows ``start`` to ``start + length`` of one length (a batch-of-one row: 1)."""
        n = int(self.lengths[start])
        if dim != 0 or any(int(x) != n for x in self.lengths[start : start + length]):
            raise ValueError("PaddedRows.narrow: rows of one length in dim 0 only")
        out = cut_to(self.data.narrow(0, start, length), self.dims, n)
        if out._base is None:  # (an inference tensor: its base noted, see view_base)
            base = view_base(self.data)
            setattr(out, _VIEW_OF, self.data if base is None else base)
        return out

    def numel(self) -> int:
        return self.data.numel()

    def element_size(self) -> int:
        return self.data.element_size()

    def rows(self, index: Any, itensor: torch.Tensor | None) -> PaddedRows:
        """Rows ``index`` (a slice, or an int64 array whose tensor is ``itensor``)."""
        if type(index) is slice:
            return PaddedRows(self.data[index], self.dims, self.lengths[index], self.zero)
        return PaddedRows(
            self.data.index_select(0, itensor), self.dims, self.lengths[index], self.zero
        )

    def _past(self, dim: int) -> torch.Tensor:
        """True past each row's length in ``dim``, shaped to broadcast against ``data``.
        Made once per lengths, length and device of the last few (``_MASKS``): a decoder's
        steps mask scores over the same memories round after round."""
        data = self.data
        big = data.shape[dim]
        key = (self.lengths.dtype.str, self.lengths.tobytes(), big, data.device)
        past = _MASKS.get(key)
        if past is None:
            lengths = torch.from_numpy(self.lengths).to(data.device)
            past = torch.arange(big, device=data.device) >= lengths[:, None]  # (rows, big)
            if len(_MASKS) >= 16:
                _MASKS.clear()
            _MASKS[key] = past
        shape = [data.shape[0]] + [1] * (data.dim() - 1)
        shape[dim] = big
        return past.view(shape)

    def _past_any(self, dims: Any) -> torch.Tensor:
        """True past each row's length in any of ``dims``."""
        out = self._past(dims[0])
        for d in dims[1:]:
            out = out | self._past(d)
        return out

    def mask(self) -> torch.Tensor:
        """True past each row's length (in any of its ragged dims), shaped to broadcast
        against ``data``."""
        if self._mask is None:
            self._mask = self._past_any(self.dims)
        return self._mask

    def filled(self, value: Any, along: int | None = None) -> torch.Tensor:
        """``data`` with ``value`` past each row's length (itself where that is zeros
        already).  With ``along``, one of several ragged dims (a softmax's over scores
        (L, L)), ``value`` past the length in that dim and zeros past it in the others
        alone, so that each padded line along it holds values that reduce to a number
        (a softmax over a line of -inf alone is nan, and its backward would carry nan)."""
        if along is not None and (len(self.dims) == 1 or value == 0):
            along = None
        if self.zero and value == 0:
            return self.data
        last = self._filled
        if last is not None and last[0] == (value, along):  # (rows several groups read)
            return last[1]
        data = self.data
        if along is None:
            out = self._fill(data, self.mask(), value)
        else:
            if not self.zero:
                data = self._fill(data, self._past_any([d for d in self.dims if d != along]), 0)
            out = self._fill(data, self._past(along), value)
        self._filled = ((value, along), out)
        return out

    @staticmethod
    def _fill(data: torch.Tensor, mask: torch.Tensor, value: Any) -> torch.Tensor:
        if data.is_floating_point():
            # (torch.where: 1.7x faster than masked_fill on the CPU, (64, 64, 29) floats:
            # 74 against 123 us; the same values and gradient)
            return torch.where(mask, value, data)
        return data.masked_fill(mask, value)

    def parts(self) -> tuple[list[np.ndarray], list[torch.Tensor]]:
        """The rows by length: per length, the rows' positions and their values (one
        ``index_select``, cut to the length): registered as a padded call's parts where a
        later group reads rows one by one."""
        order = np.argsort(self.lengths, kind="stable")
        sorted_lengths = self.lengths[order]
        cuts = (np.flatnonzero(np.diff(sorted_lengths)) + 1).tolist()
        rows, values = [], []
        for lo, hi in zip([0, *cuts], [*cuts, len(order)]):
            pick = order[lo:hi]
            rows.append(pick)
            index = torch.from_numpy(np.ascontiguousarray(pick)).to(self.data.device)
            part = self.data.index_select(0, index)
            values.append(cut_to(part, self.dims, int(sorted_lengths[lo])))
        return rows, values


def padded_pieces(parts: list[Any]) -> PaddedRows | None:
    """Rows of several outputs, some of them ``PaddedRows``, as ONE ``PaddedRows`` (their
    rows one part after another): each part padded with zeros to the widest along the dims
    the rows differ in (an embedding of sentences of several lengths, whose one-word
    sentences ran as an op of their own).  Zeros past every row where each part has them
    (a tensor part has no padding).  None where the parts differ in another dim, in dtype
    or device, or the PaddedRows parts in their ragged dims (a tensor part's rows, of one
    shape, must hold one length in all of them)."""
    ragged = [p for p in parts if type(p) is PaddedRows]
    if not ragged:
        return None
    dims, first = ragged[0].dims, ragged[0].data
    if any(p.dims != dims for p in ragged):
        return None
    datas = [p.data if type(p) is PaddedRows else p for p in parts]
    for t in datas:
        if (
            t.dim() != first.dim()
            or t.dtype != first.dtype
            or t.device != first.device
            or any(t.shape[k] != first.shape[k] for k in range(1, t.dim()) if k not in dims)
        ):
            return None
    for p in parts:
        if type(p) is not PaddedRows and any(p.shape[d] != p.shape[dims[0]] for d in dims):
            return None
    widths = [max(t.shape[d] for t in datas) for d in dims]
    padded = [pad_dims(t, dims, widths) for t in datas]
    lengths = np.concatenate(
        [
            p.lengths if type(p) is PaddedRows else np.full(p.shape[0], p.shape[dims[0]], np.int64)
            for p in parts
        ]
    )
    zero = all(p.zero for p in ragged)
    return PaddedRows(torch.cat(padded, 0), dims, lengths, zero)


def check_outputs(op: Any, step: int, rows: int, out: Any, alone: bool) -> tuple[torch.Tensor, ...]:
    """An op's result as a tuple of tensors of ``rows`` rows each (any rows if ``alone``)."""
    if isinstance(out, torch.Tensor):
        outs: tuple[torch.Tensor, ...] = (out,)
    elif isinstance(out, (tuple, list)) and out and all(isinstance(t, torch.Tensor) for t in out):
        outs = tuple(out)
    else:
        raise FoldError(
            f"apply: op {op_name(op)!r} (step {step}) returned {_describe_output(out)}; an op "
            "must return a tensor or a tuple of tensors. Fix: return torch tensors, e.g. "
            "torch.as_tensor(value)."
        )
    if not alone:
        for k, t in enumerate(outs):
            if t.dim() == 0 or t.shape[0] != rows:
                raise FoldError(
                    f"apply: op {op_name(op)!r} (step {step}) returned output {k} of shape "
                    f"{tuple(t.shape)} for a group of {rows} node(s); outputs must have one row "
                    "per node in dim 0. Fix: keep the batch dim (no .sum() or .view(-1) over "
                    "it), or mark a node whose value is shared with .nobatch()."
                )
    return outs


# The attribute where fold notes the base of a view it made of an inference tensor (made
# under torch.inference_mode()), whose views keep none: their ``_base`` is None.
_VIEW_OF = "_fold_view_of"


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of (``t._base``), or the one fold noted for a view of an
    inference tensor (``PaddedRows.narrow``); None for a tensor that is no view."""
    b = t._base
    return getattr(t, _VIEW_OF, None) if b is None else b


def version_of(t: torch.Tensor) -> int | None:
    """``t._version``, the count of in-place changes to its memory; None for an inference
    tensor (made under ``torch.inference_mode()``), which has no version counter (asked,
    torch raises, which costs 7 us)."""
    return None if t.is_inference() else t._version


# torch.tensor as fold found it: an autobatch call wraps torch.tensor while it records (a
# known value), and its rounds convert their number columns here, recording nothing.
_TENSOR = torch.tensor


def literal_value(kind: Any, column: Any, device: torch.device) -> torch.Tensor:
    """One argument column of literals as a tensor on ``device``: batch-of-one tensors (kind a
    (shape, dtype) tuple) concatenated, or numbers (a numpy array; floats in the default
    dtype)."""
    # Always a fresh tensor: the graph keeps its literals for the next apply (and for the
    # next chunk of a BatchModule's models), so an op that changes an argument in place, or
    # a caller that changes a result that is an argument, must not reach them.
    if type(kind) is tuple:
        if len(column) > 1:
            t = torch.cat(column, 0)
        else:
            return column[0].to(device, non_blocking=True, copy=True)
    elif kind != FLOAT and type(column) is np.ndarray:
        t = torch.from_numpy(column.copy())  # ints or bools: a copy without torch's dispatch
    else:
        dtype = torch.get_default_dtype() if kind == FLOAT else None
        t = _TENSOR(column, dtype=dtype)
    return t if t.device == device else t.to(device, non_blocking=True)


def literal_output(kind: str, items: Any, i: int, device: torch.device) -> torch.Tensor:
    """The value of a list of numbers (a 1-D tensor), of batch-of-one tensors (their cat), or
    of a 1-D tensor given as the list (itself, on ``device``); ``items`` checked by
    ``_classify_lists``."""
    if kind == "numbers":
        try:
            t = numbers_tensor(items)
        except (OverflowError, RuntimeError, TypeError, ValueError) as err:
            raise FoldError(
                f"apply: lists[{i}] holds numbers torch cannot put in one tensor "
                f"({type(err).__name__}: {err}); ints must fit in torch.long (int64). Fix: "
                "pass smaller ints, or floats."
            ) from None
        return t if device.type == "cpu" else t.to(device, non_blocking=True)
    if kind == "column":
        return items.to(device, non_blocking=True)
    return torch.cat([t.to(device, non_blocking=True) for t in items], 0)


def bad_split(arrays: GraphArrays, node: int, n: int, m: int) -> FoldError:
    """The FoldError for a handle of ``node`` made by ``split(n)`` (``n`` 0: the whole node)
    where its op returned ``m`` outputs (0: the node has no value of its own)."""
    op = op_name(arrays.op_of(node))
    if m == 0:
        return FoldError(
            f"apply: node {node} ({op!r}) has no value here: a nobatch node can only be an "
            "argument of the ops that read it whole, or an output of its own list."
        )
    if n == 0:
        return FoldError(
            f"apply: op {op!r} returned {m} outputs, but node {node} ({op!r}) is used whole, "
            f"without split. Fix: use the handles of its split, h = f.add({op!r}, ...)"
            f".split({m})."
        )
    return FoldError(
        f"apply: node {node} ({op!r}) was split with .split({n}), but op {op!r} returned "
        f"{m} output(s). Fix: call .split({m}), or return {n} tensors."
    )


def _describe_output(out: Any) -> str:
    if isinstance(out, (tuple, list)):
        inner = ", ".join(type(x).__name__ for x in out)
        return f"a {type(out).__name__} of ({inner})"
    return f"a {type(out).__name__}"


# A tensor whose rows hold zeros past each row's length in one dim (a padded batch of values
# of several lengths: a packed RNN's outputs, literal sequences padded together) can carry
# that fact, as (dim, per-row lengths), for the padded calls that read it (``fold.autobatch``:
# no padding to fill where zeros are what it would fill).  An attribute of the tensor: it
# lives as long as the tensor.
_ZERO_PAST = "_fold_zero_past"


def mark_zero_past(t: torch.Tensor, dim: Any, lengths: list[int]) -> torch.Tensor:
    """Mark ``t`` (see ``_ZERO_PAST``): row i holds zeros past ``lengths[i]`` in ``dim`` (or
    in each of a tuple of dims)."""
    setattr(t, _ZERO_PAST, (dim, lengths))
    return t


def zero_past(t: torch.Tensor) -> tuple[Any, list[int]] | None:
    """``(dim, lengths)`` where ``t`` is marked by ``mark_zero_past``, else None."""
    return getattr(t, _ZERO_PAST, None)


def padded_literals(column: list[torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """Batch-of-one tensors (1, L_i, ...) that differ in dim 1 alone (each example's own
    sequence: a source's token ids) as ONE zero-padded tensor (n, max L_i, ...), marked with
    their lengths (``mark_zero_past``); or that differ in several dims, each tensor of one
    length in all of them (a graph's adjacency (1, n_i, n_i)), padded in all, marked with
    those dims; None for any other column."""
    first = column[0]
    if first.dim() < 2 or len(column) < 2:
        return None
    shape, dtype = first.shape, first.dtype
    for t in column:
        if t.shape[0] != 1 or t.dim() != first.dim() or t.dtype != dtype:
            return None
    varying = [d for d in range(1, first.dim()) if any(t.shape[d] != shape[d] for t in column)]
    if varying and varying[0] != 1:
        return None  # (values that differ past dim 1 alone: a call per part takes them)
    if len(varying) <= 1:
        out = pad_sequence([t[0] for t in column], batch_first=True)
        dims: int | tuple[int, ...] = 1
    elif any(t.shape[d] != t.shape[varying[0]] for t in column for d in varying):
        return None
    else:
        dims = tuple(varying)
        big = max(t.shape[varying[0]] for t in column)
        out = torch.cat([pad_dims(t, varying, [big] * len(varying)) for t in column], 0)
    if out.device != device:
        out = out.to(device, non_blocking=True)
    return mark_zero_past(out, dims, [t.shape[varying[0] if varying else 1] for t in column])


def padded_part(whole: torch.Tensor, start: int, stop: int, like: torch.Tensor) -> torch.Tensor:
    """Rows ``start`` to ``stop`` of ``padded_literals``' (or ``rows_of_padded``') tensor, each
    of ``like``'s length: a view cut to that length in the dims the tensor is padded in."""
    dims = zero_past(whole)[0]  # type: ignore[index]
    dims = (dims,) if type(dims) is int else dims
    return cut_to(whole[start:stop], dims, like.shape[dims[0]])


def rows_of_padded(column: list[torch.Tensor]) -> torch.Tensor | None:
    """Batch-of-one tensors (1, L_i, ...) that are each a whole row of one zero-padded
    tensor (``mark_zero_past``; a packed RNN's outputs, read in a later round as its rows:
    a decoder's memories), cut to that row's length: those rows as ONE ``index_select`` of
    it, to the longest of them, marked in turn; None for any other column (a row cut
    shorter than its values, a view of anything else)."""
    found = _rows_in(column)
    if found is None:
        return None
    b, rows, extents = found
    index = torch.from_numpy(rows).to(b.device)
    out = b.narrow(1, 0, int(extents.max())).index_select(0, index)
    return mark_zero_past(out, 1, extents.tolist())


def _rows_in(column: list[torch.Tensor]) -> tuple[torch.Tensor, np.ndarray, np.ndarray] | None:
    """``(b, rows, lengths)`` where every tensor of ``column`` is a whole row of one marked
    zero-padded tensor ``b`` (see ``rows_of_padded``): the rows' indices and lengths."""
    first = column[0]
    b = first._base
    noted = b is None  # (views of an inference tensor: the base noted, see view_base)
    if noted:
        b = getattr(first, _VIEW_OF, None)
    known = None if b is None else zero_past(b)
    if known is None or known[0] != 1 or len(column) < 2 or b.dim() < 2:
        return None
    stride, start = b.stride(), b.storage_offset()
    if noted:
        if any(getattr(t, _VIEW_OF, None) is not b for t in column):
            return None
    elif any(t._base is not b for t in column):
        return None
    # One shape past the length and one stride for all: views made alike (a row each).
    rest, strides = first.shape[2:], first.stride()
    if rest != b.shape[2:] or strides[1:] != stride[1:]:
        return None
    if any(t.stride() != strides or t.shape[2:] != rest for t in column):
        return None
    offsets = np.fromiter([t.storage_offset() for t in column], np.int64, len(column)) - start
    rows, extra = np.divmod(offsets, stride[0])
    if extra.any() or rows.min() < 0 or rows.max() >= b.shape[0]:
        return None
    sizes = np.fromiter([t.shape[1] for t in column], np.int64, len(column))
    if any(t.shape[0] != 1 for t in column):
        return None
    lengths = np.asarray(known[1], np.int64)
    if not np.array_equal(lengths[rows], sizes):
        return None
    return b, rows, sizes


def padded_rows_of(
    column: list[torch.Tensor],
    device: torch.device,
    made: dict[Any, PaddedRows],
    kept: dict[Any, Any] | None = None,
) -> PaddedRows | None:
    """A literal column of batch-of-one tensors (1, L_i, ...) that differ in dim 1 alone
    as ``PaddedRows`` (zeros past each length): the rows of one marked padded tensor where
    they are (``rows_of_padded``: a decoder's memories in a later round; ``made`` holds
    those made already, so that the columns of one memory in several groups read one
    copy), else padded together (``padded_literals``); None for any other column.

    Rows that are a run of the padded tensor's rows in order (every example still decoding)
    are a view of it, not a copy.  ``kept`` (a dict the caller keeps across applies:
    autobatch's rounds) holds the columns of rows made before, by the identity of their
    views: a decoder's later rounds read the same memories, the same view objects (see
    ``fold.autobatch.recorder``), so a round finds them there, unless the padded tensor was
    changed in place since (its version)."""
    key = None
    found = None
    if kept is not None:
        key = tuple(map(id, column))
        entry = kept.get(key)
        if entry is not None and version_of(entry[1]) == entry[2]:
            return entry[3]
        found = _rows_kept(key, kept)
    if found is None:
        found = _rows_in(column)
    if found is None:
        # (one column padded once in an apply: a graph's adjacency read by each of its
        # convolutions, each call's batch of one a view of its own of the same memory; the
        # column's tensors live while the apply runs, so no other takes their memory)
        made_key = (
            "literals",
            *[
                (t.data_ptr(), t.device, t.dtype, t.shape, t.stride(), t.requires_grad)
                for t in column
            ],
        )
        got = made.get(made_key)
        if got is None:
            t = padded_literals(column, device)
            if t is None:
                return None
            dims, lengths = zero_past(t)  # type: ignore[misc]
            got = made[made_key] = PaddedRows(t, dims, np.array(lengths, np.int64), zero=True)
        return got
    b, rows, lengths = found
    made_key = (id(b), rows.tobytes())  # (b lives while the column's views do)
    got = made.get(made_key)
    if got is None:
        longest = int(lengths.max())
        first = int(rows[0])
        if rows[-1] - first == len(rows) - 1 and (np.diff(rows) == 1).all():
            t = b.narrow(0, first, len(rows)).narrow(1, 0, longest)  # a view: rows in order
        else:
            index = torch.from_numpy(rows).to(b.device)
            t = b.narrow(1, 0, longest).index_select(0, index)
        if t.device != device:
            t = t.to(device, non_blocking=True)
        got = made[made_key] = PaddedRows(t, 1, lengths, zero=True)
    if key is not None:
        if len(kept) >= _KEPT_COLUMNS:  # type: ignore[arg-type]
            kept.clear()  # type: ignore[union-attr]
        # The column itself keeps its views alive, so that no other tensor takes their ids.
        # (b is an output of fold's own: an inference tensor's None is no change seen)
        kept[key] = (column, b, version_of(b), got)  # type: ignore[index]
        kept[_ROWS_KEPT] = (column, b, version_of(b), rows, lengths)  # type: ignore[index]
    return got


# The key under which a ``kept`` dict of ``padded_rows_of`` holds the last column found to
# be rows of a marked padded tensor: (its views, that tensor, its version, their rows, their
# lengths), whose views' rows a later column of some of them reads (see ``_rows_kept``).
_ROWS_KEPT = "rows of the last column"


def _rows_kept(key: tuple[int, ...], kept: dict[Any, Any]) -> tuple[Any, ...] | None:
    """``_rows_in`` of a column (``key``: its views' ids) whose every view was a view of the
    last column found in ``kept`` (a decoder's memories in a round after some examples
    finished: the others' views again): their rows and lengths as found then, where the
    padded tensor has not changed since; else None.  (The kept column holds its views, so an
    id there is that view's.)"""
    last = kept.get(_ROWS_KEPT)
    if last is None or len(key) < 2:
        return None
    views, b, version, rows, lengths = last
    if version_of(b) != version:
        return None
    where = dict(zip(map(id, views), range(len(views))))
    at = [where.get(i) for i in key]
    if None in at:
        return None
    pick = np.asarray(at, np.int64)
    return b, rows[pick], lengths[pick]


# The most columns a ``kept`` dict of ``padded_rows_of`` holds (emptied when full).
_KEPT_COLUMNS = 16
