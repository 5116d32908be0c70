"""GRU sequence classifier, forward+backward: eager per sequence, fold, hand-batched steps.

    python benchmarks/rnn.py

Sequences of random lengths (1 to --max-len words) with a two-layer head on each final state,
at 1, 16 and 256 sequences per batch, plus one sequence of --long-len steps (where every
group has one node, so the per-group cost of the engine is all that differs).  Fold records
``start``/``step``/``head`` nodes per word and applies the graph, with depth scheduling
(``fold``) and with ``Fold(strategy="agenda")`` (``agenda``: one head group instead of one
per distinct length); the hand-written code sorts
the sequences by length and runs one GRU step per time step on the prefix still running.
Interleaved runs, medians; writes benchmarks/results/rnn.json.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from agenda import SeqClassifier, record  # noqa: E402
from common import interleaved, median, parser, setup, table, write_json  # noqa: E402


def fold_forward(
    model: SeqClassifier, seqs: list[list[int]], strategy: str = "depth"
) -> torch.Tensor:
    f, outs = record(strategy, seqs)
    (logits,) = f.apply(model, [outs])
    return logits


def agenda_forward(model: SeqClassifier, seqs: list[list[int]]) -> torch.Tensor:
    return fold_forward(model, seqs, "agenda")


def hand_forward(model: SeqClassifier, seqs: list[list[int]]) -> torch.Tensor:
    """Length-sorted batching: step t runs the GRU on the sequences longer than t."""
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    longest = len(seqs[order[0]])
    words = torch.zeros(len(seqs), longest, dtype=torch.long)
    for row, i in enumerate(order):
        words[row, : len(seqs[i])] = torch.tensor(seqs[i])
    running = [sum(len(s) > t for s in seqs) for t in range(longest)]
    h = model.start(words[:, 0])
    for t in range(1, longest):
        k = running[t]
        h = torch.cat([model.step(h[:k], words[:k, t]), h[k:]])
    unsort = torch.empty(len(seqs), dtype=torch.long)
    unsort[torch.tensor(order)] = torch.arange(len(seqs))
    return model.head(h[unsort])


def eager_forward(model: SeqClassifier, seqs: list[list[int]]) -> torch.Tensor:
    outs = []
    for seq in seqs:
        h = model.start(torch.tensor(seq[:1]))
        for w in seq[1:]:
            h = model.step(h, torch.tensor([w]))
        outs.append(model.head(h))
    return torch.cat(outs)


def main() -> None:
    ap = parser(__doc__, device=False)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--max-len", type=int, default=40)
    ap.add_argument("--long-len", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--reps", type=int, default=11)
    args = ap.parse_args()
    setup(args)
    torch.manual_seed(0)
    model = SeqClassifier(1000, args.hidden)
    rng = random.Random(0)
    workloads = [
        (
            f"{n} x 1-{args.max_len} steps",
            [rng.choices(range(1000), k=rng.randint(1, args.max_len)) for _ in range(n)],
        )
        for n in args.sizes
    ]
    workloads.append((f"1 x {args.long_len} steps", [rng.choices(range(1000), k=args.long_len)]))
    rows = []
    for name, seqs in workloads:
        want = eager_forward(model, seqs)
        for fwd in (fold_forward, agenda_forward, hand_forward):
            torch.testing.assert_close(fwd(model, seqs), want, rtol=1e-4, atol=1e-5)

        def run(fwd, seqs=seqs):
            def go() -> None:
                model.zero_grad(set_to_none=True)
                fwd(model, seqs).sum().backward()

            return go

        times = interleaved(
            {"fold": run(fold_forward), "agenda": run(agenda_forward), "hand": run(hand_forward)},
            args.reps,
        )
        times.update(interleaved({"eager": run(eager_forward)}, max(1, args.reps // 4)))
        med = {k: median(v) for k, v in times.items()}
        steps = sum(map(len, seqs))
        rows.append(
            {
                "workload": name,
                "words": steps,
                "eager ms": 1e3 * med["eager"],
                "fold ms": 1e3 * med["fold"],
                "agenda ms": 1e3 * med["agenda"],
                "hand ms": 1e3 * med["hand"],
                "fold/hand": med["fold"] / med["hand"],
                "agenda/hand": med["agenda"] / med["hand"],
                "fold us/word": 1e6 * med["fold"] / steps,
            }
        )
        print(f"  {name} done", flush=True)
    print(f"GRU hidden {args.hidden}, forward+backward, {args.threads} thread(s)")
    print(table(rows, list(rows[0])))
    print(f"wrote {write_json('rnn', {'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
