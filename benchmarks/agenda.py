"""The strategies (``auto``, ``depth``, ``agenda``, ``lockstep``) on a GRU classifier and a
binary TreeLSTM: ``auto`` should never be far from the best of the other three.

    python benchmarks/agenda.py
    python benchmarks/agenda.py --only gru --sequences 256

- ``gru``: RNNs over sequences of different lengths with a two-layer classifier head on
  each final state.  Depth scheduling runs the head once per distinct sequence length; the
  agenda lets the head wait until every sequence is done and runs it once.
- ``treelstm``: binary TreeLSTM (``fold.models.TreeLSTM``) over random trees, the leaves and
  internal nodes recorded as ``record_tree`` does.

Prints groups launched, forward+backward time (recording and planning included) and each
strategy's ratio to the best of depth, agenda and lockstep; writes
benchmarks/results/agenda.json.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved, median, parser, setup, table, write_json  # noqa: E402

import fold  # noqa: E402
from fold.models import TreeLSTM, record_tree  # noqa: E402
from fold.treebank import random_tree  # noqa: E402


class SeqClassifier(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.cell = nn.GRUCell(hidden, hidden)
        self.hidden_layer = nn.Linear(hidden, hidden)
        self.logits = nn.Linear(hidden, 5)

    def start(self, w: torch.Tensor) -> torch.Tensor:
        return self.cell(self.embed(w))

    def step(self, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.cell(self.embed(w), h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.logits(torch.relu(self.hidden_layer(h)))


def record(strategy: str, seqs: list[list[int]]) -> tuple[fold.Fold, list[fold.Node]]:
    f = fold.Fold(strategy)
    start, step, head = f.op("start"), f.op("step"), f.op("head")  # recorders for a hot loop
    outs = []
    for seq in seqs:
        h = start(seq[0])
        for w in seq[1:]:
            h = step(h, w)
        outs.append(head(h))
    return f, outs


STRATEGIES = ("auto", "depth", "agenda", "lockstep")


def tree_record(strategy: str, trees: list[Any]) -> tuple[fold.Fold, list[fold.Node]]:
    f = fold.Fold(strategy)
    return f, [record_tree(f, t) for t in trees]


def main() -> None:
    ap = parser(__doc__, device=False)
    ap.add_argument("--only", nargs="+", choices=["gru", "treelstm"], default=["gru", "treelstm"])
    ap.add_argument("--sequences", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--trees", type=int, default=64)
    ap.add_argument("--reps", type=int, default=11)
    args = ap.parse_args()
    setup(args)
    torch.manual_seed(0)
    rng = random.Random(0)
    workloads: dict[str, tuple[Any, Any, Any]] = {}
    if "gru" in args.only:
        seqs = [
            [rng.randrange(1000) for _ in range(rng.randint(1, args.max_len))]
            for _ in range(args.sequences)
        ]
        workloads["gru"] = (SeqClassifier(1000, args.hidden), record, seqs)
    if "treelstm" in args.only:
        trees = [random_tree(rng, rng.randint(5, 35), 1000) for _ in range(args.trees)]
        workloads["treelstm"] = (TreeLSTM(1000, args.hidden), tree_record, trees)
    rows = []
    for name, (model, rec, data) in workloads.items():

        def run(strategy: str, model: Any = model, rec: Any = rec, data: Any = data) -> Any:
            def go() -> None:
                f, outs = rec(strategy, data)
                model.zero_grad(set_to_none=True)
                f.apply(model, [outs])[0].sum().backward()

            return go

        ref = {s: rec(s, data) for s in STRATEGIES}
        values = {s: f.apply(model, [outs])[0] for s, (f, outs) in ref.items()}
        for s in STRATEGIES[1:]:
            torch.testing.assert_close(values[s], values["auto"])
        times = interleaved({s: run(s) for s in STRATEGIES}, args.reps)
        med = {s: median(times[s]) for s in STRATEGIES}
        best = min(med["depth"], med["agenda"], med["lockstep"])
        for s in STRATEGIES:
            f = ref[s][0]
            rows.append(
                {
                    "model": name,
                    "strategy": s,
                    "groups": f.plan().num_groups,
                    "median_ms": 1e3 * med[s],
                    "/best": med[s] / best,
                }
            )
    print(
        f"forward+backward, hidden {args.hidden}: GRU over {args.sequences} sequences of "
        f"1-{args.max_len} steps, TreeLSTM over {args.trees} trees of 5-35 leaves; /best: "
        "against the best of depth, agenda and lockstep"
    )
    print(table(rows, ["model", "strategy", "groups", "median_ms", "/best"]))
    print(f"wrote {write_json('agenda', {'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
