"""Before / after: the project's own benchmarks on two revisions, runs interleaved, medians.

    python benchmarks/ab.py --base REV            # REV against the working tree
    python benchmarks/ab.py --base REV --head HEAD --rounds 5

Each side is a source tree (the base exported from git into a temporary folder, its C
extensions built there; the head the working tree, or a revision exported the same way). A
round runs every benchmark once per side, each as its own process with that side's ``fold``
first on ``sys.path`` and that side's own benchmark script, the order of the sides swapped
every other round so that neither always runs first on a warm or a busy machine. Each
benchmark already measures its figure as a ratio inside one process (fold against
hand-batched code, side by side); this script reports per figure the median over the rounds
for each side, their ratio, and the run-to-run spread (min-max over the rounds) that a
change has to stay within.

Figures: TreeLSTM fold / level at hidden 150 and 32, recording us per node with ``Fold.op``
recorders and with ``f.add(...).split(2)`` (``tree_lstm.py``); per-sample MNIST fold /
batched (``mnist.py``); GRU over 256 sequences fold / hand, depth and agenda (``rnn.py``);
tensor ops per apply forward and backward, 8 and 32 trees (``count_ops`` of
``tests/test_executor.py``); TreeLSTM autobatch / explicit fold, with ``@fold.batchable``
cells and with no annotation, hidden 150 and 32 (``autobatch.py``; a base without
``--eager-reps 0`` fails there: leave it out with ``--only``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import median, parser, table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

OPS = (
    "import sys, json; sys.path.insert(0, 'tests'); from test_executor import count_ops; "
    "print(json.dumps({'ops': [count_ops(8), count_ops(32)]}))"
)


def _tree(d: dict[str, Any]) -> dict[str, float]:
    out = {}
    for r in d["rows"]:
        if r["method"] == "fold":
            out[f"TreeLSTM fold/level, hidden {r['hidden']}"] = r["vs_level"]
    out["recording us/node, Fold.op"] = d["record_us_per_node"]
    out["recording us/node, f.add().split(2)"] = d["record_add_us_per_node"]
    return out


def _mnist(d: dict[str, Any]) -> dict[str, float]:
    return {
        "MNIST per-sample fold/batched": d["fold_vs_batched_paired"],
        "MNIST, loss nodes, fold/batched": d["loss_nodes_vs_batched_paired"],
    }


def _rnn(d: dict[str, Any]) -> dict[str, float]:
    (row,) = [r for r in d["rows"] if r["workload"].startswith("256 ")]
    return {
        "GRU 256 seqs fold/hand (depth)": row["fold/hand"],
        "GRU agenda/hand": row["agenda/hand"],
    }


def _ops(d: dict[str, Any]) -> dict[str, float]:
    (f8, b8), (f32, b32) = d["ops"]
    return {
        "tensor ops fwd, 8 trees": f8,
        "tensor ops fwd, 32 trees": f32,
        "tensor ops bwd, 8 trees": b8,
        "tensor ops bwd, 32 trees": b32,
    }


def _autobatch(d: dict[str, Any]) -> dict[str, float]:
    return {
        f"TreeLSTM {r['method']}/fold, hidden {r['hidden']}": r["vs_fold"]
        for r in d["trees"]
        if r["method"].startswith("autobatch")
    }


def jobs(quick: bool) -> list[tuple[str, list[str], str | None, Callable[[dict], dict]]]:
    """(name, command, JSON result file or None for stdout, extractor)."""
    reps = ["--reps", "5"] if quick else ["--reps", "9"]
    return [
        (
            "tree_lstm",
            ["benchmarks/tree_lstm.py", "--steady-malloc", *reps, "--eager-reps", "1"],
            "tree_lstm.json",
            _tree,
        ),
        (
            "mnist",
            ["benchmarks/mnist.py", "--steady-malloc", "--reps", "9" if quick else "15"]
            + ["--eager-reps", "1"],
            "mnist.json",
            _mnist,
        ),
        (
            "rnn",
            ["benchmarks/rnn.py", "--steady-malloc", "--sizes", "256", "--long-len", "20", *reps],
            "rnn.json",
            _rnn,
        ),
        ("ops", ["-c", OPS], None, _ops),
        (
            "autobatch",
            ["benchmarks/autobatch.py", "--only", "trees", *reps, "--eager-reps", "0"],
            "autobatch.json",
            _autobatch,
        ),
    ]


def export(rev: str, into: Path) -> Path:
    """The tree of ``rev`` (fold/, benchmarks/, tests/) in ``into``, with its C extensions
    built in place where ``rev`` has them (as an install builds them): without them fold
    records with its Python fallback, which would make the side slower than it is."""
    paths = ["fold", "benchmarks", "tests"]
    listed = subprocess.run(
        ["git", "ls-tree", "--name-only", rev], cwd=ROOT, check=True, capture_output=True
    ).stdout.split()
    builds = b"setup.py" in listed
    data = subprocess.run(
        ["git", "archive", rev, *paths, *(["setup.py", "pyproject.toml"] if builds else [])],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    into.mkdir(parents=True)
    archive = into / "src.tar"
    archive.write_bytes(data)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    archive.unlink()
    if builds:
        subprocess.run(
            [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
            cwd=into,
            check=True,
            capture_output=True,
        )
    return into


def run_side(root: Path, cmd: list[str], result: str | None, threads: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run(
        [sys.executable, *cmd, "--threads", str(threads)]
        if cmd[0] != "-c"
        else [sys.executable, *cmd],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed in {root}:\n{proc.stdout}\n{proc.stderr}")
    if result is None:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    return json.loads((root / "runs" / "benchmarks" / result).read_text())


def main() -> None:
    ap = parser(__doc__, device=False)
    ap.add_argument("--base", required=True, help="the revision to compare against")
    ap.add_argument("--head", default=None, help="a revision; default: the working tree")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="fewer reps per benchmark run")
    ap.add_argument(
        "--only", nargs="+", default=None, help="run these of: tree_lstm mnist rnn ops autobatch"
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"before": export(args.base, Path(tmp) / "before")}
        sides["after"] = export(args.head, Path(tmp) / "after") if args.head else ROOT
        figures: dict[str, dict[str, list[float]]] = {}
        for rnd in range(args.rounds):
            order = list(sides) if rnd % 2 == 0 else list(reversed(sides))
            for name, cmd, result, extract in jobs(args.quick):
                if args.only and name not in args.only:
                    continue
                for side in order:
                    got = extract(run_side(sides[side], cmd, result, args.threads))
                    for fig, v in got.items():
                        figures.setdefault(fig, {"before": [], "after": []})[side].append(v)
                print(f"round {rnd + 1}/{args.rounds}: {name} done", flush=True)
    rows = []
    for fig, v in figures.items():
        b, a = median(v["before"]), median(v["after"])
        rows.append(
            {
                "figure": fig,
                "before": b,
                "after": a,
                "after/before": a / b if b else float("nan"),
                "before spread": f"{min(v['before']):.3g}-{max(v['before']):.3g}",
                "after spread": f"{min(v['after']):.3g}-{max(v['after']):.3g}",
            }
        )
    head = args.head or "working tree"
    print(
        f"before: {args.base}, after: {head}; {args.rounds} rounds, medians, {args.threads} thread(s)"
    )
    print(table(rows, list(rows[0])))
    print(f"wrote {write_json('ab', {'args': vars(args), 'rows': rows, 'runs': figures})}")


if __name__ == "__main__":
    main()
