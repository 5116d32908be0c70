"""Recording cost per node against the number of arguments.

    python benchmarks/recording.py

Records 20k nodes of an op with k node arguments (k = 1, 2, 4, 8, 9, 12, 16), each node
reading k earlier nodes, with ``f.add(op, *args)`` and with a list argument
(``f.add(op, [args])``), and reports microseconds per recorded node (median of --reps
recordings; the argument lists are built before the clock starts).  Target: at most 2 us
per node up to 16 arguments.  Writes ``recording.json``.
"""

from __future__ import annotations

import gc
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import median, parser, setup, table, write_json  # noqa: E402

import fold  # noqa: E402


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
    print(f"wrote {write_json('recording', {'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
