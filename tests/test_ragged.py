"""Variable-length list arguments: ``fold.Ragged`` against per-list loops, random graphs with
list arguments against Unfold (values and gradients), and their bad input."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import fold

W = 4


def _lists(lengths: list[int], feature: tuple[int, ...] = (3,)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(sum(lengths) + len(lengths))
    return [torch.randn(n, *feature, generator=g, dtype=torch.double) for n in lengths]


@pytest.mark.parametrize("host", [True, False])
@pytest.mark.parametrize("lengths", [[2, 0, 3, 1], [0, 0], [1], [4, 4]])
def test_ragged_methods_equal_per_list_loops(
    lengths: list[int], host: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each method against a loop over the lists; ``host=False``: the forms that read no
    lengths on the host (a Ragged on a device, made outside an apply)."""
    if not host:
        monkeypatch.setattr(fold.Ragged, "_host_lengths", lambda self: None)
    parts = _lists(lengths)
    values = torch.cat(parts) if sum(lengths) else torch.zeros(0, 3, dtype=torch.double)
    r = fold.Ragged(values, torch.tensor(lengths))
    assert len(r) == len(lengths)
    assert r.offsets.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert r.segment_ids.tolist() == [i for i, n in enumerate(lengths) for _ in range(n)]
    zeros = torch.zeros(3, dtype=torch.double)
    torch.testing.assert_close(r.sum(), torch.stack([p.sum(0) for p in parts]))
    torch.testing.assert_close(
        r.mean(), torch.stack([p.mean(0) if len(p) else zeros for p in parts])
    )
    torch.testing.assert_close(
        r.amax(), torch.stack([p.amax(0) if len(p) else zeros for p in parts])
    )
    longest = max(lengths)
    padded = r.padded(-1.0)
    assert padded.shape == (len(lengths), longest, 3)
    for i, p in enumerate(parts):
        torch.testing.assert_close(padded[i, : len(p)], p)
        assert (padded[i, len(p) :] == -1).all()
        assert r.mask[i].tolist() == [j < len(p) for j in range(longest)]
    scores = values.sum(1)
    weights = r.softmax(scores)
    want = [torch.softmax(p.sum(1), 0) for p in parts]
    torch.testing.assert_close(weights, torch.cat(want) if sum(lengths) else scores)
    # Gradients of softmax and padded, against the loops' (weights that tell rows apart).
    leaf = values.detach().clone().requires_grad_()
    parts_leaf = list(leaf.split(lengths))
    g = torch.Generator().manual_seed(1)
    w_soft = torch.randn(len(scores), generator=g, dtype=torch.double)
    w_pad = torch.randn(padded.shape, generator=g, dtype=torch.double)
    r_leaf = fold.Ragged(leaf, torch.tensor(lengths))
    got = torch.autograd.grad(
        (r_leaf.softmax(leaf.sum(1) ** 2) * w_soft).sum() + (r_leaf.padded(-1.0) * w_pad).sum(),
        leaf,
    )[0]
    want_total = sum(
        (torch.softmax(p.sum(1) ** 2, 0) * w).sum() + (p * w_pad[i, : len(p)]).sum()
        for i, (p, w) in enumerate(zip(parts_leaf, w_soft.split(lengths)))
    )
    if sum(lengths):
        want_g = torch.autograd.grad(want_total, leaf)[0]
        torch.testing.assert_close(got, want_g)
    part = r.lists(1, len(lengths) - 1)
    torch.testing.assert_close(part.sum(), r.sum()[1:])
    if sum(lengths):
        nested = r.nested()
        for i, p in enumerate(parts):
            torch.testing.assert_close(nested[i], p)


def test_an_all_empty_group_takes_its_feature_from_the_argument() -> None:
    r = fold.Ragged(torch.zeros(0), torch.tensor([0, 0, 0]))
    assert r.sum(feature=(5,)).shape == (3, 5) and not r.sum(feature=(5,)).any()
    assert r.mean(feature=(5,)).shape == (3, 5)
    assert r.sum(feature=(5,), dtype=torch.float64).dtype == torch.float64
    assert r.padded(feature=(5,)).shape == (3, 0, 5)
    full = fold.Ragged(torch.ones(2, 4), torch.tensor([2, 0]))
    assert full.sum(feature=(9,)).shape == (2, 4)  # the values' own shape wins


class Pool(nn.Module):
    """A child-sum node over a list of any length, attention over the list, two outputs."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.table = nn.Parameter(torch.randn(7, W, generator=g, dtype=torch.double))
        self.proj = nn.Parameter(torch.randn(W, W, generator=g, dtype=torch.double) / 2)
        self.query = nn.Parameter(torch.randn(W, generator=g, dtype=torch.double))

    def embed(self, i: torch.Tensor) -> torch.Tensor:
        return self.table[i]

    def pool(self, i: torch.Tensor, children: fold.Ragged) -> torch.Tensor:
        d = self.proj.dtype  # an all-empty group knows no dtype: say it
        total = children.sum(feature=(W,), dtype=d) @ self.proj
        scores = children.values @ self.query if children.values.dim() == 2 else children.values
        weights = children.softmax(scores)
        attended = fold.Ragged(children.values * weights.unsqueeze(-1), children.lengths)
        peak = children.amax(feature=(W,), dtype=d)
        read = attended.sum(feature=(W,), dtype=d)
        return torch.tanh(self.table[i] + total + read + 0.5 * peak)

    def fork(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sin(), x @ self.proj


@st.composite
def list_programs(draw: Any) -> list[tuple[Any, ...]]:
    """Steps: ("leaf", word) | ("pool", word, [refs]) | ("fork", ref); a ref is (step, k)
    with k None for a whole node or the output index of a fork."""
    prog: list[tuple[Any, ...]] = [("leaf", draw(st.integers(0, 6)))]
    for _ in range(draw(st.integers(1, 14))):
        refs = [
            (s, k)
            for s, step in enumerate(prog)
            for k in ((0, 1) if step[0] == "fork" else (None,))
        ]
        kind = draw(st.sampled_from(["leaf", "pool", "pool", "pool", "fork"]))
        if kind == "leaf":
            prog.append(("leaf", draw(st.integers(0, 6))))
        elif kind == "fork":
            whole = [r for r in refs if r[1] is None]
            prog.append(("fork", draw(st.sampled_from(whole))))
        else:  # empty lists, repeated elements, elements from different depths
            prog.append(
                ("pool", draw(st.integers(0, 6)), draw(st.lists(st.sampled_from(refs), max_size=5)))
            )
    return prog


def _replay(f: Any, prog: list[tuple[Any, ...]]) -> list[Any]:
    made: list[Any] = []
    for step in prog:
        if step[0] == "leaf":
            made.append(f.add("embed", step[1]))
        elif step[0] == "fork":
            made.append(f.add("fork", made[step[1][0]]).split(2))
        else:
            made.append(f.add("pool", step[1], [_ref(made, r) for r in step[2]]))
    return [_ref(made, (s, None)) for s, step in enumerate(prog) if step[0] != "fork"]


def _ref(made: list[Any], ref: tuple[int, Any]) -> Any:
    s, k = ref
    return made[s] if k is None else made[s][k]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    list_programs(), st.sampled_from(["depth", "agenda", "lockstep"]), st.sampled_from([None, 2])
)
def test_random_graphs_with_list_arguments_fold_equals_unfold(
    prog: list[tuple[Any, ...]], strategy: str, max_rows: int | None
) -> None:
    model = Pool()
    f = fold.Fold(strategy)
    (got,) = f.apply(model, [_replay(f, prog)], max_rows=max_rows)
    u = fold.Unfold(model)
    (want,) = u.apply(model, [_replay(u, prog)])
    torch.testing.assert_close(got, want)
    params = list(model.parameters())
    g = torch.autograd.grad(got.square().sum(), params, allow_unused=True)
    w = torch.autograd.grad(want.square().sum(), params, allow_unused=True)
    for a, b in zip(g, w):
        if a is None or b is None:
            assert a is None and b is None
        else:
            torch.testing.assert_close(a, b)


def test_list_arguments_count_in_depth_and_share_groups_across_lengths() -> None:
    f = fold.Fold(strategy="depth")
    leaves = [f.add("embed", i) for i in range(4)]
    a = f.add("pool", 0, leaves[:1])
    b = f.add("pool", 1, leaves)  # another length, the same step: one group
    c = f.add("pool", 2, [])
    top = f.add("pool", 3, [a, c, leaves[0]])
    assert (a.depth, b.depth, c.depth, top.depth) == (1, 1, 0, 2)
    assert f.add("pool", 1, leaves) == b  # the same list: the same node
    f.apply(Pool(), [[top, b]])
    pool_groups = [r for r in f.last_run if r[1] == "pool"]
    assert [r[2] for r in pool_groups] == [1, 2, 1]
    assert (1, a) in f.node_args(top.id) and (1, leaves[0]) in f.node_args(top.id)


def test_bad_list_arguments_name_the_op_argument_and_element() -> None:
    f, other = fold.Fold(), fold.Fold()
    x = f.add("embed", 1)
    with pytest.raises(
        fold.FoldError, match=r"'pool'.*argument 1 is a list whose element 1 is of type int"
    ):
        f.add("pool", 0, [x, 3])
    with pytest.raises(fold.FoldError, match="element 0 is a Node of another Fold"):
        f.add("pool", 0, [other.add("embed", 1)])
    rec = f.op("pool")
    rec(0, [x])  # the recorder's fast path checks elements too
    with pytest.raises(fold.FoldError, match="element 2 is of type str"):
        rec(0, [x, x, "x"])

    class Shapes(Pool):
        def wide(self, i):
            return torch.cat([self.table[i], self.table[i]], 1)

    g = fold.Fold()
    a, b = g.add("embed", 1), g.add("wide", 2)
    top = g.add("pool", 0, [a, b])
    with pytest.raises(
        fold.FoldError, match=r"'pool', argument 1: element 1 .* must agree in shape"
    ):
        g.apply(Shapes(), [[top]])
    u = fold.Unfold(Shapes())
    with pytest.raises(fold.FoldError, match="differ in shape"):
        u.add("pool", 0, [u.add("embed", 1), u.add("wide", 2)])


def test_a_nobatch_element_of_a_list_is_refused() -> None:
    g = fold.Fold()
    shared = g.add("embed", 1).nobatch()
    with pytest.raises(fold.FoldError, match="a list holds a nobatch node"):
        g.apply(Pool(), [[g.add("pool", 0, [shared])]])


def test_with_values_shares_the_lists_and_checks_the_rows() -> None:
    r = fold.Ragged(torch.arange(10.0).view(5, 2), torch.tensor([2, 0, 3]))
    seg = r.segment_ids
    doubled = r.with_values(2 * r.values)
    assert doubled.segment_ids is seg  # computed once for both
    torch.testing.assert_close(doubled.sum(), 2 * r.sum())
    torch.testing.assert_close(doubled.lengths, r.lengths)
    with pytest.raises(fold.FoldError, match=r"with_values\(values\): values has shape \(4, 2\)"):
        r.with_values(torch.zeros(4, 2))


class ChildSum(nn.Module):
    """A child-sum cell written as a user first writes it: the children's values through a
    Linear, with no feature= anywhere."""

    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, hidden)
        self.U = nn.Linear(hidden, hidden)

    def leaf(self, word: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.embed(word))

    def node(self, x: torch.Tensor, children: fold.Ragged) -> torch.Tensor:
        summed = torch.zeros(len(x), self.U.out_features).index_add(
            0, children.segment_ids, self.U(children.values)
        )
        return torch.tanh(x + summed)


def test_an_all_empty_group_takes_the_element_shape_a_group_of_its_op_gave() -> None:
    """An op whose lists are all empty in a group: once a group of it had elements (here in
    an earlier apply on the same model), the empty group gets values (0, *their shape) in
    their dtype, and the op as a user first writes it runs, equal to Unfold.  Where nothing
    told the shape yet (a tree's leaves run before any node with children), the FoldError
    names feature= as the fix."""
    torch.manual_seed(0)
    model = ChildSum()

    def leaves_only(f: Any) -> Any:
        return [f.add("node", f.add("leaf", w), []) for w in (1, 2, 3)]

    f = fold.Fold(strategy="depth")
    with pytest.raises(fold.FoldError, match=r"list argument 1 is empty in every node.*feature="):
        f.apply(model, [leaves_only(f)])
    # A graph where the op's lists have elements (made by another op, run before).
    g = fold.Fold(strategy="depth")
    pooled = g.add("node", g.add("leaf", 7), [g.add("leaf", 8), g.add("leaf", 9)])
    g.apply(model, [[pooled]])
    for make in (leaves_only, lambda f: [f.add("node", f.add("leaf", 5), leaves_only(f))]):
        f = fold.Fold(strategy="depth")
        got = f.apply(model, [make(f)])[0]
        u = fold.Unfold(model)
        want = u.apply(model, [make(u)])[0]
        torch.testing.assert_close(got, want)


class SumCell(nn.Module):
    """A child-sum cell of batched layers, using every reduction a Ragged has."""

    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, hidden)
        self.U = nn.Linear(hidden, hidden)

    def leaf(self, word: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.embed(word))

    def node(self, x: torch.Tensor, children: fold.Ragged) -> torch.Tensor:
        u = children.with_values(self.U(children.values))
        weights = children.softmax(u.values.sum(-1))
        attended = u.with_values(u.values * weights[:, None]).sum()
        return torch.tanh(x + attended + u.mean() + children.padded().sum(1) * 0.1 + u.amax())


def _sum_graph(f: Any) -> list[Any]:
    ls = [f.add("leaf", w) for w in (1, 2, 3, 4, 5)]
    a = f.add("node", ls[0], [ls[1], ls[2]])
    b = f.add("node", ls[3], [])
    c = f.add("node", ls[4], [ls[0], ls[1], ls[2], ls[3]])
    return [f.add("node", ls[1], [a, b, c, ls[0]]), a, b, c]


@pytest.mark.parametrize("chunk", [None, 3])
@pytest.mark.parametrize("max_rows", [None, 1])
def test_list_arguments_with_a_batch_module_equal_n_separate_folds(max_rows, chunk) -> None:
    """One fold runs N child-sum models at once: each model's values and gradients equal
    its own fold's (float64), also in chunks of one node (max_rows=1); backprop of one
    model's output leaves every other model's gradients exactly zero.  ``chunk``: models
    per pass, one at a time (a CPU's default) or all 3 in one pass (a GPU's: the op takes
    the N models' lists as one ModelRagged)."""
    from fold.batched_ops import BatchModule

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        n = 3
        models = [SumCell() for _ in range(n)]
        bm = BatchModule.from_modules(models)
        bm.chunk_size = chunk
        f = fold.Fold()
        (out,) = f.apply(bm, [_sum_graph(f)], max_rows=max_rows)
        assert out.shape[:2] == (n, 4)
        weights = torch.randn_like(out)
        grads = torch.autograd.grad((out * weights).sum(), list(bm.parameters()), retain_graph=True)
        by_name = dict(zip([k for k, _ in bm.named_parameters()], grads))
        for i, m in enumerate(models):
            g = fold.Fold()
            (want,) = g.apply(m, [_sum_graph(g)])
            torch.testing.assert_close(out[i], want)
            mine = torch.autograd.grad((want * weights[i]).sum(), list(m.parameters()))
            for (name, _), a in zip(m.named_parameters(), mine):
                stacked = next(v for k, v in by_name.items() if k.endswith(name))
                torch.testing.assert_close(stacked[i], a)
        # Isolation: model 1's output alone.
        iso = torch.autograd.grad(out[1].sum(), list(bm.parameters()), allow_unused=True)
        for grad in iso:
            if grad is not None:
                assert torch.count_nonzero(grad[[0, 2]]) == 0
                assert torch.count_nonzero(grad[1]) > 0
    finally:
        torch.set_default_dtype(old)


@pytest.mark.parametrize("chunk", [None, 2, 3])
def test_list_arguments_of_a_model_under_the_vmap_fallback_equal_each_model_alone(chunk) -> None:
    """A model with raw parameters (no batched layer: it runs under torch.vmap) takes the
    lists of N models too: each model sees its own lists, values and gradients equal to its
    own Unfold (float64); empty lists, repeated elements and every Ragged reduction."""
    from fold.batched_ops import BatchModule

    prog = [
        ("leaf", 1),
        ("pool", 2, [(0, None), (0, None)]),
        ("pool", 3, []),
        ("fork", (1, None)),
        ("pool", 4, [(1, None), (3, 1), (2, None)]),
        ("pool", 5, [(4, None)]),
    ]
    models = [Pool() for _ in range(3)]
    with torch.no_grad():
        for i, m in enumerate(models):
            for p in m.parameters():
                p.add_(0.1 * i * torch.randn_like(p))
    with pytest.warns(UserWarning, match="torch.vmap"):
        bm = BatchModule.from_modules(models)
    bm.chunk_size = chunk
    f = fold.Fold()
    (out,) = f.apply(bm, [_replay(f, prog)])
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum(), list(bm.parameters()))
    for i, m in enumerate(models):
        u = fold.Unfold(m)
        (want,) = u.apply(m, [_replay(u, prog)])
        torch.testing.assert_close(out[i], want)
        mine = torch.autograd.grad((want * weights[i]).sum(), list(m.parameters()))
        for stacked, g in zip(grads, mine):
            torch.testing.assert_close(stacked[i], g)


def test_the_lists_of_n_models_refuse_offsets_and_nested() -> None:
    from fold.ragged import ModelRagged

    r = ModelRagged(
        torch.zeros(4, 2),
        torch.tensor([1, 1]),
        torch.tensor([0, 1, 0, 1]),
        torch.tensor([0, 0, 1, 1]),
        2,
    )
    for read in (lambda: r.offsets, r.nested):
        with pytest.raises(fold.FoldError, match="not contiguous.*Fix"):
            read()


class Attend(nn.Module):
    """An encoder step and a decoder step attending over its example's encoder states (a
    list argument): the memory every step of an example reads again."""

    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.embed = nn.Parameter(torch.randn(9, hidden, generator=g, dtype=torch.double))
        self.w = nn.Parameter(torch.randn(hidden, hidden, generator=g, dtype=torch.double) / 2)
        self.q = nn.Parameter(torch.randn(hidden, hidden, generator=g, dtype=torch.double) / 2)

    def enc(self, h: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h @ self.w + self.embed[word])

    def start(self, word: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.embed[word])

    def dec(self, h: torch.Tensor, word: torch.Tensor, memory: fold.Ragged) -> torch.Tensor:
        q = (h @ self.q).index_select(0, memory.segment_ids)
        weights = memory.softmax((memory.values * q).sum(1))
        ctx = memory.with_values(weights[:, None] * memory.values).sum()
        return torch.tanh(h @ self.w + ctx + self.embed[word])


def _decoders(f: Any, sources: list[int], steps: list[int], shared: bool) -> list[Any]:
    outs = []
    for e, (n, k) in enumerate(zip(sources, steps)):
        h = f.add("start", e % 9)
        memory = [h]
        for i in range(1, n):
            h = f.add("enc", h, (e + i) % 9)
            memory.append(h)
        for t in range(k):  # each step reads the example's memory (or, unshared, a part)
            h = f.add("dec", h, (e * t) % 9, memory if shared else memory[t % n :])
            outs.append(h)
    return outs


@pytest.mark.parametrize("strategy", ["depth", "agenda", "lockstep"])
@pytest.mark.parametrize("shared", [True, False])
def test_memories_read_by_every_step_equal_eager(
    strategy: str, shared: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decoders whose steps read their example's memory (elements from several encoder
    steps: a table read), examples dropping out at different steps: values and gradients
    against eager per node; the memories of the later steps are read from the table rows
    kept by the first (``Values.list_recipe``), where the lists repeat."""
    from fold.values import Values

    hits = []
    plan = Values.list_recipe

    def spy(self: Values, lists: Any, idx: Any) -> Any:
        got = plan(self, lists, idx)
        hits.append(got is not None)
        return got

    monkeypatch.setattr(Values, "list_recipe", spy)
    sources, steps = [3, 5, 2, 4, 6], [4, 1, 6, 3, 5]
    model = Attend()
    f = fold.Fold(strategy)
    (got,) = f.apply(model, [_decoders(f, sources, steps, shared)])
    u = fold.Unfold(model)
    (want,) = u.apply(model, [_decoders(u, sources, steps, shared)])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    weights = torch.linspace(-1, 1, got.numel(), dtype=got.dtype).view(got.shape)
    params = list(model.parameters())
    g = torch.autograd.grad((got * weights).sum(), params)
    w = torch.autograd.grad((want * weights).sum(), params)
    for a, b in zip(g, w):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert any(hits) == shared
