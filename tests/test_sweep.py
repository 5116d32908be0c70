"""N models in one fold: ``Fold.apply(BatchModule, lists)`` against N separate folds."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fold
from fold.batched_ops import BatchModule
from fold.models import TreeLSTM, record_tree
from fold.treebank import random_tree

N = 3


def trees(n: int = 12, seed: int = 0) -> list:
    rng = random.Random(seed)
    return [random_tree(rng, rng.randint(1, 9), 50) for _ in range(n)]


def record(ts) -> tuple[fold.Fold, list[fold.Node]]:
    f = fold.Fold()
    return f, [record_tree(f, t) for t in ts]


# None: the default (one model per pass on a CPU), 2: chunks of 2 and 1, N: all at once.
CHUNKS = pytest.mark.parametrize(
    "chunk", [None, 2, N], ids=["default", "chunks-of-2", "all-at-once"]
)


@CHUNKS
def test_n_tree_lstms_in_one_fold_equal_n_separate_folds(chunk) -> None:
    torch.manual_seed(0)
    models = [TreeLSTM(50, 8).double() for _ in range(N)]
    bm = BatchModule.from_modules(copy.deepcopy(models))
    bm.chunk_size = chunk
    ts = trees()
    labels = [t.word % 5 if t.word is not None else 2 for t in ts]
    f, roots = record(ts)
    h, y = f.apply(bm, [roots, labels])
    assert h.shape == (N, len(ts), 8) and y.shape == (len(ts),)
    logits = bm.method("classify")(h)
    losses = torch.stack([F.cross_entropy(logits[i], y) for i in range(N)])
    losses.sum().backward()
    for i, m in enumerate(models):
        g, r = record(ts)
        (hi,) = g.apply(m, [r])
        F.cross_entropy(m.classify(hi), y).backward()
        torch.testing.assert_close(h[i], hi)
        mine = bm.grads_of(i)
        for name, p in m.named_parameters():
            torch.testing.assert_close(
                mine[name], p.grad, msg=lambda s, name=name, i=i: f"model {i} {name}: {s}"
            )


@CHUNKS
def test_backprop_through_one_model_leaves_the_others_untouched(chunk) -> None:
    bm = BatchModule.from_modules([TreeLSTM(50, 8).double() for _ in range(N)])
    bm.chunk_size = chunk
    f, roots = record(trees(8, seed=1))
    (h,) = f.apply(bm, [roots])
    h[1].pow(2).sum().backward()
    used = [(name, p) for name, p in bm.named_parameters() if p.grad is not None]
    assert len(used) == 5  # embedding, leaf gates (2), node gates (2); the classifier is unused
    for name, p in used:
        assert torch.count_nonzero(p.grad[0]) == 0 and torch.count_nonzero(p.grad[2]) == 0, name
    assert all(torch.count_nonzero(p.grad[1]) for _, p in used)


def test_per_sample_tensors_and_shadowed_op_names_with_a_batch_module() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 4, dtype=torch.double)  # .double() would call children()

        def children(self, x):  # the SPINN name: resolved to this method, not nn.Module's
            return torch.tanh(self.lin(x.view(-1, 6)))

    with pytest.warns(UserWarning, match="shadows nn.Module.children"):
        bm = BatchModule.from_modules([Net() for _ in range(N)])
    xs = [torch.randn(1, 2, 3, dtype=torch.double) for _ in range(5)]
    f = fold.Fold()
    (out,) = f.apply(bm, [[f.add("children", x) for x in xs]])
    for i in range(N):
        ref = bm.unbatch(i)
        torch.testing.assert_close(out[i], torch.cat([type(ref).children(ref, x) for x in xs]))


@CHUNKS
def test_bootstrap_ensemble_by_per_model_weights(chunk) -> None:
    """Model i's own sample of the trees: record the union once, weight each model's loss
    by how often its bootstrap sample drew each tree (the documented recipe)."""
    torch.manual_seed(0)
    ts = trees(10, seed=3)
    labels = torch.tensor([i % 5 for i in range(len(ts))])
    rng = random.Random(0)
    draws = [[rng.randrange(len(ts)) for _ in ts] for _ in range(N)]
    counts = torch.zeros(N, len(ts), dtype=torch.double)
    for i, d in enumerate(draws):
        for j in d:
            counts[i, j] += 1
    models = [TreeLSTM(50, 8).double() for _ in range(N)]
    bm = BatchModule.from_modules(copy.deepcopy(models))
    bm.chunk_size = chunk
    f, roots = record(ts)
    (h,) = f.apply(bm, [roots])
    per_tree = F.cross_entropy(
        bm.method("classify")(h).flatten(0, 1), labels.repeat(N), reduction="none"
    )
    losses = (per_tree.view(N, -1) * counts).sum(1) / counts.sum(1)
    losses.sum().backward()
    for i, m in enumerate(models):  # reference: model i on its own bootstrap sample
        sample = [ts[j] for j in draws[i]]
        g, r = record(sample)
        (hi,) = g.apply(m, [r])
        F.cross_entropy(m.classify(hi), labels[draws[i]]).backward()
        mine = bm.grads_of(i)
        for name, p in m.named_parameters():
            torch.testing.assert_close(mine[name], p.grad)


def test_nobatch_with_several_models_is_refused() -> None:
    bm = BatchModule(TreeLSTM(50, 4), batch=2)
    f = fold.Fold()
    h, _ = f.add("leaf", 3).nobatch().split(2)
    with pytest.raises(
        fold.FoldError, match="nobatch nodes are not supported with a BatchModule yet"
    ):
        f.apply(bm, [[h]])
