"""Shared helpers of the benchmark scripts: interleaved timing, medians, tables, JSON."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"


def interleaved(
    fns: dict[str, Callable[[], Any]], reps: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Run each function ``reps`` times, round-robin, and return the wall times (seconds).

    Round-robin order spreads the machine's noise evenly over the contenders, so their ratio
    is far steadier than back-to-back blocks would give; the order is reversed every other
    round, so no contender always runs right after the same one (whose cache footprint it
    would inherit).
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    items = list(fns.items())
    for r in range(reps):
        for name, fn in items if r % 2 == 0 else items[::-1]:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def sync(device: str) -> None:
    """Wait for the GPU, so a timing covers the work and not only its launch."""
    if device == "cuda":
        torch.cuda.synchronize()


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def paired_ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    """The median over rounds of ``a``'s time / ``b``'s time in the same round.

    Runs of one round are adjacent, so slow drifts of the machine cancel in each ratio; on a
    shared machine this is steadier than the ratio of the two medians.
    """
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "processor": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def write_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"machine": machine(), **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
