"""The seed notebook's per-sample MNIST loop, batched with fold.

    python examples/mnist_per_sample.py                    # 8x8 digits bundled with scikit-learn
    python examples/mnist_per_sample.py --data DIR         # MNIST IDX files (train-images-idx3-ubyte...)

The training code is written for one image at a time (``model(image)`` on a (1, H, W) tensor).
fold records 32 such calls and runs them as one batched forward and backward.  The script
trains with fold, reports test accuracy, and times the same steps run eagerly per sample.
"""

from __future__ import annotations

import argparse
import gzip
import struct
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import fold
from fold.models import MLP


def read_idx(path: Path) -> torch.Tensor:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        data = fh.read()
    ndim = data[3]
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    return torch.frombuffer(bytearray(data[4 + 4 * ndim :]), dtype=torch.uint8).view(shape)


def load_mnist(directory: Path) -> tuple[torch.Tensor, ...]:
    def find(stem: str) -> Path:
        for p in (directory / stem, directory / f"{stem}.gz"):
            if p.exists():
                return p
        raise SystemExit(f"missing {stem} in {directory}")

    xtr = read_idx(find("train-images-idx3-ubyte")).float() / 255
    ytr = read_idx(find("train-labels-idx1-ubyte")).long()
    xte = read_idx(find("t10k-images-idx3-ubyte")).float() / 255
    yte = read_idx(find("t10k-labels-idx1-ubyte")).long()
    return xtr, ytr, xte, yte


def load_digits() -> tuple[torch.Tensor, ...]:
    try:
        from sklearn.datasets import load_digits as sk_digits
    except ImportError:
        raise SystemExit(
            "no --data given and scikit-learn is missing: pip install 'torch-fold[examples]'"
        ) from None
    d = sk_digits()
    x = torch.tensor(d.images, dtype=torch.float32) / 16
    y = torch.tensor(d.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    cut = int(0.8 * len(x))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def fold_step(
    model: MLP, opt: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor
) -> float:
    f = fold.Fold()
    outs = [
        f.add("forward", images[i : i + 1]) for i in range(len(images))
    ]  # one (1, H, W) image each
    logits, targets = f.apply(model, [outs, labels.tolist()])
    loss = F.cross_entropy(logits, targets)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def eager_step(
    model: MLP, opt: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor
) -> float:
    opt.zero_grad()
    total = 0.0
    for i in range(len(images)):
        loss = F.cross_entropy(model(images[i : i + 1]), labels[i : i + 1]) / len(images)
        loss.backward()
        total += loss.item()
    opt.step()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--data", type=Path, help="directory with the MNIST IDX files")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--speed-steps", type=int, default=30)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: speed figures that hold on a busy machine)",
    )
    ap.add_argument("--save", type=Path, help="write the trained weights here (torch.save)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    xtr, ytr, xte, yte = load_mnist(args.data) if args.data else load_digits()
    pixels = xtr[0].numel()
    print(f"{len(xtr)} training images of {tuple(xtr.shape[1:])}, {len(xte)} test images")
    model = MLP(pixels)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for epoch in range(1, args.epochs + 1):
        perm = torch.randperm(len(xtr))
        steps = [idx for idx in perm.split(args.batch) if len(idx) == args.batch]
        bar = tqdm(steps, desc=f"epoch {epoch}/{args.epochs}", leave=False)
        losses = [fold_step(model, opt, xtr[idx], ytr[idx]) for idx in bar]
        with torch.no_grad():
            acc = (model(xte).argmax(1) == yte).float().mean().item()
        print(f"epoch {epoch}: loss {sum(losses) / len(losses):.3f}, test accuracy {acc:.1%}")

    if args.save:
        torch.save(model.state_dict(), args.save)
        print(f"saved the weights to {args.save}")
    batches = [
        (xtr[i : i + args.batch], ytr[i : i + args.batch])
        for i in range(0, args.batch * args.speed_steps, args.batch)
    ]
    times = {}
    for name, step in (("eager per-sample", eager_step), ("fold", fold_step)):
        t0 = time.perf_counter()
        for xb, yb in batches:
            step(model, opt, xb, yb)
        times[name] = time.perf_counter() - t0
    n = args.batch * len(batches)
    print(
        f"training on {n} images, {args.batch} per step: eager per-sample {n / times['eager per-sample']:.0f} "
        f"images/s, fold {n / times['fold']:.0f} images/s ({times['eager per-sample'] / times['fold']:.1f}x, "
        f"{args.threads} thread{'s' if args.threads > 1 else ''})"
    )


if __name__ == "__main__":
    main()
