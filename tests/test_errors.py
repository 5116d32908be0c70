"""Bad input: each a FoldError naming the op, the argument and the fix."""

from __future__ import annotations

import pytest
import torch

import fold
from fold import FoldError


class Obj:
    def one(self, x):
        return x * 1.0

    def two(self, x):
        return x + 1, x - 1

    def boom(self, x, y):
        raise RuntimeError("kaboom")

    def scalar(self, x):
        return 3

    def nested(self, x):
        return [x, "no"]

    def squash(self, x):
        return x.sum()

    def widen(self, x):
        return x.float().unsqueeze(1).repeat(1, len(x))


def test_fold_error_is_a_value_error() -> None:
    assert issubclass(FoldError, ValueError)


@pytest.mark.parametrize(
    "bad, shown",
    [
        ("word", "str"),
        ([1, 2], "list"),
        ({"a": 1}, "dict"),
        (None, "NoneType"),
        (object(), "object"),
    ],
)
def test_add_rejects_unsupported_arguments(bad: object, shown: str) -> None:
    f = fold.Fold()
    x = f.add("one", 1)
    with pytest.raises(
        FoldError, match=rf"Fold.add\('one', \.\.\.\): argument 1 is a {shown}.*Fix"
    ):
        f.add("one", x, bad)
    assert len(f) == 1  # nothing was recorded


def test_add_rejects_a_node_of_another_fold() -> None:
    other = fold.Fold().add("one", 1)
    with pytest.raises(FoldError, match=r"'one'.*argument 0 is a Node of another Fold"):
        fold.Fold().add("one", other)


def test_add_rejects_tensors_that_are_not_batch_of_one() -> None:
    with pytest.raises(FoldError, match=r"argument 0 is a tensor of shape \(3, 2\).*unsqueeze"):
        fold.Fold().add("one", torch.zeros(3, 2))
    with pytest.raises(FoldError, match=r"argument 0 is a tensor of shape \(\)"):
        fold.Fold().add("one", torch.tensor(1.0))


def test_add_rejects_an_op_that_is_neither_name_nor_callable() -> None:
    with pytest.raises(FoldError, match="op is a int"):
        fold.Fold().add(3, 1)


def test_apply_with_a_missing_op() -> None:
    f = fold.Fold()
    f.add("missing", 1)
    with pytest.raises(
        FoldError, match=r"op 'missing' is not a method of the Obj.*def missing\(self"
    ):
        f.apply(Obj(), [[f.add("one", 1)]])


def test_multi_output_node_used_without_split() -> None:
    f = fold.Fold()
    n = f.add("two", 1)
    f.add("one", n)
    with pytest.raises(FoldError, match=r"op 'two' returned 2 outputs.*without split.*split\(2\)"):
        f.apply(Obj(), [[n]])


@pytest.mark.parametrize("n", [1, 3])
def test_split_with_the_wrong_n(n: int) -> None:
    f = fold.Fold()
    outs = f.add("two", 1).split(n)
    with pytest.raises(FoldError, match=rf"split with \.split\({n}\), but op 'two' returned 2"):
        f.apply(Obj(), [[outs[0]]])


def test_split_of_a_single_output_op_into_two() -> None:
    f = fold.Fold()
    a, _ = f.add("one", 1).split(2)
    with pytest.raises(FoldError, match=r"\.split\(2\), but op 'one' returned 1 output"):
        f.apply(Obj(), [[a]])


def test_split_twice_differently_and_split_of_an_output() -> None:
    f = fold.Fold()
    n = f.add("two", 1)
    a, _ = n.split(2)
    assert n.split(2)[0] == a
    # split() records nothing: a split that does not match the op is caught where it is used.
    wrong = n.split(3)
    assert f.apply(Obj(), [[a]])[0].shape == (1,)
    with pytest.raises(FoldError, match=r"split with \.split\(3\), but op 'two' returned 2"):
        f.apply(Obj(), [[wrong[2]]])
    with pytest.raises(FoldError, match="already one output of a split"):
        a.split(2)
    with pytest.raises(FoldError, match="must be an int from 1 to 128"):
        f.add("two", 2).split(0)


def test_whole_node_used_after_split_is_rejected() -> None:
    f = fold.Fold()
    n = f.add("two", 1)
    n.split(2)
    user = f.add("one", n)
    with pytest.raises(FoldError, match=r"node 0 \('two'\) is used whole, without split"):
        f.apply(Obj(), [[user]])
    with pytest.raises(FoldError, match=r"node 0 \('two'\) is used whole"):
        f.apply(Obj(), [[n]])


def test_whole_node_used_before_split_is_rejected_at_apply() -> None:
    f = fold.Fold()
    n = f.add("two", 1)
    user = f.add("one", n)
    n.split(2)
    with pytest.raises(FoldError, match=r"node 0 \('two'\) is used whole, without split"):
        f.apply(Obj(), [[user]])


@pytest.mark.parametrize(
    "op, shown", [("scalar", "a int"), ("nested", r"a list of \(Tensor, str\)")]
)
def test_op_returning_non_tensors(op: str, shown: str) -> None:
    f = fold.Fold()
    n = f.add(op, 1)
    with pytest.raises(
        FoldError, match=rf"op '{op}' \(step 0\) returned {shown}; an op must return a tensor"
    ):
        f.apply(Obj(), [[n]])


def test_op_dropping_the_batch_dim() -> None:
    f = fold.Fold()
    nodes = [f.add("squash", i) for i in range(3)]
    with pytest.raises(FoldError, match=r"op 'squash' .* shape \(\) for a group of 3 node\(s\)"):
        f.apply(Obj(), [nodes])


def test_list_mixing_nodes_and_numbers() -> None:
    f = fold.Fold()
    n = f.add("one", 1)
    with pytest.raises(FoldError, match=r"lists\[1\] mixes nodes and numbers"):
        f.apply(Obj(), [[n], [n, 3]])


def test_lists_of_the_wrong_type() -> None:
    f = fold.Fold()
    n = f.add("one", 1)
    with pytest.raises(FoldError, match="expected a list of lists"):
        f.apply(Obj(), n)
    with pytest.raises(FoldError, match=r"lists\[0\] is a Node"):
        f.apply(Obj(), [n])
    with pytest.raises(FoldError, match=r"lists\[0\] is empty"):
        f.apply(Obj(), [[]])
    with pytest.raises(FoldError, match=r"lists\[0\] holds a str"):
        f.apply(Obj(), [["x"]])


def test_output_nodes_of_different_shapes_in_one_list() -> None:
    f = fold.Fold()
    a = f.add("one", 1)  # (1,) float
    b = f.add("widen", 2)  # (1, 1)
    with pytest.raises(FoldError, match=r"lists\[0\] holds output nodes of different shapes"):
        f.apply(Obj(), [[a, b]])


def test_output_nodes_of_another_fold() -> None:
    f, g = fold.Fold(), fold.Fold()
    f.add("one", 1)
    with pytest.raises(FoldError, match="nodes that this Fold did not record"):
        f.apply(Obj(), [[g.add("one", 1)]])


def test_exception_inside_an_op_is_chained_and_the_fold_stays_usable() -> None:
    f = fold.Fold()
    xs = [f.add("one", i) for i in range(4)]
    ys = [f.add("boom", x, torch.zeros(1, 7)) for x in xs]
    with pytest.raises(FoldError) as info:
        f.apply(Obj(), [ys])
    msg = str(info.value)
    assert "op 'boom' failed at step 1 on a group of 4 node(s)" in msg
    assert "arguments ((4,), (4, 7))" in msg and "RuntimeError: kaboom" in msg
    assert isinstance(info.value.__cause__, RuntimeError)
    # Still inspectable: the summary shows what ran before the failure, networkx the graph.
    assert "one x4" in f.summary()
    assert f.to_networkx().number_of_nodes() == 8


def test_an_op_out_of_memory_names_the_limits_and_stays_an_out_of_memory_error() -> None:
    class Small(torch.nn.Module):
        """An op that 'runs out of memory' on more than 3 rows at a time."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if len(x) > 3:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return x * 2

    f = fold.Fold()
    xs = [torch.full((1, 2), float(i), dtype=torch.float64) for i in range(8)]
    outs = [f.add("forward", x) for x in xs]
    with pytest.raises(torch.OutOfMemoryError) as info:  # what a step's OOM handler catches
        f.apply(Small(), [outs])
    assert isinstance(info.value, FoldError)
    msg = str(info.value)
    assert "op 'forward' failed at step 0 on a group of 8 node(s)" in msg
    assert "max_rows=K" in msg and "offload='cpu'" in msg and "Unfold" not in msg
    (y,) = f.apply(Small(), [outs], max_rows=3)  # the fix it names
    torch.testing.assert_close(y, torch.cat(xs) * 2, rtol=0, atol=0)


@pytest.mark.parametrize("bad", ["foreign list element", "handle beyond int64"])
def test_a_refused_call_leaves_the_fold_usable(bad: str) -> None:
    """A call refused after its pattern was seen (here in an earlier Fold) makes its
    signature before the recorder raises; apply must not trip on that empty signature."""
    for attempt in range(2):  # the first Fold teaches the pattern, the second is refused
        f, other = fold.Fold(), fold.Fold()
        x = f.add("one", 1)
        if bad == "foreign list element":
            arg = [x, other.add("one", 2)] if attempt else [x]
        else:
            arg = f._node_type(1 << 63) if attempt else x
        try:
            f.add("pair", x, arg)
        except FoldError as e:
            assert attempt == 1
            assert "another Fold" in str(e) or "deeper than int64" in str(e)
        y = f.add("three", 3)  # a signature made after the refused one
        groups = [line.split(" x")[0].strip() for line in f.summary().splitlines()[1:]]
        # The plan's groups named by their own signatures.
        assert groups[:3] == ["step 0:", "one", "three"] and len(groups) == (3 if attempt else 5)
        (out,) = f.apply(Pair(), [[y]])
        assert out.tolist() == [3.0]


class Pair(Obj):
    def three(self, x):
        return x * 1.0

    def pair(self, x, y):
        return x + (y.sum(feature=(), dtype=x.dtype) if isinstance(y, fold.Ragged) else y)


def test_unknown_strategy() -> None:
    with pytest.raises(
        FoldError,
        match=r"unknown strategy; expected one of \['agenda', 'auto', 'depth', 'lockstep'\]",
    ):
        fold.Fold(strategy="magic")


def test_unfold_errors_match_fold() -> None:
    u = fold.Unfold(Obj())
    with pytest.raises(FoldError, match=r"argument 0 is a str"):
        u.add("one", "x")
    with pytest.raises(FoldError, match=r"has no op 'nope'"):
        u.add("nope", 1)
    with pytest.raises(FoldError, match=r"returned 2 output\(s\). Fix: call \.split\(2\)"):
        u.add("two", 1).split(3)
    with pytest.raises(FoldError, match=r"returned 2 outputs and its node is used whole"):
        u.add("one", u.add("two", 1))
    with pytest.raises(FoldError, match="not the object this Unfold was built with"):
        u.apply(Obj(), [[u.add("one", 1)]])


def test_arithmetic_on_a_node_is_refused() -> None:
    f = fold.Fold()
    n = f.add("one", 1)
    with pytest.raises(FoldError, match=r"is a handle on a recorded value.*f.add\('my_op'"):
        n + 1
    with pytest.raises(FoldError, match="handle on a recorded value"):
        2 * n


def test_numpy_and_other_number_types_are_normalised() -> None:
    np = pytest.importorskip("numpy")
    f = fold.Fold()
    a = f.add("one", np.int64(3))
    assert a == f.add("one", 3)  # the same int argument, memoised
    (out,) = f.apply(Obj(), [[a, f.add("one", np.float32(0.5))]])
    assert out.tolist() == [3.0, 0.5]


@pytest.mark.parametrize("with_node", [False, True])
def test_an_int_beyond_int64_names_the_op_and_argument(with_node: bool) -> None:
    class Steps:
        def start(self, w):
            return w.double().unsqueeze(1)

        def step(self, h, w):
            return h + w.double().unsqueeze(1)

    f = fold.Fold()
    h = f.add("start", 1)
    out = f.add("step", h, 2**70) if with_node else f.add("start", 2**70)
    where = "op 'step', argument 1" if with_node else "op 'start', argument 0"
    with pytest.raises(fold.FoldError, match=f"{where}: an int does not fit in torch.long"):
        f.apply(Steps(), [[out]])


@pytest.mark.parametrize("runner", ["fold", "unfold"])
def test_bad_entries_of_output_lists(runner: str) -> None:
    obj = Obj()
    f = fold.Fold() if runner == "fold" else fold.Unfold(obj)
    n = f.add("one", 1)
    cases = [
        ([n], [torch.tensor(3.0)], r"lists\[1\]\[0\] is a tensor of shape \(\).*unsqueeze"),
        (
            [n],
            [torch.ones(1, 2), torch.ones(3, 2)],
            r"lists\[1\]\[1\] is a tensor of shape \(3, 2\)",
        ),
        (
            [n],
            [torch.ones(1, 2), torch.ones(1, 2, dtype=torch.float64)],
            r"\(2,\) float32, \(2,\) float64",
        ),
        ([n], [1, 2**70], r"lists\[1\] holds numbers .*int64"),
        ([n], torch.ones(2, 3), r"lists\[1\] is a tensor of shape \(2, 3\); .* 1-D.*t.view\(-1\)"),
        ([n], torch.tensor(4), r"lists\[1\] is a tensor of shape \(\);.*t.view\(1\)"),
    ]
    for first, second, match in cases:
        with pytest.raises(FoldError, match=match):
            f.apply(obj, [first, second])


def test_output_nodes_of_different_dtypes_name_the_dtypes() -> None:
    class Two:
        def f32(self, x):
            return x.float().unsqueeze(1)

        def f64(self, x):
            return x.double().unsqueeze(1)

    f = fold.Fold()
    a, b = f.add("f32", 1), f.add("f64", 2)
    with pytest.raises(
        FoldError,
        match=r"\(1,\) float32 per row, \(1,\) float64 per row|\(1,\) float32, \(1,\) float64 per row",
    ):
        f.apply(Two(), [[a, b]])


def test_numpy_bools_are_bool_arguments_and_list_entries() -> None:
    np = pytest.importorskip("numpy")

    class Flags:
        def flag(self, b):
            assert b.dtype == torch.bool
            return b.float().unsqueeze(1)

    f = fold.Fold()
    a, b = f.add("flag", np.True_), f.add("flag", np.False_)
    assert a == f.add("flag", True)  # the same bool argument, memoised
    out, flags = f.apply(Flags(), [[a, b], [np.True_, False]])
    assert out.view(-1).tolist() == [1.0, 0.0]
    assert flags.dtype == torch.bool and flags.tolist() == [True, False]


def test_max_rows_keyed_by_an_unknown_op() -> None:
    f = fold.Fold()
    n = f.add("one", 1)
    with pytest.raises(FoldError, match=r"max_rows has a limit for 'onee'.*its ops: \['one'\]"):
        f.apply(Obj(), [[n]], max_rows={"onee": 1})
    # An op of the object that this graph does not use is fine (a dict shared by graphs).
    (out,) = f.apply(Obj(), [[n]], max_rows={"one": 1, "two": 4})
    assert out.tolist() == [1.0]
