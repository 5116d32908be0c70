"""N LeNets (or MLPs) x 64 images, forward+backward: BatchModule vs a vmap ensemble vs a
sequential loop.

    python benchmarks/models.py                  # 32 LeNets, 1 thread, CPU
    python benchmarks/models.py --arch mlp       # 784-128-128-10 MLPs
    python benchmarks/models.py --device cuda --models 10 100 1000

The vmap ensemble is the torch.func recipe (stack_module_state + functional_call under vmap);
the sequential loop runs the N models one after another.  Interleaved runs, medians; writes
benchmarks/results/models_<arch>[_cuda].json.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved, median, parser, setup, sync, table, write_json  # noqa: E402

from fold.batched_ops import BatchModule, batch_loss  # noqa: E402


class LeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5, padding=2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x.flatten(1))))))


class MLP(nn.Module):
    """784-128-128-10, the issue's second GPU workload."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(784, 128),
            nn.ReLU(),
            nn.Linear(128, 128),
            nn.ReLU(),
            nn.Linear(128, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


ARCHS = {"lenet": LeNet, "mlp": MLP}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--models", type=int, nargs="+", default=[32])
    ap.add_argument("--arch", choices=sorted(ARCHS), default="lenet")
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--reps", type=int, default=11)
    args = ap.parse_args()
    setup(args)
    torch.manual_seed(0)
    dev = args.device
    rows = []
    for n in args.models:
        models = [ARCHS[args.arch]().to(dev) for _ in range(n)]
        bm = BatchModule.from_modules(copy.deepcopy(models)).to(dev)
        params, buffers = stack_module_state(copy.deepcopy(models))
        base = copy.deepcopy(models[0]).to("meta")
        x = torch.randn(n, args.images, 1, 28, 28, device=dev)
        y = torch.randint(0, 10, (n, args.images), device=dev)

        def batched(bm=bm, x=x, y=y, n=n) -> None:
            bm.zero_grad(set_to_none=True)
            batch_loss(bm(x), y, n, F.cross_entropy).sum().backward()
            sync(dev)

        def ensemble(params=params, buffers=buffers, base=base, x=x, y=y) -> None:
            for p in params.values():
                p.grad = None

            def one(p, b, xi, yi):
                return F.cross_entropy(functional_call(base, (p, b), (xi,)), yi)

            vmap(one)(params, buffers, x, y).sum().backward()
            sync(dev)

        def sequential(models=models, x=x, y=y) -> None:
            for i, m in enumerate(models):
                m.zero_grad(set_to_none=True)
                F.cross_entropy(m(x[i]), y[i]).backward()
            sync(dev)

        for p in params.values():
            p.requires_grad_(True)
        times = interleaved(
            {"batchmodule": batched, "vmap": ensemble, "sequential": sequential}, args.reps
        )
        med = {k: median(v) for k, v in times.items()}
        best = min(med["vmap"], med["sequential"])
        for k in ("batchmodule", "vmap", "sequential"):
            rows.append(
                {
                    "models": n,
                    "method": k,
                    "median_ms": 1e3 * med[k],
                    "samples/s": n * args.images / med[k],
                    "vs_best_baseline": med[k] / best,
                }
            )
    print(
        f"{ARCHS[args.arch].__name__} x {args.images} images of 1x28x28, forward+backward, device {dev}, {args.threads} thread(s)"
    )
    print(table(rows, ["models", "method", "median_ms", "samples/s", "vs_best_baseline"]))
    name = f"models_{args.arch}" + ("" if dev == "cpu" else f"_{dev}")
    print(f"wrote {write_json(name, {'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
