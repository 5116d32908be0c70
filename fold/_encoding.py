"""The one owner of the handle layout, the argument kinds and the depth step.

A leaf module: it imports nothing of fold.  Every other module reads handles through the
names here; hot paths inline the same expressions, but spelled with these names (the
generated recorders take :data:`DEPTH_AFTER` as their source text).

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
from typing import Any

import numpy as np

__all__ = [
    "BOOL",
    "DEPTH_AFTER",
    "DEPTH_SHIFT",
    "FLOAT",
    "ID_MASK",
    "ID_SHIFT",
    "INT",
    "KIND_NAMES",
    "LOW_MASK",
    "MAX_SPLIT",
    "NODE",
    "NSPLIT_MASK",
    "NSPLIT_SHIFT",
    "OUT_MASK",
    "SCALAR_KINDS",
    "SPLIT",
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
NODE, INT, FLOAT, BOOL = 0, 1, 2, 3
KIND_NAMES = {NODE: "node", INT: "int", FLOAT: "float", BOOL: "bool"}
SCALAR_KINDS: dict[type, int] = {int: INT, float: FLOAT, bool: BOOL}


def is_tensor_kind(kind: Any) -> bool:
    """Whether ``kind`` is a literal tensor's (shape[1:], dtype)."""
    return type(kind) is tuple


def tensor_kind(t: Any) -> tuple[Any, Any]:
    """The kind of a batch-of-one literal tensor."""
    return (t.shape[1:], t.dtype)


# ---------------------------------------------------------------- handle layout
OUT_MASK = (1 << 7) - 1
SPLIT = 1 << 7
NSPLIT_SHIFT = 8
NSPLIT_MASK = (1 << 8) - 1
LOW_MASK = (1 << 16) - 1  # output index, split flag and split count
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
