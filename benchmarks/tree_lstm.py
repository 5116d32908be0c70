"""TreeLSTM forward+backward: eager tree by tree, fold, and hand-written level-by-level batching.

    python benchmarks/tree_lstm.py                 # hidden 150 and 32, 256 trees, 1 thread
    python benchmarks/tree_lstm.py --hidden 150 --reps 20

Fold time includes recording the graph; the level-batched time includes its own tree walk.
Runs are interleaved and medians reported; ratios are against level-by-level batching.
Writes benchmarks/results/tree_lstm.json.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved, median, parser, setup, table, write_json  # noqa: E402

import fold  # noqa: E402
from fold.models import TreeLSTM, record_tree  # noqa: E402
from fold.treebank import Tree, random_tree  # noqa: E402


def make_trees(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[Tree]:
    rng = random.Random(seed)
    return [random_tree(rng, rng.randint(lo, hi), vocab) for _ in range(n)]


def level_batched(model: TreeLSTM, trees: list[Tree]) -> torch.Tensor:
    """Hand-written batching: all leaves in one call, then one call per tree height.

    States live in one buffer written with in-place ``index_copy_`` (index_select saves only
    its index, so autograd allows it); leaf states are computed once per distinct word.
    """
    words: list[int] = []
    leaf_rows: list[int] = []
    levels: dict[int, tuple[list[int], list[int], list[int]]] = {}
    roots: list[int] = []
    n = 0
    for tree in trees:
        stack: list[tuple[int, int]] = []  # (row, height)
        for t in tree.postorder():
            if t.left is None:
                words.append(t.word)
                leaf_rows.append(n)
                stack.append((n, 0))
            else:
                r, rh = stack.pop()
                left, lh = stack.pop()
                h = max(lh, rh) + 1
                lv = levels.get(h)
                if lv is None:
                    lv = levels[h] = ([], [], [])
                lv[0].append(n)
                lv[1].append(left)
                lv[2].append(r)
                stack.append((n, h))
            n += 1
        roots.append(stack[0][0])
    dev = model.embed.weight.device
    uniq, inverse = torch.unique(torch.tensor(words, device=dev), return_inverse=True)
    lh_, lc_ = model.leaf(uniq)
    rows = torch.tensor(leaf_rows, device=dev)
    H = torch.zeros(n, model.hidden, device=dev).index_copy_(0, rows, lh_.index_select(0, inverse))
    C = torch.zeros(n, model.hidden, device=dev).index_copy_(0, rows, lc_.index_select(0, inverse))
    for h in sorted(levels):
        par, left, right = (torch.tensor(x, device=dev) for x in levels[h])
        nh, nc = model.node(
            H.index_select(0, left),
            C.index_select(0, left),
            H.index_select(0, right),
            C.index_select(0, right),
        )
        H.index_copy_(0, par, nh)
        C.index_copy_(0, par, nc)
    return H.index_select(0, torch.tensor(roots, device=dev))


def fold_graph(trees: list[Tree]) -> fold.Fold:
    """The graph as ``fold.models.record_tree`` records it (``Fold.op`` recorders)."""
    f = fold.Fold()
    for t in trees:
        record_tree(f, t)
    return f


def fold_graph_add(trees: list[Tree]) -> fold.Fold:
    """The same graph recorded with ``f.add(...).split(2)``."""
    f = fold.Fold()
    add = f.add
    for tree in trees:
        stack: list[tuple[fold.Node, ...]] = []
        for t in tree.postorder():
            if t.left is None:
                stack.append(add("leaf", t.word).split(2))
            else:
                rh, rc = stack.pop()
                lh, lc = stack.pop()
                stack.append(add("node", lh, lc, rh, rc).split(2))
    return f


def fold_forward(model: TreeLSTM, trees: list[Tree]) -> torch.Tensor:
    f = fold.Fold()
    roots = [record_tree(f, t) for t in trees]
    return f.apply(model, [roots])[0]


def eager_forward(model: TreeLSTM, trees: list[Tree]) -> torch.Tensor:
    return torch.cat([model.encode(t) for t in trees])


def step(model: TreeLSTM, forward, trees: list[Tree]) -> None:
    model.zero_grad(set_to_none=True)
    forward(model, trees).sum().backward()


def main() -> None:
    ap = parser(__doc__, device=False)
    ap.add_argument("--hidden", type=int, nargs="+", default=[150, 32])
    ap.add_argument("--trees", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=10_000)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--eager-reps", type=int, default=3)
    args = ap.parse_args()
    setup(args)
    torch.manual_seed(0)
    trees = make_trees(args.trees, 5, 35, args.vocab)
    nodes = sum(len(t) for t in trees)
    rows = []
    for hidden in args.hidden:
        model = TreeLSTM(args.vocab, hidden)
        # Same values: the comparison is only meaningful if all three compute the same thing.
        ref = level_batched(model, trees)
        torch.testing.assert_close(fold_forward(model, trees), ref, rtol=1e-4, atol=1e-5)
        fns = {
            "fold": lambda model=model: step(model, fold_forward, trees),
            "level": lambda model=model: step(model, level_batched, trees),
        }
        times = interleaved(fns, args.reps)
        eager = interleaved(
            {"eager": lambda model=model: step(model, eager_forward, trees)},
            args.eager_reps,
            warmup=0,
        )
        times.update(eager)
        med = {k: median(v) for k, v in times.items()}
        for name in ("eager", "fold", "level"):
            rows.append(
                {
                    "hidden": hidden,
                    "method": name,
                    "median_ms": 1e3 * med[name],
                    "trees/s": args.trees / med[name],
                    "vs_level": med[name] / med["level"],
                    "reps": len(times[name]),
                }
            )
    print(
        f"TreeLSTM, {args.trees} trees ({nodes} nodes), forward+backward, {args.threads} thread(s)"
    )
    print(table(rows, ["hidden", "method", "median_ms", "trees/s", "vs_level", "reps"]))
    # Recording alone: the tree walk and every add/split, per node of the graph.
    graph_nodes = len(fold_graph(trees))
    assert len(fold_graph_add(trees)) == graph_nodes
    rec = interleaved(
        {"op": lambda: fold_graph(trees), "add": lambda: fold_graph_add(trees)}, args.reps
    )
    rec_us = 1e6 * median(rec["op"]) / graph_nodes
    add_us = 1e6 * median(rec["add"]) / graph_nodes
    # Means too: a garbage collection lands in some recordings only, and a median hides it.
    rec_mean = 1e6 * sum(rec["op"]) / len(rec["op"]) / graph_nodes
    add_mean = 1e6 * sum(rec["add"]) / len(rec["add"]) / graph_nodes
    print(
        f"recording: {rec_us:.2f} us per node with Fold.op recorders, {add_us:.2f} with "
        f"add(...).split(2) ({graph_nodes} graph nodes, tree walk included, medians; means "
        f"{rec_mean:.2f} and {add_mean:.2f})"
    )
    path = write_json(
        "tree_lstm",
        {
            "args": vars(args),
            "nodes": nodes,
            "rows": rows,
            "record_us_per_node": rec_us,
            "record_add_us_per_node": add_us,
            "record_us_per_node_mean": rec_mean,
            "record_add_us_per_node_mean": add_mean,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
