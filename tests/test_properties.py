"""Property test: random DAGs of random ops, Fold against Unfold, values and gradients."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import fold

W = 4  # the width of the values; "widen" makes 2 * W


class Ops(nn.Module):
    """Row-wise ops of arities 1-3, one with two outputs, leaves of every argument kind."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.table = nn.Parameter(torch.randn(7, W, generator=g, dtype=torch.double))
        self.proj = nn.Parameter(torch.randn(W, W, generator=g, dtype=torch.double) / 2)
        self.proj4 = nn.Parameter(torch.randn(4, W, generator=g, dtype=torch.double) / 2)

    # leaves
    def embed(self, i: torch.Tensor) -> torch.Tensor:  # int leaf
        return self.table[i]

    def image(self, x: torch.Tensor) -> torch.Tensor:  # tensor leaf, (1, W) or (1, 2, 2)
        return x.reshape(len(x), -1) @ self.proj4 if x.dim() == 3 else x @ self.proj

    # arity 1
    def squash(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * 1.5

    def norm(self, x: torch.Tensor) -> torch.Tensor:  # any width: shapes differ at run time
        return x / (1 + x.pow(2).sum(1, keepdim=True))

    def widen(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x.sin()], 1)

    def fork(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x @ self.proj, x.cos()

    # arity 2 and 3
    def mul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * b

    def scale(self, a: torch.Tensor, s: torch.Tensor) -> torch.Tensor:  # float or bool leaf
        return a * (s.double() + 0.5).unsqueeze(1)

    def mix(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return a * b + c

    def summary(self, a: torch.Tensor) -> torch.Tensor:  # nobatch: whole (k, W) -> (1, W)
        return a.sum(0, keepdim=True) * 0.3

    def attend(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return x + table.sum(0) * x.mean(1, keepdim=True)


LEAF_SHAPES = [(1, W), (1, 2, 2)]


@st.composite
def programs(draw: Any) -> list[tuple[Any, ...]]:
    """A list of instructions; each value is (index, width). Later ones use earlier values."""
    n = draw(st.integers(3, 25))
    prog: list[tuple[Any, ...]] = []
    widths: list[int] = []  # width of each value produced so far
    for _ in range(n):
        choices = ["embed", "image"] + (
            ["unary", "fork", "mul", "scale", "mix", "nobatch"] if widths else []
        )
        kind = draw(st.sampled_from(choices))
        pick = st.integers(0, max(len(widths) - 1, 0))
        if kind == "embed":
            prog.append(("embed", draw(st.integers(0, 6))))
            widths.append(W)
        elif kind == "image":
            shape = draw(st.sampled_from(LEAF_SHAPES))
            prog.append(("image", shape, draw(st.integers(0, 2))))
            widths.append(W)
        elif kind == "unary":
            i = draw(pick)
            op = draw(
                st.sampled_from(
                    ["squash", "norm", "widen"] if widths[i] == W else ["squash", "norm"]
                )
            )
            prog.append((op, i))
            widths.append(2 * widths[i] if op == "widen" else widths[i])
        elif kind == "fork":
            i = draw(pick)
            if widths[i] != W:
                continue
            prog.append(("fork", i))
            widths += [W, W]
        elif kind == "scale":
            i = draw(pick)
            s = draw(st.one_of(st.floats(-2, 2, allow_nan=False), st.booleans()))
            prog.append(("scale", i, s))
            widths.append(widths[i])
        elif kind in ("mul", "mix"):
            i = draw(pick)
            same = [j for j, w in enumerate(widths) if w == widths[i]]
            others = [draw(st.sampled_from(same)) for _ in range(1 if kind == "mul" else 2)]
            prog.append((kind, i, *others))
            widths.append(widths[i])
        else:  # a nobatch summary of some same-width values, attended to by others
            i = draw(pick)
            if widths[i] != W:
                continue
            users = draw(
                st.lists(
                    st.sampled_from([j for j, w in enumerate(widths) if w == W]),
                    min_size=1,
                    max_size=3,
                )
            )
            prog.append(("nobatch", i, tuple(users)))
            widths += [W] * len(users)
    return prog


def record(rec: Any, op: str, outputs: int | None, *args: Any) -> Any:
    """``rec.add(op, *args)`` (split into ``outputs``), or on a Fold every other time the
    bound recorder ``rec.op(op, outputs)``: both must record the same nodes."""
    if isinstance(rec, fold.Fold) and len(rec) % 2:
        return rec.op(op, outputs)(*args)
    node = rec.add(op, *args)
    return node if outputs is None else node.split(outputs)


def replay(
    rec: Any,
    prog: list[tuple[Any, ...]],
    leaves: dict[tuple[Any, ...], torch.Tensor],
    shift: int = 0,
) -> list[Any]:
    """Record ``prog`` into a Fold or an Unfold; returns the handle of every value.
    ``shift`` offsets the embedding ids (another sample of the same program)."""
    vals: list[Any] = []
    for ins in prog:
        op = ins[0]
        if op == "embed":
            vals.append(rec.add("embed", (ins[1] + shift) % 7))
        elif op == "image":
            vals.append(rec.add("image", leaves[ins[1], ins[2]]))
        elif op in ("squash", "norm", "widen"):
            vals.append(rec.add(op, vals[ins[1]]))
        elif op == "fork":
            vals.extend(record(rec, "fork", 2, vals[ins[1]]))
        elif op == "scale":
            vals.append(record(rec, "scale", None, vals[ins[1]], ins[2]))
        elif op in ("mul", "mix"):
            vals.append(record(rec, op, None, *(vals[i] for i in ins[1:])))
        else:
            table = rec.add("summary", vals[ins[1]]).nobatch()
            vals.extend(rec.add("attend", vals[u], table) for u in ins[2])
    return vals


def run(
    rec: Any,
    model: Ops,
    prog: list[tuple[Any, ...]],
    leaves: dict[Any, torch.Tensor],
    widths: list[int],
):
    vals = replay(rec, prog, leaves)
    lists = [[v for v, w in zip(vals, widths) if w == width] for width in sorted(set(widths))]
    outs = rec.apply(model, lists)
    loss = sum(
        (o * torch.linspace(-1, 1, o.numel(), dtype=torch.double).view_as(o)).sum() for o in outs
    )
    for p in model.parameters():
        p.grad = None
    for t in leaves.values():
        t.grad = None
    loss.backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    grads += [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves.values()]
    return outs, grads


def widths_of(prog: list[tuple[Any, ...]], leaves: dict[Any, torch.Tensor]) -> list[int]:
    """The width of every value, by running the program eagerly."""
    u = fold.Unfold(Ops())
    return [h.get().shape[1] for h in replay(u, prog, leaves)]


def _leaves(seed: int) -> dict[Any, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        (shape, k): torch.randn(*shape, generator=g, dtype=torch.double, requires_grad=True)
        for shape in LEAF_SHAPES
        for k in range(3)
    }


def assert_same(folded: Any, unfolded: Any) -> None:
    """(outputs, gradients) of a Fold run equal to those of its Unfold run."""
    (f_out, f_grads), (u_out, u_grads) = folded, unfolded
    assert len(f_out) == len(u_out)
    for a, b in zip(f_out, u_out):
        torch.testing.assert_close(a, b)
    for a, b in zip(f_grads, u_grads):
        torch.testing.assert_close(a, b)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(), st.sampled_from(["depth", "agenda", "lockstep"]))
def test_random_dags_fold_equals_unfold(prog: list[tuple[Any, ...]], strategy: str) -> None:
    leaves = _leaves(1)
    model = Ops()
    widths = widths_of(prog, leaves)
    assert_same(
        run(fold.Fold(strategy), model, prog, leaves, widths),
        run(fold.Unfold(model), model, prog, leaves, widths),
    )


def run_samples(
    rec: Any,
    model: Ops,
    prog: list[tuple[Any, ...]],
    leaves: list[dict[Any, Any]],
    order: list[int],
):
    """Record ``prog`` once per sample (its own leaves and embedding ids), then apply with
    one list per value of the program: that value of every sample, in ``order``."""
    per_sample = [replay(rec, prog, leaves[s], shift=s) for s in range(len(leaves))]
    lists = [[per_sample[s][v] for s in order] for v in range(len(per_sample[0]))]
    outs = rec.apply(model, lists)
    loss = sum(
        (o * torch.linspace(-1, 1, o.numel(), dtype=torch.double).view_as(o)).sum() for o in outs
    )
    params = list(model.parameters()) + [t for d in leaves for t in d.values()]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return outs, [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(), st.integers(1, 5), st.sampled_from(["in order", "reversed", "first only"]))
def test_per_sample_programs_fold_equals_unfold(
    prog: list[tuple[Any, ...]], samples: int, order_kind: str
) -> None:
    """The same random program recorded once per sample (a per-sample loop): every op a group
    of one node per sample, the case the chain path of ``apply`` takes when the output lists
    name the samples in order, and the general executor otherwise."""
    leaves = [_leaves(10 + s) for s in range(samples)]
    order = {
        "in order": list(range(samples)),
        "reversed": list(range(samples))[::-1],
        "first only": [0],
    }[order_kind]
    model = Ops()
    assert_same(
        run_samples(fold.Fold(), model, prog, leaves, order),
        run_samples(fold.Unfold(model), model, prog, leaves, order),
    )


def _plan_rows(plan: Any) -> list[tuple[Any, list[int]]]:
    return [(g.key, [int(n) for n in g.nodes]) for s in plan.steps for g in s.groups]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(), st.integers(1, 40))
def test_agenda_implementations_plan_alike(prog: list[tuple[Any, ...]], samples: int) -> None:
    """The agenda's array implementation (wide graphs) makes the plan of its per-node one,
    on random programs recorded once per sample: nobatch keys, splits, an argument node read
    at two positions, signatures at many depths."""
    from fold.scheduler.agenda import _agenda_arrays, _agenda_nodes

    f = fold.Fold("agenda")
    leaves = _leaves(3)
    for s in range(samples):
        replay(f, prog, leaves, shift=s)
    a = f.snapshot()
    assert _plan_rows(_agenda_arrays(a)) == _plan_rows(_agenda_nodes(a))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-(2**62), 2**62) | st.integers(0, 5), max_size=60))
def test_distinct_is_numpy_unique(values: list[int]) -> None:
    """fold.arrays.distinct (graph edges, value-table classes) against np.unique."""
    import numpy as np

    from fold.arrays import distinct

    x = np.array(values, dtype=np.int64)
    got = distinct(x)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, np.unique(x))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([1, 2, 255, 256, 257, 65536, 65537, 2**40]), st.data())
def test_stable_order_is_a_stable_argsort(bound: int, data: st.DataObject) -> None:
    """fold.arrays.stable_order (the schedulers' sorts, narrowed to radix-sorted dtypes)."""
    import numpy as np

    from fold.arrays import stable_order

    values = data.draw(st.lists(st.integers(0, bound - 1) | st.integers(0, 3), max_size=80))
    x = np.array(values, dtype=np.int64)
    np.testing.assert_array_equal(stable_order(x, bound), np.argsort(x, kind="stable"))
