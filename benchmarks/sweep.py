"""A sweep of N TreeLSTMs: one model-batched fold against the N models one after another.

    python benchmarks/sweep.py                       # N = 4 and 16, hidden 150, CPU, 1 thread
    python benchmarks/sweep.py --device cuda --models 8 32 128
    python benchmarks/sweep.py --only childsum       # 8 child-sum TreeLSTMs, per-model lrs

The child-sum sweep: N child-sum TreeLSTMs (list arguments: each node's children are one
Ragged) over 128 random dependency trees of 5-35 words, hidden 64, a training step each
(forward, backward, SGD with a learning rate per model): one fold with a BatchModule and
``fold.optim.SGD`` against N folds with ``torch.optim.SGD``, after checking that one step
of each leaves every model's parameters equal (float64).

The benchmark trees of benchmarks/tree_lstm.py (256 random binary trees, 5-35 leaves, vocab
10k); each contender records the trees, runs forward+backward of a root-label loss for all N
models.  Interleaved runs, medians; on CUDA also peak memory.  Writes
benchmarks/results/sweep[_cuda].json.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved, median, parser, setup, sync, table, write_json  # noqa: E402
from tree_lstm import make_trees  # noqa: E402

from fold.batched_ops import BatchModule  # noqa: E402
from fold.graph import Fold  # noqa: E402
from fold.models import TreeLSTM, record_tree  # noqa: E402


def childsum_rows(args) -> list[dict]:  # type: ignore[no-untyped-def]
    """N child-sum TreeLSTMs, per-model learning rates: one fold against N folds."""
    import random

    from fold.models import ChildSumTreeLSTM, record_dep_tree
    from fold.optim import SGD
    from fold.treebank import random_dep_tree

    n, dev = args.childsum_models, args.device
    rng = random.Random(0)
    trees = [random_dep_tree(rng, rng.randint(5, 35), 10_000) for _ in range(128)]
    labels = torch.tensor([i % 5 for i in range(len(trees))], device=dev)
    lrs = [0.05 * (i + 1) for i in range(n)]

    def make(dtype: torch.dtype) -> tuple:  # type: ignore[type-arg]
        torch.manual_seed(0)
        models = [ChildSumTreeLSTM(10_000, 64).to(dev, dtype) for _ in range(n)]
        bm = BatchModule.from_modules(copy.deepcopy(models)).to(dev)
        opts = [torch.optim.SGD(m.parameters(), lr=lr) for m, lr in zip(models, lrs)]
        return models, opts, bm, SGD(bm.parameters(), lr=lrs), bm.method("classify")

    def batched_step(bm, opt, classify) -> None:  # type: ignore[no-untyped-def]
        opt.zero_grad(set_to_none=True)
        f = Fold()
        roots = [record_dep_tree(f, t)[-1] for t in trees]
        (h,) = f.apply(bm, [roots])
        # Each model's mean loss, summed: each model's gradient as its own fold's.
        logits = classify(h).flatten(0, 1)
        (F.cross_entropy(logits, labels.repeat(n), reduction="sum") / len(trees)).backward()
        opt.step()
        sync(dev)

    def sequential_step(models, opts) -> None:  # type: ignore[no-untyped-def]
        for m, o in zip(models, opts):
            o.zero_grad(set_to_none=True)
            f = Fold()
            roots = [record_dep_tree(f, t)[-1] for t in trees]
            (h,) = f.apply(m, [roots])
            F.cross_entropy(m.classify(h), labels).backward()
            o.step()
        sync(dev)

    # One step of each in float64: every model's parameters equal.
    models, opts, bm, opt, classify = make(torch.float64)
    batched_step(bm, opt, classify)
    sequential_step(models, opts)
    for i, m in enumerate(models):
        for (name, p), q in zip(m.named_parameters(), bm.unbatch(i).parameters()):
            torch.testing.assert_close(q, p, msg=f"model {i} {name}")

    models, opts, bm, opt, classify = make(torch.float32)
    times = interleaved(
        {
            "one fold, N models": lambda: batched_step(bm, opt, classify),
            "N folds": lambda: sequential_step(models, opts),
        },
        args.reps,
    )
    med = {k: median(v) for k, v in times.items()}
    return [
        {
            "models": n,
            "one fold ms": 1e3 * med["one fold, N models"],
            "N folds ms": 1e3 * med["N folds"],
            "speedup": med["N folds"] / med["one fold, N models"],
        }
    ]


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--models", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--trees", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=150)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--childsum-models", type=int, default=8)
    ap.add_argument("--only", choices=["treelstm", "childsum"], nargs="+")
    args = ap.parse_args()
    setup(args)
    parts = args.only or ["treelstm", "childsum"]
    if "childsum" in parts:
        rows = childsum_rows(args)
        print(f"sweep of child-sum TreeLSTMs, hidden 64, 128 trees, a training step, {args.device}")
        print(table(rows, list(rows[0])))
        name = "sweep_childsum" + ("" if args.device == "cpu" else f"_{args.device}")
        write_json(name, {"args": vars(args), "rows": rows})
    if "treelstm" not in parts:
        return
    torch.manual_seed(0)
    dev = args.device
    trees = make_trees(args.trees, 5, 35, 10_000)
    labels = torch.tensor([i % 5 for i in range(len(trees))], device=dev)

    rows = []
    for n in args.models:
        models = [TreeLSTM(10_000, args.hidden).to(dev) for _ in range(n)]
        bm = BatchModule.from_modules(copy.deepcopy(models)).to(dev)
        classify = bm.method("classify")

        def batched(bm=bm, classify=classify, n=n) -> None:
            bm.zero_grad(set_to_none=True)
            f = Fold()
            roots = [record_tree(f, t) for t in trees]
            (h,) = f.apply(bm, [roots])
            F.cross_entropy(classify(h).flatten(0, 1), labels.repeat(n)).backward()
            sync(dev)

        def one_after_another(models=models) -> None:
            for m in models:
                m.zero_grad(set_to_none=True)
                f = Fold()
                roots = [record_tree(f, t) for t in trees]
                (h,) = f.apply(m, [roots])
                F.cross_entropy(m.classify(h), labels).backward()
            sync(dev)

        times = interleaved(
            {"one fold, N models": batched, "N folds": one_after_another}, args.reps
        )
        med = {k: median(v) for k, v in times.items()}
        row = {
            "models": n,
            "batched trees/s": n * len(trees) / med["one fold, N models"],
            "sequential trees/s": n * len(trees) / med["N folds"],
            "speedup": med["N folds"] / med["one fold, N models"],
        }
        if dev == "cuda":
            for name, fn in (("batched", batched), ("sequential", one_after_another)):
                torch.cuda.reset_peak_memory_stats()
                fn()
                row[f"{name} peak MB"] = torch.cuda.max_memory_allocated() / 2**20
        rows.append(row)
    print(
        f"sweep of TreeLSTMs, hidden {args.hidden}, {len(trees)} trees, forward+backward, device {dev}"
    )
    print(table(rows, list(rows[0])))
    print(
        f"wrote {write_json('sweep' + ('' if dev == 'cpu' else '_' + dev), {'args': vars(args), 'rows': rows})}"
    )


if __name__ == "__main__":
    main()
