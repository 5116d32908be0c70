"""TreeLSTM training throughput against trees per fold: eager, fold, level-by-level batching.

    python benchmarks/tree_throughput.py                    # CPU, 1 thread
    python benchmarks/tree_throughput.py --device cuda      # on a GPU

For 1, 16, 64, 256 and 1024 trees per batch (random binary trees, 5-35 leaves, vocab 10k),
trees/s of forward+backward, interleaved runs, medians, and the peak memory of one
forward+backward of fold and of the level-batched code: torch.cuda.max_memory_allocated on a
GPU; on CPU malloc's bytes in use after each op (benchmarks/common.py, peak_host_bytes).  Writes benchmarks/results/tree_throughput[_cuda].json
and, with matplotlib, docs/tree_throughput[_cuda].png.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    interleaved,
    median,
    output_path,
    parser,
    peak_host_bytes,
    setup,
    sync,
    table,
    write_json,
)
from tree_lstm import eager_forward, fold_forward, level_batched, make_trees  # noqa: E402

from fold.models import TreeLSTM  # noqa: E402


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
    ap.add_argument("--hidden", type=int, default=150)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--eager-trees", type=int, default=64, help="eager is timed on at most this many trees"
    )
    args = ap.parse_args()
    setup(args)
    torch.manual_seed(0)
    dev = args.device
    model = TreeLSTM(10_000, args.hidden).to(dev)
    rows = []
    for size in args.sizes:
        trees = make_trees(size, 5, 35, 10_000, seed=size)
        eager_trees = trees[: args.eager_trees]

        def run(forward, ts, model=model):
            def go() -> None:
                model.zero_grad(set_to_none=True)
                forward(model, ts).sum().backward()
                sync(dev)

            return go

        times = interleaved(
            {"fold": run(fold_forward, trees), "level": run(level_batched, trees)}, args.reps
        )
        times["eager"] = interleaved(
            {"eager": run(eager_forward, eager_trees)}, max(1, args.reps // 2)
        )["eager"]
        row = {"trees": size}
        for name in ("eager", "fold", "level"):
            n = len(eager_trees) if name == "eager" else size
            row[f"{name} trees/s"] = n / median(times[name])
        row["fold/level"] = median(times["fold"]) / median(times["level"])
        for name, fwd in (("fold", fold_forward), ("level", level_batched)):
            if dev == "cuda":
                torch.cuda.reset_peak_memory_stats()
                run(fwd, trees)()
                peak = torch.cuda.max_memory_allocated()
            else:  # malloc's bytes in use after each op: the CPU stand-in
                peak = peak_host_bytes(run(fwd, trees))
            if peak is not None:
                row[f"{name} peak MB"] = peak / 2**20
        if "fold peak MB" in row:
            row["peak fold/level"] = row["fold peak MB"] / row["level peak MB"]
        rows.append(row)
        print(f"  {size} trees done", flush=True)
    cols = list(rows[0])
    print(
        f"TreeLSTM hidden {args.hidden}, forward+backward, device {dev}, {args.threads} thread(s)"
    )
    print(table(rows, cols))
    suffix = "" if dev == "cpu" else f"_{dev}"
    print(f"wrote {write_json('tree_throughput' + suffix, {'args': vars(args), 'rows': rows})}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("eager", "fold", "level"):
        ax.plot(args.sizes, [r[f"{name} trees/s"] for r in rows], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("trees per fold")
    ax.set_ylabel("trees/s (forward+backward)")
    ax.set_title(f"TreeLSTM hidden {args.hidden}, {dev}")
    ax.legend()
    fig.tight_layout()
    out = output_path(f"tree_throughput{suffix}.png", docs=True)
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
