"""Reference models written the fold way: per-example ops that batch along dim 0.

:class:`TreeLSTM` is the binary N-ary TreeLSTM of Tai et al. (2015) used by the examples and
benchmarks; :class:`ChildSumTreeLSTM` their child-sum TreeLSTM over dependency trees (any
number of children, a ``fold.Ragged`` list argument); :class:`MLP` the per-sample image
classifier of the MNIST example, benchmark and tests; :class:`GraphNet` a message-passing
network over small graphs (a node's neighbours are a list argument).  Its ops are ``leaf`` and ``node`` (not ``children``, which would
shadow ``nn.Module.children`` and break ``.to()``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from fold.graph import Fold
from fold.node import Node
from fold.ragged import Ragged
from fold.treebank import DepTree, Tree
from fold.unfold import Unfold

Graph = tuple[list[int], list[list[int]]]
"""A graph for :class:`GraphNet`: each node's type id, and each node's in-neighbours (the
nodes whose messages it receives), by index."""

__all__ = [
    "MLP",
    "ChildSumTreeLSTM",
    "Graph",
    "GraphNet",
    "TreeLSTM",
    "record_dep_tree",
    "record_graph",
    "record_tree",
]


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


class ChildSumTreeLSTM(nn.Module):
    """Child-sum TreeLSTM (Tai et al. 2015) over dependency trees: a node's input is its word,
    its children are a list of any length (0 for a leaf), with one forget gate per child.

    A node's state is one tensor ``(n, 2 * hidden)``, ``h`` then ``c``, so the children are
    one list argument.  ``node(word, children)`` takes the children as a :class:`fold.Ragged`
    (what fold passes for a list of nodes); ``node_fixed(word, *children)`` takes them as
    separate arguments (what per-example code and fold without list arguments use: fold groups
    it per child count).  Both compute the same values.

    Example::

        model = ChildSumTreeLSTM(vocab_size=100, hidden=32, classes=5)
        f = fold.Fold()
        roots = [record_dep_tree(f, t)[-1] for t in trees]   # DepTrees with integer words
        (state,) = f.apply(model, [roots])                   # (len(trees), 64): h, c
        logits = model.classify(state)
    """

    def __init__(
        self, vocab_size: int, hidden: int, classes: int = 5, embed_dim: int | None = None
    ) -> None:
        super().__init__()
        embed_dim = embed_dim or hidden
        self.hidden = hidden
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.word_gates = nn.Linear(embed_dim, 4 * hidden)  # i, o, u and f from the word
        self.iou_from_children = nn.Linear(hidden, 3 * hidden, bias=False)
        self.forget_from_child = nn.Linear(hidden, hidden, bias=False)
        self.out = nn.Linear(hidden, classes)

    def _combine(self, x: torch.Tensor, hsum: torch.Tensor, fc: torch.Tensor) -> torch.Tensor:
        i, o, u = (x[:, : 3 * self.hidden] + self.iou_from_children(hsum)).chunk(3, 1)
        c = torch.sigmoid(i) * torch.tanh(u) + fc
        return torch.cat([torch.sigmoid(o) * torch.tanh(c), c], 1)

    def node(self, word: torch.Tensor, children: Ragged) -> torch.Tensor:
        """(n,) word ids and n lists of child states -> (n, 2 * hidden) states."""
        x = self.word_gates(self.embed(word))
        hid = self.hidden
        if not children.values.shape[0]:  # every node of the group is a leaf
            zero = x.new_zeros(x.shape[0], hid)
            return self._combine(x, zero, zero)
        h, c = children.values.split(hid, 1)
        f = torch.sigmoid(
            x[:, 3 * hid :].index_select(0, children.segment_ids) + self.forget_from_child(h)
        )
        fc = children.with_values(f * c).sum()
        return self._combine(x, children.with_values(h).sum(), fc)

    def node_fixed(self, word: torch.Tensor, *children: torch.Tensor) -> torch.Tensor:
        """(n,) word ids and k child states, each (n, 2 * hidden) -> (n, 2 * hidden)."""
        x = self.word_gates(self.embed(word))
        hid = self.hidden
        if not children:
            zero = x.new_zeros(x.shape[0], hid)
            return self._combine(x, zero, zero)
        h, c = torch.stack(children, 1).split(hid, 2)  # (n, k, hidden) each
        f = torch.sigmoid(x[:, None, 3 * hid :] + self.forget_from_child(h))
        return self._combine(x, h.sum(1), (f * c).sum(1))

    def classify(self, state: torch.Tensor) -> torch.Tensor:
        """(n, 2 * hidden) states -> (n, classes) logits, from ``h``."""
        return self.out(state[:, : self.hidden])

    def encode(self, tree: DepTree) -> list[torch.Tensor]:
        """Eager reference: every node's state ``(1, 2 * hidden)``, children before parents
        (the root's last), computed node by node with ``node_fixed``."""
        dev = self.embed.weight.device
        states: dict[int, torch.Tensor] = {}
        out = []
        for t in tree.postorder():
            word = torch.tensor([t.word], device=dev)
            s = self.node_fixed(word, *[states[id(ch)] for ch in t.children])
            states[id(t)] = s
            out.append(s)
        return out


def record_dep_tree(f: Fold | Unfold, tree: DepTree, ragged: bool = True) -> list[Node]:
    """Record a dependency tree with a :class:`ChildSumTreeLSTM`'s ops; returns every node's
    state, children before parents (the root's last).

    ``ragged=True`` records ``node(word, [children])``, one op whatever the child count;
    ``ragged=False`` records ``node_fixed(word, *children)`` (fold then groups per count).
    """
    states: dict[int, Node] = {}
    out = []
    add = f.add
    for t in tree.postorder():
        kids = [states[id(ch)] for ch in t.children]
        s = add("node", t.word, kids) if ragged else add("node_fixed", t.word, *kids)
        states[id(t)] = s
        out.append(s)
    return out


class GraphNet(nn.Module):
    """Message passing over a graph, then a graph-level classifier.

    Each round, every node sends ``message(h)`` and takes ``update(h, messages)``, a GRU cell
    on the sum of its in-neighbours' messages (a list argument of any length); ``readout``
    sums a graph's final node states and classifies.  ``update_fixed(h, *messages)`` is the
    same update with the messages as separate arguments (per-example code, and fold without
    list arguments).

    Example::

        model = GraphNet(types=10, hidden=64, classes=2)
        f = fold.Fold()
        outs = [f.add("readout", record_graph(f, g, rounds=3)) for g in graphs]
        (logits,) = f.apply(model, [outs])                   # (len(graphs), 2)
    """

    def __init__(self, types: int, hidden: int, classes: int = 2) -> None:
        super().__init__()
        self.hidden = hidden
        self.embed = nn.Embedding(types, hidden)
        self.msg = nn.Linear(hidden, hidden)
        self.cell = nn.GRUCell(hidden, hidden)
        self.out = nn.Linear(hidden, classes)

    def start(self, kind: torch.Tensor) -> torch.Tensor:
        """(n,) node types -> (n, hidden) initial states."""
        return self.embed(kind)

    def message(self, h: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.msg(h))

    def update(self, h: torch.Tensor, messages: Ragged) -> torch.Tensor:
        """(n, hidden) states and n lists of messages -> (n, hidden) new states."""
        return self.cell(messages.sum(feature=(self.hidden,), dtype=h.dtype), h)

    def update_fixed(self, h: torch.Tensor, *messages: torch.Tensor) -> torch.Tensor:
        total = torch.stack(messages).sum(0) if messages else torch.zeros_like(h)
        return self.cell(total, h)

    def readout(self, states: Ragged) -> torch.Tensor:
        """n lists of node states -> (n, classes) logits, from each list's sum."""
        return self.out(states.sum(feature=(self.hidden,), dtype=self.out.weight.dtype))

    def encode(self, graph: Graph, rounds: int) -> torch.Tensor:
        """Eager reference: the (1, classes) logits of one graph, node by node."""
        kinds, neighbours = graph
        dev = self.embed.weight.device
        h = [self.start(torch.tensor([k], device=dev)) for k in kinds]
        for _ in range(rounds):
            m = [self.message(x) for x in h]
            h = [self.update_fixed(x, *[m[u] for u in nb]) for x, nb in zip(h, neighbours)]
        return self.out(torch.stack(h).sum(0))


def record_graph(f: Fold | Unfold, graph: Graph, rounds: int, ragged: bool = True) -> list[Node]:
    """Record ``rounds`` of :class:`GraphNet` message passing; returns the final node states.

    ``ragged=True`` records ``update(h, [messages])``; ``ragged=False`` records
    ``update_fixed(h, *messages)`` (fold then groups per in-degree).  Records through
    :meth:`Fold.op` recorders (no op lookup per node); an :class:`Unfold` through ``add``.
    """
    kinds, neighbours = graph
    if isinstance(f, Fold):
        start, message, update = f.op("start"), f.op("message"), f.op("update")
        update_fixed = f.op("update_fixed")
    else:
        start, message, update, update_fixed = (
            functools.partial(f.add, op) for op in ("start", "message", "update", "update_fixed")
        )
    h = [start(k) for k in kinds]
    for _ in range(rounds):
        m = [message(x) for x in h]
        if ragged:
            h = [update(x, [m[u] for u in nb]) for x, nb in zip(h, neighbours)]
        else:
            h = [update_fixed(x, *[m[u] for u in nb]) for x, nb in zip(h, neighbours)]
    return h
