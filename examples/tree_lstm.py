"""Train a TreeLSTM sentiment classifier with fold, and compare its speed with eager PyTorch.

    python examples/tree_lstm.py                      # bundled synthetic treebank, ~1 minute
    python examples/tree_lstm.py --data path/to/sst   # SST train.txt / dev.txt / test.txt

Each tree is written per example: a ``leaf`` op per word and a ``node`` op per constituent.
fold records all the trees of a batch into one graph and runs it with one batched call per
tree level; every constituent's label is a training target, as in SST.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import fold
from fold.models import TreeLSTM
from fold.treebank import Tree, Vocab, bundled_treebank, load_treebank


def record(f: fold.Fold, tree: Tree, states: list[fold.Node], labels: list[int]) -> None:
    """Record one tree; append the ``h`` of every constituent and its label."""
    stack = []
    for t in tree.postorder():
        if t.is_leaf:
            h, c = f.add("leaf", t.word).split(2)
        else:
            rh, rc = stack.pop()
            lh, lc = stack.pop()
            h, c = f.add("node", lh, lc, rh, rc).split(2)
        stack.append((h, c))
        states.append(h)
        labels.append(t.label)


def fold_batch(
    model: TreeLSTM, trees: list[Tree]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Loss over all constituents, and root logits/labels, for a batch of trees."""
    f = fold.Fold()
    states: list[fold.Node] = []
    labels: list[int] = []
    roots: list[fold.Node] = []
    for t in trees:
        record(f, t, states, labels)
        roots.append(states[-1])
    h, y, root_h = f.apply(model, [states, labels, roots])
    return (
        F.cross_entropy(model.classify(h), y),
        model.classify(root_h),
        torch.tensor([t.label for t in trees]),
    )


def eager_batch(model: TreeLSTM, trees: list[Tree]) -> torch.Tensor:
    """The same loss, computed the usual way: one tree, one node at a time."""
    logits, labels = [], []
    for tree in trees:
        stack = []
        for t in tree.postorder():
            if t.is_leaf:
                h, c = model.leaf(torch.tensor([t.word]))
            else:
                rh, rc = stack.pop()
                lh, lc = stack.pop()
                h, c = model.node(lh, lc, rh, rc)
            stack.append((h, c))
            logits.append(model.classify(h))
            labels.append(t.label)
    return F.cross_entropy(torch.cat(logits), torch.tensor(labels))


@torch.no_grad()
def accuracy(model: TreeLSTM, trees: list[Tree], batch: int = 256) -> float:
    correct = 0
    for i in range(0, len(trees), batch):
        _, logits, y = fold_batch(model, trees[i : i + batch])
        correct += (logits.argmax(1) == y).sum().item()
    return correct / len(trees)


def trees_per_second(
    model: TreeLSTM, trees: list[Tree], batch: int, step, repeats: int = 3
) -> float:
    """Training throughput, the median of ``repeats`` passes over ``trees``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: time the work, keep the weights
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(0, len(trees), batch):
            opt.zero_grad()
            step(model, trees[i : i + batch]).backward()
            opt.step()
        rates.append(len(trees) / (time.perf_counter() - t0))
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--data", help="directory with SST train.txt/dev.txt/test.txt (default: bundled)"
    )
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch", type=int, default=25)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.003)
    ap.add_argument(
        "--train-size", type=int, default=0, help="use only this many training trees (0: all)"
    )
    ap.add_argument(
        "--speed-trees", type=int, default=200, help="trees timed for the fold-vs-eager speed"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: speed figures that hold on a busy machine)",
    )
    ap.add_argument("--save", type=Path, help="write the trained weights here (torch.save)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    bank = load_treebank(args.data) if args.data else bundled_treebank()
    vocab = Vocab.from_trees(bank["train"])
    data = {k: [vocab.numericalize(t) for t in v] for k, v in bank.items()}
    train = data["train"][: args.train_size or None]
    print(
        f"treebank: {', '.join(f'{k} {len(v)}' for k, v in data.items())} trees, vocabulary {len(vocab)}"
    )

    model = TreeLSTM(len(vocab), args.hidden, classes=5)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    print(f"dev accuracy before training: {accuracy(model, data['dev']):.1%}")
    for epoch in range(1, args.epochs + 1):
        rng.shuffle(train)
        bar = tqdm(
            range(0, len(train), args.batch), desc=f"epoch {epoch}/{args.epochs}", leave=False
        )
        total = 0.0
        for n, i in enumerate(bar, 1):
            loss, _, _ = fold_batch(model, train[i : i + args.batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
            bar.set_postfix(loss=f"{total / n:.3f}")
        print(
            f"epoch {epoch}: train loss {total / n:.3f}, dev accuracy {accuracy(model, data['dev']):.1%}"
        )
    print(f"test accuracy (root label, 5 classes): {accuracy(model, data['test']):.1%}")
    if args.save:
        torch.save(model.state_dict(), args.save)
        print(f"saved the weights to {args.save}")

    timed = train[: args.speed_trees]
    eager = trees_per_second(model, timed, args.batch, eager_batch)
    batched = trees_per_second(model, timed, args.batch, lambda m, ts: fold_batch(m, ts)[0])
    print(
        f"training speed on {len(timed)} trees, batch {args.batch}: eager {eager:.0f} trees/s, "
        f"fold {batched:.0f} trees/s ({batched / eager:.1f}x; medians of 3, {args.threads} "
        f"thread{'s' if args.threads > 1 else ''})"
    )


if __name__ == "__main__":
    main()
