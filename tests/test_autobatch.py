"""fold.autobatch: unchanged per-example code, batched; every result against eager per
example (values and gradients, float64), and the errors it gives for bad use."""

from __future__ import annotations

import copy
import functools
import gc
import io
import logging
import math
import pickle
import random
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

import fold
from fold.autobatch import Lazy, buffers, common, driver, recorder, tables, traced, values
from fold.autobatch import ops as aops
from fold.autobatch.recorder import _OPS
from fold.models import ChildSumTreeLSTM, TreeLSTM
from fold.ops import PaddedRows
from fold.treebank import Tree, random_dep_tree, random_tree

# Float64 throughout (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("float64")


def eager_stack(fn, *iterables):
    """The reference: fn eagerly per example, stacked per output position."""
    outs = [fn(*ex) for ex in zip(*iterables)]
    leaves = [torch.utils._pytree.tree_flatten(o) for o in outs]
    spec = leaves[0][1]
    cols = [
        torch.stack([torch.as_tensor(lv[0][j]) for lv in leaves]) for j in range(len(leaves[0][0]))
    ]
    return torch.utils._pytree.tree_unflatten(cols, spec)


def assert_same(fn, params, *iterables, loss=lambda out: out):
    """autobatch(fn) equals eager per example: values and gradients of params."""
    got = fold.autobatch(fn, *iterables)
    want = eager_stack(fn, *iterables)
    torch.testing.assert_close(got, want)
    if all(  # rows of tensors (or lists of tensors) are recorded once: per example too
        isinstance(it, torch.Tensor) or (isinstance(it, list) and isinstance(it[0], torch.Tensor))
        for it in iterables
    ):
        torch.testing.assert_close(fold.autobatch(fn, *iterables, per_example=True), want)
    flat_got = [t for t in torch.utils._pytree.tree_leaves(got) if t.is_floating_point()]
    flat_want = [t for t in torch.utils._pytree.tree_leaves(want) if t.is_floating_point()]
    weights = [torch.randn_like(t) for t in flat_want]
    lg = sum((w * t).sum() for w, t in zip(weights, flat_got))
    lw = sum((w * t).sum() for w, t in zip(weights, flat_want))
    gg = torch.autograd.grad(lg, params, allow_unused=True)
    gw = torch.autograd.grad(lw, params, allow_unused=True)
    for p, a, b in zip(params, gg, gw):
        # A parameter that no output depends on: None in eager, zeros where the batched
        # graph reaches it through a gather of rows it does not use.
        torch.testing.assert_close(
            torch.zeros_like(p) if a is None else a, torch.zeros_like(p) if b is None else b
        )
    return got


def assert_same_grads(got, want, params):
    """The gradients of ``params`` through ``got`` (batched) and ``want`` (eager) under the
    loss ``sum(x ** 2)`` are equal."""
    for a, b in zip(
        torch.autograd.grad(got.pow(2).sum(), params),
        torch.autograd.grad(want.pow(2).sum(), params),
    ):
        torch.testing.assert_close(a, b)


def assert_same_lists(got, want, params):
    """Per-example results (tuples of tensors of each example's own shapes, as
    ``stack=False`` returns them) equal eager's ``want``: values, shapes and the gradients
    of ``params`` under random weights."""
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b)
    weights = [[torch.randn_like(t) for t in w] for w in want]

    def loss(outs):
        return sum((c * t).sum() for cs, ts in zip(weights, outs) for c, t in zip(cs, ts))

    for a, b in zip(
        torch.autograd.grad(loss(got), params), torch.autograd.grad(loss(want), params)
    ):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------- TreeLSTM
class Cells(nn.Module):
    """The TreeLSTM written for ONE example (no batch dim)."""

    def __init__(self, vocab: int = 30, hidden: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.leaf_gates = nn.Linear(hidden, 3 * hidden)
        self.node_gates = nn.Linear(2 * hidden, 5 * hidden)

    def leaf(self, word):
        i, o, u = self.leaf_gates(self.embed(word)).chunk(3)
        c = torch.sigmoid(i) * torch.tanh(u)
        return torch.sigmoid(o) * torch.tanh(c), c

    def node(self, lh, lc, rh, rc):
        i, o, u, fl, fr = self.node_gates(torch.cat([lh, rh])).chunk(5)
        c = torch.sigmoid(i) * torch.tanh(u) + torch.sigmoid(fl) * lc + torch.sigmoid(fr) * rc
        return torch.sigmoid(o) * torch.tanh(c), c


class BatchableCells(Cells):
    leaf = fold.batchable(Cells.leaf)
    node = fold.batchable(Cells.node)


def encode(cells, tree: Tree):
    if tree.left is None:
        return cells.leaf(torch.tensor(tree.word))
    (lh, lc), (rh, rc) = encode(cells, tree.left), encode(cells, tree.right)
    return cells.node(lh, lc, rh, rc)


def trees(n: int = 12, seed: int = 0) -> list[Tree]:
    rng = random.Random(seed)
    return [random_tree(rng, rng.randint(1, 9), 30) for _ in range(n)]


@pytest.mark.parametrize("cls", [BatchableCells, Cells], ids=["batchable", "no annotation"])
def test_tree_lstm_matches_eager(cls):
    cells = cls()
    h, c = assert_same(lambda t: encode(cells, t), list(cells.parameters()), trees())
    assert h.shape == c.shape == (12, 6)


def test_batchable_records_one_node_per_call():
    cells = BatchableCells()
    ts = trees(4)
    f_nodes = []
    orig = fold.Fold.apply

    def spy(self, obj, lists, **kw):
        f_nodes.append(len(self))
        return orig(self, obj, lists, **kw)

    fold.Fold.apply = spy
    try:
        fold.autobatch(lambda t: encode(cells, t), ts)
    finally:
        fold.Fold.apply = orig
    # One node per tree node (identical leaves of equal words are one node).
    distinct = set()

    def walk(t, key=()):
        if t.left is None:
            distinct.add(("leaf", t.word))
        else:
            distinct.add(id(t))
            walk(t.left)
            walk(t.right)

    for t in ts:
        walk(t)
    assert f_nodes == [len(distinct)]


def test_repeated_calls_take_the_fast_path_and_keep_shapes_apart():
    """Calls of lazy arguments only (a module first, perhaps) seen before skip the key
    building; the key still holds each argument's shape, so calls of one function on other
    shapes are other ops, and a module or a lazy value first are told apart."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)

    @fold.batchable
    def mix(a, b):  # its output's shape depends on both arguments' shapes
        return torch.cat([a * b.sum(), b.mean() - b])

    class Pair(nn.Module):
        def forward(self, a, b):
            return a - b.flip(0)

    pair = Pair()

    def fn(x, y):
        s, t = lin(x), lin(y)  # lazy values of shape (3,)
        wide = torch.cat([s, t])  # (6,)
        out = [mix(s, t), mix(t, s), mix(wide, wide), mix(s, wide), pair(s, t), pair(wide, wide)]
        out += [mix(mix(s, t), s), mix(wide, s)]
        # Shapes come from each op's inferred outputs: a call given another op's shapes
        # would report them here.
        assert [tuple(o.shape) for o in out] == [(6,), (6,), (12,), (9,), (3,), (6,), (9,), (9,)]
        return torch.cat(out)

    xs, ys = torch.randn(5, 3), torch.randn(5, 3)
    with_fast = assert_same(fn, list(lin.parameters()), xs, ys)
    assert with_fast.shape == (5, 6 + 6 + 12 + 9 + 3 + 6 + 9 + 9)


def test_a_module_and_a_number_tensor_take_the_fast_path(monkeypatch):
    """``model.embed(torch.tensor(word))`` seen before skips the key building too: keyed by
    the module and the tensor's dtype and device, the word read with .item()."""
    from fold.autobatch.recorder import _Recorder

    emb = nn.Embedding(10, 3)
    parts = []
    part = _Recorder._part
    monkeypatch.setattr(
        _Recorder, "_part", lambda self, a, *r: parts.append(a) or part(self, a, *r)
    )

    class Cells(nn.Module):
        @fold.batchable
        def leaf(self, word):
            return emb(word).tanh()

    cells = Cells()
    examples = [[3, 1, 3, 7, 2], [4, 4], [9]]
    # torch.tensor(w) inside fn is a known value; torch.as_tensor(w) an eager number tensor.
    # (Looked up at the call, as code names it: torch.tensor is autobatch's while it runs.)
    for make, kind in (
        (lambda w: torch.tensor(w), values.Known),
        (lambda w: torch.as_tensor(w), torch.Tensor),
    ):

        def fn(words, make=make):
            out = emb(make(words[0]))
            for w in words[1:]:
                out = out + emb(make(w)) * 0.5
            return out

        def method(words, make=make):
            return sum(cells.leaf(make(w)) for w in words)

        for f in (fn, method):
            parts.clear()
            assert_same(f, list(emb.parameters()), examples)
            # Only the first call builds its key from the word; the rest take the fast path.
            assert sum(isinstance(p, kind) for p in parts) == 1, (f.__name__, kind)


def test_negative_zero_is_a_constant_of_its_own():
    """``x * -0.0`` is not ``x * 0.0`` (the sign of each zero differs): the two calls must
    not share an op key, or the second would be the first's node."""
    lin = nn.Linear(2, 3)

    def fn(x):
        h = lin(x)
        z = h * 0.0  # -0.0 where h < 0
        # Keyword constants too: z + 0.0 * h and z + -0.0 * h differ in sign where h < 0.
        return (
            h * 0.0,
            h * -0.0,
            1 / (h * -0.0),
            torch.add(z, h, alpha=0.0),
            torch.add(z, h, alpha=-0.0),
        )

    xs = torch.randn(4, 2)
    got = fold.autobatch(fn, xs)
    want = eager_stack(fn, xs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
        assert torch.equal(torch.signbit(g), torch.signbit(w))


def test_rows_of_a_tensor_changed_in_place_are_read_again():
    """The rows of a tensor autobatch iterates over are prepared once (batch-of-one views,
    numbers for 0-dim rows); a row the per-example code changes in place before using it must
    be read as it is then, as eager code reads it."""
    lin = nn.Linear(3, 4)

    def fn(img, label):
        label.add_(1)
        img.mul_(2)
        return F.cross_entropy(lin(img), label), img * label

    x, y = torch.randn(6, 3), torch.randint(0, 3, (6,))
    want = eager_stack(fn, x.clone(), y.clone())
    got = fold.autobatch(fn, x.clone(), y.clone())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_a_row_of_an_iterated_tensor_changed_after_a_call_took_it_is_refused():
    """A row a recorded call took as ``rows`` prepared it is read when its round runs; an
    example that then changes its row in place (``x.mul_(2)`` after ``lin(x)``) would give
    that call the changed value where eager code read the old one (it did, silently): a
    FoldError naming the change and the fix.  A list of tensors was refused already, naming
    the example; a list of views of one tensor is read at each call (a copy)."""
    lin = nn.Linear(3, 3)

    def fn(x):
        h = lin(x)
        x.mul_(2)
        return h + lin(x)

    x = torch.randn(4, 3)
    with pytest.raises(
        fold.FoldError, match=r"iterates over was changed in place after a .*x.clone"
    ):
        fold.autobatch(fn, x.clone())
    with pytest.raises(fold.FoldError, match=r"example 0: a tensor of shape \(3,\) was changed"):
        fold.autobatch(fn, [row.clone() for row in x])
    # Rows given as a list of views: each taken as a copy at its call (see the test below).
    with torch.no_grad():
        torch.testing.assert_close(fold.autobatch(fn, list(x.clone())), eager_stack(fn, x.clone()))


@pytest.mark.parametrize(
    "change",
    ["set", "fill", "row method", "view of the row", "recorded write"],
)
def test_a_view_a_call_took_reads_its_value_at_the_call(change, finish):
    """``h + buf[0]``, ``buf[0]`` a view of a tensor the example made (a buffer it fills, a
    one-hot input), is read as eager code reads it: at the call.  The recorded call runs
    later, in its round, so it takes a copy of the view's value now; before, an eager change
    in place of the tensor after the call (``buf[0] = 7.0``) reached it, silently (the
    views of one tensor share its version counter, so no check could tell a change of the
    view from a change elsewhere), and a recorded write into the tensor after the call
    (``buf[1] = h``) was refused, the recorded argument holding a view of its memory.
    Values and gradients equal eager (float64)."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3).double()

    def fn(x):
        buf = torch.ones(4, 3, dtype=torch.float64)
        h = torch.tanh(lin(x))
        h = torch.add(h, buf[0], alpha=0.5) * buf[1:3].sum(0)
        if change == "set":
            buf[0] = 7.0
        elif change == "fill":
            buf.fill_(3.0)
        elif change == "row method":
            buf[0].mul_(2.0)
        elif change == "view of the row":
            buf[0:2].add_(1.0)
        else:
            buf[1] = h  # a recorded value: the buffer becomes a written buffer
        if float(h.detach().sum()) > 1e9:  # a read: the call's round runs after the change
            h = -h
        return torch.tanh(lin(h + buf[0] + buf[1]))

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(5)]
    assert_same(fn, list(lin.parameters()), xs)


class _Tempered(nn.Module):
    """A module an example may set up for itself: a temperature, a flag, a buffer."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3).double()
        self.temperature = 1.0
        self.flip = False
        self.register_buffer("scale", torch.ones(3, dtype=torch.float64))

    def forward(self, x):
        h = self.lin(x) / self.temperature * self.scale
        return -h if self.flip else h


@pytest.mark.parametrize(
    "change",
    ["attribute", "flag", "buffer in place", "weight in place", "train mode"],
)
def test_a_module_set_up_per_example_after_its_call_is_refused(change, finish):
    """A module's forward runs with its round, once for the calls of all examples: where an
    example changes the module after a recorded call of it (``m.temperature = t``, a flag,
    a buffer or weight changed in place, ``m.train()``), the call would read the change
    where eager code read the old state (it did, silently).  A FoldError names what
    changed and the fix: an attribute as it is set (each set seen, one set back to its old
    value before the round too), a tensor by its version as the round begins.  (Recorded
    once for every row, ``per_example=False``, the function is taken as pure: see the
    package's docstring.)"""
    torch.manual_seed(0)
    m = _Tempered().eval()

    def fn(x, t):
        h = m(x)
        if change == "attribute":
            m.temperature = t
        elif change == "flag":
            m.flip = t > 2
        elif change == "buffer in place":
            m.scale.mul_(t)
        elif change == "weight in place":
            with torch.no_grad():
                m.lin.weight.mul_(t)
        else:
            m.train(t > 2)
        return h + m(x)

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    said = {  # (an attribute is refused as it is set; a tensor as the round begins)
        "attribute": r"example 1: the attribute 'temperature' of _Tempered set to 2.0",
        "flag": r"example 2: the attribute 'flip' of _Tempered set to True",
        "buffer in place": r"the tensor 'scale' of _Tempered changed while the examples",
        "weight in place": r"the tensor 'weight' of _Tempered's Linear changed while",
        "train mode": r"example 2: the attribute 'training' of _Tempered set to True",
    }[change]
    with pytest.raises(fold.FoldError, match=said):
        fold.autobatch(fn, xs, [1.0, 2.0, 3.0, 4.0], per_example=True)
    m.temperature = 5.0
    assert type(m).__setattr__ is nn.Module.__setattr__  # (the guard ended with the call)


def test_a_class_guard_lives_while_any_call_uses_it():
    """Calls on two threads guard one class once (recorder._guard_class): the guard stays
    while either runs, and the class gets its own ``__setattr__`` back when the last ends;
    one installed over the guard meanwhile stays."""
    from fold.autobatch.recorder import _GUARDS, _guard_class, unguard

    class Cell(nn.Linear):
        pass

    first, second = {}, {}
    _guard_class(Cell, first)
    guard = Cell.__dict__["__setattr__"]
    _guard_class(Cell, second)
    assert Cell.__dict__["__setattr__"] is guard and _GUARDS[Cell][2] == 2
    unguard(first)
    assert Cell.__dict__["__setattr__"] is guard
    unguard(second)
    assert "__setattr__" not in Cell.__dict__ and Cell not in _GUARDS
    _guard_class(Cell, first)

    def other(self, name, value):
        nn.Module.__setattr__(self, name, value)

    Cell.__setattr__ = other
    unguard(first)
    assert Cell.__dict__["__setattr__"] is other


def test_a_parameter_changed_in_place_after_a_call_took_it_is_refused(finish):
    """A parameter given to a torch call (``torch.mv(W, x)``) is read when the call's round
    runs: changed in place after the call (``W.mul_(2)`` under torch.no_grad()), it would
    reach the call changed.  A FoldError, on the C fast path and the slow path alike (a
    second call finds every call in the fast table kept from the first, and the C path
    notes the parameter)."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
    lin = nn.Linear(3, 3).double()

    def fn(x, i):
        h = torch.tanh(torch.mv(w, lin(x)))
        if i == 2:  # (a later example: its call was found in the fast table)
            with torch.no_grad():
                w.mul_(2.0)
        return h

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    fold.autobatch(fn, xs, [0, 1, 3, 3], per_example=True)  # (its entries kept: C from here)
    with pytest.raises(fold.FoldError, match=r"a parameter of shape \(3, 3\) changed"):
        fold.autobatch(fn, xs, list(range(4)), per_example=True)


def test_a_module_set_up_alike_before_its_calls_of_a_round_equals_eager(finish):
    """Set up before its calls of a round, a module reads what eager code reads: a
    temperature every example sets alike at each step (a schedule), a read each step (a
    round each); and a renormalising embedding (``max_norm``), whose table its own calls
    change in place (no change a later call would not make alike).  Values and gradients
    equal eager (float64)."""
    torch.manual_seed(0)
    m = _Tempered()
    table = nn.Embedding(6, 3, max_norm=1.0).double()
    schedule = [1.0, 2.0, 0.5]

    def fn(x, k):
        h = x
        for t in schedule:
            m.temperature = t
            h = torch.tanh(m(h)) + table(k)
            if float(h.detach().sum()) > 1e9:  # a read: a round per step
                h = -h
        return h

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(5)]
    ks = [torch.tensor(i % 6) for i in range(5)]
    kept = table.weight.detach().clone()
    got = fold.autobatch(fn, xs, ks)
    renormed = table.weight.detach().clone()
    with torch.no_grad():
        table.weight.copy_(kept)
    assert_same(fn, [*m.parameters(), table.weight], xs, ks)
    torch.testing.assert_close(table.weight.detach(), renormed)  # renormalised alike
    torch.testing.assert_close(got, eager_stack(fn, xs, ks))


def test_torch_functions_reach_lazy_values_directly_only_during_a_call():
    """While autobatch runs, torch.cat, torch.softmax, F.softmax and kin hand a call on lazy
    values straight to the recorder (torch's argument parsing costs 1-2 us a call, a
    functional's 4-6); after it, they are torch's own again.  A wrapper another library put over torch.cat before the call
    is kept and sees every call; a torch-function mode on during the call sees the calls on
    lazy values, as it would without autobatch's wrappers.  Values equal eager's."""
    from torch.overrides import TorchFunctionMode

    found = {name: getattr(torch, name) for name in ("cat", "stack", "softmax", "tanh")}
    found_f = {name: getattr(F, name) for name in ("softmax", "relu")}
    during = {}
    lin = nn.Linear(2, 2)
    root = nn.Parameter(torch.randn(4))

    def fn(x):
        during.update({name: getattr(torch, name) for name in found})
        during.update({"F." + name: getattr(F, name) for name in found_f})
        h = lin(x)
        c = torch.cat([h, torch.tanh(h)], dim=0)
        c = c + torch.cat([root[:2], h])  # a parameter first, the lazy value after it
        return torch.softmax(c, 0) + torch.stack([h, h]).sum() + F.softmax(F.relu(c), dim=0)

    xs = [torch.randn(2) for _ in range(3)]
    want = torch.stack([fn(x) for x in xs])
    torch.testing.assert_close(fold.autobatch(fn, xs, per_example=True), want)
    found_all = {**found, **{"F." + name: f for name, f in found_f.items()}}
    assert all(during[k] is not f and during[k].__wrapped__ is f for k, f in found_all.items())
    assert all(getattr(torch, name) is f for name, f in found.items())
    assert all(getattr(F, name) is f for name, f in found_f.items())

    seen = []

    def counting_cat(*args, **kwargs):
        seen.append(len(args[0]))
        return found["cat"](*args, **kwargs)

    class Counting(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is found["cat"] and type(args[0][0]) is Lazy:  # an example's call
                seen.append("mode")
            return func(*args, **(kwargs or {}))

    torch.cat = counting_cat
    try:
        torch.testing.assert_close(fold.autobatch(fn, xs, per_example=True), want)
        assert torch.cat is counting_cat and seen[:3] == [2, 2, 2]  # (then fold's own)
    finally:
        torch.cat = found["cat"]
    seen.clear()
    with Counting():
        torch.testing.assert_close(fold.autobatch(fn, xs, per_example=True), want)
    assert seen == ["mode"] * 3 and torch.cat is found["cat"]


def test_nothing_installed_outlives_the_call_and_other_wrappers_are_kept():
    """autobatch's wrappers over nn.Module.__call__ and torch.tensor exist only while a call
    runs. A counting wrapper another library installs after one call sees every module call
    outside autobatch, also after the next call; one installed while a call runs is kept;
    torch.compile's tracer finds no graph break after autobatch."""
    module_call, tensor, as_tensor = nn.Module.__call__, torch.tensor, torch.as_tensor
    setattr_ = nn.Module.__setattr__  # (a called module's class guarded while a call records)
    lin = nn.Linear(2, 2)
    x = torch.randn(5, 2)
    rows = list(x)
    torch.testing.assert_close(fold.autobatch(lambda r: lin(r), rows), lin(x))
    assert nn.Module.__call__ is module_call and torch.tensor is tensor
    assert torch.as_tensor is as_tensor and nn.Module.__setattr__ is setattr_

    def sets_up(r):
        out = lin(r)
        lin.flag = float(r[0]) > 0  # (refused after the call: a FoldError)
        return out

    lin.flag = True
    with pytest.raises(fold.FoldError, match="attribute 'flag' of Linear set to False"):
        fold.autobatch(sets_up, [torch.ones(2), -torch.ones(2)], per_example=True)
    assert nn.Module.__setattr__ is setattr_ and "__setattr__" not in nn.Linear.__dict__
    seen = []

    def counting(self, *args, **kwargs):
        seen.append(self)
        return module_call(self, *args, **kwargs)

    nn.Module.__call__ = counting
    try:
        torch.testing.assert_close(fold.autobatch(lambda r: lin(r), rows), lin(x))
        assert nn.Module.__call__ is counting
        seen.clear()
        lin(x), lin(x)
        assert seen == [lin, lin]
        # A wrapper installed over autobatch's while a call runs stays when the call ends.
        during = []

        def install(r):
            if not during:
                inner = nn.Module.__call__

                def late(self, *args, **kwargs):
                    during.append(self)
                    return inner(self, *args, **kwargs)

                during.append(late)
                nn.Module.__call__ = late
            return lin(r)

        torch.testing.assert_close(fold.autobatch(install, rows, per_example=True), lin(x))
        assert nn.Module.__call__ is during[0]
        del during[1:]
        seen.clear()
        lin(x)
        assert during[1:] == [lin] and seen == [lin]
        # The next call records through a new wrapper over that one, and leaves it in place.
        torch.testing.assert_close(fold.autobatch(lambda r: lin(r), rows), lin(x))
        assert nn.Module.__call__ is during[0]
    finally:
        nn.Module.__call__ = module_call
    assert torch.tensor is tensor
    # torch.compile's tracer (in a process of its own: dynamo's state stays behind it).
    script = (
        "import torch, fold\n"
        "model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU())\n"
        "x = torch.randn(5, 2)\n"
        "fold.autobatch(lambda r: model(r), list(x))\n"
        "e = torch._dynamo.explain(model)(x)\n"
        "print(e.graph_break_count, e.graph_count)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "1"], done.stdout


def test_module_that_overrides_call_runs_its_extra_work_once():
    """A module whose own __call__ does more after super().__call__: the extra work is
    recorded around the module's node, and the node runs the module as nn.Module.__call__
    does, so the work happens once, as in eager code."""

    class Doubling(nn.Linear):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs) * 2 + 1

    lin = Doubling(3, 2)
    xs = [torch.randn(3) for _ in range(4)]
    assert_same(lambda x: lin(x), list(lin.parameters()), xs)
    assert_same(lambda x: lin(x), list(lin.parameters()), torch.stack(xs))


def test_fold_models_tree_lstm_with_batched_methods():
    """fold.models.TreeLSTM's batched ops, marked batched=True, from per-example code."""
    model = TreeLSTM(30, 5)
    leaf = fold.batchable(model.leaf, batched=True)
    node = fold.batchable(model.node, batched=True)

    def enc(t):
        if t.left is None:
            return leaf(torch.tensor(t.word))
        (lh, lc), (rh, rc) = enc(t.left), enc(t.right)
        return node(lh, lc, rh, rc)

    got = assert_same(lambda t: enc(t)[0], list(model.parameters())[:-2], trees())
    # The same values as the explicit fold of fold.models.
    f = fold.Fold()
    from fold.models import record_tree

    (want,) = f.apply(model, [[record_tree(f, t) for t in trees()]])
    torch.testing.assert_close(got, want)


def test_child_sum_tree_lstm_with_ragged_lists():
    """A list of lazy values given to a batched=True function arrives as a fold.Ragged."""
    model = ChildSumTreeLSTM(40, 5)
    node = fold.batchable(model.node, batched=True)

    def enc(t):
        return node(torch.tensor(t.word), [enc(c) for c in t.children])

    rng = random.Random(1)
    ts = [random_dep_tree(rng, rng.randint(1, 9), 40) for _ in range(10)]
    assert_same(enc, list(model.parameters())[:-2], ts)


# ---------------------------------------------------------------------------- structures
def test_output_structures_and_eager_leaves():
    lin = nn.Linear(3, 4)

    def fn(x):
        y = lin(x)
        return {"y": y, "pair": (y.sum(), torch.ones(2)), "list": [torch.relu(y)]}

    xs = [torch.randn(3) for _ in range(5)]
    out = assert_same(fn, list(lin.parameters()), xs)
    assert out["y"].shape == (5, 4) and out["pair"][0].shape == (5,)
    assert out["pair"][1].shape == (5, 2) and out["list"][0].shape == (5, 4)


@pytest.mark.parametrize("cls", [BatchableCells, Cells], ids=["batchable", "no annotation"])
def test_autobatch_leaves_no_cyclic_garbage(cls):
    """Recording and applying free everything by reference counting: no reference cycle is
    left per example (pytree.tree_flatten's helper left one), so no collection follows."""
    cells, ts = cls(), trees()
    fold.autobatch(lambda t: encode(cells, t), ts)  # ops and shapes made
    for fn in (lambda t: encode(cells, t), lambda t: encode(cells, t)[0]):
        _assert_no_cyclic_garbage(fn, ts)


def _assert_no_cyclic_garbage(fn, *iterables, **options):
    """``fold.autobatch(fn, *iterables)`` and its result freed leave nothing for a collection."""
    gc.collect()
    gc.disable()  # (else a collection could come first, after recording)
    try:
        out = fold.autobatch(fn, *iterables, **options)
        del out
    finally:
        gc.enable()
    assert gc.collect() == 0


@pytest.mark.parametrize("per_example", [False, True], ids=["rows-once", "per-example"])
@pytest.mark.parametrize("how", ["module", "functional"])
def test_in_place_activations_change_their_input_as_eager(finish, how, per_example):
    """An activation or dropout with ``inplace=True`` (``nn.ReLU(inplace=True)(h)``,
    ``F.relu(h, inplace=True)``) changes its input, as ``h.relu_()`` does: the value object
    becomes the result, for a value of the round and one computed before the example's last
    read alike, and code that reads ``h`` after sees the change (values and gradients equal
    eager, float64).  It ran on the group's batch in place, where a later use of ``h`` kept
    the old value (its rows gathered anew), and on an earlier round's row at once, which
    torch refused (a view of a split)."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3).double()
    relu = nn.ReLU(inplace=True)
    drop = nn.Dropout(0.0, inplace=True)

    def act(h):
        return relu(h) if how == "module" else F.relu(h, inplace=True)

    def fn(x):
        h = lin(x)
        g = h * 2.0  # (recorded before the change: the value before it)
        y = act(h)  # y is h
        k = lin(h) * 1.5
        # a read: k is a value of an earlier round after it (what reads it saves nothing)
        w = k * 0.5 if float(k.detach().sum()) > 0 else k + 1.0
        y2 = act(k)  # y2 is k
        z = drop(lin(y2)) if how == "module" else F.dropout(lin(y2), 0.0, True, True)
        return g + y + h + w + k + y2 * 3.0 + z

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    got = fold.autobatch(fn, torch.stack(xs), per_example=per_example)
    want = eager_stack(fn, xs)
    torch.testing.assert_close(got, want)
    assert_same_grads(got, want, list(lin.parameters()))


def test_autobatch_with_reads_leaves_no_cyclic_garbage():
    """A call whose examples read (rounds), take views of earlier rounds' values (kept once
    per value), detach them, hold a view across a read and change a value of an earlier
    round in place frees everything by reference counting too: what autobatch notes of the
    memory those values share holds them weakly (a kept view held by its recorder made a
    cycle of every round's recorder and outputs, freed only by a collection)."""
    lin = nn.Linear(3, 3)

    def fn(x):
        h = lin(x)
        v = h[1:]  # a view held across the read
        for _ in range(3):
            tok = int(h.detach().argmax())  # a read: h is of an earlier round after it
            first = h[0]  # a view of an earlier round's value, kept once per value
            d = first.detach()  # a tensor made of its row at once
            h = lin(h) * d
            h[tok] = 0.0  # an in-place change of a value of an earlier round
        return h + v.sum()

    xs = [torch.randn(3) for _ in range(4)]
    fold.autobatch(fn, xs)  # ops and shapes made
    _assert_no_cyclic_garbage(fn, xs)


def test_a_module_holding_a_dropout_and_string_results_leave_no_cyclic_garbage():
    """A module holding a Dropout (in eval mode) called across reads, results that are
    strings (a decoded name): nothing left for a collection.  The fast table's entry of such
    a module held its Fold (a trace's table holds the entry: a cycle per call), and a string
    result went through pytree's flatten, whose helper is left in a cycle."""

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.drop = nn.Linear(3, 3), nn.Dropout(0.1)

        def forward(self, x):
            return self.drop(torch.tanh(self.lin(x)))

    step = Step().eval()

    def fn(x):
        h = step(x)
        name = ""
        for _ in range(3):
            k = int(h.detach().argmax())  # a read each step
            name += "abc"[k]
            h = step(h)
        return name

    xs = [torch.randn(3) for _ in range(4)]
    with torch.no_grad():
        assert fold.autobatch(fn, xs, stack=False) == [fn(x) for x in xs]
        _assert_no_cyclic_garbage(fn, xs, stack=False)


def test_results_of_other_structures_than_the_first_are_refused():
    lin = nn.Linear(2, 2)
    xs = [torch.randn(2)] * 3
    for kinds in (["t", "t", "d"], ["d", "d", "t"], ["1", "t", "t"], ["t", "1", "t"]):

        def fn(x, k):
            y = lin(x)
            return {"t": (y, y), "d": {"a": y, "b": y}, "1": y}[k]

        with pytest.raises(fold.FoldError, match="example [12] returned a structure"):
            fold.autobatch(fn, xs, kinds)


def test_mixed_lazy_and_eager_results_at_one_position():
    lin = nn.Linear(2, 2)

    def fn(x, use):
        return lin(x) if use else x * 2

    xs = [torch.randn(2) for _ in range(4)]
    assert_same(fn, list(lin.parameters()), xs, [True, False, True, False])


def test_numbers_in_results_become_a_tensor():
    lin = nn.Linear(2, 2)
    out = fold.autobatch(lambda x, k: (lin(x), k), [torch.randn(2)] * 3, [1, 2, 3])
    assert torch.equal(out[1], torch.tensor([1, 2, 3]))


def test_per_sample_mnist_loss():
    model = nn.Sequential(nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 4))
    x, y = torch.randn(6, 12), torch.randint(0, 4, (6,))
    assert_same(lambda a, b: F.cross_entropy(model(a), b), list(model.parameters()), x, y)
    op_modes = {op.name: op.mode for op in _OPS.values() if op.fn in (model, F.cross_entropy)}
    assert op_modes == {"Sequential call": "direct", "F.cross_entropy": "direct"}


def test_cross_entropy_ignored_target_is_nan_as_eager():
    lin = nn.Linear(3, 4)
    x, y = torch.randn(3, 3), torch.tensor([1, -100, 2])
    got = fold.autobatch(lambda a, b: F.cross_entropy(lin(a), b), x, y)
    want = torch.stack([F.cross_entropy(lin(a), b) for a, b in zip(x, y)])
    torch.testing.assert_close(got, want, equal_nan=True)
    assert got[1].isnan()


@pytest.mark.parametrize(
    "kw",
    [{}, {"reduction": "sum"}, {"reduction": "none"}, {"size_average": False}, {"reduce": False}],
)
@pytest.mark.parametrize("per_example", [True, False])
def test_cross_entropy_reductions_with_ignored_targets(kw, per_example):
    """An ignored target: nan for one example's mean, 0 for its sum, as eager gives; the
    legacy size_average/reduce arguments (which override reduction) too.  Gradients equal
    eager's where the value is a number."""
    lin = nn.Linear(3, 4)
    x, y = torch.randn(4, 3), torch.tensor([1, -100, 2, 0])

    def fn(a, b):
        return F.cross_entropy(lin(a), b, **kw)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the legacy arguments' warning
        got = fold.autobatch(fn, x, y, per_example=per_example)
        want = eager_stack(fn, x, y)
    torch.testing.assert_close(got, want, equal_nan=True)
    w = torch.randn(4)
    grads = [
        torch.autograd.grad((torch.where(want.isnan(), 0.0, out) * w).sum(), [*lin.parameters()])
        for out in (got, want)
    ]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------- tensor rows
class Counted:
    """A per-example function that counts its calls."""

    def __init__(self, fn):
        self.fn = fn
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


def test_tensor_rows_record_once_and_equal_eager():
    """Every iterable a tensor: fn is recorded once on lazy rows and each call runs once on
    the whole batch; values and gradients (of the parameters and of the input rows) equal
    eager per example, and per_example=True, which calls fn per example."""
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    x = torch.randn(7, 2, 5, requires_grad=True)
    y = torch.randint(0, 3, (7,))

    def loss(img, label):
        h = model(img.sum(0) * 0.5)
        return F.cross_entropy(h, label), torch.softmax(h, -1)

    fn = Counted(loss)
    got = assert_same(fn, [*model.parameters(), x], x, y)
    assert fn.calls == 1 + 7 + 7  # once traced; per example; the eager reference
    fn.calls = 0
    per = fold.autobatch(fn, x, y, per_example=True)
    assert fn.calls == 7
    torch.testing.assert_close(per, got)


def _vmap_calls(monkeypatch):
    """The functions torch.func.vmap is given from now on (a group that runs under vmap),
    as a list that grows as they come."""
    calls = []
    real = torch.func.vmap
    monkeypatch.setattr(torch.func, "vmap", lambda f, *a, **k: calls.append(f) or real(f, *a, **k))
    return calls


@pytest.mark.parametrize(
    "reduce",
    [
        lambda h: h.max() + h[0].max(),
        lambda h: torch.min(h) * h[1].min(),
        lambda h: ((h > 0).all(), (h[0] > 0).any(), h[0] * 2),
        lambda h: h[0] * h.argmax() + h[1].argmax(),  # (a 0-dim value's argmax: 0)
        lambda h: h.round().max() + h[0],  # (ties: the gradient split among them)
        lambda h: h.sum() + h.mean() + torch.amin(h[None]) + h[None].amax(),
    ],
)
def test_whole_value_max_min_all_any_run_directly_and_equal_eager(reduce, monkeypatch):
    """``max()``, ``min()``, ``all()``, ``any()``, ``argmax()``, ``sum()``, ``mean()``,
    ``amax()`` and ``amin()`` over a whole per-example value (of any rank; 0-dim too, but
    for the sum and mean) run as one direct call on the group (not under vmap); values and
    gradients equal eager (float64), per example and recorded once."""
    lin = nn.Linear(3, 4)
    vmapped = _vmap_calls(monkeypatch)
    xs = torch.randn(6, 3) * 2
    assert_same(lambda x: reduce(lin(x)), list(lin.parameters()), xs)
    assert not vmapped


@pytest.mark.parametrize(
    "shaped",
    [
        lambda h: (
            (h.view(2, 2) * 2).view(4) + h.reshape(-1, 1).reshape((4,)) * h.view(torch.Size([4]))
        ),
        lambda h: (
            h.view(2, 2).transpose(0, 1).reshape(4) * h.view(1, 2, 2).permute(2, 0, 1).flatten()
        ),
        lambda h: torch.logsumexp(h.view(2, 2), -1) + h.logsumexp(0, keepdim=True),
        lambda h: h.gather(0, (h.detach().abs() * 2).long().clamp(max=3)) + h,
        lambda h: torch.gather(h.view(2, 2), 1, torch.tensor([[1], [0]])).squeeze(1),
        lambda h: torch.broadcast_tensors(h.view(2, 2), h[:2])[1] * 3,
        lambda h: sum(torch.broadcast_tensors(h[:1], h, torch.ones(3, 1, dtype=h.dtype))),
        lambda h: (torch.where((h.view(2, 2) > 0).all(1), h[:2], -h[2:]), (h > 0).any(-1)),
        lambda h: (h * 2, torch._is_all_true(h.abs() > -1), torch._is_any_true(h > 9)),
        lambda h: (h.view(1, 4, 1).squeeze() + h[None].squeeze() * h.squeeze(), h[:1].squeeze()),
        lambda h: (h.sum()[None] * h, h[0][None, ...], h[1][...]),  # (a number's new dims)
    ],
)
def test_reshape_gather_logsumexp_and_broadcasts_run_directly_and_equal_eager(shaped, monkeypatch):
    """``view``/``reshape`` to a shape of ints (a value not contiguous too), ``transpose``
    and ``permute``, ``logsumexp``,
    ``all``/``any`` along a dim, ``gather`` of a per-example (or shared) index,
    ``torch.broadcast_tensors`` of per-example values and shared tensors (a distribution's
    parameters), ``torch._is_all_true`` (its argument check): one direct call on a group,
    not vmap's; values and gradients equal eager (float64), per example and recorded once
    (a policy's Categorical over samples ran 7 of its calls under vmap: 2.2 ms for 256
    samples, 1.1 now)."""
    lin = nn.Linear(3, 4)
    vmapped = _vmap_calls(monkeypatch)
    xs = torch.randn(6, 3) * 2
    assert_same(lambda x: shaped(lin(x)), list(lin.parameters()), xs)
    assert not vmapped


class _TextCNN(nn.Module):
    """A sentence classifier of convolutions over time (Kim 2014) written for one sentence,
    as a batch of one: embeddings (1, D, L), a Conv1d per width, ReLU, max over time, a
    Linear, the cross-entropy of the sentence's label."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.convs = nn.ModuleList([nn.Conv1d(8, 6, k, padding=p) for k, p in ((2, 0), (3, 1))])
        self.out = nn.Linear(12, 4)

    def forward(self, words, label):
        e = self.emb(words).t()[None]
        h = torch.cat([F.relu(c(e)).max(dim=2)[0] for c in self.convs], 1)
        return F.cross_entropy(self.out(h), label[None])


def test_convolutions_over_sentences_of_several_lengths_run_padded(monkeypatch):
    """A sentence classifier of one's own over sentences of several lengths: recorded whole
    for the first length, run through once the lengths vary (a group per length under vmap
    before), its Conv1d on batches of the examples' own (1, C, L) one padded call per conv
    module (its zero padding is what the padding adds), the batches merged, and its ReLU
    and max over time one padded call for both convs; ``t()`` and the cross-entropy over a
    batch of one directly; nothing under vmap.  Values and gradients equal eager (float64).  (Each
    ran under vmap, the conv and the max one group per length.)"""
    torch.manual_seed(0)
    model = _TextCNN()
    words = [torch.randint(0, 50, (int(n),)) for n in (5, 9, 7, 5, 12, 9)]
    labels = [torch.tensor(i % 4) for i in range(6)]
    fold.autobatch(model, words, labels)  # (recorded whole, then run through)
    convs = []
    real = F.conv1d

    def counted(x, *args, **kwargs):
        convs.append(tuple(x.shape))
        return real(x, *args, **kwargs)

    vmapped = _vmap_calls(monkeypatch)
    got = assert_same(model, list(model.parameters()), words, labels)
    assert got.shape == (6,)
    assert not vmapped
    want = torch.stack([model(w, y) for w, y in zip(words, labels)])
    padded = _spy_padded_calls(monkeypatch)
    monkeypatch.setattr(torch.nn.modules.conv.F, "conv1d", counted)
    torch.testing.assert_close(fold.autobatch(model, words, labels), want)
    assert convs == [(6, 8, 12), (6, 8, 12)], convs  # (one call per conv: all six, padded)
    # (the two convs' outputs, of lengths L - 1 and L, share the ReLU's and the max's call)
    assert sorted(padded) == sorted(
        ["Embedding call", "Tensor.t", "Tensor.__getitem__", "Conv1d call", "Conv1d call"]
        + ["F.relu", "Tensor.max"]
    ), padded


class _DeepSets(nn.Module):
    """A set function (Zaheer et al. 2017) written for one set: phi of each element, their
    sum, rho of it, squeezed to a number."""

    def __init__(self) -> None:
        super().__init__()
        self.phi = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 8))
        self.rho = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x):
        return self.rho(self.phi(x).sum(0)).squeeze()


def test_a_set_model_over_sets_of_several_sizes_runs_through_and_pads(monkeypatch):
    """A module of one's own over sets of several sizes: run through once the sizes vary
    (its squeeze() runs directly, so nothing inside runs under vmap), phi and the sum one
    padded call each for all sizes, rho one call; values and gradients equal eager.  (Its
    ``squeeze()`` ran under vmap, which kept the module whole: a group per size, 2.4x
    slower than eager for 128 sets of 3-39 elements, 2.6x faster now; ad hoc.)"""
    torch.manual_seed(0)
    model = _DeepSets()
    sets = [torch.randn(n, 3) for n in (4, 2, 7, 4, 5, 2)]
    fold.autobatch(model, sets)  # (recorded whole for the first size, then run through)
    padded = _spy_padded_calls(monkeypatch)
    vmapped = _vmap_calls(monkeypatch)
    assert_same(model, list(model.parameters()), sets)
    assert not vmapped
    assert "DeepSets call" not in padded and {"Sequential call", "Tensor.sum"} <= set(padded)


class _GraphConv(nn.Module):
    """A graph classifier (Kipf and Welling 2017) written for one graph: its adjacency
    (n, n), node features (n, 3), two graph convolutions and a mean over the nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.out = nn.Linear(3, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, a, x):
        h = torch.relu(a @ self.l1(x))
        h = torch.relu(a @ self.l2(h))
        return self.out(h.mean(0))


def _graphs(sizes):
    adjacency = []
    for n in sizes:
        a = (torch.rand(n, n) < 0.4).to(torch.get_default_dtype())
        a = ((a + a.t()) > 0).to(a.dtype) + torch.eye(n)
        d = a.sum(1).rsqrt()
        adjacency.append(d[:, None] * a * d[None, :])
    return adjacency, [torch.randn(n, 3) for n in sizes]


def test_a_graph_classifier_pads_its_adjacency_in_both_dims(monkeypatch):
    """Graphs of several sizes: each adjacency (n, n) differs in two dims, which padded rows
    now hold (one length for both), so that each graph convolution's matmul, ReLU and
    linear run as one padded call for all the graphs, never in parts (a call per size
    before, with the pads and cats of each: 1.6x slower than eager per graph, 64 graphs of
    5-29 nodes).  Values and gradients equal eager."""
    torch.manual_seed(0)
    model = _GraphConv()
    adjacency, features = _graphs((4, 2, 7, 4, 5, 3))
    fold.autobatch(model, adjacency, features)  # (recorded whole, then run through)
    from fold.autobatch import ops

    calls = {"_pad_run": [], "_ragged_run": []}
    for how, names in calls.items():
        real = getattr(ops._Op, how)
        monkeypatch.setattr(
            ops._Op,
            how,
            lambda self, v, real=real, names=names: names.append(self.name) or real(self, v),
        )
    assert_same(model, list(model.parameters()), adjacency, features)
    assert not calls["_pad_run"], calls
    # (one call per convolution, all six graphs, in each of assert_same's two runs)
    assert calls["_ragged_run"].count("Tensor.matmul") == 4, calls


def _attention(how):
    """Self-attention over one sentence (L, 4), written three ways: separate projections,
    a fused one cut by ``chunk`` or by slices; causal or not."""
    torch.manual_seed(0)
    fused, q, k, v = nn.Linear(4, 12), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def fn(x):
        if how.startswith("chunk"):
            qs, ks, vs = fused(x).chunk(3, -1)
        elif how == "slices":
            p = fused(x)
            qs, ks, vs = p[:, :4], p[:, 4:8], p[:, 8:]
        else:
            qs, ks, vs = q(x), k(x), v(x)
        scores = qs @ ks.t() / 2.0  # (L, L)
        if how == "chunk-causal":
            mask = torch.triu(torch.ones(len(x), len(x), dtype=torch.bool), 1)
            scores = scores.masked_fill(mask, float("-inf"))
        return (torch.softmax(scores, -1) @ vs).mean(0) + torch.softmax(scores, 0).amax(0).sum()

    params = [p for m in (fused, q, k, v) for p in m.parameters()]
    return fn, params


@pytest.mark.parametrize("how", ["separate", "chunk", "chunk-causal", "slices"])
def test_self_attention_written_for_one_sentence_pads_its_scores(how, monkeypatch):
    """Self-attention written for one sentence, over sentences of several lengths: its
    scores (L, L) are padded in both dims, its fused projection cut by ``chunk`` or by
    slices as the padded value's pieces, so that every op runs as one padded call for all
    the lengths, none in parts (the scores and the chunks ran a call per length before:
    1.8x slower than eager per sentence, 64 sentences of 5-29 words).  A softmax along
    either dim of the scores fills the padding past each length with -inf along its dim
    alone (no line of -inf, whose softmax is nan).  Values and gradients equal eager."""
    fn, params = _attention(how)
    xs = [torch.randn(n, 4) for n in (3, 6, 2, 6, 4, 1)]
    fold.autobatch(fn, xs)
    names = []
    from fold.autobatch import ops

    real = ops._Op._pad_run
    monkeypatch.setattr(
        ops._Op, "_pad_run", lambda self, v: names.append(self.name) or real(self, v)
    )
    assert_same(fn, params, xs)
    assert not names, names


@pytest.mark.parametrize(
    "cut",
    [
        lambda h: torch.stack([c.sum(0) for c in h.chunk(2, 0)]),  # (along the length)
        lambda h: torch.stack([c.sum(0) for c in h.split(2)[:1]]),
        lambda h: h.unbind(0)[0] + h.unbind(1)[1].sum(),
        lambda h: h[-2:].sum(0),  # (from the end: it would read the padding)
        lambda h: sum(c.sum(0) for c in h.split([1, 3], dim=1)),  # (pieces of two shapes)
        lambda h: h[:5].sum(0) + h[4:].sum(0) + h[:-1].sum(0),  # (past some lengths)
    ],
)
def test_pieces_and_slices_that_padding_would_change_equal_eager(cut):
    """Pieces along the dim the values differ in, slices from the end, pieces of several
    shapes: not padded (each value's pieces are not the padded value's), a call per
    length; values and gradients equal eager."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    xs = [torch.randn(n, 4) for n in (3, 6, 2, 6, 4, 2)]
    assert_same(lambda x: cut(lin(x)), list(lin.parameters()), xs)


@pytest.mark.parametrize(
    "conv",
    [
        lambda: nn.Conv2d(2, 3, 3, padding=1, stride=2),
        lambda: nn.Conv2d(2, 4, (2, 3), dilation=(2, 1), groups=2),
        lambda: nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"),  # (per shape)
        lambda: nn.ConvTranspose2d(2, 3, 3, stride=2),
    ],
)
def test_convolutions_over_images_of_several_sizes_equal_eager(conv):
    """Conv2d over images of several heights and widths, each a batch of one (1, C, H, W)
    or unbatched (C, H, W): padded groups where zeros are what the conv reads past an
    image (zero padding; reflect padding keeps a group per size; a transposed conv writes
    past the image, so it keeps a group per size too), the examples merged; values and
    gradients equal eager (float64)."""
    torch.manual_seed(0)
    c = conv()
    images = [torch.randn(2, h, w) for h, w in ((5, 7), (6, 6), (5, 7), (8, 5))]
    assert_same(lambda x: c(x[None])[0].tanh().sum((1, 2)), list(c.parameters()), images)
    assert_same(lambda x: c(x).amax((1, 2)), list(c.parameters()), images)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_loss_over_a_batch_of_the_examples_own_runs_directly(reduction, monkeypatch):
    """``F.cross_entropy`` and ``F.nll_loss`` of (N, classes) scores and N class indices
    per example (a model called on ``x[None]``, or on a few rows), with ignored targets,
    and an example whose targets are all ignored (a mean of nothing: nan, as eager):
    one direct call for the group; values and gradients equal eager (float64)."""
    lin = nn.Linear(3, 5)
    vmapped = _vmap_calls(monkeypatch)
    xs = torch.randn(6, 4, 3)
    ys = torch.randint(0, 5, (6, 4))
    ys[1, 2] = 7
    ys[3] = 2
    ys[4] = 7

    def fn(x, y):
        h = lin(x)
        return (
            F.cross_entropy(h, y, ignore_index=7, reduction=reduction),
            F.nll_loss(F.log_softmax(h, -1), y.clamp(max=4), reduction=reduction),
            F.cross_entropy(h, torch.where(y == 7, -100, y), reduction=reduction),
            F.cross_entropy(h[:1], y[:1].clamp(0, 4), label_smoothing=0.1),
        )

    keep = [0, 1, 2, 3, 5]  # (the all-ignored example's nan: compared apart, below)
    assert_same(fn, list(lin.parameters()), xs[keep], ys[keep])
    got = fold.autobatch(fn, xs, ys)
    want = torch.stack([fn(x, y)[0] for x, y in zip(xs, ys)])
    torch.testing.assert_close(got[0], want, equal_nan=True)
    assert not vmapped
    assert torch.isnan(got[0][4]) == (reduction == "mean")


@pytest.mark.parametrize("how", ["max", "min"])
def test_max_and_min_along_a_dim_run_directly_and_equal_eager(how, monkeypatch):
    """``x.max(dim)``, ``torch.min(x, dim, keepdim=True)``: values and indices (ties: the
    first, as eager), one direct call; gradients flow to the indices taken."""
    lin = nn.Linear(3, 6)
    vmapped = _vmap_calls(monkeypatch)
    reduce = getattr(torch, how)

    def fn(x):
        h = lin(x).view(2, 3).round()  # (ties)
        v, i = getattr(h, how)(dim=1)
        w = reduce(h, 0, keepdim=True)
        return v * 2, i, w.values, w.indices, h.t().sum(0)

    assert_same(fn, list(lin.parameters()), torch.randn(7, 3) * 3)
    assert not vmapped


@pytest.mark.parametrize("kind", ["tuples", "lists", "dicts"])
def test_a_datasets_samples_of_tensors_are_recorded_once(kind, recordings):
    """A list of samples as a Dataset yields them, each an ``(x, y)`` tuple (a list, a
    dict) of tensors of one shape: ``fn(sample)`` recorded once for all of them, each field
    stacked, the function given the sample's structure of lazy rows; values and gradients
    equal eager (float64).  (They were recorded one by one: 3.8 against 0.46 ms for 256
    samples of an MLP's loss; ad hoc.)  Samples that differ in a field's dtype or shape, or
    hold a number, are recorded per example, with the same results."""
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    xs, ys = torch.randn(9, 5), torch.randint(0, 3, (9,))
    if kind == "dicts":
        samples = [{"x": x, "y": y} for x, y in zip(xs, ys)]
        fn = lambda s: F.cross_entropy(model(s["x"]), s["y"]) + model(s["x"]).sum()  # noqa: E731
    else:
        make = tuple if kind == "tuples" else list
        samples = [make((x, y)) for x, y in zip(xs, ys)]
        fn = lambda s: F.cross_entropy(model(s[0]), s[1]) + model(s[0]).sum()  # noqa: E731
    counts = recordings
    got = fold.autobatch(fn, samples)
    assert counts == {"once": 1, "per example": 0}
    want = torch.stack([fn(s) for s in samples])
    torch.testing.assert_close(got, want)
    params = list(model.parameters())
    for a, b in zip(
        torch.autograd.grad(got.sum(), params), torch.autograd.grad(want.sum(), params)
    ):
        torch.testing.assert_close(a, b)
    odd = list(samples)
    odd[2] = {"x": xs[2][:4], "y": ys[2]} if kind == "dicts" else make((xs[2][:4], ys[2]))
    with pytest.raises(fold.FoldError, match="example 2"):  # (per example: its error names it)
        fold.autobatch(fn, odd)
    mixed = [(x, int(y)) for x, y in zip(xs, ys)]  # (a tensor indexed by an int label)
    counts["once"] = counts["per example"] = 0
    got = fold.autobatch(lambda s: model(s[0])[s[1]], mixed)
    assert counts["per example"] == 0
    torch.testing.assert_close(got, torch.stack([model(x)[int(y)] for x, y in zip(xs, ys)]))


def _grads_equal(got, want, params):
    torch.testing.assert_close(got, want)
    for a, b in zip(
        torch.autograd.grad(got.sum(), params),
        torch.autograd.grad(want.sum(), params, retain_graph=True),
    ):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("form", ["pairs", "two lists", "dicts", "tensor of a list"])
def test_a_datasets_int_labels_are_recorded_once(form, recordings):
    """Samples as torchvision's datasets yield them, ``(image, int label)``, and the loss
    written for one: ``F.cross_entropy(model(x.view(1, -1)), torch.tensor([y]))``.  The
    label is a number per row (``values.RowNumber``): the function is recorded once for all
    samples, ``torch.tensor([y])`` the rows' labels; values and gradients equal eager
    (float64) and the per-example path.  (Recorded one by one before: 4.9x the collated
    step against 2.25x, 32 MNIST samples; ad hoc.)"""
    model = nn.Sequential(nn.Linear(12, 7), nn.Tanh(), nn.Linear(7, 3))
    images = [torch.randn(1, 3, 4) for _ in range(9)]
    labels = [i % 3 for i in range(9)]
    params = list(model.parameters())

    def loss(x, y):
        assert isinstance(y, int)  # (as eager code meets it)
        if form == "tensor of a list":
            return F.cross_entropy(model(x.view(1, -1)), torch.tensor([[y]])[0])
        return F.cross_entropy(model(x.view(1, -1)), torch.tensor([y]))

    if form == "two lists":
        got = fold.autobatch(loss, images, labels)
        ref = fold.autobatch(loss, images, labels, per_example=True)
    elif form == "dicts":
        samples = [{"image": x, "label": y} for x, y in zip(images, labels)]
        got = fold.autobatch(lambda s: loss(s["image"], s["label"]), samples)
        ref = fold.autobatch(lambda s: loss(s["image"], s["label"]), samples, per_example=True)
    else:
        pairs = list(zip(images, labels))
        got = fold.autobatch(lambda p: loss(*p), pairs)
        ref = fold.autobatch(lambda p: loss(*p), pairs, per_example=True)
    assert recordings["once"] == 1
    want = torch.stack([loss(x, y) for x, y in zip(images, labels)])
    _grads_equal(got, want, params)
    _grads_equal(ref, want, params)


def test_numbers_per_row_of_each_type_equal_eager(recordings):
    """Float, bool and int numbers per row through ``torch.tensor`` (a weight, a flag, a
    label; a dtype given; ``torch.as_tensor``; mixed with Python numbers in one list), an
    int as an index (``log_probs[y]``, ``out[0, y]``), and returned as they are (stacked as per-example results are:
    floats in the default dtype): recorded once, values and gradients equal eager."""
    lin = nn.Linear(4, 3)
    xs = [torch.randn(4) for _ in range(6)]
    weights = [0.1 * i + 1e-9 for i in range(6)]  # (bits a float32 conversion would round)
    flags = [i % 2 == 0 for i in range(6)]
    labels = [i % 3 for i in range(6)]

    def fn(x, w, flag, y):
        out = lin(x)
        score = out[torch.tensor(y)] * torch.tensor(w) + torch.as_tensor(w, dtype=torch.float32)
        score = score - F.log_softmax(out, -1)[y] + out[None][0, y]  # (an index by the int)
        mask = torch.tensor([flag, True])
        pair = torch.tensor([y, 2.5])  # (an int beside a float: the default dtype)
        return score, mask, pair + out.sum(), w, y, flag, torch.tensor(w)

    got = fold.autobatch(fn, xs, weights, flags, labels)
    assert recordings["per example"] == 0
    outs = [fn(*ex) for ex in zip(xs, weights, flags, labels)]
    want = [torch.stack([torch.as_tensor(o[j]) for o in outs]) for j in range(7)]
    for j, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype
        exact = j not in (0, 2)  # (numbers as given: their bits; the rest computed)
        torch.testing.assert_close(g, w, rtol=0 if exact else None, atol=0 if exact else None)
    params = list(lin.parameters())
    for a, b in zip(
        torch.autograd.grad((got[0] + got[2].sum(1)).sum(), params),
        torch.autograd.grad((want[0] + want[2].sum(1)).sum(), params),
    ):
        torch.testing.assert_close(a, b)


def test_a_function_recorded_once_records_its_next_call_through_the_fast_tables(monkeypatch):
    """A function recorded once on lazy rows keeps its trace and the recorder's fast tables
    (``traced._TRACES``): its next call records the same calls by the C fast path, none by
    the slow one, and each call records what its own Python does (a scale and a branch
    changed between calls): values and gradients equal eager on every call."""
    lin = nn.Linear(5, 4)
    xs = [torch.randn(5) for _ in range(7)]
    state = {"scale": 1.0, "tanh": True}

    def fn(x):
        h = lin(x) * state["scale"]
        return torch.tanh(h) if state["tanh"] else torch.relu(h)

    slow = []
    real = recorder._Recorder._record

    def counted(self, *args, **kwargs):
        slow.append(args[0])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(recorder._Recorder, "_record", counted)
    params = list(lin.parameters())
    counts = []
    for scale, tanh in [(1.0, True), (1.0, True), (2.0, True), (2.0, False), (1.0, True)]:
        state["scale"], state["tanh"] = scale, tanh
        slow.clear()
        got = fold.autobatch(fn, xs)
        _grads_equal(got, torch.stack([fn(x) for x in xs]), params)
        counts.append(len(slow))
    if common._C is not None:  # (the fast tables are the C path's)
        assert counts[0] > 0 and counts[1] == 0 and counts[4] == 0, counts


_LABEL_USES = ("tensor", "index", "branch", "arith", "loop", "weight", "pair")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=7),
    st.lists(st.sampled_from(_LABEL_USES), min_size=1, max_size=4, unique=True),
    st.sampled_from(["pairs", "lists"]),
)
def test_random_uses_of_labels_per_row_equal_eager(labels, uses, form):
    """Random per-example programs over (x, int label) samples and a float weight per
    sample, the label used as a tensor, an index, a branch, arithmetic, a loop count: the
    same values and gradients as eager per example (float64), however the rows split at
    the reads."""
    torch.manual_seed(len(labels))
    lin, head = nn.Linear(3, 4), nn.Linear(4, 4)
    xs = [torch.randn(3) for _ in labels]
    weights = [0.25 * y - 0.1 for y in labels]

    def fn(x, y, w):
        out = head(torch.tanh(lin(x)))
        total = out.sum() * 0
        if "tensor" in uses:
            total = total + F.cross_entropy(out[None], torch.tensor([y]))
        if "index" in uses:
            total = total - F.log_softmax(out, -1)[y]
        if "branch" in uses:
            total = total + (torch.tanh(out).sum() if y > 1 else torch.relu(out).sum())
        if "arith" in uses:
            total = total + torch.tensor(y * 2 + 1) * out.mean()
        if "loop" in uses:
            h = out
            for _ in range(y):
                h = head(torch.tanh(h))
            total = total + h.sum()
        if "weight" in uses:
            total = total * torch.tensor(w)
        if "pair" in uses:
            total = total + torch.tensor([y, w]).sum()
        return total

    if form == "pairs":
        samples = list(zip(xs, labels, weights))
        got = fold.autobatch(lambda s: fn(*s), samples)
    else:
        got = fold.autobatch(fn, xs, labels, weights)
    want = torch.stack([fn(*s) for s in zip(xs, labels, weights)])
    _grads_equal(got, want, [*lin.parameters(), *head.parameters()])


def test_numbers_per_row_read_in_python_equal_eager(recordings):
    """A number per row used in Python (``if y == 2``, ``range(y)``, an index of a list, a
    dict's key, arithmetic, ``str``) is read: the rows that hold one value go on together,
    as a tensor's reads do; a torch call given the number itself (``x * y``) falls back to
    per example.  Every form equals eager, values and gradients."""
    lin = nn.Linear(4, 4)
    xs = [torch.randn(4) for _ in range(8)]
    labels = [i % 3 for i in range(8)]
    names = {0: "a", 1: "bb", 2: "ccc"}
    params = list(lin.parameters())

    def branches(x, y):
        h = lin(x)
        if y == 2:
            h = torch.tanh(h)
        for _ in range(y):
            h = lin(h)
        mixed = [y + 1, y * 2.0, 0.5 + y, y / 4, 2**y, -y, abs(y - 1), float(y)]
        return h * len(["a", "bb", "ccc"][y]) + torch.tensor(mixed).sum() + len(f"{y:03d}")

    def looked_up(x, y):
        return lin(x) * len(names[y])  # (a dict's key: per example)

    def scaled(x, y):
        return lin(x) * y  # (a torch call given the number: per example)

    def made(x, y):
        h = lin(x)
        return h + h.new_tensor(y)  # (a method given the number: per example)

    for fn in (branches, looked_up, scaled, made):
        recordings["per example"] = 0
        got = fold.autobatch(fn, xs, labels)
        want = torch.stack([fn(x, y) for x, y in zip(xs, labels)])
        _grads_equal(got, want, params)
        assert (recordings["per example"] == 0) == (fn is branches), fn.__name__
    recordings["once"] = recordings["per example"] = 0
    got = fold.autobatch(lambda y: lin(torch.ones(4) * y), labels)  # (numbers alone)
    assert recordings["once"] == 0
    _grads_equal(got, torch.stack([lin(torch.ones(4) * y) for y in labels]), params)


class _EarlyExit(nn.Module):
    """An early-exit classifier written for one example: where the first head is confident
    it answers, else the example goes on through a second block (a read: ``if``)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.head1 = nn.Linear(6, 6), nn.Linear(6, 3)
        self.second, self.head2 = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x))
        p = torch.softmax(self.head1(h), -1)
        if p.max() > 0.4:
            return p
        return torch.softmax(self.head2(torch.relu(self.second(h)) + h), -1)


@pytest.mark.parametrize("rows", ["tensor", "list"])
def test_reads_of_tensor_rows_run_in_lockstep_split_where_rows_disagree(rows, recordings):
    """Tensor rows (a tensor, or a Dataset's list of samples of one shape) whose function
    reads: recorded once for all rows, a read runs what is recorded so far and the rows go
    on in lockstep; where they read different values (an early exit taken by some), the
    function is recorded again for each group of rows that read one value, from the values
    computed so far.  Values and gradients (parameters, inputs) equal eager (float64), and
    no example is recorded on its own."""
    torch.manual_seed(0)
    model = _EarlyExit().double()
    x = torch.randn(12, 6, dtype=torch.float64) * 2
    took = [bool(torch.softmax(model.head1(torch.relu(model.first(r))), -1).max() > 0.4) for r in x]
    assert 0 < sum(took) < len(took)  # (both paths taken)
    counts = recordings
    xs = x if rows == "tensor" else list(x)
    got = fold.autobatch(model, xs)
    assert counts == {"once": 3, "per example": 0}  # all rows, then each group
    want = torch.stack([model(r) for r in x])
    torch.testing.assert_close(got, want)
    leaf = x.clone().requires_grad_()
    w = torch.randn_like(want)
    grads = torch.autograd.grad(
        (fold.autobatch(model, leaf) * w).sum(), [leaf, *model.parameters()]
    )
    want_grads = torch.autograd.grad(
        (torch.stack([model(r) for r in leaf]) * w).sum(), [leaf, *model.parameters()]
    )
    for g, h in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, h)


def test_lockstep_reads_that_agree_record_once_and_nested_splits_equal_eager(recordings):
    """Reads every row agrees on (a flag that holds for all) cost no split; reads that split
    the rows again inside a group (an int that picks how many steps, then a sign), and
    ``.tolist()`` reads, each group recorded from what its rows read before: values and
    gradients equal eager (float64)."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4).double()
    x = torch.randn(32, 4, dtype=torch.float64)

    def fn(r):
        h = torch.tanh(lin(r))
        if (h.abs() <= 1).all():  # every row: no split
            h = h * 2
        for _ in range(int(r.argmax()) % 2 + 1):  # one or two steps
            h = torch.tanh(lin(h))
        if h.sum() > 0:  # (groups split again)
            h = h + 1
        first = (h[:1] > 0).tolist()
        return h * (1.0 + first[0]), h.sum()

    counts = recordings
    assert_same(fn, list(lin.parameters()), x)
    assert counts["per example"] == 32  # (assert_same's per_example=True run alone)
    assert 1 + 2 + 4 < counts["once"] <= 1 + 16  # (splits into 2, 4, then up to 8 groups)


def test_lockstep_gives_way_to_examples_recorded_one_by_one(recordings):
    """Where the rows' reads split them into too many groups (a read of a float that
    differs in every row), or a call that changes a module's buffers would run before a
    read (a batch norm in training), the examples are recorded one by one as before: the
    results equal eager, and the batch norm's statistics count each example once."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4).double()
    x = torch.randn(16, 4, dtype=torch.float64)

    def scaled(r):
        h = lin(r)
        return h * float(h.detach().sum())  # (a Python float per row)

    counts = recordings
    assert_same(scaled, list(lin.parameters()), x)
    assert counts["per example"] >= 16

    norm, twin = nn.BatchNorm1d(4).double(), nn.BatchNorm1d(4).double()
    xs = torch.randn(5, 3, 4, dtype=torch.float64)

    def normed(m):
        def fn(r):
            h = m(r)
            if bool(h[0, 0] > 0):  # (rows disagree)
                h = h * 2
            return h.sum()

        return fn

    torch.testing.assert_close(fold.autobatch(normed(norm), xs), eager_stack(normed(twin), xs))
    torch.testing.assert_close(norm.running_mean, twin.running_mean)
    torch.testing.assert_close(norm.running_var, twin.running_var)
    assert int(norm.num_batches_tracked) == int(twin.num_batches_tracked) == 5


@pytest.mark.parametrize(
    "flatten",
    [
        lambda r: r.flatten(),
        lambda r: r.flatten(1),
        lambda r: torch.flatten(r, 0, 1),
        lambda r: r.flatten(-2, -1),
        lambda r: r.flatten(start_dim=1, end_dim=-1),
        lambda r: r[0, 0].flatten(),
    ],
)
def test_flatten_runs_directly_with_its_dims_moved(flatten):
    lin = nn.Linear(4, 4)
    x = torch.randn(5, 2, 3, 4)
    assert_same(lambda r: flatten(lin(r)), list(lin.parameters()), x)
    modes = {op.mode for op in _OPS.values() if op.fn in (torch.flatten, torch.Tensor.flatten)}
    assert modes == {"direct"}


@pytest.mark.parametrize(
    "fn",
    [
        lambda h, b: h + b,  # (T, D) + (D,)
        lambda h, b: b * h,  # (D,) * (T, D)
        lambda h, b: (h * b)[None] + h,  # (1, T, D) + (T, D): a batch of one, a position table
        lambda h, b: torch.where(h > 0, b, h),  # (T, D) mask, (D,), (T, D)
        lambda h, b: torch.maximum(b, h.sum(0, keepdim=True)),  # (D,) and (1, D)
    ],
    ids=["add", "rmul", "batch-of-one", "where", "maximum"],
)
def test_elementwise_calls_on_per_example_values_of_several_ranks_run_directly(fn):
    """Per-example arguments of several ranks (each example's values broadcast as
    broadcasting aligns them): the group runs as one call, each stacked argument given
    1-dims after its batch dim (``tables._aligned_elementwise``), not under vmap.  Values
    and gradients equal eager's; examples of several lengths, in rounds."""
    driver.clear_cache()  # (the ops below are this test's alone)
    lin, proj = nn.Linear(3, 4), nn.Linear(3, 4)

    def per_example(x):
        h = lin(x)
        b = torch.tanh(proj(x[0]))
        out = fn(h, b)
        if float(out.detach().sum()) > 0:  # a read: a second round
            out = out * 2
        return out

    xs = [torch.randn(n, 3) for n in (2, 4, 3, 4)]
    want = [per_example(x) for x in xs]
    got = fold.autobatch(per_example, xs, stack=False)
    assert_same_lists(got, want, [*lin.parameters(), *proj.parameters()])
    ops = [
        op
        for op in _OPS.values()
        if op.mode is common._DIRECT and getattr(op.call, "func", None) is tables._aligned_call
    ]
    assert ops, "no call ran aligned"


@pytest.mark.parametrize(
    "index",
    [(None,), (slice(None), None), (Ellipsis, None)],
    ids=["[None]", "[:, None]", "[..., None]"],
)
def test_new_dims_of_values_of_several_lengths_share_one_padded_group(index):
    """``x[None]`` (a batch of one, as torch's modules take it), ``x[:, None]``,
    ``x[..., None]`` of per-example values of several lengths: one group op for every
    length (run as one padded call), as ``x[0]`` is, not a group per length.  Values and
    gradients equal eager's."""
    driver.clear_cache()  # (the ops below are this test's alone)
    lin = nn.Linear(3, 4)
    xs = [torch.randn(n, 3) for n in (2, 5, 3, 5, 4)]

    def fn(x):
        return torch.tanh(lin(x)[index]).sum(0)

    want = [fn(x) for x in xs]
    got = fold.autobatch(fn, xs, stack=False)
    assert_same_lists(got, want, list(lin.parameters()))
    ops = [op for op in _OPS.values() if op.fn is tables._GETITEM and op.args[1] == index]
    assert len(ops) >= 3 and len({op.fold_op for op in ops}) == 1, ops


def test_an_elementwise_call_with_a_0d_per_example_value_keeps_eager_dtypes():
    """A 0-dim tensor takes no part in type promotion in eager code (float32 times a
    float64 0-dim tensor is float32); stacked with 1-dims it would (float64): such a call is
    not run aligned (vmap promotes as eager code does), and the dtype is eager's."""
    lin = nn.Linear(3, 4).float()

    def per_example(x):
        s = x.sum().double()  # 0-dim, float64, per example
        return lin(x) * s

    xs = [torch.randn(n, 3, dtype=torch.float32) for n in (2, 4, 3)]
    got = fold.autobatch(per_example, xs, stack=False)
    for g, x in zip(got, xs):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, per_example(x))


def test_tensor_rows_literals_lists_and_constant_results():
    """Values made inside fn (the same for every example) are repeated over the batch: a
    number or tensor given to a recorded call, a list given to a batched=True function
    (a Ragged of equal lists), a tensor or number returned as it is."""
    a, b = nn.Linear(3, 4), nn.Linear(3, 4)

    @fold.batchable(batched=True)
    def total(items):
        return items.sum() * items.lengths.unsqueeze(1)

    def fn(x, k):
        h = a(x)
        return (
            h + torch.tensor([1.0, 2.0, 3.0, 4.0]),
            F.cross_entropy(h, torch.tensor(2)) + F.cross_entropy(h, k),
            total([h, b(x), h * 2]),
            torch.ones(2),
            5,
        )

    f = Counted(fn)
    x, k = torch.randn(5, 3), torch.randint(0, 4, (5,))
    assert_same(f, [*a.parameters(), *b.parameters()], x, k)
    assert f.calls == 1 + 5 + 5


def test_tensor_rows_that_cannot_be_traced_record_per_example():
    """fn reading a row, changing one in place, or giving a batched=True function an empty
    list: the one recording fails, autobatch records per example (the same results), and
    later calls with the same function and row shapes go straight there."""
    lin = nn.Linear(3, 2)

    @fold.batchable(batched=True)
    def total(items):
        return items.sum()

    def reads(x, k):
        return lin(x) * int(k)

    def in_place(x, k):
        x.mul_(2)
        return lin(x)

    def empty(x, k):
        return total([lin(x) for _ in range(int(k) - int(k))]) + lin(x)

    x, k = torch.randn(4, 3), torch.tensor([1, 2, 3, 4])
    for fn in (reads, in_place, empty):
        # A callable object is remembered by id: one freed by an earlier test may share it.
        traced._UNTRACEABLE.clear()
        f = Counted(fn)
        want = eager_stack(fn, x.clone(), k)
        torch.testing.assert_close(fold.autobatch(f, x.clone(), k), want)
        assert f.calls == 1 + 4
        f.calls = 0
        torch.testing.assert_close(fold.autobatch(f, x.clone(), k), want)
        assert f.calls == 4, fn.__name__


def test_a_recording_made_once_changes_its_own_values_in_place():
    """Recorded once for every row, a function that changes a value it computed in place
    (``h += b``, ``h.mul_(2)``, ``h[0] = 0``, a list holding ``h`` first) stays recorded once:
    the value object becomes its new value, as per example (values and gradients equal
    eager's, float64).  A change eager code would see through a view (``v = h[0:2]; v += 1``)
    records per example instead, which refuses it."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3).double()

    def changes(x):
        h = lin(x)
        kept = [h]
        h += x
        h.mul_(2.0)
        h[0] = 0.0
        return kept[0] * 1.0

    def through_a_view(x):
        h = lin(x)
        v = h[0:2]
        v += 1.0
        return h

    xs = torch.randn(4, 3, dtype=torch.float64)
    traced._UNTRACEABLE.clear()
    f = Counted(changes)
    assert_same(f, list(lin.parameters()), xs)
    f.calls = 0
    fold.autobatch(f, xs)
    assert f.calls == 1  # (once for every row)
    f = Counted(through_a_view)
    with pytest.raises(fold.FoldError, match=r"example 0: in-place \.__iadd__\(\) .*view"):
        fold.autobatch(f, xs)
    assert f.calls == 1 + 1  # (the recording once, then the first example)

    def a_row(x):  # (eager code changes the caller's tensor: per example, so does autobatch)
        x += 1.0
        return lin(x)

    rows = xs.clone()
    torch.testing.assert_close(fold.autobatch(a_row, rows), eager_stack(a_row, xs.clone()))
    torch.testing.assert_close(rows, xs + 1.0)


def test_a_seed_set_inside_the_function_warns_where_a_recorded_value_draws():
    """``torch.manual_seed`` inside the function: a random call on a recorded value (here
    ``F.dropout`` of a computed value) draws when its group runs, so the seed cannot give it
    eager's numbers (a silent difference before): a warning says so and names the fix.  A
    draw with no recorded argument runs at once and follows the seed, as eager's (equal
    values and gradients, no warning).  torch.manual_seed stays torch's own."""
    lin = nn.Linear(3, 3)
    xs = [torch.randn(3) for _ in range(3)]
    real = torch.manual_seed

    def at_once(x):
        torch.manual_seed(7)
        return lin(x) * (torch.rand(3) > 0.5)

    got = fold.autobatch(at_once, xs)  # (no warning: the suite's warnings are errors)
    want = torch.stack([at_once(x) for x in xs])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(
        torch.autograd.grad(got.sum(), lin.weight), torch.autograd.grad(want.sum(), lin.weight)
    )

    def recorded(x):
        torch.manual_seed(11)
        return F.dropout(torch.tanh(lin(x)), 0.5)

    for rows in (xs, [x[None] for x in xs]):  # (one recording for all rows; per example)
        torch.manual_seed(0)
        with pytest.warns(UserWarning, match=r"example \d+: .*after torch.manual_seed.*Fix:"):
            fold.autobatch(recorded, rows, per_example=rows is not xs)
    assert torch.manual_seed is real


def test_random_draws_are_not_shared_by_a_recording_made_once():
    """A tensor drawn eagerly inside fn (torch.randn with no lazy argument) differs per
    example: a recording made once would share one draw, so autobatch records per example,
    drawing the same numbers as eager code from the same seed; a @batchable function that
    draws runs under vmap (a draw per row and per call), not as a recording kept for every
    group."""
    lin = nn.Linear(3, 3)
    x = torch.randn(4, 3)

    def noisy(r):
        return lin(r) + torch.randn(3)

    torch.manual_seed(1)
    got = fold.autobatch(noisy, x)
    torch.manual_seed(1)
    torch.testing.assert_close(got, eager_stack(noisy, x))

    @fold.batchable
    def jitter(a):
        return a + torch.randn(3)

    def fn(r):
        return jitter(lin(r)) - lin(r)

    first, second = fold.autobatch(fn, [*x]), fold.autobatch(fn, [*x])
    assert not torch.allclose(first[0], first[1])  # a draw per row
    assert not torch.allclose(first, second)  # and per call
    (op,) = [op for op in _OPS.values() if op.fn is jitter.fn]
    assert traced._compile(op) is False


def test_a_batchable_function_reads_its_state_in_each_call():
    """A @batchable function recorded once reads Python state (self.training) when recorded:
    each autobatch call records it again, so model.eval() between calls is seen."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        @fold.batchable
        def cell(self, x):
            return F.dropout(self.lin(x), 0.5, training=self.training) * 2.0

    net = Net()
    xs = [torch.randn(4) for _ in range(6)]
    train = fold.autobatch(net.cell, xs)
    assert (train == 0).any()  # dropout in training mode
    net.eval()
    assert_same(net.cell, list(net.parameters()), xs)


def test_tensor_rows_stop_at_the_shortest_and_keep_errors():
    """Rows of unequal tensors pair up as zip pairs them; an error inside a batched call
    still names the user's line (from the per-example recording autobatch falls back to)."""
    lin = nn.Linear(3, 3)
    x, w = torch.randn(6, 3), torch.randn(4)
    torch.testing.assert_close(
        fold.autobatch(lambda r, s: lin(r) * s, x, w), eager_stack(lambda r, s: lin(r) * s, x, w)
    )

    @fold.batchable
    def reads(v):
        return v * v.sum().item()

    with pytest.raises(fold.FoldError, match=r"test_autobatch\.py:\d+: .*reads\(lin\(r\)\)"):
        fold.autobatch(lambda r: reads(lin(r)), x)


def test_a_batch_module_whose_code_mixes_rows_runs_per_example():
    """A BatchModule whose model centres its batch (h - h.mean(0)): the examples' rows of one
    group would mix, so its calls run one example at a time; a model whose code keeps its
    rows apart still runs the group as one call."""
    from fold.batched_ops import BatchModule

    class Centred(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 5)

        def forward(self, x):
            h = self.lin(x)
            return h - h.mean(0)

    torch.manual_seed(0)
    bm = BatchModule.from_modules([Centred() for _ in range(3)]).double()
    xs = [torch.randn(3, 2, 4, dtype=torch.float64) for _ in range(5)]
    with pytest.warns(UserWarning, match="acts along the rows' dim"):
        assert_same(lambda x: bm(x).square(), list(bm.parameters()), xs)
    assert bm.rows_kept("forward", xs[0]) is False
    kept = BatchModule(nn.Sequential(nn.Linear(4, 5), nn.Tanh()), batch=3).double()
    assert_same(lambda x: kept(x).square(), list(kept.parameters()), xs)
    assert kept.rows_kept("forward", xs[0]) is True


def test_batch_module_call_per_example():
    from fold.batched_ops import BatchModule

    bm = BatchModule(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)), batch=3)
    xs = [torch.randn(3, 2, 4) for _ in range(5)]
    out = assert_same(lambda x: bm(x).square(), list(bm.parameters()), xs)
    assert out.shape == (5, 3, 2, 2)
    # Rows of a tensor: recorded once, the models' rows merged the same way.
    f = Counted(lambda x: bm(x).square())
    assert_same(f, list(bm.parameters()), torch.stack(xs))
    # Recorded on lazy rows twice (its forward's calls would run under vmap: again with the
    # module call as one call), then per example twice.
    assert f.calls == 2 + 5 + 5
    f.calls = 0
    fold.autobatch(f, torch.stack(xs))
    assert f.calls == 1  # remembered: straight to one call per module
    assert any(op.fn is bm and op.mode == "model-batched" for op in _OPS.values())


def test_batchable_function_runs_as_its_calls_not_under_vmap():
    """A group of @batchable per-example calls runs as the calls the function makes,
    recorded once on lazy values (each call on the batch in its own mode), not under vmap;
    one that returns a value depending on no argument, or reads one, runs under vmap."""
    torch.manual_seed(0)
    lin = nn.Linear(6, 6)
    w = nn.Parameter(torch.randn(3, 3))

    @fold.batchable
    def inner(a):
        return torch.softmax(a, -1) * a[0]

    @fold.batchable
    def cell(a, b):
        p, q = lin(torch.cat([a, b])).chunk(2)
        return inner(p) + q @ w * torch.ones(3), torch.stack([a, b]).mean(0)

    @fold.batchable
    def constant(a):
        return torch.ones(3) + 0 * a.sum(), torch.ones(2)

    def fn(x):
        a, b = x.chunk(2)
        h, m = cell(a, b)
        return h, m, constant(h)

    made = {}
    compile_ = common.HOOKS.compile

    def spy(op):
        made[op.name] = compile_(op)
        return made[op.name]

    common.HOOKS.compile = spy
    try:
        xs = [torch.randn(6) for _ in range(5)]
        assert_same(fn, [*lin.parameters(), w], xs)
    finally:
        common.HOOKS.compile = compile_
    programs = made
    assert callable(
        programs["test_batchable_function_runs_as_its_calls_not_under_vmap.<locals>.cell"]
    )
    assert callable(
        programs["test_batchable_function_runs_as_its_calls_not_under_vmap.<locals>.inner"]
    )
    assert (
        programs["test_batchable_function_runs_as_its_calls_not_under_vmap.<locals>.constant"]
        is False
    )


def test_no_grad_regions_stop_gradients_as_eager():
    """Calls recorded under torch.no_grad() (a target network, a stop-gradient) run under it:
    no gradient reaches their parameters or flows through their results, as in eager code.
    Before, they ran with gradients on: the target network got gradients, the rest wrong ones."""
    torch.manual_seed(0)
    lin, tgt = nn.Linear(3, 3), nn.Linear(3, 3)

    @fold.batchable
    def mix(a, b):
        return torch.tanh(a) * b

    def fn(x):
        h = lin(x)
        with torch.no_grad():
            t = mix(tgt(h), h) + 1.0
        return (h - t).square().sum(), h * t

    x = torch.randn(5, 3)
    assert_same(fn, [*lin.parameters(), *tgt.parameters()], x)
    assert_same(fn, [*lin.parameters(), *tgt.parameters()], [*x])
    grads = torch.autograd.grad(fold.autobatch(fn, x)[0].sum(), [tgt.weight], allow_unused=True)
    assert grads == (None,)


def test_autocast_regions_run_in_their_dtype_as_eager():
    """Calls recorded in a torch.autocast region run in it (bfloat16 here), and a region
    switched off inside one runs without it; the same inside an outer region.  Before, they
    ran in float32: results off by the bfloat16 rounding (~4e-3 here)."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4).float()

    def fn(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = lin(x)
            with torch.autocast("cpu", enabled=False):
                k = lin(h.float())
        return h.float() * 2 + k

    x = torch.randn(5, 4, dtype=torch.float32)
    want = eager_stack(fn, x)
    (g_want,) = torch.autograd.grad(want.sum(), [lin.weight])
    for per_example, xs in ((False, x), (True, x), (False, [*x])):
        got = fold.autobatch(fn, xs, per_example=per_example)
        torch.testing.assert_close(got, want)
        # A batched bfloat16 weight gradient sums the examples in bfloat16 (eager: in float32).
        (g_got,) = torch.autograd.grad(got.sum(), [lin.weight])
        torch.testing.assert_close(g_got, g_want, rtol=2e-2, atol=5e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(fold.autobatch(fn, x), eager_stack(fn, x))


def test_batchable_outside_autobatch_is_plain_eager():
    @fold.batchable
    def per_example(x):
        return torch.cat([x, x])

    @fold.batchable(batched=True)
    def batched(x, items):
        return x * 2 + items.sum()

    x = torch.randn(3)
    torch.testing.assert_close(per_example(x), torch.cat([x, x]))
    items = [torch.randn(3), torch.randn(3)]
    torch.testing.assert_close(batched(x, items), x * 2 + items[0] + items[1])
    torch.testing.assert_close(batched(x, []), x * 2)


def test_batched_function_calling_a_batched_function_in_a_group():
    @fold.batchable(batched=True)
    def inner(x):
        return x * 3

    @fold.batchable(batched=True)
    def outer(x):
        return inner(x) + 1  # runs on the group's batch as it is

    lin = nn.Linear(2, 2)
    xs = [torch.randn(2) for _ in range(4)]
    assert_same(lambda x: outer(lin(x)), list(lin.parameters()), xs)


# ---------------------------------------------------------------------------- random programs
UNARY = [torch.tanh, torch.sigmoid, lambda x: x * 0.5, lambda x: -x, torch.relu, torch.exp]


def _steps(kinds: int) -> st.SearchStrategy:
    """1-8 steps of a random program: (the op of the menu, two picks from the pool)."""
    return st.lists(
        st.tuples(st.integers(0, kinds - 1), st.integers(0, 1000), st.integers(0, 1000)),
        min_size=1,
        max_size=8,
    )


@st.composite
def programs(draw):
    """A random per-example program: a list of steps over a growing pool of values, each
    step an op of the menu on values of the pool; examples draw their own lengths."""
    steps = draw(_steps(13))
    lengths = draw(st.lists(st.integers(1, 3), min_size=1, max_size=5))
    return steps, lengths


class Menu(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.w = nn.Parameter(torch.randn(width, width) / width)

    @fold.batchable
    def mix(self, a, b):
        return torch.stack([a, b]).mean(0) @ self.w

    def run(self, steps, x):
        pool = [self.lin(x)]
        for kind, i, j in steps:
            a, b = pool[i % len(pool)], pool[j % len(pool)]
            if kind <= 1:
                v = UNARY[(i + j) % len(UNARY)](a)
            elif kind == 2:
                v = a * b + 1
            elif kind == 3:
                v = self.lin(a)
            elif kind == 4:
                v = torch.cat([a, b]).view(2, -1).sum(0)  # under vmap (view)
            elif kind == 5:
                v = F.softmax(a, -1) + a[0]
            elif kind == 6:
                v = self.mix(a, b)
            elif kind == 7:
                p, q = a.chunk(2)
                v = torch.cat([q, p])
            elif kind == 8:
                v = a @ self.w + b.sum()
            elif kind == 10:
                v = torch.logsumexp(torch.stack([a, b]).transpose(0, 1), -1).repeat(2)[:4] * a
            elif kind == 11:
                v = a.gather(0, (b.detach().abs() * 2).long().clamp(max=3)) + b
            elif kind == 12:
                p, q = torch.broadcast_tensors(a.reshape(2, 2), b[:2])
                v = (p * q).permute(1, 0).reshape(4)
            else:
                v = torch.where(a > 0, a, b)
            pool.append(v)
        return pool[-1], pool[len(pool) // 2]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_random_programs_match_eager(program):
    steps, lengths = program
    torch.manual_seed(0)
    menu = Menu(4)
    # Per example a different program length: examples differ in structure.
    examples = [(steps[: max(1, len(steps) - k)], torch.randn(4)) for k in lengths]
    assert_same(lambda s, x: menu.run(s, x), list(menu.parameters()), *zip(*examples))
    # One program for rows of a tensor: recorded once on lazy rows.
    rows = torch.randn(len(lengths), 4)
    run = Counted(lambda x: menu.run(steps, x))
    assert_same(run, list(menu.parameters()), rows)
    # Recorded once on lazy rows (twice where a call of a module's forward has no direct
    # form: then again with module calls as one call each), then per example twice.
    assert run.calls in (1 + 2 * len(lengths), 2 + 2 * len(lengths))


# ---------------------------------------------------------------------------- errors
def lazy_of(x):
    return torch.tanh(nn.Linear(3, 3)(x))


@pytest.mark.parametrize(
    "read",
    [
        lambda y: bool(y.sum() > 0),
        lambda y: y.sum().item(),
        lambda y: float(y.sum()),
        lambda y: int(y[0] * 10),
        lambda y: y.detach().tolist(),
        lambda y: y.detach().numpy().sum(),
        lambda y: max(y[0], y[1]),
        lambda y: min(y),
        lambda y: [1.0, 2.0][int(y[0] > 0)],
    ],
    ids=["bool", "item", "float", "int", "tolist", "numpy", "max", "min", "index"],
)
def test_a_read_pauses_the_example_and_gives_the_eager_value(read):
    """Reading a recorded value (issue 32): the example pauses, a round computes it, and it
    resumes with the value eager code reads; what it records after the read uses it."""
    lin = nn.Linear(3, 3)

    def fn(x, i):  # example 1 reads, and branches on what it read
        y = lazy_of_lin(lin, x)
        if i == 1:
            got = read(y)
            v = got if isinstance(got, float | int | bool) else float(torch.as_tensor(got).sum())
            return y * float(v)
        return y

    xs = [torch.randn(3) for _ in range(3)]
    with warnings.catch_warnings():  # float() of a value with history warns, as eager
        warnings.filterwarnings("ignore", "Converting a tensor with requires_grad")
        assert_same(fn, list(lin.parameters()), xs, [0, 1, 2])


def test_a_round_whose_op_reads_itself_runs_a_whole_plan(monkeypatch):
    """A decoder step whose two ``cat`` calls are one op (the second reads the first through
    the attention, as the translation tutorial's decoder does): every round runs a whole
    plan (that op's groups split by depth), whose groups read their inputs where they lie,
    not the general gathers; values and gradients equal eager."""
    from fold import run

    plans = []
    plan_of = run.plan_of

    def kept(arrays, strategy):
        plan = plan_of(arrays, strategy)
        plans.append(plan)
        return plan

    monkeypatch.setattr(run, "plan_of", kept)
    monkeypatch.setattr(driver, "EAGER_GROUP", 0)
    attn, combine, proj = nn.Linear(6, 3), nn.Linear(6, 3), nn.Linear(3, 3)

    def fn(x, k):
        h, e = torch.tanh(x), x * 0.5
        for _ in range(3):
            if k:  # (examples apart: no chain of whole outputs, which any plan runs whole)
                e = e * 2.0
            e, h = proj(e), proj(h)  # (values of this round: both cats take two)
            w = torch.softmax(attn(torch.cat((e, h))), 0)
            e = torch.relu(combine(torch.cat((e, w * h))))
            h = torch.tanh(h + e)
            if float(h.detach().sum()) > 5.0:  # a read: a round per step
                break
        return h

    params = [*attn.parameters(), *combine.parameters(), *proj.parameters()]
    assert_same(fn, params, [torch.randn(3) for _ in range(4)], [0, 1, 0, 1])
    assert plans and all(p.whole for p in plans), [p.whole for p in plans]


def test_a_read_of_a_value_without_history_grouped_with_rows_that_carry_one(finish):
    """``float(h.detach().sum())`` in one example beside ``h[1:].sum()`` in another: one
    group of sums (padded), whose output carries a history for the second example's row.  The
    first example's read gets its number as eager code does, without the warning (or, for
    ``.numpy()``, the error) of a tensor that carries a history.  Found by the random-programs
    test of in-place changes."""
    lin = nn.Linear(3, 3)

    def fn(x, k):
        h = torch.sin(lin(x))
        if k == 0:
            v = float(h.detach().sum()) + float(h.detach().sum().numpy())
            return h * v
        return h + h[1:].sum()

    xs = [torch.randn(3) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (eager code warns nowhere here)
        assert_same(fn, list(lin.parameters()), xs, [0, 1, 1])


def lazy_of_lin(lin, x):
    return torch.tanh(lin(x))


def _masked_fill_(x):
    s = lin_of_3(x)
    s.masked_fill_(x > 0, 0.0)  # (attention's scores masked so)
    return s


def _set_items(x):
    h = lin_of_3(x).clone()
    h[0] = 0.0
    h[1] += 3.0 * x[2]  # (a view taken, changed, and set back)
    h[2:] *= 2
    return h


def _torch_inplace(x):
    h = torch.sin(lin_of_3(x))
    torch.neg_(h).mul_(x)
    torch.relu_(h)  # (last: its backward reads its result, which nothing changes after)
    return h


def _functional_inplace(x):
    h = lin_of_3(x) * 1.0
    torch.nn.functional.leaky_relu_(h, 0.1)  # (no tensor method of its out-of-place name)
    return h


def _not_the_newest(x):
    a = lin_of_3(x)
    b = a * 2.0  # (a value made after a: a's change is recorded all the same)
    a.add_(b)
    a.sub_(x)
    return a, b


def _list_alias(x):
    hs = []
    h = lin_of_3(x)
    hs.append(h)
    h += 1.0  # (in place: the list's entry is h itself, and changes with it)
    h.mul_(x)
    return torch.stack(hs), h


def _dead_view(x):
    h = lin_of_3(x)
    y = h[0] * 3  # a view used and dropped: no view of h is held any more
    h.mul_(2.0)
    return h + y


def _index_by_value(x):
    h = lin_of_3(x)
    i = int(torch.tensor(2))  # a known index
    h[i] = -1.0
    h.copy_(h * 2).fill_(0.5).add_(x)
    return h


def _split_dropped(x):
    h = lin_of_3(x)
    s = torch.split(h, 2)[0].sum()  # views of several outputs, dropped at once
    h.mul_(2.0)
    return h + s


def _masked_set(x):
    h = lin_of_3(x)
    h[h < 0] = -1.0  # (a mask of h's shape and one number: one torch.where a group)
    h[x > 0.5] = 2
    return h


def _view_of_a_temporary(x):
    m = lin_of_3(x).view(3, 1)  # a view of a value no name holds: changing it is safe
    m[0, 0] = 0.0
    m[1] *= 2.0  # (a view of m taken, changed, and set back)
    return m.view(3)


def _at_a_recorded_index(x):
    h = lin_of_3(x).clone()
    h[h.argmax()] += 1.0  # (the index a value of the round)
    return h


def _after_a_read(x):
    h = lin_of_3(x)
    tok = int(h.argmax())  # a read: h is a value of an earlier round now
    h = h.clone()  # (a value of this round, its own)
    h[tok] = -10.0
    return h


def _earlier_round(x):
    h = lin_of_3(x)
    tok = int(h.argmax())
    h[tok] = -10.0  # h is a value of an earlier round now, which no view shares
    return h


def _changed_after_a_read(x):
    h = lin_of_3(x)
    kept = [h]  # (the list holds h itself: it sees every change, as eager code's does)
    tok = int(h.argmax())  # a read: h is a value of an earlier round now
    h[tok] = -10.0
    h[(tok + 1) % 3] = h[(tok + 2) % 3] * 3.0  # (a view taken and let go, then a write)
    h[tok] += x[0]  # (a view of h changed and set back)
    h *= 2.0
    h.add_(x)
    if float(h.detach().sum()) > 0:  # another read: the changes so far run in its round
        torch.relu_(h)
    h += x * x
    return kept[0] * 1.0


def _accumulated_across_reads(x):
    h = lin_of_3(x)
    total = h.sum()
    totals = [total]
    for _ in range(3):
        h = torch.tanh(lin_of_3(h))
        if float(h[0].detach()) > 0:  # a read each step: total is of an earlier round
            total += h.sum()
        else:
            total -= h[1]
    return totals[0] + 0.0


def _changed_under_no_grad(x):
    h = lin_of_3(x)
    with torch.no_grad():
        h.mul_(2.0)  # eager code changes the value and keeps h's graph (the change unseen)
    k = lin_of_3(x * 3.0)
    with torch.no_grad():
        _RELU_IN_PLACE(k)  # (an in-place activation, no view taken: its fast path)
    h = h + k
    g = lin_of_3(x * 2.0)
    int(g.detach().argmax())  # a read: g is of an earlier round after it
    with torch.no_grad():
        g[0] = 0.5
        g += 1.0
    return h * 3.0 + g


def _two_alike_results_changed_after_a_read(x):
    h = lin_of_3(x)
    int(h.argmax())
    a = h * 2.0  # of h's row at once, kept for the call: b and c are other values on it
    b = h * 2.0
    c = h * 2.0
    b += 1.0  # eager code leaves a and c as they were
    v = h[0:2]  # one view kept: w is the same value
    w = h[0:2]
    return a + c, b, torch.cat([v, w[1:]])


def _a_copy_of_a_view_changed_after_a_read(x):
    h = lin_of_3(x)
    v = h[0:2]
    int(h.argmax())  # a read: h and its view are of an earlier round now
    c = v.clone()  # (a value of its own)
    c.mul_(3.0)
    return torch.cat([c, h[2:]])


def lin_of_3(x):
    return _LIN3(x)


_RELU_IN_PLACE = nn.ReLU(inplace=True)


_LIN3 = nn.Linear(3, 3)


@pytest.mark.parametrize(
    "fn",
    [
        _masked_fill_,
        _set_items,
        _torch_inplace,
        _functional_inplace,
        _not_the_newest,
        _list_alias,
        _dead_view,
        _index_by_value,
        _masked_set,
        _split_dropped,
        _view_of_a_temporary,
        _at_a_recorded_index,
        _after_a_read,
        _earlier_round,
        _changed_after_a_read,
        _accumulated_across_reads,
        _two_alike_results_changed_after_a_read,
        _a_copy_of_a_view_changed_after_a_read,
        _changed_under_no_grad,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
def test_in_place_changes_of_recorded_values_match_eager(finish, fn):
    """In-place methods, in-place torch functions, ``x[i] = v`` and augmented assignment on a
    value recorded in the round (``scores.masked_fill_(mask, -inf)``, ``h[i] += v``,
    ``torch.relu_(h)``) are recorded out of place and the value object becomes the result:
    every name and list holding it sees the change, as in eager code.  Values and gradients
    equal eager's (float64)."""
    _LIN3.to(torch.float64)  # (the module's tests run in float64)
    with torch.no_grad():
        torch.manual_seed(0)
        _LIN3.reset_parameters()
    assert_same(fn, list(_LIN3.parameters()), [torch.randn(3) for _ in range(4)])


def _view_changed(x):
    h = lin_of_3(x)
    v = h[0:2]
    v.mul_(2.0)  # eager code changes h too
    return h


def _view_held(x):
    h = lin_of_3(x)
    v = h[0:2]
    h.mul_(2.0)  # eager code changes v too
    return h, v


def _detached_held(x):
    h = lin_of_3(x)
    d = h.detach()
    h.add_(1.0)  # eager code changes d too (one memory)
    return h, d


def _view_held_across_a_read(x):
    h = lin_of_3(x)
    v = h[0:2]  # recorded in h's round
    int(h.argmax())
    h.mul_(2.0)  # eager code changes v too
    return h, v


def _view_taken_after_a_read(x):
    h = lin_of_3(x)
    int(h.argmax())
    v = h[0:2]  # taken of h's row at once
    h[2] = 1.0  # eager code changes v too (its memory)... and h[2], which v does not see
    return h, v * 1.0


def _earlier_view_changed(x):
    h = lin_of_3(x)
    v = h[0:2]
    int(h.argmax())
    v += 1.0  # eager code changes h too
    return h


def _same_round_view_changed(x):
    h = lin_of_3(x)
    v = h[0:2]
    v += 1.0  # eager code changes h too (was x = x + 1.0 on the name, silently)
    return h


def _view_in_a_list_changed(x):
    h = lin_of_3(x)
    parts = [h[0:2], h[2:]]
    parts[0] += 1.0  # eager code changes h too (the list's item was rebound, silently)
    return h


_HELD = [None]


def _view_in_a_global_list_changed(x):
    h = lin_of_3(x)
    _HELD[0] = h[1:]
    _HELD[0] += 1.0  # the same, the list a global
    return h


class _Parts:
    def __init__(self):
        self.parts = []


def _view_in_an_attribute_list_changed(x):
    h = lin_of_3(x)
    holder = _Parts()
    holder.parts.append(h[0:2])
    holder.parts[0] += 1.0  # the same, the list an attribute of an object
    return h


def _detached_after_a_read(x):
    h = lin_of_3(x)
    int(h.argmax())
    d = h.detach()  # one memory with h
    h.add_(1.0)
    return h, d


def _detached_view_let_go(x):
    h = lin_of_3(x)
    v = h[0:2]
    int(h.argmax())
    a = v.detach()  # one memory with v, and so with h
    del v
    h.mul_(2.0)  # eager code changes a too
    return h, torch.cat([a, a[:1]])


def _array_of_an_earlier_value(x):
    with torch.no_grad():
        h = lin_of_3(x)
        arr = h.numpy()  # a read: h is of an earlier round after it; arr is its memory
        h.add_(1.0)  # eager code changes arr too
        return h, torch.tensor(arr.copy())


def _unbound_after_a_read(x):
    h = lin_of_3(x)
    int(h.argmax())
    parts = h.unbind()  # views of h, made at once
    h.mul_(2.0)
    return h, torch.stack(parts)


def _view_of_an_earlier_value(x):
    h = lin_of_3(x)
    int(h.argmax())  # a read: h is a value of an earlier round now
    g = lin_of_3(x * 2)
    v = h.expand_as(g)  # recorded in this round, a view of h's row
    v.mul_(2.0)
    return v + g


def _split_held(x):
    h = lin_of_3(x)
    first, rest = torch.split(h, 2)  # views of several outputs, held
    h.mul_(2.0)  # eager code changes first and rest too
    return h + first.sum() + rest.sum()


def _random_fill(x):
    h = lin_of_3(x)
    h.uniform_()  # (no out-of-place form: torch.rand_like(h))
    return h


def _out_into_lazy(x):
    h = lin_of_3(x)
    torch.add(x, 1.0, out=h)
    return h


_EARLIER_SHARED = r"(\.mul_\(\)|__setitem__) .* of an earlier round that shares memory.*Fix: "


@pytest.mark.parametrize(
    "fn, match",
    [
        (_view_changed, r"\.mul_\(\) on a lazy value that is a view of another.*Fix: "),
        (_view_held, r"\.mul_\(\) on a lazy value while a view of it is in use.*Fix: "),
        (_detached_held, r"\.add_\(\) on a lazy value while a view of it is in use"),
        (_view_held_across_a_read, _EARLIER_SHARED),
        (_view_taken_after_a_read, _EARLIER_SHARED),
        (_earlier_view_changed, r"__iadd__\(\) .* of an earlier round that shares memory"),
        (_same_round_view_changed, r"__iadd__\(\) on a lazy value that is a view of another"),
        (_view_in_a_list_changed, r"__iadd__\(\) on a lazy value that is a view of another"),
        (_view_in_a_global_list_changed, r"__iadd__\(\) on a lazy value that is a view of"),
        (_view_in_an_attribute_list_changed, r"__iadd__\(\) on a lazy value that is a view"),
        (_detached_after_a_read, r"\.add_\(\) .* of an earlier round that shares memory"),
        (_unbound_after_a_read, _EARLIER_SHARED),
        (_detached_view_let_go, _EARLIER_SHARED),
        (_array_of_an_earlier_value, r"\.add_\(\) .* of an earlier round that shares memory"),
        (_out_into_lazy, r"in-place torch\.add on a lazy value.*Fix: "),
        (_random_fill, r"uniform_ on a lazy value has no out-of-place form.*Fix: .*rand_like"),
        (_split_held, r"\.mul_\(\) on a lazy value while a view of it is in use"),
    ],
    ids=[
        "view-changed",
        "view-held",
        "detached-held",
        "view-held-across-a-read",
        "view-taken-after-a-read",
        "earlier-view-changed",
        "same-round-view-changed",
        "view-in-a-list-changed",
        "view-in-a-global-list-changed",
        "view-in-an-attribute-list-changed",
        "detached-after-a-read",
        "unbound-after-a-read",
        "detached-view-let-go",
        "array-of-an-earlier-value",
        "out=",
        "random-fill",
        "split-held",
    ],
)
def test_in_place_changes_autobatch_cannot_follow_are_fold_errors(finish, fn, match):
    """An in-place change that eager code would see through another tensor sharing the
    memory (a view changed, or a view held while its value changes), a change of a value
    computed in an earlier round, or ``out=`` a lazy value: a FoldError naming the example,
    the op and the fix, never a result that differs from eager's silently."""
    _LIN3.to(torch.float64)
    with pytest.raises(fold.FoldError, match=r"example 0: .*" + match):
        fold.autobatch(fn, [torch.randn(3) for _ in range(3)])


def test_augmented_assignments_to_items_of_lists_and_tensors_match_eager(finish):
    """``hs[1] += v`` of a value in a list changes the value in place (every name holding it
    sees the change), ``h[i] += v`` and ``h[i, j] += v`` write ``h`` through the item's
    view, a dict's item the same: values and gradients equal eager's (float64), before and
    after a read."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)

    def fn(x):
        h = torch.tanh(lin(x)) * 1.0  # (tanh's output is saved for backward: not changed)
        hs, by = [h, h * 2], {"a": h * 3}
        hs[1] += h
        by["a"] -= hs[1]
        i = 1
        h[i] += hs[1][0]
        if float(h.detach().sum()) > -1e9:  # a read: h is a value of an earlier round
            h[0] *= 2.0
        m = torch.outer(h, h)
        m[i, 2] += h[3]
        holder = _Parts()
        holder.parts.append(m * 1.0)
        holder.parts[0] += h[0]  # (a value in an attribute's list: changed in place)
        return hs[0], hs[1], by["a"], m, holder.parts[0]

    assert_same(fn, list(lin.parameters()), [torch.randn(4) for _ in range(3)])


def test_error_inside_a_batched_call_names_the_source_line():
    @fold.batchable
    def reads(x):
        return x * x.sum().item()  # fine on one example, not under vmap

    lin = nn.Linear(3, 3)
    with pytest.raises(fold.FoldError, match=r"test_autobatch\.py:\d+: .*reads\(lin\(x\)\)"):
        fold.autobatch(lambda x: reads(lin(x)), [torch.randn(3), torch.randn(3)])


def test_shape_error_while_recording_names_the_line():
    lin = nn.Linear(3, 3)
    with pytest.raises(fold.FoldError, match=r"torch\.cat at .*test_autobatch\.py:\d+.*fails"):
        fold.autobatch(lambda x: torch.cat([lin(x), torch.ones(2, 2)]), [torch.randn(3)])


def test_structure_mismatch_and_empty_input():
    lin = nn.Linear(2, 2)
    with pytest.raises(fold.FoldError, match="same structure"):
        fold.autobatch(lambda x, k: (lin(x),) * k, [torch.randn(2)] * 2, [1, 2])
    with pytest.raises(fold.FoldError, match="no examples"):
        fold.autobatch(lambda x: lin(x), [])


def test_lazy_values_do_not_escape():
    lin = nn.Linear(2, 2)
    kept = []
    fold.autobatch(lambda x: kept.append(lin(x)) or lin(x), [torch.randn(2)])
    assert isinstance(kept[0], Lazy)
    with pytest.raises(fold.FoldError, match="outside the function autobatch runs"):
        torch.tanh(kept[0])
    with pytest.raises(fold.FoldError, match=r"in-place \.add_\(\) .*outside the function"):
        kept[0].add_(1.0)
    with pytest.raises(fold.FoldError, match="inside a function autobatch is running"):
        fold.autobatch(lambda x: fold.autobatch(lin, [x]), [torch.randn(2)])


def test_list_elements_must_agree_for_a_batched_function():
    @fold.batchable(batched=True)
    def total(items):
        return items.sum()

    a, b = nn.Linear(2, 2), nn.Linear(2, 3)
    with pytest.raises(fold.FoldError, match="element 1 of a list"):
        fold.autobatch(lambda x: total([a(x), b(x)]), [torch.randn(2)])


def test_lazy_metadata_is_known_while_recording():
    lin = nn.Linear(3, 5)
    seen = []

    def fn(x):
        y = lin(x)
        seen.append((y.shape, y.dtype, y.dim(), y.size(0), len(y), y.ndim))
        return torch.stack([*y])  # iteration unbinds

    fold.autobatch(fn, [torch.randn(3)])
    assert seen == [(torch.Size([5]), torch.float64, 1, 5, 5, 1)]


# ------------------------------------------------------- no silent wrong answers (issue 31)
def _add_(buf, y):
    buf.add_(y)


def _copy_(buf, y):
    buf.copy_(y)


def _iadd(buf, y):
    acc = buf
    acc += y  # rebinds acc; buf, an alias, would keep zeros


def _setitem(buf, y):
    buf[0] = y[0]


def _out(buf, y):
    torch.add(y, 1, out=buf)


def _fill_zero(buf, y):
    buf.zero_()
    buf.fill_(y[1])


def _twice(buf, y):
    buf[1:] = y[:2] * 3
    buf.mul_(2)
    buf -= y


@pytest.mark.parametrize(
    "write", [_add_, _copy_, _iadd, _setitem, _fill_zero, _twice], ids=lambda f: f.__name__
)
@pytest.mark.parametrize("rows", ["list", "tensor"])
def test_in_place_writes_into_a_buffer_the_example_made_equal_eager(write, rows):
    """buf = torch.zeros(3); buf.add_(y): a tensor the example made itself, written with a
    recorded value in place, holds the written value from then on (recorded out of place),
    for every alias of it; returned, it is that value.  Eager's values and gradients."""
    lin = nn.Linear(3, 3)

    def fn(x):
        buf = torch.zeros(3)
        alias = buf
        write(buf, lin(x))
        return buf * 2, alias.sum()

    xs = torch.randn(4, 3)
    assert_same(fn, list(lin.parameters()), list(xs) if rows == "list" else xs)


def test_a_buffer_filled_step_by_step_across_reads_equals_eager():
    """The encoder of PyTorch's translation tutorial fills a buffer row by row
    (``encoder_outputs[ei] = out[0, 0]``), here with a read per step that stops each example
    at its own length: the buffer holds its writes across rounds, and what reads it after
    (attention over it) has eager's values and gradients.  The tensors get their class back
    when the call ends."""
    torch.manual_seed(0)
    cell = nn.GRUCell(3, 4)
    q = nn.Linear(4, 4)
    kept = []

    def fn(x):
        buf = torch.zeros(6, 4)
        kept.append(buf)
        h = torch.zeros(4)
        for t in range(len(x)):
            h = cell(x[t], h)
            buf[t] = h
            if float(h.detach().sum()) > 1.5:  # a read: the example may stop here
                break
        w = torch.softmax(buf @ q(h), 0)
        return (w @ buf,)

    xs = [torch.randn(n, 3) for n in (2, 6, 4, 5, 3)]
    got = fold.autobatch(fn, xs, stack=False)
    assert all(type(b) is torch.Tensor for b in kept)
    kept.clear()
    want = [fn(x) for x in xs]
    assert_same_lists(got, want, [*cell.parameters(), *q.parameters()])
    puts = [op for op in _OPS.values() if op.fn is buffers._put and op.args[0].meta.shape == (6, 4)]
    assert puts and all(op.mode is common._DIRECT for op in puts)  # one call a group


def test_a_written_buffer_answers_as_the_tensor_it_holds():
    """A written buffer used as eager code uses a tensor: its repr and length, iterated row
    by row, its shape, dtype, ``.T``, ``.tolist()`` and a number of it (reads: a round).
    Eager's values and gradients."""
    lin = nn.Linear(3, 3)
    seen = []

    def fn(x):
        buf = torch.zeros(2, 3)
        buf[0] = lin(x)
        seen.append((repr(buf).startswith("tensor") or "lazy" in repr(buf).lower(), len(buf)))
        rows = [r.sum() for r in buf]
        numbers = buf.tolist()
        assert buf.shape == (2, 3) and buf.dtype == x.dtype and buf.ndim == 2
        assert buf.T.shape == (3, 2) and buf.size(0) == 2
        return buf.sum() + rows[0] * float(buf[0, 0].detach()) + len(numbers[0])

    assert_same(fn, list(lin.parameters()), [torch.randn(3) for _ in range(3)])
    assert all(ok and n == 2 for ok, n in seen)


def _row_iadd(buf, y):  # Python: t = buf[0]; t += y; buf[0] = t (the tutorial's evaluate)
    buf[0] += y
    buf[1] += y * 2


def _through_a_view(buf, y):  # a view kept and written through: the buffer sees it
    row = buf[1]
    row += y
    return row * 3


def _slice_copy(buf, y):
    buf[0].mul_(0.5)  # (no recorded value: eager)
    buf[1:].copy_(y.view(1, 3))
    buf[1] += 1


def _method_on_a_part(buf, y):  # a view of a written buffer, written through
    buf[0] = y
    buf[1].mul_(2)
    buf.T[2].add_(y[:2])
    part = buf[0]
    part[1:] = 0.0


@pytest.mark.parametrize(
    "write", [_row_iadd, _through_a_view, _slice_copy, _method_on_a_part], ids=lambda f: f.__name__
)
def test_writes_through_views_of_a_buffer_equal_eager(write):
    """``encoder_outputs[ei] += out[0, 0]`` (the older evaluate of PyTorch's translation
    tutorial): Python writes into the view ``buf[ei]``, then sets it back.  A write through a
    view of a buffer the example made is recorded as a write of the buffer's part, and the
    view a written buffer of its own whose value is that part.  Eager's values and
    gradients, the view's too, and every part runs one call a group."""
    lin = nn.Linear(3, 3)

    def fn(x):
        buf = torch.ones(2, 3)
        got = write(buf, lin(x))
        return buf * 2, buf.sum() if got is None else got

    assert_same(fn, list(lin.parameters()), [torch.randn(3) for _ in range(4)])
    ops = [op for op in _OPS.values() if op.fn in (buffers._region, buffers._put_region)]
    assert ops and all(op.mode is common._DIRECT for op in ops)


@pytest.mark.parametrize(
    "write", [_row_iadd, _through_a_view, _slice_copy, _method_on_a_part], ids=lambda f: f.__name__
)
def test_writes_through_views_of_a_buffer_under_inference_mode_equal_eager(write, finish):
    """Under torch.inference_mode() torch keeps no base for a view (its ``_base`` is None):
    the buffer a view is written through is found by its memory (``buffers._base_of``), so
    ``encoder_outputs[ei] += out[0, 0]`` records as it does under torch.no_grad() (it was a
    FoldError).  Values equal eager, before and after a read (float64)."""
    lin = nn.Linear(3, 3).double()

    def fn(x):
        buf = torch.ones(2, 3, dtype=torch.float64)
        got = write(buf, lin(x))
        if float(buf.sum()) > 0:  # a read
            buf[0] = buf[0] * 2
        write(buf, lin(buf[1]))
        return buf * 2, buf.sum() if got is None else got

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    with torch.inference_mode():
        want = [fn(x) for x in xs]
        got = fold.autobatch(fn, xs, stack=False)
    for g, w in zip(got, want):
        for a, b in zip(g, w, strict=True):
            torch.testing.assert_close(a, b)


def test_views_of_a_written_buffer_across_reads_and_copies_equal_eager(finish):
    """After a read (every round batched, or the examples finishing as eager code), views
    of a written buffer: ones that copy (``buf.T.reshape(-1)``: no view of its memory, the
    call on its value), several at once (``unbind``, read), a view of a view written
    through.
    Eager's values and gradients."""
    lin = nn.Linear(3, 3)

    def fn(x):
        buf = torch.zeros(2, 3)
        buf[0] = lin(x)
        if float(buf[0].detach().sum()) > 0:  # a read
            buf[1] = buf[0] * 2
        b = buf[1]
        b[1:].add_(buf[0][:2])  # a view of a view, written: the buffer sees it
        flat = buf.T.reshape(-1)
        first, second = buf.unbind(0)  # (read only: eager refuses writes near unbind's views)
        return flat, buf * 1, first + second + b

    assert_same(fn, list(lin.parameters()), [torch.randn(3) for _ in range(4)])


def test_a_tensor_indexed_by_a_lazy_value_takes_it_as_one_index():
    """``W[idx]`` of a parameter (or of the example's input, or a buffer written at a mask)
    by a lazy index: one recorded index, as a tensor index is.  Torch takes a sequence index
    for a tuple of its items, and a lazy value with a Python ``__getitem__`` was one: torch
    read each of its items (a node each) and warned.  Values and gradients equal eager's;
    with the C storage (fold/_clazy.c), no warning."""
    table = nn.Parameter(torch.randn(6, 4))
    lin = nn.Linear(4, 4)

    def fn(x):
        h = lin(x)
        rows = table[h.topk(2).indices]  # a lazy index of two rows
        picked = x[h > 0].sum()  # a lazy mask of the input
        buf = torch.zeros(4)
        buf[h > 0] = 1.0  # a buffer written at a lazy mask
        return rows.sum(0) + picked + buf

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert_same(fn, [table, *lin.parameters()], [torch.randn(4) for _ in range(4)])
    if values._C is not None:
        assert not [w for w in seen if "sequence" in str(w.message)], [str(w.message) for w in seen]


def test_a_write_at_a_mask_runs_as_one_call_a_group(monkeypatch, caplog):
    """``h[mask] = number`` with a mask of h's shape (``logits[banned] = -inf``) is recorded
    as a ``torch.where``: one call a group, where a boolean index runs one call per example
    (vmap cannot batch it, and says so in a logged warning); values and gradients equal
    eager's."""
    monkeypatch.setattr(driver, "EAGER_GROUP", 0)
    _LIN3.to(torch.float64)
    with caplog.at_level(logging.WARNING):
        assert_same(_masked_set, list(_LIN3.parameters()), [torch.randn(3) for _ in range(4)])
    assert not [r for r in caplog.records if "vmap" in r.getMessage()]


def _masked_set_after_reads(x):
    h = lin_of_3(x)
    if float(h[0].detach()) > 0:  # (rows that disagree: the examples run as coroutines)
        h = lin_of_3(h)
    h = lin_of_3(h)
    h[h < 0] = -1.0
    return h


def test_a_write_at_a_mask_after_reads_runs_as_one_call_a_group(monkeypatch):
    """The same write in a round after the examples' reads disagree, where autobatch's
    wrappers are installed over torch's functions (``torch.where`` among them): recorded as
    torch's own ``torch.where``, run directly (it was recorded as the wrapper, which the
    tables do not know: under vmap); values and gradients equal eager's."""
    monkeypatch.setattr(driver, "EAGER_GROUP", 0)
    _LIN3.to(torch.float64)
    driver.clear_cache()  # (the ops below are this test's alone)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, dtype=torch.float64, generator=g) for _ in range(8)]
    assert len({float(_LIN3(x)[0].detach()) > 0 for x in xs}) == 2  # (the reads disagree)
    assert_same(_masked_set_after_reads, list(_LIN3.parameters()), xs)
    wheres = [op for op in _OPS.values() if "torch.where" in op.name]
    assert wheres and all(op.fn is torch.where for op in wheres)
    assert all(op.mode is common._DIRECT for op in wheres)


def test_an_in_place_change_of_a_view_of_an_earlier_value_is_a_fold_error(monkeypatch):
    """A view recorded in this round of a value of an earlier round (``h.expand_as(g)``
    after a read of ``h``) changed in place: eager code changes ``h`` too, which autobatch
    does not follow, so it is refused, naming the copy fix.  (Where the examples finish as
    eager code, ``h`` is a row of its round's output, and torch itself refuses the change
    of a view of one of several views.)"""
    monkeypatch.setattr(driver, "EAGER_GROUP", 0)
    _LIN3.to(torch.float64)
    with pytest.raises(
        fold.FoldError,
        match=r"example 0: .*\.mul_\(\) on a lazy value that is a view of a value computed "
        r"in an earlier round.*Fix: .*clone",
    ):
        fold.autobatch(_view_of_an_earlier_value, [torch.randn(3) for _ in range(3)])


def test_an_in_place_write_into_a_copy_of_a_recorded_value_equals_eager():
    """``c = h.clone(); c[0] = 0`` writes into a recorded value of the round: recorded out of
    place; so does the buffer fix autobatch named before it took such writes
    (``buf = torch.zeros_like(h); buf.copy_(h); buf[0] = 0``).  Both equal eager."""
    lin = nn.Linear(3, 3)

    def copied(x):
        c = lin(x).clone()
        c[0] = 0.0
        return c

    assert_same(copied, list(lin.parameters()), [torch.randn(3) for _ in range(3)])

    def fixed(x):
        h = lin(x)
        buf = torch.zeros_like(h)
        buf.copy_(h)
        buf[0] = 0.0
        return buf

    assert_same(fixed, list(lin.parameters()), [torch.randn(3) for _ in range(3)])


def test_a_buffer_written_eagerly_with_a_computed_value_stays_the_examples_own(finish):
    """After a read, an earlier round's value written into a buffer runs at once, as eager
    code (the buffer then has a gradient history); a later write of a value of the round
    recording now still records (it was refused: the buffer "needed a gradient").  Found
    by the random-programs test of buffers.  Eager's values and gradients."""
    lin = nn.Linear(3, 3)

    def fn(x):
        buf = torch.zeros(4, 3)
        h = torch.tanh(lin(x))
        if float(h.detach().sum()) > 5:  # a read: h is an earlier round's value after it
            h = -h
        buf.view(-1)[0] = h[1]  # at once, on h's row
        h = torch.tanh(lin(h))
        buf[1] = h  # recorded
        return buf * 2, h

    assert_same(fn, list(lin.parameters()), [torch.randn(3) for _ in range(4)])


def test_buffers_made_like_a_value_are_the_examples_own():
    """``out = torch.zeros_like(h)`` (and ``ones_like``, ``empty_like`` then filled,
    ``full_like``) of a recorded value, of one of an earlier round, or of the example's own
    input: a tensor made from the shape alone, at once, that the example may fill in place
    as a buffer.  Eager's values and gradients."""
    lin = nn.Linear(3, 3)

    def fn(x):
        h = lin(x)
        out = torch.zeros_like(h)
        out[0] = h[1]
        out[1] = h[0] * 2
        if float(h.detach().sum()) > 0:  # a read: h is an earlier round's value after it
            h = -h
        ones = torch.ones_like(h)
        ones[2] = h[2]
        empty = torch.empty_like(h)
        empty.copy_(h * 3)
        full = torch.full_like(x, 0.5)
        full[1] += h[0]
        return out + ones + empty + full

    assert_same(fn, list(lin.parameters()), [torch.randn(3) for _ in range(5)])


def _shared_buffer(buf, y):  # a tensor made before the call, shared by every example
    _SHARED.add_(y)


_SHARED = torch.zeros(3)


def _view_first(buf, y):  # a view of the buffer taken before the write would go stale
    row = buf[:2]
    buf[0] = y[0]
    return row


def _unknown_form(buf, y):
    buf[0] = y[0]
    buf.normal_()


def _shape_change(buf, y):
    buf[0] = y[0]
    buf.unsqueeze_(0)


@pytest.mark.parametrize(
    "write, match",
    [
        (_out, r"out=.*in place.*Fix: .*buf = buf \+ y"),
        (_shared_buffer, r"in place.*not one the example made.*Fix: .*buf = buf \+ y.*zeros_like"),
        (_view_first, r"in place.*Fix: .*buf = buf \+ y"),
        (_unknown_form, r"normal_ on a buffer written with recorded values.*Fix: "),
        (_shape_change, r"unsqueeze_ on a buffer .*of shape \(3,\) would give shape"),
    ],
    ids=["out", "shared", "view", "no-out-of-place-form", "shape"],
)
def test_in_place_writes_autobatch_cannot_take_are_fold_errors(write, match):
    """A recorded value written into a tensor the example did not make (one shared by every
    example), one with a view taken before, or through ``out=``: the tensor would keep its
    old values, so the call is refused, naming the op and the out-of-place fix; so is an
    in-place op on a written buffer with no out-of-place form, or one changing its shape."""
    lin = nn.Linear(3, 3)

    def fn(x):
        buf = torch.zeros(3)
        write(buf, lin(x))
        return buf

    with pytest.raises(fold.FoldError, match=match) as e:
        fold.autobatch(fn, [torch.randn(3) for _ in range(3)])
    assert "example 0" in str(e.value)
    assert not _SHARED.any()


def test_a_buffer_one_example_made_is_refused_in_another():
    """A written buffer kept where another example finds it (a list outside the function):
    the examples run interleaved, so the other would read its writes so far; refused."""
    lin = nn.Linear(3, 3)
    kept = []

    def fn(x):
        if not kept:
            kept.append(torch.zeros(3))
            kept[0][0] = lin(x)[0]
        return kept[0] + x

    with pytest.raises(fold.FoldError, match="example 1: uses a buffer that example 0 made"):
        fold.autobatch(fn, [torch.randn(3) for _ in range(3)], per_example=True)
    assert type(kept[0]) is torch.Tensor


def test_a_lazy_value_kept_after_its_call_is_refused_at_every_use():
    lin = nn.Linear(2, 2)
    kept = []
    xs = [torch.randn(2), torch.randn(2)]
    fold.autobatch(lambda x: kept.append(lin(x)) or lin(x), xs)
    k = kept[0]
    for use in (lambda: k + 1, lambda: k.sum(), lambda: k[0], lambda: k.view(2), lambda: -k):
        with pytest.raises(fold.FoldError, match="after the autobatch call that recorded it"):
            use()
    # Used inside the next call: through an operator, a torch function, or returned.
    with pytest.raises(fold.FoldError, match="after the autobatch call|another autobatch call"):
        fold.autobatch(lambda x: lin(x) + k, xs)
    with pytest.raises(fold.FoldError, match="from another autobatch call"):
        fold.autobatch(lambda x: torch.add(lin(x), k), xs)
    with pytest.raises(fold.FoldError, match="example 0 returned .*earlier autobatch call"):
        fold.autobatch(lambda x: k, xs)


def test_eager_results_of_different_shapes_name_the_example():
    sizes = iter([3, 3, 4])
    with pytest.raises(fold.FoldError, match=r"example 2 returned \(4,\) .* example 0 \(3,\)"):
        fold.autobatch(lambda x: torch.zeros(next(sizes)), [torch.randn(2)] * 3, per_example=True)
    lin = nn.Linear(2, 2)
    with pytest.raises(fold.FoldError, match=r"example 1 returned \(3,\) .* example 0 \(2,\)"):
        fold.autobatch(
            lambda x, k: lin(x) if k == 0 else torch.zeros(3), [torch.randn(2)] * 2, [0, 1]
        )


def test_a_failure_inside_a_batched_op_is_chained_to_the_users_exception():
    @fold.batchable(batched=True)
    def fussy(x):  # fine on the batch of one that shape inference runs, not on a group
        if x.shape[0] > 1:
            raise KeyError("the user's own error")
        return x

    lin = nn.Linear(2, 2)
    with pytest.raises(fold.FoldError, match="fussy") as e:
        fold.autobatch(lambda x: fussy(lin(x)) * 2, [torch.randn(2)] * 3)
    assert type(e.value.__cause__) is KeyError


def test_an_op_out_of_memory_on_a_group_stays_an_out_of_memory_error():
    @fold.batchable(batched=True)
    def big(x):  # "out of memory" on a group, fine on the batch of one of shape inference
        if x.shape[0] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return x

    lin = nn.Linear(2, 2)
    with pytest.raises(torch.OutOfMemoryError) as e:  # what a loop's OOM handler catches
        fold.autobatch(lambda x: big(lin(x)) * 2, [torch.randn(2)] * 3)
    assert isinstance(e.value, fold.FoldError)
    assert "big" in str(e.value) and "fewer examples" in str(e.value)
    assert type(e.value.__cause__) is torch.OutOfMemoryError


def test_torch_tensor_of_recorded_scalars_matches_eager():
    lin = nn.Linear(3, 3)

    def fn(x, k):
        y = lin(x)
        return torch.tensor([y[0], y[1] * 2, k]), torch.tensor([[y[2], 1.0], [2, y[0]]])

    xs, ks = [torch.randn(3) for _ in range(4)], [1, 2, 3, 4]
    got = fold.autobatch(fn, xs, ks)
    with warnings.catch_warnings():  # eager torch warns of converting values with history
        warnings.simplefilter("ignore", UserWarning)
        want = eager_stack(fn, xs, ks)
    torch.testing.assert_close(got, want)
    assert not any(t.requires_grad for t in got)  # torch.tensor copies: no history, as eager
    ints = fold.autobatch(lambda x: torch.tensor([lin(x).argmax(), 7]), xs)
    assert ints.dtype == torch.long
    torch.testing.assert_close(ints, torch.stack([torch.tensor([lin(x).argmax(), 7]) for x in xs]))
    with pytest.raises(fold.FoldError, match="torch.stack"):
        fold.autobatch(lambda x: torch.tensor([lin(x), lin(x)]), xs)


def test_complex_parts_conjugate_transposes_and_sizes_of_a_lazy_value_equal_eager():
    """``z.real``, ``z.imag`` of a complex value, ``x.H`` and ``x.mH`` (conjugate
    transposes), ``itemsize``, ``nbytes``, ``is_cpu`` and ``is_nested`` of a lazy value:
    torch's tensor properties, which a lazy value lacked (a bare AttributeError).  Values
    and gradients equal eager's (float64)."""
    lin = nn.Linear(4, 4).double()

    def fn(x):
        h = torch.tanh(lin(x))
        z = torch.complex(h, h * 2)
        m = torch.complex(h.view(2, 2), h.view(2, 2).flip(0))
        sizes = h.itemsize + h.nbytes + z.itemsize + int(h.is_cpu) + int(h.is_nested)
        return (z * z.conj()).real + z.imag + (m.H @ m).real.flatten() + m.mH.imag.flatten() + sizes

    assert_same(fn, list(lin.parameters()), [torch.randn(4, dtype=torch.float64) for _ in range(3)])


@pytest.mark.parametrize(
    "attr", ["requires_grad", "grad_fn", "grad", "is_leaf", "retains_grad", "output_nr"]
)
def test_autograd_attributes_of_a_lazy_value_are_a_fold_error(attr):
    with pytest.raises(fold.FoldError, match=rf"example 0: \.{attr} of a lazy value.*Fix:"):
        fold.autobatch(lambda x: getattr(lazy_of(x), attr), [torch.randn(3)])


def test_data_of_a_lazy_value_is_its_detached_value():
    lin = nn.Linear(3, 3)
    xs = [torch.randn(3) for _ in range(3)]
    got = fold.autobatch(lambda x: lin(x).data * 2 + lin(x), xs)
    torch.testing.assert_close(got, eager_stack(lambda x: lin(x).data * 2 + lin(x), xs))
    g = torch.autograd.grad(got.sum(), lin.weight)[0]
    torch.testing.assert_close(g, torch.stack(xs).sum(0).expand(3, 3))


@pytest.mark.parametrize(
    "misuse, match",
    [
        (lambda y: torch.Tensor.add(y, 1), r"unbound tensor method.*Fix: .*y?\.add\(1\)"),
        (lambda y: torch.func.vmap(torch.sin)(y), r"vmap.*autobatch already batches"),
        (lambda y: copy.deepcopy(y), r"deepcopy.*Fix: x\.clone\(\)"),
        (lambda y: setattr(y, "meta", None), r"setting \.meta of a lazy value"),
        (lambda y: delattr(y, "node"), r"deleting \.node of a lazy value"),
        (lambda y: pickle.dumps(y), r"pickling a lazy value"),
    ],
)
def test_misuse_of_a_lazy_value_is_a_fold_error_naming_the_fix(misuse, match):
    with pytest.raises(fold.FoldError, match=match):
        fold.autobatch(lambda x: misuse(lazy_of(x)), [torch.randn(3)] * 2)


@pytest.mark.parametrize("transform", ["grad", "jacrev", "vmap", "grad-after-read"])
def test_torch_func_transforms_inside_the_function_run_at_once_as_eager(finish, transform):
    """A torch.func transform the function opens (per-example input gradients with
    ``torch.func.grad``, a Jacobian, a vmap over the example's own rows) runs its calls at
    once, as eager code does, on the example's tensors and the rows of earlier rounds'
    values: values and gradients equal eager (float64).  (A module call in it was recorded
    and ran later, outside the transform: torch.func.grad and vmap raised torch's errors.)"""
    torch.manual_seed(0)
    lin, out = nn.Linear(4, 4), nn.Linear(4, 1)

    def fn(x):
        if transform == "grad":
            return torch.func.grad(lambda z: out(torch.tanh(lin(z))).sum())(x)
        if transform == "jacrev":
            return torch.func.jacrev(lambda z: torch.tanh(lin(z)))(x)
        if transform == "vmap":
            return torch.func.vmap(lin)(x.view(2, 2).repeat(1, 2)) + lin(x)
        h = torch.tanh(lin(x))
        if float(h.detach().sum()) > 0:  # a read: h is a value of an earlier round
            h = h * 2
        return torch.func.grad(lambda z: out(z * h).sum())(x) + h

    params = [*lin.parameters(), *out.parameters()]
    assert_same(fn, params, [torch.randn(4) for _ in range(4)])


@pytest.mark.parametrize(
    "inside, match",
    [
        (lambda h, x: torch.func.grad(lambda z: (z * h).sum())(x), r"Tensor\.mul inside a torch"),
        (lambda h, x: torch.func.grad(lambda z: z.sum())(h), r"transform .*was given"),
    ],
    ids=["closed-over", "given"],
)
def test_a_lazy_value_of_the_round_inside_a_torch_func_transform_is_a_fold_error(inside, match):
    """A value the function computed in the round recording has no value yet where a
    transform runs its function at once: a FoldError naming the fix (read first, or compute
    it inside), not torch's error about a type it does not know."""
    lin = nn.Linear(3, 3)
    with pytest.raises(fold.FoldError, match=rf"example 0: .*{match}.*Fix: .*read a value"):
        fold.autobatch(lambda x: inside(torch.tanh(lin(x)), x), [torch.randn(3) for _ in range(2)])


@pytest.mark.parametrize("stack", [True, False])
def test_an_object_holding_lazy_values_returned_is_a_fold_error_or_registered(stack):
    """A result torch's pytree does not look into (a dataclass, an object of one's own)
    holding lazy values: a FoldError naming the example and the fix, where the values left
    the call uncomputed (the first use of one raised far from the call, telling the user to
    use what autobatch returns).  A dataclass registered with the pytree comes back with
    its fields computed (stacked, with ``stack``), equal to eager's."""
    import dataclasses

    lin = nn.Linear(3, 3)
    xs = [torch.randn(3) for _ in range(3)]

    @dataclasses.dataclass
    class Out:
        h: torch.Tensor
        n: int

    class Own:
        def __init__(self, h):
            self.hs = [h]

    for make in (lambda x: Out(lin(x), 2), lambda x: Own(lin(x))):
        with pytest.raises(fold.FoldError, match=r"example 0 returned an object of type .*Fix:"):
            fold.autobatch(make, xs, stack=stack)
    torch.utils._pytree.register_dataclass(Out)
    try:
        got = fold.autobatch(lambda x: Out(torch.tanh(lin(x)), 2), xs, stack=stack)
    finally:
        torch.utils._pytree._deregister_pytree_node(Out)
    want = [torch.tanh(lin(x)) for x in xs]
    rows = got.h if stack else torch.stack([o.h for o in got])
    torch.testing.assert_close(rows, torch.stack(want))
    torch.testing.assert_close(
        torch.autograd.grad(rows.sum(), lin.weight),
        torch.autograd.grad(torch.stack(want).sum(), lin.weight),
    )


def test_copy_of_a_lazy_value_is_its_value_cut_from_the_history_as_eager():
    lin = nn.Linear(3, 3)
    xs = [torch.randn(3) for _ in range(3)]
    assert_same(lambda x: copy.copy(lin(x)) * 2 + lin(x), list(lin.parameters()), xs)


# ---------------------------------------------------------------- sequences (issue 31)
@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.LSTM(4, 5),
        lambda: nn.GRU(4, 5, num_layers=2),
        lambda: nn.RNN(4, 5, nonlinearity="relu", bidirectional=True),
        lambda: nn.LSTM(4, 5, num_layers=2, bidirectional=True, batch_first=True),
        lambda: nn.LSTM(4, 5, proj_size=3),
    ],
    ids=["lstm", "gru-2", "rnn-bi", "lstm-2-bi-batch-first", "lstm-proj"],
)
@pytest.mark.parametrize("state", ["none", "given"])
def test_recurrent_modules_on_one_unbatched_sequence_match_eager(make, state):
    """nn.LSTM/GRU/RNN called on one sentence (L, D), as a tagger's encoder is written:
    sequences of one length run as one batch; several lengths, one packed call."""
    torch.manual_seed(0)
    rnn, emb = make(), nn.Linear(3, 4)
    dirs = 2 if rnn.bidirectional else 1
    h_size = rnn.proj_size or rnn.hidden_size

    def fn(x):
        seq = emb(x)
        if state == "none":
            out, h = rnn(seq)
        else:
            h0 = torch.tanh(emb(x[0]))[:1].expand(rnn.num_layers * dirs, h_size).contiguous()
            if isinstance(rnn, nn.LSTM):
                c0 = torch.zeros(rnn.num_layers * dirs, rnn.hidden_size)
                out, h = rnn(seq, (h0, c0 + 0.5))
            else:
                out, h = rnn(seq, h0)
        last = h[0] if isinstance(h, tuple) else h
        return out.sum(0), last.flatten()

    xs = [torch.randn(n, 3) for n in (5, 3, 5, 7, 3)]
    assert_same(fn, [*rnn.parameters(), *emb.parameters()], xs)
    assert_same(fn, [*rnn.parameters(), *emb.parameters()], torch.randn(4, 6, 3))  # rows


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
@pytest.mark.parametrize(
    "make",
    [lambda: nn.GRU(3, 4), lambda: nn.LSTM(3, 4, num_layers=2, bidirectional=True)],
    ids=["gru", "lstm-2-bi"],
)
def test_sequences_of_several_lengths_run_as_one_packed_call(make, grad, monkeypatch):
    """An RNN on sentences of several lengths: one call on the packed batch (its forward
    sees one PackedSequence), every sentence's outputs (each position, the last state)
    equal to eager per sentence, and gradients with them; float64, where a mix-up of rows
    or lengths cannot hide in rounding.  (Seen through the class's forward: a hook on the
    module would make its calls run one per example, see the hook tests.)"""
    from torch.nn.utils.rnn import PackedSequence

    from fold.autobatch.common import _LOCAL

    def inferring():  # shape inference runs the module on one example's zeros
        return _LOCAL.rec is not None and _LOCAL.rec.paused

    torch.manual_seed(0)
    rnn, emb = make().double(), nn.Linear(2, 3).double()
    packed = []  # per call of the module: packed, or not (None: shape inference's)
    real = type(rnn).forward

    def forward(self, x, *rest):
        packed.append(None if inferring() else type(x) is PackedSequence)
        return real(self, x, *rest)

    monkeypatch.setattr(type(rnn), "forward", forward)

    def fn(x):
        out, h = rnn(torch.tanh(emb(x)))
        last = h[0] if isinstance(h, tuple) else h
        return out * 2, last + 1

    xs = [torch.randn(n, 2, dtype=torch.float64) for n in (5, 1, 7, 3, 5, 2, 7)]
    want = [fn(x) for x in xs]
    packed.clear()
    with torch.set_grad_enabled(grad):
        got = fold.autobatch(fn, xs, stack=False)
    assert packed.count(True) == 1 and packed.count(False) == 0
    if not grad:
        for g, w in zip(got, want, strict=True):
            for a, b in zip(g, w, strict=True):
                assert a.shape == b.shape and not a.requires_grad
                torch.testing.assert_close(a, b)
        return
    assert_same_lists(got, want, [*rnn.parameters(), *emb.parameters()])


@pytest.mark.parametrize(
    "make, state",
    [
        (lambda: nn.LSTM(3, 4, bidirectional=True), False),
        (lambda: nn.GRU(3, 4, num_layers=2), True),
        (lambda: nn.LSTM(3, 4, batch_first=True), True),
        (lambda: nn.RNN(3, 4, nonlinearity="relu"), False),
    ],
    ids=["lstm-bi", "gru-2-state", "lstm-batch-first-state", "rnn"],
)
def test_an_rnn_over_padded_rows_runs_whole_in_one_packed_call(monkeypatch, make, state):
    """A tagger's encoder written per sentence (an embedding of its words, an RNN over
    them) over sentences of several lengths: the embedding runs as one padded call, and the
    RNN takes its padded output (``PaddedRows``) as ONE packed call of the whole group, its
    outputs padded rows in turn; no group runs in parts (one per length), so the round is a
    whole plan.  Per-sentence outputs (each its own length, stack=False), final states and
    gradients equal eager per sentence (float64); with a given initial state too."""
    from fold.autobatch import ops

    torch.manual_seed(6)
    emb, rnn, init = nn.Embedding(20, 3).double(), make().double(), nn.Linear(3, 4).double()
    dirs, layers = 2 if rnn.bidirectional else 1, rnn.num_layers
    whole, parts = [], []
    real_rows, real_parts = ops._Op._packed_rows, ops._Op._packed
    monkeypatch.setattr(
        ops._Op, "_packed_rows", lambda self, v: whole.append(real_rows(self, v)) or whole[-1]
    )
    monkeypatch.setattr(
        ops._Op, "_packed", lambda self, p: parts.append(self.name) or real_parts(self, p)
    )

    def fn(ids):
        x = emb(ids)  # (L, 3)
        if not state:
            out, h = rnn(x)
        else:
            h0 = torch.tanh(init(x[0])).expand(layers * dirs, 4).contiguous()
            out, h = rnn(x, (h0, h0 * 0.5) if isinstance(rnn, nn.LSTM) else h0)
        last = h[0] if isinstance(h, tuple) else h
        return out * 2, last + 1

    sentences = [torch.randint(0, 20, (n,)) for n in (3, 5, 1, 5, 4, 2, 6)]
    want = [fn(w) for w in sentences]
    got = fold.autobatch(fn, sentences, stack=False)
    assert len(whole) == 1 and type(whole[0][0]) is PaddedRows and parts == []
    params = [*emb.parameters(), *rnn.parameters(), *(init.parameters() if state else ())]
    assert_same_lists(got, want, params)
    with torch.no_grad():
        again = fold.autobatch(fn, sentences, stack=False)
    for g, w in zip(again, want):
        for a, b in zip(g, w):
            assert not a.requires_grad
            torch.testing.assert_close(a, b)


def test_a_whole_rnn_groups_outputs_are_read_by_the_general_gathers_after_it(monkeypatch):
    """An RNN's group over sentences of several lengths runs whole (its outputs padded rows,
    its final states one tensor), then a call that takes no padded rows (``torch.flip`` of
    the outputs) sends the rest of the round to the general gathers: every output of the
    RNN's group, the padded one by its rows of each length and the states whole, is
    registered for them.  Values and gradients equal eager (float64)."""
    from fold import executor

    torch.manual_seed(7)
    emb, lstm = nn.Embedding(20, 3).double(), nn.LSTM(3, 4).double()
    indexed = []
    real = executor.Executor._index_rows
    monkeypatch.setattr(
        executor.Executor, "_index_rows", lambda self: indexed.append(1) or real(self)
    )

    def fn(ids):
        out, (h, c) = lstm(emb(ids))
        return torch.flip(out, [0]) * 2, h + c

    sentences = [torch.randint(0, 20, (n,)) for n in (3, 5, 2, 5, 4, 6)]
    want = [fn(w) for w in sentences]
    got = fold.autobatch(fn, sentences, stack=False)
    assert indexed
    assert_same_lists(got, want, [*emb.parameters(), *lstm.parameters()])


def test_shapes_are_inferred_on_zeros_where_nothing_can_change_and_on_fake_tensors_else(
    monkeypatch,
):
    """Shape inference runs torch functions and modules of stateless types on one example's
    zeros (fake tensors cost milliseconds a call, a GRU over 30 steps 100 ms, and their
    first use 1 s of imports): torch.nn's own modules but those that keep state (running
    statistics, a lazy module's parameters), made of such modules (a transformer layer, whose
    output shape is known without a call).  A call that could change a shared tensor in place (a name
    with "norm", an embedding with ``max_norm``) and a module of any other type run on fake
    tensors, and so does a call that fails on zeros (a Cholesky factor).  Values and
    gradients equal eager's, float64; no parameter changes."""
    driver.clear_cache()
    ran = []
    for how in ("_run_zeros", "_run_fake"):
        real = getattr(recorder._Recorder, how)

        def spy(self, op, slots, real=real, how=how):
            ran.append((how[5:], op.name))
            return real(self, op, slots)

        monkeypatch.setattr(recorder._Recorder, how, spy)

    class Scaled(nn.Linear):  # a subclass: its forward could do anything
        def forward(self, x):
            return super().forward(x) * 0.5

    torch.manual_seed(0)
    gru, sub = nn.GRU(3, 4).double(), Scaled(4, 4).double()
    mlp = nn.Sequential(nn.Linear(4, 4), nn.Tanh()).double()
    layer = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True).double().eval()
    table = nn.Embedding(5, 4, max_norm=1.0).double()
    scale = nn.Parameter(torch.rand(4, dtype=torch.float64))

    def fn(x, k):
        out, h = gru(x)
        y = torch.softmax(mlp(out) @ h[0], 0)  # (L,)
        z = sub(torch.mul(out, scale)).sum() + F.layer_norm(out, (4,), scale).sum()
        z = z + layer(out[None]).sum()  # torch.nn's own, of torch.nn's own: zeros
        # Zeros are not positive-definite: fake tensors infer the shape.
        c = torch.linalg.cholesky(out.T @ out + k * torch.eye(4, dtype=torch.float64))
        w = table(out[:, 0].abs().long().clamp(max=4)).sum()
        return y.max() * c.diagonal().sum() + z + w

    xs = [torch.randn(n, 3, dtype=torch.float64) for n in (4, 2, 4, 5)]
    ks = [torch.tensor(v, dtype=torch.float64) for v in (1.0, 3.0, 2.0, 5.0)]
    params = [*gru.parameters(), *mlp.parameters(), *sub.parameters(), scale]
    params += list(layer.parameters())
    kept = [t.clone() for t in params]
    assert_same(fn, params, xs, ks)
    for a, b in zip(kept, params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    zeros = {name for how, name in ran if how == "zeros"}
    fake = {name for how, name in ran if how == "fake"}
    assert {"GRU call", "Sequential call", "Tensor.__matmul__", "torch.mul"} <= zeros - fake
    # (its output has its input's shape: inferred without a call, see tables._Transformer)
    assert "TransformerEncoderLayer call" not in zeros | fake
    assert {"Scaled call", "F.layer_norm", "Embedding call"} <= fake - zeros
    assert "linalg_cholesky" in zeros & fake  # zeros failed, then fake tensors ran


def test_a_tensor_changed_in_place_after_a_recorded_call_took_it_is_an_error(monkeypatch):
    """A recorded call runs with its round, later: an eager tensor it took as an argument
    and that the function then changes in place would reach it changed (it silently read
    the new value).  That is a FoldError naming the example, the call and the fix, on every
    path.  A
    tensor changed after the round that read it ran (a mask updated after each read) is
    fine: values and gradients equal eager's."""
    monkeypatch.setattr(driver, "EAGER_GROUP", 0)  # every round batched
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)
    xs = [torch.randn(3) for _ in range(4)]

    def changed(x):
        w = torch.ones(3, 3)
        h = lin(x)
        a = h @ w
        w.add_(1)
        return a + h @ w

    for kw in ({}, {"per_example": True}, {"stack": False}):
        with pytest.raises(
            fold.FoldError,
            match=r"example 0: a tensor of shape \(3, 3\) was changed in place after a "
            r"recorded call \(Tensor.__matmul__\)",
        ):
            fold.autobatch(changed, xs, **kw)

    def changed_later(x, i):  # (example 2 only: the C path took its call where it has one)
        w = torch.ones(3, 3)
        a = lin(w)
        if i == 2:
            w.add_(1)
        return a.sum(0) + lin(x)

    with pytest.raises(
        fold.FoldError, match=r"example 2: .* after a recorded call \(Linear call\) took it"
    ):
        fold.autobatch(changed_later, xs, list(range(4)))

    def masked(x):
        mask, out = torch.ones(3), []
        h = lin(x)
        for _ in range(3):
            s = h + mask  # (add saves no argument for backward: eager may change mask)
            mask[int(s.detach().argmax())] = 0.0  # a read: the round with the use runs first
            out.append(s)
        return torch.stack(out)

    assert_same(masked, list(lin.parameters()), xs)


def test_known_values_changed_in_place_are_read_as_changed(monkeypatch):
    """A tensor made of Python values inside the function (``torch.tensor(3)``) is known
    while recording and passed or read as that value; changed in place (``t.add_(1)``,
    ``t[0] = 7``, a step counter) its value is the changed tensor's from then on, read back
    and passed to recorded calls (before, reads and calls kept the value it was made of: a
    silent wrong answer).  A call that took it before the change keeps what it took.
    Values and gradients equal eager's, per example and in batched rounds."""
    monkeypatch.setattr(driver, "EAGER_GROUP", 0)
    torch.manual_seed(0)
    lin = nn.Linear(2, 2)

    def fn(x):
        step = torch.tensor(3)
        step.add_(1)
        scale = torch.tensor(2.0)
        scale.mul_(3)
        mask = torch.tensor([1.0, 2.0])
        # (Sums: a product would save the tensor for backward, and eager code could not
        # change it afterwards.)
        before = lin(x) + mask
        mask[0] = 7.0
        after = lin(x) + mask
        h = lin(x) * int(step) + float(scale) + (lin(x) + scale) + before + after
        if float(h.detach().sum()) > 1e9:  # a read: what follows is recorded in a round
            h = h * 2
        scale.add_(1)
        return h + scale + lin(x) * float(scale)

    xs = [torch.randn(2) for _ in range(3)]
    assert_same(fn, list(lin.parameters()), xs)


@pytest.mark.parametrize("read", [False, True], ids=["no-read", "after-a-read"])
def test_random_calls_on_the_same_value_draw_their_own_numbers(read, monkeypatch):
    """Calls on the same arguments are one node (they are taken as pure), but a call that
    draws random numbers is not: two dropouts of one value, two ``rand_like``, and Monte
    Carlo samples of a module with dropout on one input each draw their own, as in eager
    code (before, each pair was one node: equal masks, equal samples).  Recorded per
    example, and in a batched round after a read.  In eval mode the same calls are
    deterministic: values and gradients equal eager's."""
    monkeypatch.setattr(driver, "EAGER_GROUP", 0)  # the round after the read stays batched
    torch.manual_seed(0)
    lin = nn.Linear(6, 64)  # 64 wide: two masks agree with probability 2 ** -64
    mc = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5))

    def fn(x):
        h = lin(x)
        if read:  # the rest recorded in a batched round, h a node of it
            assert float(h.detach().sum()) < 1e9
            h = lin(x) + h
        a, b = F.dropout(h, 0.5, mc.training), F.dropout(h, 0.5, mc.training)
        c, d = torch.rand_like(h), torch.rand_like(h)
        return a, b, c, d, torch.stack([mc(h) for _ in range(4)])

    xs = [torch.randn(6) for _ in range(32)]
    a, b, c, d, samples = fold.autobatch(fn, xs, per_example=True)
    with torch.no_grad():
        h = lin(torch.stack(xs)) * (2 if read else 1)
        kept = torch.stack([mc[0](h)] * 4, 1)
    for x, y in ((a, b), (c, d)):
        assert type(x) is torch.Tensor and (x != y).any(1).all()  # every example: its own
    for i in range(4):
        for j in range(i):
            assert (samples[:, i] != samples[:, j]).any(1).all()
    # What each draw kept is the value scaled by 2, the rest zeros; about half dropped.
    for got, whole in ((a, h), (b, h), (samples, kept)):
        dropped = got == 0
        torch.testing.assert_close(torch.where(dropped, 2 * whole, got), 2 * whole)
        assert 0.35 < dropped.double().mean() < 0.65
    assert ((0 <= c) & (c < 1) & (0 <= d) & (d < 1)).all()

    mc.eval()  # no draws: equal to eager, values and gradients
    assert_same(lambda x: [*fn(x)[:2], fn(x)[4]], [*lin.parameters(), *mc.parameters()], xs)


@pytest.mark.parametrize("form", ["methods", "functions"])
def test_attention_over_memories_of_several_lengths_runs_one_call_per_op(form):
    """Dot attention over each example's memory (L, H) of its own length: the scores
    (matmul), their softmax (and log_softmax), the context (matmul) and the memory's mean
    each run as ONE call on the values padded to the longest memory (its parts listed in
    the report, one per length); values and gradients equal eager per example (float64)."""
    torch.manual_seed(0)
    enc, q = nn.Linear(2, 3).double(), nn.Linear(3, 3).double()
    calls = []

    def fn(x):
        mem = torch.tanh(enc(x))  # (L, 3)
        if form == "methods":
            scores = mem @ q(mem.mean(0))
            w = scores.softmax(0)
            ctx = w @ mem
            return ctx, scores.log_softmax(-1), mem.mean(0, True)
        scores = torch.matmul(mem, q(torch.mean(mem, dim=0)))
        w = F.softmax(scores, dim=0)
        ctx = torch.matmul(w, mem)
        return ctx, F.log_softmax(scores, dim=-1), torch.mean(mem, 0, keepdim=True)

    xs = [torch.randn(n, 2, dtype=torch.float64) for n in (4, 5, 6, 4, 2, 6, 3)]
    from fold.autobatch import ops

    real_parts, real_ragged, real_run = ops._Op._pad_run, ops._Op._ragged_run, ops._Op._run

    inside = []

    def counted(self, parts):
        calls.append((self.name, len(parts)))
        inside.append(self)
        try:
            return real_parts(self, parts)
        finally:
            inside.pop()

    def ragged(self, values):  # a whole group of rows of several lengths (PaddedRows)
        lengths = {int(n) for v in values if type(v) is PaddedRows for n in v.lengths}
        calls.append((self.name, len(lengths)))
        inside.append(self)
        try:
            return real_ragged(self, values)
        finally:
            inside.pop()

    def run(self, values):  # a padded call: on all seven examples at once
        if inside:
            assert len(values[0]) == len(xs)
        return real_run(self, values)

    params = [*enc.parameters(), *q.parameters()]
    want = [fn(x) for x in xs]
    import unittest.mock

    with (
        unittest.mock.patch.object(ops._Op, "_pad_run", counted),
        unittest.mock.patch.object(ops._Op, "_ragged_run", ragged),
        unittest.mock.patch.object(ops._Op, "_run", run),
    ):
        got = fold.autobatch(fn, xs, stack=False)
    # every padded op ran once, on the five lengths (in parts, or as PaddedRows)
    assert calls and all(parts == 5 for _, parts in calls), calls
    # enc (on each example's own tensor: literals of several shapes share the group too),
    # tanh, mean, scores, softmax, context, log_softmax, mean(keepdim)
    assert len(calls) == 8, calls
    assert_same_lists(got, want, params)
    with torch.no_grad():
        again = fold.autobatch(fn, xs, stack=False)
    for g, w in zip(again, want):
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b)
    # A memory of one row broadcasts where others do not: it keeps groups of its own.
    ys = [*xs, torch.randn(1, 2, dtype=torch.float64)]
    for g, w in zip(fold.autobatch(fn, ys, stack=False), [fn(y) for y in ys]):
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b)


def test_argmax_and_argmin_run_directly_and_equal_eager():
    """argmax/argmin over a whole value, along a dim (negative too) and with keepdim: each
    group one call on the stacked values (no vmap), results equal eager."""
    from fold.autobatch import record_examples
    from fold.autobatch.common import _VMAP

    lin = nn.Linear(3, 4)

    def fn(x):
        h = lin(x)  # (2, 4)
        return (
            h.argmax(),
            torch.argmin(h, 1),
            h.argmax(dim=-1, keepdim=True),
            torch.argmax(h, 0, True),
            h[0].argmin(),
        )

    xs = [torch.randn(2, 3) for _ in range(5)]
    got = fold.autobatch(fn, xs, per_example=True)
    want = eager_stack(fn, xs)
    for a, b in zip(got, want):
        assert a.dtype == torch.int64
        torch.testing.assert_close(a, b)
    rec, _, _ = record_examples(fn, xs)
    modes = {op.name: op.mode for op, _ in rec.fold.snapshot().signatures}
    assert not [name for name, mode in modes.items() if "arg" in name and mode is _VMAP], modes


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_cat_of_recorded_values_and_a_parameter_runs_directly(dim):
    """torch.cat of per-example values and a shared parameter (a parser's root row before
    a sentence's states): one call per group on the parameter expanded (no vmap); values
    and gradients, the parameter's included, equal eager."""
    from fold.autobatch import record_examples
    from fold.autobatch.common import _VMAP

    lin = nn.Linear(3, 4)
    root = nn.Parameter(torch.randn(1, 4) if dim == 0 else torch.randn(2, 1))

    def fn(x):
        h = lin(x)  # (2, 4)
        return torch.cat([root, h, root], dim) if dim == 0 else torch.cat((h, root), dim=dim)

    xs = [torch.randn(2, 3) for _ in range(5)]
    assert_same(fn, [*lin.parameters(), root], xs)
    rec, _, _ = record_examples(fn, xs)
    modes = [op.mode for op, _ in rec.fold.snapshot().signatures if op.name == "torch.cat"]
    assert modes and _VMAP not in modes


def test_padded_calls_read_an_earlier_padded_calls_outputs_in_place(monkeypatch):
    """Attention after an encoder over memories of several lengths: each padded call after
    the first takes its column as the padded tensor the call before left (its padding set
    to zeros, or to -inf along softmax's dim), not a pad per part; values and gradients
    equal eager (float64).  The examples' own tensors (the encoder's input), which no
    padded call made, are padded part by part."""
    from fold.autobatch import ops

    torch.manual_seed(3)
    enc, q = nn.Linear(2, 3).double(), nn.Linear(3, 3).double()
    taken = []
    real = ops._tiled_base
    monkeypatch.setattr(ops, "_tiled_base", lambda c, b: taken.append(real(c, b)) or taken[-1])
    # The parts path: whole groups of PaddedRows declined (as where padding would more than
    # double the values), so the groups run on the general gathers, in parts.
    monkeypatch.setattr(ops._Op, "_ragged_run", lambda self, values: None)

    def fn(x):
        mem = torch.tanh(enc(x))  # (L, 3): a padded Linear, its parts views of one tensor
        scores = mem @ q(mem.mean(0))
        w = torch.softmax(scores * 3.0, 0)  # -inf past each memory's length
        return w @ mem + scores.exp().sum() * 0.1

    xs = [torch.randn(n, 2, dtype=torch.float64) for n in (4, 5, 6, 4, 2, 6, 3)]
    want = torch.stack([fn(x) for x in xs])
    got = fold.autobatch(fn, xs)
    torch.testing.assert_close(got, want)
    params = [*enc.parameters(), *q.parameters()]
    assert_same_grads(got, want, params)
    assert sum(t is not None for t in taken) >= 4  # mean, scores, softmax, context
    assert any(type(t) is ops._Padded for t in taken) and None in taken


def _spy_padded_calls(monkeypatch):
    """The names of the ops run as one padded call, in parts (``_pad_run``: the general
    gathers' path) or whole (``_ragged_run``: a whole plan's), as they run."""
    from fold.autobatch import ops

    names = []
    for how in ("_pad_run", "_ragged_run"):
        real = getattr(ops._Op, how)  # (an op's padded_call is bound when made: patch here)
        monkeypatch.setattr(
            ops._Op, how, lambda self, v, real=real: names.append(self.name) or real(self, v)
        )
    return names


def _general_gathers(monkeypatch):
    """Rounds on the general gathers where their signatures read themselves, as before
    such rounds were split by depth into a whole plan (``signature_schedule``'s ``split``):
    for the tests of the gathers' padded parts, which rounds still take where no whole plan
    can be made (a column that mixes shapes, an op that takes no padded rows)."""
    from fold.scheduler import auto

    real = auto.signature_schedule
    monkeypatch.setattr(auto, "signature_schedule", lambda a, split=False: real(a))


def test_padded_outputs_of_one_shape_are_one_source_for_all_lengths(monkeypatch):
    """On the general gathers, over memories of several lengths, a padded call whose output
    has one shape for every length (a mean over the memory, a context ``weights @ mem``, a packed GRU's final state)
    registers that output as one tensor of all the parts' rows; outputs whose shape follows
    the length (the GRU's states, the scores, the weights) stay one per length.  Later
    groups read both; values and gradients equal eager (float64)."""
    from fold.values import Values

    _general_gathers(monkeypatch)  # (its ``+`` reads itself through the attention)
    registered = []
    real = Values.add_parts
    monkeypatch.setattr(
        Values, "add_parts", lambda v, outs, *a: registered.append(outs) or real(v, outs, *a)
    )
    torch.manual_seed(6)
    gru, q = nn.GRU(2, 3).double(), nn.Linear(3, 3).double()

    def fn(x):
        mem, h = gru(x)  # (L, 3), (1, 3)
        ctx = mem.mean(0)
        w = torch.softmax(mem @ q(h[0] + ctx), 0)  # (L,)
        return torch.tanh(w @ mem + ctx)

    lengths = (4, 5, 6, 4, 2, 6, 3)
    xs = [torch.randn(n, 2, dtype=torch.float64) for n in lengths]
    want = torch.stack([fn(x) for x in xs])
    got = fold.autobatch(fn, xs)
    torch.testing.assert_close(got, want)
    params = [*gru.parameters(), *q.parameters()]
    assert_same_grads(got, want, params)
    parts = len(set(lengths))
    whole = [o for outs in registered for o in outs if type(o) is torch.Tensor]
    per_length = [o for outs in registered for o in outs if type(o) is list]
    # The GRU's final state, the mean and the context: one tensor of all 7 rows each.
    assert sorted(tuple(o.shape) for o in whole) == [(7, 1, 3), (7, 3), (7, 3)]
    # The GRU's states, the scores and the weights: one tensor per length.
    assert len(per_length) == 3 and all(len(o) == parts for o in per_length)


def test_a_packed_rnn_reads_an_embeddings_padded_output_in_place(monkeypatch):
    """An LSTM over each sentence's embedded words (sentences of several lengths), in a
    round the general gathers run (its linear layer applied twice reads itself, and no
    split plan is made here): the packed call takes the embedding's padded output as it is,
    not a pad per length; values and gradients equal eager (float64)."""
    from fold.autobatch import ops

    _general_gathers(monkeypatch)
    torch.manual_seed(4)
    emb, lstm = nn.Embedding(20, 3).double(), nn.LSTM(3, 4, bidirectional=True).double()
    lin = nn.Linear(8, 8).double()
    taken = []
    real = ops._tiled_base
    monkeypatch.setattr(ops, "_tiled_base", lambda c, b: taken.append(real(c, b)) or taken[-1])

    def fn(ids):
        states, (h, _) = lstm(emb(ids))
        return lin(lin(states.sum(0))) + h.flatten()

    sentences = [torch.randint(0, 20, (n,)) for n in (3, 5, 2, 5, 4, 1, 3)]
    want = torch.stack([fn(w) for w in sentences])
    got = fold.autobatch(fn, sentences)
    torch.testing.assert_close(got, want)
    params = [*emb.parameters(), *lstm.parameters(), *lin.parameters()]
    assert_same_grads(got, want, params)
    assert any(type(t) is ops._Padded for t in taken)


def test_encoder_rows_of_several_lengths_run_padded(monkeypatch):
    """A parser's encoder: torch.cat of a shared root row and each sentence's states, then
    rows of it by non-negative ints, over sentences of several lengths: the cat and each
    index run as one padded call (not a group per length); a cat whose varying value is not
    last (the root after the states), and a negative index, keep a group per length.
    Values and gradients equal eager (float64)."""

    torch.manual_seed(5)
    lin = nn.Linear(2, 3).double()
    root = nn.Parameter(torch.randn(1, 3, dtype=torch.float64))
    padded = _spy_padded_calls(monkeypatch)

    def fn(x):
        states = torch.tanh(lin(x))  # (L, 3)
        enc = torch.cat([root, states])  # (L + 1, 3): padded at its end
        after = torch.cat([states, root])  # the root after the padding: a group per length
        return enc[0] * 2 + enc[1] + enc[2] * enc[1] + after[-1] + enc[-1]

    xs = [torch.randn(n, 2, dtype=torch.float64) for n in (2, 4, 3, 4, 5, 2)]
    want = torch.stack([fn(x) for x in xs])
    got = fold.autobatch(fn, xs)
    torch.testing.assert_close(got, want)
    params = [root, *lin.parameters()]
    assert_same_grads(got, want, params)
    names = [n.split(" (")[0] for n in padded]
    assert names.count("torch.cat") == 1 and names.count("Tensor.__getitem__") == 3, names


def test_attention_written_with_mv_einsum_bmm_mm_and_dot_runs_padded():
    """The same attention written with torch.mv, einsum, bmm, mm, dot and a transpose (ops
    under vmap among them): over memories of several lengths each is one padded call;
    values and gradients equal eager (float64)."""
    from fold.autobatch import ops

    torch.manual_seed(0)
    enc, q = nn.Linear(2, 3).double(), nn.Linear(3, 3).double()

    def fn(x):
        mem = torch.tanh(enc(x))
        w = F.softmax(torch.mv(mem, q(mem.mean(0))), dim=0)
        c1 = torch.einsum("l,lh->h", w, mem)
        c2 = torch.bmm(w.view(1, 1, -1), mem.unsqueeze(0)).squeeze(0).squeeze(0)
        c3 = torch.mm(w.unsqueeze(0), mem).squeeze(0)
        return c1, c2, c3, mem.t().sum(1), torch.dot(w, w)

    xs = [torch.randn(n, 2, dtype=torch.float64) for n in (4, 5, 6, 4, 2, 6, 3)]
    padded = []
    real, real_ragged = ops._Op._pad_run, ops._Op._ragged_run

    def counted(self, parts):
        padded.append(self.name)
        return real(self, parts)

    def ragged(self, values):  # a whole group of PaddedRows (a whole plan's)
        padded.append(self.name)
        return real_ragged(self, values)

    import unittest.mock

    with (
        unittest.mock.patch.object(ops._Op, "_pad_run", counted),
        unittest.mock.patch.object(ops._Op, "_ragged_run", ragged),
    ):
        got = fold.autobatch(fn, xs, stack=False)
    assert {"torch.mv", "torch.einsum", "torch.bmm", "torch.mm", "torch.dot", "Tensor.t"} <= set(
        padded
    ), padded
    assert_same_lists(got, [fn(x) for x in xs], [*enc.parameters(), *q.parameters()])


class _Pointer(nn.Module):
    """A pointer network written for one example: each step scores the example's own inputs
    (L, 4) against a query, masks the ones already picked, and reads the argmax (a round);
    it returns the picks and the log-probability of each pick."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.att = nn.Linear(4, 4)

    def forward(self, seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        enc = torch.tanh(self.enc(seq))
        q, used, picks, logps = enc.mean(0), torch.zeros(len(seq), dtype=torch.bool), [], []
        for _ in range(len(seq)):
            scores = (enc @ self.att(q)).masked_fill(used, float("-inf"))
            i = int(scores.argmax())  # a read: the example pauses
            logps.append(torch.log_softmax(scores, 0)[i])
            picks.append(i)
            used = used.clone()
            used[i] = True
            q = enc[i]
        return torch.tensor(picks), torch.stack(logps)


def test_pointer_network_over_inputs_of_several_lengths_runs_padded_calls(finish, monkeypatch):
    """A pointer network over inputs of several lengths: a round's masked_fill (its mask a
    tensor of each example's length) and argmax run as one padded call each, not one group
    per length; picks, log-probabilities and gradients equal eager per example (float64)."""
    torch.manual_seed(0)
    model = _Pointer().double()
    seqs = [torch.randn(n, 4, dtype=torch.float64) for n in (3, 5, 2, 6, 4, 5, 3)]
    names = _spy_padded_calls(monkeypatch)
    got, want = fold.autobatch(model, seqs, stack=False), [model(x) for x in seqs]
    assert [g[0].tolist() for g in got] == [w[0].tolist() for w in want]
    assert_same_lists([g[1:] for g in got], [w[1:] for w in want], list(model.parameters()))
    ran = {n.split(" (")[0] for n in names}
    assert {"Tensor.masked_fill", "Tensor.argmax"} <= ran, ran
    if finish == "batched-rounds":  # one padded call a round, where lengths differ (5 rounds)
        assert names.count(next(n for n in names if n.startswith("Tensor.argmax"))) == 5


@pytest.mark.parametrize("which", ["argmax", "argmin", "amin"])
def test_extremes_over_values_of_several_lengths_never_pick_the_padding(which):
    """argmax, argmin and amin over values of several lengths run padded: the padding is
    filled with a value that never wins, even where each example's values are all the
    dtype's extreme (-inf, inf, an integer type's least or greatest), or where the values tie
    (the first index wins, as in eager); along a dim, over a whole value of one dim, with
    keepdim; floats and integers."""
    lin = nn.Linear(2, 3)
    fns = {
        "argmax": lambda v: (v.argmax(), v.argmax(0), v[:, 1].argmax(), v.argmax(0, keepdim=True)),
        "argmin": lambda v: (v.argmin(), v.argmin(0), v[:, 1].argmin(), v.argmin(dim=0)),
        "amin": lambda v: (v.amin(0), v[:, 1].amin(0), v.amin(0) * 2),
    }

    def fn(x, fill):
        v = lin(x)  # (L, 3)
        ints = (v * 10).long()
        if fill == "ties":
            v, ints = v * 0.0, ints * 0
        elif fill is not None:
            extreme = torch.iinfo(torch.long).min if fill < 0 else torch.iinfo(torch.long).max
            v, ints = v * 0.0 + fill, ints * 0 + extreme
        return (*fns[which](v), *fns[which](ints))

    lengths = (3, 5, 2, 5, 4)
    xs = [torch.randn(n, 2) for n in lengths]
    for fill in (None, "ties", float("-inf"), float("inf")):
        got = fold.autobatch(lambda x, fill=fill: fn(x, fill), xs, stack=False)
        for g, w in zip(got, [fn(x, fill) for x in xs], strict=True):
            for a, b in zip(g, w, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape
                torch.testing.assert_close(a, b)


def test_padded_groups_of_integer_and_bool_values_match_eager():
    """Values of several lengths that are integers or bools: amax pads with the dtype's
    least value (no -inf in an integer tensor), elementwise ops with zeros."""
    lin = nn.Linear(2, 3)

    def fn(x):
        ids = (lin(x) * 10).long()  # (L, 3) integers of several lengths
        big = ids > 0
        return ids.amax(0), (ids * 2 + 1).sum(0), (big * big).sum(0), torch.softmax(lin(x), 0)

    xs = [torch.randn(n, 2) for n in (3, 5, 2, 5, 4)]
    got = fold.autobatch(fn, xs, stack=False)
    for g, w in zip(got, [fn(x) for x in xs]):
        for a, b in zip(g, w):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b)


def test_additive_attention_over_memories_of_several_lengths_matches_eager():
    """Additive (Bahdanau) attention written per example: a Linear over the memory, a
    broadcast add, tanh, a projection, softmax, weights unsqueezed and multiplied into the
    memory, summed, and the memory's largest entries (amax): groups mixing memories of
    several lengths run padded; values and gradients equal eager (float64)."""
    torch.manual_seed(0)
    enc = nn.Linear(2, 4).double()
    w_mem, w_q, v = (nn.Linear(4, 4).double() for _ in range(3))
    emb = nn.Embedding(9, 4).double()

    def fn(x, ids):
        mem = torch.relu(enc(x)) + emb(ids + 0) * 0.5  # (L, 4); ids + 0: a recorded value
        q = torch.tanh(mem.sum(0))
        e = v(torch.tanh(w_mem(mem) + w_q(q))).sum(-1)  # (L,)
        w = torch.softmax(e, 0)
        ctx = (w.unsqueeze(1) * mem).sum(0)
        return ctx, mem.amax(0), torch.log_softmax(e, dim=0) - e.mean(0)

    lengths = (3, 5, 2, 5, 7, 3, 2, 4)
    xs = [torch.randn(n, 2, dtype=torch.float64) for n in lengths]
    ids = [torch.randint(0, 9, (n,)) for n in lengths]
    params = [*enc.parameters(), *w_mem.parameters(), *w_q.parameters(), *v.parameters()]
    params += list(emb.parameters())
    got = fold.autobatch(fn, xs, ids, stack=False)
    assert_same_lists(got, [fn(x, i) for x, i in zip(xs, ids)], params)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("side", ["right", "left"])
def test_pad_sequence_of_recorded_sequences_matches_eager(batch_first, side):
    from torch.nn.utils.rnn import pad_sequence

    lin = nn.Linear(3, 2)

    def fn(x):
        parts = [lin(x[:2]), lin(x[1:5]), torch.tanh(lin(x))]
        return pad_sequence(parts, batch_first=batch_first, padding_value=-1.5, padding_side=side)

    xs = [torch.randn(6, 3) for _ in range(4)]
    assert_same(fn, list(lin.parameters()), xs)
    assert_same(fn, list(lin.parameters()), torch.stack(xs))


def test_torch_distributions_batch_with_and_without_their_argument_check():
    """A distribution over recorded parameters: its log_prob and entropy batch; with the
    default check (validate_args), the check's read pauses the example for a round."""
    lin = nn.Linear(3, 2)

    def fn(x, validate):
        h = lin(x)
        d = torch.distributions.Normal(h[0], F.softplus(h[1]), validate_args=validate)
        return d.log_prob(torch.tensor(0.3)) + d.entropy()

    xs = [torch.randn(3) for _ in range(4)]
    assert_same(fn, list(lin.parameters()), xs, [False] * 4)
    assert_same(fn, list(lin.parameters()), xs, [True] * 4)


def test_a_list_of_same_shape_tensors_is_recorded_once_like_tensor_rows():
    """Samples as a Dataset yields them, a list of tensors of one shape: fn is recorded
    once on lazy rows (one torch.stack), with values and gradients of eager per example;
    a list of tensors of different shapes, or a function that reads a row, records per
    example with the list's own tensors."""
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    samples = [torch.randn(1, 6) for _ in range(7)]
    f = Counted(lambda x: model(x)[0])
    got = assert_same(f, list(model.parameters()), samples)
    assert got.shape == (7, 3)
    f.calls = 0
    fold.autobatch(f, samples)
    assert f.calls == 1
    ragged = [torch.randn(1, 6), torch.randn(2, 6)]
    g = Counted(lambda x: model(x).sum(0))
    assert_same(g, list(model.parameters()), ragged)
    g.calls = 0
    fold.autobatch(g, ragged)
    assert g.calls == 2
    # Inputs that carry gradients: they reach each sample, as eager.
    leaves = [torch.randn(6, requires_grad=True) for _ in range(3)]
    out = fold.autobatch(lambda x: model(x).tanh(), leaves)
    grads = torch.autograd.grad(out.sum(), leaves)
    want = torch.autograd.grad(torch.stack([model(x).tanh() for x in leaves]).sum(), leaves)
    torch.testing.assert_close(grads, want)


# ---------------------------------------------------------------- known values (issue 31)
def test_torch_tensor_of_python_values_is_known_and_read_back_at_once():
    """torch.tensor(word) inside fn makes no tensor until one is needed: read back it is the
    value (no FoldError, no round), and every use equals eager's."""
    emb = nn.Embedding(10, 3)
    lin = nn.Linear(3, 3)
    seen = []

    def fn(word, scale):
        w = torch.tensor(word)
        s = torch.tensor(scale)
        seen.append((type(w), int(w), w.item(), float(s), bool(w), w.shape, w.dtype, w.tolist()))
        h = emb(w)  # a module call: the word is a literal column
        h = lin(h) * s + w  # with lazy values: recorded, the known values batched
        eager = (w + 1) * 2  # known values alone: eager, a tensor at once
        assert type(eager) is torch.Tensor and int(eager) == (word + 1) * 2
        idx = emb.weight[w]  # as an index
        return h.sum() + idx.sum() + eager, torch.tensor([word, 2 * word]), w

    words, scales = [3, 1, 4, 1, 5], [0.5, 1.5, 2.0, -1.0, 0.25]
    out = assert_same(fn, [*emb.parameters(), *lin.parameters()], words, scales)
    assert out[1].dtype == torch.long and out[2].tolist() == words
    assert seen[0][0] is values.Known and seen[0][1:5] == (3, 3, 0.5, True)
    assert seen[0][5:] == (torch.Size([]), torch.long, 3)


@pytest.mark.parametrize(
    "data, kwargs",
    [
        (3, {"dtype": torch.float64}),
        (3.5, {"dtype": torch.float32}),
        (True, {}),
        (2, {"dtype": torch.bool}),
        (7, {"device": "cpu"}),
        ([1.5, 2.5], {}),
        ([[1, 2], [3, 4]], {"dtype": torch.int32}),
    ],
)
def test_known_values_keep_torch_tensor_dtype_and_device(data, kwargs):
    lin = nn.Linear(2, 2)

    def fn(x):
        t = torch.tensor(data, **kwargs)
        return lin(x) * t.sum().to(x.dtype) + t.double().mean(), t

    xs = [torch.randn(2) for _ in range(3)]
    got = assert_same(fn, list(lin.parameters()), xs)
    want = torch.tensor(data, **kwargs)
    assert got[1].dtype == want.dtype and got[1].shape == (3, *want.shape)


@pytest.mark.parametrize(
    "data, kwargs",
    [
        ([0.0, float("-inf"), 1.5], {}),
        ([1, 2, 3], {}),
        ([True, False], {}),
        ([True, 2], {}),
        ([1, 2.5], {}),
        ([], {}),
        ((4, 5), {"dtype": torch.float64}),
        ([1.0, -0.0], {"dtype": torch.float16}),
        ([1, 2], {"dtype": torch.long, "device": "cpu"}),
    ],
)
def test_known_flat_lists_have_torch_tensor_dtype_and_shape(data, kwargs):
    """torch.tensor of a flat list of Python numbers inside fn holds the numbers (no tensor
    per call) with the dtype and shape torch.tensor gives them; its tensor, and every use,
    equal eager's."""
    want = torch.tensor(data, **kwargs)
    seen = []

    def fn(x):
        t = torch.tensor(data, **kwargs)
        seen.append((type(t), t.dtype, t.shape))
        return x * 0 + t.sum().to(x.dtype), t

    got = fold.autobatch(fn, [torch.randn(2) for _ in range(3)], per_example=True)
    assert seen[0] == (values.Known, want.dtype, want.shape)
    torch.testing.assert_close(got[1], torch.stack([want] * 3), equal_nan=True)


def test_known_masks_added_to_recorded_values_match_eager_across_rounds(finish):
    """A mask made per step from Python numbers (a parser's legal actions), added to a
    recorded value, in rounds: equal masks share one literal row, but 0.0 and -0.0, NaN and
    a mask whose tensor was changed in place each give eager's values; gradients equal."""
    torch.manual_seed(3)
    lin = nn.Linear(3, 3)
    masks = [
        [0.0, float("-inf"), 0.0],
        [0.0, 0.0, float("-inf")],
        [-0.0, 0.0, 0.0],
        [float("nan"), 0.0, 0.0],
    ]

    def fn(x, k):
        h = lin(x)
        total = h.sum() * 0
        for step in range(4):
            m = torch.tensor(masks[(k + step) % 4])
            if step == 3:
                m.add_(1.0)  # in place on its tensor: the recorded row must see it
            scores = h + m
            total = total + (scores.nan_to_num(nan=0.5, neginf=-5.0) * (step + 1)).sum()
            if int(scores.argmax()) < 0:  # a read per step: a round per step
                break
            h = torch.tanh(lin(h)) * 1.5  # a module call: recorded in the round after it
        return total

    xs, ks = [torch.randn(3) for _ in range(9)], [0, 1, 2, 3, 0, 1, 2, 3, 1]
    want = torch.stack([fn(x, k) for x, k in zip(xs, ks)])
    got = fold.autobatch(fn, xs, ks)
    torch.testing.assert_close(got, want)
    params = list(lin.parameters())
    for a, b in zip(
        torch.autograd.grad(got.sum(), params), torch.autograd.grad(want.sum(), params)
    ):
        torch.testing.assert_close(a, b)
    # The shared rows keep 0.0 and -0.0 apart (the sums above cannot tell them apart)
    one = values.Known((0.0, 0.0), values._meta((2,), torch.float32, torch.device("cpu")), False)
    neg = values.Known((-0.0, 0.0), values._meta((2,), torch.float32, torch.device("cpu")), False)
    assert one.row() is not neg.row() and torch.signbit(neg.row()[0, 0])
    assert one.row() is values.Known((0.0, 0.0), one.meta, False).row()


@pytest.mark.filterwarnings("ignore::UserWarning")  # (dynamo's, tracing what it calls)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (torch.compile's imports)
def test_a_module_made_by_torch_compile_runs_eagerly_on_fake_tensors():
    """A module made by ``torch.compile``: shape inference ran its compiled kernels on fake
    tensors, which have no data, and the process crashed (a segmentation fault in the
    inductor kernel).  Fold's fake-tensor runs take torch.compiler's eager stance; the
    groups run the compiled module.  Values equal eager."""
    torch.manual_seed(0)
    compiled = torch.compile(nn.Sequential(nn.Linear(3, 3), nn.Tanh()))

    def fn(x):
        h = compiled(x)
        return h * 2 if float(h.detach().sum()) > 0 else h  # a read: a round

    xs = [torch.randn(3) for _ in range(4)]
    try:
        want = torch.stack([fn(x) for x in xs])
    except Exception as err:  # (no C++ compiler for inductor's kernels here)
        pytest.skip(f"torch.compile cannot run here: {type(err).__name__}")
    got = fold.autobatch(fn, xs)
    torch.testing.assert_close(got, want)


def test_shape_inference_on_fake_tensors_logs_nothing_of_torchs_where_it_fails():
    """A module of one's own whose forward fails on fake tensors (an in-place update of a
    buffer with a batched value, when it is tried under vmap there): torch logs each failed
    fake kernel as an error with its traceback, which reached the user's log from fold's
    probing (about 20 lines).  The failure is fold's to handle: nothing is logged by torch,
    and the call's error is autobatch's FoldError naming the fix."""

    class Ema(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.register_buffer("ema", torch.zeros(3))

        def forward(self, x):
            y = self.lin(x)
            with torch.no_grad():
                self.ema.mul_(0.9).add_(0.1 * y)
            return y + self.ema

    m = Ema()
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")  # (torch's: no propagation)
    seen = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = seen.append
    fake_log.addHandler(handler)
    try:
        with pytest.raises(fold.FoldError, match="writes a recorded value"):
            fold.autobatch(lambda x: torch.tanh(m(x)), [torch.randn(3) for _ in range(3)])
    finally:
        fake_log.removeHandler(handler)
    assert not seen, [r.getMessage()[:80] for r in seen]


def test_a_module_of_ones_own_that_reads_is_run_through(caplog, monkeypatch):
    """A module of the user's own whose forward reads a value (vmap cannot run it) is not
    recorded whole: its forward runs as the function's own code, each call inside it
    recorded, and the read pauses the example for a round, as anywhere else.  Eager's
    values and gradients, every group batched (nothing runs one call per example)."""

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            h = self.lin(x)
            return h * 2 if h.sum() > 0 else h - 1  # a read: no vmap

    gate = Gate()
    xs = [torch.randn(3) for _ in range(6)]
    rounds = []
    run_round = driver._Session.run_round
    monkeypatch.setattr(
        driver._Session, "run_round", lambda self: rounds.append(1) or run_round(self)
    )
    with caplog.at_level("WARNING", logger="fold.autobatch.ops"):
        assert_same(lambda x: gate(x).tanh(), list(gate.parameters()), xs)
    assert rounds  # the read paused the examples
    assert not any("one call per example" in r.message for r in caplog.records)
    assert not [op for op in _OPS.values() if op.fn is gate]  # never recorded whole
    assert [op for op in _OPS.values() if op.fn is gate.lin]


@pytest.mark.parametrize("held", ["GRU", "GRU unused", "LSTMCell", "GRUCell", "RNNCell"])
def test_a_module_of_ones_own_holding_a_recurrent_module_is_run_through_at_once(held, monkeypatch):
    """A module of the user's own holding an ``nn.GRU`` (the translation tutorial's encoder:
    a GRU on a batch of one) or a recurrent cell (a decoder's step module) is run through
    without the try under vmap on fake tensors (torch.func.vmap has no batching rule for the
    recurrent ops, and runs the GRU and RNN cells one call per example; the fake tensors'
    first use imports torch's compiler): the try is never made, and eager's values and
    gradients come back, also where the module's forward does not call what it holds."""

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            kind = held.split()[0]
            self.rnn = getattr(nn, kind)(4, 4)
            self.lin = nn.Linear(4, 4)

        def forward(self, word, hidden):
            x = self.embed(word).view(1, 1, -1)
            if held == "GRU":
                out, hidden = self.rnn(x, hidden)
                return out[0, 0] + self.lin(hidden[0, 0]), hidden
            if held == "LSTMCell":
                h, c = self.rnn(x[0], (hidden[0], hidden[0] * 0.5))
                return self.lin(h[0]) + c[0], h[None]
            if held in ("GRUCell", "RNNCell"):
                h = self.rnn(x[0, 0], hidden[0, 0])
                return self.lin(h), h[None, None]
            return self.lin(x[0, 0]), hidden * 0.5

    enc = Encoder().double()
    tried = []
    monkeypatch.setattr(recorder._Recorder, "_vmaps", lambda self, op: tried.append(op) or True)

    def fn(words):
        hidden = torch.zeros(1, 1, 4, dtype=torch.float64)
        outs = []
        for w in words.tolist():
            out, hidden = enc(torch.tensor(w), hidden)
            outs.append(out)
        return torch.stack(outs).sum(0)

    g = torch.Generator().manual_seed(0)
    words = [torch.randint(0, 10, (3,), generator=g) for _ in range(5)]
    assert_same(fn, list(enc.parameters()), words)
    assert not tried  # (run through at once)
    assert not [op for op in _OPS.values() if op.fn is enc]  # never recorded whole


def test_a_module_of_ones_own_returning_python_values_is_run_through():
    """A step module returning a Python value beside its state (``(h, int(h.argmax()))``,
    a read inside its forward): run through, not refused (a recorded call returns tensors
    only), the read pausing the example; the number of steps each example takes is its
    own.  Eager's values and gradients."""

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, h):
            h = torch.tanh(self.lin(h))
            return h, int(h.detach().argmax())

    step = Step()

    def fn(x):
        h, a = step(x)
        for _ in range(a):
            h, _ = step(h)
        return h

    torch.manual_seed(3)
    xs = [torch.randn(3) for _ in range(8)]
    assert len({step(x)[1] for x in xs}) > 1  # examples take different numbers of steps
    assert_same(fn, list(step.parameters()), xs)
    assert not [op for op in _OPS.values() if op.fn is step]


def _centre(module, inputs, out):
    return out - out.mean()  # over the example's own values, in eager code


def _unit_input(module, inputs):
    return (inputs[0] / inputs[0].norm(),)


def _scaled_grad(module, grad_in, grad_out):
    return tuple(None if g is None else g / (1 + g.norm()) for g in grad_in)


@pytest.mark.parametrize(
    "hook",
    ["forward", "forward pre", "global forward", "full backward", "on a submodule", "on an RNN"],
)
def test_module_hooks_see_each_examples_values_as_in_eager_code(hook, finish, caplog):
    """A module hook reads or changes the values of one call: run on a group's batched call,
    ``out - out.mean()`` centred over every example's values at once, silently.  A module
    with hooks (its own or a submodule's, forward or backward, or global module hooks) runs
    its calls one per example, as eager code; values and gradients equal eager (float64)."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3).double()
    seq = nn.Sequential(nn.Linear(3, 3), nn.Tanh()).double()
    gru = nn.GRU(3, 3).double()
    handles = []
    if hook == "forward":
        handles.append(lin.register_forward_hook(_centre))
    elif hook == "forward pre":
        handles.append(lin.register_forward_pre_hook(_unit_input))
    elif hook == "global forward":
        handles.append(
            nn.modules.module.register_module_forward_hook(
                lambda m, i, o: _centre(m, i, o) if isinstance(o, torch.Tensor) else None
            )
        )
    elif hook == "full backward":
        handles.append(lin.register_full_backward_hook(_scaled_grad))
    elif hook == "on a submodule":
        handles.append(seq[0].register_forward_hook(_centre))
    else:
        handles.append(gru.register_forward_hook(lambda m, i, o: (o[0] - o[0].mean(), o[1])))

    def fn(x):
        out, h = gru(x)
        y = seq(lin(h[0]) + out.sum(0))
        if float(y.detach().sum()) > 0:  # a read: a round
            y = y * 2
        return lin(y)

    xs = [torch.randn(n, 3, dtype=torch.float64) for n in (2, 4, 4, 3, 2)]
    params = [*lin.parameters(), *seq.parameters(), *gru.parameters()]
    try:
        want = [fn(x) for x in xs]
        with caplog.at_level(logging.WARNING, logger="fold.autobatch.ops"):
            got = fold.autobatch(fn, xs, stack=False)
        assert_same_lists([(g,) for g in got], [(w,) for w in want], params)
    finally:
        for h in handles:
            h.remove()
    assert [r for r in caplog.records if "has hooks" in r.getMessage()]  # said (once each)


def test_a_hooked_module_over_tensor_rows_runs_per_example_too():
    """The examples as rows of one tensor (recorded once for all of them, ``_traced``): a
    module with a forward hook still runs one call per example.  Values and gradients
    equal eager (float64)."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3).double()
    handle = lin.register_forward_hook(_centre)
    try:
        assert_same(
            lambda x: torch.tanh(lin(x)), list(lin.parameters()), torch.randn(5, 3).double()
        )
    finally:
        handle.remove()


@pytest.mark.filterwarnings("ignore:.*weight_norm.*deprecated:FutureWarning")
def test_a_module_with_torchs_weight_hooks_runs_batched():
    """torch's own pre-hooks that make a module's weight from its parameters (spectral and
    weight norm, pruning) read no value of the call: such a module's groups stay one call.
    Values and gradients equal eager (float64, eval mode: no power iteration)."""
    from torch.nn.utils import prune, spectral_norm, weight_norm

    torch.manual_seed(0)
    mods = [spectral_norm(nn.Linear(3, 3)), weight_norm(nn.Linear(3, 3)), nn.Linear(3, 3)]
    prune.l1_unstructured(mods[2], "weight", amount=0.3)
    mods = [m.double().eval() for m in mods]
    calls = []
    real = nn.Linear.forward

    def counted(self, x):
        calls.append(x.shape)
        return real(self, x)

    def fn(x):
        return torch.tanh(mods[2](mods[1](mods[0](x))))

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(5)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(nn.Linear, "forward", counted)
        got = fold.autobatch(fn, xs)
    assert (5, 3) in calls  # a group's call, not five
    torch.testing.assert_close(got, torch.stack([fn(x) for x in xs]))
    assert_same(fn, [p for m in mods for p in m.parameters()], xs)


def test_a_module_of_ones_own_tried_under_vmap_passes_no_torch_warning_on():
    """A module of one's own holding a GRU cell, tried under vmap on fake tensors when first
    recorded, then run so: vmap runs the cell example by example, and torch's warning of that
    reached the user from the try (and, where warnings are errors, failed it: the module was
    then run through, where users' runs took vmap).  Values and gradients equal eager."""

    class Step(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cell = nn.GRUCell(3, 3)

        def forward(self, x, h):
            return self.cell(x, h) * 2

    torch.manual_seed(0)
    step = Step().double()
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]

    def fn(x):
        return torch.tanh(step(x, torch.tanh(x)))

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = fold.autobatch(fn, xs)
    assert not [str(w.message)[:60] for w in seen]
    torch.testing.assert_close(got, torch.stack([fn(x) for x in xs]))
    assert_same(fn, list(step.parameters()), xs)


def test_a_module_vmap_cannot_run_runs_one_call_per_example(caplog):
    """A call of torch's own that vmap cannot run (``torch.gru``, the kernel under
    nn.GRU, which has no batching rule): its group runs one call per example, with eager's
    values and gradients, and says so once."""
    gru = nn.GRU(3, 4)
    xs = [torch.randn(5, 1, 3) for _ in range(4)]

    def fn(x):
        h0 = torch.tanh(x[:1].sum(2, keepdim=True)).expand(1, 1, 4).contiguous()
        out, h = torch.gru(x, h0, gru._flat_weights, True, 1, 0.0, False, False, False)
        return out.sum(0) + h[0]

    with caplog.at_level("WARNING", logger="fold.autobatch.ops"):
        assert_same(fn, list(gru.parameters()), xs)
    assert any("one call per example" in r.message for r in caplog.records)


class _TinyTransformer(nn.Module):
    """torch.nn's transformer, greedy decoding written for one source (a batch of one, the
    whole prefix and a mask at every step); ``alike``: the usual causal mask, else one that
    differs between examples (a bias of the example's own)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 8)
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        layer = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.dec = nn.TransformerDecoder(layer, 1)
        self.proj = nn.Linear(8, 7)

    def greedy(self, src: torch.Tensor, alike: bool = True) -> tuple[torch.Tensor, ...]:
        mem = self.enc(self.emb(src)[None])
        toks, outs = [1], []
        for _ in range(5):
            n = len(toks)
            mask = nn.Transformer.generate_square_subsequent_mask(n, dtype=torch.float64)
            if not alike:
                mask = mask + 0.1 * int(src[0])
            out = self.dec(self.emb(torch.tensor(toks))[None], mem, tgt_mask=mask)
            logits = self.proj(out[0, -1])
            outs.append(logits)
            toks.append(int(logits.argmax()))
            if toks[-1] == 0:
                break
        return torch.tensor(toks), torch.stack(outs)


def test_a_transformer_decoder_whose_masks_differ_loops_and_says_so_once(caplog, finish):
    """Greedy decoding with torch.nn's transformer, each example's mask its own: the
    decoder (whose group runs as one call on the examples' merged batch only where they
    gave one mask) is called on a longer prefix each round, a new op each time.  Its
    groups run one call per example, said once for the module; the encoder layer (sources
    of several lengths, one call with a key padding mask) warns nothing (eager code does
    not).  Tokens equal eager (float64)."""
    torch.manual_seed(0)
    model = _TinyTransformer().double().eval()
    g = torch.Generator().manual_seed(1)
    srcs = [torch.randint(1, 7, (int(n),), generator=g) for n in (3, 5, 3, 6, 5, 3)]
    with torch.no_grad():
        want = [model.greedy(s, False)[0] for s in srcs]
        with warnings.catch_warnings(record=True) as seen, caplog.at_level("WARNING"):
            warnings.simplefilter("always")
            got = fold.autobatch(lambda s: model.greedy(s, False)[0], srcs, stack=False)
    assert [x.tolist() for x in got] == [x.tolist() for x in want]
    assert max(len(w) for w in want) > 3  # several rounds, each a new prefix length
    assert not [str(w.message) for w in seen]
    said = [r for r in caplog.records if "one call per example" in r.message]
    assert (
        len(said) == 1 and "TransformerDecoder: its examples' attention masks" in said[0].message
    ), said


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_a_transformer_decoder_given_masks_made_alike_runs_under_vmap(monkeypatch, grad):
    """The same decoding with the usual causal mask, which every example makes alike: a
    group's masks are one value, and the decoder's groups run as one call on the
    examples' merged batch (they ran one call per example, then under vmap: see
    ``benchmarks/control_flow.py --only transformer``).  Tokens, logits and gradients
    equal eager (float64)."""
    monkeypatch.setattr(driver, "EAGER_GROUP", 0)
    torch.manual_seed(0)
    model = _TinyTransformer().double().eval()
    g = torch.Generator().manual_seed(2)
    srcs = [torch.randint(1, 7, (4,), generator=g) for _ in range(6)]  # one length
    looped = []
    from fold.autobatch.ops import _Op

    real = _Op._loop

    def spy(self, values):
        looped.append((self.name, len(values[0])))
        return real(self, values)

    monkeypatch.setattr(_Op, "_loop", spy)
    with torch.set_grad_enabled(grad):
        want = [model.greedy(s) for s in srcs]
        got = fold.autobatch(model.greedy, srcs, stack=False)
    assert max(len(w[0]) for w in want) > 3
    assert [g[0].tolist() for g in got] == [w[0].tolist() for w in want]
    assert not [(name, n) for name, n in looped if n > 1], looped
    if grad:
        assert_same_lists([g[1:] for g in got], [w[1:] for w in want], list(model.parameters()))
    else:
        for a, b in zip(got, want):
            torch.testing.assert_close(a[1], b[1])


@pytest.mark.parametrize("cls", [nn.GRU, nn.LSTM, nn.RNN], ids=["gru", "lstm", "rnn"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["time-major", "batch-first"])
@pytest.mark.parametrize("states", [False, True], ids=["no-states", "states"])
@pytest.mark.parametrize("n", [1, 2], ids=["batch-of-1", "batch-of-2"])
def test_recurrent_modules_on_a_batch_of_their_own_run_as_one_call(cls, batch_first, states, n):
    """A recurrent module given a batch of the example's own (``x.view(1, 1, -1)`` and
    states ``(layers, 1, H)``, per-example code written after a batched model): a group of
    such calls runs as ONE call, the examples' batches merged into the module's batch dim
    (vmap has no batching rule for it).  Eager's values and gradients."""
    torch.manual_seed(0)
    rnn = cls(3, 4, num_layers=2, bidirectional=True, batch_first=batch_first)
    lin = nn.Linear(3, 4)
    xs = [torch.randn(5, n, 3) for _ in range(4)]  # each (L, N, D), time-major

    def fn(x):
        x = x.transpose(0, 1) if batch_first else x
        if not states:
            out, h = rnn(torch.tanh(x))
        else:
            h0 = torch.tanh(lin(x.sum(1 if batch_first else 0))).expand(4, n, 4).contiguous()
            out, h = rnn(torch.tanh(x), (h0, h0 * 2) if cls is nn.LSTM else h0)
        hs = torch.cat(h) if isinstance(h, tuple) else h
        return out.sum(1 if batch_first else 0), hs.sum(0)

    assert_same(fn, [*rnn.parameters(), *lin.parameters()], xs)
    (op,) = [op for op in _OPS.values() if op.fn is rnn]
    assert op.mode is common._DIRECT and not op.looped


@pytest.mark.parametrize("cls", [nn.GRUCell, nn.LSTMCell, nn.RNNCell], ids=["gru", "lstm", "rnn"])
@pytest.mark.parametrize("n", [1, 3], ids=["batch-of-1", "batch-of-3"])
def test_cells_on_a_batch_of_their_own_run_as_one_call(cls, n):
    """A recurrent cell given ``(N, D)`` inputs and states per example: one call for the
    group, the batches merged.  Eager's values and gradients over three steps."""
    torch.manual_seed(0)
    cell = cls(3, 4)
    xs = [torch.randn(3, n, 3) for _ in range(4)]

    def fn(x):
        h = torch.zeros(n, 4) + x[0, :, :1]
        state = (h, h * 0.5) if cls is nn.LSTMCell else h
        for t in range(3):
            state = cell(x[t], state)
        return state[0] + state[1] if cls is nn.LSTMCell else state

    assert_same(fn, list(cell.parameters()), xs)
    (op,) = {op for op in _OPS.values() if op.fn is cell and op.args[0].meta.ndim == 2}
    assert op.mode is common._DIRECT and not op.looped


def test_bmm_of_two_per_example_stacks_runs_directly():
    """``torch.bmm(w.unsqueeze(0), mem.unsqueeze(0))``, attention written for a batch of
    one: one batched call for the group.  Eager's values and gradients."""
    q = nn.Linear(3, 3)
    xs = [torch.randn(5, 3) for _ in range(4)]

    def fn(mem):
        w = torch.softmax(mem @ q(mem[0]), 0)
        return torch.bmm(w.view(1, 1, -1), mem.unsqueeze(0)).view(-1)

    assert_same(fn, list(q.parameters()), xs)
    ops = [op for op in _OPS.values() if op.fn is torch.bmm]
    assert ops and all(op.mode is common._DIRECT for op in ops)


def test_dropout_in_eval_mode_is_pure_and_draws_again_in_training(monkeypatch):
    """A module holding a Dropout, in eval mode, draws nothing: its calls are pure (a call
    on a value every example shares is one node, not one variant per example).  Switched
    to training, the same recorded call draws apart per call again."""
    torch.manual_seed(0)
    emb = nn.Embedding(3, 4)
    drop = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).eval()
    fresh = []
    record_fresh = recorder._Recorder._record_fresh
    monkeypatch.setattr(
        recorder._Recorder,
        "_record_fresh",
        lambda self, op, fargs: fresh.append(op) or record_fresh(self, op, fargs),
    )

    def fn(x):
        e = emb(torch.tensor(1))  # one row, one node, for every example
        return drop(e) + x, drop(e * x)

    xs = torch.randn(5, 4)
    params = [*emb.parameters(), *drop.parameters()]
    assert_same(fn, params, xs)
    assert not fresh
    ops = {op for op in _OPS.values() if op.fn is drop}
    assert ops and all(not op.random and op.random_modules == (drop[1],) for op in ops)

    def twice(x):
        return drop(x), drop(x)

    xs = [torch.ones(4) + i for i in range(3)]
    for _ in range(2):  # eval mode: fast table entries for drop, kept with the call's Fold
        a, b = fold.autobatch(twice, xs, per_example=True)
        torch.testing.assert_close(a, b)
    drop.train()
    for _ in range(2):  # the same function: its kept entries look at the mode on every call
        a, b = fold.autobatch(twice, xs, per_example=True)
        assert not torch.equal(a, b)  # two calls on one value: two draws
    a, b = fold.autobatch(lambda x: (drop(x), drop(x)), [torch.ones(4)] * 3)
    assert fresh
    assert not torch.equal(a, b)
    assert not torch.equal(a[0], a[1])  # and one per example


def test_a_seq2seq_of_the_tutorials_style_decodes_batched(caplog):
    """The decoder of PyTorch's seq2seq tutorial, as written there for ONE sentence: a
    module of the user's own holding a GRU on a batch of one (``view(1, 1, -1)``), a
    Dropout (eval mode), attention by ``bmm`` and ``topk``, and a decode loop that reads
    ``topi.item()`` until EOS.  The module is run through (vmap cannot run its GRU), its
    GRU runs one call per group: the same tokens and values as eager decoding, and no
    group runs one call per example."""
    torch.manual_seed(0)
    hidden, vocab, maxlen, eos = 6, 5, 7, 1

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(vocab, hidden)
            self.attn = nn.Linear(2 * hidden, maxlen)
            self.combine = nn.Linear(2 * hidden, hidden)
            self.dropout = nn.Dropout(0.1)
            self.gru = nn.GRU(hidden, hidden)
            self.out = nn.Linear(hidden, vocab)

        def forward(self, tok, h, mem):
            e = self.dropout(self.embedding(tok).view(1, 1, -1))
            w = F.softmax(self.attn(torch.cat((e[0], h[0]), 1)), dim=1)
            applied = torch.bmm(w.unsqueeze(0), mem.unsqueeze(0))
            o = F.relu(self.combine(torch.cat((e[0], applied[0]), 1)).unsqueeze(0))
            o, h = self.gru(o, h)
            return F.log_softmax(self.out(o[0]), dim=1), h

    dec = Decoder().eval()

    def decode(mem):
        h = mem.mean(0).view(1, 1, -1)
        tok, logps, toks = torch.tensor([[0]]), [], []
        for _ in range(maxlen):
            logp, h = dec(tok, h, mem)
            topv, topi = logp.topk(1)
            logps.append(topv.view(1))
            toks.append(topi.item())
            if toks[-1] == eos:
                break
            tok = topi.squeeze().detach()
        return torch.cat(logps), torch.tensor(toks)

    mems = [torch.randn(maxlen, hidden) for _ in range(8)]
    with caplog.at_level("WARNING", logger="fold.autobatch.ops"):
        got = fold.autobatch(decode, mems, stack=False)
    want = [decode(m) for m in mems]
    assert [g[1].tolist() for g in got] == [w[1].tolist() for w in want]
    assert len({len(w[1]) for w in want}) > 1  # examples stop at different steps
    assert_same_lists([g[:1] for g in got], [w[:1] for w in want], list(dec.parameters()))
    assert not any("one call per example" in r.message for r in caplog.records)
    assert not [op for op in _OPS.values() if op.fn is dec]  # run through
    (gru,) = {op for op in _OPS.values() if op.fn is dec.gru}
    assert gru.mode is common._DIRECT


@pytest.mark.parametrize("rnn_cls", [nn.LSTM, nn.GRU], ids=["lstm", "gru"])
@pytest.mark.parametrize("sort", [False, True], ids=["unsorted", "sorted"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["time-major", "batch-first"])
def test_packed_sequences_inside_fn_match_eager(rnn_cls, sort, batch_first):
    """pad_sequence -> pack_padded_sequence -> an RNN -> pad_packed_sequence, per example
    (a character RNN over each word of a sentence): the lengths are known while recording,
    so packing and unpacking record as ops that batch, and examples whose batch sizes agree
    share one packed RNN call."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence, pad_sequence

    torch.manual_seed(0)
    lin = nn.Linear(3, 4)
    rnn = rnn_cls(4, 5, num_layers=2, bidirectional=True, batch_first=batch_first)

    def fn(x, lens):
        lens = sorted(lens, reverse=True) if sort else lens
        seqs = [torch.tanh(lin(x[:n])) for n in lens]
        packed = pack_padded_sequence(
            pad_sequence(seqs, batch_first=batch_first), lens, batch_first, enforce_sorted=sort
        )
        out, h = rnn(packed)
        padded, lengths = pad_packed_sequence(out, batch_first=batch_first, total_length=7)
        last = h[0] if isinstance(h, tuple) else h
        return padded.sum(1 if batch_first else 0), last.sum(0), lengths

    xs = [torch.randn(6, 3) for _ in range(5)]
    lens = [[2, 6, 3], [6, 6, 1], [2, 6, 3], [4, 5, 6], [2, 6, 3]]
    got = assert_same(fn, [*lin.parameters(), *rnn.parameters()], xs, lens)
    assert got[2].dtype == torch.long
    # Lengths that are recorded values are refused, naming the fix.
    with pytest.raises(fold.FoldError, match="recorded values.*Fix"):
        fold.autobatch(
            lambda x: pack_padded_sequence(lin(x)[:, None], lin(x)[0].argmax().reshape(1) + 1),
            xs,
        )


# ------------------------------------------------ data-dependent control flow (issue 32)
EOS, MAX_STEPS = 0, 7


class Decoder(nn.Module):
    """A tiny greedy decoder written for ONE example: it stops at EOS, or after MAX_STEPS."""

    def __init__(self, vocab: int = 5, hidden: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.cell = nn.GRUCell(hidden, hidden)
        self.proj = nn.Linear(hidden, vocab)

    def decode(self, src: torch.Tensor, log: list | None = None):
        h = torch.tanh(src)
        tok, logits = 1, []
        for _ in range(MAX_STEPS):
            h = self.cell(self.embed(torch.tensor(tok)), h)
            out = self.proj(h)
            logits.append(out)
            tok = int(out.argmax())  # a read: this example pauses here
            if log is not None:
                log.append(tok)
            if tok == EOS:
                break
        return torch.stack(logits)


@pytest.fixture(params=["batched-rounds", "eager-finish"])
def finish(request, monkeypatch):
    """Tests of reads run twice: every round batched (``EAGER_GROUP`` 0), and as autobatch
    runs by default, where the examples finish as eager code once a round's groups are
    small (here, with a few examples, after the first round)."""
    from fold.autobatch import driver

    if request.param == "batched-rounds":
        monkeypatch.setattr(driver, "EAGER_GROUP", 0)
    return request.param


def _sources(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, generator=g) * 3 for _ in range(n)]


def _eager_decodes(model: Decoder, srcs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
    logs: list = []
    outs = []
    for s in srcs:
        log: list = []
        outs.append(model.decode(s, log))
        logs.append(log)
    return outs, logs


def test_greedy_decoding_until_eos_matches_eager_with_its_own_lengths(monkeypatch, finish):
    """Each example decodes until it emits EOS: the decisions, the logits (stack=False: each
    its own length) and the gradients equal eager; with every round batched, the rounds are
    the most reads any one example makes, not their sum; by default the last examples
    finish as eager code, once a round's groups hold fewer than EAGER_GROUP nodes."""
    from fold.autobatch import driver

    torch.manual_seed(3)
    model = Decoder()
    srcs = _sources(12)
    want, want_logs = _eager_decodes(model, srcs)
    assert len({len(w) for w in want}) > 1  # lengths differ: EOS-driven
    rounds = []
    run_round = driver._Session.run_round
    monkeypatch.setattr(
        driver._Session, "run_round", lambda self: rounds.append(1) or run_round(self)
    )
    logs: list = [[] for _ in srcs]
    got = fold.autobatch(lambda s, log: model.decode(s, log), srcs, logs, stack=False)
    assert logs == want_logs
    if finish == "batched-rounds":
        assert len(rounds) == max(len(w) for w in want) < sum(len(w) for w in want)
    else:  # the last examples finished as eager code: fewer rounds
        assert len(rounds) < max(len(w) for w in want)
    assert isinstance(got, list) and [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    params = list(model.parameters())
    weights = [torch.randn_like(w) for w in want]
    gg = torch.autograd.grad(sum((a * b).sum() for a, b in zip(got, weights)), params)
    gw = torch.autograd.grad(sum((a * b).sum() for a, b in zip(want, weights)), params)
    for a, b in zip(gg, gw):
        torch.testing.assert_close(a, b)


class _AttentionDecoder(nn.Module):
    """A GRU encoder over each source (its own length) and a dot-attention GRU decoder,
    greedy until EOS: the shapes a seq2seq decoder makes (see benchmarks/control_flow.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 8)
        self.enc = nn.GRU(8, 8)
        self.dec = nn.GRUCell(16, 8)
        self.out = nn.Linear(16, 6)
        with torch.no_grad():  # EOS (0) after varied numbers of steps
            self.out.bias[0] += 0.2

    def greedy(self, src: torch.Tensor) -> torch.Tensor:
        mem, h = self.enc(self.embed(src))
        h, ctx, toks = h[0], mem.mean(0), []
        tok = 1
        for _ in range(8):
            h = self.dec(torch.cat([self.embed(torch.tensor(tok)), ctx]), h)
            ctx = torch.softmax(mem @ h, 0) @ mem
            tok = int(self.out(torch.cat([h, ctx])).argmax())
            toks.append(tok)
            if tok == 0:
                break
        return torch.tensor(toks)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_attention_decoding_under_no_grad_and_inference_mode_matches_eager(mode, finish):
    """Greedy decoding of sources of several lengths under torch.no_grad() and
    torch.inference_mode(): the encoder packed, the attention padded, every round's reads
    resumed; the tokens equal eager decoding (float64)."""
    torch.manual_seed(0)
    model = _AttentionDecoder().double()
    g = torch.Generator().manual_seed(0)
    srcs = [
        torch.randint(1, 6, (int(n),), generator=g) for n in torch.randint(2, 9, (12,), generator=g)
    ]
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with context():
        want = [model.greedy(s) for s in srcs]
        got = fold.autobatch(lambda s: model.greedy(s), srcs, stack=False)
    assert len({len(w) for w in want}) > 4  # EOS-driven lengths
    assert [g.tolist() for g in got] == [w.tolist() for w in want]


@pytest.mark.parametrize("grad", [False, True])
def test_softmax_weights_past_their_lengths_are_zero_to_their_readers(grad, monkeypatch):
    """Attention over memories of several lengths, its weights (one padded softmax) read by
    a product with the memory, a sum and a positionwise op: values (and, with gradients,
    gradients) equal eager's (float64).  Outside autograd the softmax's output is marked
    zero past each length (the product takes it as it is); under autograd it is not (the
    fill keeps a later op's nan off the padding's gradient)."""
    from fold.autobatch import ops

    marks = []
    real = ops._Op._ragged_run

    def spy(self, values):  # the zero marks of a whole padded group's outputs
        out = real(self, values)
        marks.extend((self.name.split(" ")[0], x.zero) for x in out or () if type(x) is PaddedRows)
        return out

    monkeypatch.setattr(ops._Op, "_ragged_run", spy)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, 5, generator=g, dtype=torch.float64) for n in (3, 7, 1, 5, 7, 2)]
    enc = nn.Linear(5, 5).double()
    q = torch.randn(5, generator=g, dtype=torch.float64)

    def fn(x):
        mem = torch.tanh(enc(x))
        weights = torch.softmax(mem @ q, 0)
        return weights @ mem, (weights * 3 + 1).sum(), weights.sqrt().sum()

    with torch.set_grad_enabled(grad):
        want = [fn(x) for x in xs]
        got = fold.autobatch(fn, xs, stack=False)
    for a, b in zip(got, want):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    assert ("torch.softmax", not grad) in marks
    assert ("torch.softmax", grad) not in marks
    if grad:
        params = list(enc.parameters())
        gg = torch.autograd.grad(sum(sum(x.sum() for x in a) for a in got), params)
        gw = torch.autograd.grad(sum(sum(x.sum() for x in a) for a in want), params)
        for a, b in zip(gg, gw):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


class _LogitDecoder(_AttentionDecoder):
    """``_AttentionDecoder`` returning its logits (differentiable) where it stops at EOS."""

    def logits(self, src: torch.Tensor) -> torch.Tensor:
        mem, h = self.enc(self.embed(src))
        h, ctx, out = h[0], mem.mean(0), []
        tok = 1
        for _ in range(8):
            h = self.dec(torch.cat([self.embed(torch.tensor(tok)), ctx]), h)
            ctx = torch.softmax(mem @ h, 0) @ mem
            logit = self.out(torch.cat([h, ctx]))
            out.append(logit)
            tok = int(logit.argmax())
            if tok == 0:
                break
        return torch.stack(out)


@pytest.mark.parametrize("grad", [False, True])
def test_memories_of_examples_still_decoding_are_found_from_the_round_before(grad, monkeypatch):
    """A decoder's memories read by every round (views of one padded encoder output): after
    some examples stop, the others' views are found among the last round's (``ops._rows_kept``),
    not checked view by view again; every round batched, the logits (and, with gradients,
    gradients) equal eager's (float64)."""
    from fold import ops as fold_ops
    from fold.autobatch import driver

    monkeypatch.setattr(driver, "EAGER_GROUP", 0)
    found = []
    real = fold_ops._rows_kept

    def spy(key, kept):
        got = real(key, kept)
        found.append(got is not None)
        return got

    monkeypatch.setattr(fold_ops, "_rows_kept", spy)
    torch.manual_seed(0)
    model = _LogitDecoder().double()
    g = torch.Generator().manual_seed(0)
    srcs = [
        torch.randint(1, 6, (int(n),), generator=g) for n in torch.randint(2, 9, (12,), generator=g)
    ]
    with torch.set_grad_enabled(grad):
        want = [model.logits(s) for s in srcs]
        got = fold.autobatch(lambda s: model.logits(s), srcs, stack=False)
    assert len({len(w) for w in want}) > 4  # EOS-driven lengths
    assert any(found)
    if grad:
        assert_same_lists([(x,) for x in got], [(w,) for w in want], list(model.parameters()))
    else:
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _stack_rows(enc_lin, x):
    """A parser's features: rows of an earlier round's encoding, picked by read values."""
    enc = torch.tanh(enc_lin(x))  # (n, 4)
    picked, i = [], 0
    for _ in range(4):
        f = torch.cat([enc[i], enc[0] * 0, enc.mean(0)])  # methods of an earlier value
        i = int(f.argmax()) % len(enc)
        picked.append(i)
    return torch.tensor(picked)


def _masked_choices(enc_lin, x):
    """An eager mask made in the function, used by a recorded call, then changed in place
    before the call's round runs (eager code read it as it was at the call)."""
    mask = torch.zeros(4, dtype=torch.float64)
    h, out = x[0], []
    for _ in range(3):
        scores = enc_lin(h) + mask
        mask[len(out)] = float("-inf")
        t = int(scores.argmax())
        out.append(t)
        h = torch.tanh(enc_lin(h))
    return torch.tensor(out)


@pytest.mark.parametrize("program", [_stack_rows, _masked_choices])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_reads_under_inference_mode_take_values_without_version_counters(mode, program, finish):
    """Under torch.inference_mode() every tensor is an inference tensor, which has no
    version counter: rows of earlier rounds that methods are memoised on, eager tensors a
    recorded call takes, and the tensor autobatch iterates over (made in inference mode)
    give the eager tokens, as under torch.no_grad() (float64)."""
    torch.manual_seed(3)
    lin = nn.Linear(4, 4).double()
    with torch.inference_mode():
        xs = torch.randn(6, 5, 4, dtype=torch.float64)  # an inference tensor, iterated over
    if mode == "no_grad":
        xs = xs.clone()
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    if mode == "no_grad" and program is _masked_choices:
        # (a tensor with a version counter, changed after a call took it: refused)
        with context(), pytest.raises(fold.FoldError, match="changed in place after a recorded"):
            fold.autobatch(lambda x: program(lin, x), xs, stack=False)
        return
    with context():
        want = [program(lin, x) for x in xs]
        got = fold.autobatch(lambda x: program(lin, x), xs, stack=False)
    assert len({tuple(w.tolist()) for w in want}) > 1
    assert [g.tolist() for g in got] == [w.tolist() for w in want]


def test_examples_without_reads_mix_with_ones_that_read_and_results_stack(finish):
    """Some examples read, some never do, one stops at its first step: stacked results
    (one shape) equal eager, and so does every example alone (batch invariance)."""
    torch.manual_seed(1)
    lin = nn.Linear(4, 4)

    def fn(x, k):
        h = torch.tanh(lin(x))
        steps = 0
        while k and steps < 5 and float(h.sum()) > -10:  # k == 0: never reads
            h = torch.tanh(lin(h)) * 0.9
            steps += 1
            if steps == k:
                break
        return h, torch.tensor(steps)

    xs, ks = [torch.randn(4) for _ in range(6)], [0, 1, 3, 0, 5, 2]
    warnings.filterwarnings("ignore", "Converting a tensor with requires_grad")  # as eager
    got = assert_same(fn, list(lin.parameters()), xs, ks)
    for i in range(len(xs)):
        alone = fold.autobatch(fn, [xs[i]], [ks[i]])
        torch.testing.assert_close(alone[0][0], got[0][i])
        torch.testing.assert_close(alone[1][0], got[1][i])


def test_rounds_record_into_one_fold_and_an_op_takes_nodes_and_earlier_rows(finish, monkeypatch):
    """Every round of a call records into one Fold, emptied between rounds (its recorders and
    fast tables kept), and one module takes, in the same round, a value of this round (a
    node) and one of an earlier round (a literal row): the C fast key files the two calls
    apart. Values and gradients equal eager (float64), and so does each example alone."""
    torch.manual_seed(5)
    lin = nn.Linear(3, 3).double()

    def fn(x, k):
        h = torch.tanh(lin(x))
        for _ in range(k):
            a = lin(h)  # h: made in an earlier round after the first read (a row)
            h = torch.tanh(lin(a) + a)  # a: of this round (a node), through the same module
            if float(h.detach().sum()) > 50:  # a read: the example pauses, a round runs
                break
        return h

    made = []
    init = fold.Fold.__init__
    monkeypatch.setattr(fold.Fold, "__init__", lambda self, *a: made.append(1) or init(self, *a))
    monkeypatch.setattr(driver, "_POOL", {})  # (no Fold kept from an earlier call)
    xs, ks = [torch.randn(3, dtype=torch.float64) for _ in range(9)], [4, 1, 3, 0, 4, 2, 4, 3, 1]
    got = assert_same(fn, list(lin.parameters()), xs, ks)
    assert len(made) == 1  # the first call: one Fold for all its rounds; the next ones reuse it
    for i in (0, 3, 5):
        torch.testing.assert_close(fold.autobatch(fn, [xs[i]], [ks[i]])[0], got[i])


def test_a_call_that_returned_gives_its_fold_and_fast_tables_to_the_next_call(finish, monkeypatch):
    """A call that returned keeps its Fold, emptied, with its fast tables for the next call:
    that call makes no Fold, and where its calls were seen before (the same lengths) none
    takes the slow path. Memories of other lengths are new keys in the kept tables. Values
    and gradients equal eager (float64) in every call. A call that raised gives nothing
    back; another function keeps a Fold of its own; clear_cache empties what is kept."""
    torch.manual_seed(7)
    lin = nn.Linear(3, 3).double()

    def fn(mem, k):  # mem: (L, 3), a memory of its own length; k reads at most
        h = torch.tanh(mem.mean(0))
        for _ in range(abs(k)):
            w = torch.softmax(mem @ lin(h), 0)
            h = torch.tanh(lin(h) + w @ mem)
            if float(h.detach().sum()) > 50:
                break
        if k < 0:
            raise ValueError("boom")
        return h

    def mems(lengths):
        return [torch.randn(n, 3, dtype=torch.float64) for n in lengths]

    def kept():
        return sum(map(len, driver._POOL.values()))

    made, slow = [], []
    init, record = fold.Fold.__init__, recorder._Recorder._record
    monkeypatch.setattr(fold.Fold, "__init__", lambda self, *a: made.append(1) or init(self, *a))
    monkeypatch.setattr(
        recorder._Recorder, "_record", lambda self, *a: slow.append(a[0]) or record(self, *a)
    )
    monkeypatch.setattr(driver, "_POOL", {})
    params = list(lin.parameters())
    xs, ks = mems([2, 5, 3, 5, 4]), [3, 1, 0, 2, 3]
    assert_same(fn, params, xs, ks)
    assert len(made) == 1 and kept() == 1
    first, slow[:] = list(slow), []
    made.clear()
    assert_same(fn, params, mems([5, 2, 4, 3, 2]), [2, 3, 3, 1, 0])  # lengths seen before
    assert not made
    if common._C is not None and finish == "batched-rounds":
        # Calls on lazy values only took the slow path in the first call, never in the
        # next; those on an example's own tensor (``mem @ ...``: it is the example's data,
        # so it has no fast key) take it in every call.
        lazy_only = {lin, torch.tanh}
        assert lazy_only & set(first) and not lazy_only & set(slow), (first, slow)
    assert_same(fn, params, mems([7, 1, 6]), [3, 2, 1])  # new lengths: new entries
    assert not made and kept() == 1

    other = lambda mem, k: fn(mem, k) * 2  # noqa: E731  (another function: a Fold of its own)
    assert_same(other, params, xs, ks)
    assert len(made) == 1 and kept() == 2
    with pytest.raises(ValueError, match="boom"):
        fold.autobatch(fn, mems([2, 6]), [1, -1])
    assert kept() == 1  # the Fold the failed call took is not given back
    made.clear()
    assert_same(fn, params, xs, ks)
    assert len(made) == 1 and kept() == 2
    driver.clear_cache()
    assert kept() == 0


def test_reads_under_no_grad_and_results_of_different_shapes_name_the_example(finish):
    torch.manual_seed(3)
    model = Decoder()
    srcs = _sources(12)
    want, _ = _eager_decodes(model, srcs)
    with torch.no_grad():
        got = fold.autobatch(lambda s: model.decode(s), srcs, stack=False)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
        assert not g.requires_grad
    lengths = [len(w) for w in want]
    first_other = next(i for i, n in enumerate(lengths) if n != lengths[0])
    with pytest.raises(fold.FoldError, match=rf"example {first_other} returned"):
        fold.autobatch(lambda s: model.decode(s), srcs)


def test_a_read_in_a_batchable_body_stays_an_error_and_an_exception_ends_the_call():
    lin = nn.Linear(3, 3)

    @fold.batchable
    def gate(h):
        return h * 2 if float(h.sum()) > 0 else h  # runs batched: use torch.where

    with pytest.raises(fold.FoldError, match=r"torch\.where"):
        fold.autobatch(lambda x: gate(lin(x)), [torch.randn(3) for _ in range(3)])

    def fails(x, i):
        y = lin(x)
        if float(y.detach().sum()) > -1e9 and i == 2:
            raise KeyError("example two (not example 21)")  # a note names example 2 still
        return y

    with pytest.raises(KeyError, match="example two") as info:
        fold.autobatch(fails, [torch.randn(3) for _ in range(4)], [0, 1, 2, 3])
    if sys.version_info >= (3, 11):  # the example that raised, in a note (add_note)
        assert info.value.__notes__ == ["autobatch: raised while running example 2"]
    # Nothing of that call stays: the next one runs.
    out = fold.autobatch(lambda x: lin(x) * float(lin(x).sum() > 0), [torch.randn(3)] * 2)
    assert out.shape == (2, 3)


@pytest.mark.parametrize("rounds", [1, 2], ids=["first-round", "later-round"])
def test_a_batched_call_that_fails_for_one_examples_values_names_that_example(monkeypatch, rounds):
    """One example looks up a row past an embedding's end: its round's batched call fails
    for every example at once (torch names no row).  The FoldError names the example whose
    call fails alone on its values, and its error; the call is no bare IndexError from
    torch.  Other examples' calls come first and after it in the group."""
    monkeypatch.setattr(driver, "EAGER_GROUP", 0)  # every round batched
    emb, lin = nn.Embedding(5, 3), nn.Linear(3, 3)

    def fn(i):
        h = lin(emb(i if rounds == 1 else i % 5))
        if rounds == 2 and float(h.sum()) > -1e9:  # a read: the lookup below is round 2's
            h = h + emb(i)
        return h

    ids = [torch.tensor(k) for k in (1, 3, 2, 7, 0)]  # example 3's 7 is past the end
    with pytest.raises(fold.FoldError) as info:
        fold.autobatch(fn, ids, stack=False)
    said = str(info.value)
    assert said.startswith("autobatch: example 3: its call of Embedding call"), said
    assert "IndexError: index out of range" in said and "Fix:" in said


def test_an_exception_propagates_though_others_are_paused_inside_torch(finish):
    """One example raises while others are paused inside torch's C code (``t.view(n, -1)``
    of a recorded count: torch's argument parser reads ``n``).  Ending those examples,
    torch takes the exit for "not an index" and goes on, and the example fails to read: what
    it raised replaced the first error (a FoldError naming the wrong example).  The first
    error propagates, with its note, and the grad mode is the caller's."""
    lin = nn.Linear(3, 6)
    table = torch.arange(12.0).reshape(4, 3)

    def fn(x, i):
        h = lin(x)
        if i == 4:
            raise KeyError("four")
        n = (h[:2] > 0).long().sum().clamp(min=1) + 1
        with torch.no_grad():
            return table.view(n, -1).sum() * h

    with pytest.raises(KeyError, match="four") as info:
        fold.autobatch(fn, [torch.randn(3) for _ in range(6)], list(range(6)))
    if sys.version_info >= (3, 11):
        assert info.value.__notes__ == ["autobatch: raised while running example 4"]
    assert torch.is_grad_enabled()


def test_a_read_inside_the_functions_own_greenlet_names_the_fix():
    """A read inside a greenlet the function started itself cannot pause the example (only
    the example's own coroutine can): a FoldError naming that, not the generic fix."""
    greenlet = pytest.importorskip("greenlet")
    lin = nn.Linear(3, 3)

    def fn(x):
        inner = greenlet.greenlet(lambda: lin(x) * 3 if float(lin(x)[0]) > 0 else lin(x))
        return inner.switch()

    with pytest.raises(fold.FoldError, match=r"example 0: float\(\).*greenlet.*read outside"):
        fold.autobatch(fn, [torch.randn(3) for _ in range(3)])


@pytest.mark.parametrize("order", ["second", "first"])
def test_autograd_grad_inside_the_function_is_a_read_and_equals_eager(order, finish):
    """``torch.autograd.grad(loss, params, create_graph=True)`` inside the function (a MAML
    inner step: the model adapted to the example, then its loss) is a read: the example
    pauses until its loss is computed, then torch's grad runs on its row (the round's graph
    kept for the other examples).  Values and gradients, second order through the adapted
    weights too, equal eager (float64); first order alike.  (It was a FoldError of shape
    inference: "element 0 of tensors does not require grad".)"""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3).double()
    params = list(lin.parameters())

    def fn(x, y):
        loss = (torch.tanh(lin(x)) - y).pow(2).sum()
        gw, gb = torch.autograd.grad(loss, (lin.weight, lin.bias), create_graph=order == "second")
        w, b = lin.weight - 0.1 * gw, lin.bias - 0.1 * gb
        return (torch.tanh(F.linear(x, w, b)) - y).pow(2).sum()  # the adapted model's loss

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    ys = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    assert_same(fn, params, xs, ys)


def test_a_gradient_penalty_with_respect_to_the_input_equals_eager(finish):
    """A gradient penalty (WGAN-GP's): the example's input made to require a gradient, the
    critic's output differentiated with respect to it inside the function with
    ``create_graph``, its norm penalised.  Values and the critic's gradients equal eager's
    (float64)."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).double()

    def fn(x):
        x = x.clone().requires_grad_(True)
        out = critic(x).sum()
        (g,) = torch.autograd.grad(out, x, create_graph=True)
        return (g.norm() - 1) ** 2 + out

    assert_same(
        fn, list(critic.parameters()), [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    )


def test_autograd_grad_with_respect_to_a_lazy_value_names_the_fix():
    """Gradients with respect to a recorded value (a row of a group's output): a FoldError
    naming the example and the fix."""
    lin = nn.Linear(3, 3)

    def fn(x):
        h = lin(x)
        (g,) = torch.autograd.grad(h.pow(2).sum(), h)
        return g

    with pytest.raises(
        fold.FoldError, match=r"example 0: torch\.autograd\.grad with respect.*Fix:"
    ):
        fold.autobatch(fn, [torch.randn(3) for _ in range(3)])


@pytest.mark.parametrize("call", ["register_hook", "retain_grad"])
def test_gradient_hooks_on_a_lazy_value_name_the_fix(call):
    """``h.register_hook(fn)`` and ``h.retain_grad()`` on a recorded value: a FoldError naming
    the example and the fix (before, shape inference ran them on zeros without gradients
    and reported torch's "doesn't require gradient")."""
    lin = nn.Linear(3, 3)

    def fn(x):
        h = lin(x)
        if call == "register_hook":
            h.register_hook(lambda g: g * 2)
        else:
            h.retain_grad()
        return torch.tanh(h)

    with pytest.raises(fold.FoldError, match=rf"example 0: \.{call}\(\).*Fix: "):
        fold.autobatch(fn, [torch.randn(3) for _ in range(3)], per_example=True)


def test_a_round_runs_modules_made_of_modules(finish):
    """A module whose forward calls submodules, recorded as one call and run in a round:
    its submodules run, they do not record (the round runs with recording off)."""
    torch.manual_seed(4)
    mlp = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3))

    def fn(x):
        h = x
        for _ in range(4):
            h = mlp(h)
            if float(h.detach().sum()) > 1.0:  # a read after a nested module's call
                h = h * 0.5
        return h

    assert_same(fn, list(mlp.parameters()), [torch.randn(3) for _ in range(5)])


# The settings of the random-program tests (each runs under both `finish` modes).
_PROGRAMS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def step_programs(steps: int, arg: tuple[int, int], length: int, examples: int, min_steps=0):
    """Per example a list of (step, argument) pairs: a step in ``0..steps``, an argument in
    ``arg`` (inclusive), ``min_steps`` to ``length`` of them; 1 to ``examples`` examples."""
    pair = st.tuples(st.integers(0, steps), st.integers(*arg))
    return st.lists(
        st.lists(pair, min_size=min_steps, max_size=length), min_size=1, max_size=examples
    )


@st.composite
def read_programs(draw):
    """Per example: a list of steps, each a layer to apply and whether to read (and branch
    on) the value after it."""
    n = draw(st.integers(1, 5))
    return [
        [(draw(st.integers(0, 2)), draw(st.booleans())) for _ in range(draw(st.integers(0, 4)))]
        for _ in range(n)
    ]


@_PROGRAMS
@given(read_programs())
def test_random_programs_with_reads_match_eager(finish, programs):
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(3, 3) for _ in range(3)])

    def fn(x, program):
        h = torch.tanh(layers[0](x))
        for layer, read in program:
            h = torch.tanh(layers[layer](h))
            if read and float(h[0].detach()) > 0:  # a decision on the value
                h = -h
        return h

    xs = [torch.randn(3) for _ in programs]
    assert_same(fn, list(layers.parameters()), xs, programs)


@_PROGRAMS
@given(st.lists(st.lists(st.integers(0, 5), max_size=5), min_size=1, max_size=6))
def test_random_programs_with_data_shaped_calls_match_eager(finish, programs):
    """Random programs mixing a layer, a decision on a value, a boolean-mask selection, a
    size given by a recorded count, a custom autograd.Function and a known accumulator
    changed in place: values and gradients equal eager (float64), whichever examples take
    which steps (each data-shaped call a read of its own)."""
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(3, 3) for _ in range(2)])

    def fn(x, program):
        h = torch.tanh(layers[0](x))
        acc = torch.tensor([0.0, 0.0, 0.0])
        for step in program:
            if step == 0:
                h = torch.tanh(layers[1](h))
            elif step == 1 and float(h.sum().detach()) > 0:
                h = h * 0.5
            elif step == 2:
                h = h + h[h > 0].sum()
            elif step == 3:
                n = (h > 0).long().sum() + 1  # 1 to 4
                h = h + torch.ones(n, 3).sum(0) * 0.1 + h.repeat(n)[:3]
            elif step == 4:
                h = _StraightThrough.apply(h) * h + h
            else:
                acc += 1.0
        return h * acc.sum()

    xs = [torch.randn(3) for _ in programs]
    assert_same(fn, list(layers.parameters()), xs, programs)


@_PROGRAMS
@given(step_programs(8, (0, 2), 7, 5))
def test_random_programs_changing_recorded_values_in_place_match_eager(finish, programs):
    """Random programs that change recorded values in place (methods, ``h[i] = v``,
    ``h[i] += v``, ``+=``, torch's in-place functions), keep them in a list first (which
    must see the changes), take views used and dropped, and read and decide (after which the
    value is copied before it changes, as autobatch asks): values and gradients equal eager
    (float64), whichever examples take which steps."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)

    def fn(x, program):
        h = torch.sin(lin(x))
        kept = []
        for step, i in program:
            if step == 0:
                h = torch.sin(lin(h))  # a new value
            elif step == 1:
                h.mul_(0.5).add_(x)
            elif step == 2:
                h[i] = h[(i + 1) % 3] * 2  # (the view on the right is dropped first)
            elif step == 3:
                h[i] += x[i]
            elif step == 4:
                kept.append(h)  # the list holds h itself: later changes show in it
            elif step == 5:
                h += 1.0
            elif step == 6:
                h.masked_fill_(x > 0.5, 0.25)
            elif step == 7:
                y = h[i:].sum()  # a view used and dropped
                torch.neg_(h)
                h = h + y
            else:  # a read that decides; h is a copy after (a value of an earlier round)
                h = -h.clone() if float(h.detach().sum()) > 0 else h.clone()
        return h + sum(kept, torch.zeros(3))

    xs = [torch.randn(3) for _ in programs]
    assert_same(fn, list(lin.parameters()), xs, programs)


@_PROGRAMS
@given(step_programs(8, (0, 2), 7, 4))
def test_random_in_place_changes_with_views_held_are_eager_or_refused(finish, programs):
    """Random programs that keep views of a value (a slice, ``view``, ``detach``, a view of a
    view, ``split``'s parts) and change the value or the views in place, reading them after:
    autobatch either gives eager's values and gradients (float64) or refuses with the
    FoldError of an in-place change it cannot follow; never a result that differs silently.
    Programs with no view held when a change comes must run."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)

    def fn(x, program):  # (its step 8: read the views and let them go)
        return _view_program(lin, x, [(10 if s == 8 else s, i) for s, i in program])

    xs = [torch.randn(3) for _ in programs]
    try:
        assert_same(fn, list(lin.parameters()), xs, programs)
    except fold.FoldError as err:
        assert re.search(r"in-place .* on a lazy value (that is a view|while a view)", str(err))
        assert any(  # refused only where a change met a view held (or made on a view)
            any(s in (0, 1, 2, 3, 7) for s, _ in p) and any(s in (4, 5, 6) for s, _ in p)
            for p in programs
        ), (programs, err)


def _view_program(lin, x, program):
    """The program of the random in-place tests below on one example: each (step, i) takes
    a view of the value (0-3, 7), changes the value or a view in place (4-6, 8), reads the
    value (9), or reads the views and lets them go (10)."""
    h = torch.sin(lin(x))
    views = []
    out = torch.zeros(3)
    for step, i in program:
        if step == 0:
            views.append(h[i:])
        elif step == 1:
            views.append(h.view(3, 1)[:, 0])
        elif step == 2:
            views.append(h.detach())
        elif step == 3 and views:
            views.append(views[-1][:1])  # a view of a view
        elif step == 4:
            h.mul_(0.5)
        elif step == 5 and views:
            views[i % len(views)].add_(1.0)
        elif step == 6:
            h[i] = x[i]
        elif step == 7:
            views.extend(torch.split(h, 2))  # views of several outputs
        elif step == 8 and views:
            v = views[i % len(views)]
            v += 1.0  # (on the view: eager code changes h too)
        elif step == 9:  # a read: h and its views are values of an earlier round after
            out = out * (2.0 if float(h.detach()[i]) > 0 else -1.0)
        elif step == 10:
            out = out + sum(v.sum() for v in views) + h  # read them all
            views = []  # (dropped: changes after this may run)
    return out + h + sum((v.sum() for v in views), torch.zeros(()))


def _views_held_when_changed(program):
    """Whether a program of the test below changes its value, or a view of it, in place while
    it holds a view (the only place autobatch may refuse it)."""
    held = 0
    for step, _ in program:
        if step in (0, 1, 2) or (step == 3 and held):
            held += 1
        elif step == 7:
            held += 2
        elif step in (4, 6) or (step in (5, 8) and held):
            if held:
                return True
        elif step == 10:
            held = 0
    return False


@_PROGRAMS
@given(step_programs(10, (0, 2), 9, 4))
def test_random_in_place_changes_across_reads_with_views_are_eager_or_refused(finish, programs):
    """Random programs that keep views of a value (a slice, ``view``, ``detach``, a view of a
    view, ``split``'s parts), change the value or the views in place (methods, ``h[i] = v``,
    ``+=`` on a view), and read the value between (so that the value and its views are of an
    earlier round when they change): autobatch gives eager's values and gradients (float64),
    or refuses with the FoldError of an in-place change it cannot follow, and only where a
    view is held when a change comes; never a result that differs silently (``v += 1`` of a
    view, rebound on the name where it could not change in place, was one: the value it
    views kept its old value)."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)

    def fn(x, program):
        return _view_program(lin, x, program)

    xs = [torch.randn(3) for _ in programs]
    try:
        for x, program in zip(xs, programs):
            fn(x, program)
    except RuntimeError:  # (a view of split's changed in place: eager code refuses)
        with pytest.raises((fold.FoldError, RuntimeError)):
            fold.autobatch(fn, xs, programs)
        return
    try:
        assert_same(fn, list(lin.parameters()), xs, programs)
    except fold.FoldError as err:
        assert re.search(r"in-place .* on a lazy value .*(view|shares memory)", str(err)), err
        assert any(_views_held_when_changed(p) for p in programs), (programs, err)


def _add_through_a_row(buf, row, h):
    """``view = buf[row]; view += h``, the view let go when the step ends."""
    view = buf[row]
    view += h
    return h + view


def test_a_view_held_from_an_eager_write_refuses_a_later_recorded_write(monkeypatch):
    """After a read, a value of an earlier round written through a view of the example's
    buffer is computed at once (eager); the view, a plain tensor, is still held when a value
    of the round recording is written into the buffer: that write is recorded out of place,
    which the held view would not see, so it is refused with the FoldError naming a view
    taken before the write (found by the random-programs test of buffers, where it failed
    now and then)."""
    monkeypatch.setattr(driver, "EAGER_GROUP", 0)
    lin = nn.Linear(3, 3)

    def fn(x):
        buf = torch.zeros(4, 3)
        h = torch.tanh(lin(x))
        if float(h.detach().sum()) > 1e9:  # a read: h is a value of an earlier round
            h = -h
        view = buf[1]
        view += h  # computed at once
        buf[0] = torch.tanh(lin(h))  # a value of this round: recorded
        return buf, view

    with pytest.raises(fold.FoldError, match=r"example 0: Tensor\.__setitem__ .*view taken"):
        fold.autobatch(fn, [torch.randn(3) for _ in range(2)])


def test_a_view_of_a_tensor_with_a_history_given_to_a_call_is_its_value_then(finish):
    """A recorded call given a view of an eager tensor that has a gradient history (a
    buffer written with a value of an earlier round, computed at once) reads the view's
    value at the call, as eager code does, though the tensor changes in place before the
    call's round runs: values and gradients equal eager (float64).  (The view was held as
    it was, so the call read the later value: a silent wrong answer.)"""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)

    def fn(x):
        h = torch.tanh(lin(x))
        if float(h.detach().sum()) > -1e9:  # a read: h is a value of an earlier round
            h = h * 1.0
        buf = torch.zeros(4, 3)
        buf[0] = h  # computed at once: buf has a gradient history
        y = lin(x) + buf[0]  # recorded, given a view of buf
        buf[0] = h * 3.0  # changed in place before y's round runs
        return y, buf

    assert_same(fn, list(lin.parameters()), [torch.randn(3) for _ in range(3)])


@_PROGRAMS
@given(step_programs(12, (0, 3), 6, 5))
# (example 1's first read is false: torch.where of an earlier round's value runs at once, the
# buffer gets a gradient history by an eager write, a recorded call then takes a view of it;
# the view was held until its round, so the recorded write after it was refused)
@example(programs=[[(5, 0), (0, 0), (5, 0), (11, 0), (0, 0)]] * 2)
def test_random_programs_writing_buffers_match_eager(finish, programs):
    """Random programs that fill a buffer they made (``torch.zeros(4, 3)``) with recorded
    rows, by assignment, ``+=``, a write through a view kept, ``add_`` of the whole, a row of
    numbers, interleaved with reads that decide and with uses of the buffer (a matmul over
    it, a row of it, a torch function given a recorded value first and a view of the buffer
    after it, ``buf.unsqueeze(0)`` made again at every use): values and gradients equal
    eager (float64), whichever examples write
    where and when, and the buffer returned is its value.  (The view written through dies
    with its step: a plain view still held when a recorded value is later written into
    its buffer is refused, since it would not see the write; see
    ``test_a_view_held_from_an_eager_write_refuses_a_later_recorded_write``.)"""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)

    def fn(x, program):
        buf = torch.zeros(4, 3)
        h = torch.tanh(lin(x))
        for step, row in program:
            if step == 0:
                buf[row] = h
            elif step == 1:
                buf[row] += h * 0.5
            elif step == 2:
                h = _add_through_a_row(buf, row, h)
            elif step == 3:
                buf.add_(h)
            elif step == 4:
                buf[row] = 1.5
            elif step == 5 and float(h.detach().sum()) > 0:  # a read that decides
                h = torch.tanh(lin(h + buf[row]))
            elif step == 6:  # (a clone: a product saves its operand, which later writes change)
                h = torch.tanh(buf.clone() @ h)[:3] + h
            elif step == 7:
                buf[row].mul_(0.5)  # a method of a part
            elif step == 8:
                buf.T[row % 3].add_(h[0])  # a part of a view
            elif step == 9:
                part = buf[1:3]
                part[row % 2] = h * 2  # a slice kept, written
                h = h + part.sum(0)
                # (let go with its step: held, a recorded write into buf later would be
                # refused, as a view it could not follow; where h was computed at once,
                # torch.where of an earlier round's value, the write above was eager)
                del part
            elif step == 10:
                buf.view(-1)[row] = h[1]  # a flat view
            elif step == 11:  # a recorded value first, the buffer's view after it
                h = torch.add(h, buf.unsqueeze(0)[0, row], alpha=0.5)
            else:
                h = torch.where(h > 0, h, buf[row])
        return buf * 2, h

    xs = [torch.randn(3) for _ in programs]
    assert_same(fn, list(lin.parameters()), xs, programs)


@_PROGRAMS
@given(step_programs(4, (1, 2), 5, 5, min_steps=1))
def test_random_programs_of_modules_run_through_match_eager(finish, programs):
    """Random programs of a module of one's own that vmap cannot run (a GRU on a batch of
    one inside it, a read in its forward that picks a branch), its cell on batches of one or
    two rows, a Dropout in eval mode and ``bmm`` attention over a memory: values and
    gradients equal eager (float64), whichever examples take which steps."""
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.gru = nn.GRU(3, 3)
            self.cell = nn.GRUCell(3, 3)
            self.drop = nn.Dropout(0.3)
            self.q = nn.Linear(3, 3)

        def forward(self, h, mem, step, rows):
            if step == 0:
                out, hn = self.gru(h.view(1, 1, -1), h.view(1, 1, -1))
                return out.view(-1) + hn.view(-1)
            if step == 1:
                return self.cell(h.expand(rows, 3), h.expand(rows, 3)).sum(0) / rows
            if step == 2:
                w = torch.softmax(mem @ self.q(h), 0)
                return torch.bmm(w.view(1, 1, -1), mem.unsqueeze(0)).view(-1)
            if step == 3 and float(h.detach().sum()) > 0:  # a read in the forward
                return self.drop(-h)
            return torch.tanh(self.q(self.drop(h)))

    block = Block().eval()

    def fn(x, program):
        mem = torch.tanh(x.view(2, 3))
        h = block.q(mem[0])
        for step, rows in program:
            h = block(h, mem, step, rows)
        return h

    xs = [torch.randn(6) for _ in programs]
    assert_same(fn, list(block.parameters()), xs, programs)


@st.composite
def moded_programs(draw):
    """Per example: steps of (layer, how to read after it: not, plainly, or inside
    ``torch.no_grad()``; how to use the value kept from the start: not, a row of it, or a row
    of it scaled under ``no_grad``)."""
    n = draw(st.integers(1, 6))
    step = st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 2), st.integers(0, 2))
    return [draw(st.lists(step, max_size=4)) for _ in range(n)]


@_PROGRAMS
@given(moded_programs())
def test_random_programs_with_reads_under_no_grad_and_kept_values_match_eager(finish, programs):
    """Random programs whose reads happen with gradients on or off, and that use rows of a
    value kept from their first step (an earlier round's value once a read has run: its
    methods memoised, made with gradients on or off): values and gradients equal eager
    (float64), whichever examples read where."""
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(3, 3) for _ in range(3)]).double()

    def fn(x, program):
        kept = torch.tanh(layers[0](x.expand(3, 3)))  # (3, 3)
        h = kept[0]
        for layer, read, use, row in program:
            h = torch.tanh(layers[layer](h))
            if use == 1:
                h = h + kept[row] * 0.5
            elif use == 2:
                with torch.no_grad():
                    scale = kept[row] * 2
                h = h * scale
            if read == 1 and float(h[0].detach()) > 0:
                h = -h
            elif read == 2:
                with torch.no_grad():
                    flip = float(h[1]) > 0
                if flip:
                    h = h * 0.5
        return h

    xs = [torch.randn(3, dtype=torch.float64) for _ in programs]
    assert_same(fn, list(layers.parameters()), xs, programs)


@_PROGRAMS
@given(step_programs(5, (0, 2), 7, 5))
def test_random_programs_under_inference_mode_match_eager(finish, programs):
    """Under torch.inference_mode() tensors have no version counter and their views no
    base.  Random programs that apply a layer, read and branch, add a row of a value kept
    from their first step (memoised methods of an earlier round's value), write a buffer
    they made through a view (``buf[i] += h``), add an eager mask they change afterwards,
    and sum a boolean-mask selection: values equal eager's (float64), whichever examples
    take which steps."""
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(3, 3) for _ in range(3)]).double()

    def fn(x, program):
        kept = torch.tanh(layers[0](x.expand(3, 3)))  # (3, 3)
        buf = torch.zeros(3, 3, dtype=torch.float64)
        mask = torch.zeros(3, dtype=torch.float64)
        h = kept[0]
        for step, arg in program:
            if step == 0:
                h = torch.tanh(layers[arg](h))
            elif step == 1:
                if float(h[arg]) > 0:  # a read
                    h = -h
            elif step == 2:
                h = h + kept[arg] * 0.5
            elif step == 3:
                buf[arg] += h
            elif step == 4:
                h = h + mask
                mask[arg] = mask[arg] - 1.0  # after the call took it: eager read it before
            else:
                h = h + h[h > 0].sum()
        return h, buf

    xs = [torch.randn(3, dtype=torch.float64) for _ in programs]
    with torch.inference_mode():
        want = [fn(x, p) for x, p in zip(xs, programs)]
        got = fold.autobatch(fn, xs, programs, stack=False)
    for g, w in zip(got, want):
        for a, b in zip(g, w, strict=True):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "shapes",
    [
        ((5, 4), (4,)),
        ((4,), (4, 3)),
        ((4,), (4,)),
        ((2, 5, 4), (2, 4, 3)),
        ((3, 5, 4), (4,)),  # a stack of matrices @ a vector (failed: batch dims misaligned)
        ((4,), (2, 4, 3)),  # a vector @ a stack of matrices
    ],
)
@pytest.mark.parametrize("grad", [True, False])
def test_matmul_of_two_recorded_operands_runs_batched_as_eager(shapes, grad):
    """Attention written per example (``mem @ query``, ``weights @ mem``): both operands
    recorded, the group one batched matmul, values and gradients as eager; without
    gradients (where matrices @ a vector takes another of torch's kernels) values as
    eager."""
    from fold.autobatch import clear_cache

    clear_cache()  # the ops below alone in the table
    (sa, sb) = shapes
    lin_a, lin_b = nn.Linear(3, sa[-1]), nn.Linear(3, sb[-1])

    def fn(x, y):
        a = lin_a(x.expand(*sa[:-1], 3)) if len(sa) > 1 else lin_a(x)
        b = lin_b(y.expand(*sb[:-1], 3)) if len(sb) > 1 else lin_b(y)
        if len(sb) > 1 and len(sa) == 1:
            b = b.transpose(-1, -2) if sb[-2] != sa[-1] else b
        return torch.tanh(a @ b if len(sb) == 1 or b.shape[-2] == a.shape[-1] else a @ b.mT)

    xs, ys = [torch.randn(3) for _ in range(4)], [torch.randn(3) for _ in range(4)]
    if grad:
        assert_same(fn, [*lin_a.parameters(), *lin_b.parameters()], xs, ys)
    else:
        with torch.no_grad():
            torch.testing.assert_close(fold.autobatch(fn, xs, ys), eager_stack(fn, xs, ys))
    op_modes = {op.mode for op in _OPS.values() if "matmul" in op.name}
    assert op_modes <= {"direct"}, op_modes


@pytest.mark.parametrize("cpu", [True, False], ids=["cpu-forms", "gpu-forms"])
@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("shapes", [((5, 4), (4,)), ((3, 5, 4), (4,)), ((4,), (2, 4, 3))])
def test_the_forms_of_a_matmul_group_equal_per_example_matmuls(shapes, grad, cpu):
    """Each form ``_matmul_group`` takes for a group of per-example matmuls (the CPU's, and
    the GPU's, checked here on the CPU) equals the examples' own matmuls, values and
    gradients (float64)."""
    from fold.autobatch.tables import _matmul_group

    n = 4
    a = torch.randn(n, *shapes[0], dtype=torch.float64, requires_grad=grad)
    b = torch.randn(n, *shapes[1], dtype=torch.float64, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        got = _matmul_group(a, b, cpu=cpu)
        want = torch.stack([x @ y for x, y in zip(a, b)])
    torch.testing.assert_close(got, want)
    if grad:
        w = torch.randn_like(want)
        torch.testing.assert_close(
            torch.autograd.grad((got * w).sum(), (a, b)),
            torch.autograd.grad((want * w).sum(), (a, b)),
        )


def test_torch_functions_of_earlier_rounds_values_run_at_once_as_eager(finish):
    """After a round, a torch function whose lazy arguments all come from earlier rounds
    (an index into an encoder's output, a cat of known rows) runs at once: its result is a
    tensor, and values and gradients equal eager."""
    lin = nn.Linear(3, 4)
    seen = []

    def fn(x):
        enc = torch.tanh(lin(x.expand(5, 3)))  # (5, 4): an encoder's output
        total = enc[0] * 0
        for i in range(3):
            j = int(enc[i].argmax()) % 5  # a read: enc is an earlier round's value now
            row = torch.cat([enc[j], enc[i]])
            seen.append(type(row))
            seen.append(type(enc[i, 1:3]))  # a method of an earlier value, plain indices
            total = total + lin(x) * row[:4].sum() + enc[i, 1:3].sum() * enc[..., 0].view(-1)[j]
        return total

    assert_same(fn, list(lin.parameters()), [torch.randn(3) for _ in range(4)])
    assert torch.Tensor in seen


# Calls whose result's shape depends on the data, or that return a Python value: reads.
_DATA_SHAPED = {
    "nonzero": lambda y, m: y[:, 0].gt(0).nonzero().double() * y.sum(),
    "argwhere": lambda y, m: torch.argwhere(y > 0).double() + y.mean(),
    "masked_select": lambda y, m: torch.masked_select(y, y > 0),
    "mask-index": lambda y, m: y[y.sum(1) > 0] * 2,
    "input-mask-index": lambda y, m: y[m],
    "index-with-mask-in-tuple": lambda y, m: y[:, y[0] > 0],
    "unique": lambda y, m: torch.unique((y > 0).long() + (y > 0.6).long()).double() * y.sum(),
    "unique_consecutive": lambda y, m: (y.flatten() > 0).long().unique_consecutive() * y.sum(),
    "bincount": lambda y, m: (
        torch.bincount(((y > 0).long() + (y > 0.6).long()).flatten()) * y.mean()
    ),
    "where-condition-alone": lambda y, m: torch.stack(torch.where(y > 0)).double() * y.sum(),
    "repeat_interleave": lambda y, m: y[0].repeat_interleave((y[1] > 0).long() + 1),
    "one_hot": lambda y, m: (
        F.one_hot(y[0].argsort()[:2] + (y[1, :2] > 0).long()).double() * y[2, 0]
    ),
    "equal": lambda y, m: y * 2 if torch.equal(y > 0, m) else y,
    "allclose": lambda y, m: y * 3 if y.allclose(y.abs()) else -y,
}


@pytest.mark.parametrize("call", list(_DATA_SHAPED), ids=list(_DATA_SHAPED))
def test_calls_whose_shape_depends_on_the_data_read_their_arguments(call, finish):
    """``nonzero``, ``x[mask]``, ``unique``, ``torch.where(cond)``, ``torch.equal`` and kin
    (tables._READS): each example's result has a shape (or a Python value) of its own data.
    Before, such a call was recorded with the shape of the first example's zeros, and its
    group failed (or, for ``torch.where(cond)``, raised from deep in the executor).  Now it
    reads its lazy arguments, as ``int(t)`` does: the example pauses until their round, and
    the call runs at once on their rows.  Values, shapes and gradients equal eager's, and
    the call costs one round, as a read does."""
    lin = nn.Linear(3, 3)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 3, generator=g) for _ in range(5)]
    masks = [torch.rand(4, 3, generator=g) > 0.5 for _ in range(5)]
    masks[2] = torch.tanh(lin(xs[2])) > 0  # torch.equal true for one example at least
    op = _DATA_SHAPED[call]

    def fn(x, m):
        y = torch.tanh(lin(x))
        return (op(y, m) * 1.5,)  # a recorded call on the result, after the read

    from fold.autobatch import driver

    rounds = []
    run_round = driver._Session.run_round
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(driver._Session, "run_round", lambda self: rounds.append(1) or run_round(self))
        got = fold.autobatch(fn, xs, masks, stack=False)
    want = [fn(x, m) for x, m in zip(xs, masks)]
    assert len({tuple(w[0].shape) for w in want}) > 1 or call in ("equal", "allclose")
    assert_same_lists(got, want, list(lin.parameters()))
    assert len(rounds) == 1  # the round of the read; the rest runs at once


def test_formatting_a_one_number_value_reads_it_as_eager(finish):
    """``f"{loss:.3f}"`` inside the function formats the number, as a tensor's format does
    (a read); a value of more numbers formats as its repr, and a format spec for it is a
    TypeError, as for a tensor."""
    lin = nn.Linear(3, 1)
    seen: list[str] = []

    def fn(x):
        y = torch.tanh(lin(x)).sum()
        seen.append(f"{y:.4f}|{int(y > 0):d}")
        return y * 2

    xs = [torch.randn(3) for _ in range(4)]
    want = [fn(x) for x in xs]
    eager, seen[:] = list(seen), []
    got = fold.autobatch(fn, xs)
    torch.testing.assert_close(got, torch.stack(want))
    assert sorted(seen) == sorted(eager)
    with pytest.raises(fold.FoldError, match="format"):
        fold.autobatch(lambda x: torch.tensor(len(f"{lin(x).expand(2):.3f}")), xs)


# Calls that a recorded count sizes: torch takes a one-number integer tensor where it takes an
# int, and hands a lazy one to autobatch as an argument.
_SIZED = {
    "slice": lambda y, n: y[:n],
    "narrow": lambda y, n: torch.narrow(y, 0, 0, n),
    "repeat": lambda y, n: y.repeat(n),
    "expand": lambda y, n: y.expand(n, 5),
    "arange": lambda y, n: torch.arange(n).double() * y.sum(),
    "topk": lambda y, n: y.topk(n).values,
    "split": lambda y, n: torch.split(y, n)[0],
    "chunk": lambda y, n: y.chunk(n)[-1],
    "new_zeros": lambda y, n: y.new_zeros(n) + y.sum(),
    "tensor_split": lambda y, n: y.tensor_split(n.reshape(1))[1],
    # Sizes given one by one to a factory, or to a method of an eager tensor: torch's parser
    # called the count's __index__ itself, inside its C code (the process crashed).
    "ones": lambda y, n: torch.ones(n, 2).sum() * y,
    "zeros-tuple": lambda y, n: torch.zeros((n, 2)).sum() + y,
    "randn": lambda y, n: torch.randn(n, 2).sum() * 0 + y,
    "eager-expand": lambda y, n: torch.ones(1, 2).expand(n, 2).sum() * y,
    "eager-new_zeros": lambda y, n: y.detach().new_zeros(n, 2).sum() + y,
    "eager-reshape": lambda y, n: torch.reshape(torch.arange(12.0), (n, -1))[:, 0].sum() * y,
    # A recorded flag as a fill value: read, and its dtype kept (bool, as eager fills).
    "full-of-flag": lambda y, n: (~torch.full((2,), n > 2)).double().sum() + y,
    "index-by-count": lambda y, n: y[n] * y,  # data, not a size: batched as before
    "roll": lambda y, n: torch.roll(y, n),  # a size that leaves the shape: per example
}


@pytest.mark.parametrize("call", list(_SIZED), ids=list(_SIZED))
def test_calls_sized_by_a_recorded_count_read_it(call, finish):
    """``x[:n]``, ``x.repeat(n)``, ``torch.arange(n)``, ``x.topk(k)`` of a recorded count
    ``n`` (a one-number integer value): torch hands the lazy ``n`` to autobatch as it hands
    a tensor argument, and it was recorded as a batched argument with the first example's
    zero shapes (its group then failed; ``x[:n]`` raised an AttributeError from inside
    autobatch).  Such a call is found by its shapes (zeros against ones for ``n``) and reads
    ``n``, as ``int(n)`` would; ``n`` as data (an index) stays batched.  Values, shapes and
    gradients equal eager's."""
    lin = nn.Linear(3, 5)
    op = _SIZED[call]

    def fn(x):
        y = torch.tanh(lin(x))
        n = (y[:3] > 0).long().sum() + 1  # 1 to 4, of the example's data
        return (op(y, n) * 1.5,)

    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(3, generator=g) for _ in range(6)]
    want = [fn(x) for x in xs]
    got = fold.autobatch(fn, xs, stack=False)
    assert_same_lists(got, want, list(lin.parameters()))


def test_a_wrong_size_given_as_a_recorded_count_raises_torchs_error():
    """A recorded count given to torch where it takes sizes, and sizes that do not fit:
    torch's own error, as eager code gets it (the count used to be read inside torch's C
    argument parsing, and the error's C++ backtrace, taken on the example's coroutine stack
    after that pause, crashed the process)."""
    lin = nn.Linear(3, 6)
    table = torch.arange(12.0)

    def fn(x):
        h = lin(x)
        n = (h[:2] > 0).long().sum().clamp(min=1) + 1  # 2 or 3: 12 values do not fit n x 5
        return torch.reshape(table, (n, 5)).sum() * h

    with pytest.raises(RuntimeError, match="is invalid for input of size 12"):
        fold.autobatch(fn, [torch.randn(3) for _ in range(6)])


_KNOWN_AS_NUMBER = {
    "tensor": lambda k, y: torch.tensor(k) * y,
    "tensor-of-list": lambda k, y: torch.tensor([k, 1.0]) @ y[:2],
    "as_tensor-of-list": lambda k, y: torch.as_tensor([k, k]) * y[:2],
    "new_tensor": lambda k, y: y.detach().new_tensor(k) * y,
    "new_tensor-of-list": lambda k, y: y.detach().new_tensor([[k, 2]]) * y[:2],
    "full": lambda k, y: torch.full((3,), k) * y,
    "new_full": lambda k, y: y.detach().new_full((3,), k) * y,
    "full_like": lambda k, y: torch.full_like(y, k) * y,
    "arange": lambda k, y: torch.arange(k)[:2].double() @ y[:2],
    "linspace": lambda k, y: torch.linspace(0, k, 3) * y,
    "tensor-of-lazy": lambda k, y: torch.tensor(y.sum()) * y,
    "new_tensor-of-lazy": lambda k, y: y.new_tensor(y[0]) * y,
}


@pytest.mark.parametrize("call", list(_KNOWN_AS_NUMBER), ids=list(_KNOWN_AS_NUMBER))
def test_known_and_lazy_values_given_to_tensor_factories_match_eager(call, finish):
    """A known value (``torch.tensor(2)``) passes torch's own test for a tensor without
    being one: given to ``torch.tensor``, ``Tensor.new_tensor`` or where a factory takes a
    number (``torch.full``'s fill value, ``arange``'s end), torch's C conversion read it as
    a tensor's memory (``torch.tensor(k)`` crashed the process; the others raised a
    TypeError or read garbage).  While autobatch runs those factories get the known
    values' tensors, and ``torch.tensor`` of a lazy value copies its values without
    history, as of a tensor.  Values and gradients equal eager's, after a read, and the
    factories are torch's own again after the call."""
    lin = nn.Linear(3, 3)
    make = _KNOWN_AS_NUMBER[call]

    def fn(x):
        y = torch.tanh(lin(x))
        k = torch.tensor(2) if float(y.sum()) > 0 else torch.tensor(3)  # a read first
        return (make(k, y) * 1.5).sum().reshape(1) + y

    with warnings.catch_warnings():  # torch.tensor(t) of a tensor warns, as eager
        warnings.filterwarnings("ignore", "To copy construct from a tensor")
        warnings.filterwarnings("ignore", "Converting a tensor with requires_grad")
        assert_same(fn, list(lin.parameters()), [torch.randn(3) for _ in range(4)])
    assert torch.full is _TORCH_FULL and torch.arange is _TORCH_ARANGE
    from fold.autobatch import patches

    for (where, name), wrapper in patches._WRAPPERS.items():  # every one put back
        assert where.__dict__.get(name) is not wrapper, name
        if where is torch.Tensor:  # (inherited from torch's C base: deleted again)
            assert name not in torch.Tensor.__dict__, name


_TORCH_FULL, _TORCH_ARANGE = torch.full, torch.arange


def test_known_values_format_pickle_and_change_in_place_as_tensors(finish):
    """A known value (``torch.tensor(...)`` of Python values inside the function) formats
    as a tensor (``f"{t:.2f}"``), is saved and loaded as a tensor (``torch.save`` with
    ``weights_only``, its dtype kept), and ``k += 1`` changes it in place, as every alias
    of it sees in eager code; ``loss += step`` of a recorded step still rebinds ``loss``."""
    lin = nn.Linear(3, 3)

    def fn(x):
        h = lin(x)
        scale = 1.0 if float(h.sum()) > 0 else 2.0  # a read first
        a = torch.tensor([1.0, 2.0, 3.0])
        alias = a
        a += 1
        a *= torch.tensor(scale)
        buf = io.BytesIO()
        torch.save(torch.tensor([2.0, 3.0], dtype=torch.float64), buf)
        buf.seek(0)
        kept = torch.load(buf)
        digits = len(f"{torch.tensor(scale * 1.25):.3f}")
        loss = torch.tensor(0.0)
        for i in range(2):
            loss += h.sum() * i
        return h * alias * digits * kept.sum().float() * (kept.dtype == torch.float64) + loss

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Converting a tensor with requires_grad")
        assert_same(fn, list(lin.parameters()), [torch.randn(3) for _ in range(4)])


def test_a_categorical_over_recorded_logits_scores_a_known_action(finish):
    """``torch.distributions.Categorical(logits=h)`` of a recorded value (its shape check
    calls ``ndimension()``) and ``log_prob`` of ``torch.tensor(action)`` with the argument
    check on (it tests ``isinstance(value, torch.Tensor)``): values and gradients equal
    eager's."""
    lin = nn.Linear(3, 4)

    def fn(x):
        d = torch.distributions.Categorical(logits=lin(x))
        a = int(d.probs.argmax())
        return d.log_prob(torch.tensor(a)) + d.entropy()

    assert_same(fn, list(lin.parameters()), [torch.randn(3) for _ in range(5)])


class _ReverseGrad(torch.autograd.Function):
    """A gradient reversal layer (old style: ``forward(ctx, ...)``, no vmap rule)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ctx.scale * g, None


class _StraightThrough(torch.autograd.Function):
    """A straight-through sign: the forward's ops carry no gradient of their own."""

    @staticmethod
    def forward(ctx, x):
        return (x > 0).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g


class _Clip(torch.autograd.Function):
    """New style, with a vmap rule: its groups run under torch.func.vmap."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x.clamp(-0.5, 0.5)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g * 2.0


@pytest.mark.parametrize(
    "make",
    [
        lambda y: _ReverseGrad.apply(y, 0.5),
        _StraightThrough.apply,  # taken before autobatch runs, as `sign = STE.apply` is
        lambda y: _StraightThrough.apply(y),
        _Clip.apply,
    ],
    ids=["reverse-grad", "straight-through-taken-before", "straight-through", "vmap-rule"],
)
@pytest.mark.parametrize("reads", [False, True], ids=["no-read", "read"])
def test_custom_autograd_functions_keep_their_backward(make, reads, finish):
    """torch calls a custom Function's forward with gradients off and passes values that are
    not tensors through untouched: on lazy values, its ops were recorded without gradients
    and its backward never ran (a gradient reversal, a straight-through estimator: silent
    wrong gradients).  While autobatch runs, a Function's call on lazy values is recorded
    whole and runs on the examples' rows (under vmap where the Function has a vmap rule, else
    one call per example): values and gradients equal eager's, with rows recorded once (a
    list of same-shape tensors), per example and across rounds."""
    lin = nn.Linear(3, 3)

    def fn(x):
        h = torch.tanh(lin(x))
        if reads and float(h.sum()) > 0:
            h = h * 2
        return make(h) * lin(x)

    xs = [torch.randn(3) for _ in range(5)]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Converting a tensor with requires_grad")
        assert_same(fn, list(lin.parameters()), xs)
    assert torch.autograd.Function.__dict__["apply"] is _FUNCTION_APPLY
    assert "apply" not in torch.autograd.function._SingleLevelFunction.__dict__


_FUNCTION_APPLY = torch.autograd.Function.__dict__["apply"]


def test_a_read_inside_no_grad_leaves_the_gradients_of_the_rest(finish):
    """Torch's grad mode belongs to the thread, not to one example: an example that reads
    inside ``with torch.no_grad():`` pauses with gradients off.  The rounds and the other
    examples still run in their own modes (before, the whole result lost its gradients, and
    an example resumed after one that paused so recorded without them).  Values and
    gradients equal eager (float64); half the examples read under no_grad, half not."""
    torch.manual_seed(0)
    lin, lin2 = nn.Linear(3, 3).double(), nn.Linear(3, 3).double()

    def fn(x, i):
        h = lin(x)
        for _ in range(3):
            if i % 2:
                with torch.no_grad():
                    stop = float(h.sum()) > 100  # a read with gradients off
            else:
                stop = float(h.detach().sum()) > 100
            h = torch.tanh(lin2(h))
            if stop:
                break
        return h

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(10)]
    assert_same(fn, [*lin.parameters(), *lin2.parameters()], xs, list(range(10)))


def test_a_value_first_used_under_no_grad_carries_its_gradient_later(finish):
    """A value of an earlier round is made a row (or a literal of a later call) once and
    kept: where that first use was under ``torch.no_grad()``, a later use with gradients on
    still carries the gradient (before, it silently had none)."""
    torch.manual_seed(1)
    lin, lin2 = nn.Linear(3, 3).double(), nn.Linear(3, 3).double()

    def fn(x):
        h = lin(x)
        if float(h.detach().sum()) > 1e9:  # a read: h is an earlier round's value now
            h = h * 2
        with torch.no_grad():
            a = lin2(h)  # h a literal of a call, made with gradients off
            b = torch.cat([h, h]) * 2  # h's row, made with gradients off
        return lin2(h) + torch.cat([h, h])[:3] + a + b[3:]

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(10)]
    assert_same(fn, [*lin.parameters(), *lin2.parameters()], xs)


@pytest.mark.parametrize("stack", [True, False])
@pytest.mark.parametrize("reads", [True, False])
def test_enable_grad_inside_a_function_run_under_no_grad_keeps_its_gradients(stack, reads, finish):
    """autobatch called under ``torch.no_grad()`` on a function that turns gradients back on
    (``with torch.enable_grad():``): its calls run with gradients, and so do the gathers
    between them and the results' stacking (before, the gathers ran without, and the
    gradients reaching the first calls were lost).  Values and gradients equal the
    per-example results of eager code."""
    torch.manual_seed(2)
    lin, lin2 = nn.Linear(3, 3).double(), nn.Linear(3, 3).double()

    def fn(x):
        with torch.enable_grad():
            h = lin(x)
            for _ in range(3):
                h = torch.tanh(lin2(h))
                if reads and float(h.detach().sum()) > 100:
                    break
            return h

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(10)]
    with torch.no_grad():
        got = fold.autobatch(fn, xs, stack=stack)
        want = [fn(x) for x in xs]
    got = list(got)
    params = [*lin.parameters(), *lin2.parameters()]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
        assert a.requires_grad
    weights = [torch.randn_like(w) for w in want]
    for a, b in zip(
        torch.autograd.grad(sum((w * g).sum() for w, g in zip(weights, got)), params),
        torch.autograd.grad(sum((w * g).sum() for w, g in zip(weights, want)), params),
    ):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("region", ["inference_mode", "autocast"])
def test_a_read_inside_a_region_the_function_opened_is_a_fold_error(region):
    """Inference mode and autocast belong to the thread; a read inside such a region that
    the function opened would resume the other examples inside it: a FoldError naming the
    example and the fix (the same region around the autobatch call works)."""
    lin = nn.Linear(3, 3)

    def fn(x):
        h = lin(x)
        ctx = torch.inference_mode() if region == "inference_mode" else torch.autocast("cpu")
        with ctx:
            if float(h.detach().sum()) > 1e9:
                h = h * 2
        return h

    xs = [torch.randn(3) for _ in range(4)]
    with pytest.raises(fold.FoldError, match=f"example 0: .*torch.{region}.*Fix: read after"):
        fold.autobatch(fn, xs)

    def outside(x):
        h = lin(x)
        if float(h.detach().sum()) > 1e9:
            h = h * 2
        return h

    ctx = torch.inference_mode() if region == "inference_mode" else torch.autocast("cpu")
    with ctx:
        got = fold.autobatch(outside, xs)
        want = torch.stack([outside(x) for x in xs])
    torch.testing.assert_close(got, want)


def test_methods_of_earlier_rounds_values_are_made_once_and_match_eager(finish):
    """A parser's features: ``enc[0] * 0`` and ``enc[i]`` for the positions on its stack,
    each step, ``enc`` a value of an earlier round.  Such a method (pure, plain arguments)
    runs at once, once per autobatch call for each value, method, arguments and grad mode:
    the same call later gives the same lazy value, whose own methods are made once alike.
    Values and gradients equal eager (float64); the memo holds one entry per distinct call."""
    torch.manual_seed(0)
    lin, mlp = nn.Linear(3, 4).double(), nn.Linear(12, 3).double()
    made = []

    def parse(x, n):
        enc = torch.tanh(lin(x.expand(n, 3)))  # (n, 4): the encoder's output
        stack, buffer, total = [0], list(range(1, n)), 0
        while buffer or len(stack) > 1:
            pad = enc[0] * 0
            feats = [
                enc[stack[-1]],
                enc[stack[-2]] if len(stack) > 1 else pad,
                enc[buffer[0]] if buffer else pad,
            ]
            scores = mlp(torch.cat(feats))
            total = total + scores
            a = int(scores.argmax())  # a read: a round per step
            if buffer and (a == 0 or len(stack) < 2):
                stack.append(buffer.pop(0))
            else:
                stack.pop(-2 if a == 1 and len(stack) > 2 else -1)
        if common._LOCAL.rec is not None:
            made.append(len(common._LOCAL.rec.session.memo))
        return total

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(10)]
    ns = [3 + i % 4 for i in range(10)]
    assert_same(parse, [*lin.parameters(), *mlp.parameters()], xs, ns)
    # one entry per distinct call: enc[0], enc[0] * 0, and enc[i] for each position indexed
    assert made and max(made) <= 2 + 6 * len(xs), made


def test_a_value_made_at_once_from_an_earlier_round_is_its_own_literal_row(finish):
    """``hidden[0]`` of an earlier round's ``hidden`` runs at once (a one-row output of its
    own, see values._memo_wrap); a later call that takes it (``torch.cat((e, hidden[0]))``,
    the translation tutorial's decoder) takes that one row itself as its literal, not a view
    of it (the C path's split_view and row_literal alike).  Values and gradients equal eager
    (float64), with the method under torch.no_grad() too, where its row carries none."""
    from fold.autobatch.recorder import _Recorder

    torch.manual_seed(0)
    lin, cell = nn.Linear(3, 4).double(), nn.Linear(8, 4).double()

    def decode(x):
        hidden = torch.tanh(lin(x)).unsqueeze(0)  # (1, 4)
        total = 0
        for _ in range(3):
            if float(hidden.detach().sum()) > 1e9:  # a read: hidden is of an earlier round now
                break
            with torch.no_grad():
                frozen = hidden[0] * 1  # at once, no gradient
            e = torch.tanh(hidden[0])  # at once, from the row of hidden (its gradient flows)
            hidden = torch.tanh(cell(torch.cat((e, hidden[0] + frozen)))).unsqueeze(0)
            total = total + hidden.sum()
        return total

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(6)]
    assert_same(decode, [*lin.parameters(), *cell.parameters()], xs)
    rec = _Recorder()
    one = torch.randn(1, 4, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        assert rec.row_literal(one, 0) is one
    many = torch.randn(3, 4)
    assert rec.row_literal(many, 0) is not many


def test_the_repr_of_an_earlier_rounds_value_shows_its_numbers(finish):
    """A debugging print inside the function: a value not computed yet shows its shape and
    example; one of an earlier round (and a memoised method of it) shows its numbers, as the
    tensor's repr in eager code does."""
    lin = nn.Linear(3, 2)
    seen = []

    def fn(x):
        h = lin(x)
        seen.append(("before", repr(h)))
        if float(h.detach().sum()) > 1e9:
            h = h * 2
        seen.append(("after", repr(h), repr(h[0] * 2), repr(lin(x)), repr(torch.tanh(h))))
        return h

    xs = [torch.randn(3) for _ in range(10)]
    with torch.no_grad():
        fold.autobatch(fn, xs, stack=False)
        want = [lin(x) for x in xs]
    before = [r for r in seen if r[0] == "before"]
    after = [r for r in seen if r[0] == "after"]
    assert before and all(r[1].startswith("Lazy((2,), example ") for r in before)
    assert {r[1] for r in after} == {f"Lazy({w!r})" for w in want}
    assert {r[2] for r in after} == {f"Lazy({w[0] * 2!r})" for w in want}
    # a call of this round (lin(x)) or an eager tensor (tanh of an earlier value) as ever
    assert all(r[3].startswith("Lazy((2,), example ") for r in after)
    assert {r[4] for r in after} == {repr(torch.tanh(w)) for w in want}


def test_memoised_methods_keep_arguments_and_grad_modes_apart(finish):
    """The memo of methods of earlier rounds' values keys their arguments by type and bits:
    ``x * 0`` and ``x * 0.0`` of an integer value (long against float), ``v[1]`` and
    ``v[True]`` (a row against a new dim), ``f * 0.0`` and ``f * -0.0`` (the sign of zero),
    two slices, a tuple index; and the grad mode (a value made under ``no_grad`` carries no
    gradient, the same call with gradients on does).  Each equals eager, dtype and sign bit
    included; the same call twice gives one lazy value."""
    torch.manual_seed(1)
    lin = nn.Linear(3, 4).double()
    same = []

    def fn(x):
        h = lin(x.expand(3, 3))  # (3, 4)
        k = (h.abs() * 3).long()
        if float(h.detach().sum()) > 1e9:  # a read: h and k are earlier rounds' values now
            h = h * 2
        with torch.no_grad():
            frozen = h * 2
        live = h * 2
        a, b = h[1], h[1]
        if common._LOCAL.rec is not None:
            same.append(a is b)
        return (
            k * 0,
            k * 0.0,
            h[1],
            h[True],
            h * 0.0,
            h * -0.0,
            h[0:2],
            h[0:3],
            h[1, 2],
            frozen + live,
        )

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(8)]
    got = fold.autobatch(fn, xs, stack=False)
    want = [fn(x) for x in xs]
    for g, w in zip(got, want):
        for a, b in zip(g, w, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            torch.testing.assert_close(a, b)
            assert torch.equal(torch.signbit(a), torch.signbit(b))
    assert same and all(same)
    params = list(lin.parameters())
    gg = torch.autograd.grad(sum(g[-1].sum() for g in got), params)
    gw = torch.autograd.grad(sum(w[-1].sum() for w in want), params)
    for a, b in zip(gg, gw):
        torch.testing.assert_close(a, b)


def test_a_memoised_value_is_made_again_after_its_source_changes_in_place(finish):
    """A row of an earlier round's value changed in place through a view that is not
    memoised (``unbind``, under no_grad, as eager code may): the memoised methods of that
    value are made again from the changed row, as eager code computes them; a memoised value
    itself, like every lazy value, refuses an in-place change."""
    lin = nn.Linear(3, 4)

    def fn(x):
        h = lin(x.expand(3, 3))
        if float(h.sum()) > 1e9:  # a read: h is an earlier round's value now
            h = h * 2
        before = h * 3
        h.unbind(0)[0].fill_(7.0)  # the row, changed in place (eager changes h so too)
        return before, h * 3, h[0]

    xs = [torch.randn(3) for _ in range(8)]
    with torch.no_grad():
        got = fold.autobatch(fn, xs, stack=False)
        want = [fn(x) for x in xs]
    for g, w in zip(got, want):
        for a, b in zip(g, w, strict=True):
            torch.testing.assert_close(a, b)

    def changes(x):
        h = lin(x.expand(3, 3))
        if float(h.sum()) > 1e9:
            h = h * 2
        h[0].add_(1.0)
        return h

    with pytest.raises(fold.FoldError, match="in-place"), torch.no_grad():
        fold.autobatch(changes, xs)


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.uint8, torch.bool])
def test_reads_of_integer_values_give_what_eager_reads(dtype, finish):
    """Reads of 0-dim integer and bool values (a token, an action, a stop flag), which come
    from one list of their round's output: int, float, bool, .item(), an index and ``if``
    give eager's numbers of eager's Python types, and what is recorded after them equals
    eager, values and gradients."""
    torch.manual_seed(2)
    lin = nn.Linear(3, 4)
    table = [0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5]

    def fn(x, reads):
        y = lin(x)
        for step in range(3):
            v = y[step] > 0 if dtype is torch.bool else (y[step].abs() * 3).to(dtype) % 8
            got = [int(v), float(v), bool(v), v.item(), table[v]]
            reads.append([(type(r), r) for r in got])
            y = y * got[4] if v else y + got[1]
        return y

    xs = [torch.randn(3) for _ in range(5)]
    want_reads: list = []
    want = torch.stack([fn(x, want_reads) for x in xs])
    got_reads: list = []
    got = fold.autobatch(lambda x: fn(x, got_reads), xs)
    torch.testing.assert_close(got, want)
    # the examples pause at each read, so the reads interleave: compare them per example
    assert sorted(map(repr, got_reads)) == sorted(map(repr, want_reads))
    assert len({r[0][1] for r in want_reads}) > 1  # the reads differ between examples
    weights = torch.randn_like(want)
    params = list(lin.parameters())
    for a, b in zip(
        torch.autograd.grad((got * weights).sum(), params),
        torch.autograd.grad((want * weights).sum(), params),
    ):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_float_reads_of_one_number_values_give_what_eager_reads(dtype, shape, finish):
    """float(), bool() and .item() of a one-number floating value (a loss, a halting
    probability; 0-dim or of shape (1,)), which come from one list of their round's output,
    give eager's numbers of eager's Python types (zeros, a NaN and -0.0 among them); int()
    and an index keep the tensor's own conversion (an index of a float is torch's error), and
    so does a read of a value that requires grad (torch's warning, once, as in eager)."""
    torch.manual_seed(4)
    lin = nn.Linear(3, 3)
    specials = [0.0, -0.0, float("nan"), 1.25]

    def fn(x, k, i, reads):
        y = lin(x)
        with warnings.catch_warnings():  # torch warns once per process, eager or not
            warnings.simplefilter("ignore")
            reads.append((i, [float(y[0])]))  # requires grad: the row's conversion
        for step in range(3):
            v = (y[step].abs() * 3 - 1).detach().to(dtype).reshape(shape)
            if step == 0:  # a special number, per example
                v = v * 0 + specials[k] if specials[k] == specials[k] else v * float("nan")
            got = [float(v), bool(v), v.item()]
            if got[0] == got[0]:  # int() of a NaN raises in both
                got.append(int(v))
            reads.append((i, got))
            y = y * 0.5 + (0.0 if got[0] != got[0] else got[0]) if got[1] else y - 1
        with pytest.raises(TypeError):
            [0, 1, 2][v]
        return y

    xs, ks = [torch.randn(3) for _ in range(6)], [0, 1, 2, 3, 0, 3]
    want_reads: list = []
    want = torch.stack([fn(x, k, i, want_reads) for i, (x, k) in enumerate(zip(xs, ks))])
    got_reads: list = []
    got = fold.autobatch(lambda x, k, i: fn(x, k, i, got_reads), xs, ks, range(6))
    torch.testing.assert_close(got, want)
    # The examples pause at each read, so reads interleave: compare them example by example.
    # A batched Linear may round its last bit apart from a per-example one, so the numbers
    # are compared within a tolerance; types, NaNs and the sign of a zero exactly.
    tol = 1e-2 if dtype is torch.bfloat16 else 1e-5
    for i in range(6):
        mine = [r for j, r in got_reads if j == i]
        theirs = [r for j, r in want_reads if j == i]
        assert len(mine) == len(theirs) == 4
        for a_reads, b_reads in zip(mine, theirs):
            assert [type(r) for r in a_reads] == [type(r) for r in b_reads]
            for a, b in zip(a_reads, b_reads):
                if a != a or b != b:
                    assert a != a and b != b  # NaN in both
                    continue
                assert math.isclose(a, b, rel_tol=tol, abs_tol=tol)
                assert math.copysign(1, a) == math.copysign(1, b)
    assert any(r[0] == 0 for _, r in got_reads)  # a zero
    assert any(r[0] != r[0] for _, r in got_reads)  # a NaN
    weights = torch.randn_like(want)
    params = list(lin.parameters())
    for a, b in zip(
        torch.autograd.grad((got * weights).sum(), params),
        torch.autograd.grad((want * weights).sum(), params),
    ):
        torch.testing.assert_close(a, b)


def test_reads_with_tuple_states_and_keyword_arguments_match_eager(finish):
    """An LSTM cell's (h, c) state passed as a tuple, a keyword argument of a torch
    function, a module called on an earlier round's value: batched rounds and the eager
    finish both equal eager, values and gradients."""
    torch.manual_seed(5)
    cell = nn.LSTMCell(4, 4)
    head = nn.Linear(4, 3)

    def fn(x):
        state = (torch.tanh(x), torch.zeros(4))
        out = []
        for _ in range(6):
            state = cell(x, state)
            logits = head(state[0])
            out.append(torch.softmax(logits, dim=0))
            if int(logits.argmax()) == 0:  # a read: a data-dependent stop
                break
        return torch.stack(out).sum(0) + state[1].sum()

    xs = [torch.randn(4) for _ in range(6)]  # groups of at most 6: the eager finish engages
    assert_same(fn, [*cell.parameters(), *head.parameters()], xs)


def test_a_value_of_an_earlier_round_kept_beyond_the_call_is_refused(finish):
    """A lazy value of a round, kept in a list past the autobatch call (with batched rounds,
    and after the examples finished as eager code): every later use is a FoldError, never a
    value read from the call's tables."""
    lin = nn.Linear(3, 3)
    kept = []

    def fn(x):
        h = lin(x)
        if float(h.detach().sum()) > -100:  # a read: h is an earlier round's value after it
            kept.append(h)
            h = h * 2
        return h

    fold.autobatch(fn, [torch.randn(3) for _ in range(4)])
    uses = [
        lambda v: v[0],
        lambda v: v + 1,
        lambda v: v.view(-1),
        lambda v: lin(v),
        lambda v: torch.tanh(v),
        lambda v: float(v.sum()),
    ]
    for use in uses:
        with pytest.raises(fold.FoldError, match="used (after|outside)"):
            use(kept[0])


def test_a_value_of_another_call_is_refused_in_rounds(finish):
    """A lazy value of one autobatch call passed into another call with reads (batched
    rounds, or the eager finish): a FoldError naming the fix, never the other call's row."""
    lin = nn.Linear(3, 3)
    kept = []

    def first(x):
        h = lin(x)
        if float(h.detach().sum()) > -100:
            kept.append(h)
        return h

    fold.autobatch(first, [torch.randn(3) for _ in range(4)])
    other = kept[0]

    @fold.batchable(batched=True)
    def total(items):
        return items.sum()

    uses = [
        lambda h: lin(other) + h,
        lambda h: torch.tanh(other) + h,
        lambda h: other[0] + h,
        lambda h: total([h, other]),  # in a list given to a batched=True function
    ]
    for use in uses:

        def second(x, use=use):
            h = lin(x)
            if float(h.detach().sum()) > -100:  # a read: the next lines run in a later round
                h = h * 1.0
            return use(h)

        with pytest.raises(fold.FoldError, match="(another|after the) autobatch call"):
            fold.autobatch(second, [torch.randn(3) for _ in range(4)])


# ------------------------------------------------------------ random programs over ragged values
@st.composite
def ragged_programs(draw):
    """A random per-example program over a sequence (L, 3) whose length L each example
    draws: steps over a pool of per-position values (L, 3) and a pool of pooled values (3,),
    and whether to read (and branch on) a pooled value now and then."""
    steps = draw(_steps(29))
    lengths = draw(st.lists(st.integers(1, 5), min_size=1, max_size=6))
    return steps, lengths, draw(st.booleans())


class RaggedMenu(nn.Module):
    """Attention-style ops on values whose length differs per example: what autobatch runs
    as padded calls (softmax and log_softmax along either dim, mean/sum/amax/amin, argmax and
    argmin, max and min along a dim, masked_fill, matmul and einsum against a pooled query, a
    cat after a shared row, an index by int, transposes, convolutions over the length,
    elementwise ops; scores (L, L) padded in both dims, a fused projection's chunks, slices,
    a graph of the positions), mixed with reads that start new rounds."""

    def __init__(self, width: int = 3) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.q = nn.Linear(width, width)
        self.root = nn.Parameter(torch.randn(1, width))
        self.emb = nn.Embedding(7, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.conv = nn.ModuleList(
            [nn.Conv1d(width, width, 3, padding=1), nn.Conv1d(width, width, 2, padding=1)]
        )

    def run(self, steps, x, reads):
        rag = [torch.tanh(self.lin(x))]  # (L, 3)
        pooled = [x.sum(0)]  # (3,)
        for kind, i, j in steps:
            a, b, u = rag[i % len(rag)], rag[j % len(rag)], pooled[i % len(pooled)]
            if reads and (i + j) % 3 == 0 and float(u.detach().sum()) > 0:  # a read: a round
                u = -u
            same = a.shape == b.shape
            if kind == 0:
                rag.append(torch.tanh(a))
            elif kind == 1:
                rag.append(self.lin(a))
            elif kind == 2:
                rag.append(torch.softmax(a, 0))
            elif kind == 3:
                rag.append(torch.softmax(a, -1))
            elif kind == 4:
                w = torch.softmax(a @ self.q(u), 0)  # (L,)
                pooled.append(w @ (b if same else a))
            elif kind == 5:
                pooled.append(a.mean(0))
            elif kind == 6:
                pooled.append(a.amax(0))
            elif kind == 7:
                pooled.append(a.sum(0) * 0.3)
            elif kind == 8:
                c = torch.cat([self.root, a])  # (L + 1, 3)
                rag.append(c[1:] * 0.5 + c[0])
            elif kind == 9:
                pooled.append(a[i % a.shape[0]])
            elif kind == 10:
                rag.append(a * b if same else a * 2)
            elif kind == 11:
                rag.append(torch.softmax(a.t(), -1).t())
            elif kind == 12:
                rag.append(a.unsqueeze(0).squeeze(0) - u)
            elif kind == 13:
                pooled.append(torch.log_softmax(a, 0).sum(0))
            elif kind == 14:
                rag.append(torch.sigmoid(a) + torch.relu(b) if same else torch.relu(a))
            elif kind == 15:
                pooled.append(torch.einsum("ld,l->d", a, torch.softmax(a @ u, 0)))
            elif kind == 16:
                rag.append(a + self.emb(torch.tensor(i % 7)))
            elif kind == 18:  # masked attention, the mask a recorded value
                scores = (a @ self.q(u)).masked_fill(a[:, j % 3] > 0.2, -5.0)
                pooled.append(torch.softmax(scores, 0) @ a)
            elif kind == 19:  # a mask made per example from its length (a literal)
                keep = torch.arange(a.shape[0]) % 2 == i % 2
                rag.append(a.masked_fill(keep[:, None], 0.0) + a * 0.5)
            elif kind == 20:  # the positions of the largest and least: index tensors
                best = a.sum(-1).argmax()
                pooled.append(u * best + a.argmin(0) - a.argmax(dim=0, keepdim=True)[0])
            elif kind == 21:
                pooled.append(a.amin(0) + u)
            elif kind == 22:  # the largest and least along the length: values and indices
                top, at = a.max(0)
                low = torch.min(a, dim=0, keepdim=True)
                pooled.append(top * at + low.values[0] - low.indices[0])
            elif kind == 23:  # convolutions over the length (zeros padding, or none)
                c = self.conv[i % 2](a.t()[None])[0].t()  # (L or L + 1, 3)
                rag.append(torch.relu(c))
            elif kind == 24:  # self-attention's scores (L, L), softmax along either dim
                s = a @ self.q(b if same else a).t()
                rag.append(torch.softmax(s, j % 2) @ a)
            elif kind == 25:  # a fused projection cut in three, a causal mask of ones
                q, k, v = self.qkv(a).chunk(3, -1)
                causal = torch.triu(torch.ones(a.shape[0], a.shape[0], dtype=torch.bool), 1)
                rag.append(torch.softmax((q @ k.t()).masked_fill(causal, -1e9), -1) @ v)
            elif kind == 26:  # slices that start at 0 or further on
                head = a[1:].mean(0) if a.shape[0] > 1 else a[0]
                rag.append(a[:, :2].sum(-1, keepdim=True) * head + a[::2].sum(0))
            elif kind == 27:  # a graph of the positions (L, L), made per example
                n = torch.arange(a.shape[0])
                adj = ((n[:, None] - n[None]).abs() <= 1).to(a.dtype)
                rag.append(torch.relu(adj @ a / adj.sum(1, keepdim=True)))
            elif kind == 28:  # the scores' largest and least along each dim
                s = a @ a.t()
                pooled.append(s.amax(0) @ a + s.max(1)[0] @ a - s.amin(1) @ b if same else u)
            else:
                pooled.append(torch.tanh(self.q(u)))
        return pooled[-1] + sum(r.sum(0) for r in rag[-2:])


_RAGGED_PADDED_RUNS = [0]


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(ragged_programs())
def test_random_programs_over_values_of_several_lengths_match_eager(finish, monkeypatch, program):
    """Random programs on sequences of several lengths (float64), with and without reads:
    values and gradients equal eager per example, under batched rounds and the eager
    finish; the padded calls that run them are counted (checked below, once the examples
    have run)."""
    from fold.autobatch import ops

    for how in ("_pad_run", "_ragged_run"):  # in parts or whole
        real = getattr(ops._Op, how)

        def counting(self, v, real=real):
            _RAGGED_PADDED_RUNS[0] += 1
            return real(self, v)

        monkeypatch.setattr(ops._Op, how, counting)
    steps, lengths, reads = program
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        menu = RaggedMenu()
        xs = [torch.randn(n, 3) for n in lengths]
        assert_same(lambda x: menu.run(steps, x, reads), list(menu.parameters()), xs)
    finally:
        torch.set_default_dtype(old)


def test_rows_padded_in_a_longer_group_meet_rows_padded_in_their_own(finish):
    """A ReLU of sequences and of their convolution (one longer) runs as one padded call,
    whose rows of the sequences keep the longer rows' padding; an op that then takes them
    beside the sequences' own rows (padded to the sequences' longest) takes each column cut
    to its own longest (it failed: widths 3 and 4 in one call).  Found by the property
    test above."""
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        menu = RaggedMenu()
        steps = [(23, 1, 0), (14, 0, 0)]  # (a conv of length L + 1 and its ReLU; then a
        # sigmoid plus a ReLU of the sequences)
        xs = [torch.randn(n, 3) for n in (2, 3)]
        assert_same(lambda x: menu.run(steps, x, False), list(menu.parameters()), xs)
    finally:
        torch.set_default_dtype(old)


def test_random_programs_over_values_of_several_lengths_ran_padded_calls(monkeypatch):
    """The menu of the property test above runs as padded calls (the test is not vacuous):
    counted over the property test's examples where it ran first, and on one fixed program
    here (attention over memories of three lengths: every op of it one padded call)."""

    if _RAGGED_PADDED_RUNS[0]:
        assert _RAGGED_PADDED_RUNS[0] > 10
    names = _spy_padded_calls(monkeypatch)
    menu = RaggedMenu()
    xs = [torch.randn(n, 3) for n in (2, 4, 5)]
    fold.autobatch(lambda x: menu.run([(2, 0, 0), (4, 0, 0)], x, False), xs)
    ran = {n.split(" (")[0] for n in names}
    assert {"torch.softmax", "Tensor.__matmul__"} <= ran, ran


# ------------------------------------------------------------ reads with Ragged memories and N models
class _RaggedAttention(nn.Module):
    """A decoder whose memories are a list of per-token values (its own count per example),
    read through a ``batched=True`` attention that receives them as a ``fold.Ragged``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 5)
        self.key = nn.Linear(5, 5)
        self.cell = nn.GRUCell(10, 5)
        self.out = nn.Linear(5, 6)

    @fold.batchable(batched=True)
    def attend(self, mems: fold.Ragged, h: torch.Tensor) -> torch.Tensor:
        """(n lists of (5,) memories, (n, 5) queries) -> (n, 5): dot attention per list."""
        scores = (mems.values * h[mems.segment_ids]).sum(-1)
        return mems.with_values(mems.softmax(scores)[:, None] * mems.values).sum()

    def decode(self, src: torch.Tensor) -> torch.Tensor:
        mems = [torch.tanh(self.key(self.embed(t))) for t in src]  # a list of lazy values
        h, logits = self.out.weight.new_zeros(5), []
        for _ in range(6):
            ctx = self.attend(mems, h)
            h = self.cell(torch.cat([ctx, h]), h)
            step = self.out(h)
            logits.append(step)
            if int(step.argmax()) == int(src[len(logits) % len(src)]):  # a read: it stops
                break
        return torch.stack(logits)


def test_decoding_with_ragged_memories_matches_eager(finish):
    """Greedy decoding whose attention takes each example's memories as a fold.Ragged (a
    batched=True function over lists of lazy values), with reads deciding when each example
    stops: logits (stack=False, each its own length) and gradients equal eager (float64)."""
    torch.manual_seed(0)
    model = _RaggedAttention().double()
    g = torch.Generator().manual_seed(2)
    srcs = [
        torch.randint(1, 6, (int(n),), generator=g) for n in torch.randint(1, 6, (9,), generator=g)
    ]
    want = [model.decode(s) for s in srcs]
    assert len({len(w) for w in want}) > 1  # EOS-driven lengths
    got = fold.autobatch(lambda s: model.decode(s), srcs, stack=False)
    assert_same_lists([(g,) for g in got], [(w,) for w in want], list(model.parameters()))


def test_n_models_decoding_through_a_batch_module_matches_eager(finish):
    """N models of one architecture decoding at once (a BatchModule: one call runs the three
    models on an example's (3, 1, 4) state), each example stopping when a read of its
    models' outputs says so: values and gradients equal eager per example; backprop of one
    model's outputs leaves the other models' gradients exactly zero."""
    from fold.batched_ops import BatchModule

    torch.manual_seed(1)
    bm = BatchModule(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), batch=3).double()
    xs = [torch.randn(3, 1, 4, dtype=torch.float64) for _ in range(6)]

    def decode(x):
        h, steps = x, []
        for _ in range(5):
            h = bm(h)
            steps.append(h)
            if float(h.detach()[:, 0, 0].sum()) < 0:  # one decision for the three models
                break
        return torch.stack(steps)  # (steps, 3, 1, 4)

    want = [decode(x) for x in xs]
    assert len({len(w) for w in want}) > 1
    got = fold.autobatch(decode, xs, stack=False)
    params = list(bm.parameters())
    # Model 1's outputs alone: the gradients of models 0 and 2 are exactly zero.
    one = torch.autograd.grad(sum(g[:, 1].sum() for g in got), params, retain_graph=True)
    want_one = torch.autograd.grad(sum(w[:, 1].sum() for w in want), params, retain_graph=True)
    for a, b in zip(one, want_one):
        torch.testing.assert_close(a, b)
        assert (a[0] == 0).all() and (a[2] == 0).all() and (a[1] != 0).any()
    assert_same_lists([(g,) for g in got], [(w,) for w in want], params)


@pytest.mark.parametrize("cls", [nn.GRUCell, nn.RNNCell, nn.LSTMCell, nn.GRU, nn.RNN, nn.LSTM])
def test_recurrent_modules_called_with_keywords_run_batched(cls):
    """``cell(x, hx=h)``, ``cell(input=x, hx=...)``, ``hx=None``, and the same for an RNN over
    sequences of several lengths, run as the positional calls do (a cell's own batched call;
    one packed call for the RNN), not under vmap, where cells and RNNs have no batching
    rule (torch warns of a per-example fallback): values and gradients equal eager."""
    from fold.autobatch import clear_cache

    clear_cache()
    torch.manual_seed(0)
    mod = cls(3, 3)
    rnn = issubclass(cls, nn.RNNBase)
    xs = [torch.randn(n, 3) if rnn else torch.randn(3) for n in (2, 4, 4, 5)]
    hs = [torch.randn(1, 3) if rnn else torch.randn(3) for _ in range(4)]
    lstm = cls in (nn.LSTM, nn.LSTMCell)

    def first(out):  # a cell's h (an LSTM cell's (h, c)), an RNN's outputs summed over time
        out = out[0] if lstm or rnn else out
        return out.sum(0) if rnn else out

    params = list(mod.parameters())
    state = (lambda h: (h, h * 2)) if lstm else (lambda h: h)
    assert_same(lambda x, h: first(mod(x, hx=state(h))), params, xs, hs)
    assert_same(lambda x, h: first(mod(input=x, hx=state(h))), params, xs, hs)
    assert_same(lambda x, h: first(mod(x, hx=None)) * h.sum(), params, xs, hs)
    modes = {op.mode for op in _OPS.values() if op.fn is mod}
    assert "vmap" not in modes and modes, modes


def test_attention_over_slices_of_a_packed_encoders_outputs_matches_eager(finish):
    """An encoder's outputs, padded with zeros past each sequence's length, are read in
    place by the attention after it (no padding filled); slices of them cut shorter than
    their sequences (``mem[:n]``) keep values where their padding would be, so their padded
    calls fill it: values and gradients equal eager, in the encoder's round and after a
    read (float64)."""
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        gru, q = nn.GRU(3, 3), nn.Linear(3, 3)

        def fn(x, n):
            mem, h = gru(x)  # (L, 3), zero-padded together with the other lengths
            out = []
            for part in (mem, mem[:n], mem[: n + 1]):
                w = torch.softmax(part @ q(h[0]), 0)
                out.append(w @ part + part.mean(0) + part.amax(0))
            if float(out[0].detach().sum()) > -100:  # a read: the rest in a later round
                w = torch.softmax(mem[:n] @ q(out[1]), 0)
                out.append(w @ mem[:n] + mem.sum(0))
                w = torch.softmax(mem @ q(out[2]), 0)  # whole rows of the encoder's output
                out.append(w @ mem)
            return torch.stack(out)

        lengths = [2, 5, 3, 5, 4, 2]
        xs = [torch.randn(k, 3) for k in lengths]
        ns = [max(1, k - 1 - i % 2) for i, k in enumerate(lengths)]
        assert_same(fn, [*gru.parameters(), *q.parameters()], xs, ns)
        with torch.no_grad():  # (where the strided reads of earlier outputs apply)
            got = fold.autobatch(fn, xs, ns)
            want = torch.stack([fn(x, n) for x, n in zip(xs, ns)])
        torch.testing.assert_close(got, want)
    finally:
        torch.set_default_dtype(old)


def test_attention_over_earlier_memories_runs_whole_as_padded_rows(monkeypatch):
    """Rounds after the first of a decoder over memories of several lengths (an earlier
    round's encoder rows): each attention op runs as ONE call on the memories padded
    together (``PaddedRows``: a whole plan, no parts), its scores handed on padded; values,
    decisions, the scores returned per example (stack=False) and gradients equal eager
    (float64), with every round batched."""
    from fold.autobatch import ops

    monkeypatch.setattr(driver, "EAGER_GROUP", 0)
    torch.manual_seed(2)
    enc, cell, out = nn.GRU(3, 4).double(), nn.GRUCell(4, 4).double(), nn.Linear(8, 3).double()
    params = [*enc.parameters(), *cell.parameters()]  # (out is only read)

    def fn(x, steps):
        mem, h = enc(x)  # (L, 4), (1, 4)
        h, ctx, scores = h[0], mem.mean(0), None
        for _ in range(steps):
            h = cell(ctx, h)
            scores = mem @ h  # (L,): rows of several lengths
            ctx = torch.softmax(scores, 0) @ mem
            if float(out(torch.cat([h, ctx])).detach().max()) > 5:  # a read: a round per step
                break
        return ctx, scores.log_softmax(0)

    xs = [torch.randn(n, 3, dtype=torch.float64) for n in (4, 2, 6, 5, 4, 3, 6, 2)]
    steps = [3, 1, 4, 2, 4, 3, 2, 4]
    ragged, parts = [], []
    real_ragged, real_parts = ops._Op._ragged_run, ops._Op._pad_run
    monkeypatch.setattr(
        ops._Op, "_ragged_run", lambda self, v: ragged.append(self.name) or real_ragged(self, v)
    )
    monkeypatch.setattr(
        ops._Op, "_pad_run", lambda self, p: parts.append(self.name) or real_parts(self, p)
    )
    want = [fn(x, k) for x, k in zip(xs, steps)]
    got = fold.autobatch(fn, xs, steps, stack=False)
    assert_same_lists(got, want, params)
    # No round runs in parts: the first one's encoder runs as one packed call on the
    # sources padded together (its outputs PaddedRows), and the mean and the three attention
    # ops of every round as one call each, the first round's too.
    assert parts == [], parts
    assert sum(n.startswith("Tensor.mean") for n in ragged) == 1, ragged
    for name in ("Tensor.__matmul__", "torch.softmax"):
        assert sum(n.startswith(name) for n in ragged) >= 4, ragged
    with torch.no_grad():
        again = fold.autobatch(fn, xs, steps, stack=False)
    for g, w in zip(again, want):
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b)


def test_a_decoders_first_round_runs_whole_though_its_cat_reads_itself(monkeypatch):
    """A greedy decoder as people write it: a GRU encoder over each source (several
    lengths), then per step ``torch.cat`` of the token's embedding and the context before
    the cell and ``torch.cat`` of the state and the context after it (one op: in the first
    round, which holds the encoder and the first step, that op reads itself through the
    cell).  Every round runs as a whole plan, the first too (the cat and the cell split by
    depth, see ``signature_schedule``): no group runs in parts.  Tokens, per-example logits
    and gradients equal eager (float64), every round batched."""
    from fold.autobatch import ops

    monkeypatch.setattr(driver, "EAGER_GROUP", 0)
    torch.manual_seed(8)
    emb, enc = nn.Embedding(6, 4).double(), nn.GRU(4, 4).double()
    cell, attn, out = nn.GRUCell(8, 4).double(), nn.Linear(4, 4).double(), nn.Linear(8, 6).double()
    params = [*emb.parameters(), *enc.parameters(), *cell.parameters(), *attn.parameters()]
    params += list(out.parameters())
    parts = []
    for name in ("_pad_run", "_packed"):
        real = getattr(ops._Op, name)
        monkeypatch.setattr(
            ops._Op, name, lambda self, p, real=real: parts.append(self.name) or real(self, p)
        )

    def fn(src, steps):
        mem, h = enc(emb(src))
        h, ctx, tok, logits = h[0], mem.mean(0), 1, []
        for _ in range(steps):
            h = cell(torch.cat([emb(torch.tensor(tok)), ctx]), h)
            ctx = torch.softmax(mem @ attn(h), 0) @ mem
            o = out(torch.cat([h, ctx]))
            logits.append(o)
            tok = int(o.argmax())  # a read: a round per step
            if tok == 0:
                break
        return (torch.stack(logits),)

    srcs = [torch.randint(1, 6, (n,)) for n in (4, 2, 6, 5, 3, 6, 2)]
    steps = [3, 1, 4, 2, 4, 3, 2]
    want = [fn(s, k) for s, k in zip(srcs, steps)]
    got = fold.autobatch(fn, srcs, steps, stack=False)
    assert parts == [], parts
    assert_same_lists(got, want, params)


def test_padded_rows_read_rows_masks_and_parts():
    """``PaddedRows``: row i cut to its length (as a row and as a batch-of-one narrow), rows
    by slice and index, the padding set by ``filled`` (and left where it is zeros already),
    and the rows by length as parts."""
    data = torch.arange(24.0).view(4, 3, 2)
    rows = PaddedRows(data, 1, np.array([2, 3, 1, 2], np.int64))
    assert torch.equal(rows[1], data[1]) and torch.equal(rows[2], data[2, :1])
    assert torch.equal(rows.narrow(0, 3, 1), data[3:4, :2])
    with pytest.raises(ValueError):
        rows.narrow(0, 0, 2)  # rows of two lengths
    picked = rows.rows(np.array([3, 0]), torch.tensor([3, 0]))
    assert picked.lengths.tolist() == [2, 2] and torch.equal(picked.data, data[[3, 0]])
    assert rows.rows(slice(1, 3), None).lengths.tolist() == [3, 1]
    filled = rows.filled(-1.0)
    for i, n in enumerate([2, 3, 1, 2]):
        assert torch.equal(filled[i, :n], data[i, :n]) and bool((filled[i, n:] == -1).all())
    assert PaddedRows(data, 1, rows.lengths, zero=True).filled(0) is data
    positions, parts = rows.parts()
    assert [p.tolist() for p in positions] == [[2], [0, 3], [1]]
    assert [tuple(p.shape) for p in parts] == [(1, 1, 2), (2, 2, 2), (1, 3, 2)]
    assert torch.equal(parts[1], data[[0, 3], :2])


def test_padded_pieces_join_padded_rows_and_tensors_of_one_ragged_dim():
    """``padded_pieces``: PaddedRows and tensors whose rows differ in the PaddedRows' one
    ragged dim, as one PaddedRows (each part zero-padded to the widest, rows in part order,
    their lengths kept: a tensor part's rows all of its extent), zeros past the rows where
    every PaddedRows part has them; None where no part is PaddedRows, or the parts differ
    in another dim, in dtype, or in their ragged dim."""
    from fold.ops import padded_pieces

    a = PaddedRows(torch.randn(2, 4, 3), 1, np.array([4, 2], np.int64), zero=False)
    b = torch.randn(3, 1, 3)  # three rows of length 1 (an op of their own)
    c = PaddedRows(torch.randn(1, 5, 3), 1, np.array([5], np.int64), zero=True)
    joined = padded_pieces([a, b, c])
    assert joined.dim == 1 and joined.lengths.tolist() == [4, 2, 1, 1, 1, 5]
    assert tuple(joined.data.shape) == (6, 5, 3) and not joined.zero
    for i, want in enumerate([a[0], a[1], b[0], b[1], b[2], c[0]]):
        assert torch.equal(joined[i], want)
    assert bool((joined.data[2:5, 1:] == 0).all())  # the tensor part padded with zeros
    assert padded_pieces([b, c]).zero
    assert padded_pieces([b, b]) is None  # no PaddedRows
    assert padded_pieces([a, torch.randn(3, 1, 2)]) is None  # another dim differs
    assert padded_pieces([a, b.half()]) is None  # another dtype
    other = PaddedRows(torch.randn(2, 4, 3), 2, np.array([3, 2], np.int64))
    assert padded_pieces([a, other]) is None  # another ragged dim


def test_padded_rows_of_earlier_rows_are_views_in_order_and_kept_across_calls():
    """``padded_rows_of`` on rows of a marked padded tensor (a decoder's memories, read in a
    later round): every row in order is a view of it (no copy), a subset an index copy;
    with a ``kept`` dict, the same column (the same view objects) is found there on the next
    call, unless the padded tensor was changed in place since; the mask of the same lengths
    is made once."""
    from fold.ops import _MASKS, mark_zero_past, padded_rows_of

    lengths = [2, 4, 3]
    b = mark_zero_past(torch.zeros(3, 4, 2), 1, lengths)
    with torch.no_grad():
        for i, n in enumerate(lengths):
            b[i, :n] = torch.randn(n, 2)
    views = [b.narrow(0, i, 1).narrow(1, 0, n) for i, n in enumerate(lengths)]
    kept: dict = {}
    whole = padded_rows_of(views, b.device, {}, kept)
    assert whole.data.data_ptr() == b.data_ptr() and whole.data._base is b  # a view
    assert whole.lengths.tolist() == lengths and torch.equal(whole.data, b)
    assert padded_rows_of(list(views), b.device, {}, kept) is whole  # kept: the same views
    some = padded_rows_of([views[2], views[0]], b.device, {}, kept)
    assert some.data._base is None and torch.equal(some.data, b[[2, 0], :3])  # a copy
    with torch.no_grad():
        b.add_(1.0)  # changed in place: what was kept of it is not used
    again = padded_rows_of(list(views), b.device, {}, kept)
    assert again is not whole and torch.equal(again.data, b)
    _MASKS.clear()
    m1 = PaddedRows(torch.zeros(3, 4), 1, np.array(lengths, np.int64)).mask()
    m2 = PaddedRows(torch.ones(3, 4, 5), 1, np.array(lengths, np.int64)).mask()
    assert len(_MASKS) == 1 and m1.shape == (3, 4) and m2.shape == (3, 4, 1)
    assert m1.tolist() == [[False, False, True, True], [False] * 4, [False] * 3 + [True]]


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_decoder_rounds_read_the_memories_padded_once(monkeypatch, mode):
    """Every round of a decoder over memories of several lengths reads the same memories:
    they are found padded from the first round that read them on (``_rows_in`` runs once per
    column of them, not per round), values, decisions and gradients equal eager (float64).
    Under torch.inference_mode() too, where torch keeps no base for a view (the rows note
    theirs: ``fold.ops.view_base``)."""
    from fold import ops as fold_ops

    monkeypatch.setattr(driver, "EAGER_GROUP", 0)
    torch.manual_seed(3)
    enc, cell = nn.GRU(3, 4).double(), nn.GRUCell(4, 4).double()
    params = [*enc.parameters(), *cell.parameters()]

    def fn(x):
        mem, h = enc(x)
        h, ctx = h[0], mem.mean(0)
        for _ in range(5):
            h = cell(ctx, h)
            ctx = torch.softmax(mem @ h, 0) @ mem
            if float(h.detach().sum()) > 100:  # a read: a round per step, never true
                break
        return ctx

    xs = [torch.randn(n, 3, dtype=torch.float64) for n in (4, 2, 6, 5, 3)]
    calls = []
    real = fold_ops._rows_in
    with monkeypatch.context() as m:
        m.setattr(fold_ops, "_rows_in", lambda c: calls.append(len(c)) or real(c))
        with getattr(torch, mode)():
            got = fold.autobatch(fn, xs)
            want = torch.stack([fn(x) for x in xs])
    # Once where the first step's mean reads the encoder's rows, once where the second
    # round's attention reads them; not once per round (five rounds read them).
    assert calls == [5, 5], calls
    torch.testing.assert_close(got, want)
    assert_same(fn, params, xs)


def test_earlier_rows_come_from_one_split_from_the_second_row_on():
    """``_Recorder.row_literal``: the first row asked of an earlier round's output is a
    narrow, every later one a view from one ``split`` of it (the same values, storage and
    gradients as narrows); a tensor subclass or ``PaddedRows`` is narrowed."""
    rec = recorder._Recorder()
    src = torch.randn(4, 3, requires_grad=True) * 1.0
    first = rec.row_literal(src, 2)
    second = rec.row_literal(src, 0)
    third = rec.row_literal(src, 3)
    assert first.grad_fn.name().startswith(("Slice", "Narrow"))
    assert second.grad_fn is third.grad_fn and "Split" in second.grad_fn.name()
    for view, row in ((first, 2), (second, 0), (third, 3)):
        assert view.shape == (1, 3) and torch.equal(view, src[row : row + 1])
        assert view.data_ptr() == src[row].data_ptr()
    w = torch.randn(3, 3)
    (grad,) = torch.autograd.grad(((first + second * 2 + third * 3) * w).sum(), src)
    want = torch.zeros(4, 3)
    want[2], want[0], want[3] = w.sum(0), 2 * w.sum(0), 3 * w.sum(0)
    torch.testing.assert_close(grad, want)
    other = torch.randn(4, 3)  # another tensor: its own first narrow
    assert torch.equal(rec.row_literal(other, 1), other[1:2])
    param = nn.Parameter(torch.randn(2, 3))
    assert rec.row_literal(param, 1).grad_fn.name().startswith(("Slice", "Narrow"))
    padded = PaddedRows(torch.arange(12.0).view(3, 4), 1, np.array([2, 4, 1], np.int64))
    assert torch.equal(rec.row_literal(padded, 0), torch.tensor([[0.0, 1.0]]))


def test_rows_of_a_rounds_output_come_from_one_split_from_the_second_row_on():
    """``_Recorder.row_of`` (an example's result, or its value in the eager finish): the
    first row asked of an output is an index, every later one a row of one ``split``, a
    ``PaddedRows`` row cut to its length; values, storage and gradients are the index's.
    Per-sentence results of an encoder (stack=False) so reach their output through one
    backward node, and equal eager (float64)."""
    rec = recorder._Recorder()
    src = torch.randn(4, 3, requires_grad=True) * 1.0
    first, second, third = rec.row_of(src, 2), rec.row_of(src, 0), rec.row_of(src, 3)
    assert "Split" not in str(first.grad_fn.next_functions)
    assert second.grad_fn.next_functions[0][0] is third.grad_fn.next_functions[0][0]
    assert "Split" in second.grad_fn.next_functions[0][0].name()
    for row, r in ((first, 2), (second, 0), (third, 3)):
        assert (
            row.shape == (3,) and torch.equal(row, src[r]) and row.data_ptr() == src[r].data_ptr()
        )
    w = torch.randn(3)
    (grad,) = torch.autograd.grad(((first + second * 2 + third * 3) * w).sum(), src)
    want = torch.zeros(4, 3)
    want[2], want[0], want[3] = w, 2 * w, 3 * w
    torch.testing.assert_close(grad, want)
    data = torch.arange(24.0).view(3, 4, 2)
    padded = PaddedRows(data, 1, np.array([2, 4, 1], np.int64))
    rows = [rec.row_of(padded, i) for i in (1, 0, 2)]
    for row, i, n in zip(rows, (1, 0, 2), (4, 2, 1)):
        assert torch.equal(row, data[i, :n])

    torch.manual_seed(9)
    emb, lstm = nn.Embedding(20, 3).double(), nn.LSTM(3, 4).double()
    sentences = [torch.randint(0, 20, (n,)) for n in (3, 5, 2, 5, 4)]
    got = fold.autobatch(lambda w: lstm(emb(w))[0], sentences, stack=False)
    splits = {g.grad_fn.next_functions[0][0] for g in got[1:]}  # (narrow, select, split)
    splits = {s.next_functions[0][0] for s in splits}
    assert len(splits) == 1 and "Split" in next(iter(splits)).name()
    want = [lstm(emb(w))[0] for w in sentences]
    assert_same_lists([(g,) for g in got], [(w,) for w in want], list(lstm.parameters()))


@pytest.mark.parametrize("mask", ["known", "computed", "shared"])
def test_masked_fill_runs_directly(mask):
    """``scores.masked_fill(~torch.tensor(ok), -inf)`` (a parser's legal actions), a mask
    computed from the example, or one eager mask for all: one direct call for the group.
    Eager's values and gradients."""
    lin = nn.Linear(3, 3)
    xs = [torch.randn(3) for _ in range(5)]
    oks = [[True, i % 2 == 0, i % 3 != 0] for i in range(5)]
    shared = torch.tensor([False, True, False])

    def fn(x, ok):
        s = lin(x)
        m = ~torch.tensor(ok) if mask == "known" else x > 0 if mask == "computed" else shared
        return torch.softmax(s.masked_fill(m, -1e4), 0)

    assert_same(fn, list(lin.parameters()), xs, oks)
    ops = [op for op in _OPS.values() if op.fn is torch.Tensor.masked_fill]
    assert ops and all(op.mode is common._DIRECT for op in ops)


def test_the_tutorials_training_step_equals_eager():
    """The training step of PyTorch's seq2seq tutorial, as written for one pair: the encoder
    (a module of one's own holding a GRU on a batch of one) fills a buffer in place
    (``encoder_outputs[ei] = out[0, 0]``), the decoder attends over it, and the loss adds up
    step by step (``loss += criterion(...)`` from ``loss = 0``), with teacher forcing for
    some pairs and the decoder's own ``topi.item()`` (a read, until EOS) for the others.
    Eager's losses and gradients."""
    torch.manual_seed(0)
    hidden, vocab, maxlen, eos = 5, 6, 8, 1

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(vocab, hidden)
            self.gru = nn.GRU(hidden, hidden)

        def forward(self, tok, h):
            return self.gru(self.embedding(tok).view(1, 1, -1), h)

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(vocab, hidden)
            self.attn = nn.Linear(2 * hidden, maxlen)
            self.gru = nn.GRU(2 * hidden, hidden)
            self.out = nn.Linear(hidden, vocab)

        def forward(self, tok, h, mem):
            e = self.embedding(tok).view(1, 1, -1)
            w = F.softmax(self.attn(torch.cat((e[0], h[0]), 1)), dim=1)
            applied = torch.bmm(w.unsqueeze(0), mem.unsqueeze(0))
            o, h = self.gru(torch.cat((e, applied), 2), h)
            return F.log_softmax(self.out(o[0]), dim=1), h

    enc, dec = Encoder(), Decoder()
    criterion = nn.NLLLoss()

    def train(src, tgt, forcing):
        h = torch.zeros(1, 1, hidden)
        encoder_outputs = torch.zeros(maxlen, hidden)
        for ei in range(src.size(0)):
            out, h = enc(src[ei], h)
            encoder_outputs[ei] = out[0, 0]
        tok, loss = torch.tensor([[0]]), 0
        for di in range(tgt.size(0)):
            logp, h = dec(tok, h, encoder_outputs)
            loss += criterion(logp, tgt[di])
            if forcing:
                tok = tgt[di]
            else:
                topv, topi = logp.topk(1)
                tok = topi.squeeze().detach()
                if tok.item() == eos:
                    break
        return loss / tgt.size(0)

    g = torch.Generator().manual_seed(1)
    srcs = [torch.randint(2, vocab, (n,), generator=g) for n in (3, 7, 5, 4, 6, 2)]
    tgts = [torch.randint(0, vocab, (n, 1), generator=g) for n in (4, 2, 6, 3, 5, 7)]
    forcing = [True, False, True, False, False, True]
    assert_same(train, [*enc.parameters(), *dec.parameters()], srcs, tgts, forcing)


def test_negated_known_flags_stay_known():
    """``~torch.tensor(ok)`` of Python flags (a parser's illegal actions) is the known value
    of the negated flags (no tensor made), as eager's ``~`` gives them; of one flag too."""
    seen = []

    def fn(x, ok):
        m, one = ~torch.tensor(ok), ~torch.tensor(ok[0])
        seen.append((type(m), m.tolist(), m.dtype, type(one), bool(one)))
        return x.masked_fill(m, 0.0) + one

    xs = [torch.randn(3) for _ in range(3)]
    oks = [[True, False, i == 1] for i in range(3)]
    torch.testing.assert_close(
        fold.autobatch(fn, xs, oks), torch.stack([fn(x, ok) for x, ok in zip(xs, oks)])
    )
    for (t, got, dtype, t1, b), ok in zip(seen[:3], oks):
        assert t is values.Known and t1 is values.Known and dtype is torch.bool
        assert got == [not o for o in ok] and b is (not ok[0])


def test_a_batchable_function_returning_python_values_is_a_fold_error():
    """A ``@fold.batchable`` function runs as one recorded call per group: its results must
    be tensors; a Python value among them is a FoldError naming the call and the fix (a
    module of one's own returning one is run through instead, see above)."""

    @fold.batchable
    def scored(h):
        return h.tanh(), 3

    with pytest.raises(fold.FoldError, match=r"returns tuple, not tensors.*Fix: compute"):
        fold.autobatch(lambda x: scored(x * 2)[0], [torch.randn(3) for _ in range(2)])


def test_combinations_of_lengths_equal_numpys_unique():
    """``ops._combinations`` (a count of each length where the ragged columns share their
    lengths) gives what ``np.unique`` of the columns' combined codes gives: the distinct
    combinations in order and each row's index among them."""
    rng = np.random.default_rng(0)
    for trial in range(500):
        n = int(rng.integers(0, 20))
        a = rng.integers(0, 8, n)
        b = rng.integers(0, 8, n)
        cols = [[a], [a, a.copy()], [a, b]][trial % 3]
        aops.forget_combinations()
        combos, inv = aops._combinations(cols)
        stacked = np.stack(cols) if n else np.zeros((len(cols), 0), np.int64)
        uniq, first, want = np.unique(
            stacked.T.tolist() if n else np.zeros((0, len(cols))),
            axis=0,
            return_index=True,
            return_inverse=True,
        )
        assert combos == [tuple(stacked[:, i].tolist()) for i in first]
        assert np.array_equal(np.asarray(inv).ravel(), np.asarray(want).ravel())


# Calls whose arguments after the tensor are passed by keyword, each the same call by
# position (values._BUILTIN_POSITIONAL, values._given): method and function forms; and
# dims given otherwise than as one int (none: ``amax(h, ())``; one by one: ``flip(0, 1)``).
_KEYWORD_CALLS = {
    "sum": lambda h: h.sum(dim=1, keepdim=True) + torch.sum(h, dim=0),
    "mean": lambda h: h.mean(dim=1, keepdim=True) + torch.mean(h, keepdim=False, dim=0),
    "prod": lambda h: h.prod(dim=1, keepdim=True) + torch.prod(h, dim=0),
    "amax, amin": lambda h: h.amax(dim=1, keepdim=True) - torch.amin(h, dim=0),
    "amax of no dims": lambda h: h * torch.amax(h, dim=(), keepdim=True) + torch.amin(h, ()),
    "flip": lambda h: h.flip(0, 1) + h.flip([1]) + torch.flip(h, dims=(0,)),
    "logsumexp": lambda h: h.logsumexp(dim=1, keepdim=True) + torch.logsumexp(h, dim=0),
    "argmax, argmin": lambda h: h * h.argmax(dim=1, keepdim=True) + torch.argmin(h, dim=0),
    "all, any": lambda h: h * (h > 0).all(dim=1, keepdim=True) + torch.any(h > 1, dim=0),
    "max, min": lambda h: h.max(dim=1, keepdim=True).values + torch.min(h, dim=0)[0],
    "softmax": lambda h: h.softmax(dim=1) + torch.log_softmax(h, dim=0) + F.softmax(h, dim=1),
    "cumsum, cumprod": lambda h: h.cumsum(dim=1) + torch.cumsum(h, dim=0) + h.cumprod(dim=1),
    "nansum, median": lambda h: (
        h.nansum(dim=1, keepdim=True) + torch.median(h, dim=0, keepdim=False).values
    ),
    "chunk, unbind": lambda h: (
        torch.cat(h.chunk(2, dim=1), 1) + torch.stack(torch.unbind(h, dim=0))
    ),
    "squeeze, unsqueeze": lambda h: (
        h[:1].squeeze(dim=0).unsqueeze(dim=0) + torch.squeeze(h[:, :1], dim=1).unsqueeze(dim=1)
    ),
    "flatten": lambda h: h.flatten(start_dim=0, end_dim=1) + torch.flatten(h, end_dim=-1),
    "transpose": lambda h: (
        h.transpose(dim0=0, dim1=1).sum(1) + torch.transpose(h, 1, dim1=0).sum(1)
    ),
    "narrow, select": lambda h: (
        h.narrow(dim=1, start=1, length=2).sum(1) + torch.select(h, dim=1, index=0)
    ),
    "index_select, gather": lambda h: (
        h.index_select(dim=1, index=torch.tensor([2, 0]))
        + torch.gather(h, dim=1, index=torch.tensor([[1, 1], [0, 2], [3, 0]]))
    ),
    "topk": lambda h: h.topk(k=2, dim=1, largest=False).values + torch.topk(h, 2, dim=1)[0],
    "sort, argsort": lambda h: (
        h.sort(dim=1, descending=True).values + h * torch.argsort(h, dim=1, descending=True)
    ),
}


@pytest.mark.parametrize("name", list(_KEYWORD_CALLS))
def test_calls_with_keyword_arguments_equal_eager(name):
    """Tensor methods and torch functions given their dims (and the like) by keyword, as
    people write them (``h.sum(dim=1, keepdim=True)``, ``h.argmax(dim=-1)``,
    ``F.softmax(h, dim=1)``): recorded as the same calls by position, where the fast path
    takes them; values and gradients equal eager, per example and recorded once for all
    rows, twice (the second call from the first's tables)."""
    lin = nn.Linear(4, 12).double()
    call = _KEYWORD_CALLS[name]

    def fn(x):
        return call(lin(x).view(3, 4))

    xs = torch.randn(5, 4, dtype=torch.float64)
    for _ in range(2):
        assert_same(fn, list(lin.parameters()), xs)
        assert_same(fn, list(lin.parameters()), list(xs))


@pytest.mark.parametrize("method", [False, True], ids=["function", "method"])
@pytest.mark.parametrize("name", ["argmax", "argmin"])
def test_argmax_over_all_with_keepdim_keeps_every_dim(name, method):
    """``torch.argmax(h, keepdim=True)`` over all of a per-example matrix keeps both dims
    as 1, as eager does ((1, 1)); torch's vmap gives one dim, so the group runs directly.
    Per example, from stacked rows, and with a dim."""
    lin = nn.Linear(4, 12)

    def fn(x):
        h = lin(x).view(3, 4)
        call = getattr(h, name) if method else functools.partial(getattr(torch, name), h)
        return call(keepdim=True), call(None, True), call(1, keepdim=True)

    xs = torch.randn(5, 4)
    want = eager_stack(fn, xs)
    assert want[0].shape == (5, 1, 1)
    for got in (
        fold.autobatch(fn, xs),
        fold.autobatch(fn, list(xs)),
        fold.autobatch(fn, xs, per_example=True),
    ):
        for g, w in zip(got, want):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w)


@pytest.mark.parametrize("program", [False, True], ids=["under vmap", "as a program"])
def test_a_vmap_batching_rule_giving_other_shapes_is_caught(program, caplog, monkeypatch):
    """A module whose forward torch's vmap runs with a batching rule that gives another
    shape than one call (``torch.argmax(h, keepdim=True)``: ``(n, 1)`` for per-example
    matrices, where one call gives ``(1, 1)``): the op's first group is checked against one
    call of it, and its groups run one call per example, said in a warning; values equal
    eager (they came back as ``(n, 1)`` before).  A module's forward runs as a program of
    its calls where it can be recorded once (the argmax run directly, no warning); the
    check is for what runs under vmap (here, with the program made impossible)."""
    if not program:
        monkeypatch.setattr(aops.HOOKS, "compile", lambda op: False)

    class Peak(nn.Module):
        def forward(self, h):
            return torch.argmax(h, keepdim=True) + h.sum()

    peak, lin = Peak(), nn.Linear(4, 12)

    def fn(x):
        return peak(lin(x).view(3, 4))

    xs = [torch.randn(4) for _ in range(5)]
    with caplog.at_level(logging.WARNING, logger="fold"):
        got = fold.autobatch(fn, xs, per_example=True)
    want = torch.stack([fn(x) for x in xs])
    assert got.shape == want.shape == (5, 1, 1)
    torch.testing.assert_close(got, want)
    assert ("other shapes than one call" in caplog.text) is not program
    torch.testing.assert_close(fold.autobatch(fn, xs, per_example=True), want)  # (looped)


# Calls with a dim on a per-example number (a 0-dim value): torch takes dim 0 or -1 of one
# number as the number itself (a softmax of it is 1, a cumsum or flip gives it back); stacked,
# dim -1 is the batch dim, and such calls ran over the batch (silently wrong values).
_NUMBER_DIMS = {
    "softmax": lambda s: torch.softmax(s, -1) + torch.log_softmax(s, dim=-1) + s.softmax(0),
    "cumsum": lambda s: torch.cumsum(s, -1) * s.cumprod(0) + s.logcumsumexp(-1),
    "flip, squeeze": lambda s: s.flip(-1) + s.squeeze(-1) * 2,
    "unsqueeze, stack": lambda s: (s.unsqueeze(-1) * torch.stack([s, s * 2], -1)).sum(-1),
    "sum, amax, mean": lambda s: s.sum(-1) + s.amax(0) * s.mean(dim=-1),
}


@pytest.mark.parametrize("name", list(_NUMBER_DIMS))
def test_dims_of_a_number_per_example_equal_eager(name):
    """A dim op on a per-example number (``torch.softmax(score, -1)``, ``s.cumsum(-1)``):
    values and gradients equal eager, per example and from rows; ops that add a dim
    (``unsqueeze``, ``stack``) keep running directly."""
    lin = nn.Linear(4, 3).double()
    call = _NUMBER_DIMS[name]

    def fn(x):
        h = lin(x)
        return call(h.sum()) * h

    xs = torch.randn(5, 4, dtype=torch.float64)
    driver.clear_cache()  # (the ops below are this test's alone)
    with warnings.catch_warnings():  # (flip and squeeze of a number: vmap cannot, a loop)
        warnings.filterwarnings("ignore", message=".*does not run under torch.func.vmap")
        assert_same(fn, list(lin.parameters()), xs)
        assert_same(fn, list(lin.parameters()), list(xs))
    if name == "unsqueeze, stack":
        ups = [op for op in _OPS.values() if op.fn in tables._RANK_UP]
        assert ups and all(op.mode is common._DIRECT for op in ups)


# Dim ops run directly on the stacked values (their dim moved past the batch dim), where
# they ran under vmap: a decoder's ``logits.topk(1)`` at every step, sorts, cumulative ops.
_DIRECT_DIM_CALLS = {
    "topk": lambda h: (
        h.topk(2).values.sum(1, keepdim=True) * torch.topk(h, 1, 0)[1] + h.topk(k=1, dim=-1)[0]
    ),
    "kthvalue": lambda h: h.kthvalue(2).values[:, None] + torch.kthvalue(h, 1, 0, True).values,
    "sort": lambda h: h.sort().values * torch.sort(h, 0, descending=True).indices,
    "argsort": lambda h: h * h.argsort() + h * torch.argsort(h, 0, descending=True),
    "mode": lambda h: h * h.round().mode().values[:, None] + torch.mode(h.round(), 0).values,
    "median": lambda h: h.median(-1).values[:, None] * torch.median(h, 0, keepdim=True).values,
    "cumprod, cummax, cummin": lambda h: (
        h.cumprod(0) * h.cummax(-1).values + torch.cummin(h, dim=0).indices
    ),
    "logcumsumexp": lambda h: h.logcumsumexp(0) + torch.logcumsumexp(h, -1),
    "nansum, nanmean": lambda h: h * h.nansum() + h.nansum(0) + torch.nanmean(h, -1, True),
    "count_nonzero": lambda h: (
        h * (h > 0).count_nonzero() + torch.count_nonzero(h > 0, -1)[:, None]
    ),
    "glu": lambda h: F.glu(h).repeat(1, 2) + F.glu(torch.cat([h, h.flip(0)]), 0),
    "diff": lambda h: h.diff()[:, :2] * torch.diff(h, 1, 0)[:, :2].sum() + h.diff(n=2, dim=-1),
}


@pytest.mark.parametrize("name", list(_DIRECT_DIM_CALLS))
def test_dim_calls_run_directly_and_equal_eager(name):
    """``topk``, ``sort``, ``argsort``, ``kthvalue``, ``mode``, ``median``, the cumulative
    ops, ``nansum``, ``count_nonzero``, ``glu`` and ``diff`` with their dims given, by
    keyword, or by default (-1): values and gradients equal eager, per example and from
    rows, and their groups run directly (one call each, not under vmap)."""
    lin = nn.Linear(4, 12).double()
    call = _DIRECT_DIM_CALLS[name]

    def fn(x):
        return call(lin(x).view(3, 4))

    xs = torch.randn(5, 4, dtype=torch.float64)
    driver.clear_cache()  # (the ops below are this test's alone)
    assert_same(fn, list(lin.parameters()), xs)
    assert_same(fn, list(lin.parameters()), list(xs))
    names = set(re.findall(r"[a-z_]+", name))  # (the functions the case is named after)
    ops = [op for op in _OPS.values() if getattr(op.fn, "__name__", None) in names]
    assert {op.fn.__name__ for op in ops} == names
    assert all(op.mode is common._DIRECT for op in ops), [
        (op.name, op.mode) for op in ops if op.mode is not common._DIRECT
    ]


# Dim ops drawn for the property test below: name -> call on (value, dim), each taking a dim
# in -rank .. rank - 1 of a value of ``rank`` dims (``rank + 1`` for those that add one).
_DIM_CALLS = {
    "softmax": lambda x, d: torch.softmax(x, d),
    "log_softmax": lambda x, d: F.log_softmax(x, dim=d),
    "sum": lambda x, d: x.sum(d),
    "mean keepdim": lambda x, d: x.mean(d, keepdim=True),
    "amax": lambda x, d: x.amax(d),
    "cumsum": lambda x, d: x.cumsum(d),
    "cumprod": lambda x, d: torch.cumprod(x, dim=d),
    "logcumsumexp": lambda x, d: x.logcumsumexp(d),
    "flip": lambda x, d: x.flip(d),
    "logsumexp": lambda x, d: x.logsumexp(d),
    "max": lambda x, d: x.max(d).values,
    "sort": lambda x, d: x.sort(d).values,
    "topk": lambda x, d: x.topk(1, d).values,
    "norm": lambda x, d: x.norm(dim=d),
    "squeeze": lambda x, d: x.squeeze(d),
    "unsqueeze": lambda x, d: x.unsqueeze(d),
    "stack": lambda x, d: torch.stack([x, x * 2], d),
}
_RANK_UPS = {"unsqueeze", "stack"}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.sampled_from(sorted(_DIM_CALLS)), st.integers(0, 3), st.integers(0, 7)),
        min_size=1,
        max_size=4,
    ),
    st.booleans(),
)
def test_dim_calls_on_values_of_any_rank_equal_eager(calls, rows):
    """Chains of dim ops on per-example values of rank 0 to 3 (a number, a vector, ...), each
    with a dim drawn from the range torch takes for it (``-1`` and ``0`` of a number
    included): values and gradients equal eager, per example and from rows."""
    lin = nn.Linear(3, 24).double()

    def fn(x):
        out = lin(x).sum() * 0
        for name, rank, pick in calls:
            v = lin(x)[: (1, 2, 6, 24)[rank]].reshape(((), (2,), (2, 3), (2, 3, 4))[rank])
            span = rank + (name in _RANK_UPS)
            d = pick % (2 * span) - span if span else (pick % 2) - 1  # (-1 or 0 of a number)
            out = out + _DIM_CALLS[name](v, d).sum()
        return out

    xs = torch.randn(4, 3, dtype=torch.float64)
    with warnings.catch_warnings():  # (a number's flip and squeeze: a loop, said once)
        warnings.filterwarnings("ignore", message=".*does not run under torch.func.vmap")
        assert_same(fn, list(lin.parameters()), xs if rows else list(xs))


_ROOT = nn.Parameter(torch.randn(3, dtype=torch.float64))
_LIST_LIN = nn.Linear(3, 3).double()


@fold.batchable(batched=True)
def _list_total(items):
    return items.sum() * items.lengths.to(items.values.dtype)[:, None]


# Lists given to a batched function that hold tensors beside (or in place of) lazy values.
_MIXED_LISTS = {
    "a constant beside a lazy value": lambda x: [_LIST_LIN(x), torch.ones(3, dtype=x.dtype)],
    "tensors made per example": lambda x: [torch.ones(3, dtype=x.dtype), torch.full_like(x, 2)],
    "the example's input": lambda x: [x, x * 2],
    "a parameter beside a lazy value": lambda x: [_ROOT, _LIST_LIN(x)],
    "a parameter alone": lambda x: [_ROOT, _ROOT * 1],
    "a known value": lambda x: [torch.tensor([1.0, 2.0, 3.0], dtype=x.dtype), _LIST_LIN(x)],
}


@pytest.mark.parametrize("rows", [False, True], ids=["per example", "rows"])
@pytest.mark.parametrize("name", list(_MIXED_LISTS))
def test_a_batched_functions_list_of_tensors_and_lazy_values_equals_eager(name, rows):
    """A ``@fold.batchable(batched=True)`` function given a list that holds tensors beside
    lazy values (a constant, the example's input, a parameter: ``[self.root, h]``), or
    tensors alone: a Ragged of the list, as eager code's one call gives it (each tensor a
    node of the example first); values and gradients equal eager, the parameter's too.  It
    was a FoldError naming the function's failure on a plain list."""
    make = _MIXED_LISTS[name]

    def fn(x):
        return _LIST_LIN(x) + _list_total(make(x))

    xs = torch.randn(4, 3, dtype=torch.float64)
    assert_same(fn, [*_LIST_LIN.parameters(), _ROOT], xs if rows else list(xs))


class _CellModule(nn.Module):
    """A TreeLSTM-style cell written as a module of one's own (no annotation)."""

    def __init__(self) -> None:
        super().__init__()
        self.gates = nn.Linear(6, 9)
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, lh, rh):
        i, o, u = self.gates(torch.cat([lh, rh])).chunk(3)
        c = torch.sigmoid(i) * torch.tanh(u) * (2.0 if self.training else 1.0)
        return torch.sigmoid(o) * torch.tanh(c) * self.scale, c


@pytest.mark.parametrize("training", [True, False])
def test_a_module_of_ones_own_recorded_whole_runs_its_groups_as_a_program(training, monkeypatch):
    """A module of the user's own recorded whole (one node per call) runs each group as the
    calls its forward makes, recorded once on lazy values standing for the group (each
    call on the group's batch), not under vmap: vmap never runs; values and gradients equal
    eager per example, in training and in eval mode (its forward reads ``self.training``)."""
    cell = _CellModule().double().train(training)
    lin = nn.Linear(3, 3).double()
    driver.clear_cache()  # (the ops below are this test's alone)

    def fn(x):
        h, c = cell(lin(x), x)
        h2, c2 = cell(h, c[:3])
        return h2 + c2[:3]

    xs = list(torch.randn(6, 3, dtype=torch.float64))
    got = fold.autobatch(fn, xs, per_example=True)
    want = eager_stack(fn, xs)
    torch.testing.assert_close(got, want)
    assert_same_grads(got, want, [*cell.parameters(), *lin.parameters()])
    ops = [op for op in _OPS.values() if op.fn is cell]
    assert ops and all(op._vmapped is None for op in ops)  # (recorded whole, never vmapped)


def test_a_channels_last_layout_of_a_per_example_value_equals_eager():
    """``contiguous``/``to``/``clone`` with ``memory_format=torch.channels_last`` on an
    example's 4-D value (a conv's output of ``x[None]``): the stacked values have one dim
    more, which that layout does not take (a FoldError); the values are the same in any
    layout, so the stacked ones keep the usual one."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3)

    def fn(x):
        y = conv(x.unsqueeze(0))
        a = y.contiguous(memory_format=torch.channels_last)
        b = y.to(memory_format=torch.channels_last)
        c = y.clone(memory_format=torch.channels_last)
        return (a + 2 * b + 3 * c).sum((0, 1))

    xs = [torch.randn(3, 6, 6, requires_grad=True) for _ in range(3)]
    assert_same(fn, [*conv.parameters(), *xs], xs)


def test_sparse_adjacency_per_example_and_shared_equals_eager():
    """A graph convolution written for one graph, ``relu(A @ W(h))`` twice: each example's
    own sparse adjacency (several sizes; some examples dense: a sparse and a dense value of
    one shape are never one group, and sparse ones are never padded), one sparse matrix
    shared by every example used twice (its group's stack cannot broadcast: bmm), a sparse
    matrix on the right, and ops on the sparse values themselves."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)

    def graph(n, sparse):
        a = (torch.rand(n, n) < 0.4).double() * torch.rand(n, n)
        return a.to_sparse() if sparse else a

    sizes = (4, 5, 4, 6, 4, 4, 5)
    xs = [torch.randn(n, 3, requires_grad=True) for n in sizes]
    adjs = [graph(n, i % 3 != 1) for i, n in enumerate(sizes)]
    shared = graph(4, True)

    def gcn(x, a):
        h = torch.relu(a @ lin(torch.relu(a @ lin(x))))
        right = lin(x).t() @ (a * 2).t()
        return torch.cat([h.sum(0), right.sum(1), (a @ lin(x)[:, 0]).sum()[None]])

    def shared_twice(x):
        return (shared @ lin(shared @ (x * 2))).sum(0)

    params = [*lin.parameters(), *xs]
    assert_same(gcn, params, xs, adjs)
    assert_same(shared_twice, params, [x for x in xs if len(x) == 4])
