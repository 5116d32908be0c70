"""A sweep of N TreeLSTMs: one model-batched fold against the N models one after another.

    python benchmarks/sweep.py                       # N = 4 and 16, hidden 150, CPU, 1 thread
    python benchmarks/sweep.py --device cuda --models 8 32 128

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


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--models", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--trees", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=150)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    setup(args)
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
