"""Shared helpers of the benchmark scripts: interleaved timing, medians, tables, JSON."""

from __future__ import annotations

import argparse
import ctypes
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


def parser(doc: str | None, *, device: bool = True) -> argparse.ArgumentParser:
    """The scripts' argument parser, with the options they share (--threads, --device)."""
    ap = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument(
        "--steady-malloc",
        action="store_true",
        help="keep freed heap memory in the process (glibc), see steady_malloc()",
    )
    if device:
        ap.add_argument("--device", default="cpu", help="cpu or cuda")
    return ap


def setup(args: argparse.Namespace) -> None:
    """Apply the shared options: threads, and the allocator setting if asked for."""
    torch.set_num_threads(args.threads)
    if args.steady_malloc and not steady_malloc():
        raise SystemExit("--steady-malloc: this C library has no glibc mallopt")


def steady_malloc() -> bool:
    """Make glibc keep freed heap memory in the process: no trimming, no mmap per block.

    By default glibc returns the top of the heap to the system when more than 128 KiB of it
    is free, and serves large blocks by mmap, so a training step can pay tens of page faults
    for memory it freed a moment earlier, or none, depending on how the contenders' small
    allocations happen to lie in that process (MNIST: 0.6-1.3 for the same code in different
    processes).  Both contenders run under the same setting; this removes the lottery, not
    any contender's own work.  False where this is not glibc.
    """
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_trim_threshold, 1 << 30)) and bool(mallopt(m_mmap_threshold, 1 << 25))


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
