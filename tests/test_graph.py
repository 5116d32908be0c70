"""Recording, scheduling and inspection of a Fold."""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch

import fold
from fold.models import TreeLSTM, record_tree
from fold.scheduler import depth_schedule
from fold.treebank import random_tree


def tree_fold(n: int = 6) -> fold.Fold:
    rng = random.Random(1)
    f = fold.Fold()
    for _ in range(n):
        record_tree(f, random_tree(rng, rng.randint(2, 9), 1000))
    return f


def test_depth_is_one_more_than_the_deepest_argument() -> None:
    f = fold.Fold()
    a = f.add("x", 1)
    b = f.add("y", a, 2)
    c = f.add("z", a, b)
    assert [f.depth[n.id] for n in (a, b, c)] == [0, 1, 2]


def test_depth_schedule_groups_by_depth_and_signature() -> None:
    f = fold.Fold()
    a, b = f.add("leaf", 1), f.add("leaf", 2)
    c = f.add("leaf", 1.5)  # another kind: own group
    d = f.add("pair", a, b)
    f.add("pair", c, d)
    plan = depth_schedule(f.snapshot())
    got = [[sorted(g.nodes) for g in s.groups] for s in plan.steps]
    assert got == [[[0, 1], [2]], [[3]], [[4]]]
    assert plan.num_groups == 4


def test_schedule_is_a_pure_function_of_the_graph() -> None:
    f = tree_fold()
    p1, p2 = depth_schedule(f.snapshot()), depth_schedule(f.snapshot())
    assert [[list(g.nodes) for g in s.groups] for s in p1.steps] == [
        [list(g.nodes) for g in s.groups] for s in p2.steps
    ]
    assert sorted(n for s in p1.steps for g in s.groups for n in g.nodes) == list(range(len(f)))


def test_nobatch_nodes_run_alone_and_split_their_consumers() -> None:
    f = fold.Fold()
    t1 = f.add("table", 1).nobatch()
    t2 = f.add("table", 2).nobatch()
    uses = [f.add("use", i, t) for i in range(3) for t in (t1, t2)]
    plan = depth_schedule(f.snapshot())
    sizes = [sorted(len(g.nodes) for g in s.groups) for s in plan.steps]
    assert sizes == [[1, 1], [3, 3]]
    assert {n.id for n in uses} == {n for g in plan.steps[1].groups for n in g.nodes}


def test_tensor_literal_shapes_are_part_of_the_signature() -> None:
    f = fold.Fold()
    f.add("img", torch.zeros(1, 3))
    f.add("img", torch.zeros(1, 3))
    f.add("img", torch.zeros(1, 4))
    f.add("img", torch.zeros(1, 3, dtype=torch.double))
    assert sorted(len(g.nodes) for g in depth_schedule(f.snapshot()).steps[0].groups) == [1, 1, 2]


def test_tensor_arguments_are_memoised_by_identity() -> None:
    f = fold.Fold()
    t = torch.zeros(1, 3)
    assert f.add("img", t) == f.add("img", t)
    assert f.add("img", t) != f.add("img", torch.zeros(1, 3))


def test_to_networkx() -> None:
    f = fold.Fold()
    a, b = f.add("two", 1).split(2)
    c = f.add("sum", b, a).nobatch()
    g = f.to_networkx()
    assert sorted(g.nodes) == [0, 1]
    assert g.nodes[0] == {"op": "two", "depth": 0, "split": 2, "nobatch": False}
    assert g.nodes[c.id]["nobatch"] is True
    # Two edges 0 -> 1 (arguments 0 and 1) collapse into one in a DiGraph; the last one wins.
    assert g.edges[0, 1] == {"arg": 1, "out": 0}


def test_summary_before_and_after_apply() -> None:
    f = fold.Fold()
    xs = [f.add("leaf", i) for i in range(3)]
    top = f.add("node", xs[0], torch.zeros(1, 2))
    before = str(f)
    assert "planned: 2 steps, 2 groups" in before
    assert "leaf x3 (int)" in before and "node x1 (node, tensor(1, 2) float32)" in before

    class Obj:
        def leaf(self, i):
            return i.float().unsqueeze(1)

        def node(self, x, t):
            return x + t

    f.apply(Obj(), [[top]])
    after = f.summary()
    assert "last apply: 2 steps, 2 groups" in after
    assert "leaf x3 ((3,) int64)" in after and "node x1 ((1, 1), (1, 2))" in after


def test_draw_writes_a_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    f = tree_fold(3)
    path = tmp_path / "graph.png"
    f.draw(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_node_repr_and_len() -> None:
    f = fold.Fold()
    h, c = f.add("leaf", 3).split(2)
    assert repr(c) == "Node(0[1], op='leaf', depth=0)"
    assert len(f) == 1 and "1 nodes" in repr(f)


def test_unfold_runs_ops_eagerly_like_fold() -> None:
    model = TreeLSTM(100, 8)
    rng = random.Random(3)
    trees = [random_tree(rng, rng.randint(1, 6), 100) for _ in range(5)]
    f, u = fold.Fold(), fold.Unfold(model)
    (a,) = f.apply(model, [[record_tree(f, t) for t in trees]])
    (b,) = u.apply(model, [[record_tree(u, t) for t in trees]])
    torch.testing.assert_close(a, b)


class Ops:
    def two(self, x):
        return x + 1, x * 2

    def mix(self, a, b):
        return a * 3 + b

    def scale(self, a, k):
        return a * k


def test_op_recorder_records_the_nodes_add_records() -> None:
    f = fold.Fold()
    two = f.op("two", outputs=2)
    assert f.op("two", outputs=2) is two  # cached per (op, outputs)
    a, b = two(1)
    assert (a, b) == f.add("two", 1).split(2)  # memoised together with add
    m = f.op("mix")(a, b)
    assert m == f.add("mix", a, b)
    s = f.op("scale", outputs=1)(m, 2.5)  # node and number arguments
    assert s == f.add("scale", m, 2.5).split(1)
    c, d = two(2)
    assert len(f) == 4
    outs = f.apply(Ops(), [[s[0]], [m], [a, c]])
    ops = Ops()
    u = fold.Unfold(ops)
    ua, ub = u.add("two", 1).split(2)
    um = u.add("mix", ua, ub)
    (us,) = u.add("scale", um, 2.5).split(1)
    uc, _ = u.add("two", 2).split(2)
    for got, want in zip(outs, u.apply(ops, [[us], [um], [ua, uc]])):
        torch.testing.assert_close(got, want)


def test_op_recorder_rejects_bad_arguments() -> None:
    f, g = fold.Fold(), fold.Fold()
    other = g.add("two", 1)
    mix = f.op("mix")
    with pytest.raises(fold.FoldError, match=r"argument 1 is a Node of another Fold"):
        mix(f.add("two", 1), other)
    with pytest.raises(fold.FoldError, match=r"argument 0 is a str"):
        mix("x", 1)
    with pytest.raises(fold.FoldError, match=r"outputs must be None or an int from 1 to 128"):
        f.op("two", outputs=0)
    with pytest.raises(fold.FoldError, match="expected a method name"):
        f.op(["two"])
    rec = f.op("two", outputs=2)
    del f
    with pytest.raises(fold.FoldError, match="its Fold no longer exists"):
        rec(1)


def test_a_wrong_split_is_caught_where_a_consumer_reads_it() -> None:
    f = fold.Fold()
    x = f.add("two", 1)
    (wrong,) = x.split(1)
    f.add("mix", wrong, wrong)
    with pytest.raises(fold.FoldError, match=r"split with \.split\(1\), but op 'two' returned 2"):
        f.apply(Ops(), [[x.split(2)[0]]])


def test_a_renewed_fold_records_a_new_graph_as_a_new_fold_would() -> None:
    """Fold._renew (autobatch's rounds) empties the graph and keeps its recorders: the next
    graph numbers its nodes from 0, its signatures go in the order of their first nodes (the
    chain plan reads them so, though the Fold registered them in the order of the graph
    before), and apply gives what a new Fold gives."""

    class Ops:
        def two(self, x):
            return x * 2.0

        def mix(self, a, k):
            return a + k

        def feat(self, t):
            return t.sum(1) * 3.0

    def first(f):
        a = f.add("mix", f.add("two", 1.5), 2)
        return [a, f.add("feat", torch.ones(1, 4))]

    def second(f):  # "feat" before "two" and "mix": signatures out of the Fold's order
        x = f.add("feat", torch.full((1, 4), 2.0))
        y = f.add("mix", f.add("two", 0.5), 1)
        return [f.add("mix", x, 3), y, f.add("two", 4.0)]

    f = fold.Fold()
    outs = first(f)
    f.apply(Ops(), [[o] for o in outs])
    f._renew()
    assert len(f) == 0
    renewed = second(f)
    fresh = fold.Fold()
    again = second(fresh)
    assert [h.id for h in renewed] == [h.id for h in again] == [3, 2, 4]  # ids from 0 again
    for got, want in zip(
        f.apply(Ops(), [[o] for o in renewed]), fresh.apply(Ops(), [[o] for o in again])
    ):
        torch.testing.assert_close(got, want)
    arrays = f.snapshot()
    node_id = fold._encoding.node_id
    firsts = [min(map(node_id, arrays.handles(s))) for s in range(len(arrays.signatures))]
    assert firsts == sorted(firsts)


def test_node_classes_are_reused_only_when_nothing_refers_to_them() -> None:
    from fold import node as graph

    f = fold.Fold()
    stale = f.add("two", 1)
    del f
    g = fold.Fold()
    # The stale handle keeps its class alive, so the new Fold has another one and rejects it.
    assert g._node_type is not type(stale)
    with pytest.raises(fold.FoldError, match="Node of another Fold"):
        g.add("mix", g.add("two", 1), stale)
    del stale, g
    pooled = len(graph._NODE_TYPES)
    for _ in range(50):  # a Fold per step, as a training loop makes them
        fold.Fold().add("two", 1)
    assert len(graph._NODE_TYPES) <= pooled + 1


def test_a_fold_per_step_reuses_its_node_class(monkeypatch) -> None:
    """A training loop records a new Fold every step, with ops on node arguments: nothing the
    library keeps across Folds (recorder patterns, plans) may hold a Fold's Node class, or
    every step makes a class (tens of microseconds, and cyclic garbage)."""
    from fold import node

    made = []
    original = node._make_node_type
    monkeypatch.setattr(node, "_make_node_type", lambda: made.append(1) or original())

    class Ops:
        def two(self, x):
            return x * 2.0

        def mix(self, a, k):
            return a + k

    for _ in range(20):
        f = fold.Fold()
        outs = [f.add("mix", f.add("two", i), 1) for i in range(3)]
        f.apply(Ops(), [outs])
        del f, outs
    assert len(made) <= 1


def test_specialised_recorders_fall_back_for_other_arities_and_types() -> None:
    f, g = fold.Fold(), fold.Fold()
    mix = f.op("mix")
    a, b = f.op("two", outputs=2)(1)
    first = mix(a, b)  # classifies (a node, a node) and unrolls that case
    fast = f.op("mix")
    assert fast is not mix and f.op("mix") is fast
    assert fast(a, b) == first and mix(a, b) == first
    assert fast(b, a) == f.add("mix", b, a)
    assert fast(a, 2) == f.add("mix", a, 2)  # other types: the general path
    assert fast(a) == f.add("mix", a)  # other arities too
    assert fast(a, b, a) == f.add("mix", a, b, a)
    with pytest.raises(fold.FoldError, match="argument 1 is a Node of another Fold"):
        fast(a, g.add("two", 1))
    leaf = f.op("two", outputs=2)
    assert leaf(True) == f.add("two", True).split(2)  # bool is not int: its own signature
    assert f.signatures[f.sig[leaf(True)[0].id]][1] == (fold._encoding.BOOL,)


def test_the_graph_keeps_plain_ints_not_node_objects() -> None:
    """Node handles are objects the garbage collector tracks; the graph must keep plain ints,
    or every recorded graph fills the oldest generation (full collections while recording)."""
    f = fold.Fold()
    trees = [random_tree(random.Random(i), 6, 50) for i in range(4)]
    roots = [record_tree(f, t) for t in trees]  # Fold.op recorders, unrolled after one call
    x = f.add("two", 3)
    a, b = x.split(2)
    f.add("mix", a, b)  # add
    f.add("mix", a, 2)  # add, mixed kinds
    f.add("image", torch.ones(1, 2), a)  # literal tensor with a node argument
    keys = [key for memo in f._memos for key in memo]
    packed = [key for key in keys if type(key) is bytes]  # node arguments only: int64 bytes
    kept = [k for key in keys if type(key) is tuple for k in key]
    kept += [k for targs in f._targs if targs for args in targs for k in args]
    assert roots and kept and packed
    assert not [k for k in kept if isinstance(k, fold.Node)]
    assert len(keys) == len(packed) + sum(type(key) is tuple for key in keys)


def test_handles_beyond_int64_are_a_fold_error_when_recorded() -> None:
    """Packed memo keys and list keys hold int64 handles: a graph too deep for them (about
    500k steps) is refused where it is recorded, never cut short."""
    f = fold.Fold()
    x = f.add("leaf", 1)
    deep = type(x)(1 << 63)  # the handle of a node half a million steps deep
    for record in (lambda: f.add("pair", x, deep), lambda: f.add("pool", [x, deep])):
        with pytest.raises(fold.FoldError, match="deeper than int64"):
            record()
    rec = f.op("pair")
    rec(x, x)  # the specialised recorder: the same check
    with pytest.raises(fold.FoldError, match="deeper than int64"):
        rec(deep, x)


def test_a_recorder_kept_by_the_caller_reaches_its_specialised_version(monkeypatch) -> None:
    """``step = f.op("step")`` once, then a loop: after the first call, the recorder the
    caller holds runs the unrolled code (it never classifies arguments again), and
    no reference cycle keeps the Fold or its recorders alive once the caller drops it."""
    from fold import graph

    gc.collect()
    gc.disable()
    try:
        f = fold.Fold()
        mix = f.op("mix")
        a, b = f.op("two", outputs=2)(1)
        first = mix(a, b)  # classifies and unrolls

        def general_path(*args):
            raise AssertionError("the general recorder ran")

        monkeypatch.setattr(graph.Fold, "_specialise", general_path)
        second = mix(b, a)  # a new node of the same types
        monkeypatch.undo()
        assert second == f.add("mix", b, a) and first == f.add("mix", a, b)
        alive, unrolled = weakref.ref(f), weakref.ref(f.op("mix"))
        del f
        assert alive() is None and unrolled() is None  # freed by reference counts alone
        with pytest.raises(fold.FoldError, match="its Fold no longer exists"):
            mix(a, 3)
    finally:
        gc.enable()


@pytest.mark.parametrize("outputs", [None, 1, 3])
def test_unrolled_recorders_return_what_add_and_split_return(outputs) -> None:
    class Three:
        def three(self, x, k):
            return (x * k, x + k, x - k) if outputs == 3 else x * k

    f = fold.Fold()
    base = f.add("three", 1.5, 2)  # a node argument for the recorder below
    (x,) = [base] if outputs != 3 else [base.split(3)[0]]
    rec = f.op("three", outputs=outputs)
    first = rec(x, 2)  # generic: classifies, then the Fold unrolls the recorder
    unrolled = f.op("three", outputs=outputs)
    assert unrolled is not rec
    for k in (2, 3, 4):
        got = unrolled(x, k)
        node = f.add("three", x, k)
        want = node if outputs is None else node.split(outputs)
        assert got == want and type(got) is type(want)
    assert first == unrolled(x, 2)
    lists = [[v] for v in (first if outputs else [first])] if outputs != 3 else [[first[2]]]
    out = f.apply(Three(), lists)
    assert out[0].shape == (1,)


def test_the_plan_is_kept_until_the_graph_changes() -> None:
    f = fold.Fold()
    a = f.add("two", 1)
    x, y = a.split(2)
    b = f.add("mix", x, y)
    first = f.plan()
    assert f.plan() is first  # applying the same graph again plans once
    c = f.add("mix", b, y)  # a new node: a new plan that holds it
    grown = f.plan()
    assert grown is not first and c.id in {
        int(n) for s in grown.steps for g in s.groups for n in g.nodes
    }
    f.add("mix", b, y)  # a memo hit adds nothing: the plan stays
    assert f.plan() is grown
    b.nobatch()  # other group keys
    marked = f.plan()
    assert marked is not grown and any(
        g.key == ("nobatch", b.id) for s in marked.steps for g in s.groups
    )
    f.strategy = "agenda"
    assert f.plan() is not marked and f.plan().num_groups == len(f)


class InPlace(torch.nn.Module):
    """Ops that change their arguments in place, and one that returns its argument."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(2.0))

    def dec(self, w):
        w -= 1  # an int column, changed in place
        return w.to(self.scale.dtype).unsqueeze(1) * self.scale

    def img(self, x):
        x.mul_(0)
        return x * self.scale

    def same(self, w):
        return w

    def join(self, a, b):
        return a + b


def test_ops_changing_arguments_in_place_do_not_change_the_graph() -> None:
    model = InPlace()
    f = fold.Fold()
    leaves = [f.add("dec", i) for i in range(4)]
    images = [f.add("img", torch.full((1, 2), 3.0))]
    roots = [f.add("join", leaves[0], leaves[1]), f.add("join", leaves[2], leaves[3])]
    first = f.apply(model, [leaves, roots, images])
    second = f.apply(model, [leaves, roots, images])
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b)
    assert first[0].view(-1).tolist() == [-2.0, 0.0, 2.0, 4.0]  # (i - 1) * 2, every time
    # The Fold's literal tensor is the user's: untouched.
    assert f.args[4][0].tolist() == [[3.0, 3.0]]


def test_results_do_not_alias_what_the_graph_keeps() -> None:
    model = InPlace()
    f = fold.Fold()
    nodes = [f.add("same", i) for i in range(3)]
    tail = f.add("join", nodes[0], nodes[1])  # a second signature: the general executor
    for entries in ([nodes], [nodes, [tail]]):
        (r, *_) = f.apply(model, entries)
        r += 100
        (again, *_) = f.apply(model, entries)
        assert again.tolist() == [0, 1, 2]


def test_ops_changing_arguments_in_place_under_a_batch_module() -> None:
    from fold.batched_ops import BatchModule

    class Dec(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(1, 1)

        def dec(self, w):
            w -= 1
            return self.lin(w.float().unsqueeze(1))

    models = [Dec() for _ in range(3)]
    bm = BatchModule.from_modules(models)
    f = fold.Fold()
    nodes = [f.add("dec", i) for i in range(4)]
    (out,) = f.apply(bm, [nodes])  # on a CPU: one model at a time, one graph
    for i, m in enumerate(models):
        want = m.lin(torch.arange(4.0).unsqueeze(1) - 1)
        torch.testing.assert_close(out[i], want)


def test_negative_zero_is_not_memoised_as_zero() -> None:
    np = pytest.importorskip("numpy")

    class Recip:
        def recip(self, x):
            return 1 / x

        def pair(self, x, y):
            return y / x

    f = fold.Fold()
    a, b, c = f.add("recip", 0.0), f.add("recip", -0.0), f.add("recip", np.float64(-0.0))
    assert a != b and b == c
    rec = f.op("pair")
    p, q = rec(-0.0, 1.0), rec(0.0, 1.0)
    assert p != q
    nan = float("nan")
    obj = Recip()
    got = f.apply(obj, [[a, b, f.add("recip", nan)], [p, q]])
    u = fold.Unfold(obj)
    want = u.apply(
        obj,
        [
            [u.add("recip", 0.0), u.add("recip", -0.0), u.add("recip", nan)],
            [u.add("pair", -0.0, 1.0), u.add("pair", 0.0, 1.0)],
        ],
    )
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, equal_nan=True)
    assert got[0][:2].tolist() == [float("inf"), float("-inf")]
    # A -0.0 among literal tensors takes its own node too.
    t = torch.ones(1, 2)
    assert f.add("pair", -0.0, t) != f.add("pair", 0.0, t)


def test_one_d_tensor_as_a_list_of_numbers() -> None:
    model = InPlace()
    labels = torch.tensor([3, 1, 2])
    for chain in (True, False):
        f = fold.Fold()
        nodes = [f.add("dec", i) for i in range(3)]
        if not chain:
            f.add("join", nodes[0], nodes[1])
        out, y = f.apply(model, [nodes, labels])
        assert y.tolist() == [3, 1, 2] and y.dtype == torch.long
        assert out.shape == (3, 1)
    u = fold.Unfold(model)
    assert u.apply(model, [[u.add("dec", 1)], labels])[1].tolist() == [3, 1, 2]


def test_submodules_load_on_first_use() -> None:
    import subprocess
    import sys

    code = (
        "import fold; fold.optim.SGD; fold.batched_ops.BatchModule; fold.train.Trainer; "
        "fold.diagnostics.Aggregator\n"
        "try:\n    fold.nope\nexcept AttributeError:\n    print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_draw_leaves_the_matplotlib_backend_alone(tmp_path) -> None:
    matplotlib = pytest.importorskip("matplotlib")
    before = matplotlib.get_backend()
    matplotlib.use("svg")
    try:
        f = fold.Fold()
        f.add("join", f.add("same", 1), f.add("same", 2))
        f.draw(str(tmp_path / "g.png"))
        assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(before)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's own, on importing dynamo
def test_apply_on_a_compiled_module_warns_that_ops_run_uncompiled() -> None:
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def leaf(self, x):
            return self.lin(x)

    m = M()
    compiled = torch.compile(m)  # compiles lazily: nothing runs until forward is called
    f = fold.Fold()
    n = f.add("leaf", torch.ones(1, 2))
    with pytest.warns(UserWarning, match=r"op 'leaf' runs uncompiled.*torch.compile\(model.leaf\)"):
        (out,) = f.apply(compiled, [[n]])
    torch.testing.assert_close(out, m.leaf(torch.ones(1, 2)))


class _Sum(torch.nn.Module):
    def leaf(self, x):
        return x[:, None] * torch.ones(1, 2)

    def pair(self, a, b):
        return a + 2 * b


def _interrupt_at(code: object, line: int):
    """A trace function raising KeyboardInterrupt the first time ``code`` reaches ``line``."""
    import sys

    fired = []

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == line and not fired:
            fired.append(line)
            raise KeyboardInterrupt
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code is code else None

    sys.settrace(tracer)
    return fired


def test_an_interrupt_while_a_signature_is_made_leaves_the_fold_usable() -> None:
    """A KeyboardInterrupt at any line of Fold._signature leaves the Fold as it was: the
    next records and apply give what Unfold gives."""
    import sys

    code = fold.Fold._signature.__code__
    lines = sorted({ln for _, _, ln in code.co_lines() if ln is not None})[1:]
    for line in lines:
        f = fold.Fold()
        a = f.add("leaf", 1.0)
        fired = _interrupt_at(code, line)
        try:
            f.add("pair", a, a)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        b = f.add("pair", a, a)
        c = f.add("pair", b, a)
        got = f.apply(_Sum(), [[b, c]])[0]
        m = _Sum()
        u = fold.Unfold(m)
        ua = u.add("leaf", 1.0)
        ub = u.add("pair", ua, ua)
        want = u.apply(m, [[ub, u.add("pair", ub, ua)]])[0]
        torch.testing.assert_close(got, want, msg=f"line {line} (fired: {fired})")


def test_a_lost_node_id_is_a_fold_error_at_apply() -> None:
    """What two threads recording one Fold at once do (both miss the memo, each takes an
    id, one is lost): apply refuses, naming threads and the fix."""
    f = fold.Fold()
    a = f.add("leaf", 1.0)
    next(f._ids)  # the losing thread's id
    b = f.add("pair", a, a)
    with pytest.raises(fold.FoldError, match="several threads.*Fix: record it again"):
        f.apply(_Sum(), [[b]])


def test_one_fold_recorded_from_threads_is_right_or_refused(monkeypatch) -> None:
    """Threads racing on one Fold (the Python recorders, which can switch between steps):
    apply gives Unfold's values, or the FoldError that names threads; nothing else."""
    import sys
    import threading

    from fold import graph

    monkeypatch.setattr(graph, "_CRecorder", None)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        f = fold.Fold()
        per_thread: list = [None] * 4

        def work(k: int) -> None:
            leaves = [f.add("leaf", float(i % 7)) for i in range(200)]
            per_thread[k] = [f.add("pair", x, y) for x, y in zip(leaves, leaves[1:])]

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    roots = [r for rs in per_thread for r in rs]
    try:
        got = f.apply(_Sum(), [roots])[0]
    except fold.FoldError as err:
        assert "several threads" in str(err)
        return
    leaf = [torch.full((2,), float(i % 7)) for i in range(200)]
    want = torch.stack([x + 2 * y for x, y in zip(leaf, leaf[1:])] * 4)
    torch.testing.assert_close(got, want)


class _StepOps:
    """Ops of a small per-sample step: literal features, a number, and a mix of both."""

    def feat(self, t):
        return t.sum(1) * 3.0

    def leaf(self, k):
        return k.to(torch.float64) * 0.5

    def mix(self, a, b):
        return a * b + 1.0


def _record_step(f, xs, ks):
    feats = [f.add("feat", x) for x in xs]
    return [f.add("mix", a, f.add("leaf", k)) for a, k in zip(feats, ks)]


def test_a_dropped_fold_leaves_its_recorders_to_the_next_fold(monkeypatch) -> None:
    """A Fold per step, as a per-sample training loop makes them: the next Fold takes the
    dropped one's recorders of literal arguments (none made again), numbers its nodes from
    0, and gives eager's values and gradients; recorders of node arguments are made again;
    a step of one op on literals takes the one-call path though the Fold keeps the
    signatures of the step before."""
    from fold import graph, run

    monkeypatch.setattr(graph, "_LEFT", [])
    made = []
    specialise = graph.Fold._specialise
    monkeypatch.setattr(
        graph.Fold, "_specialise", lambda self, op, *a: made.append(op) or specialise(self, op, *a)
    )
    rng = torch.Generator().manual_seed(0)
    for step in range(4):
        made.clear()
        xs = [
            torch.randn(1, 3, dtype=torch.float64, generator=rng, requires_grad=True)
            for _ in range(5)
        ]
        ks = [step + i for i in range(5)]
        f = fold.Fold()
        outs = _record_step(f, xs, ks)
        assert [h.id for h in outs[:2]] == [6, 8]  # ids from 0, as in a new Fold
        (got,) = f.apply(_StepOps(), [outs])
        want = torch.cat([x.sum(1) * 3.0 * (k * 0.5) + 1.0 for x, k in zip(xs, ks)])
        torch.testing.assert_close(got, want)
        grads = torch.autograd.grad(got.square().sum(), xs)
        wgrads = [
            2 * w * 3.0 * (k * 0.5) * torch.ones(1, 3, dtype=torch.float64)
            for w, k in zip(want, ks)
        ]
        for g, w in zip(grads, wgrads):
            torch.testing.assert_close(g, w)
        # The first Fold makes every recorder; the next ones only that of "mix" (nodes).
        assert sorted(made) == (["feat", "leaf", "mix"] if step == 0 else ["mix"])
        del f, outs
    # One op on literals: the one-call path, through the signatures left by the steps above.
    f = fold.Fold()
    xs = [torch.randn(1, 3, dtype=torch.float64, generator=rng) for _ in range(3)]
    feats = [f.add("feat", x) for x in xs]
    assert len(f.signatures) == 3 and run._one_sig(f) is not None
    monkeypatch.setattr(run, "Executor", None)  # the one-call path makes no executor
    (got,) = f.apply(_StepOps(), [feats])
    torch.testing.assert_close(got, torch.cat([x.sum(1) * 3.0 for x in xs]))


def test_a_dropped_fold_leaves_nothing_a_caller_can_still_reach(monkeypatch) -> None:
    """What a caller still holds of a dropped Fold keeps the next Fold from taking its
    recorders, or no longer records: a handle (its Node class would name the new Fold's
    nodes), a snapshot (it reads the lists a Fold empties when it leaves them), a recorder
    from Fold.op (called: it would record into the new Fold; held specialised: the new
    Fold starts afresh), and a Fold with an op that is not a name leaves nothing."""
    from fold import graph

    monkeypatch.setattr(graph, "_LEFT", [])

    f = fold.Fold()
    stale = f.add("leaf", 1)
    del f
    g = fold.Fold()  # the handle is alive: g does not take its class
    assert g._node_type is not type(stale) and graph._LEFT == []
    with pytest.raises(fold.FoldError, match="Node of another Fold"):
        g.add("mix", stale, 1)
    with pytest.raises(fold.FoldError, match="no longer exists"):
        _ = stale.fold
    del g, stale

    f = fold.Fold()
    nodes = [f.add("feat", torch.full((1, 2), float(i))) for i in range(3)]
    arrays = f.snapshot()
    rows = [r[0].tolist() for r in arrays.rows(0)]
    left = len(graph._LEFT)
    del f, nodes
    assert len(graph._LEFT) == left  # the snapshot is alive: nothing left, nothing emptied
    assert arrays.count == [3] and [r[0].tolist() for r in arrays.rows(0)] == rows
    del arrays

    graph._LEFT.clear()
    f = fold.Fold()
    rec = f.op("leaf")
    rec(1)  # its box now points at the specialised recorder the Fold leaves
    del f
    assert len(graph._LEFT) == 1
    g = fold.Fold()
    assert graph._LEFT == [] and g._renewed  # g took the recorders
    with pytest.raises(fold.FoldError, match="no longer exists"):
        rec(2)
    assert len(g) == 0
    del g

    f = fold.Fold()
    f.op("leaf")(1)
    held = f.op("leaf")  # after its first call, the specialised recorder itself
    assert held is f._by_op["leaf"]
    del f
    g = fold.Fold()
    assert not g._renewed and "leaf" not in g._by_op  # held elsewhere: g starts afresh
    with pytest.raises(fold.FoldError, match="Node of another Fold"):
        g.add("mix", held(2), 1)
    del g, held

    graph._LEFT.clear()
    f = fold.Fold()
    f.add(_StepOps().leaf, 1)
    del f
    assert graph._LEFT == []  # a callable op: kept, it would keep its object alive

    f = fold.Fold()
    f.add("leaf", 1)
    f.epoch = 3  # the caller's own attribute
    f.apply = lambda *a, **k: None  # (a wrapped apply, as a test harness might)
    del f
    assert graph._LEFT == []  # not left: it would reappear on the next Fold
    g = fold.Fold()
    assert not hasattr(g, "epoch") and "apply" not in vars(g)
