"""Full garbage collections set off by training steps: fold against hand-batched code.

    python benchmarks/gc_pauses.py                 # 60 steps per model, hidden 32
    python benchmarks/gc_pauses.py --steps 100 --only gnn

A full (oldest-generation) collection walks every tracked object of the process, about
0.1 s with torch imported.  CPython runs one when the objects promoted to the oldest
generation since the last one exceed a quarter of those already there, so a training loop
that keeps promoting objects pays one every few dozen steps.  For each model of
``benchmarks/dynamic.py`` this runs ``--steps`` forward+backward steps of fold (list
arguments, agenda schedule) and of the hand-batched code, and counts the full collections
and their time (gc callbacks).  Writes ``gc_pauses.json``.
"""

from __future__ import annotations

import gc
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import parser, setup, table, write_json  # noqa: E402
from dynamic import MODELS, train_step  # noqa: E402


def full_collections(step: Any, steps: int) -> tuple[int, float]:
    """(count, seconds) of the full collections during ``steps`` calls of ``step``."""
    step()
    gc.collect()
    seen = {"n": 0, "t": 0.0, "t0": 0.0}

    def watch(phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            seen["t0"] = time.perf_counter()
        else:
            seen["n"] += 1
            seen["t"] += time.perf_counter() - seen["t0"]

    gc.callbacks.append(watch)
    try:
        for _ in range(steps):
            step()
    finally:
        gc.callbacks.remove(watch)
    return int(seen["n"]), seen["t"]


def main() -> None:
    ap = parser(__doc__, device=False)
    ap.add_argument("--only", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--hidden", type=int, default=32)
    args = ap.parse_args()
    setup(args)
    rows = []
    for name in args.only:
        spec = MODELS[name]
        data = spec["data"](random.Random(0), 64)
        model = spec["make"](args.hidden)
        row: dict[str, Any] = {"model": name, "steps": args.steps}
        for label, fn in (("fold", spec["fold"](True, "agenda")), ("hand", spec["hand"])):
            n, secs = full_collections(train_step(model, fn, data), args.steps)
            row[f"{label} full GCs"] = n
            row[f"{label} GC ms"] = 1e3 * secs
        rows.append(row)
        print(f"  {name} done", flush=True)
    print(f"full collections over {args.steps} training steps, hidden {args.hidden}")
    print(table(rows, list(rows[0])))
    print(f"wrote {write_json('gc_pauses', {'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
