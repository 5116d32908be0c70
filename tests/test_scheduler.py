"""Schedulers: plans as pure functions of the graph, group counts of depth and agenda."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

import fold
from fold._encoding import node_id
from fold.models import TreeLSTM, record_tree
from fold.scheduler import (
    SCHEDULERS,
    ArrayGraph,
    Plan,
    agenda_schedule,
    auto_schedule,
    chain_plan,
    depth_schedule,
    lockstep_schedule,
)
from fold.scheduler.signature import signature_schedule
from fold.treebank import random_tree


class SeqModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.cell = nn.RNNCell(8, 8)
        self.out = nn.Linear(8, 3)

    def start(self, w: torch.Tensor) -> torch.Tensor:
        return self.cell(self.embed(w))

    def step(self, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.cell(self.embed(w), h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(h)


def record_sequences(f: fold.Fold, lengths: list[int]) -> list[fold.Node]:
    rng = random.Random(0)
    outs = []
    for n in lengths:
        h = f.add("start", rng.randrange(50))
        for _ in range(n - 1):
            h = f.add("step", h, rng.randrange(50))
        outs.append(f.add("head", h))
    return outs


def test_every_node_is_planned_once_and_after_its_arguments() -> None:
    for strategy, schedule in SCHEDULERS.items():
        f = fold.Fold(strategy)
        record_sequences(f, [3, 1, 5, 2])
        plan = schedule(f.snapshot())
        order = [n for s in plan.steps for g in s.groups for n in g.nodes]
        assert sorted(order) == list(range(len(f))), strategy
        position = {n: i for i, s in enumerate(plan.steps) for g in s.groups for n in g.nodes}
        for nid in range(len(f)):
            for _, a in f.node_args(nid):
                assert position[node_id(a)] < position[nid], strategy


def test_agenda_merges_the_heads_of_sequences_of_different_lengths() -> None:
    lengths = [1, 4, 2, 9, 4, 7, 3]
    groups = {}
    results = {}
    model = SeqModel()
    for strategy in ("depth", "agenda"):
        f = fold.Fold(strategy)
        outs = record_sequences(f, lengths)
        groups[strategy] = f.plan().num_groups
        (results[strategy],) = f.apply(model, [outs])
        heads = [r for r in f.last_run if r[1] == "head"]
        if strategy == "agenda":
            assert len(heads) == 1 and heads[0][2] == len(lengths)
    # depth: start, 8 step levels, one head group per distinct length (6); agenda: 1 head group
    assert groups == {"depth": 1 + 8 + 6, "agenda": 1 + 8 + 1}
    torch.testing.assert_close(results["depth"], results["agenda"])


def test_agenda_matches_depth_on_trees() -> None:
    rng = random.Random(2)
    model = TreeLSTM(100, 8)
    trees = [random_tree(rng, rng.randint(1, 10), 100) for _ in range(20)]
    out = {}
    for strategy in ("depth", "agenda"):
        f = fold.Fold(strategy)
        (out[strategy],) = f.apply(model, [[record_tree(f, t) for t in trees]])
        assert f.plan().num_groups == max(f.depth) + 1
    torch.testing.assert_close(out["depth"], out["agenda"])


@pytest.mark.parametrize("schedule", [depth_schedule, agenda_schedule, lockstep_schedule])
def test_empty_graph_has_an_empty_plan(schedule) -> None:
    assert schedule(fold.Fold().snapshot()).steps == []
    assert schedule(ArrayGraph(sig=[], depth=[])).steps == []


def test_wide_graphs_take_the_array_agenda_and_match_depth(monkeypatch) -> None:
    """64 sequences: the agenda's array implementation plans them (the per-node one would
    raise here), with one head group, and the values and gradients equal depth scheduling's."""
    from fold.scheduler import agenda

    def refuse(graph):
        raise AssertionError("the per-node agenda ran on a wide graph")

    monkeypatch.setattr(agenda, "_agenda_nodes", refuse)
    rng = random.Random(4)
    lengths = [rng.randint(1, 9) for _ in range(64)]
    model = SeqModel()
    results, grads = {}, {}
    for strategy in ("depth", "agenda"):
        f = fold.Fold(strategy)
        outs = record_sequences(f, lengths)
        (results[strategy],) = f.apply(model, [outs])
        grads[strategy] = torch.autograd.grad(results[strategy].square().sum(), model.parameters())
        heads = [r for r in f.last_run if r[1] == "head"]
        if strategy == "agenda":
            assert len(heads) == 1 and heads[0][2] == len(lengths)
            assert f.plan().num_groups == 1 + (max(lengths) - 1) + 1
        else:
            assert len(heads) == len(set(lengths))
    torch.testing.assert_close(results["depth"], results["agenda"])
    for a, b in zip(grads["depth"], grads["agenda"]):
        torch.testing.assert_close(a, b)


def _groups(plan) -> list[list[tuple[int, list[int]]]]:
    return [[(g.key, [int(n) for n in g.nodes]) for g in step.groups] for step in plan.steps]


def test_schedulers_plan_a_graph_built_by_hand_without_a_fold() -> None:
    """Schedulers read the GraphView interface only: arrays built by hand plan as a Fold's.

    Two chains of ``step`` (signature 1) of lengths 1 and 3 from two leaves (signature 0),
    each read by a ``head`` (signature 2): depth runs the heads at two depths, the agenda
    waits and runs them as one group."""
    #        node:  0  1  2  3  4  5  6  7
    sig = np.array([0, 0, 1, 1, 1, 1, 2, 2])
    depth = np.array([0, 0, 1, 1, 2, 3, 2, 4])
    src = np.array([0, 1, 3, 4, 2, 5])
    dst = np.array([2, 3, 4, 5, 6, 7])
    g = ArrayGraph(sig, depth, src, dst)
    assert _groups(depth_schedule(g)) == [
        [(0, [0, 1])],
        [(1, [2, 3])],
        [(1, [4]), (2, [6])],
        [(1, [5])],
        [(2, [7])],
    ]
    assert _groups(agenda_schedule(g)) == [
        [(0, [0, 1])],
        [(1, [2, 3])],
        [(1, [4])],
        [(1, [5])],
        [(2, [6, 7])],
    ]
    # auto: the agenda's plan, which has fewer groups (5 against 6).
    assert _groups(auto_schedule(g)) == _groups(agenda_schedule(g))
    # Group keys given by hand (as nobatch nodes make them) split what signatures would join.
    keyed = ArrayGraph(sig, depth, src, dst, group_keys=[0, ("own", 1), 1, 1, 1, 1, 2, 2])
    assert _groups(depth_schedule(keyed))[0] == [(0, [0]), (("own", 1), [1])]


def test_one_group_per_signature_where_no_signature_reads_itself() -> None:
    """Leaves (signature 0), a pad made from leaf 0 (signature 2), a cat of a leaf or the pad
    (signature 1, at depths 1 and 2), a head on each cat (signature 3): depth runs the cats
    and the heads twice; one group per signature runs each once, after what it reads; a
    graph whose signature reads itself gets no such plan."""
    #        node:  0  1  2  3  4  5  6
    sig = np.array([0, 0, 2, 1, 1, 3, 3])
    depth = np.array([0, 0, 1, 1, 2, 2, 3])
    src = np.array([0, 1, 2, 3, 4])
    dst = np.array([2, 3, 4, 5, 6])
    g = ArrayGraph(sig, depth, src, dst)
    assert depth_schedule(g).num_groups == 6
    assert _groups(signature_schedule(g)) == [
        [(0, [0, 1])],
        [(2, [2])],
        [(1, [3, 4])],
        [(3, [5, 6])],
    ]
    assert _groups(auto_schedule(g)) == _groups(signature_schedule(g))
    loop = ArrayGraph(sig=[0, 1, 1], depth=[0, 1, 2], src=[0, 1], dst=[1, 2])
    assert signature_schedule(loop) is None  # a chain of steps: signature 1 reads itself
    through = ArrayGraph(sig=[0, 1, 2, 1], depth=[0, 1, 2, 3], src=[0, 1, 2], dst=[1, 2, 3])
    assert signature_schedule(through) is None  # 1 reads 2, which reads 1


class _Branches(nn.Module):
    """Ops of the graph above, on real values."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.lin = nn.Linear(8, 3)

    def leaf(self, w: torch.Tensor) -> torch.Tensor:
        return self.embed(w)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5 - 1

    def pair(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([a, b], 1)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def test_one_group_per_signature_gives_unfolds_values_and_gradients() -> None:
    """Examples that pair a leaf with a pad made one op earlier, or with another leaf, put
    ``pair`` and ``head`` at two depths: auto runs each signature once, with Unfold's values
    and gradients."""
    torch.manual_seed(1)
    model = _Branches().double()
    rng = random.Random(2)
    words = [[rng.randrange(10) for _ in range(2)] for _ in range(7)]

    def record(f):
        outs = []
        for k, (a, b) in enumerate(words):
            x = f.add("leaf", a)
            y = f.add("leaf", b)
            outs.append(f.add("head", f.add("pair", x, f.add("pad", y) if k % 2 else y)))
        return outs

    f = _same_as_unfold(model, record)
    assert len(f.last_run) == 4  # leaf, pad, pair, head: one group each


def _same_as_unfold(model: nn.Module, record, run=None) -> fold.Fold:
    """``record`` applied by a Fold (or run by ``run(fold, nodes)``) and by Unfold: values
    and gradients equal; the Fold."""
    results = []
    folded = fold.Fold()
    for f in (folded, fold.Unfold(model)):
        model.zero_grad()
        outs = record(f)
        h = run(f, outs) if run is not None and f is folded else f.apply(model, [outs])[0]
        (h * torch.arange(1.0, 1 + h.numel(), dtype=h.dtype).view(h.shape)).sum().backward()
        results.append((h.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b)
    return folded


class _Cycle(_Branches):
    """A ``pair`` before a ``cell`` and another after it: one op, as a decoder's first step
    calls one ``torch.cat`` before its cell and one after it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin4 = nn.Linear(8, 4)

    def cell(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin4(x))


def test_signature_plan_split_by_depth_where_signatures_read_themselves() -> None:
    """``pair`` reads ``cell``, which reads ``pair``: no plan of one group per signature.
    With ``split``, the signatures on the cycle are grouped by depth (``pair`` at two
    depths, named by slots past the signatures), the others kept whole (``leaf``, ``head``):
    a whole plan, each group reading only groups of earlier steps, whose run gives Unfold's
    values and gradients (float64)."""
    from fold.executor import Executor

    torch.manual_seed(3)
    model = _Cycle().double()
    words = [(3, 1), (4, 1), (5, 9), (2, 6), (5, 3)]

    def record(f):
        outs = []
        for a, b in words:
            x, y = f.add("leaf", a), f.add("leaf", b)
            h = f.add("cell", f.add("pair", x, y))
            outs.append(f.add("head", f.add("pair", h, y)))
        return outs

    def run(f, outs):
        a = f.snapshot()
        assert signature_schedule(a) is None
        plan = signature_schedule(a, split=True)
        assert plan is not None and plan.whole
        nsig = len(a.count)
        names = {sid: op for sid, (op, _) in enumerate(a.signatures)}
        step_of: dict[int, int] = {}
        seen = []
        for s, step in enumerate(plan.steps):
            for g in step.groups:
                slot = g.key if g.slot is None else g.slot
                assert (g.slot is None) == (names[g.key] in ("leaf", "head"))
                assert g.slot is None or g.slot >= nsig
                for src in g.inputs:
                    if src is not None:
                        for part in getattr(src, "parts", (src,)):
                            assert step_of[part.sid] < s  # an earlier step's group
                step_of[slot] = s
                seen.extend(a.ids(g.key) if g.slot is None else g.nodes)
        assert sorted(int(x) for x in seen) == list(range(a.n))  # every node once
        sizes = sorted(len(g.nodes) for st in plan.steps for g in st.groups if g.slot)
        assert sizes == [5, 5, 5]  # pair at two depths, cell at one
        ex = Executor(a, model)
        ex.run(plan)
        return ex.output("nodes", outs, 0)

    _same_as_unfold(model, record, run)


class _Widths(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)

    def leaf(self, w: torch.Tensor) -> torch.Tensor:
        return self.embed(w)

    def widen(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x * 2], 1)

    def norm(self, v: torch.Tensor) -> torch.Tensor:
        return v.pow(2).sum(1)


def test_one_group_per_signature_falls_back_where_a_column_mixes_shapes() -> None:
    """A column reading rows of two shapes (a leaf's 4, a widened leaf's 8) cannot be one
    cat: that group, and the rest, run on the general gathers, in parts by shape, with
    Unfold's values and gradients."""
    torch.manual_seed(4)
    model = _Widths().double()
    words = [3, 1, 4, 1, 5, 9, 2]

    def record(f):
        outs = []
        for k, w in enumerate(words):
            x = f.add("leaf", w)
            outs.append(f.add("norm", f.add("widen", x) if k % 2 else x))
        return outs

    f = _same_as_unfold(model, record)
    assert signature_schedule(f.snapshot()).whole
    # (step, size) per group: leaf, widen, then norm at the third level in parts by shape,
    # as the general gathers run it (depth would run norm's parts at two steps)
    assert [(r[0], r[2]) for r in f.last_run] == [(0, 6), (1, 2), (2, 4), (2, 2)]


def test_chain_plan_only_for_chains_of_whole_outputs() -> None:
    """The chain planner emits its plan (each signature one group, its inputs named) for a
    per-sample loop, and None for a graph where a column is not a whole earlier output."""
    f = fold.Fold()
    logits = [f.add("forward", torch.ones(1, 3)) for _ in range(4)]
    losses = [f.add("loss", h, i) for i, h in enumerate(logits)]
    plan = chain_plan(f.snapshot())
    assert plan is not None and plan.whole
    (forward,), (loss,) = (step.groups for step in plan.steps)
    assert forward.inputs == (None,) and loss.inputs[0].sid == forward.key
    assert loss.nodes.ids(f.snapshot()).tolist() == [n.id for n in losses]
    h = fold.Fold()  # a graph of the same structure: the same plan, made once
    [h.add("loss", h.add("forward", torch.ones(1, 3)), i) for i in range(4)]
    assert chain_plan(h.snapshot()) is plan
    g = fold.Fold()
    xs = [g.add("forward", torch.ones(1, 3)) for _ in range(4)]
    g.add("loss", xs[1], 0)  # reads one node of four: no whole output
    assert chain_plan(g.snapshot()) is None
    assert depth_schedule(g.snapshot()).num_groups == 2


def test_auto_plans_the_agenda_only_where_depth_leaves_groups_to_merge(monkeypatch) -> None:
    """auto takes depth's plan without planning the agenda where depth has one group per
    signature; where the agenda only ties depth's group count, depth's plan."""
    from fold.scheduler import auto

    def refuse(graph):
        raise AssertionError("the agenda was planned")

    monkeypatch.setattr(auto, "agenda_schedule", refuse)
    tree = ArrayGraph(sig=[0, 0, 0, 1], depth=[0, 0, 0, 1], src=[0, 1, 2], dst=[3, 3, 3])
    assert _groups(auto_schedule(tree)) == _groups(depth_schedule(tree))
    # A chain: 4 groups for 2 signatures, so the agenda is planned; a tie keeps depth.
    chain = ArrayGraph(sig=[0, 1, 1, 1], depth=[0, 1, 2, 3], src=[0, 1, 2], dst=[1, 2, 3])
    depth_plan = depth_schedule(chain)
    tie = Plan(list(reversed(depth_plan.steps)))  # the same number of groups
    monkeypatch.setattr(auto, "agenda_schedule", lambda graph: tie)
    assert _groups(auto_schedule(chain)) == _groups(depth_plan)
    fewer = Plan(depth_plan.steps[:3])
    monkeypatch.setattr(auto, "agenda_schedule", lambda graph: fewer)
    assert auto_schedule(chain) is fewer


def test_auto_is_the_default_and_matches_depth_values() -> None:
    """Fold() schedules with auto; a TreeLSTM batch gives depth's values and gradients."""
    assert fold.Fold().strategy == "auto"
    torch.manual_seed(0)
    model = TreeLSTM(50, 8).double()
    rng = random.Random(3)
    trees = [random_tree(rng, rng.randint(2, 9), 50) for _ in range(6)]
    results = []
    for strategy in ("auto", "depth"):
        f = fold.Fold(strategy=strategy)
        roots = [record_tree(f, t) for t in trees]
        model.zero_grad()
        (h,) = f.apply(model, [roots])
        (h * torch.arange(1.0, 1 + h.numel(), dtype=h.dtype).view(h.shape)).sum().backward()
        results.append(
            (h.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None])
        )
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_auto_remembers_its_choice_per_model(monkeypatch) -> None:
    """A graph of the same signatures takes the schedule chosen before without planning the
    other, until RECHECK graphs have passed; then both are planned again."""
    from fold.scheduler import auto

    monkeypatch.setattr(auto, "_CHOSEN", {})
    rng = random.Random(0)

    def graph():
        f = fold.Fold()
        for t in [random_tree(rng, rng.randint(2, 9), 50) for _ in range(6)]:
            record_tree(f, t)
        return f.snapshot()

    auto_schedule(graph())
    ((chosen, since),) = auto._CHOSEN.values()
    assert chosen is depth_schedule and since == 0  # trees: the agenda is no better
    planned = []
    real = auto.agenda_schedule
    monkeypatch.setattr(auto, "agenda_schedule", lambda g: planned.append(1) or real(g))
    for _ in range(auto.RECHECK):
        auto_schedule(graph())
    assert planned == []
    auto_schedule(graph())  # the RECHECK-th graph after the choice: both planned again
    assert planned == [1]


def test_plan_cost_counts_groups_copied_bytes_and_repeated_reads() -> None:
    """plan_cost: groups at GROUP each; a column read in place (a whole source in order)
    costs nothing more; a column with rows read twice is copied whole, and its repeats cost
    REPEAT on top."""
    from fold.scheduler import auto

    def graph(reads):
        f = fold.Fold()
        enc = [f.add("enc", torch.ones(1, 2)) for _ in range(4)]
        for k, i in enumerate(reads):
            f.add("use", enc[i], k)
        return f.snapshot()

    in_order, repeats = graph([0, 1, 2, 3]), graph([0, 1, 0, 1])
    enc_sig, use_sig = in_order.signatures
    facts = auto.Facts(row_bytes={enc_sig: (1000,), use_sig: (8,)})
    group_s, copy_s, repeat_s = auto.COSTS["cpu"]
    cost, known = auto.plan_cost(in_order, depth_schedule(in_order), facts)
    assert known and cost == pytest.approx(2 * group_s, rel=1e-12)
    cost, known = auto.plan_cost(repeats, depth_schedule(repeats), facts)
    want = 2 * group_s + 4 * 1000 * copy_s + 2 * 1000 * repeat_s
    assert known and cost == pytest.approx(want, rel=1e-12)
    # Unmeasured sizes count DEFAULT_ROW_BYTES and say so.
    cost, known = auto.plan_cost(repeats, depth_schedule(repeats), auto.Facts())
    rows = auto.DEFAULT_ROW_BYTES
    assert not known and cost == pytest.approx(
        2 * group_s + 4 * rows * copy_s + 2 * rows * repeat_s, rel=1e-12
    )


class _Memory(nn.Module):
    """Decoder steps that each attend over their example's memory (benchmarks/dynamic.py's
    memory graph, small)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.enc_ = nn.Linear(4, 4)
        self.cell = nn.GRUCell(4, 4)

    def enc(self, words):
        return torch.tanh(self.enc_(self.embed(words)))

    def start(self, y):
        return self.cell(self.embed(y))

    def step(self, h, y):
        return self.cell(self.embed(y), h)

    def use(self, h, memory):
        weights = torch.bmm(memory, h[:, :, None])[:, :, 0].softmax(1)
        return torch.bmm(weights[:, None], memory)[:, 0]


def test_auto_takes_depth_where_the_agenda_would_copy_memories_once_sizes_are_known() -> None:
    """The agenda merges every step's ``use`` into one group with fewer groups in all, but
    that group copies a memory per step.  Before any apply the rows count a default size
    and auto takes the agenda; the apply measures the memory's rows, and from then on auto
    takes depth and remembers it.  Every apply equals eager, values and gradients."""
    torch.manual_seed(0)
    model = _Memory().double()
    rng = random.Random(0)
    data = [
        (torch.randint(10, (1, 2000)), [rng.randrange(10) for _ in range(21)]) for _ in range(4)
    ]

    def eager():
        outs = []
        for words, ys in data:
            memory = model.enc(words)
            h = model.start(torch.tensor(ys[:1]))
            for y in ys[1:]:
                h = model.step(h, torch.tensor([y]))
                outs.append(model.use(h, memory))
        return torch.cat(outs)

    def batched():
        f = fold.Fold()
        outs = []
        for words, ys in data:
            memory = f.add("enc", words)
            h = f.add("start", ys[0])
            for y in ys[1:]:
                h = f.add("step", h, y)
                outs.append(f.add("use", h, memory))
        (out,) = f.apply(model, [outs])
        snap = f.snapshot()
        return out, f, depth_schedule(snap).num_groups, agenda_schedule(snap).num_groups

    def grads(out):
        model.zero_grad()
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    want = eager()
    want_g = grads(want)
    used = []
    for _ in range(3):
        out, f, depth_groups, agenda_groups = batched()
        assert agenda_groups < depth_groups
        used.append(len(f.last_run))
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        for a, b in zip(grads(out), want_g):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert used == [agenda_groups, depth_groups, depth_groups]
    from fold.scheduler import auto

    ((chosen, _since),) = auto.facts_of(model).chosen.values()
    assert chosen is depth_schedule


class _ShiftReduce(nn.Module):
    """A tiny SPINN: a tracker step per transition, a reduce on the stack's top two."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, 4)
        self.tracker = nn.RNNCell(8, 4)
        self.compose = nn.Linear(12, 4)

    def leaf(self, w):
        return torch.tanh(self.emb(w))

    def track(self, top, t):
        return self.tracker(torch.cat([top, top], 1), t)

    def reduce(self, left, right, t):
        return torch.tanh(self.compose(torch.cat([left, right, t], 1)))


def _shift_reduce(f, words, actions):
    """Record a sentence's transitions (0 shift, 1 reduce); returns the root."""
    t = f.add("leaf", 0)
    stack, buffer = [], [f.add("leaf", w) for w in words]
    for a in actions:
        top = stack[-1] if stack else buffer[0]
        t = f.add("track", top, t)
        if a == 0:
            stack.append(buffer.pop(0))
        else:
            right, left = stack.pop(), stack.pop()
            stack.append(f.add("reduce", left, right, t))
    return stack[-1]


def _random_parse(rng, n):
    """The transitions of a random binary tree over n words."""
    actions, depth = [], 0
    shifted = 0
    while shifted < n or depth > 1:
        if shifted < n and (depth < 2 or rng.random() < 0.5):
            actions.append(0)
            shifted += 1
            depth += 1
        else:
            actions.append(1)
            depth -= 1
    return actions


def test_lockstep_runs_a_shift_reduce_batch_a_transition_at_a_time() -> None:
    """Sentences parsed together: lockstep makes a tracker group and a reduce group per
    transition (as hand-written batching does), fewer than depth and the agenda; every
    strategy gives eager's values and gradients, and auto takes lockstep there."""
    rng = random.Random(0)
    data = []
    for _ in range(12):
        n = rng.randint(3, 9)
        data.append(([rng.randrange(20) for _ in range(n)], _random_parse(rng, n)))
    model = _ShiftReduce().double()

    def eager():
        outs = []
        for words, actions in data:
            t = model.leaf(torch.tensor([0]))
            stack, buffer = [], [model.leaf(torch.tensor([w])) for w in words]
            for a in actions:
                top = stack[-1] if stack else buffer[0]
                t = model.track(top, t)
                if a == 0:
                    stack.append(buffer.pop(0))
                else:
                    right, left = stack.pop(), stack.pop()
                    stack.append(model.reduce(left, right, t))
            outs.append(stack[-1])
        return torch.cat(outs)

    want = eager()
    want_g = torch.autograd.grad(want.sum(), list(model.parameters()))
    longest = max(len(a) for _, a in data)
    reduces = max(sum(a) for _, a in data)
    groups = {}
    for strategy in ("depth", "agenda", "lockstep", "auto"):
        f = fold.Fold(strategy)
        roots = [_shift_reduce(f, w, a) for w, a in data]
        (got,) = f.apply(model, [roots])
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        for a, b in zip(torch.autograd.grad(got.sum(), list(model.parameters())), want_g):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        groups[strategy] = len(f.last_run)
    # one leaf group, a tracker group per transition, a reduce group per transition that
    # reduces in some sentence
    assert groups["lockstep"] <= 1 + longest + (longest - 1)
    assert groups["lockstep"] < min(groups["depth"], groups["agenda"])
    assert groups["auto"] == groups["lockstep"]
    assert reduces < longest


def _plan_form(plan):
    """A plan as plain values: per step, per group its key, size and inputs."""
    if plan is None:
        return None

    def rows(r):
        if r is None or type(r) is slice:
            return r
        return tuple(np.asarray(r).tolist())

    def source(x):
        from fold.scheduler.plan import Pieces

        if x is None:
            return None
        if type(x) is Pieces:
            return ("pieces", tuple(source(p) for p in x.parts), rows(x.order))
        return (x.sid, x.out, x.nsplit, rows(x.rows))

    return (
        plan.whole,
        [
            [
                (g.key, len(g.nodes), None if g.inputs is None else tuple(map(source, g.inputs)))
                for g in step.groups
            ]
            for step in plan.steps
        ],
    )


@pytest.mark.parametrize("seed", range(40))
def test_signature_schedule_of_all_columns_at_once_equals_signature_by_signature(seed) -> None:
    """The signature plan made of every node column at once (``_fused_schedule``) is the
    plan made signature by signature, on random recorded graphs: node arguments from earlier
    signatures, split outputs, shared nodes (memoised calls), rows in and out of order,
    columns reading several signatures, literal tensors and ints, and graphs whose
    signatures read themselves (no plan)."""
    from fold.scheduler.signature import _fused_schedule, _per_signature

    rng = random.Random(seed)
    f = fold.Fold()
    _random_graph(rng, f, loops=rng.random() < 0.2)
    a = f.snapshot()
    nsig = len(a.count)
    assert _plan_form(_fused_schedule(a, nsig)) == _plan_form(_per_signature(a, nsig))


def _random_graph(rng, f, loops, cycles=False, splits=None):
    """A random graph recorded into ``f`` (a Fold or an Unfold): ops ``op{k}_{arity}`` on
    values of earlier ops (with ``loops``, of the same op too; with ``cycles``, of any op
    recorded so far, so that signatures read each other), ints and literal (1, 2) tensors;
    an op's nodes split in two where ``splits`` holds its index (else at random per node).
    Every value made, whole or split, in order."""
    made: dict[int, list] = {}  # per op index, the values it made (whole or split outputs)
    everything = []
    nops = rng.randint(2, 6)
    for _ in range(rng.randint(4, 60)):
        k = rng.randrange(nops)
        earlier = [v for o, vs in made.items() if o < k or (loops and o == k) or cycles for v in vs]
        args = []
        for _ in range(rng.randint(1, 3)):
            what = rng.random()
            if earlier and what < 0.7:
                args.append(rng.choice(earlier))
            elif what < 0.85:
                args.append(rng.randrange(3))
            else:
                args.append(
                    torch.full((1, 2), rng.random()) if splits is not None else torch.zeros(1, 2)
                )
        node = f.add(f"op{k}_{len(args)}", *args)
        split = k in splits if splits is not None else rng.random() < 0.3
        outs = list(node.split(2)) if split else [node]
        made.setdefault(k, []).extend(outs)
        everything.extend(outs)
    return everything


class _Sums(nn.Module):
    """Ops ``op{k}_{arity}`` of ``_random_graph``: a (n, 2) value of the first column of each
    argument, two outputs for the ops in ``splits``."""

    def __init__(self, splits: set) -> None:
        super().__init__()
        self.splits = splits
        self.w = nn.Parameter(torch.tensor([0.5, -0.25], dtype=torch.float64))

    def __getattr__(self, name: str):
        if not name.startswith("op"):
            return super().__getattr__(name)
        k = int(name[2:].split("_")[0])

        def op(*args):
            n = len(args[0])
            x = sum(a.to(torch.float64).reshape(n, -1)[:, :1] * (i + 1) for i, a in enumerate(args))
            y = torch.tanh(x * self.w + 0.1 * k)
            return (y, y * 2 - 1) if k in self.splits else y

        return op


@pytest.mark.parametrize("seed", range(30))
def test_split_signature_plans_run_as_unfold_on_random_graphs(seed) -> None:
    """Random graphs whose signatures read themselves and each other (cycles through
    several signatures, split outputs, shared nodes, ints and literal tensors): the plan
    with the signatures on cycles split by depth is whole, holds every node once, each group
    reading groups of earlier steps only, and runs to Unfold's values and gradients."""
    from fold.executor import Executor

    splits = {k for k in range(6) if random.Random(seed + 1000).random() < 0.3}
    model = _Sums(splits)

    def record(f):
        return _random_graph(random.Random(seed), f, loops=True, cycles=True, splits=splits)

    def run(f, outs):
        a = f.snapshot()
        plan = signature_schedule(a, split=True)
        assert plan is not None and plan.whole
        step_of: dict[int, int] = {}
        seen = []
        for s, step in enumerate(plan.steps):
            for g in step.groups:
                for src in g.inputs:
                    for part in getattr(src, "parts", (src,)) if src is not None else ():
                        assert step_of[part.sid] < s
                step_of[g.key if g.slot is None else g.slot] = s
                seen.extend(a.ids(g.key) if g.slot is None else g.nodes)
        assert sorted(int(x) for x in seen) == list(range(a.n))
        ex = Executor(a, model)
        ex.run(plan)
        return ex.output("nodes", outs, 0)

    _same_as_unfold(model, record, run)
