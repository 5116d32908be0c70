"""Depth vs agenda scheduling on a workload where they differ: RNNs over sequences of
different lengths with a two-layer classifier head on each final state.

    python benchmarks/agenda.py

Depth scheduling runs the head once per distinct sequence length; the agenda lets the head
wait until every sequence is done and runs it once.  Prints groups launched and forward+
backward time (planning included) for both; writes benchmarks/results/agenda.json.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved, median, parser, setup, table, write_json  # noqa: E402

import fold  # noqa: E402


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


def main() -> None:
    ap = parser(__doc__, device=False)
    ap.add_argument("--sequences", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--reps", type=int, default=11)
    args = ap.parse_args()
    setup(args)
    torch.manual_seed(0)
    rng = random.Random(0)
    seqs = [
        [rng.randrange(1000) for _ in range(rng.randint(1, args.max_len))]
        for _ in range(args.sequences)
    ]
    model = SeqClassifier(1000, args.hidden)

    def run(strategy: str):
        def go() -> None:
            f, outs = record(strategy, seqs)
            model.zero_grad(set_to_none=True)
            f.apply(model, [outs])[0].sum().backward()

        return go

    ref = {s: record(s, seqs) for s in ("depth", "agenda")}
    values = {s: f.apply(model, [outs])[0] for s, (f, outs) in ref.items()}
    torch.testing.assert_close(values["depth"], values["agenda"])
    times = interleaved({s: run(s) for s in ("depth", "agenda")}, args.reps)
    rows = [
        {
            "strategy": s,
            "groups": ref[s][0].plan().num_groups,
            "head groups": sum(1 for r in ref[s][0].last_run if r[1] == "head"),
            "median_ms": 1e3 * median(times[s]),
        }
        for s in ("depth", "agenda")
    ]
    print(
        f"{args.sequences} sequences of 1-{args.max_len} steps, GRU hidden {args.hidden}, forward+backward"
    )
    print(table(rows, ["strategy", "groups", "head groups", "median_ms"]))
    print(f"wrote {write_json('agenda', {'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
