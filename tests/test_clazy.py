"""The C hot path of autobatch's recording (fold/_clazy.c) against its Python twin.

``fold.lazy`` looks a call up in the recorder's fast table with ``_C.fast`` where the
extension is built and with the generated Python functions (``_py_fast``) otherwise.  Both
must agree on every call: the same miss, or the same node with the same per-example outputs
(single, tuple, or another structure made by the op's wrap).  Random argument tuples over
every kind of value a call can see (lazy values of this recorder and of another, modules,
number tensors with and without gradients, other tensors, plain numbers), against a table
filled by the slow path on real calls.  ``tests/test_autobatch.py`` checks the values.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import fold
from fold import lazy as L

C = L._C


def test_c_lazy_path_is_built() -> None:
    """The install compiles the extension (setup.py); a failed build would leave autobatch on
    its slower Python path without a word, so the suite says so."""
    if os.environ.get("FOLD_RECORDER") == "python":
        pytest.skip("FOLD_RECORDER=python: recording without the C fast paths, as asked")
    assert C is not None, "fold._clazy was not built: reinstall with a C compiler"
    assert L.Lazy.__mro__[1] is C.LazyBase
    assert L._fast_path is C.fast


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
        self.rec = L._Recorder()
        other = L._Recorder()
        L._install_module_call()
        L._LOCAL.rec = other
        try:
            self.foreign = self.lin(torch.randn(3))
            L._LOCAL.rec = self.rec
            a = self.lin(torch.randn(3))
            b = self.lin(torch.randn(3))
            c = torch.cat([a, b])
            self.lazies = [a, b, c]
            per = L._PER_EXAMPLE
            self.calls = [
                (torch.add, "torch", (a, b)),
                (torch.tanh, "torch", (c,)),
                (torch.Tensor.__mul__, "torch", (a, a)),
                (_pair, per, (a, b)),
                (_pair, per, (c, c)),
                (_nested, per, (a,)),
                (_through, per, (self.lin, a)),
                (self.lin, "module", (b,)),
                (self.emb, "module", (torch.tensor(3),)),
                (self.scale, "module", (torch.tensor(0.5),)),
                (_leaf, per, (self.emb, torch.tensor(4))),
            ]
            for fn, kind, args in self.calls:
                self.rec.record(fn, kind, args, {})
        finally:
            L._LOCAL.rec = None
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
            3,
            0.5,
        ]


_WORLD: _World | None = None


def _world() -> _World:
    global _WORLD
    if _WORLD is None:
        _WORLD = _World()
    return _WORLD


def _outcome(fn: Any, *args: Any) -> Any:
    try:
        out = fn(*args)
    except Exception as err:  # both paths must raise alike
        return ("raised", type(err))
    if out is L._MISS:
        return "miss"
    leaves = [x for x in _flat(out)]
    return (
        type(out),
        [(type(x), x.node if isinstance(x, L.Lazy) else x) for x in leaves],
        [x.meta if isinstance(x, L.Lazy) else None for x in leaves],
    )


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
    args = tuple(args)
    c = _outcome(C.fast, w.rec, fn, kind, args)
    py = _outcome(L._py_fast, w.rec, fn, kind, args) if args else "miss"
    assert c == py, (fn, kind, args)


@pytest.mark.skipif(C is None, reason="fold._clazy not built")
def test_every_call_with_one_argument_swapped_agrees() -> None:
    """Each call seen before, with each argument in turn replaced by each kind of value."""
    w = _world()
    for fn, kind, args in w.calls:
        for i in range(len(args)):
            for v in w.values:
                swapped = (*args[:i], v, *args[i + 1 :])
                c = _outcome(C.fast, w.rec, fn, kind, swapped)
                assert c == _outcome(L._py_fast, w.rec, fn, kind, swapped), (fn, i, v)


@pytest.mark.skipif(C is None, reason="fold._clazy not built")
def test_every_recorded_call_is_a_hit_in_both_paths() -> None:
    """The filled table is reached: each call seen before gives the same node again, in
    both paths, with outputs in the op's structure."""
    w = _world()
    for fn, kind, args in w.calls:
        c, py = _outcome(C.fast, w.rec, fn, kind, args), _outcome(L._py_fast, w.rec, fn, kind, args)
        assert c == py and c != "miss", (fn, kind)
    structures = {fn: _outcome(C.fast, w.rec, fn, kind, args)[0] for fn, kind, args in w.calls}
    assert structures[_pair] is tuple and structures[_nested] is dict
    assert structures[torch.tanh] is L.Lazy


@pytest.mark.skipif(C is None, reason="fold._clazy not built")
def test_the_c_path_takes_more_arguments_than_python() -> None:
    """Up to MAX_FAST lazy arguments (the generated Python stops at 6): a 10-argument
    batchable call seen before takes the C path, and its values equal eager."""

    @fold.batchable
    def many(*xs: torch.Tensor) -> torch.Tensor:
        return torch.stack(xs).sum(0).tanh()

    lin = nn.Linear(2, 2)
    slow = []
    record = L._Recorder.record

    def counted(self: Any, fn: Any, kind: str, args: Any, kwargs: Any) -> Any:
        if fn is many.fn:
            slow.append(len(args))
        return record(self, fn, kind, args, kwargs)

    def fn(x: torch.Tensor) -> torch.Tensor:
        parts = [lin(x * (i + 1)) for i in range(10)]
        return many(*parts) + many(*reversed(parts))

    xs = torch.randn(4, 2)
    ref = torch.stack([fn(x) for x in xs])
    L._Recorder.record = counted  # type: ignore[method-assign]
    try:
        out = fold.autobatch(fn, list(xs), per_example=True)
    finally:
        L._Recorder.record = record  # type: ignore[method-assign]
    torch.testing.assert_close(out, ref)
    # Only the first of the 8 calls builds its key; the other 7 share it (same metas).
    assert C.MAX_FAST >= 10 and slow == [10]


def test_methods_and_batchable_keep_their_names() -> None:
    assert L.Lazy.__add__.__name__ == "__add__"
    assert L.Lazy.sum.__name__ == "sum"

    @fold.batchable
    def cell(x: torch.Tensor) -> torch.Tensor:
        """A cell."""
        return x

    assert cell.__name__ == "cell" and cell.__doc__ == "A cell."
    assert isinstance(cell, fold.batchable)
