"""Per-sample MNIST MLP training, 32 samples per step: eager per-sample, fold, plain batched.

    python benchmarks/mnist.py                   # 1 thread, contenders interleaved, medians
    python benchmarks/mnist.py --steady-malloc   # the same, glibc keeping freed memory


Each contender does the same training step (forward, cross-entropy, backward, Adam) on the
same 32 images of 1x28x28: eager runs the model once per image (gradients accumulated), fold
records one ``forward`` node per image and applies the graph, plain batched calls the model
once on the concatenated (32, 28, 28) batch, collated once on what a DataLoader's default
``collate_fn`` makes of the (image, label) samples, (32, 1, 28, 28) and a label tensor;
"fold, apply only" runs fold's training loop on graphs recorded beforehand (what recording
costs is the difference); "fold, loss nodes" records each sample's loss as a node too
(forward -> loss); "floor" appends the samples to a list, concatenates it and calls forward
once: what any per-sample recording pays at least.  --steady-malloc: see
benchmarks/common.py, steady_malloc.  Writes benchmarks/results/mnist.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved, median, paired_ratio, parser, setup, table, write_json  # noqa: E402

import fold  # noqa: E402
from fold.arrays import numbers_tensor  # noqa: E402
from fold.models import MLP  # noqa: E402


class PerSampleLoss(MLP):
    """The MLP with a per-sample loss op, for the loop that records the loss per sample too."""

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, y, reduction="none")


def main() -> None:
    ap = parser(__doc__, device=False)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10, help="training steps per timed run")
    ap.add_argument("--reps", type=int, default=31)
    ap.add_argument("--eager-reps", type=int, default=3)
    args = ap.parse_args()
    setup(args)
    torch.manual_seed(0)
    images = [torch.rand(1, 28, 28) for _ in range(args.batch * args.steps)]
    labels = [int(i % 10) for i in range(len(images))]
    model = PerSampleLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    b = args.batch

    def eager() -> None:
        for s in range(args.steps):
            opt.zero_grad()
            for i in range(s * b, (s + 1) * b):
                (F.cross_entropy(model(images[i]), torch.tensor(labels[i : i + 1])) / b).backward()
            opt.step()

    def folded() -> None:
        for s in range(args.steps):
            f = fold.Fold()
            outs = [f.add("forward", images[i]) for i in range(s * b, (s + 1) * b)]
            logits, y = f.apply(model, [outs, labels[s * b : (s + 1) * b]])
            opt.zero_grad()
            F.cross_entropy(logits, y).backward()
            opt.step()

    def folded_loss() -> None:  # the loss recorded per sample too: forward -> loss
        for s in range(args.steps):
            f = fold.Fold()
            losses = [
                f.add("loss", f.add("forward", images[i]), labels[i])
                for i in range(s * b, (s + 1) * b)
            ]
            (loss,) = f.apply(model, [losses])
            opt.zero_grad()
            loss.mean().backward()
            opt.step()

    # The same loop on graphs recorded beforehand: what apply costs without the recording.
    graphs = []
    for s in range(args.steps):
        f = fold.Fold()
        graphs.append((f, [f.add("forward", images[i]) for i in range(s * b, (s + 1) * b)]))

    def apply_only() -> None:
        for s, (f, outs) in enumerate(graphs):
            logits, y = f.apply(model, [outs, labels[s * b : (s + 1) * b]])
            opt.zero_grad()
            F.cross_entropy(logits, y).backward()
            opt.step()

    def batched() -> None:
        for s in range(args.steps):
            x = torch.cat(images[s * b : (s + 1) * b])
            y = torch.tensor(labels[s * b : (s + 1) * b])
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()

    def floor() -> None:
        """What any per-sample recording must pay at least: each sample appended to a list,
        then the list concatenated, the labels converted as fold converts them, and the
        model's forward called once (fold's one-op path calls ``forward`` as this does)."""
        for s in range(args.steps):
            xs: list[torch.Tensor] = []
            for i in range(s * b, (s + 1) * b):
                xs.append(images[i])
            logits = model.forward(torch.cat(xs))
            y = numbers_tensor(labels[s * b : (s + 1) * b])
            opt.zero_grad()
            F.cross_entropy(logits, y).backward()
            opt.step()

    def collated() -> None:  # what a DataLoader's default collate_fn makes of the samples
        for s in range(args.steps):
            x, y = default_collate(
                list(zip(images[s * b : (s + 1) * b], labels[s * b : (s + 1) * b]))
            )
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()

    times = interleaved(
        {
            "fold": folded,
            "fold, apply only": apply_only,
            "fold, loss nodes": folded_loss,
            "batched": batched,
            "collated": collated,
            "floor": floor,
        },
        args.reps,
    )
    # Eager is 5-10x slower: timed on its own, so it does not run between the two compared.
    times.update(interleaved({"eager": eager}, args.eager_reps, warmup=0))
    med = {k: median(v) for k, v in times.items()}
    rows = [
        {
            "method": k,
            "median_ms_per_step": 1e3 * med[k] / args.steps,
            "samples/s": b * args.steps / med[k],
            "vs_batched": med[k] / med["batched"],
        }
        for k in (
            "eager",
            "fold",
            "fold, apply only",
            "fold, loss nodes",
            "batched",
            "collated",
            "floor",
        )
    ]
    print(
        f"per-sample MNIST MLP training, {b} samples per step, {args.threads} thread(s), {args.reps} reps"
    )
    print(table(rows, ["method", "median_ms_per_step", "samples/s", "vs_batched"]))
    paired = paired_ratio(times, "fold", "batched")
    apply_paired = paired_ratio(times, "fold, apply only", "batched")
    print(f"fold / batched, median of per-round ratios: {paired:.3f}")
    loss_paired = paired_ratio(times, "fold, loss nodes", "batched")
    print(f"fold apply only / batched, median of per-round ratios: {apply_paired:.3f}")
    print(f"fold with loss nodes / batched, median of per-round ratios: {loss_paired:.3f}")
    collated_paired = paired_ratio(times, "fold", "collated")
    print(f"fold / DataLoader-collated, median of per-round ratios: {collated_paired:.3f}")
    floor_paired = paired_ratio(times, "fold", "floor")
    floor_collated = paired_ratio(times, "floor", "collated")
    print(
        f"fold / floor (a list, its cat, one forward): {floor_paired:.3f}; "
        f"floor / collated: {floor_collated:.3f}"
    )
    result = {
        "args": vars(args),
        "rows": rows,
        "fold_vs_batched_paired": paired,
        "apply_only_vs_batched_paired": apply_paired,
        "loss_nodes_vs_batched_paired": loss_paired,
        "fold_vs_collated_paired": collated_paired,
        "fold_vs_floor_paired": floor_paired,
        "floor_vs_collated_paired": floor_collated,
    }
    print(f"wrote {write_json('mnist', result)}")


if __name__ == "__main__":
    main()
