"""The one owner of the handle layout, the argument kinds and the depth step.

A leaf module: it imports nothing of fold but ``fold.errors``.  Every other module reads
handles through the names here; hot paths inline the same expressions, spelled with these
names (the generated recorders take :data:`DEPTH_AFTER` and :data:`KEY_SOURCE` as source
text).  An argument kind is defined here whole: its code, its name, how an argument is
classified as it (:func:`classify`), the memo key a recorder keeps for it, and the dtype of
its column; the executor's ``_run_group`` is the one place that gathers it.

A handle (a :class:`fold.Node`, an int) is laid out as::

    bits 0-6    output index k of a split output (0 for the whole node)
    bit  7      set on split outputs
    bits 8-15   n of the split(n) that made the handle (0 for the whole node)
    bits 16-43  node id (a topological order: ids grow as nodes are recorded)
    bits 44-    depth (highest, so the max of some handles is the deepest one; unbounded)

Why an int: hashing and comparison run in C, recording finds the depth of all its arguments
with one ``max()``, and the executor turns a column of handles into rows with a few numpy
operations.  The split count travels in the handle, so ``split()`` writes nothing into the
graph; apply checks each handle against the number of outputs its op returned.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
import torch

from fold.errors import FoldError, op_name

__all__ = [
    "BOOL",
    "DEPTH_AFTER",
    "DEPTH_SHIFT",
    "FLOAT",
    "ID_MASK",
    "ID_SHIFT",
    "INT",
    "KIND_NAMES",
    "LIST",
    "list_handles",
    "list_lengths",
    "key_rows",
    "packed",
    "packed_matrix",
    "LOW_MASK",
    "MAX_SPLIT",
    "NODE",
    "NSPLIT_MASK",
    "NSPLIT_SHIFT",
    "OUT_MASK",
    "KEY_SOURCE",
    "LIST_INLINE",
    "NUMBER_DTYPES",
    "SCALAR_KINDS",
    "TENSOR",
    "SPLIT",
    "classify",
    "convert",
    "decode",
    "depth_after",
    "depth_of",
    "float_key",
    "is_tensor_kind",
    "low_bits",
    "node_id",
    "out_index",
    "split_code",
    "split_count",
    "tensor_kind",
    "wanted_outputs",
]

# ---------------------------------------------------------------- argument kinds
# A node's signature is (op, kinds): one kind per argument.  A literal tensor's kind is the
# tuple (shape[1:], dtype), so nodes whose literal tensors differ in shape never share a group.
NODE, INT, FLOAT, BOOL, LIST = 0, 1, 2, 3, 4
TENSOR = "tensor"  # a literal tensor's kind before its shape is known (in recorders only)
KIND_NAMES = {
    NODE: "node",
    INT: "int",
    FLOAT: "float",
    BOOL: "bool",
    LIST: "list",
    TENSOR: "tensor",
}
SCALAR_KINDS: dict[type, int] = {int: INT, float: FLOAT, bool: BOOL}
# The memo key a generated recorder keeps for an argument ``{a}`` of each kind, when its
# type is the kind's own (a Node of the Fold, int, float, bool): node handles as plain ints
# (untracked by the garbage collector), -0.0 as its own key (see float_key), a literal
# tensor as its id (the graph keeps the tensor itself).  Other types of a kind (numpy
# numbers) are converted by ``convert`` first.  A list of nodes (a variable-length argument,
# received by the op as a ``fold.Ragged``) is kept as the bytes of its int64 handles (see
# ``list_handles``), its elements checked by the recorder's ``l{i}`` (this Fold's nodes, or
# a FoldError naming the element); recorders build it inline by ``LIST_INLINE`` and call
# ``l{i}`` only where that fails.  Bytes are never tracked by the garbage collector, where a
# tuple nested in the key tuple can leave the key tracked into the oldest generation.
KEY_SOURCE = {
    NODE: "{a} | 0",
    LIST: "l{i}({a})",
    INT: "{a}",
    BOOL: "{a}",
    FLOAT: "{a} if {a} else fk({a})",
    TENSOR: "id({a})",
}
# A signature whose arguments are all nodes keys its memo by ONE bytes object, the int64
# handles packed by a ``struct.Struct`` (see ``packed``): building it is one C call, where a
# tuple display makes a fresh int per argument that the memo then keeps (at 16 arguments,
# 1.0 us per node against 2.1), and the executor reads a whole signature as one buffer.


LIST_INLINE = "q('q', {a}).tobytes() if nodes_only(map(type, {a})) else l{i}({a})"
# The numpy dtype of a column of number arguments of each kind.
NUMBER_DTYPES = {INT: np.int64, FLOAT: np.float64, BOOL: np.bool_}


def classify(op: Any, pos: int, a: Any) -> tuple[Any, Any]:
    """The kind of argument ``a`` (position ``pos`` of op ``op``) and its value as the graph
    keeps it, for any type; a FoldError for what fold cannot take.  (Recorders classify each
    argument type once, then key arguments of that type by ``KEY_SOURCE``.)"""
    if isinstance(a, torch.Tensor):
        if a.dim() == 0 or a.shape[0] != 1:
            raise FoldError(
                f"Fold.add({op_name(op)!r}, ...): argument {pos} is a tensor of shape "
                f"{tuple(a.shape)}; tensor arguments are batch-of-one values of shape (1, ...), "
                "concatenated along dim 0 across a group. Fix: pass x.unsqueeze(0) for one "
                "value, a Python number for a scalar, or compute a shared table in a node "
                "marked .nobatch()."
            )
        return tensor_kind(a), a
    if type(a) is list:  # its elements are the caller's to check (they are handles)
        return LIST, a
    if isinstance(a, (bool, np.bool_)):  # numpy's bool is no numbers.Integral
        return BOOL, bool(a)
    if isinstance(a, numbers.Integral):
        return INT, int(a)
    if isinstance(a, numbers.Real):
        return FLOAT, float_key(a)
    shown = repr(a)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    raise FoldError(
        f"Fold.add({op_name(op)!r}, ...): argument {pos} is a {type(a).__name__} ({shown}); "
        "expected a Node of this Fold, a list of them, an int/float/bool, or a batch-of-one "
        "torch.Tensor of shape (1, ...). Fix: convert it to a tensor, or give the op's object "
        "an attribute holding it."
    )


def convert(kind: Any) -> Any:
    """For an argument of ``kind`` whose type is not the kind's own (a numpy number): the
    function that makes it the Python value the graph keeps."""
    return int if kind == INT else bool if kind == BOOL else float_key if kind == FLOAT else None


def is_tensor_kind(kind: Any) -> bool:
    """Whether ``kind`` is a literal tensor's (shape[1:], dtype)."""
    return type(kind) is tuple


def tensor_kind(t: Any) -> tuple[Any, Any]:
    """The kind of a batch-of-one literal tensor."""
    return (t.shape[1:], t.dtype)


def any_shape(kind: Any) -> bool:
    """Whether ``kind`` is a literal tensor kind of any shape, ``(None, dtype)``: the kind an
    op that takes padded parts (``padded_call``, see fold.executor) gives its literal
    tensors, so that tensors of several shapes share its signature."""
    return type(kind) is tuple and kind[0] is None


# ---------------------------------------------------------------- handle layout
OUT_MASK = (1 << 7) - 1
SPLIT = 1 << 7
NSPLIT_SHIFT = 8
NSPLIT_MASK = (1 << 8) - 1
LOW_MASK = (1 << 16) - 1  # output index, split flag and split count
# fold/_crecord.c (the recorders' C fast path) spells the shifts and the memo keys below
# again: keep it in step (tests/test_crecord.py compares it with the Python recorders).
ID_SHIFT = 16
ID_MASK = (1 << 28) - 1
DEPTH_SHIFT = 44
MAX_SPLIT = OUT_MASK + 1

# The depth bits of a node whose deepest node argument is the handle ``{}``: one step later.
# Source text, for the generated recorders; ``depth_after`` is the same as a function.
DEPTH_AFTER = f"((({{}}) >> {DEPTH_SHIFT}) + 1) << {DEPTH_SHIFT}"


def depth_after(h: int) -> int:
    """The depth bits of a node whose deepest node argument is ``h``."""
    return ((h >> DEPTH_SHIFT) + 1) << DEPTH_SHIFT


def depth_of(h: int) -> int:
    """The depth (step of the depth schedule) of a handle.

    These functions take int64 numpy arrays of handles too, elementwise."""
    return h >> DEPTH_SHIFT


def node_id(h: int) -> int:
    """The node id of a handle."""
    return (h >> ID_SHIFT) & ID_MASK


def low_bits(h: int) -> int:
    """A handle's output index, split flag and split count (0 for a whole node)."""
    return h & LOW_MASK


def out_index(h: int) -> int:
    """The output index of a handle (0 for a whole node)."""
    return h & OUT_MASK


def split_count(h: int) -> int:
    """The n of the ``split(n)`` that made a handle; 0 for a whole node."""
    return (h >> NSPLIT_SHIFT) & NSPLIT_MASK


def wanted_outputs(h: int) -> int:
    """How many outputs a handle needs its op to return (1 for a whole node)."""
    return (h >> NSPLIT_SHIFT) & NSPLIT_MASK or 1


def split_code(n: int) -> int:
    """The low bits that output 0 of ``split(n)`` adds to a whole node's handle."""
    return SPLIT | n << NSPLIT_SHIFT


def decode(handles: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An int64 array of handles -> (node ids, output indices, outputs each one needs)."""
    return (
        (handles >> ID_SHIFT) & ID_MASK,
        handles & OUT_MASK,
        np.maximum((handles >> NSPLIT_SHIFT) & NSPLIT_MASK, 1),
    )


# ---------------------------------------------------------------- number arguments
class _NegZero(float):
    """``-0.0`` as a memo key: equal to ``0.0`` as a float, yet a different value (``1 / x``
    is ``-inf``), so it must not share ``0.0``'s node.  Only equal to itself; converts to
    ``-0.0`` wherever a float is read (numpy, ``array``, torch)."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return type(other) is _NegZero

    def __ne__(self, other: object) -> bool:
        return type(other) is not _NegZero

    def __hash__(self) -> int:
        return 0x2D30  # not hash(0.0) == 0

    def __repr__(self) -> str:
        return "-0.0"


_NEG_ZERO = _NegZero(-0.0)


def float_key(x: Any) -> float:
    """A float argument as the graph keeps it: itself, except ``-0.0`` (see ``_NegZero``).

    NaNs need nothing: a NaN equals no other float, so each NaN object is its own node."""
    x = float(x)
    return _NEG_ZERO if x == 0.0 and math.copysign(1.0, x) < 0 else x


def packed(kinds: Any) -> bool:
    """Whether a signature's memo keys are packed int64 handles (all arguments nodes)."""
    return bool(kinds) and all(k == NODE for k in kinds)


def packed_matrix(keys: Any, k: int) -> np.ndarray:
    """Packed memo keys (see ``packed``) as an int64 array, nodes x ``k`` argument positions."""
    return np.frombuffer(b"".join(keys), dtype=np.int64).reshape(-1, k)


def key_rows(keys: Any, kinds: Any) -> list[Any]:
    """A signature's memo keys as argument rows (node handles as plain ints), in order."""
    if packed(kinds):
        return packed_matrix(keys, len(kinds)).tolist()
    return list(keys)


def list_handles(keys: Any) -> np.ndarray:
    """The handles of list arguments' memo keys (bytes of int64 handles, see ``KEY_SOURCE``),
    all lists one after another, as one int64 array."""
    return np.frombuffer(b"".join(keys), dtype=np.int64)


def list_lengths(keys: Any) -> np.ndarray:
    """The number of elements of each list argument's memo key, as an int64 array (a tensor
    of it is ``torch.from_numpy``: no per-item conversion)."""
    return np.fromiter(map(len, keys), np.int64, len(keys)) >> 3
