"""A TreeLSTM batch larger than the memory the process may use, completed with ``max_rows``
and ``offload="cpu"``.

    python benchmarks/memory_gpu.py --device cuda          # the demonstration (a GPU)
    python benchmarks/memory_gpu.py --trees 32 --hidden 64  # a dry run of the checks on CPU

On CUDA: one plain forward+backward of the batch gives its peak memory P over what was
allocated before (the model, the inputs).  The process is then limited
(``torch.cuda.set_per_process_memory_fraction``) to that base plus ``--fraction`` of P, and
each setting runs the same forward+backward: plain ``apply`` (expected to run out of
memory), ``max_rows``, ``offload="cpu"``, and both.  For each it prints whether it
completed, its peak over the base and its time (median of ``--reps``), and checks the root
states and every gradient against the unlimited run (||a - b|| / ||b|| <= 1e-5, float32).  Writes
benchmarks/results/memory_gpu.json (with --save).  On CPU only the checks run.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import parser, setup, sync, table, write_json  # noqa: E402
from tree_lstm import make_trees  # noqa: E402

import fold  # noqa: E402
from fold.models import TreeLSTM, record_tree  # noqa: E402


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||: the distance of a result from the unlimited run's."""
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--trees", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--fraction", type=float, default=0.5, help="of the plain run's peak")
    ap.add_argument("--max-rows", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    setup(args)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if cuda and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = TreeLSTM(10_000, args.hidden).to(dev)
    trees = make_trees(args.trees, 5, 35, 10_000)

    def step(**limits):  # type: ignore[no-untyped-def]
        model.zero_grad(set_to_none=True)
        f = fold.Fold()
        roots = [record_tree(f, t) for t in trees]
        (h,) = f.apply(model, [roots], **limits)
        h.pow(2).mean().backward()
        sync(args.device)
        return h.detach()

    ref_h = step().cpu()
    ref_g = {k: p.grad.cpu() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    base = limit = 0
    if cuda:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()

    def measure(name: str, limits: dict) -> dict:  # type: ignore[type-arg]
        """One setting's row: ``--reps`` timed runs, the last one's distance from the
        reference run and its peak over the base; "out of memory" where a run ran out."""
        row: dict = {"setting": name}  # type: ignore[type-arg]
        times = []
        try:
            for _ in range(args.reps):
                if cuda:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                h = step(**limits)
                times.append(time.perf_counter() - t0)
        except torch.OutOfMemoryError:
            model.zero_grad(set_to_none=True)
            return row | {"completed": "out of memory"}
        grads = dict(model.named_parameters())
        err = max(
            [rel_err(h.cpu(), ref_h)] + [rel_err(grads[k].grad.cpu(), g) for k, g in ref_g.items()]
        )
        row |= {"completed": "yes", "max rel err": err}
        row["median_ms"] = 1e3 * statistics.median(times)
        if cuda:
            row["peak MB over base"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        model.zero_grad(set_to_none=True)
        return row

    rows = []
    peak = 0.0
    if cuda:  # the plain run without a limit gives the peak the limit is a fraction of
        rows.append(measure("plain, no limit", {}))
        peak = rows[0]["peak MB over base"] * 2**20
        torch.cuda.empty_cache()
        limit = base + int(args.fraction * peak)
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(limit / total, dev)

    settings = {
        "plain": {},
        f"max_rows={args.max_rows}": {"max_rows": args.max_rows},
        'offload="cpu"': {"offload": "cpu"},
        f'max_rows={args.max_rows}, offload="cpu"': {"max_rows": args.max_rows, "offload": "cpu"},
    }
    rows += [measure(name, limits) for name, limits in settings.items()]
    if cuda:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        print(
            f"plain peak {peak / 2**20:.0f} MB over a base of {base / 2**20:.0f} MB; "
            f"limit: base + {args.fraction} x peak = {limit / 2**20:.0f} MB"
        )
    print(f"TreeLSTM hidden {args.hidden}, {args.trees} trees, forward+backward, {dev}")
    print(table(rows, ["setting", "completed", "max rel err", "median_ms", "peak MB over base"]))
    out = {"args": vars(args), "plain_peak_mb": peak / 2**20, "base_mb": base / 2**20}
    out["limit_mb"] = limit / 2**20
    print(f"wrote {write_json('memory_gpu', out | {'rows': rows})}")
    worst = max((r["max rel err"] for r in rows if "max rel err" in r), default=0.0)
    if worst > 1e-5:
        raise SystemExit(f"a limited run differs from the unlimited one: {worst:.2g} > 1e-5")


if __name__ == "__main__":
    main()
