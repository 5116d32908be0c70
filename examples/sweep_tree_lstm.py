"""A learning-rate sweep of N TreeLSTMs trained as ONE fold on the bundled treebank.

    python examples/sweep_tree_lstm.py                    # 8 models, lr from 3e-4 to 3e-2
    python examples/sweep_tree_lstm.py --models 4 --epochs 2 --data path/to/sst

Every batch of trees is recorded once; ``fold.apply`` runs it for all N models of a
``BatchModule`` (all at once on a GPU, one model per pass on a CPU), and a per-model Adam
gives each model its own learning rate.  At the end: a per-model table (lr, loss, accuracy),
a PNG of the dev-accuracy curves, TensorBoard logs (one curve per model), and the speed
against training the N models one after another.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import fold
import fold.optim
from fold.batched_ops import BatchModule, batch_loss, batch_topk
from fold.diagnostics import Aggregator, Diagnostic
from fold.models import TreeLSTM
from fold.treebank import Tree, Vocab, bundled_treebank, load_treebank

sys.path.insert(0, str(Path(__file__).parent))
from tree_lstm import record as record_tree  # noqa: E402


def record(trees: list[Tree]) -> tuple[fold.Fold, list[fold.Node], list[int], list[fold.Node]]:
    """One graph for a batch: the h of every constituent, its label, and the roots."""
    f = fold.Fold()
    states: list[fold.Node] = []
    labels: list[int] = []
    roots = []
    for tree in trees:
        record_tree(f, tree, states, labels)  # the single-model example's recording, unchanged
        roots.append(states[-1])
    return f, states, labels, roots


def sweep_step(bm: BatchModule, trees: list[Tree]) -> torch.Tensor:
    """(N,) losses of the N models on one batch, every constituent labelled."""
    f, states, labels, _ = record(trees)
    h, y = f.apply(bm, [states, labels])  # h: (N, nodes, hidden)
    n = bm.batch
    return batch_loss(bm.method("classify")(h), y.expand(n, -1), n, F.cross_entropy)


@torch.no_grad()
def accuracy(bm: BatchModule, trees: list[Tree]) -> torch.Tensor:
    """(N,) root accuracy of every model."""
    f, _, _, roots = record(trees)
    (h,) = f.apply(bm, [roots])
    y = torch.tensor([t.label for t in trees]).expand(bm.batch, -1)
    return batch_topk(bm.method("classify")(h), y, bm.batch, (1,))[0]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--data", help="directory with SST train.txt/dev.txt/test.txt (default: bundled)"
    )
    ap.add_argument("--models", type=int, default=8)
    ap.add_argument("--lr-min", type=float, default=3e-4)
    ap.add_argument("--lr-max", type=float, default=3e-2)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=25)
    ap.add_argument("--hidden", type=int, default=48)
    ap.add_argument("--train-size", type=int, default=800)
    ap.add_argument("--speed-trees", type=int, default=100)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: speed figures that hold on a busy machine)",
    )
    ap.add_argument("--save", type=Path, help="write the N models' state dicts here (torch.save)")
    ap.add_argument(
        "--out", default="runs/sweep_tree_lstm", help="TensorBoard logs and the PNG go here"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    rng = random.Random(0)
    bank = load_treebank(args.data) if args.data else bundled_treebank()
    vocab = Vocab.from_trees(bank["train"])
    data = {k: [vocab.numericalize(t) for t in v] for k, v in bank.items()}
    train = data["train"][: args.train_size or None]
    n = args.models
    lrs = torch.logspace(
        torch.tensor(args.lr_min).log10(), torch.tensor(args.lr_max).log10(), n
    ).tolist()
    models = [TreeLSTM(len(vocab), args.hidden) for _ in range(n)]
    bm = BatchModule.from_modules(copy.deepcopy(models))
    opt = fold.optim.Adam(bm.parameters(), lr=lrs)
    out = Path(args.out)
    try:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=str(out))
    except ImportError:
        writer = None
    print(
        f"{n} TreeLSTMs (hidden {args.hidden}), lr {lrs[0]:.1e} .. {lrs[-1]:.1e}, {len(train)} training trees"
    )

    curves = [accuracy(bm, data["dev"]).tolist()]
    summary = Diagnostic()
    for epoch in range(1, args.epochs + 1):
        rng.shuffle(train)
        agg = Aggregator()
        bar = tqdm(
            range(0, len(train), args.batch), desc=f"epoch {epoch}/{args.epochs}", leave=False
        )
        for i in bar:
            losses = sweep_step(bm, train[i : i + args.batch])
            opt.zero_grad()
            losses.sum().backward()
            opt.step()
            agg.update({"train": {"loss": losses}})
            bar.set_postfix(best=f"{losses.min().item():.3f}")
        summary = agg.data
        summary["dev"] = {"accuracy": accuracy(bm, data["dev"])}
        curves.append(summary["dev"]["accuracy"].tolist())
        if writer is not None:
            summary.log(writer, epoch)
        print(
            f"epoch {epoch}: best dev accuracy {max(curves[-1]):.1%} (model {curves[-1].index(max(curves[-1]))})"
        )

    summary["test"] = {"accuracy": accuracy(bm, data["test"])}
    print(summary.table(names=[f"lr={lr:.1e}" for lr in lrs], digits=3))
    if args.save:
        torch.save(bm.state_dicts(), args.save)
        print(f"saved {n} state dicts to {args.save}")

    # Speed: the same training steps as one fold of N models, and as N folds of one model.
    timed = train[: args.speed_trees]
    scratch = BatchModule.from_modules(copy.deepcopy(models))
    scratch_opt = fold.optim.Adam(scratch.parameters(), lr=0.0)
    t0 = time.perf_counter()
    for i in range(0, len(timed), args.batch):
        scratch_opt.zero_grad()
        sweep_step(scratch, timed[i : i + args.batch]).sum().backward()
        scratch_opt.step()
    swept = time.perf_counter() - t0
    plain_opts = [torch.optim.Adam(m.parameters(), lr=0.0) for m in models]
    t0 = time.perf_counter()
    for m, o in zip(models, plain_opts):
        for i in range(0, len(timed), args.batch):
            f, states, labels, _ = record(timed[i : i + args.batch])
            h, y = f.apply(m, [states, labels])
            o.zero_grad()
            F.cross_entropy(m.classify(h), y).backward()
            o.step()
    separate = time.perf_counter() - t0
    print(
        f"speed on {len(timed)} trees x {n} models: one fold {n * len(timed) / swept:.0f} trees/s, "
        f"{n} models one after another {n * len(timed) / separate:.0f} trees/s ({separate / swept:.2f}x, {args.threads} thread{'s' if args.threads > 1 else ''})"
    )

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, lr in enumerate(lrs):
        ax.plot(range(len(curves)), [c[i] for c in curves], marker="o", label=f"lr={lr:.1e}")
    ax.set_xlabel("epoch")
    ax.set_ylabel("dev accuracy (root)")
    ax.set_title(f"{n} TreeLSTMs trained as one fold")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "accuracy.png", dpi=100)
    print(f"wrote {out / 'accuracy.png'} and TensorBoard logs in {out}")


if __name__ == "__main__":
    main()
