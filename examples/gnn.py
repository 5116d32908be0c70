"""Train a message-passing network on small graphs with fold's list arguments.

    python examples/gnn.py                     # synthetic graphs, about half a minute
    python examples/gnn.py --rounds 2 --graphs 4000

Written per graph: each round every node sends ``message(h)`` and takes ``update(h,
[messages of its in-neighbours])``, a list argument of any length; ``readout([final
states])`` classifies the graph.  fold runs each round of all graphs in a batch as a few
batched calls, the op receiving the neighbour lists as a ``fold.Ragged``.

The task: does the graph have an edge from a node of type 0 into a node of type 1?  A bag of
node types cannot tell (both types occur in every graph); one round of messages can.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F

import fold
from fold.models import Graph, GraphNet, record_graph

TYPES = 6


def make_graph(rng: random.Random) -> tuple[Graph, int]:
    """A random graph of 8-24 nodes (each with 1-4 in-neighbours) and its label, balanced."""
    target = rng.randrange(2)
    while True:
        size = rng.randint(8, 24)
        kinds = [rng.randrange(TYPES) for _ in range(size)]
        kinds[0], kinds[1] = 0, 1  # both types in every graph
        nbrs = [
            rng.sample([u for u in range(size) if u != v], rng.randint(1, 4)) for v in range(size)
        ]
        label = int(any(kinds[u] == 0 for v, nb in enumerate(nbrs) if kinds[v] == 1 for u in nb))
        if label == target:
            return (kinds, nbrs), label


def fold_logits(model: GraphNet, graphs: list[Graph], rounds: int) -> torch.Tensor:
    f = fold.Fold()
    outs = [f.add("readout", record_graph(f, g, rounds)) for g in graphs]
    return f.apply(model, [outs])[0]


def eager_logits(model: GraphNet, graphs: list[Graph], rounds: int) -> torch.Tensor:
    return torch.cat([model.encode(g, rounds) for g in graphs])


def graphs_per_second(model, graphs, batch, rounds, logits_fn, repeats: int = 3) -> float:
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(0, len(graphs), batch):
            model.zero_grad()
            logits_fn(model, graphs[i : i + batch], rounds).sum().backward()
        rates.append(len(graphs) / (time.perf_counter() - t0))
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--graphs", type=int, default=2000, help="training graphs")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--speed-graphs", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    train = [make_graph(rng) for _ in range(args.graphs)]
    test = [make_graph(rng) for _ in range(500)]
    model = GraphNet(TYPES, args.hidden, classes=2)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    @torch.no_grad()
    def accuracy(data: list[tuple[Graph, int]]) -> float:
        logits = fold_logits(model, [g for g, _ in data], args.rounds)
        return (logits.argmax(1) == torch.tensor([y for _, y in data])).float().mean().item()

    print(f"{len(train)} training graphs; test accuracy before training: {accuracy(test):.1%}")
    for epoch in range(1, args.epochs + 1):
        rng.shuffle(train)
        total = 0.0
        for i in range(0, len(train), args.batch):
            chunk = train[i : i + args.batch]
            logits = fold_logits(model, [g for g, _ in chunk], args.rounds)
            loss = F.cross_entropy(logits, torch.tensor([y for _, y in chunk]))
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(chunk)
        print(f"epoch {epoch}: loss {total / len(train):.3f}, test accuracy {accuracy(test):.1%}")

    timed = [g for g, _ in train[: args.speed_graphs]]
    eager = graphs_per_second(model, timed, args.batch, args.rounds, eager_logits)
    batched = graphs_per_second(model, timed, args.batch, args.rounds, fold_logits)
    print(
        f"forward+backward on {len(timed)} graphs, batch {args.batch}: eager {eager:.0f} "
        f"graphs/s, fold {batched:.0f} graphs/s ({batched / eager:.1f}x; medians of 3, "
        f"{args.threads} thread{'s' if args.threads > 1 else ''})"
    )


if __name__ == "__main__":
    main()
