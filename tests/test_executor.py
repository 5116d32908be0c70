"""Fold.apply against eager references: values and gradients."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fold
from fold.errors import op_name
from fold.models import MLP, TreeLSTM, record_tree
from fold.scheduler import chain_plan
from fold.treebank import Tree, random_tree


def grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in module.named_parameters() if p.grad is not None}


def assert_same_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tol: float) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=lambda m, k=k: f"grad of {k}: {m}", **tol)


# ---------------------------------------------------------------- the seed notebook's examples
class Exp:
    def __init__(self, base: int) -> None:
        self.b = base

    def exp(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.b


def test_exponentiation_chain_on_a_plain_class() -> None:
    f = fold.Fold()
    result, nodes = 1, []
    for _ in range(4):
        result = f.add("exp", result)
        nodes.append(result)
    (out,) = f.apply(Exp(2), [nodes])
    assert out.dtype == torch.long
    assert out.tolist() == [2, 4, 8, 16]


class TwoOutputs:
    def B(self, x1, x2):  # noqa: N802 - the seed's op names
        return (x1 - x2) * 2, (x1 + x2) * 3

    def D(self, x1, x2):  # noqa: N802
        return x1 + x2

    def C(self, x1, x2):  # noqa: N802
        return x1 * x2


def test_two_output_split_tree() -> None:
    f = fold.Fold()
    bc, bd = f.add("B", 1, 2).split(2)
    c = f.add("C", bc, 5)
    d = f.add("D", bd, c)
    (out,) = f.apply(TwoOutputs(), [[d]])
    u = fold.Unfold(TwoOutputs())
    ubc, ubd = u.add("B", 1, 2).split(2)
    (ref,) = u.apply(u.obj, [[u.add("D", ubd, u.add("C", ubc, 5))]])
    assert out.tolist() == ref.tolist() == [-1]


def test_per_sample_mnist_forward_and_training_match_eager() -> None:
    images = [torch.rand(1, 28, 28) for _ in range(32)]
    labels = [random.Random(i).randrange(10) for i in range(32)]
    batched, eager = MLP(), MLP()
    eager.load_state_dict(batched.state_dict())
    opt_b = torch.optim.Adam(batched.parameters(), lr=1e-3)
    opt_e = torch.optim.Adam(eager.parameters(), lr=1e-3)
    for _ in range(3):
        f = fold.Fold()
        outs = [f.add("forward", im) for im in images]
        logits, targets = f.apply(batched, [outs, labels])
        assert logits.shape == (32, 10) and targets.dtype == torch.long
        loss = F.cross_entropy(logits, targets)
        opt_b.zero_grad()
        loss.backward()
        ref_logits = torch.cat([eager(im) for im in images])
        ref_loss = F.cross_entropy(ref_logits, torch.tensor(labels))
        opt_e.zero_grad()
        ref_loss.backward()
        torch.testing.assert_close(logits, ref_logits)
        assert_same_grads(grads(batched), grads(eager))
        opt_b.step()
        opt_e.step()
    for p, q in zip(batched.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q)


# ---------------------------------------------------------------- recurrent and tree models
class RNN(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.cell = nn.RNNCell(dim, dim)

    def start(self, word: torch.Tensor) -> torch.Tensor:
        return self.cell(self.embed(word))

    def step(self, h: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
        return self.cell(self.embed(word), h)


def rnn_eager(model: RNN, seq: list[int]) -> torch.Tensor:
    h = model.start(torch.tensor(seq[:1]))
    for w in seq[1:]:
        h = model.step(h, torch.tensor([w]))
    return h


@pytest.mark.parametrize("lengths", [[1, 2, 3], [7, 3, 9, 1, 4], [12] * 4])
def test_rnn_over_sequences_of_different_lengths(lengths: list[int]) -> None:
    rng = random.Random(len(lengths))
    seqs = [[rng.randrange(50) for _ in range(n)] for n in lengths]
    model = RNN()
    f = fold.Fold()
    finals = []
    for seq in seqs:
        h = f.add("start", seq[0])
        for w in seq[1:]:
            h = f.add("step", h, w)
        finals.append(h)
    (out,) = f.apply(model, [finals])
    out.pow(2).sum().backward()
    g = grads(model)
    model.zero_grad()
    ref = torch.cat([rnn_eager(model, s) for s in seqs])
    ref.pow(2).sum().backward()
    torch.testing.assert_close(out, ref)
    assert_same_grads(g, grads(model))


def test_rnn_chain_2000_steps_deep() -> None:
    model = RNN(dim=8)
    seq = [random.Random(0).randrange(50) for _ in range(2000)]
    f = fold.Fold()
    h = f.add("start", seq[0])
    for w in seq[1:]:
        h = f.add("step", h, w)
    assert max(f.depth) == 1999
    (out,) = f.apply(model, [[h]])
    out.sum().backward()
    g = grads(model)
    model.zero_grad()
    ref = rnn_eager(model, seq)
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    assert_same_grads(g, grads(model), rtol=1e-4, atol=1e-5)


def make_trees(n: int, seed: int = 0, vocab: int = 100) -> list[Tree]:
    rng = random.Random(seed)
    return [random_tree(rng, rng.randint(1, 12), vocab) for _ in range(n)]


@pytest.mark.parametrize("n_trees", [1, 5, 40])
def test_tree_lstm_matches_eager_recursion(n_trees: int) -> None:
    model = TreeLSTM(100, 24).double()
    trees = make_trees(n_trees, seed=n_trees)
    labels = [t.word or 0 for t in trees]
    f = fold.Fold()
    roots = [record_tree(f, t) for t in trees]
    h, y = f.apply(model, [roots, [lb % 5 for lb in labels]])
    model.loss(h, y).backward()
    g = grads(model)
    model.zero_grad()
    ref = torch.cat([model.encode(t) for t in trees])
    model.loss(ref, y).backward()
    torch.testing.assert_close(h, ref)
    assert_same_grads(g, grads(model))


def test_shared_subtrees_accumulate_gradients() -> None:
    model = TreeLSTM(30, 8).double()
    f, u = fold.Fold(), fold.Unfold(model)
    outs = []
    for rec in (f, u):
        a = rec.add("leaf", 3).split(2)
        b = rec.add("leaf", 4).split(2)
        shared = rec.add("node", *a, *b).split(2)  # used by both parents and as an output
        p1 = rec.add("node", *shared, *a).split(2)
        p2 = rec.add("node", *b, *shared).split(2)
        top = rec.add("node", *p1, *p2).split(2)
        outs.append((rec, [top[0], shared[0], p1[1]]))
    results = []
    for rec, nodes in outs:
        model.zero_grad()
        (v,) = rec.apply(model, [nodes])
        (v * torch.arange(1.0, 9.0, dtype=torch.double)).sum().backward()
        results.append((v, grads(model)))
    torch.testing.assert_close(results[0][0], results[1][0])
    assert_same_grads(results[0][1], results[1][1])


def test_memoisation_returns_the_same_node_and_computes_once() -> None:
    calls = []

    class Obj:
        def leaf(self, x):
            calls.append(len(x))
            return x.float() * 2

    f = fold.Fold()
    a, b, c = f.add("leaf", 1), f.add("leaf", 1), f.add("leaf", 2)
    assert a == b and a != c
    assert f.add("leaf", 1.0) != a  # a float is another kind than an int
    assert f.add("leaf", True) != a
    (out,) = f.apply(Obj(), [[a, b, c]])
    assert out.tolist() == [2.0, 2.0, 4.0]
    assert sorted(calls) == [1, 1, 2]  # leaf(int) x2 rows, leaf(float), leaf(bool) in own groups


class Table(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 4, dtype=torch.double))

    def rows(self, i: torch.Tensor) -> torch.Tensor:
        return self.w[i]

    def table(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([a, b, a * b], 0)  # (3, 4): not one row per node, hence nobatch

    def score(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return x @ table.t()


def test_nobatch_values_are_passed_whole_and_get_gradients() -> None:
    model = Table()
    results = []
    for rec in (fold.Fold(), fold.Unfold(model)):
        model.zero_grad()
        t1 = rec.add("table", rec.add("rows", 0), rec.add("rows", 1)).nobatch()
        t2 = rec.add("table", rec.add("rows", 2), rec.add("rows", 3)).nobatch()
        outs = [rec.add("score", rec.add("rows", i), t) for i in range(6) for t in (t1, t2)]
        v, tab = rec.apply(model, [outs, [t1]])
        (v.sin().sum() + tab.sum()).backward()
        results.append((v, tab, model.w.grad.clone()))
    f = results[0]
    torch.testing.assert_close(f[0], results[1][0])
    torch.testing.assert_close(f[1], results[1][1])
    assert f[1].shape == (3, 4)
    torch.testing.assert_close(f[2], results[1][2])


class Shapes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5, dtype=torch.double))

    def make(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return x / (1 + x.pow(2).sum(1, keepdim=True))


def test_same_op_with_different_shapes_runs_as_separate_groups() -> None:
    model = Shapes()
    shapes = [(1, 3), (1, 5), (1, 3), (1, 2, 2), (1, 5)]
    xs = [torch.randn(*s, dtype=torch.double, requires_grad=True) for s in shapes]
    f = fold.Fold()
    outs = [f.add("norm", f.add("make", x)) for x in xs]
    # Nodes of one list must share a shape: one list per shape.
    by_shape = {s: [o for o, t in zip(outs, shapes) if t == s] for s in dict.fromkeys(shapes)}
    results = f.apply(model, list(by_shape.values()))
    loss = sum((r * torch.arange(r.numel(), dtype=torch.double).view_as(r)).sum() for r in results)
    loss.backward()
    fg = [x.grad.clone() for x in xs] + [model.scale.grad.clone()]
    # "norm" nodes share a record-time signature but differ in runtime shape: split at run time.
    norm_groups = [r for r in f.last_run if r[1] == "norm"]
    assert sorted(r[2] for r in norm_groups) == [1, 2, 2]
    for x in xs:
        x.grad = None
    model.zero_grad()
    ref = [
        torch.cat([model.norm(model.make(x)) for x, t in zip(xs, shapes) if t == s])
        for s in by_shape
    ]
    sum((r * torch.arange(r.numel(), dtype=torch.double).view_as(r)).sum() for r in ref).backward()
    for a, b in zip(results, ref):
        torch.testing.assert_close(a, b)
    for a, b in zip(fg, [x.grad for x in xs] + [model.scale.grad]):
        torch.testing.assert_close(a, b)


def test_numbers_and_tensor_lists_and_dtypes() -> None:
    class Obj:
        def f(self, i, x, b, t):
            return torch.stack([i.double(), x.double(), b.double()], 1) + t

    f = fold.Fold()
    nodes = [
        f.add("f", k, k / 2, k % 2 == 0, torch.full((1, 3), float(k), dtype=torch.double))
        for k in range(5)
    ]
    out, ints, floats, tensors = f.apply(
        Obj(), [nodes, [1, 2], [0.5, 1], [torch.ones(1, 2), torch.zeros(1, 2)]]
    )
    expected = torch.tensor(
        [[k + k, k / 2 + k, float(k % 2 == 0) + k] for k in range(5)], dtype=torch.double
    )
    torch.testing.assert_close(out, expected)
    assert ints.dtype == torch.long and floats.dtype == torch.get_default_dtype()
    assert tensors.shape == (2, 2)


@pytest.mark.parametrize(
    "items",
    [
        [3, 1, 4],
        [0.1, 1 / 3, 2.5, -1e30, 1e-45, 3.4028235e38, float("inf"), float("nan")],
        [True, False],
        [1, 2.5],
        [True, 2],
        [1e300],
        [2**62, -(2**63)],
    ],
)
@pytest.mark.parametrize("default", [torch.float32, torch.float64])
def test_number_lists_become_what_torch_tensor_makes(items: list, default: torch.dtype) -> None:
    """apply's lists of numbers are built through numpy; torch.tensor is the reference."""
    from fold.arrays import numbers_tensor

    old = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        ref = torch.tensor(items)
        got = numbers_tensor(items)
        (applied,) = fold.Fold().apply(object(), [items])
    finally:
        torch.set_default_dtype(old)
    for t in (got, applied):
        assert t.dtype == ref.dtype
        torch.testing.assert_close(t, ref, rtol=0, atol=0, equal_nan=True)


def test_number_list_beyond_int64_raises_as_torch_does() -> None:
    from fold.arrays import numbers_tensor

    with pytest.raises(Exception) as ref:
        torch.tensor([1, 2**64])
    with pytest.raises(ref.type):
        numbers_tensor([1, 2**64])


def test_callable_ops_are_grouped_by_identity() -> None:
    def double(x):
        return x * 2

    def triple(x):
        return x * 3

    f = fold.Fold()
    nodes = [f.add(double, i) for i in range(3)] + [f.add(triple, i) for i in range(3)]
    (out,) = f.apply(object(), [nodes])
    assert out.tolist() == [0, 2, 4, 0, 3, 6]
    assert sorted(r[2] for r in f.last_run) == [3, 3]


def test_group_sizes_follow_depth_schedule() -> None:
    model = TreeLSTM(100, 8)
    trees = make_trees(30)
    f = fold.Fold()
    roots = [record_tree(f, t) for t in trees]
    f.apply(model, [roots])
    depth = max(f.depth) + 1
    assert len(f.last_run) == depth  # one leaf group, then one node group per level
    assert sum(r[2] for r in f.last_run) == len(f)


def test_outputs_land_on_cpu_for_plain_objects() -> None:
    f = fold.Fold()
    (out,) = f.apply(Exp(3), [[f.add("exp", 2)]])
    assert out.device.type == "cpu"


@pytest.mark.gpu
def test_results_land_on_the_module_device() -> None:
    model = TreeLSTM(50, 8).cuda()
    trees = make_trees(4, vocab=50)
    f = fold.Fold()
    roots = [record_tree(f, t) for t in trees]
    h, y = f.apply(model, [roots, [1, 2, 3, 4]])
    assert h.is_cuda and y.is_cuda
    torch.testing.assert_close(h, torch.cat([model.encode(t) for t in trees]))


# ---------------------------------------------------------------- op counts (deterministic)
class CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += 1
        return func(*args, **(kwargs or {}))


def full_tree(depth: int, rng: random.Random) -> Tree:
    if depth == 0:
        return Tree(0, word=rng.randrange(1000))
    return Tree(0, left=full_tree(depth - 1, rng), right=full_tree(depth - 1, rng))


def count_ops(n_trees: int) -> tuple[int, int]:
    rng = random.Random(n_trees)
    model = TreeLSTM(1000, 8)
    trees = [full_tree(4, rng) for _ in range(n_trees)]
    f = fold.Fold()
    roots = [record_tree(f, t) for t in trees]
    with CountOps() as forward:
        (h,) = f.apply(model, [roots])
    with CountOps() as backward:
        h.sum().backward()
    return forward.count, backward.count


def test_tensor_ops_grow_with_steps_and_groups_not_with_nodes() -> None:
    small_fwd, small_bwd = count_ops(8)  # 8 trees of depth 4: 248 nodes, 5 steps
    big_fwd, big_bwd = count_ops(32)  # 4x the nodes, the same depth
    assert big_fwd < 1.5 * small_fwd, (small_fwd, big_fwd)
    assert big_bwd < 1.5 * small_bwd, (small_bwd, big_bwd)


@pytest.mark.parametrize("order", ["all in order", "reversed", "repeated", "prefix"])
def test_output_lists_of_a_one_op_graph(order: str) -> None:
    """A per-sample graph (one op, no node arguments): its output list is the group's output
    when it names every node in order, and a gather otherwise; values and gradients match."""
    torch.manual_seed(0)
    lin = nn.Linear(5, 3)
    xs = [torch.randn(1, 5) for _ in range(6)]
    f = fold.Fold()
    nodes = [f.add("forward", x) for x in xs]
    pick = {
        "all in order": list(range(6)),
        "reversed": list(range(5, -1, -1)),
        "repeated": [2] * 6,
        "prefix": [0, 1, 2],
    }[order]
    (out,) = f.apply(lin, [[nodes[i] for i in pick]])
    want = torch.cat([lin(xs[i]) for i in pick])
    torch.testing.assert_close(out, want)
    (g,) = torch.autograd.grad(out.square().sum(), lin.weight)
    (g_want,) = torch.autograd.grad(want.square().sum(), lin.weight)
    torch.testing.assert_close(g, g_want)


class _PerSample:
    def forward(self, x, k, scale):
        return x * k[:, None] * scale[:, None]

    def two(self, x):
        return x + 1, x - 1

    def bad(self, x):
        raise RuntimeError("kaboom")


def test_one_op_graphs_take_one_call_and_keep_every_check() -> None:
    """A per-sample graph (one op, literal arguments only) runs as one call; its results, its
    summary and its errors are those of the general executor."""
    torch.manual_seed(0)
    xs = [torch.randn(1, 3, requires_grad=True) for _ in range(4)]
    f = fold.Fold()
    nodes = [f.add("forward", x, i, 0.5) for i, x in enumerate(xs)]
    out, ks = f.apply(_PerSample(), [nodes, [1, 2, 3, 4]])
    want = torch.cat([x * i * 0.5 for i, x in enumerate(xs)])
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(ks, torch.tensor([1, 2, 3, 4]))
    grads = torch.autograd.grad(out.sum(), xs)
    torch.testing.assert_close(
        torch.cat(grads), torch.tensor([[0.0] * 3, [0.5] * 3, [1.0] * 3, [1.5] * 3])
    )
    assert "forward x4 ((4, 3), (4,) int64, (4,))" in f.summary()

    g = fold.Fold()
    whole = [g.add("two", x) for x in xs]
    with pytest.raises(
        fold.FoldError, match=r"op 'two' returned 2 outputs, but node 0 .*without split"
    ):
        g.apply(_PerSample(), [whole])
    b = fold.Fold()
    bad = [b.add("bad", x) for x in xs]
    with pytest.raises(
        fold.FoldError, match=r"op 'bad' failed at step 0 on a group of 4 node\(s\)"
    ):
        b.apply(_PerSample(), [bad])
    other = fold.Fold()
    theirs = [other.add("two", x) for x in xs]  # equal ints, another Fold's handles
    with pytest.raises(fold.FoldError, match="nodes that this Fold did not record"):
        g.apply(_PerSample(), [theirs])


def _total(x: torch.Tensor) -> torch.Tensor:
    return x.sum()


@pytest.mark.parametrize(
    "case", ["forward", "split outputs", "numbers and tensors lists", "bad split", "fails", "rows"]
)
def test_the_one_call_path_equals_the_executor(case: str, monkeypatch) -> None:
    """``run._one_call`` (a graph of one op on literals, its node lists whole outputs) gives
    what the general executor gives: values, gradients, the summary, and errors."""
    from fold import run

    executors = []

    def go(fast: bool):
        if not fast:
            monkeypatch.setattr(run, "_one_call", lambda *a: None)
        real = run.Executor
        monkeypatch.setattr(
            run, "Executor", lambda *a, **k: executors.append(fast) or real(*a, **k)
        )
        torch.manual_seed(0)
        xs = [torch.randn(1, 3, requires_grad=True) for _ in range(5)]
        f = fold.Fold()
        if case == "split outputs":
            pairs = [f.add("two", x).split(2) for x in xs]
            lists = [[p[1] for p in pairs], [p[0] for p in pairs]]
        elif case == "bad split":
            lists = [[f.add("two", x) for x in xs]]
        elif case == "fails":
            lists = [[f.add("bad", x) for x in xs]]
        elif case == "rows":
            total = _total  # one callable op: no row per node
            lists = [[f.add(total, x) for x in xs]]
        else:
            nodes = [f.add("forward", x, i, 0.25 * i) for i, x in enumerate(xs)]
            lists = [nodes]
            if case == "numbers and tensors lists":
                lists += [[1.5, 2.0, 3.0], [torch.ones(1, 2)] * 2, torch.arange(3)]
        try:
            outs = f.apply(_PerSample(), lists)
        except fold.FoldError as err:
            monkeypatch.undo()
            return ("error", str(err))
        grads = torch.autograd.grad(sum(o.sum() for o in outs if o.requires_grad), xs)
        monkeypatch.undo()
        return outs, grads, f.summary()

    fast, general = go(True), go(False)
    assert executors == [False]  # the one-call path ran no executor
    if fast[0] == "error":
        assert fast == general
        return
    for a, b in zip(fast[0], general[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(fast[1], general[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert fast[2] == general[2]


class _Chain(nn.Module):
    """Per-sample ops that chain: an encoder with two outputs, a head, a per-sample loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(4, 6)
        self.head = nn.Linear(3, 5)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.enc(x).chunk(2, 1)

    def mix(self, a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(a) * w[:, None] + b)

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, y, reduction="none")

    def twice(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, 2 * x


def _record_chain(f: fold.Fold | fold.Unfold, xs: list[torch.Tensor], order: list[int]) -> Any:
    mids = []
    for i, x in enumerate(xs):
        a, b = f.add("encode", x).split(2)
        mids.append((a, b, 0.5 + i))
    logits = [f.add("mix", *mids[i]) for i in order]
    losses = [f.add("loss", lg, i % 5) for lg, i in zip(logits, order)]
    return logits, losses


def _no_rows(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the executor indexed rows")


@pytest.mark.parametrize("order", ["in order", "shuffled"])
def test_per_sample_chains_match_eager(order: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """encode -> mix -> loss per sample: one call per op on whole outputs when every column
    is an earlier op's nodes in order (a whole plan: the executor's value store is not even
    built), and gathers when it is not; values and gradients match Unfold either way."""
    xs = [torch.randn(1, 4) for _ in range(7)]
    pick = list(range(7)) if order == "in order" else [3, 0, 6, 1, 5, 2, 4]
    model = _Chain()
    f = fold.Fold()
    logits, losses = _record_chain(f, xs, pick)
    assert f.plan().whole == (order == "in order")
    assert (chain_plan(f.snapshot()) is not None) == (order == "in order")
    if order == "in order":
        monkeypatch.setattr(fold.executor, "Values", _no_rows)
    got_logits, got_loss, ys = f.apply(model, [logits, losses, [i % 5 for i in pick]])
    got = torch.autograd.grad(got_loss.sum() + got_logits.square().sum(), model.parameters())

    u = fold.Unfold(model)
    ref_logits, ref_losses = _record_chain(u, xs, pick)
    want_logits, want_loss, want_ys = u.apply(
        model, [ref_logits, ref_losses, [i % 5 for i in pick]]
    )
    want = torch.autograd.grad(want_loss.sum() + want_logits.square().sum(), model.parameters())
    torch.testing.assert_close(got_logits, want_logits)
    torch.testing.assert_close(got_loss, want_loss)
    torch.testing.assert_close(ys, want_ys)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_chain_reports_and_checks_as_the_general_executor() -> None:
    """The chain path's summary equals the general executor's (forced with max_rows), and a
    wrong split or a whole use of a two-output op raise the executor's FoldErrors."""
    xs = [torch.randn(1, 4) for _ in range(5)]
    model = _Chain()
    f = fold.Fold()
    logits, losses = _record_chain(f, xs, list(range(5)))
    a = f.apply(model, [losses])
    chain_summary = f.summary()
    b = f.apply(model, [losses], max_rows=100)
    assert f.summary() == chain_summary
    assert "encode x5" in chain_summary and "loss x5" in chain_summary
    torch.testing.assert_close(a[0], b[0])

    g = fold.Fold()
    hs = [g.add("twice", x).split(3)[1] for x in xs]
    with pytest.raises(fold.FoldError, match=r"split with \.split\(3\), but op 'twice' returned 2"):
        g.apply(model, [hs])
    w = fold.Fold()
    whole = [w.add("twice", x) for x in xs]
    heads = [w.add("loss", h, 1) for h in whole]
    with pytest.raises(fold.FoldError, match=r"op 'twice' returned 2 outputs, but node 0 .*whole"):
        w.apply(model, [heads])


class _Memories(nn.Module):
    """Per-example memories at two depths, read by every decoder step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc_ = nn.Linear(3, 3)
        self.pre_ = nn.Linear(3, 3)
        self.cell = nn.GRUCell(3, 3)
        self.seen: list[int] = []

    def enc(self, x):
        return torch.tanh(self.enc_(x))

    def pre(self, m):
        return torch.tanh(self.pre_(m))

    def step(self, h, y):
        return self.cell(y[:, None].expand(-1, 3).to(h.dtype), h)

    def use(self, h, memory):
        self.seen.append(memory.data_ptr())
        weights = torch.bmm(memory, h[:, :, None])[:, :, 0].softmax(1)
        return torch.bmm(weights[:, None], memory)[:, 0]


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
def test_a_column_read_again_is_gathered_once(grad: bool) -> None:
    """Decoder steps read their examples' memories, which sit at two depths, so each step's
    memory column is gathered from two groups: with gradients on, the gather of its second
    read is kept and read again by every later step (no memory limit set; without the reuse
    each step's gather stays alive for backward at an address of its own); values and
    gradients equal eager either way."""
    model = _Memories().double()
    xs = [torch.randn(1, 5, 3, dtype=torch.float64) for _ in range(4)]
    h0 = [torch.randn(1, 3, dtype=torch.float64) for _ in range(4)]

    def eager():
        outs = []
        for i, (x, h) in enumerate(zip(xs, h0)):
            m = model.enc(x)
            m = model.pre(m) if i % 2 else m
            for t in range(6):
                h = model.step(h, torch.tensor([float(t)], dtype=torch.float64))
                outs.append(model.use(h, m))
        return torch.cat(outs)

    f = fold.Fold(strategy="depth")
    outs = []
    for i, (x, h) in enumerate(zip(xs, h0)):
        m = f.add("enc", x)
        m = f.add("pre", m) if i % 2 else m
        for t in range(6):
            h = f.add("step", h, float(t))
            outs.append(f.add("use", h, m))
    with torch.set_grad_enabled(grad):
        model.seen.clear()
        (got,) = f.apply(model, [outs])
        seen = list(model.seen)
        want = eager()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert len(seen) == 6  # the first step's memories sit at two depths: two groups
    if grad:  # from its second read on, every step reads one gather (one address: alive)
        assert len(set(seen[3:])) == 1 and seen[2] != seen[1]
    if grad:
        params = list(model.parameters())
        for a, b in zip(
            torch.autograd.grad(got.sum(), params), torch.autograd.grad(want.sum(), params)
        ):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


class _PaddedSum:
    """An op that sums each node's row of any length: its groups may mix lengths, and it
    takes them as one call on padded parts (``padded_call``), counted."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(1) * 2

    def padded_call(self, parts: list[tuple[torch.Tensor, ...]]) -> list[Any]:
        self.calls.append([p[0].shape[1] for p in parts])
        longest = max(p[0].shape[1] for p in parts)
        x = torch.cat([F.pad(p[0], (0, longest - p[0].shape[1])) for p in parts])
        out = self(x)
        sizes = [p[0].shape[0] for p in parts]
        return [(o,) for o in out.split(sizes)]


@pytest.mark.parametrize("padded", [True, False], ids=["padded-call", "part-by-part"])
def test_a_group_whose_rows_differ_in_shape_runs_in_parts_or_padded(padded: bool) -> None:
    """A group whose node argument reads rows of several shapes (sequences of several
    lengths) runs one call per shape; an op with ``padded_call`` takes all the parts in one
    call instead; both equal eager, values and gradients, each node's row where it was."""
    torch.manual_seed(0)
    op = _PaddedSum()
    if not padded:
        op = (lambda f: lambda x: f(x))(op)  # the same op, without padded_call
    w = torch.randn(()).requires_grad_()
    lengths = [3, 1, 3, 4, 1, 2, 4]
    xs = [torch.randn(1, n) for n in lengths]
    f = fold.Fold()
    scale = lambda x: x * w  # noqa: E731
    roots = [f.add(op, f.add(scale, x)) for x in xs]
    (got,) = f.apply(None, [roots])
    want = torch.cat([(x * w).sum(1) * 2 for x in xs])
    torch.testing.assert_close(got, want)
    (gw,) = torch.autograd.grad(got.square().sum(), w)
    (ww,) = torch.autograd.grad(want.square().sum(), w)
    torch.testing.assert_close(gw, ww)
    if padded:
        assert len(op.calls) == 1 and sorted(op.calls[0]) == [1, 2, 3, 4]
        # The report shows the parts (one per length), which ran as one call.
        sizes = [size for _, name, size, _ in f.last_run if name == op_name(op)]
        assert sorted(sizes) == [1, 2, 2, 2]


class _PaddedSumAndScale:
    """An op of two outputs over rows of any length: the sum (one shape for every length)
    and the row scaled (its own length); its padded call returns ``PaddedOutputs``: the
    sums as one tensor of all the parts' rows, the scaled rows per part (or, with ``bad``,
    one tensor too few)."""

    def __init__(self, bad: bool = False) -> None:
        self.bad = bad

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sum(1) * 2, x * 3

    def padded_call(self, parts: list[tuple[torch.Tensor, ...]]) -> Any:
        longest = max(p[0].shape[1] for p in parts)
        x = torch.cat([F.pad(p[0], (0, longest - p[0].shape[1])) for p in parts])
        sums, scaled = self(x)
        sizes = [p[0].shape[0] for p in parts]
        rows = [s[:, : p[0].shape[1]] for s, p in zip(scaled.split(sizes), parts)]
        return fold.ops.PaddedOutputs([sums, rows[1:] if self.bad else rows])


def test_a_padded_call_returns_an_output_of_one_shape_as_one_tensor_for_all_parts(
    monkeypatch: Any,
) -> None:
    """A padded call may return an output of one shape across its parts as ONE tensor of
    all the parts' rows (``fold.ops.PaddedOutputs``), registered as one source, beside an
    output cut per part; later groups read both.  Values and gradients equal eager; a
    padded call that returns too few per part tensors gets a FoldError naming the op."""
    from fold.values import Values

    registered: list[list[Any]] = []
    real = Values.add_parts
    monkeypatch.setattr(
        Values, "add_parts", lambda v, outs, *a: registered.append(outs) or real(v, outs, *a)
    )
    torch.manual_seed(0)
    op = _PaddedSumAndScale()
    w = torch.randn(()).requires_grad_()
    lengths = [3, 1, 3, 4, 1, 2, 4]
    xs = [torch.randn(1, n) for n in lengths]
    f = fold.Fold()
    scale = lambda x: x * w  # noqa: E731
    after = lambda s, r: s * r.sum(1)  # noqa: E731  (reads both outputs, one length each)
    outs = [f.add(op, f.add(scale, x)).split(2) for x in xs]
    roots = [f.add(after, s, r) for s, r in outs]
    (got,) = f.apply(None, [roots])
    want = torch.cat([(x * w).sum(1) * 2 * (x * w * 3).sum(1) for x in xs])
    torch.testing.assert_close(got, want)
    (gw,) = torch.autograd.grad(got.square().sum(), w)
    (ww,) = torch.autograd.grad(want.square().sum(), w)
    torch.testing.assert_close(gw, ww)
    # The sums are one source of all 7 rows; the scaled rows one per length (4 parts).
    ((sums, rows),) = registered
    assert type(sums) is torch.Tensor and sums.shape == (len(xs),)
    assert sorted(r.shape for r in rows) == [(1, 2), (2, 1), (2, 3), (2, 4)]
    g = fold.Fold()
    bad = _PaddedSumAndScale(bad=True)
    nodes = [g.add(bad, g.add(scale, x)).split(2)[0] for x in xs]
    with pytest.raises(
        fold.FoldError, match="padded call returned 3 tensors for output 1 of 4 parts"
    ):
        g.apply(None, [nodes])


def test_literal_tensors_of_several_shapes_share_the_signature_of_an_op_with_padded_call():
    """An op with ``padded_call`` keys its literal tensors by dtype alone: tensors of
    several shapes make one signature (shown as any shape), a group of them runs in parts
    of one shape each, in one padded call; a graph of that op alone takes neither the
    one-call nor the chain shortcut (their columns are concatenated whole)."""
    op = _PaddedSum()
    lengths = [3, 1, 3, 4]
    xs = [torch.randn(1, n, requires_grad=True) for n in lengths]
    f = fold.Fold()
    nodes = [f.add(op, x) for x in xs]
    assert len(f.snapshot().signatures) == 1
    assert "tensor(any shape, float32)" in f.summary()
    (got,) = f.apply(None, [nodes])
    want = torch.cat([x.sum(1) * 2 for x in xs])
    torch.testing.assert_close(got, want)
    assert len(op.calls) == 1 and sorted(op.calls[0]) == [1, 3, 4]
    gs = torch.autograd.grad(got.square().sum(), xs)
    ws = torch.autograd.grad(want.square().sum(), xs)
    for a, b in zip(gs, ws):
        torch.testing.assert_close(a, b)
    # Without padded_call, the same tensors make one signature per shape.
    g = fold.Fold()
    plain = lambda x: x.sum(1) * 2  # noqa: E731
    (out,) = g.apply(None, [[g.add(plain, x) for x in xs]])
    assert len(g.snapshot().signatures) == 3
    torch.testing.assert_close(out, want)


def test_device_of_is_the_first_parameters_in_parameters_order() -> None:
    """``fold.ops.device_of`` (where apply puts literals and results) names the device of the
    module's first parameter in ``parameters()``' order, through its shortcut (the module's
    own parameters, its first child's) and its walk (deeper, then buffers); meta tensors
    stand for a second device."""
    from fold.ops import device_of

    def first(m: torch.nn.Module) -> torch.device:
        return next(iter([*m.parameters(), *m.buffers()])).device

    meta = torch.device("meta")
    cases = [
        torch.nn.Linear(2, 2, device=meta),  # its own
        torch.nn.Sequential(torch.nn.Linear(2, 2, device=meta), torch.nn.Linear(2, 2)),
        torch.nn.Sequential(  # the first child has none of its own: its child's
            torch.nn.Sequential(torch.nn.Linear(2, 2, device=meta)), torch.nn.Linear(2, 2)
        ),
        torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(2, 2, device=meta)),
        torch.nn.BatchNorm1d(2, affine=False, device=meta),  # buffers alone
        _WithNone(),  # a child set to None (an optional layer left out) first
    ]
    for m in cases:
        assert device_of(m) == first(m) == meta, m
    assert device_of(
        torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device=meta))
    ) == torch.device("cpu")
    assert device_of(torch.nn.ReLU()) == device_of(object()) == torch.device("cpu")


class _WithNone(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.skip = torch.nn.ReLU()
        self.inner = torch.nn.Sequential(torch.nn.Linear(2, 2, device="meta"))
        self.skip = None  # type: ignore[assignment]  (kept in _modules, as None)


@pytest.mark.parametrize("models", [1, 3])
def test_index_arrays_moved_as_one_tensor_as_on_a_gpu_give_the_same_results(models, monkeypatch):
    """Off the CPU a group's index arrays travel as one tensor, split on the device
    (``Values.index_tensors``); that path, taken here on the CPU, gives the states and
    gradients of the CPU's own (float64; with N models in one pass too)."""
    from fold.batched_ops import BatchModule
    from fold.treebank import random_tree
    from fold.values import Values

    rng = random.Random(4)
    trees = [random_tree(rng, rng.randint(1, 12), 60) for _ in range(16)]
    torch.manual_seed(0)
    nets = [TreeLSTM(60, 8).double() for _ in range(models)]
    model: Any = nets[0]
    if models > 1:
        model = BatchModule.from_modules(nets)
        model.chunk_size = models  # all models in one pass, as on a GPU

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        f = fold.Fold()
        (h,) = f.apply(model, [[record_tree(f, t) for t in trees]])
        h.pow(2).sum().backward()
        return h.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    want, want_g = run()
    init = Values.__init__

    def off_cpu(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.on_cpu = False

    monkeypatch.setattr(Values, "__init__", off_cpu)
    got, got_g = run()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(got_g) == len(want_g)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
