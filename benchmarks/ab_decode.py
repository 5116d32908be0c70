"""Before / after in ONE process: greedy decoding (``control_flow.py``'s decoder) under a base
revision's fold and the working tree's, calls interleaved, medians and paired ratios.

    python benchmarks/ab_decode.py --base REV            # 21 interleaved reps
    python benchmarks/ab_decode.py --base REV --long     # the decode-long lengths
    python benchmarks/ab_decode.py --base REV --limit --eager-group 0   # decode-limit, every
                                                         # round batched on both sides
    python benchmarks/ab_decode.py --base REV --parser   # the parser's 64 sentences
    python benchmarks/ab_decode.py --base REV --tutorial # the translation tutorial's seq2seq

Where the machine's speed drifts between processes (on a shared 2-core machine one core may
run Python-heavy code 1.5x slower than the other, and a process stays where it started),
alternating processes (``ab.py``) needs many rounds to tell a 5% change from the drift. Here
both sides run in the same process, one call after the other, so each pair of calls meets
the same machine: the paired ratio (head / base, call by call) is the figure.

The base is exported from git and built as ``ab.py`` does, then loaded as a second package,
``foldbase`` (its modules' ``fold`` imports renamed; its C extensions are copies of its own
build, loaded from their own files, so neither side's C state is the other's).  Each side
installs its patches in torch only for the length of its own calls, so the two never meet.
Every call of both sides must decode the same tokens before timing.  Also reported: the
time each side spends in its batched rounds (``_Session.run_round``).
"""

from __future__ import annotations

import importlib
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from ab import export  # noqa: E402
from common import median, parser, setup, table, write_json  # noqa: E402
from control_flow import MAX_STEPS, Seq2Seq, hand_parse, parser_workload, sources  # noqa: E402

import fold  # noqa: E402

# The import forms fold's modules use, renamed to the second package.
_IMPORTS = [
    (re.compile(r"^(\s*)from fold\.", re.M), r"\1from foldbase."),
    (re.compile(r"^(\s*)from fold import", re.M), r"\1from foldbase import"),
    (re.compile(r"^(\s*)import fold\.([a-z_]+) as", re.M), r"\1import foldbase.\2 as"),
    (re.compile(r"^(\s*)import fold$", re.M), r"\1import foldbase as fold"),
    (re.compile(r'f"fold\.\{name\}"'), 'f"foldbase.{name}"'),
]


def load_base(rev: str, into: Path) -> Any:
    """Revision ``rev``'s fold, importable as ``foldbase`` from ``into``."""
    tree = export(rev, into / "tree")
    pkg = into / "pkg" / "foldbase"
    shutil.copytree(tree / "fold", pkg)
    for path in pkg.rglob("*.py"):
        text = path.read_text()
        for pattern, repl in _IMPORTS:
            text = pattern.sub(repl, text)
        path.write_text(text)
    sys.path.insert(0, str(into / "pkg"))
    import foldbase  # type: ignore[import-not-found]

    return foldbase


def main() -> None:
    ap = parser(__doc__, device=False)
    ap.add_argument("--base", required=True, help="the revision to compare the working tree with")
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument(
        "--long", action="store_true", help="decode-long's lengths (see control_flow.py)"
    )
    ap.add_argument(
        "--limit",
        action="store_true",
        help="decode-limit's model (no EOS bias, every decode to the 40-step limit)",
    )
    ap.add_argument(
        "--parser",
        action="store_true",
        help="the parser's workload instead (control_flow.py's parser row: 64 sentences)",
    )
    ap.add_argument(
        "--tutorial",
        action="store_true",
        help="the translation tutorial's seq2seq instead (tutorials.py's seq2seq row)",
    )
    ap.add_argument(
        "--eager-group",
        type=int,
        default=None,
        help="EAGER_GROUP on both sides (0: every round batched; default: each side's own)",
    )
    args = ap.parse_args()
    setup(args)
    with tempfile.TemporaryDirectory() as tmp:
        base = load_base(args.base, Path(tmp))
        sides = {"base": base, "head": fold}
        drivers = {
            "base": importlib.import_module("foldbase.autobatch.driver"),
            "head": importlib.import_module("fold.autobatch.driver"),
        }
        rounds: dict[str, float] = {}
        for name, driver in drivers.items():
            if args.eager_group is not None:
                driver.EAGER_GROUP = args.eager_group
            real = driver._Session.run_round

            def timed(self: Any, real: Any = real, name: str = name) -> None:
                t = time.perf_counter()
                real(self)
                rounds[name] = rounds.get(name, 0.0) + time.perf_counter() - t

            driver._Session.run_round = timed
        torch.manual_seed(0)
        if args.parser:
            Parser, words, vocab_size = parser_workload(64)
            parser_model = Parser(vocab_size)

            def decode(f: Any) -> list[Any]:
                with torch.no_grad():
                    got = f.autobatch(lambda w: parser_model.parse(w), words, stack=False)
                return [t.tolist() for t in got]

            def hand() -> list[Any]:
                with torch.no_grad():
                    return hand_parse(parser_model, words)

        elif args.tutorial:
            from tutorials import Tutorial
            from tutorials import sources as tutorial_sources

            tutorial = Tutorial(128).eval()
            srcs = tutorial_sources(64)

            def decode(f: Any) -> list[Any]:
                with torch.no_grad():
                    got = f.autobatch(tutorial.translate, srcs, stack=False)
                return [t.tolist() for t in got]

            def hand() -> list[Any]:
                with torch.no_grad():
                    return [t.tolist() for t in tutorial.hand(srcs)]

        else:
            model = Seq2Seq(hidden=128, eos_bias=0.0 if args.long or args.limit else 0.3)
            srcs = sources(64, 8)
            limits = [len(s) for s in srcs] if args.long else [MAX_STEPS] * len(srcs)

            def decode(f: Any) -> list[Any]:
                with torch.no_grad():
                    got = f.autobatch(lambda s, n: model.greedy(s, n), srcs, limits, stack=False)
                return [t.tolist() for t in got]

            def hand() -> list[Any]:
                with torch.no_grad():
                    return [t.tolist() for t in model.hand(srcs, limits)]

        want = hand()
        for f in sides.values():
            assert decode(f) == want, "the sides decode different tokens"
        times: dict[str, list[float]] = {k: [] for k in ("base", "head", "hand")}
        in_rounds: dict[str, list[float]] = {"base": [], "head": []}
        for rep in range(args.reps + 2):  # (two warm-up reps)
            order = ["base", "head"] if rep % 2 else ["head", "base"]
            for name in order:
                rounds.clear()
                t = time.perf_counter()
                decode(sides[name])
                dt = time.perf_counter() - t
                if rep >= 2:
                    times[name].append(dt)
                    in_rounds[name].append(rounds.get(name, 0.0))
            t = time.perf_counter()
            hand()
            if rep >= 2:
                times["hand"].append(time.perf_counter() - t)
    paired = sorted(h / b for h, b in zip(times["head"], times["base"]))
    rows = [
        {
            "side": name,
            "median_ms": 1e3 * median(times[name]),
            "vs_hand": median(times[name]) / median(times["hand"]),
            "rounds_ms": 1e3 * median(in_rounds[name]) if name in in_rounds else float("nan"),
        }
        for name in ("base", "head", "hand")
    ]
    print(table(rows, ["side", "median_ms", "vs_hand", "rounds_ms"]))
    print(
        f"head / base, call by call: median {median(paired):.3f} "
        f"(min {paired[0]:.3f}, max {paired[-1]:.3f}, {len(paired)} pairs)"
    )
    write_json(
        "ab_parser"
        if args.parser
        else "ab_tutorial"
        if args.tutorial
        else "ab_decode_long"
        if args.long
        else "ab_decode_limit"
        if args.limit
        else "ab_decode",
        {"base": args.base, "rows": rows, "paired_median": median(paired), "paired": paired},
    )


if __name__ == "__main__":
    main()
