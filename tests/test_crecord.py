"""The C fast path of the recorders (fold/_crecord.c) against the generated Python recorders.

Both must build the same graph from the same calls: the same handles, the same signatures,
the same memo keys and values (the executor reads the keys), and the same errors.  Random
call sequences over every argument kind the C path takes (nodes, split outputs, ints, floats
with their zeros and NaN, bools, lists of nodes, empty and repeated) and the ones it hands
to Python (numpy numbers, foreign nodes, literal tensors, handles beyond int64).
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fold
from fold import graph
from fold._encoding import node_id
from fold.errors import FoldError

C = graph._CRecorder
# Literal tensors are keyed by id: the same objects in both runs.
TENSORS = {(1, 2): torch.zeros(1, 2), (1, 3): torch.ones(1, 3)}


def test_c_recorder_is_built() -> None:
    """The install compiles the extension (setup.py); a failed build would leave fold on its
    slower Python recorders without a word, so the suite says so."""
    if os.environ.get("FOLD_RECORDER") == "python":
        pytest.skip("FOLD_RECORDER=python: recording without the C fast path, as asked")
    assert C is not None, "fold._crecord was not built: reinstall with a C compiler"
    f = fold.Fold()
    f.add("leaf", 1)
    assert all(type(r) is C for r in f._by_op.values())


def test_counter_numbers_as_itertools_count_and_resets() -> None:
    """The C Counter a Fold's recorders share gives itertools.count()'s ids and repr, how many
    it gave as ``issued`` (which Fold._check_intact reads); reset() starts them from 0 again,
    for a renewed Fold."""
    if graph._Counter is None:
        pytest.skip("the C recorders are off: node ids come from itertools.count()")
    import itertools

    c, want = graph._Counter(), itertools.count()
    assert [next(c) for _ in range(5)] == [next(want) for _ in range(5)]
    assert repr(c) == repr(want) == "count(5)" and c.issued == 5
    c.reset()
    assert next(c) == 0 and repr(c) == "count(1)" and c.issued == 1
    f = fold.Fold()
    a = f.add("leaf", 1)
    f._renew()
    assert type(f._ids) is graph._Counter and f.add("leaf", 2).id == a.id == 0


numbers = st.one_of(
    st.integers(-3, 3),
    st.sampled_from([2**63, -(2**70), 0.0, -0.0, math.nan, math.inf, 1.5, -2.25, True, False]),
    st.floats(-4, 4, allow_nan=False),
)


@st.composite
def calls(draw: Any) -> list[tuple[Any, ...]]:
    """A call sequence: (op, how, outputs, args), each argument ("node", i), ("list", [i..])
    (indices into the handles so far), ("num", x), ("np", x), ("tensor", shape), ("foreign",)
    or ("deep", handle); or ("again", j), repeating call j (a memo hit)."""
    out: list[tuple[Any, ...]] = []
    made = 0
    for _ in range(draw(st.integers(1, 30))):
        if out and draw(st.integers(0, 4)) == 0:
            out.append(("again", draw(st.integers(0, len(out) - 1))))
            continue
        k = draw(st.sampled_from([0, 1, 1, 2, 2, 3, 4, 9, 16]))
        args: list[tuple[Any, ...]] = []
        for _ in range(k):
            choice = draw(st.integers(0, 19)) if made else draw(st.integers(10, 15))
            node = st.integers(0, max(made - 1, 0))
            if choice < 8:
                args.append(("node", draw(node)))
            elif choice < 10:
                args.append(("list", draw(st.lists(node, max_size=5))))
            elif choice < 15:
                args.append(("num", draw(numbers)))
            elif choice == 15:
                args.append(("np", draw(st.integers(-3, 3))))
            elif choice == 16:
                args.append(("tensor", draw(st.sampled_from([(1, 2), (1, 3)]))))
            elif choice == 17:
                args.append(("foreign",))
            elif choice == 18:
                args.append(("list", [*draw(st.lists(node, max_size=2)), -1]))  # a foreign one
            else:
                forged = [((1 << 19) - 1) << 44, 1 << 63, -1, -5, -(1 << 50), -(1 << 62)]
                args.append(("deep", draw(st.sampled_from(forged))))
        outputs = draw(st.sampled_from([None, None, 2, 3]))
        op = draw(st.sampled_from(["a", "b", len]))  # a callable op too
        out.append((op, draw(st.sampled_from(["add", "op"])), outputs, args))
        made += outputs or 1
    return out


def replay(prog: list[tuple[Any, ...]], c: bool, monkeypatch: Any) -> tuple[Any, ...]:
    """Run ``prog`` on a new Fold, with or without the C path; the results, errors included,
    and the Fold's graph state."""
    monkeypatch.setattr(graph, "_CRecorder", C if c else None)
    f, other = fold.Fold(), fold.Fold()
    foreign = other.add("x", 0)
    handles: list[Any] = []
    results: list[Any] = []
    for ins in prog:
        if ins[0] == "again":
            ins = prog[ins[1]]
            while ins[0] == "again":
                ins = prog[ins[1]]
        op, how, outputs, spec = ins

        def value(a: tuple[Any, ...]) -> Any:
            kind = a[0]
            if kind == "node":
                return handles[a[1]] if a[1] < len(handles) else a[1]
            if kind == "list":
                return [handles[i] if 0 <= i < len(handles) else foreign for i in a[1]]
            if kind == "num":
                return a[1]
            if kind == "np":
                return np.int64(a[1])
            if kind == "tensor":
                return TENSORS[a[1]]
            if kind == "foreign":
                return foreign
            return f._node_type(a[1])  # a handle of this Fold's type, deeper than int64 holds

        args = [value(a) for a in spec]
        try:
            if how == "add":
                r = f.add(op, *args)
                r = r if outputs is None else r.split(outputs)
            else:
                r = f.op(op, outputs)(*args)
        except (FoldError, TypeError) as e:
            results.append((type(e), str(e)))
            continue
        got = [r] if outputs is None else list(r)
        assert all(type(h) is f._node_type for h in got)
        results.append([int(h) for h in got])
        handles.extend(got)
    # Per signature that holds nodes, in the order of their first nodes: a call refused after
    # its pattern was seen (in an earlier Fold: the patterns are kept per process) makes its
    # signature, empty or filled later, where a first refusal makes none.
    sigs = [
        (sig, list(m.items()), [tuple(id(x) if torch.is_tensor(x) else x for x in t) for t in ts])
        for sig, m, ts in zip(f.signatures, f._memos, f._targs)
        if m
        for ts in [ts or ()]
    ]
    sigs.sort(key=lambda s: node_id(s[1][0][1]))
    return results, sigs, len(f)


@pytest.mark.skipif(C is None, reason="fold._crecord not built")
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prog=calls())
def test_c_and_python_recorders_build_the_same_graph(prog: list[tuple[Any, ...]]) -> None:
    with pytest.MonkeyPatch.context() as mp:
        with_c = replay(prog, True, mp)
        without = replay(prog, False, mp)
    assert with_c == without


@pytest.mark.skipif(C is None, reason="fold._crecord not built")
def test_c_recorder_keys_and_errors(monkeypatch: Any) -> None:
    """The cases the random sequences may miss, spelled out: each kind's key, the zeros of
    float keyed apart, NaN its own node, a memo hit, the errors the Python path raises."""
    f = fold.Fold()
    x, y = f.add("leaf", 1), f.add("leaf", 2)
    rec = f.op("mix", outputs=2)
    h, c = rec(x, [x, y, y], 0.5, True, 3)
    assert type(f._by_op["leaf"]) is C and type(f._recorders[("mix", 2)]) is C
    assert rec(x, [x, y, y], 0.5, True, 3) == (h, c)  # a memo hit
    assert (h.index, c.index) == (0, 1) and h.depth == 1 and h.id == 2
    assert f.add("leaf", 0.0) != f.add("leaf", -0.0)
    assert f.add("leaf", 0.0) == f.add("leaf", 0.0)
    nan = math.nan
    assert f.add("leaf", nan) == f.add("leaf", nan)  # the same object: one node
    assert f.add("leaf", nan) != f.add("leaf", float("nan"))
    assert f.add("sum", []).depth == 0 and f.add("sum", [h, x]).depth == 2
    with pytest.raises(FoldError, match=r"argument 0 is a list whose element 1 is a Node of"):
        f.add("sum", [x, fold.Fold().add("leaf", 1)])
    with pytest.raises(FoldError, match="deeper than int64"):
        f.add("pair", x, f._node_type(1 << 63))
    with pytest.raises(TypeError):
        rec(x, [x], 0.5, True, 3, extra=1)  # keywords: the Python recorder's TypeError
    # A depth past int64 is recorded as the Python recorder records it, with Python ints.
    deep = f.add("pair", x, f._node_type(((1 << 19) - 1) << 44))
    assert deep.depth == 1 << 19


@pytest.mark.parametrize("handle", [-1, -(1 << 50), 1 << 20, (5 << 44) | (3 << 16)])
@pytest.mark.parametrize("c", [True, False], ids=["C", "Python"])
def test_forged_handles_are_refused_at_apply(handle: int, c: bool, monkeypatch: Any) -> None:
    """A Node made from an int (negative, beyond the graph, or at another node's depth)
    records the same node on both paths and is a FoldError at apply, never an IndexError
    or another node's value."""
    if c and C is None:
        pytest.skip("fold._crecord not built")
    monkeypatch.setattr(graph, "_CRecorder", C if c else None)

    class M(torch.nn.Module):
        def leaf(self, x):
            return x[:, None] * torch.ones(1, 2)

        def node(self, a):
            return a * 2

    f = fold.Fold()
    f.add("leaf", 1.0)
    n = f.add("node", f._node_type(handle))
    with pytest.raises(FoldError, match="op 'node'.*not a handle this Fold recorded.*Fix"):
        f.apply(M(), [[n]])


@pytest.mark.skipif(C is None, reason="fold._crecord not built")
def test_a_cleared_recorder_refuses_calls_and_its_getters_hold() -> None:
    """tp_clear (the collector's, reachable through gc.get_objects()) leaves NULL fields:
    a call raises, the getters answer, nothing crashes."""
    f = fold.Fold()
    f.add("leaf", 1)
    rec = f._by_op["leaf"]
    assert type(rec) is C
    rec._clear()  # what the collector's tp_clear does
    with pytest.raises(ReferenceError, match="cleared"):
        rec(2)
    assert rec.fallback is None and "cleared" in rec.__name__ and "cleared" in repr(rec)


@pytest.mark.skipif(C is None, reason="fold._crecord not built")
@pytest.mark.parametrize(
    "kinds, types",
    [((0,), (int,)), ((1,), (float,)), ((2,), (int,)), ((3,), (int,)), ((4,), (tuple,))],
)
def test_recorder_constructor_checks_kinds_against_types(kinds: Any, types: Any) -> None:
    f = fold.Fold()
    with pytest.raises(TypeError, match="does not fit its kind"):
        C(lambda *a: None, kinds, types, f._node_type, {}, iter(range(9)), None, 0, "x")


@pytest.mark.skipif(C is None, reason="fold._crecord not built")
def test_a_tensor_recorder_needs_its_sigs_and_refuses_calls_once_cleared() -> None:
    f = fold.Fold()
    with pytest.raises(TypeError, match="need sigs"):
        C(lambda *a: None, (5,), (torch.Tensor,), f._node_type, {}, iter(range(9)), None, 0, "x")
    f.add("embed", torch.ones(1, 2))
    rec = f._by_op["embed"]
    assert type(rec) is C
    rec._clear()
    with pytest.raises(ReferenceError, match="cleared"):
        rec(torch.ones(1, 2))


@pytest.mark.skipif(C is None, reason="fold._crecord not built")
def test_c_recorder_of_literal_tensors(monkeypatch: Any) -> None:
    """Literal tensors on the C path: keyed by identity within the signature of their shapes
    and dtypes; a new shape or dtype makes its signature (through the Python recorder); a
    tensor that is no batch of one is the Python recorder's FoldError.  Handles, signatures,
    memos and recorded arguments (tensors in place) equal the Python path's."""
    a, b = torch.zeros(1, 3), torch.zeros(1, 3)
    wide, double = torch.zeros(1, 4), torch.zeros(1, 3, dtype=torch.float64)

    def run(c: bool) -> tuple[Any, ...]:
        monkeypatch.setattr(graph, "_CRecorder", C if c else None)
        f = fold.Fold()
        x = f.add("leaf", 1)
        got = [f.add("mix", x, a, [x], 2)]
        assert type(f._by_op["mix"]) is (C if c else type(f._by_op["leaf"]))
        for t, kids, k in [(a, [x], 2), (b, [x], 2), (wide, [x], 2), (wide, [], 3)]:
            got.append(f.add("mix", x, t, kids, k))
        got.append(f.add("mix", x, double, [x, x], 2))
        got.append(f.add("mix", x, a, [x], 2))  # a hit after other signatures
        with pytest.raises(
            FoldError, match=r"'mix', ...\): argument 1 is a tensor of shape \(3,\)"
        ):
            f.add("mix", x, torch.zeros(3), [x], 2)  # no batch of one
        state = [
            (
                sig,
                list(m.items()),
                [tuple(id(v) if torch.is_tensor(v) else v for v in r) for r in t or ()],
            )
            for sig, m, t in zip(f.signatures, f._memos, f._targs)
        ]
        return [int(h) for h in got], state

    with_c, without = run(True), run(False)
    assert with_c == without
    handles, state = with_c
    assert handles[0] == handles[1] == handles[-1] and len(set(handles)) == 5
    mix = [s for s in state if s[0][0] == "mix"]
    assert len(mix) == 3 and sum(len(s[2]) for s in mix) == 5
