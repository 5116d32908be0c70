"""Memory-bounded apply: chunked groups give the same values and gradients."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import fold
from fold.batched_ops import BatchModule
from fold.models import TreeLSTM, record_tree
from fold.treebank import random_tree


def tree_run(model, **limits):
    rng = random.Random(0)
    trees = [random_tree(rng, rng.randint(1, 12), 60) for _ in range(20)]
    f = fold.Fold()
    roots = [record_tree(f, t) for t in trees]
    model.zero_grad(set_to_none=True)
    (h,) = f.apply(model, [roots], **limits)
    h.pow(2).sum().backward()
    sizes = [r[2] for r in f.last_run]
    return (
        h.detach(),
        {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None},
        sizes,
    )


@pytest.mark.parametrize(
    "limits",
    [
        {"max_rows": 1},
        {"max_rows": 7},
        {"max_rows": 10_000},
        {"max_rows": {"node": 3}},
        {"max_bytes": 2_000},
    ],
    ids=["rows-1", "rows-7", "rows-above", "rows-per-op", "bytes"],
)
def test_chunked_tree_lstm_equals_unchunked(limits) -> None:
    model = TreeLSTM(60, 16).double()
    ref_h, ref_g, sizes = tree_run(model)
    assert max(sizes) > 7  # some groups really are split below
    h, g, _ = tree_run(model, **limits)
    torch.testing.assert_close(h, ref_h)
    assert ref_g.keys() == g.keys()
    for k in ref_g:
        torch.testing.assert_close(g[k], ref_g[k])


def test_chunked_mnist_training_step_equals_unchunked() -> None:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(49, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10)
    ).double()

    class Obj:
        def forward(self, x):
            return mlp(x)

    images = [torch.rand(1, 7, 7, dtype=torch.double) for _ in range(32)]
    labels = [i % 10 for i in range(32)]
    grads = []
    for limits in ({}, {"max_rows": 5}, {"max_bytes": 49 * 8 * 4}):
        mlp.zero_grad()
        f = fold.Fold()
        logits, y = f.apply(Obj(), [[f.add("forward", x) for x in images], labels], **limits)
        F.cross_entropy(logits, y).backward()
        grads.append([p.grad.clone() for p in mlp.parameters()])
        if "max_bytes" in limits:
            assert [r[2] for r in f.last_run] == [32]  # one group, called in chunks of 4
    for g in grads[1:]:
        for a, b in zip(g, grads[0]):
            torch.testing.assert_close(a, b)


def test_chunked_apply_with_a_batch_module() -> None:
    bm = BatchModule.from_modules([TreeLSTM(60, 8).double() for _ in range(3)])
    bm.chunk_size = 3  # all models in one pass: chunks of rows cover (node, model) rows
    ref_h, ref_g, _ = tree_run(bm)
    h, g, _ = tree_run(bm, max_rows=4)
    torch.testing.assert_close(h, ref_h)
    for k in ref_g:
        torch.testing.assert_close(g[k], ref_g[k])


def test_offload_to_cpu_gives_the_same_results() -> None:
    model = TreeLSTM(60, 8).double()
    ref_h, ref_g, _ = tree_run(model)
    h, g, _ = tree_run(model, offload="cpu", max_rows=6)
    torch.testing.assert_close(h, ref_h)
    for k in ref_g:
        torch.testing.assert_close(g[k], ref_g[k])


@pytest.mark.parametrize(
    "limits, message",
    [
        ({"max_rows": 0}, r"max_rows=0; expected a positive int"),
        ({"max_rows": {"node": -2}}, r"max_rows\['node'\]=-2; expected a positive int"),
        ({"max_bytes": 0}, r"max_bytes=0; expected a positive int"),
        (
            {"max_bytes": 100},
            r"op 'leaf' needs 8 bytes|op 'node' needs \d+ bytes of arguments for a single node",
        ),
        ({"offload": "disk"}, r"offload='disk'; expected None or 'cpu'"),
    ],
)
def test_bad_limits(limits, message) -> None:
    model = TreeLSTM(60, 8).double()
    with pytest.raises(fold.FoldError, match=message):
        tree_run(model, **limits)


def test_limit_equal_to_the_largest_group() -> None:
    model = TreeLSTM(60, 16).double()
    ref_h, ref_g, sizes = tree_run(model)
    h, g, _ = tree_run(model, max_rows=max(sizes))
    torch.testing.assert_close(h, ref_h)
    for k in ref_g:
        torch.testing.assert_close(g[k], ref_g[k])


class _Memories(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 16, dtype=torch.float64))

    def mem_a(self, k):  # two ops make memories of one shape: rows of two sources
        return (self.w * k[:, None, None]).unsqueeze(1).expand(-1, 50, -1, -1)[:, 0]

    def mem_b(self, k):
        return self.w + k[:, None, None]

    def step(self, memory, k):  # reads a memory, gives a vector of another shape
        return memory.sum(1) * k[:, None]

    def next(self, h, memory):
        return h + memory.mean(1)


def test_value_tables_hold_the_rows_of_their_own_shape_only() -> None:
    """8 per-example memories of shape (16, 16) read by a long chain of decoder steps of
    another shape: the memories' value table holds about their rows (at most twice), not a
    row for every node left in the plan (its backward would fill a gradient that size per
    gather); values and gradients equal Unfold's."""

    def record(f):
        mems = [f.add("mem_a" if i % 2 else "mem_b", float(i)) for i in range(8)]
        outs = []
        for i, m in enumerate(mems):
            h = f.add("step", m, 1.0)
            for t in range(20 + 5 * i):  # decoders of different lengths read their memory
                h = f.add("next", h, mems[(i + t) % 8])
            outs.append(h)
        return outs

    values, nodes = _tables_checked_against_unfold(_Memories(), record)
    memory_tables = [t for t in values.tables if t is not None and t.dim() == 3]
    assert memory_tables and all(t.shape[0] <= 16 for t in memory_tables), [
        t.shape for t in memory_tables
    ]
    assert nodes > 200  # the plan had many more nodes than memories


def _tables_checked_against_unfold(model: torch.nn.Module, record: Any) -> tuple[Any, int]:
    """The graph ``record`` makes, run once by the executor (for its value tables, which
    ``Values`` returns), then ``apply``'s values and gradients checked against Unfold's;
    ``(values, nodes)``."""
    from fold.executor import Executor

    f = fold.Fold()
    outs = record(f)
    ex = Executor(f.snapshot(), model)
    ex.run(f.plan())
    (got,) = f.apply(model, [outs])
    (g,) = torch.autograd.grad(got.square().sum(), model.w)
    u = fold.Unfold(model)
    (want,) = u.apply(model, [record(u)])
    (g_want,) = torch.autograd.grad(want.square().sum(), model.w)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(g, g_want)
    return ex.values, len(f)


class _Chains(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.rand(4, generator=g, dtype=torch.float64) + 0.5)

    def start(self, k):
        return k[:, None] * self.w

    def mid(self, h):
        return torch.tanh(h) * self.w

    def pair(self, a, b):
        return a * b + a


def test_value_tables_hold_only_the_sources_reads_need() -> None:
    """Chains of 10-17 ``mid`` steps, then one ``pair`` per chain: its first column draws
    from the last 8 depths of mid groups (36 rows), so it reads a value table; the 9 earlier
    mid groups and the starts, of the same shape, are read only in order, straight from
    their sources.  The table holds the 36 rows it needs (at most twice that, as it grows),
    not the class's 116; values and gradients equal Unfold's."""

    def record(f):
        outs = []
        for i in range(8):
            h = first = f.add("start", float(i + 1))
            for _ in range(10 + i):
                h = f.add("mid", h)
            outs.append(f.add("pair", h, first))
        return outs

    values, _ = _tables_checked_against_unfold(_Chains(), record)
    held = [t.shape[0] for t in values.tables if t is not None]
    assert held and max(held) <= 72, held
    assert sum(values.class_rows) >= 116


class _Recall(torch.nn.Module):
    """Each step reads the state before it and one earlier state of its example: the earlier
    states' column draws rows from many groups, so it is gathered from a value table filled
    (and grown) step after step."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(4, 4, generator=g, dtype=torch.float64) / 2)

    def start(self, k):
        return torch.tanh(k[:, None] * self.w[0])

    def step(self, h, old):
        return torch.tanh(h @ self.w + old)


def _record_recall(f, examples: int = 6, steps: int = 12) -> list:
    rng = random.Random(0)
    outs = []
    for i in range(examples):
        states = [f.add("start", float(i + 1))]
        for _ in range(steps):
            states.append(f.add("step", states[-1], states[rng.randrange(len(states))]))
        outs.append(states[-1])
    return outs


def test_table_reads_give_eager_gradients_in_every_kind_of_backward() -> None:
    """Values and gradients through value tables (filled and grown step by step) equal
    Unfold's: a backward pass repeated on the retained graph, and a second-order gradient
    (create_graph=True)."""
    model = _Recall()
    f = fold.Fold()
    (got,) = f.apply(model, [_record_recall(f)])
    u = fold.Unfold(model)
    (want,) = u.apply(model, [_record_recall(u)])
    torch.testing.assert_close(got, want)
    (g_want,) = torch.autograd.grad(want.square().sum(), model.w, create_graph=True)
    (gg_want,) = torch.autograd.grad(g_want.square().sum(), model.w)
    loss = got.square().sum()
    for _ in range(2):  # the second pass must not see the first one's sums
        (g,) = torch.autograd.grad(loss, model.w, retain_graph=True)
        torch.testing.assert_close(g, g_want.detach())
    (g,) = torch.autograd.grad(loss, model.w, create_graph=True)
    torch.testing.assert_close(g, g_want)
    (gg,) = torch.autograd.grad(g.square().sum(), model.w)
    torch.testing.assert_close(gg, gg_want)


def test_table_backward_cost_follows_the_rows_read() -> None:
    """Backward makes ONE table-sized gradient per table, not one per read and per fill
    (index_select's backward zero-fills the whole table per read; a recorded in-place fill
    clones the whole gradient per fill)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = _Recall()
    f = fold.Fold()
    outs = _record_recall(f, examples=8, steps=20)
    (got,) = f.apply(model, [outs])
    rows = len(f)  # every node's state is one row of the states' table

    class CountLarge(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.large = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            in_place = func.overloadpacket.__name__.endswith("_")
            big = isinstance(out, torch.Tensor) and out.dim() and out.shape[0] >= rows // 2
            if big and not in_place:
                self.large += 1  # a new tensor of (about) the table's size
            return out

    with CountLarge() as mode:
        got.sum().backward()
    assert mode.large == 1, mode.large


def test_a_table_gradient_buffer_is_fresh_in_each_backward_pass() -> None:
    """The per-pass buffer of value-table reads starts at zero in a new backward pass even
    where the pass before ended early (its first anchor, which frees it, never ran)."""
    from fold.values import _TableGrad

    state = _TableGrad()
    state.shape = (3, 2)
    seen = []

    class Read(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            return x.clone()

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def]
            buf = state.rows(g)
            seen.append(buf.clone())
            buf[0] += g[0]
            return g

    x = torch.ones(3, 2, requires_grad=True)
    y = Read.apply(x)
    for _ in range(2):
        y.sum().backward(retain_graph=True)
    assert state.current() is None  # outside any backward pass
    torch.testing.assert_close(seen[0], torch.zeros(3, 2))
    torch.testing.assert_close(seen[1], torch.zeros(3, 2))


class _Gates(torch.nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.rand(4, generator=g, dtype=torch.float64) + 0.5)

    def start(self, k):
        return k[:, None] * self.w

    def split3(self, k):
        x = k[:, None] * self.w
        return x, x * x, x + 1.0

    def act(self, x):
        return torch.tanh(x) * self.w

    def mix(self, a, b):
        return a * b + a


def _gates_graph(f):
    """Per example: three gates (``split3``), each through ``act`` (one group of 72 that
    reads the gates interleaved: output 0, 1, 2 of one node, then of the next), then ``mix``
    of gate 0's with a ``start`` value and of gate 2's with gate 1's (one group of 48,
    interleaved too)."""
    outs = []
    for i in range(24):
        a = f.add("start", float(i + 1))
        s = f.add("split3", 0.1 * (i + 1)).split(3)
        g = [f.add("act", s[j]) for j in range(3)]
        outs += [f.add("mix", g[0], a), f.add("mix", g[2], g[1])]
    return outs


def test_groups_read_in_row_order_take_whole_sources_without_tables() -> None:
    """A group whose nodes read their rows interleaved runs them in the order of those rows
    (fold.executor._read_order): ``act`` then reads the three gate outputs each whole, in
    turn, and ``mix`` reads the ``start`` values whole beside a run of ``act``'s outputs.
    Each such column is a few pieces and one cat (``Values.pieces``): no value table is
    filled at all (before, both groups filled tables, one per gate).  Values and gradients
    equal Unfold's."""
    from fold.values import How

    values, _ = _tables_checked_against_unfold(_Gates(), _gates_graph)
    assert all(t is None for t in values.tables), [t.shape for t in values.tables if t is not None]
    pieces = [[r.how for r in p] for p in values.parts]
    assert [How.SOURCE] * 3 in pieces  # the three gates, each whole
    assert any(len(p) == 2 for p in pieces), pieces  # start's values whole, then a narrow


def test_groups_read_in_row_order_with_n_models() -> None:
    """The same graph on a BatchModule of 3 models in one pass (rows of (node, model)
    pairs): each model's values and gradients equal Unfold's on that model alone."""
    models = [_Gates(seed) for seed in range(3)]
    with pytest.warns(UserWarning, match="no batched layer"):  # _Gates runs under vmap
        bm = BatchModule.from_modules(models)
    bm.chunk_size = 3
    f = fold.Fold()
    (got,) = f.apply(bm, [_gates_graph(f)])
    (g,) = torch.autograd.grad(got.square().sum(), [p for n, p in bm.named_parameters()])
    for k, model in enumerate(models):
        u = fold.Unfold(model)
        (want,) = u.apply(model, [_gates_graph(u)])
        (g_want,) = torch.autograd.grad(want.square().sum(), model.w)
        torch.testing.assert_close(got[k], want)
        torch.testing.assert_close(g[k], g_want)
