"""The C hot path of autobatch's recording (fold/_clazy.c) against the slow path.

``fold.autobatch.recorder`` looks a call up in the recorder's fast table with ``_C.fast`` where the
extension is built and with the generated Python functions (``_py_fast``) otherwise.  Where
either finds a call, it must give what the slow path (``_Recorder.record`` building the op
key) gives for it: the same node, with the same per-example outputs (single, tuple, or
another structure made by the op's wrap).  Random argument tuples over every kind of value
a call can see (lazy values of this recorder and of another, lists and tuples of them,
modules, number tensors with and without gradients, other tensors, ints, bools, floats with
both zeros, None), against a table filled by the slow path on real calls.
``tests/test_autobatch.py`` checks the values.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

import fold
from fold._encoding import low_bits
from fold.autobatch import common, patches, recorder, values

C = common._C


def _same_gradients(got: torch.Tensor, want: torch.Tensor, params: list[torch.Tensor]) -> None:
    """The gradients of ``params`` under the same random weighting of ``got`` (batched) and
    ``want`` (eager) are equal."""
    w = torch.randn_like(want)
    for a, b in zip(
        torch.autograd.grad((got * w).sum(), params),
        torch.autograd.grad((want * w).sum(), params),
    ):
        torch.testing.assert_close(a, b)


def test_c_lazy_path_is_built() -> None:
    """The install compiles the extension (setup.py); a failed build would leave autobatch on
    its slower Python path without a word, so the suite says so."""
    if os.environ.get("FOLD_RECORDER") == "python":
        pytest.skip("FOLD_RECORDER=python: recording without the C fast paths, as asked")
    assert C is not None, "fold._clazy was not built: reinstall with a C compiler"
    assert values.Lazy.__mro__[1] is C.LazyBase
    assert recorder._fast_path is C.fast


def _pair(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x + y, x * y


def _nested(x: torch.Tensor) -> dict[str, Any]:
    return {"a": x.sin(), "b": [x.cos()]}


def _through(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).tanh()


def _leaf(m: nn.Module, w: torch.Tensor) -> torch.Tensor:
    return m(w) * 2


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w * x


class _World:
    """A recorder with lazy values and a fast table filled by real calls."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)
        self.emb = nn.Embedding(10, 3)
        self.scale = _Scale()
        self.rec = recorder._Recorder()
        other = recorder._Recorder()
        installed = patches._installed()
        installed.__enter__()
        common._LOCAL.rec = other
        try:
            self.foreign = self.lin(torch.randn(3))
            common._LOCAL.rec = self.rec
            a = self.lin(torch.randn(3))
            b = self.lin(torch.randn(3))
            c = torch.cat([a, b])
            self.lazies = [a, b, c]
            per = common._PER_EXAMPLE
            T = torch.Tensor
            # The torch functions themselves: while autobatch's wrappers are installed (as
            # here), torch.cat is a wrapper that passes torch's own function on.
            torch_fn = {
                f: getattr(f, "__wrapped__", f) for f in (torch.cat, torch.stack, torch.tanh)
            }
            linear = getattr(nn.functional.linear, "__wrapped__", nn.functional.linear)
            self.calls = [
                (T.chunk, "torch", (c, 2)),
                (T.__mul__, "torch", (a, 0.5)),
                (T.__mul__, "torch", (a, 0.0)),
                (T.__mul__, "torch", (a, -0.0)),
                (T.__mul__, "torch", (a, 2)),
                (T.sum, "torch", (a, 0, True)),
                (torch.nan_to_num, "torch", (a, 1.5, None)),
                (torch_fn[torch.cat], "torch", ([a, b],)),
                (torch_fn[torch.stack], "torch", ((a, b, c[:3]),)),
                (torch.add, "torch", (a, b)),
                (torch_fn[torch.tanh], "torch", (c,)),
                # A parameter argument: shared by every call, keyed by identity.
                (T.__matmul__, "torch", (self.lin.weight, a)),
                (linear, "torch", (a, self.lin.weight, self.lin.bias)),
                (torch.Tensor.__mul__, "torch", (a, a)),
                (_pair, per, (a, b)),
                (_pair, per, (c, c)),
                (_nested, per, (a,)),
                (_through, per, (self.lin, a)),
                (self.lin, "module", (b,)),
                # Eager number tensors (torch.as_tensor), and known values (torch.tensor
                # inside autobatch: patched while it records).
                (self.emb, "module", (torch.as_tensor(3),)),
                (self.scale, "module", (torch.as_tensor(0.5),)),
                # float64 is not the default dtype: it travels as a tensor, never fast.
                (self.scale, "module", (torch.as_tensor(0.5, dtype=torch.float64),)),
                (_leaf, per, (self.emb, torch.as_tensor(4))),
                (self.emb, "module", (torch.tensor(3),)),
                (self.scale, "module", (torch.tensor(0.5),)),
                (self.scale, "module", (torch.tensor(0.5, dtype=torch.float64),)),
                (_leaf, per, (self.emb, torch.tensor(4))),
                (_pair, per, (a, torch.tensor(1.5))),
                # Indexes and sizes: ints, bools, None, Ellipsis and slices, alone or in a
                # tuple (x[0, 0], h[:, -1], x[1:]), keyed by value in C too.
                (T.__getitem__, "torch", (c, slice(1, None))),
                (T.__getitem__, "torch", (c, (slice(None, 4, 2), None))),
                (T.__getitem__, "torch", (c, (Ellipsis, None))),
                (T.__getitem__, "torch", (c, Ellipsis)),
                (T.__getitem__, "torch", (c, (1,))),
                (T.__getitem__, "torch", (c, (True,))),
                (T.view, "torch", (c, (2, 3))),
                (T.view, "torch", (c, (3, -1))),
            ]
            self.known = [torch.tensor(5), torch.tensor(2.5), torch.tensor(True), torch.tensor([1])]
            assert all(type(k) is values.Known for k in self.known)
            for fn, kind, args in self.calls:
                self.rec.record(fn, kind, args, {})
        finally:
            common._LOCAL.rec = None
            installed.__exit__(None, None, None)
        self.values = [
            *self.lazies,
            self.foreign,
            self.lin,
            self.emb,
            self.scale,
            torch.tensor(5),
            torch.tensor(2.5),
            torch.tensor(True),
            torch.tensor(1.0, requires_grad=True),
            torch.tensor([1, 2]),
            torch.tensor(2.0, dtype=torch.float64),
            *self.known,
            [a, b],
            [a, self.foreign],
            (b, a),
            [],
            None,
            3,
            2,
            1,
            True,
            0.5,
            2.0,
            1.0,
            0.0,
            -0.0,
            slice(1, None),
            slice(0, 2, 1),
            slice(None, 4, 2),
            slice(0.5, 2),
            Ellipsis,
            (1,),
            (True,),
            (1, True),
            (Ellipsis, None),
            (slice(None, 4, 2), None),
            (slice(None), 1.5),
            (2, 3),
            (3, 2),
            (3, -1),
            (),
        ]


_WORLD: _World | None = None


def _world() -> _World:
    global _WORLD
    if _WORLD is None:
        _WORLD = _World()
    return _WORLD


def _slow(rec: Any, fn: Any, kind: str, args: tuple[Any, ...]) -> Any:
    """The call through the slow path alone (the fast path made to miss)."""
    old = recorder._fast_path
    recorder._fast_path = lambda *a: common._MISS
    try:
        return rec.record(fn, kind, args, {})
    finally:
        recorder._fast_path = old


def _check(w: _World, fn: Any, kind: str, args: tuple[Any, ...]) -> int:
    """Each fast path's outcome equals the slow path's where it finds the call; the number
    of paths that found it."""
    hits = 0
    for path in (C.fast, recorder._py_fast):
        if path is recorder._py_fast and not 0 < len(args) <= len(recorder._FAST):
            continue
        got = _outcome(path, w.rec, fn, kind, args)
        if got == "miss":
            continue
        hits += 1
        common._LOCAL.rec = w.rec
        try:
            want = _outcome(_slow, w.rec, fn, kind, args)
        finally:
            common._LOCAL.rec = None
        assert got == want, (path, fn, kind, args)
    return hits


def _outcome(fn: Any, *args: Any) -> Any:
    try:
        out = fn(*args)
    except Exception as err:  # both paths must raise alike
        return ("raised", type(err))
    if out is common._MISS:
        return "miss"
    leaves = [x for x in _flat(out)]
    rec = args[0]
    return (
        type(out),
        [(type(x), _node(rec, x.node) if isinstance(x, values.Lazy) else x) for x in leaves],
        [x.meta if isinstance(x, values.Lazy) else None for x in leaves],
    )


def _node(rec: Any, node: Any) -> Any:
    """A node as the two paths must agree on it: its handle; or where its arguments hold a
    literal tensor row (each call then makes a node of its own, of a new row), its
    signature, its output and the rows' values."""
    f = rec.fold
    h = int(node)
    whole = h - low_bits(h)
    for sid, memo in enumerate(f._memos):
        if f._targs[sid] is None:
            continue
        handles = list(memo.values())
        if whole in handles:
            row = f._targs[sid][handles.index(whole)]
            shown = [x.tolist() if isinstance(x, torch.Tensor) else x for x in row]
            return (f.signatures[sid], low_bits(h), shown)
    return h


def _flat(x: Any) -> list[Any]:
    if isinstance(x, (tuple, list)):
        return [y for v in x for y in _flat(v)]
    if isinstance(x, dict):
        return [y for v in x.values() for y in _flat(v)]
    return [x]


@pytest.mark.skipif(C is None, reason="fold._clazy not built")
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_c_and_python_fast_paths_agree(data: Any) -> None:
    w = _world()
    if data.draw(st.booleans()):  # a call seen before, perhaps with one argument swapped
        fn, kind, args = data.draw(st.sampled_from(w.calls))
        args = list(args)
        if data.draw(st.booleans()):
            args[data.draw(st.integers(0, len(args) - 1))] = data.draw(st.sampled_from(w.values))
    else:
        fn, kind, _ = data.draw(st.sampled_from(w.calls))
        args = data.draw(st.lists(st.sampled_from(w.values), min_size=0, max_size=6))
    _check(w, fn, kind, tuple(args))


@pytest.mark.skipif(C is None, reason="fold._clazy not built")
def test_every_call_with_one_argument_swapped_agrees() -> None:
    """Each call seen before, with each argument in turn replaced by each kind of value."""
    w = _world()
    hits = 0
    for fn, kind, args in w.calls:
        for i in range(len(args)):
            for v in w.values:
                hits += _check(w, fn, kind, (*args[:i], v, *args[i + 1 :]))
    assert hits > len(w.calls)


@pytest.mark.skipif(C is None, reason="fold._clazy not built")
def test_every_recorded_call_is_a_hit_in_both_paths() -> None:
    """The filled table is reached: each call seen before gives the same node again, in
    both paths, with outputs in the op's structure."""
    w = _world()
    for fn, kind, args in w.calls:
        if kind == "module" and recorder._INLINE.get(id(fn)) is fn:
            # (a module of one's own called on several shapes is run through from then on:
            # its calls make no op of their own, on either path; see recorder._shapes_vary)
            assert _outcome(C.fast, w.rec, fn, kind, args) == "miss"
            continue
        # (Zeros are keyed with their sign: -0.0 apart from 0.0.  A float64 number tensor
        # travels as a tensor row (not the default dtype), which the C path takes too.)
        assert _check(w, fn, kind, args) >= 1, (fn, kind, args)
        assert _outcome(C.fast, w.rec, fn, kind, args) != "miss"
    structures = {fn: _outcome(C.fast, w.rec, fn, kind, args)[0] for fn, kind, args in w.calls}
    assert structures[_pair] is tuple and structures[_nested] is dict
    assert structures[torch.tanh] is values.Lazy


@pytest.mark.skipif(C is None, reason="fold._clazy not built")
def test_the_c_path_takes_more_arguments_than_python() -> None:
    """Up to MAX_FAST lazy arguments (the generated Python stops at 6): a 10-argument
    batchable call seen before takes the C path, and its values equal eager."""

    @fold.batchable
    def many(*xs: torch.Tensor) -> torch.Tensor:
        return torch.stack(xs).sum(0).tanh()

    lin = nn.Linear(2, 2)
    slow = []
    record = recorder._Recorder.record

    def counted(self: Any, fn: Any, kind: str, args: Any, kwargs: Any) -> Any:
        if fn is many.fn:
            slow.append(len(args))
        return record(self, fn, kind, args, kwargs)

    def fn(x: torch.Tensor) -> torch.Tensor:
        parts = [lin(x * (i + 1)) for i in range(10)]
        return many(*parts) + many(*reversed(parts))

    xs = torch.randn(4, 2)
    ref = torch.stack([fn(x) for x in xs])
    recorder._Recorder.record = counted  # type: ignore[method-assign]
    try:
        out = fold.autobatch(fn, list(xs), per_example=True)
    finally:
        recorder._Recorder.record = record  # type: ignore[method-assign]
    torch.testing.assert_close(out, ref)
    # Only the first of the 8 calls builds its key; the other 7 share it (same metas).
    assert C.MAX_FAST >= 10 and slow == [10]


def test_methods_and_batchable_keep_their_names() -> None:
    assert values.Lazy.__add__.__name__ == "__add__"
    assert values.Lazy.sum.__name__ == "sum"

    @fold.batchable
    def cell(x: torch.Tensor) -> torch.Tensor:
        """A cell."""
        return x

    assert cell.__name__ == "cell" and cell.__doc__ == "A cell."
    assert isinstance(cell, fold.batchable)


# ------------------------------------------------------- crashes found by fuzzing (issue 31)
_SLOTS_SCRIPT = r"""
import gc, torch, fold
from fold import FoldError
from fold.autobatch import Lazy
lin = torch.nn.Linear(3, 3)
out = []

def fn(x):
    y = lin(x)
    for attempt in (lambda: delattr(y, "meta"), lambda: delattr(y, "node"),
                    lambda: setattr(y, "rec", None), lambda: Lazy.__new__(Lazy)):
        try:
            attempt()
            out.append("ok")
        except (FoldError, TypeError) as e:
            out.append(type(e).__name__)
    try:  # past the guard: what a C path must survive
        object.__delattr__(y, "meta")
    except AttributeError:
        pass
    gc.collect()
    for use in (lambda: y + 1, lambda: y.sum(), lambda: torch.tanh(y), lambda: lin(y)):
        try:
            use()
            out.append("ok")
        except FoldError as e:
            out.append("FoldError")
        except AttributeError:
            out.append("AttributeError")
    return lin(x)

fold.autobatch(fn, [torch.randn(3)], per_example=True)
print(" ".join(out))
"""


def _run_script(script: str, recorder: str) -> str:
    """``script`` in a fresh interpreter under the debug allocator (it poisons freed memory,
    so a use after free crashes), on the C or the Python recorder; its output."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONMALLOC="debug")
    env.pop("FOLD_RECORDER", None)
    if recorder == "python":
        env["FOLD_RECORDER"] = "python"
    elif C is None:
        pytest.skip("fold._clazy not built")
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.parametrize("recorder", ["c", "python"])
def test_a_lazy_value_never_lacks_a_field_and_a_missing_one_is_a_fold_error(recorder: str) -> None:
    """Deleting or setting a field of a lazy value, or making one without its fields, is
    refused; one forced past that (object.__delattr__, possible on the Python path) is a
    FoldError at its next use, never a crash (a subprocess, under PYTHONMALLOC=debug)."""
    got = _run_script(_SLOTS_SCRIPT, recorder).split()
    assert got[:4] == ["FoldError", "FoldError", "FoldError", "TypeError"], got
    # The C fields are read-only even to object.__delattr__: still whole, the uses record.
    assert got[4:] == (["ok"] * 4 if recorder == "c" else ["FoldError"] * 4), got


def test_modules_that_compare_equal_are_never_merged() -> None:
    """Two modules whose own __eq__/__hash__ call them equal are keyed by identity: two ops,
    the values of each; fold never calls their __hash__ (which here empties a list)."""
    victims: list[Any] = []

    class Loose(nn.Linear):
        def __eq__(self, other: object) -> bool:
            return isinstance(other, Loose)

        def __hash__(self) -> int:
            for v in victims:
                v.clear()
            return 0

    @fold.batchable
    def through(m: nn.Module, items: list[torch.Tensor]) -> torch.Tensor:
        return m(torch.stack(items).sum(0))

    torch.manual_seed(0)
    a, b = Loose(3, 3), Loose(3, 3)

    def fn(x: torch.Tensor) -> torch.Tensor:
        items = [x.tanh(), x.sin()]
        victims[:] = [items]
        return a(x) + b(x) * 2 + through(a, items) + through(b, items)

    xs = [torch.randn(3) for _ in range(4)]
    for per_example in (True, False):
        got = fold.autobatch(fn, xs, per_example=per_example)
        torch.testing.assert_close(got, torch.stack([fn(x) for x in xs]))


def test_the_fast_key_is_taken_from_the_arguments_as_given() -> None:
    """A list argument changed while the call is recorded (here by the module's forward,
    which shape inference runs) files the op under the key of the list as it was given: a
    later call with the shorter list is an op of its own, with its own values."""
    victim: list[Any] = []

    class Popper(nn.Module):
        def forward(self, items: list[torch.Tensor]) -> torch.Tensor:
            if victim:
                victim.pop().pop()
            return torch.stack(items).sum(0) * len(items)

    popper, lin = Popper(), nn.Linear(3, 3)

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = lin(x)  # lazy: a list of lazy values has a fast key
        three = [h, h.sin(), h.cos()]
        victim[:] = [three]
        first = popper(three)
        victim.clear()
        return first, popper([h.tanh(), h.exp()])

    xs = [torch.randn(3) for _ in range(3)]
    _first, second = fold.autobatch(fn, xs, per_example=True)
    want = torch.stack([(lin(x).tanh() + lin(x).exp()) * 2 for x in xs])
    torch.testing.assert_close(second, want)


_GC_SCRIPT = r"""
import gc, torch, fold
from torch import nn
from torch.nn import functional as F
torch.set_default_dtype(torch.float64)
torch.manual_seed(0)
lin, emb = nn.Linear(4, 4), nn.Embedding(10, 4)

@fold.batchable
def cell(a, b):
    return torch.tanh(lin(a) + b), a * b

def fn(words):
    hs = [emb(torch.tensor(w)) for w in words]
    items = list(hs)
    while len(items) > 1:
        h, _ = cell(items.pop(), items.pop())
        items.append(torch.cat([h]).sum(0, keepdim=True).expand(4) + h)
    return items[0]

examples = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [1, 1, 2]]
gc.set_threshold(1, 1, 1)  # a collection at nearly every allocation, while recording
got = fold.autobatch(fn, examples)
gc.set_threshold(700, 10, 10)
want = torch.stack([fn(w) for w in examples])
print(float((got - want).abs().max()))
"""


@pytest.mark.parametrize("recorder", ["c", "python"])
def test_recording_survives_collections_between_its_steps(recorder: str) -> None:
    """Collections run while keys are built and nodes recorded (gc threshold 1, the debug
    allocator, which poisons freed memory): every reference the fast path holds across
    Python code is its own, and the values equal eager."""
    out = _run_script(_GC_SCRIPT, recorder)
    assert float(out.split()[-1]) < 1e-10, out


@pytest.mark.skipif(C is None, reason="fold._clazy not built")
def test_calls_recorded_without_gradients_take_a_fast_table_of_their_own(monkeypatch: Any) -> None:
    """Under torch.no_grad() (inference, decoding) a call seen before takes the C fast path
    too, from a table of its own: never a grad-mode entry, and the values equal eager."""
    from fold.autobatch import driver

    monkeypatch.setattr(driver, "_POOL_MAX", 0)  # each call its own Fold and tables
    lin = nn.Linear(3, 3)
    slow = []
    record = recorder._Recorder._record

    def counted(self: Any, fn: Any, kind: str, args: Any, kwargs: Any) -> Any:
        slow.append(fn)
        return record(self, fn, kind, args, kwargs)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(lin(x)) * 2

    xs = [torch.randn(3) for _ in range(6)]
    recorder._Recorder._record = counted  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            got = fold.autobatch(fn, xs, per_example=True)
        mixed = fold.autobatch(fn, xs, per_example=True)  # with gradients: other entries
    finally:
        recorder._Recorder._record = record  # type: ignore[method-assign]
    want = torch.stack([fn(x) for x in xs])
    torch.testing.assert_close(got, want.detach())
    torch.testing.assert_close(mixed, want)
    assert not got.requires_grad and mixed.requires_grad
    # lin(x) of an eager tensor has no fast key (each example's tensor is its data); tanh
    # and * 2 of lazy values: once per mode, then the fast tables.
    assert len([f for f in slow if not isinstance(f, nn.Module)]) == 2 * 2


@pytest.mark.skipif(C is None, reason="fold._clazy not built")
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_module_calls_on_eager_tensors_and_known_values_take_the_fast_path(
    grad: bool, monkeypatch: Any
) -> None:
    """A module called on an eager per-example tensor (a row, a torch.zeros) or on a known
    value that is no number (torch.tensor of a list) takes the C fast path after the first
    example, with gradients on and off: the slow path keys each call once (two keys here),
    and the values equal eager."""
    lin = nn.Linear(3, 3)
    keyed: list[Any] = []
    real = C.fast_key
    monkeypatch.setattr(C, "fast_key", lambda *a: keyed.append(a[1]) or real(*a))

    def fn(x: torch.Tensor) -> torch.Tensor:
        return lin(x) + lin(torch.tensor([1.0, 2.0, 3.0]))

    xs = [torch.randn(3) for _ in range(6)]
    with torch.set_grad_enabled(grad):
        got = fold.autobatch(fn, xs, per_example=True)
    want = torch.stack([lin(x) + lin(torch.tensor([1.0, 2.0, 3.0])) for x in xs])
    torch.testing.assert_close(got, want if grad else want.detach())
    assert keyed.count(lin) == 2


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_lists_holding_a_parameter_take_the_fast_path(grad: bool, monkeypatch: Any) -> None:
    """torch.cat([self.root, states]) (a parser's encoder: a parameter row before each
    sentence's states) takes the C fast path after its first example: the slow path keys
    one call per shape, however many examples; the parameter is shared by the op, its
    gradient and the values equal eager's.  A list holding a tensor that needs no gradient
    keeps the slow path (it is a literal row of each call)."""
    if C is None:
        pytest.skip("fold._clazy is not built")
    torch.manual_seed(1)
    lin = nn.Linear(3, 4)
    root = nn.Parameter(torch.randn(1, 4))
    keyed: list[Any] = []
    real = C.fast_key
    monkeypatch.setattr(C, "fast_key", lambda *a: keyed.append(a[1]) or real(*a))

    def fn(x: torch.Tensor) -> torch.Tensor:
        enc = torch.cat([root, lin(x)])  # (1 + len(x), 4)
        return enc.sum(0) + torch.cat([lin(x[:1]), torch.ones(1, 4)]).sum(0)

    xs = [torch.randn(2 + i % 2, 3) for i in range(8)]  # two shapes
    with torch.set_grad_enabled(grad):
        got = fold.autobatch(fn, xs, per_example=True)
        want = torch.stack([fn(x) for x in xs])
    torch.testing.assert_close(got, want)
    assert keyed.count(torch.cat) == 2 + 8  # one per shape; the ones-row list every call
    if grad:
        params = [root, *lin.parameters()]
        _same_gradients(got, want, params)


def test_values_of_earlier_rounds_take_the_fast_path_alone_and_in_lists(monkeypatch: Any) -> None:
    """A decoder's memory and context come from earlier rounds; in later rounds a call on
    them (alone: ``mem @ q``, in a list: ``torch.cat([x, ctx])``) takes the C fast path
    after its first example, as the eager value's row (keyed by its shape): the slow path
    keys as many calls for eight examples as for four.  Values and gradients equal eager."""
    if C is None:
        pytest.skip("fold._clazy is not built")
    from fold.autobatch import driver

    monkeypatch.setattr(driver, "EAGER_GROUP", 0)  # every round batched
    torch.manual_seed(0)
    lin, cell = nn.Linear(3, 3), nn.GRUCell(6, 3)

    def decode(x: torch.Tensor) -> torch.Tensor:
        mem = torch.tanh(lin(x))  # (5, 3): one round's value, read by every later step
        h, ctx, outs = mem[0], mem.mean(0), []
        for _ in range(3):
            h = cell(torch.cat([h, ctx]), h)
            ctx = torch.softmax(mem @ h, 0) @ mem
            outs.append(ctx)
            if float(ctx.detach().sum()) > 1e9:  # a read: a round per step
                break
        return torch.stack(outs)

    keyed: list[Any] = []
    real = C.fast_key
    monkeypatch.setattr(C, "fast_key", lambda *a: keyed.append(a[1]) or real(*a))
    counts = []
    for n in (4, 4, 8):  # (the first call makes the ops)
        xs = [torch.randn(5, 3) for _ in range(n)]
        keyed.clear()
        got = fold.autobatch(decode, xs)
        counts.append(len(keyed))
        want = torch.stack([decode(x) for x in xs])
        torch.testing.assert_close(got, want)
        params = [*lin.parameters(), *cell.parameters()]
        _same_gradients(got, want, params)
    assert counts[1] == counts[2], counts


def test_a_written_buffer_after_a_lazy_value_takes_the_fast_path(monkeypatch: Any) -> None:
    """The translation tutorial's decoder: the encoder's outputs written into a buffer of the
    example's own, then ``torch.bmm(w.unsqueeze(0), encoder_outputs.unsqueeze(0))`` at every
    step.  The buffer's view is the same object at every step (found again before torch's
    view is made), and the call, a lazy value first, is given the value the buffer holds and
    found in the C fast table (the C key refuses the buffer at once): the recorder's slow
    path takes as many calls for eight examples as for four.  Values and gradients equal
    eager."""
    if C is None:
        pytest.skip("fold._clazy is not built")
    from fold.autobatch import driver

    monkeypatch.setattr(driver, "EAGER_GROUP", 0)  # every round batched
    torch.manual_seed(0)
    lin, att = nn.Linear(3, 3), nn.Linear(3, 4)
    views: list[list[int]] = []

    def decode(x: torch.Tensor) -> torch.Tensor:
        outputs = torch.zeros(4, 3)
        h = x[0]
        for i in range(len(x)):
            h = torch.tanh(lin(h + x[i]))
            outputs[i] = h
        seen, outs = [], []
        for _ in range(3):
            w = torch.softmax(att(h), 0)
            mem = outputs.unsqueeze(0)
            seen.append(id(mem))
            h = torch.bmm(w.unsqueeze(0).unsqueeze(0), mem)[0, 0]
            outs.append(h)
            if float(h.detach().sum()) > 1e9:  # a read: a round per step
                break
        views.append(seen)
        return torch.stack(outs)

    from fold.autobatch.recorder import _Recorder

    keyed: list[Any] = []
    real = _Recorder.record

    def record(self: Any, fn: Any, *rest: Any) -> Any:
        if fn is torch.bmm:
            keyed.append(fn)
        return real(self, fn, *rest)

    monkeypatch.setattr(_Recorder, "record", record)
    counts = []
    for n in (4, 4, 8):  # (the first call makes the ops)
        xs = [torch.randn(3, 3) for _ in range(n)]
        keyed.clear()
        views.clear()
        got = fold.autobatch(decode, xs)
        counts.append(len(keyed))
        assert all(len(set(seen)) == 1 for seen in views), views
        want = torch.stack([decode(x) for x in xs])
        torch.testing.assert_close(got, want)
        _same_gradients(got, want, [*lin.parameters(), *att.parameters()])
    assert counts[1] == counts[2], counts


def test_the_eager_finish_converts_earlier_values_in_c_alone_in_lists_and_module_calls(
    monkeypatch: Any,
) -> None:
    """Once the examples finish as eager code, a call on values of an earlier round takes
    the C path: alone (``mem @ q``), in a list (``torch.cat([e, ctx])``) and as a module's
    argument (``cell(x, h)``), each converted to its row at once; a known value keeps the
    Python path.  Values and gradients equal eager."""
    if C is None:
        pytest.skip("fold._clazy is not built")
    from fold.autobatch import driver

    monkeypatch.setattr(driver, "EAGER_GROUP", 10**6)  # eager after the first round
    slow: list[str] = []
    real_record, real_eager = recorder._Recorder.record, patches._eager_call
    monkeypatch.setattr(
        recorder._Recorder,
        "record",
        lambda self, fn, kind, *a: (
            (slow.append(kind) if self.session.eager else None) or real_record(self, fn, kind, *a)
        ),
    )
    monkeypatch.setattr(
        patches, "_eager_call", lambda *a, **k: slow.append("module") or real_eager(*a, **k)
    )
    torch.manual_seed(0)
    lin, cell = nn.Linear(3, 3), nn.GRUCell(6, 3)

    def decode(x: torch.Tensor, known: bool) -> torch.Tensor:
        mem = torch.tanh(lin(x))  # (5, 3)
        h, ctx, outs = mem[0], mem.mean(0), []
        for _ in range(3):
            if float(ctx.detach().sum()) > 1e9:  # a read: the first round ends here
                break
            e = torch.tensor([0.5, -0.5, 1.0]) if known else torch.tanh(h)
            h = cell(torch.cat([e, ctx]), h)
            ctx = torch.softmax(mem @ h, 0) @ mem
            outs.append(ctx)
        return torch.stack(outs)

    xs = [torch.randn(5, 3) for _ in range(4)]
    for known in (False, True):
        slow.clear()
        got = fold.autobatch(decode, xs, [known] * len(xs))
        want = torch.stack([decode(x, known) for x in xs])
        torch.testing.assert_close(got, want)
        params = [*lin.parameters(), *cell.parameters()]
        _same_gradients(got, want, params)
        if known:  # the known value in the list: the cat's first call per example is slow
            assert slow and set(slow) <= {"torch"}, slow
        else:
            assert slow == [], slow


def test_an_earlier_rounds_row_and_a_node_of_one_meta_have_their_own_fast_keys(
    monkeypatch: Any,
) -> None:
    """One module on a value of this round (a node) and on one of an earlier round (a literal
    row) of the same shape: the fast key files the two apart, so each table entry holds the
    Fold recorder made for its arguments' types (a node, or a tensor row), and the later
    rounds of the call (one Fold, its fast tables kept) record both without the slow path.
    Values equal eager."""
    if C is None:
        pytest.skip("fold._clazy is not built")
    from fold.autobatch import driver

    monkeypatch.setattr(driver, "EAGER_GROUP", 0)  # every round batched
    monkeypatch.setattr(driver, "_POOL_MAX", 0)  # each call its own Fold and tables
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(lin(x))
        for _ in range(4):
            a = lin(h)  # h of an earlier round: a row
            h = torch.tanh(lin(a))  # a of this round: a node
            if float(h.detach().sum()) > 1e9:
                break
        return h

    keys: dict[str, set[Any]] = {"row": set(), "node": set()}
    slow: list[Any] = []
    real = C.fast_key

    def spy(rec: Any, fn_: Any, kind: Any, args: Any) -> Any:
        key = real(rec, fn_, kind, args)
        of = getattr(args[0], "rec", None)  # None: the example's own tensor
        if fn_ is lin and key is not None and of is not None:
            keys["node" if of is rec else "row"].add(key)
        slow.append(fn_)
        return key

    xs = [torch.randn(3) for _ in range(6)]
    fold.autobatch(fn, xs)  # the ops made
    monkeypatch.setattr(C, "fast_key", spy)
    got = fold.autobatch(fn, xs)
    torch.testing.assert_close(got, torch.stack([fn(x) for x in xs]))
    assert keys["row"] and keys["node"] and not keys["row"] & keys["node"]
    # The slow path keys each kind of call (on the example's tensor, a row, a node) once per
    # autobatch call, not once per round.
    assert slow.count(lin) == 3, slow


@pytest.mark.skipif(C is None, reason="fold._clazy not built")
def test_methods_of_earlier_rounds_values_take_the_fast_path(monkeypatch: Any) -> None:
    """A tensor method of a value of an earlier round with a value of this round
    (``mem @ q(h)``: a decoder's memory at every step) is found in the fast table of the
    round recording now, as the slow path records it there: after its first round, no such
    call reaches the Python recorder (21 of 24 did before); values and gradients equal eager
    (float64)."""
    driver = importlib.import_module("fold.autobatch.driver")
    monkeypatch.setattr(driver, "EAGER_GROUP", 0)
    torch.manual_seed(1)
    enc, cell, q = nn.GRU(3, 3).double(), nn.GRUCell(3, 3).double(), nn.Linear(3, 3).double()

    def fn(x):
        mem, h = enc(x)  # mem: a lazy value of the first round
        h = h[0]
        for _ in range(4):
            h = cell(torch.softmax(mem @ q(h), 0) @ mem, h)
            if float(h.detach().sum()) > 1e6:  # a read: a round per step, never true
                break
        return h

    xs = [torch.randn(5, 3, dtype=torch.float64) for _ in range(6)]
    slow: list[str] = []
    real = recorder._Recorder._record

    def counting(self, f, kind, args, kwargs):  # type: ignore[no-untyped-def]
        slow.append(getattr(f, "__name__", ""))
        return real(self, f, kind, args, kwargs)

    monkeypatch.setattr(recorder._Recorder, "_record", counting)
    got = fold.autobatch(fn, xs)
    # Recorded slowly in the first round and once where the next round's tables are new.
    assert slow.count("__matmul__") <= 4, slow
    want = torch.stack([fn(x) for x in xs])
    torch.testing.assert_close(got, want)
    _same_gradients(got, want, [*enc.parameters(), *cell.parameters(), *q.parameters()])


@pytest.mark.skipif(C is None, reason="fold._clazy not built")
@pytest.mark.parametrize("mode", ["grad", "inference_mode"])
def test_the_c_memo_of_earlier_values_methods_keys_calls_as_python_does(
    monkeypatch: Any, mode: str
) -> None:
    """A pure method of an earlier round's value with plain arguments runs at once, memoised
    (values._memoised); the C path builds the memo key the Python path builds for the same
    call (ints, bools, floats by their bits, slices, tuples, None, Ellipsis), so the two
    share one memo: every call below is made by C (the first too, which makes the value's
    row), filed under Python's key, and a second call gives the same lazy value.  Values equal eager.  Under torch.inference_mode() too,
    where the rows are inference tensors, without a version counter."""
    driver = importlib.import_module("fold.autobatch.driver")
    monkeypatch.setattr(driver, "EAGER_GROUP", 0)
    lin = nn.Linear(3, 4).double()
    calls = [
        ("__getitem__", (1,)),
        ("__getitem__", (True,)),
        ("__getitem__", (slice(0, 2),)),
        ("__getitem__", ((0, slice(None, None, 2)),)),
        ("__getitem__", ((Ellipsis, None),)),
        ("__mul__", (0.5,)),
        ("__mul__", (-0.0,)),
        ("__mul__", (0,)),
        ("view", (-1,)),
        ("__pow__", (2,)),
        ("sum", (0,)),
    ]
    by_c: list[Any] = []
    checked: list[bool] = []

    def spy(rec: Any, out: Any, key: Any, memo: Any, x: Any) -> Any:
        by_c.append(key)
        return values._memo_wrap(rec, out, key, memo, x)

    def fn(x: torch.Tensor) -> list[torch.Tensor]:
        h = lin(x.expand(3, 3))
        if float(h.detach().sum()) > 1e9:  # a read: h is an earlier round's value now
            h = h * 2
        outs = []  # (h's row not read yet: the C path makes it, as _value_of does)
        for name, rest in calls:
            out = getattr(h, name)(*rest)
            outs.append(out)
            if common._LOCAL.rec is not None:
                memo = common._LOCAL.rec.session.memo
                key = values._memo_key(getattr(torch.Tensor, name), h, values._value_of(h), rest)
                again = getattr(h, name)(*rest)
                if getattr(torch.Tensor, name) in values._VIEW_METHODS:  # the kept view
                    checked.append(memo.get(key) is out and again is out)
                else:  # a value of its own each call, on the kept node
                    node = memo[key].node
                    checked.append(out is not again and out.node == again.node == node)
        return outs

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    inference = torch.is_inference_mode_enabled
    rest = (values._mark_shared, values._DETACH)
    C.configure_memo(values._PURE_METHODS, values._VIEW_METHODS, spy, inference, *rest)
    try:
        with torch.inference_mode(mode == "inference_mode"):
            got = fold.autobatch(fn, xs, stack=False)
    finally:
        C.configure_memo(
            values._PURE_METHODS, values._VIEW_METHODS, values._memo_wrap, inference, *rest
        )
    assert checked and all(checked), checked
    assert len(by_c) == len(calls) * len(xs)  # every call made by the C path
    for g, x in zip(got, xs):
        for a, b in zip(g, fn(x), strict=True):
            assert a.shape == b.shape and torch.equal(torch.signbit(a), torch.signbit(b))
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", ["_clazy", "_crecord"])
def test_a_built_c_extension_is_not_older_than_its_source(name: str) -> None:
    """A C extension built in place before its source was changed runs the old code, and an
    optional extension that no longer compiles leaves the old build in place silently
    (setup.py): the tests would check the old C.  Fix: ``python setup.py build_ext
    --inplace`` (or reinstall)."""
    module = importlib.import_module("fold")
    root = os.path.dirname(module.__file__)
    built = [
        f for f in os.listdir(root) if f.startswith(name + ".") and f.endswith((".so", ".pyd"))
    ]
    if not built:
        pytest.skip(f"fold.{name} is not built in place")
    source = os.path.getmtime(os.path.join(root, name + ".c"))
    for f in built:
        assert os.path.getmtime(os.path.join(root, f)) >= source, (
            f"fold/{f} is older than fold/{name}.c: rebuild it (python setup.py build_ext "
            "--inplace); a build that fails keeps the old one"
        )


@pytest.mark.skipif(C is None, reason="the C extension is not built")
def test_direct_torch_functions_in_c_agree_with_their_python_form(monkeypatch: Any) -> None:
    """``_C.Direct`` (torch.cat, torch.softmax, F.relu... while autobatch is installed)
    against the Python wrapper it replaces: a call on lazy values (first, or in a list,
    ``dim=`` as a keyword) records as in Python, values and gradients equal eager's; a call
    of plain tensors goes to torch as it is, and a torch-function mode sees the calls made
    under it (one the function enters itself too, its values equal eager's); the wrapper
    looks like the function (name, signature)."""
    import inspect

    from torch.overrides import TorchFunctionMode

    c_cat = patches._DIRECT_WRAPPERS[torch, "cat"]
    assert type(c_cat) is C.Direct and c_cat.__name__ == "cat" and c_cat.__wrapped__ is torch.cat
    relu = patches._DIRECT_WRAPPERS[torch.nn.functional, "relu"]
    assert inspect.signature(relu) == inspect.signature(torch.nn.functional.relu)
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    torch.testing.assert_close(c_cat([x, y], dim=1), torch.cat([x, y], dim=1))

    seen = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Spy():
        c_cat((x, y))
    assert seen == [torch.cat]

    lin = nn.Linear(3, 3).double()

    def fn(v: torch.Tensor) -> torch.Tensor:  # (2, 3) each
        h = lin(v)
        parts = torch.cat([h, torch.ones(2, 3, dtype=torch.float64), h.relu()], dim=1)
        w = torch.softmax(parts, dim=1)
        return torch.stack((torch.nn.functional.relu(h), w[:, :3] + w[:, 3:6]))

    xs = [torch.randn(2, 3, dtype=torch.float64) for _ in range(5)]
    want = torch.stack([fn(v) for v in xs])
    params = list(lin.parameters())
    got_c = fold.autobatch(fn, xs, per_example=True)  # (the full patches: see _installed)
    torch.testing.assert_close(got_c, want)
    _same_gradients(got_c, want, params)
    # The Python form, installed in its place.
    monkeypatch.setattr(patches, "_C", None)
    python_form = {
        key: patches._direct_wrapper(wrapper.__wrapped__)
        for key, wrapper in patches._DIRECT_WRAPPERS.items()
    }
    monkeypatch.setattr(patches, "_DIRECT_WRAPPERS", python_form)
    assert type(patches._DIRECT_WRAPPERS[torch, "cat"]) is not C.Direct
    got_py = fold.autobatch(fn, xs, per_example=True)
    torch.testing.assert_close(got_py, got_c, rtol=0, atol=0)
    _same_gradients(got_py, torch.stack([fn(v) for v in xs]), params)
    monkeypatch.undo()

    def moded(v: torch.Tensor) -> torch.Tensor:  # a mode entered by the function itself
        with Spy():
            return torch.cat([lin(v), v], dim=1)

    seen.clear()
    got = fold.autobatch(moded, xs, per_example=True)
    assert torch.cat in seen  # (the mode saw torch.cat: recorded through it, or run eagerly)
    torch.testing.assert_close(got, torch.stack([torch.cat([lin(v), v], 1) for v in xs]))


@pytest.mark.skipif(C is None, reason="fold._clazy not built")
@pytest.mark.parametrize("per_example", [False, True], ids=["rows", "per example"])
def test_functional_calls_with_default_keywords_take_the_fast_path(
    per_example: bool, monkeypatch: Any
) -> None:
    """torch.nn.functional's Python functions reach ``__torch_function__`` with keyword
    arguments (``F.relu(x)`` as ``relu(x, inplace=False)``, ``F.cross_entropy(y, t)`` with
    its six defaults, ``F.softmax(x, dim=0)`` with ``dim``), and tensor methods given dims
    by keyword (``y.sum(dim=0)``): the defaults dropped and numbers named right after the
    positional arguments passed by position, the calls find the fast table after their
    first recording, and values and gradients equal eager (float64).  A keyword that is no
    default (``reduction="sum"``) stays, and the call its slow path, with eager's values
    too."""
    from fold.autobatch import driver

    monkeypatch.setattr(driver, "_POOL_MAX", 0)  # each call its own Fold and tables
    torch.manual_seed(0)
    lin = nn.Linear(4, 3).double()
    entered: list[Any] = []
    found: list[Any] = []
    record, fast_path = recorder._Recorder._record, recorder._fast_path

    def counted(self: Any, fn: Any, kind: str, args: Any, kwargs: Any) -> Any:
        entered.append(fn)
        return record(self, fn, kind, args, kwargs)

    def hit(rec: Any, fn: Any, kind: str, args: Any) -> Any:
        out = fast_path(rec, fn, kind, args)
        if out is not common._MISS:
            found.append(fn)
        return out

    def loss(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        y = F.relu(lin(x))
        w = F.softmax(y, dim=0) + y.cumsum(dim=0) / y.sum(keepdim=True, dim=0)
        return F.cross_entropy(y[None] * w, t[None]) + F.cross_entropy(
            y[None], t[None], reduction="sum"
        )

    xs = [torch.randn(4, dtype=torch.float64) for _ in range(5)]
    ts = [torch.tensor(i % 3) for i in range(5)]
    want = torch.stack([loss(x, t) for x, t in zip(xs, ts)])
    grads = torch.autograd.grad(want.sum(), list(lin.parameters()))
    first = fold.autobatch(loss, xs, ts, per_example=per_example)
    monkeypatch.setattr(recorder._Recorder, "_record", counted)
    monkeypatch.setattr(recorder, "_fast_path", hit)
    got = fold.autobatch(loss, xs, ts, per_example=per_example)
    monkeypatch.undo()
    torch.testing.assert_close(first, want)
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got.sum(), list(lin.parameters())), grads):
        torch.testing.assert_close(a, b)
    # Recorded once for all rows, the second call's recording finds the first's tables:
    # the C path takes relu, softmax and the first cross_entropy at once (their keywords
    # defaults, or dim by position), and y.cumsum(dim=0), y.sum(keepdim=True, dim=0) as
    # cumsum(y, 0), sum(y, 0, True).  Per example (autobatch's wrappers of F.relu and
    # F.softmax installed), the first example records each call, the others find the table.
    # The cross_entropy given reduction="sum" goes the slow path every time.
    methods = (torch.Tensor.cumsum, torch.Tensor.sum)
    if per_example:
        assert entered.count(F.relu) == entered.count(F.softmax) == 1
        assert entered.count(F.cross_entropy) == 1 + len(xs)
        assert all(entered.count(f) == 1 for f in methods)
    else:
        assert not any(f in entered for f in (F.relu, F.softmax, *methods))
        assert entered.count(F.cross_entropy) == 1
    assert F.cross_entropy not in found


def test_given_drops_defaults_and_passes_numbers_by_position() -> None:
    """``values._given``: a keyword passing its default is dropped (type and value alike:
    ``inplace=0`` is no default of ``inplace=False``, passed by position), numbers named right after the
    positional arguments move to their positions, a tensor or any keyword after a gap
    stays a keyword, and a builtin's keywords stay as given."""
    x = torch.randn(3)
    assert values._given(F.relu, (x,), {"inplace": False}) == ((x,), {})
    assert values._given(F.relu, (x,), {"inplace": 0}) == ((x, 0), {})
    assert values._given(F.softmax, (x,), {"dim": 0, "_stacklevel": 3, "dtype": None}) == (
        (x, 0),
        {},
    )
    args, kwargs = values._given(
        F.cross_entropy, (x, x), {"weight": None, "ignore_index": -100, "reduction": "sum"}
    )
    assert args == (x, x) and kwargs == {"reduction": "sum"}
    w = torch.ones(3)
    args, kwargs = values._given(F.cross_entropy, (x, x), {"weight": w, "reduction": "mean"})
    assert args == (x, x) and kwargs == {"weight": w}
    # Builtins Python cannot read: those of values._BUILTIN_POSITIONAL by their names there,
    # method or function; others as given.
    assert values._given(torch.Tensor.sum, (x,), {"keepdim": True, "dim": 0}) == ((x, 0, True), {})
    assert values._given(torch.sum, (x,), {"dim": 0}) == ((x, 0), {})
    assert values._given(torch.Tensor.sum, (x,), {"dtype": torch.float64, "dim": 0}) == (
        (x,),
        {"dtype": torch.float64, "dim": 0},
    )
    assert values._given(torch.Tensor.std, (x,), {"dim": 0, "keepdim": True}) == (
        (x,),
        {"dim": 0, "keepdim": True},
    )
    # A parameter between the positional arguments and a keyword given its default: a
    # number of a Python function's (F.normalize's p), any the table lists for a builtin;
    # never a None or string default of a Python function (a loss's weight, reduction).
    assert values._given(F.normalize, (x,), {"dim": 0}) == ((x, 2.0, 0), {})
    assert values._given(torch.Tensor.clamp, (x,), {"max": 1.0}) == ((x, None, 1.0), {})
    assert values._given(torch.Tensor.topk, (x, 2), {"largest": False}) == ((x, 2, -1, False), {})
    assert values._given(F.nll_loss, (x, x), {"reduction": "sum"}) == ((x, x), {"reduction": "sum"})


def _same_values_and_grads(got: torch.Tensor, want: torch.Tensor, module: nn.Module) -> None:
    """autobatch's results equal eager's, and so do the gradients of their sums with
    respect to ``module``'s parameters."""
    torch.testing.assert_close(got, want)
    params = list(module.parameters())
    for a, b in zip(
        torch.autograd.grad(got.sum(), params), torch.autograd.grad(want.sum(), params)
    ):
        torch.testing.assert_close(a, b)


@pytest.mark.skipif(C is None, reason="fold._clazy not built")
def test_a_number_tensor_as_the_last_argument_takes_the_fast_path(monkeypatch: Any) -> None:
    """An example's own 0-dim label tensor as a loss's target (``F.cross_entropy(out, y)``,
    the last argument after a lazy value) takes the C fast path after the first example: its
    ``.item()`` is the last node.  Values and gradients equal eager (float64), labels
    differing between examples; a number tensor before a lazy value (``y * h``) still
    gives eager's values."""
    from fold.autobatch import driver

    monkeypatch.setattr(driver, "_POOL_MAX", 0)
    lin = nn.Linear(4, 3).double()
    keyed: list[Any] = []
    real = C.fast_key
    monkeypatch.setattr(C, "fast_key", lambda *a: keyed.append(a[1]) or real(*a))

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = lin(x.mean(0))
        return F.cross_entropy(h, y) + (y.double() * h).sum()

    xs = [torch.randn(3 + i % 4, 4, dtype=torch.float64) for i in range(7)]  # (per example)
    ys = [torch.tensor(i % 3) for i in range(7)]
    got = fold.autobatch(loss, xs, ys)
    want = torch.stack([loss(x, y) for x, y in zip(xs, ys)])
    _same_values_and_grads(got, want, lin)
    assert keyed.count(F.cross_entropy) == 1


@pytest.mark.skipif(C is None, reason="fold._clazy not built")
def test_a_module_run_through_skips_the_recorder_in_c(monkeypatch: Any) -> None:
    """A module of one's own whose calls are run through (recorder._INLINE: a set model over
    sets of several sizes, after its first call) goes from the C module wrapper straight to
    its forward, as the slow path runs it, with no key built nor the recorder entered:
    values and gradients equal eager (float64)."""

    class Sets(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.phi, self.rho = nn.Linear(3, 8), nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.rho(torch.relu(self.phi(x)).sum(0)).squeeze()

    torch.manual_seed(0)
    model = Sets().double()
    sets = [torch.randn(n, 3, dtype=torch.float64) for n in (4, 2, 7, 4, 5, 2)]
    fold.autobatch(model, sets)  # (recorded whole for the first size, then run through)
    assert recorder._INLINE.get(id(model)) is model
    entered: list[Any] = []
    record = recorder._Recorder.record

    def counted(self: Any, fn: Any, kind: str, args: Any, kwargs: Any) -> Any:
        entered.append(fn)
        return record(self, fn, kind, args, kwargs)

    monkeypatch.setattr(recorder._Recorder, "record", counted)
    got = fold.autobatch(model, sets)
    monkeypatch.undo()
    want = torch.stack([model(x) for x in sets])
    _same_values_and_grads(got, want, model)
    assert model not in entered


@pytest.mark.skipif(C is None, reason="fold._clazy not built")
def test_zeros_of_either_sign_take_the_fast_path_apart(monkeypatch: Any) -> None:
    """A zero constant (``h.masked_fill(m, 0.0)``, ``h * -0.0``) takes the C fast path
    after the first example, keyed with its sign: ``h * 0.0`` and ``h * -0.0`` are other
    ops (their zeros' signs differ, which ``copysign`` reads), and each equals eager."""
    from fold.autobatch import driver

    monkeypatch.setattr(driver, "_POOL_MAX", 0)
    lin = nn.Linear(3, 3).double()
    keyed: list[Any] = []
    real = C.fast_key
    monkeypatch.setattr(C, "fast_key", lambda *a: keyed.append((a[1], a[3][1:])) or real(*a))

    def fn(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        h = lin(x)
        one = torch.ones(3, dtype=torch.float64)
        return (
            h.masked_fill(m, 0.0) + torch.copysign(one, h * 0.0) * 2 + torch.copysign(one, h * -0.0)
        )

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(6)]
    ms = [torch.rand(3) > 0.5 for _ in range(6)]
    got = fold.autobatch(fn, xs, ms, per_example=True)
    want = torch.stack([fn(x, m) for x, m in zip(xs, ms)])
    torch.testing.assert_close(got, want)
    # (h * 0.0, h * -0.0 and the copysign * 2: each keyed once, by the first example)
    assert sorted(str(k[1]) for k in keyed if k[0] is torch.Tensor.__mul__) == [
        "(-0.0,)",
        "(0.0,)",
        "(2,)",
    ]
    assert len([k for k in keyed if k[0] is torch.Tensor.masked_fill]) == 1


@pytest.mark.skipif(C is None, reason="fold._clazy not built")
def test_strings_and_dtypes_are_constants_of_the_fast_key(monkeypatch: Any) -> None:
    """An einsum's equation and a dtype (``h.to(torch.float32)``) are constants of the C
    fast key, by value: two equations, or two dtypes, are two ops, each keyed once by the
    first example; values and gradients equal eager."""
    from fold.autobatch import driver

    monkeypatch.setattr(driver, "_POOL_MAX", 0)
    lin = nn.Linear(3, 3).double()
    w = torch.randn(3, 3, dtype=torch.float64)
    keyed: list[Any] = []
    real = C.fast_key
    monkeypatch.setattr(C, "fast_key", lambda *a: keyed.append((a[1], a[3])) or real(*a))

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = lin(x)
        a = torch.einsum("ij,j->i", w, h) + torch.einsum("ji,j->i", w, h)
        return a + h.to(torch.float32).to(torch.float64) * h.to(torch.float16).double()

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(6)]
    got = fold.autobatch(fn, xs, per_example=True)
    want = torch.stack([fn(x) for x in xs])
    _same_values_and_grads(got, want, lin)
    assert sorted(k[1][0] for k in keyed if k[0] is torch.einsum) == ["ij,j->i", "ji,j->i"]
    assert len([k for k in keyed if k[0] is torch.Tensor.to]) == 3  # (float32, 64, 16)


# Per entry of values._BUILTIN_POSITIONAL a call of it on a (3, 4) tensor: positional
# arguments, and keyword values each parameter may take.
_KEYWORD_SPACE: dict[str, tuple[tuple[Any, ...], dict[str, list[Any]]]] = {
    "sum": ((), {"dim": [0, 1, -1], "keepdim": [False, True]}),
    "mean": ((), {"dim": [0, 1], "keepdim": [False, True]}),
    "prod": ((), {"dim": [0, 1], "keepdim": [False, True]}),
    "argmax": ((), {"dim": [0, 1], "keepdim": [False, True]}),
    "amax": ((), {"dim": [0, 1], "keepdim": [False, True]}),
    "logsumexp": ((), {"dim": [0, 1], "keepdim": [False, True]}),
    "max": ((), {"dim": [0, 1], "keepdim": [False, True]}),
    "median": ((), {"dim": [0, 1], "keepdim": [False, True]}),
    "softmax": ((), {"dim": [0, 1]}),
    "cumsum": ((), {"dim": [0, 1]}),
    "unsqueeze": ((), {"dim": [0, 2]}),
    "chunk": ((2,), {"dim": [0, 1]}),
    "unbind": ((), {"dim": [0, 1]}),
    "flatten": ((), {"start_dim": [0, 1], "end_dim": [1, -1]}),
    "transpose": ((), {"dim0": [0, 1], "dim1": [1, 0]}),
    "narrow": ((), {"dim": [1], "start": [0, 1], "length": [2]}),
    "select": ((), {"dim": [0, 1], "index": [0, 2]}),
    "topk": ((), {"k": [1, 2], "dim": [1, -1], "largest": [True, False], "sorted": [True]}),
    "sort": ((), {"dim": [0, 1], "descending": [False, True]}),
    "argsort": ((), {"dim": [0, 1], "descending": [False, True]}),
    "clamp": ((), {"min": [None, -0.5], "max": [None, 0.5, 1.0]}),
}


@given(st.data())
@settings(max_examples=300, deadline=None)
def test_given_calls_equal_the_calls_as_written(data: st.DataObject) -> None:
    """``values._given`` of a builtin's call with random keywords (a random subset, in a
    random order, each a value the parameter takes), method or function form: the call it
    makes gives what the call as written gives, or the same error."""
    name = data.draw(st.sampled_from(sorted(_KEYWORD_SPACE)))
    positional, space = _KEYWORD_SPACE[name]
    names = data.draw(st.permutations(list(space)))
    names = names[: data.draw(st.integers(0, len(names)))]
    kwargs = {k: data.draw(st.sampled_from(space[k])) for k in names}
    func = data.draw(st.sampled_from([getattr(torch.Tensor, name), getattr(torch, name)]))
    x = torch.arange(12.0).view(3, 4).sin()

    def run(args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        try:
            return func(*args, **kw)
        except (RuntimeError, TypeError, IndexError, ValueError) as err:
            return type(err)

    args, kw = values._given(func, (x, *positional), dict(kwargs))
    want, got = run((x, *positional), kwargs), run(args, kw)
    if isinstance(want, type):
        assert got is want, (name, kwargs, args[1:], kw)
        return
    for a, b in zip(torch.utils._pytree.tree_leaves(want), torch.utils._pytree.tree_leaves(got)):
        torch.testing.assert_close(a, b, msg=f"{name} {kwargs} -> {args[1:]} {kw}")


@given(st.data())
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_builtin_calls_with_random_keywords_equal_eager(data: st.DataObject) -> None:
    """The same random calls recorded by autobatch on each example's lazy value (per
    example, twice: the second call's examples through the C path's positional_call where
    it is built): values equal eager's, or both raise."""
    name = data.draw(st.sampled_from(sorted(_KEYWORD_SPACE)))
    positional, space = _KEYWORD_SPACE[name]
    names = data.draw(st.permutations(list(space)))
    names = names[: data.draw(st.integers(0, len(names)))]
    kwargs = {k: data.draw(st.sampled_from(space[k])) for k in names}
    method = data.draw(st.booleans())
    lin = nn.Linear(4, 4).double()

    def fn(x: torch.Tensor) -> Any:
        h = lin(x)
        if method:
            return getattr(h, name)(*positional, **kwargs)
        return getattr(torch, name)(h, *positional, **kwargs)

    xs = [torch.randn(3, 4, dtype=torch.float64) for _ in range(3)]
    try:
        want = [fn(x) for x in xs]
    except (RuntimeError, TypeError, IndexError, ValueError):
        with pytest.raises(Exception):  # noqa: B017  (torch's error, or fold's naming it)
            fold.autobatch(fn, xs, stack=False, per_example=True)
        return
    for _ in range(2):
        got = fold.autobatch(fn, xs, stack=False, per_example=True)
        for g, w in zip(got, want):
            flat_g = torch.utils._pytree.tree_leaves(g)
            flat_w = torch.utils._pytree.tree_leaves(w)
            assert len(flat_g) == len(flat_w)
            for a, b in zip(flat_g, flat_w):
                torch.testing.assert_close(a, b)


def test_keyword_calls_past_the_table_bound_equal_eager(monkeypatch: Any) -> None:
    """Past the number of functions ``values._given`` keeps entries for (none kept here),
    a call's entry is made anew each time (never dropped: the C path holds its values
    borrowed), and the calls give eager's values."""
    monkeypatch.setattr(values, "_KW_FUNCTIONS", 0)
    monkeypatch.setattr(values, "_KW_DEFAULTS", {})
    lin = nn.Linear(4, 4).double()

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = lin(x)
        return F.normalize(h, dim=0) + h.cumsum(dim=0) + torch.clamp(h, max=0.5)

    xs = [torch.randn(4, dtype=torch.float64) for _ in range(4)]
    got = fold.autobatch(fn, xs, per_example=True)
    _same_values_and_grads(got, torch.stack([fn(x) for x in xs]), lin)
    assert values._KW_DEFAULTS == {}


@pytest.mark.skipif(C is None, reason="fold._clazy not built")
def test_a_batched_function_given_lists_takes_the_fast_path(monkeypatch: Any) -> None:
    """A ``batchable(batched=True)`` function given a list of lazy values (a Ragged there:
    one op for every length; a tree's losses, ``examples/autobatch_tree_lstm.py``) takes the
    C fast path after its first recording, lists of any length (100 here: the other kinds'
    list keys stop at 63).  Values and gradients equal eager (float64)."""
    from fold.autobatch import driver

    monkeypatch.setattr(driver, "_POOL_MAX", 0)

    @fold.batchable(batched=True)
    def total(items: fold.Ragged) -> torch.Tensor:
        return items.sum()

    lin = nn.Linear(3, 3).double()
    entered: list[Any] = []
    record = recorder._Recorder._record

    def counted(self: Any, fn: Any, kind: str, args: Any, kwargs: Any) -> Any:
        entered.append(fn)
        return record(self, fn, kind, args, kwargs)

    def fn(x: torch.Tensor, n: int) -> torch.Tensor:
        return total([torch.tanh(lin(x * (k + 1))) for k in range(n)])

    def eager(x: torch.Tensor, n: int) -> torch.Tensor:
        return sum((torch.tanh(lin(x * (k + 1))) for k in range(n)), torch.zeros(3, dtype=x.dtype))

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(6)]
    ns = [3, 100, 1, 3, 70, 5]
    monkeypatch.setattr(recorder._Recorder, "_record", counted)
    got = fold.autobatch(fn, xs, ns)
    monkeypatch.undo()
    _same_values_and_grads(got, torch.stack([eager(x, n) for x, n in zip(xs, ns)]), lin)
    assert sum(1 for f in entered if getattr(f, "__name__", None) == "total") == 1


@pytest.mark.skipif(C is None, reason="fold._clazy not built")
@pytest.mark.parametrize("default", [torch.float32, torch.float64])
def test_torch_tensor_of_a_number_in_c_agrees_with_the_python_wrapper(
    default: torch.dtype, monkeypatch: Any
) -> None:
    """``_C.Tensorize`` (torch.tensor while autobatch is installed) against the Python
    wrapper it stands in front of: ``torch.tensor(x)`` of an int, a float or a bool, per
    example, is the same known value (value and its type, meta, whether it travels as a
    number) under either default dtype, made in C (the wrapper is called once per type and
    dtype, to fill its table); the calls it leaves to the wrapper (a dtype given, a list)
    give what the wrapper gives; values and gradients equal eager's, and the Python
    wrapper's exactly."""
    assert type(patches._TENSOR_WRAPPER) is C.Tensorize
    assert patches._TENSOR_WRAPPER.fallback is patches._recording_tensor
    numbers: list[Any] = []

    def counting(*args: Any, **kwargs: Any) -> Any:  # (the wrapper, its calls of one number)
        if len(args) == 1 and not kwargs and type(args[0]) in (int, float, bool):
            numbers.append(args[0])
        return patches._recording_tensor(*args, **kwargs)

    wrapper = C.Tensorize(counting, patches._PLAIN, patches._modes_on)
    monkeypatch.setattr(patches, "_TENSOR_WRAPPER", wrapper)
    patches._PLAIN.clear()
    torch.set_default_dtype(default)
    try:
        seen: list[tuple[Any, Any]] = []
        emb = nn.Embedding(10, 4).to(default)

        def fn(x: torch.Tensor, word: int) -> torch.Tensor:
            for data in (word, word / 2, word > 4, -0.0):
                seen.append((torch.tensor(data), patches._recording_tensor(data)))
            for data, dtype in (([word, 1], None), (word, torch.float64)):
                got = torch.tensor(data, dtype=dtype)
                seen.append((got, patches._recording_tensor(data, dtype=dtype)))
            return emb(torch.tensor(word)) * x + torch.tensor(word / 4) * torch.tensor(True)

        xs = [torch.randn(4, dtype=default) for _ in range(6)]
        words = [0, 3, 5, 7, 9, 2]
        got = fold.autobatch(fn, xs, words, per_example=True)
        assert len(seen) == 6 * len(xs)
        for k, want in seen:
            assert type(k) is type(want) is values.Known
            assert (k.meta, k.number, k._plain) == (want.meta, want.number, want._plain)
            assert k.value == want.value and type(k.value) is type(want.value)
            assert str(k.value) == str(want.value)  # (-0.0 kept)
        assert len(numbers) <= 3  # (one per Python type: int, float, bool)
        want = torch.stack([fn(x, w) for x, w in zip(xs, words)])
        torch.testing.assert_close(got, want)
        _same_gradients(got, want, list(emb.parameters()))
        monkeypatch.setattr(patches, "_TENSOR_WRAPPER", patches._recording_tensor)
        got_py = fold.autobatch(fn, xs, words, per_example=True)
        torch.testing.assert_close(got_py, got, rtol=0, atol=0)
    finally:
        torch.set_default_dtype(torch.float32)
    assert torch.tensor is patches._TORCH_TENSOR  # (nothing left installed)


@pytest.mark.skipif(C is None, reason="the C extension is not built")
@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2),  # the output: one view, a split's tuple of two, a list argument
            st.lists(st.integers(-1, 12), max_size=3),  # arguments: earlier outputs, -1 a value
            st.booleans(),  # the output held by a name beside the log
            st.booleans(),  # a new argument value held by a name
            st.booleans(),  # a list argument (kind 2) held by a name
        ),
        max_size=10,
    ),
    st.integers(0, 4),
)
def test_the_c_view_log_walk_keeps_what_the_python_one_keeps(entries, start):
    """``views_in_use`` (fold/_clazy.c) and ``buffers._views_in_use`` keep the same entries of
    random view logs: views held by a name or not, parts of a split's tuple, views of views
    (an argument that is an earlier entry's output), list arguments held or not, from
    ``start`` on; and they keep an entry only where its group holds two values held by a
    name."""
    from fold.autobatch import buffers

    log: list[tuple[Any, tuple[Any, ...]]] = []
    names: list[Any] = []  # (the references beside the log: names that hold values)
    outs: list[Any] = []
    for kind, picks, named, named_arg, named_list in entries:
        args = []
        for p in picks:
            if 0 <= p < len(outs):
                args.append(outs[p])
            else:
                args.append(torch.empty(0))  # (a tensor: a participant)
                if named_arg:
                    names.append(args[-1])
        args = tuple(args)
        if kind == 2:
            args = (list(args),)
            if named_list:
                names.append(args[0])
            if len(log) % 3 == 2:  # (the same list again: the log holds it twice)
                args = (*args, args[0])
        out = (torch.empty(0), torch.empty(0)) if kind == 1 else torch.empty(0)
        if named:
            names.append(out[0] if kind == 1 else out)
        outs.extend(out if kind == 1 else (out,))
        log.append((out, args))
        del out, args
    del outs
    start = min(start, len(log))
    kept = C.views_in_use(log, start)
    assert kept == buffers._views_in_use(log, start)
    assert kept == sorted(set(kept)) and set(kept) <= set(range(start, len(log)))
    held = sum(len(x) if type(x) is list else 1 for x in names)
    # (a group in use holds two values held by a name; from a later start, the entries
    # before it hold values too)
    assert start > 0 or len(kept) == 0 or held >= 2
