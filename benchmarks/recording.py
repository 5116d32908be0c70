"""Recording cost per node against the number of arguments.

    python benchmarks/recording.py

Records 20k nodes of an op with k node arguments (k = 1, 2, 4, 8, 9, 12, 16), each node
reading k earlier nodes, with ``f.add(op, *args)`` and with a list argument
(``f.add(op, [args])``), and reports microseconds per recorded node (median of --reps
recordings; the argument lists are built before the clock starts).  Target: at most 2 us
per node up to 16 arguments.

Then literal tensors: nodes whose argument is a batch-of-one tensor (a sample's features,
``f.add("node", x)``), alone and beside a list of two earlier nodes (a child-sum TreeLSTM
node over given features), recorded with the C fast path of the recorders and without it
(the generated Python recorders alone).  Writes ``recording.json``.
"""

from __future__ import annotations

import gc
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import median, parser, setup, table, write_json  # noqa: E402

import fold  # noqa: E402
from fold import graph  # noqa: E402


def per_node(k: int, nodes: int, as_list: bool, reps: int) -> float:
    rng = random.Random(k)
    picks = [[rng.randrange(64 + i) for _ in range(k)] for i in range(nodes)]

    def record() -> float:
        f = fold.Fold()
        made = [f.add("leaf", i) for i in range(64)]
        add = f.add
        t0 = time.perf_counter()
        for p in picks:
            args = [made[j] for j in p]
            made.append(add("op", args) if as_list else add("op", *args))
        return time.perf_counter() - t0

    def build() -> float:  # the argument lists alone: subtracted, what remains is fold's
        made = list(range(64 + nodes))
        t0 = time.perf_counter()
        for p in picks:
            args = [made[j] for j in p]
            made.append(args)
        return time.perf_counter() - t0

    # Interleaved, each after a collection: a full collection inside one timing (20k
    # tracked objects are made) would otherwise land on whichever run it hits.
    times, base = [], []
    for _ in range(reps):
        for fn, out in ((record, times), (build, base)):
            gc.collect()
            out.append(fn())
    return 1e6 * (median(times) - median(base)) / nodes


def literal_per_node(nodes: int, with_list: bool, c: bool, reps: int) -> float:
    """Microseconds per node recorded with a literal (1, 64) tensor argument (and a list of
    two earlier nodes), with or without the C recorders."""
    feats = [torch.randn(1, 64) for _ in range(nodes)]
    saved = graph._CRecorder
    graph._CRecorder = saved if c else None
    try:

        def record() -> float:
            f = fold.Fold()
            made = [f.add("leaf", i) for i in range(2)]
            add = f.add
            t0 = time.perf_counter()
            for i, x in enumerate(feats):
                made.append(add("node", x, [made[i], made[i + 1]]) if with_list else add("node", x))
            return time.perf_counter() - t0

        times = []
        for _ in range(reps):
            gc.collect()
            times.append(record())
    finally:
        graph._CRecorder = saved
    return 1e6 * median(times) / nodes


def main() -> None:
    ap = parser(__doc__, device=False)
    ap.add_argument("--nodes", type=int, default=20_000)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    setup(args)
    rows = []
    for k in (1, 2, 4, 8, 9, 12, 16):
        rows.append(
            {
                "arguments": k,
                "add(op, *args) us/node": per_node(k, args.nodes, False, args.reps),
                "add(op, [args]) us/node": per_node(k, args.nodes, True, args.reps),
            }
        )
    print(f"recording {args.nodes} nodes, medians of {args.reps}")
    print(table(rows, list(rows[0])))
    literal = []
    for with_list in (False, True):
        literal.append(
            {
                "arguments": "a (1, 64) tensor" + (" and a list of 2 nodes" if with_list else ""),
                "C us/node": literal_per_node(args.nodes, with_list, True, args.reps),
                "Python us/node": literal_per_node(args.nodes, with_list, False, args.reps),
            }
        )
    print("literal tensor arguments, with and without the C recorders")
    print(table(literal, list(literal[0])))
    out = {"args": vars(args), "rows": rows, "literal": literal}
    print(f"wrote {write_json('recording', out)}")


if __name__ == "__main__":
    main()
