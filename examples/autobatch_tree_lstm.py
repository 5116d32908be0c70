"""The main job's TreeLSTM written as plain recursive eager code, batched by fold.autobatch.

    python examples/autobatch_tree_lstm.py                      # bundled synthetic treebank
    python examples/autobatch_tree_lstm.py --data path/to/sst   # SST train.txt / dev.txt / test.txt

``tree_loss`` is ordinary PyTorch for ONE tree: recursion over the tree, ``nn.Module``
calls, ``torch.cat``, ``chunk``, no batch dim and no ``fold.add``.  ``fold.autobatch`` runs
it once per tree of a batch with recording on, then runs every group of same-shaped calls
(all leaves of a level, all cells of a level, all constituent losses) as one batched call.
``@fold.batchable`` makes each cell one recorded node; without it every torch op would be
one.  The per-tree sum of constituent losses takes a list whose length differs per tree:
``@fold.batchable(batched=True)`` receives it as a ``fold.Ragged``.  The script trains on every constituent's label, reports accuracy, and times the same
function run eagerly per tree.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import fold
from fold.treebank import Tree, Vocab, bundled_treebank, load_treebank


class TreeLSTM(nn.Module):
    """Binary TreeLSTM (Tai et al.), written for one example: states are (hidden,)."""

    def __init__(self, vocab_size: int, hidden: int, classes: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.leaf_gates = nn.Linear(hidden, 3 * hidden)
        self.node_gates = nn.Linear(2 * hidden, 5 * hidden)
        self.out = nn.Linear(hidden, classes)

    @fold.batchable
    def leaf(self, word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i, o, u = self.leaf_gates(self.embed(word)).chunk(3)
        c = torch.sigmoid(i) * torch.tanh(u)
        return torch.sigmoid(o) * torch.tanh(c), c

    @fold.batchable
    def node(
        self, lh: torch.Tensor, lc: torch.Tensor, rh: torch.Tensor, rc: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        i, o, u, fl, fr = self.node_gates(torch.cat([lh, rh])).chunk(5)
        c = torch.sigmoid(i) * torch.tanh(u) + torch.sigmoid(fl) * lc + torch.sigmoid(fr) * rc
        return torch.sigmoid(o) * torch.tanh(c), c


@fold.batchable(batched=True)
def total(losses: fold.Ragged) -> torch.Tensor:
    """The sum of each tree's constituent losses.  Trees have different numbers of
    constituents, so this takes the list as a ``fold.Ragged`` (one list per tree of the
    group) and runs once for the whole batch; called on one tree it sums its list."""
    return losses.sum()


def tree_loss(model: TreeLSTM, tree: Tree) -> tuple[torch.Tensor, int, torch.Tensor]:
    """One tree: the summed loss of its constituents, their number, the root's logits."""
    losses = []

    def encode(t: Tree) -> tuple[torch.Tensor, torch.Tensor]:
        if t.is_leaf:
            h, c = model.leaf(torch.tensor(t.word))
        else:
            (lh, lc), (rh, rc) = encode(t.left), encode(t.right)
            h, c = model.node(lh, lc, rh, rc)
        losses.append(F.cross_entropy(model.out(h), torch.tensor(t.label)))
        return h, c

    h, _ = encode(tree)
    return total(losses), len(losses), model.out(h)


def autobatch_loss(model: TreeLSTM, trees: list[Tree]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean constituent loss and root logits (len(trees), classes) of a batch."""
    sums, counts, logits = fold.autobatch(lambda t: tree_loss(model, t), trees)
    return sums.sum() / counts.sum(), logits


def eager_loss(model: TreeLSTM, trees: list[Tree]) -> torch.Tensor:
    """The same function run eagerly, one tree at a time."""
    outs = [tree_loss(model, t) for t in trees]
    return torch.stack([s for s, _, _ in outs]).sum() / sum(n for _, n, _ in outs)


@torch.no_grad()
def accuracy(model: TreeLSTM, trees: list[Tree], batch: int = 256) -> float:
    correct = 0
    for i in range(0, len(trees), batch):
        part = trees[i : i + batch]
        _, logits = autobatch_loss(model, part)
        correct += (logits.argmax(1) == torch.tensor([t.label for t in part])).sum().item()
    return correct / len(trees)


def trees_per_second(model: TreeLSTM, trees: list[Tree], batch: int, loss_fn) -> float:
    """Training throughput (forward + backward), the median of 3 passes over ``trees``."""
    rates = []
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(0, len(trees), batch):
            model.zero_grad()
            loss_fn(model, trees[i : i + batch]).backward()
        rates.append(len(trees) / (time.perf_counter() - t0))
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--data", help="directory with SST train/dev/test .txt (default: bundled)")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=25)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.003)
    ap.add_argument("--train-size", type=int, default=0, help="use this many trees (0: all)")
    ap.add_argument("--speed-trees", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    bank = load_treebank(args.data) if args.data else bundled_treebank()
    vocab = Vocab.from_trees(bank["train"])
    data = {k: [vocab.numericalize(t) for t in v] for k, v in bank.items()}
    train = data["train"][: args.train_size or None]
    print(f"treebank: {', '.join(f'{k} {len(v)}' for k, v in data.items())} trees")

    model = TreeLSTM(len(vocab), args.hidden)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    for epoch in range(1, args.epochs + 1):
        rng.shuffle(train)
        total, steps = 0.0, 0
        for i in tqdm(range(0, len(train), args.batch), desc=f"epoch {epoch}", leave=False):
            loss, _ = autobatch_loss(model, train[i : i + args.batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, steps = total + loss.item(), steps + 1
        print(
            f"epoch {epoch}: train loss {total / steps:.3f}, "
            f"dev accuracy {accuracy(model, data['dev']):.1%}"
        )
    print(f"test accuracy (root label, 5 classes): {accuracy(model, data['test']):.1%}")

    timed = train[: args.speed_trees]
    eager = trees_per_second(model, timed, args.batch, eager_loss)
    auto = trees_per_second(model, timed, args.batch, lambda m, ts: autobatch_loss(m, ts)[0])
    print(
        f"training speed on {len(timed)} trees, batch {args.batch}: eager {eager:.0f} trees/s, "
        f"autobatch {auto:.0f} trees/s ({auto / eager:.1f}x; medians of 3, "
        f"{args.threads} thread(s))"
    )


if __name__ == "__main__":
    main()
