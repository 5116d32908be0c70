"""Train a child-sum TreeLSTM over dependency trees with fold's list arguments.

    python examples/childsum_tree_lstm.py                          # bundled treebank, ~1 min
    python examples/childsum_tree_lstm.py --data path/to/ud        # CoNLL-U files, e.g. UD
    python examples/childsum_tree_lstm.py --data path/to/ud --label upos

Each word of a dependency tree is one ``node`` op whose children are ONE list argument of
any length (0 for a leaf): ``f.add("node", word, [child states])``.  fold records all the
trees of a batch into one graph and runs each level of all trees as one batched call, the
op receiving the children as a ``fold.Ragged`` (summed per parent with one ``index_add``).

Every word is a training target: its label classified from its subtree's state.  The
bundled treebank (``fold/data/*.conllu``, the synthetic sentiment sentences of
``examples/tree_lstm.py`` as dependency trees) labels each word with the sentiment of the
phrase it heads, so the root's label is the sentence's; a directory with ``--data`` holds
``*train*.conllu``, ``*dev*.conllu`` and ``*test*.conllu`` (Universal Dependencies' file
names match), labelled by ``--label``: a CoNLL-U column such as ``deprel`` or ``upos``, or
``misc:KEY``.
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
from fold.models import ChildSumTreeLSTM, record_dep_tree
from fold.treebank import SPLITS, DepTree, Vocab, bundled_dependency_treebank, read_conllu


def load(args: argparse.Namespace) -> dict[str, list[DepTree]]:
    """The train/dev/test trees: bundled, or the CoNLL-U files of ``--data``."""
    if not args.data:
        return bundled_dependency_treebank()
    out = {}
    for split in SPLITS:
        files = sorted(Path(args.data).glob(f"*{split}*.conllu"))
        if not files:
            raise SystemExit(f"--data: no *{split}*.conllu file in {args.data}")
        out[split] = [t for path in files for t in read_conllu(path, args.label)]
    return out


def fold_batch(
    model: ChildSumTreeLSTM, trees: list[DepTree]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Loss over every word of a batch, and the roots' logits and labels."""
    f = fold.Fold()
    states: list[fold.Node] = []
    roots: list[fold.Node] = []
    labels: list[int] = []
    for tree in trees:
        nodes = record_dep_tree(f, tree)  # children before parents, the root last
        states += nodes
        roots.append(nodes[-1])
        labels += [t.label for t in tree.postorder()]
    h, y, root_h = f.apply(model, [states, labels, roots])
    root_y = torch.tensor([t.label for t in trees])
    return F.cross_entropy(model.classify(h), y), model.classify(root_h), root_y


def eager_batch(model: ChildSumTreeLSTM, trees: list[DepTree]) -> torch.Tensor:
    """The same loss the usual way: one tree, one word at a time."""
    logits = [model.classify(s) for t in trees for s in model.encode(t)]
    labels = [n.label for t in trees for n in t.postorder()]
    return F.cross_entropy(torch.cat(logits), torch.tensor(labels))


@torch.no_grad()
def accuracy(model: ChildSumTreeLSTM, trees: list[DepTree], batch: int = 256) -> float:
    """Accuracy of the roots' labels."""
    correct = 0
    for i in range(0, len(trees), batch):
        _, logits, y = fold_batch(model, trees[i : i + batch])
        correct += (logits.argmax(1) == y).sum().item()
    return correct / max(1, len(trees))


def trees_per_second(model, trees, batch: int, step, repeats: int = 3) -> float:
    """Training throughput (forward, backward, optimizer), the median of ``repeats`` passes."""
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
    ap.add_argument("--data", help="directory of CoNLL-U files (default: the bundled treebank)")
    ap.add_argument("--label", default="deprel", help="with --data: column to predict")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--batch", type=int, default=25)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.005)
    ap.add_argument("--train-size", type=int, default=0, help="only this many trees (0: all)")
    ap.add_argument("--speed-trees", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    bank = load(args)
    words = Vocab(n.word for t in bank["train"] for n in t.postorder())
    tags = sorted({n.label for t in bank["train"] for n in t.postorder()}, key=str)
    tag_id = {x: i for i, x in enumerate(tags)}
    data = {
        k: [t.map(word=lambda w: words.stoi.get(w, 0), label=lambda y: tag_id.get(y, 0)) for t in v]
        for k, v in bank.items()
    }
    train = data["train"][: args.train_size or None]
    children = [len(n.children) for t in train for n in t.postorder()]
    print(
        f"treebank: {', '.join(f'{k} {len(v)}' for k, v in data.items())} trees, vocabulary "
        f"{len(words)}, {len(tags)} labels, 0-{max(children)} children per word"
    )

    model = ChildSumTreeLSTM(len(words), args.hidden, classes=len(tags))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    print(f"dev root accuracy before training: {accuracy(model, data['dev']):.1%}")
    for epoch in range(1, args.epochs + 1):
        rng.shuffle(train)
        bar = tqdm(range(0, len(train), args.batch), desc=f"epoch {epoch}", leave=False)
        total = 0.0
        for n, i in enumerate(bar, 1):
            loss, _, _ = fold_batch(model, train[i : i + args.batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
            bar.set_postfix(loss=f"{total / n:.3f}")
        print(
            f"epoch {epoch}: train loss {total / n:.3f}, dev root accuracy "
            f"{accuracy(model, data['dev']):.1%}"
        )
    print(f"test root accuracy: {accuracy(model, data['test']):.1%}")

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
