"""Shared helpers of the benchmark scripts: interleaved timing, medians, tables, JSON."""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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
    ap.add_argument(
        "--save",
        action="store_true",
        help="write the results into the tracked benchmarks/results/ (and docs/ for plots); "
        "without it they go to runs/benchmarks/, which git ignores",
    )
    return ap


_OUT = {"dir": Path(__file__).resolve().parents[1] / "runs" / "benchmarks", "docs": None}


def output_path(name: str, docs: bool = False) -> Path:
    """Where a result file goes: the tracked benchmarks/results/ (docs/ for plots) with
    --save, else runs/benchmarks/ (ignored by git), so a run never changes tracked files
    unless asked to."""
    base = (_OUT["docs"] if docs else _OUT["dir"]) or _OUT["dir"]
    base.mkdir(parents=True, exist_ok=True)
    return base / name


def setup(args: argparse.Namespace) -> None:
    """Apply the shared options: threads, and the allocator setting if asked for."""
    torch.set_num_threads(args.threads)
    if getattr(args, "save", False):
        _OUT["dir"] = RESULTS
        _OUT["docs"] = Path(__file__).resolve().parents[1] / "docs"
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


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
        ).split()
    ]


def _host_in_use() -> Any:
    """A function returning the bytes glibc's malloc has handed out and not had back; None
    where this is not glibc (2.33+)."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2

    def in_use() -> int:
        m = mallinfo2()
        return m.uordblks + m.hblkhd  # heap chunks in use + mmapped chunks

    return in_use


class _PeakAfterEachOp(TorchDispatchMode):
    def __init__(self, in_use: Callable[[], int]) -> None:
        super().__init__()
        self.in_use = in_use
        self.peak = in_use()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.in_use())
        return out


def peak_host_bytes(fn: Callable[[], Any]) -> int | None:
    """The CPU stand-in for ``torch.cuda.max_memory_allocated``: the most bytes malloc had
    handed out after any tensor op of ``fn()`` (backward included), above what it had before.

    Read after each op dispatched, so a temporary freed inside one op is not seen (the same
    for every contender); it counts all of the process's malloc'd memory, so Python objects
    bigger than 512 bytes count too.  None where this is not glibc.
    """
    in_use = _host_in_use()
    if in_use is None:
        return None
    with _PeakAfterEachOp(in_use):  # the mode's first use loads ~20 MB of its own, once
        torch.zeros(2).add_(1).sum()
    gc.collect()
    base = in_use()
    with _PeakAfterEachOp(in_use) as mode:
        fn()
    return mode.peak - base


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
    path = output_path(f"{name}.json")
    payload = {"machine": machine(), **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
