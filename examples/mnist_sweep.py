"""A sweep of N LeNets on the digits (or MNIST) as one BatchModule.

    python examples/mnist_sweep.py                    # 8 LeNets, lr grid, sklearn's 8x8 digits
    python examples/mnist_sweep.py --data DIR         # MNIST IDX files

Every model sees the same batches; ``fold.optim.Adam`` gives each its own learning rate and
``fold.diagnostics`` keeps per-model running means.  Prints a per-model table and the speed
against training the models one after another.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from mnist_per_sample import load_digits, load_mnist  # noqa: E402

import fold.optim  # noqa: E402
from fold.batched_ops import BatchModule, batch_loss, batch_topk  # noqa: E402
from fold.diagnostics import Aggregator  # noqa: E402


class LeNet(nn.Module):
    """LeNet-5 for square images of side ``size`` (8 for the digits, 28 for MNIST)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 16, 3, padding=1)
        side = size // 4
        self.fc1 = nn.Linear(16 * side * side, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x.flatten(1))))))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--data", type=Path)
    ap.add_argument("--models", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr-min", type=float, default=1e-4)
    ap.add_argument("--lr-max", type=float, default=1e-2)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: speed figures that hold on a busy machine)",
    )
    ap.add_argument("--save", type=Path, help="write the N models' state dicts here (torch.save)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    xtr, ytr, xte, yte = load_mnist(args.data) if args.data else load_digits()
    xtr, xte = xtr.unsqueeze(1), xte.unsqueeze(1)  # (n, 1, H, W)
    n = args.models
    lrs = torch.logspace(
        torch.tensor(args.lr_min).log10(), torch.tensor(args.lr_max).log10(), n
    ).tolist()
    models = [LeNet(xtr.shape[-1]) for _ in range(n)]
    bm = BatchModule.from_modules(copy.deepcopy(models))
    opt = fold.optim.Adam(bm.parameters(), lr=lrs)
    print(
        f"{n} LeNets, lr {lrs[0]:.1e} .. {lrs[-1]:.1e}, {len(xtr)} training images of {tuple(xtr.shape[2:])}"
    )
    summary = None
    for epoch in range(1, args.epochs + 1):
        agg = Aggregator()
        bar = tqdm(torch.randperm(len(xtr)).split(args.batch), desc=f"epoch {epoch}", leave=False)
        for idx in bar:
            x = xtr[idx].expand(n, *xtr[idx].shape)  # every model sees the same batch
            y = ytr[idx].expand(n, -1)
            out = bm(x)
            losses = batch_loss(out, y, F.cross_entropy)
            opt.zero_grad()
            losses.sum().backward()
            opt.step()
            agg.update(
                {"train": {"loss": losses, "accuracy": batch_topk(out, y, n, (1,))[0]}},
                weight=len(idx),
            )
        summary = agg.data
        with torch.no_grad():
            bm.eval()
            test_out = bm(xte.expand(n, *xte.shape))
            bm.train()
        summary["test"] = {"accuracy": batch_topk(test_out, yte.expand(n, -1), n, (1,))[0]}
        best = int(summary["test"]["accuracy"].argmax())
        print(
            f"epoch {epoch}: best test accuracy {summary['test']['accuracy'][best]:.1%} (lr={lrs[best]:.1e})"
        )
    assert summary is not None
    print(summary.table(names=[f"lr={lr:.1e}" for lr in lrs], digits=3))
    if args.save:
        torch.save(bm.state_dicts(), args.save)
        print(f"saved {n} state dicts to {args.save}")

    steps = [idx for idx in torch.randperm(len(xtr)).split(args.batch)][:20]
    t0 = time.perf_counter()
    for idx in steps:
        opt.zero_grad()
        batch_loss(
            bm(xtr[idx].expand(n, *xtr[idx].shape)), ytr[idx].expand(n, -1), n, F.cross_entropy
        ).sum().backward()
    swept = time.perf_counter() - t0
    t0 = time.perf_counter()
    for m in models:
        for idx in steps:
            m.zero_grad()
            F.cross_entropy(m(xtr[idx]), ytr[idx]).backward()
    separate = time.perf_counter() - t0
    print(
        f"forward+backward of {len(steps)} batches: one BatchModule {swept:.2f}s, {n} models one after another {separate:.2f}s ({separate / swept:.2f}x, {args.threads} thread{'s' if args.threads > 1 else ''})"
    )


if __name__ == "__main__":
    main()
