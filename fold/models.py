"""Reference models written the fold way: per-example ops that batch along dim 0.

:class:`TreeLSTM` is the binary Child-Sum/N-ary TreeLSTM of Tai et al. (2015) used by the
examples and benchmarks; :class:`MLP` the per-sample image classifier of the MNIST example,
benchmark and tests.  Its ops are ``leaf`` and ``node`` (not ``children``, which would
shadow ``nn.Module.children`` and break ``.to()``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fold.graph import Fold
from fold.node import Node
from fold.treebank import Tree
from fold.unfold import Unfold

__all__ = ["MLP", "TreeLSTM", "record_tree"]


class MLP(nn.Module):
    """A ``pixels``-200-100-10 ReLU classifier whose ``forward`` takes images of any shape
    with ``pixels`` values each (a (1, 28, 28) image per sample, or a batch of them)."""

    def __init__(self, pixels: int = 784) -> None:
        super().__init__()
        self.pixels = pixels
        self.lin1 = nn.Linear(pixels, 200)
        self.lin2 = nn.Linear(200, 100)
        self.logits = nn.Linear(100, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, self.pixels)
        return self.logits(F.relu(self.lin2(F.relu(self.lin1(x)))))


class TreeLSTM(nn.Module):
    """Binary TreeLSTM sentiment classifier.

    Example::

        model = TreeLSTM(vocab_size=100, hidden=32, classes=5)
        f = fold.Fold()
        roots = [record_tree(f, t) for t in trees]      # trees with integer leaf words
        (h,) = f.apply(model, [roots])                   # (len(trees), 32)
        logits = model.classify(h)
    """

    def __init__(
        self, vocab_size: int, hidden: int, classes: int = 5, embed_dim: int | None = None
    ) -> None:
        super().__init__()
        embed_dim = embed_dim or hidden
        self.hidden = hidden
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.leaf_gates = nn.Linear(embed_dim, 3 * hidden)
        self.node_gates = nn.Linear(2 * hidden, 5 * hidden)
        self.out = nn.Linear(hidden, classes)

    def leaf(self, word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(n,) word ids -> (h, c), each (n, hidden)."""
        i, o, u = self.leaf_gates(self.embed(word)).chunk(3, 1)
        c = torch.sigmoid(i) * torch.tanh(u)
        return torch.sigmoid(o) * torch.tanh(c), c

    def node(
        self, lh: torch.Tensor, lc: torch.Tensor, rh: torch.Tensor, rc: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Children states, each (n, hidden) -> (h, c) of the parents."""
        i, o, u, fl, fr = self.node_gates(torch.cat([lh, rh], 1)).chunk(5, 1)
        c = torch.sigmoid(i) * torch.tanh(u) + torch.sigmoid(fl) * lc + torch.sigmoid(fr) * rc
        return torch.sigmoid(o) * torch.tanh(c), c

    def classify(self, h: torch.Tensor) -> torch.Tensor:
        """(n, hidden) root states -> (n, classes) logits."""
        return self.out(h)

    def loss(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.classify(h), labels)

    def encode(self, tree: Tree) -> torch.Tensor:
        """Eager reference: the root state ``h`` (1, hidden) of one tree, computed node by node."""
        stack: list[tuple[torch.Tensor, torch.Tensor]] = []
        for t in tree.postorder():
            if t.left is None:
                stack.append(self.leaf(torch.tensor([t.word], device=self.embed.weight.device)))
            else:
                rh, rc = stack.pop()
                lh, lc = stack.pop()
                stack.append(self.node(lh, lc, rh, rc))
        return stack[0][0]


def record_tree(f: Fold | Unfold, tree: Tree) -> Node:
    """Record ``tree`` into ``f`` with ops ``leaf`` and ``node``; returns the root's ``h``.

    Uses :meth:`Fold.op` recorders (the same nodes as ``f.add(...).split(2)``, with less
    overhead per node); an :class:`Unfold` records with ``add``.
    """
    stack: list[tuple[Node, Node]] = []
    if isinstance(f, Fold):
        leaf, node = f.op("leaf", outputs=2), f.op("node", outputs=2)
    else:
        leaf = lambda w: f.add("leaf", w).split(2)  # noqa: E731
        node = lambda *a: f.add("node", *a).split(2)  # noqa: E731
    for t in tree.postorder():
        if t.left is None:
            stack.append(leaf(t.word))
        else:
            rh, rc = stack.pop()
            lh, lc = stack.pop()
            stack.append(node(lh, lc, rh, rc))
    return stack[0][0]
