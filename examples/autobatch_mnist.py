"""The per-sample MNIST training loop written plainly, batched by fold.autobatch.

    python examples/autobatch_mnist.py                    # 8x8 digits bundled with scikit-learn
    python examples/autobatch_mnist.py --data DIR         # MNIST IDX files (train-images-idx3-ubyte...)

``sample_loss`` is the loss of ONE image, the way a per-sample loop writes it: the image as
it comes, no batch dim, ``model(image.flatten())`` and ``F.cross_entropy`` on its logits.
``fold.autobatch(sample_loss, images, labels)`` records it once, on lazy rows standing for
the batch's images and labels (every iterable is a tensor, so every sample records the same
calls), and runs each call once on the batch; the result is the (batch,) tensor of
per-sample losses, the same values and gradients as the loop.  The script trains, reports test accuracy, and times a step
against the loop run eagerly and against the usual batched step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from mnist_per_sample import load_digits, load_mnist  # the data loaders of the fold example
from torch import nn
from tqdm import tqdm

import fold


def make_model(pixels: int) -> nn.Module:
    return nn.Sequential(nn.Linear(pixels, 128), nn.ReLU(), nn.Linear(128, 10))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--data", type=Path, help="directory with the MNIST IDX files")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--speed-steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    xtr, ytr, xte, yte = load_mnist(args.data) if args.data else load_digits()
    print(f"{len(xtr)} training images of {tuple(xtr.shape[1:])}, {len(xte)} test images")
    model = make_model(xtr[0].numel())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def sample_loss(image: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        """Plain per-sample code: one (H, W) image, one label."""
        return F.cross_entropy(model(image.flatten()), label)

    def autobatch_step(images: torch.Tensor, labels: torch.Tensor) -> float:
        loss = fold.autobatch(sample_loss, images, labels).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    def loop_step(images: torch.Tensor, labels: torch.Tensor) -> float:
        loss = torch.stack([sample_loss(x, y) for x, y in zip(images, labels)]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    def batched_step(images: torch.Tensor, labels: torch.Tensor) -> float:
        loss = F.cross_entropy(model(images.flatten(1)), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    for epoch in range(1, args.epochs + 1):
        perm = torch.randperm(len(xtr))
        steps = [idx for idx in perm.split(args.batch) if len(idx) == args.batch]
        losses = [
            autobatch_step(xtr[idx], ytr[idx])
            for idx in tqdm(steps, desc=f"epoch {epoch}", leave=False)
        ]
        with torch.no_grad():
            acc = (model(xte.flatten(1)).argmax(1) == yte).float().mean().item()
        print(f"epoch {epoch}: loss {sum(losses) / len(losses):.3f}, test accuracy {acc:.1%}")

    # Speed: the same steps (interleaved, medians); lr 0 keeps the weights.
    for group in opt.param_groups:
        group["lr"] = 0.0
    idx = torch.arange(args.batch)
    times: dict[str, list[float]] = {"loop": [], "autobatch": [], "batched": []}
    steps = {"loop": loop_step, "autobatch": autobatch_step, "batched": batched_step}
    for _ in range(args.speed_steps):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step(xtr[idx], ytr[idx])
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(
        f"one step of {args.batch} samples: per-sample loop {med['loop']:.2f} ms, autobatch "
        f"{med['autobatch']:.2f} ms ({med['loop'] / med['autobatch']:.1f}x faster), plain "
        f"batched {med['batched']:.2f} ms (autobatch / batched {med['autobatch'] / med['batched']:.2f})"
    )


if __name__ == "__main__":
    main()
