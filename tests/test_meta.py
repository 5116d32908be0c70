"""No host syncs, proved without a GPU: everything runs with the model on the ``meta`` device.

A meta tensor has shapes and dtypes but no data, so any read of a device value on the host
(``.item()``, ``bool(t)``, ``.tolist()``, a data-dependent shape) raises.  A pass shows that
``apply``, backward, memory-limited chunking, a BatchModule apply and the per-model optimizer
steps decide everything from host-side bookkeeping, as they must to run without syncs on a GPU.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import fold
import fold.optim
from fold.batched_ops import BatchModule, batch_loss
from fold.models import MLP, TreeLSTM, record_tree
from fold.treebank import random_tree

META = torch.device("meta")


def trees(n: int = 8) -> list:
    rng = random.Random(0)
    out = [random_tree(rng, rng.randint(1, 9), 30) for _ in range(n)]
    for i, t in enumerate(out):
        t.label = i % 5
    return out


@pytest.mark.parametrize(
    "strategy, limits",
    [
        ("depth", {}),
        ("agenda", {}),
        ("depth", {"max_rows": 3}),
        ("depth", {"max_rows": {"node": 2}}),
        ("depth", {"max_bytes": 2048}),
    ],
)
def test_tree_apply_and_backward_on_meta(strategy: str, limits: dict) -> None:
    model = TreeLSTM(30, 8).to(META)
    data = trees()
    f = fold.Fold(strategy=strategy)
    roots = [record_tree(f, t) for t in data]
    h, y = f.apply(model, [roots, torch.tensor([t.label for t in data])], **limits)
    assert h.device == META and h.shape == (len(data), 8)
    assert y.device == META and y.dtype == torch.long
    model.loss(h, y).backward()
    assert all(p.grad is not None and p.grad.device == META for p in model.parameters())


def test_per_sample_loop_on_meta() -> None:
    """The chain path: one op per sample on literal images, then a per-sample loss."""

    class Loop(MLP):
        def loss(self, logits, label):
            return F.cross_entropy(logits, label, reduction="none")

    model = Loop(16).to(META)
    f = fold.Fold()
    images = [torch.randn(1, 16) for _ in range(5)]
    losses = [f.add("loss", f.add("forward", x), i % 3) for i, x in enumerate(images)]
    (out,) = f.apply(model, [losses])
    assert out.device == META and out.shape == (5,)
    out.mean().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("chunk", [None, 1, 2])
def test_batch_module_apply_and_optimizer_steps_on_meta(chunk: int | None) -> None:
    n = 3
    bm = BatchModule.from_modules([TreeLSTM(30, 8) for _ in range(n)]).to(META)
    bm.chunk_size = chunk
    data = trees()
    f = fold.Fold()
    roots = [record_tree(f, t) for t in data]
    h, y = f.apply(bm, [roots, [t.label for t in data]])
    assert h.shape == (n, len(data), 8) and h.device == META
    losses = batch_loss(bm.method("classify")(h), y.expand(n, -1), F.cross_entropy)
    losses.sum().backward()
    norms = fold.optim.clip_grad_norm_(bm.parameters(), [1.0, 2.0, 3.0])
    assert norms.shape == (n,)
    for opt in (
        fold.optim.SGD(bm.parameters(), lr=[0.1, 0.2, 0.3], momentum=0.9, nesterov=True),
        fold.optim.Adam(bm.parameters(), lr=1e-3),
        fold.optim.AdamW(bm.parameters(), lr=1e-3, weight_decay=[0.0, 0.1, 0.2]),
    ):
        opt.freeze(1)
        opt.step()
        opt.step()
        assert all(p.device == META for p in bm.parameters())
