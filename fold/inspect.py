"""Inspecting a recorded graph: its schedule as text, a networkx graph, a picture.

Reads a Fold through its public views (``signatures``, ``sig``, ``handles``, ``node_args``,
``plan()``, ``last_run``); ``Fold.summary``, ``Fold.to_networkx`` and ``Fold.draw`` call
these functions.
"""

from __future__ import annotations

from typing import Any

from fold._encoding import KIND_NAMES, depth_of, is_tensor_kind, node_id, out_index, split_count
from fold.errors import FoldError, describe, op_name

__all__ = ["draw", "kind_str", "summary", "to_networkx"]


def kind_str(k: Any) -> str:
    """An argument kind as the summary shows it: ``int``, ``node``, ``tensor(1, 3)``."""
    if is_tensor_kind(k):
        shape, dtype = k
        if shape is None:  # literal tensors of several shapes (see fold._encoding.any_shape)
            return f"tensor(any shape, {str(dtype).replace('torch.', '')})"
        return "tensor" + describe((1, *shape), dtype, always_dtype=True)
    return KIND_NAMES[k]


def summary(fold: Any) -> str:
    """The schedule: per step, each group's op, size and argument kinds or shapes.

    After an ``apply`` it shows the groups as they ran, with runtime argument shapes;
    before, the planned groups with their static argument kinds.
    """
    lines = [f"Fold: {len(fold.sig)} nodes, strategy={fold.strategy!r}"]
    if fold.last_run is not None:
        lines[0] += ", last apply:"
        rows = [
            (s, name, n, tuple(describe(*m) for m in metas)) for s, name, n, metas in fold.last_run
        ]
    else:
        lines[0] += ", planned:"
        rows = []
        sigs = fold.snapshot().signatures  # a plan's signature ids index the snapshot's
        for s, step in enumerate(fold.plan().steps):
            for g in step.groups:
                key = g.key
                op, kinds = sigs[key] if type(key) is int else fold.signatures[fold.sig[g.nodes[0]]]
                rows.append((s, op_name(op), len(g.nodes), tuple(map(kind_str, kinds))))
    nsteps = 1 + max((r[0] for r in rows), default=-1)
    lines[0] += f" {nsteps} steps, {len(rows)} groups"
    last = -1
    for s, name, size, shapes in rows:
        if s != last:
            lines.append(f"step {s}:")
            last = s
        lines.append(f"  {name} x{size} ({', '.join(shapes)})")
    return "\n".join(lines)


def to_networkx(fold: Any) -> Any:
    """The graph as a ``networkx.DiGraph``.

    Node attributes: ``op`` (name), ``depth``, ``split`` (the n of ``split(n)`` its
    consumers use it with; 0 if they use it whole or it has none), ``nobatch``.  Edge
    attributes: ``arg`` (argument position) and ``out`` (the output index of the source
    that is used).
    """
    import networkx as nx

    g = nx.DiGraph()
    handles = fold.handles
    for nid, h in enumerate(handles):
        g.add_node(
            nid,
            op=op_name(fold.op_of(nid)),
            depth=depth_of(h),
            split=0,
            nobatch=nid in fold.nobatch_ids,
        )
    for nid in range(len(handles)):
        for pos, a in fold.node_args(nid):
            src = node_id(a)
            g.add_edge(src, nid, arg=pos, out=out_index(a))
            if split_count(a):
                g.nodes[src]["split"] = split_count(a)
    return g


def draw(fold: Any, path: str) -> None:
    """Write a PNG of the graph to ``path``, nodes placed and coloured by step.

    Needs matplotlib (``pip install torch-fold[draw]``).
    """
    # A Figure with its own Agg canvas, not pyplot: the caller's global backend (an
    # interactive one in a notebook) is left as it is.
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise FoldError("Fold.draw needs matplotlib. Fix: pip install 'torch-fold[draw]'.") from err
    import networkx as nx

    g = to_networkx(fold)
    steps = max(fold.depth, default=0) + 1
    pos = nx.multipartite_layout(g, subset_key="depth") if len(g) else {}
    fig = Figure(figsize=(max(4.0, 1.2 * steps), max(3.0, 0.15 * len(g) + 2)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colors = [g.nodes[n]["depth"] for n in g.nodes]
    nx.draw_networkx(
        g,
        pos,
        ax=ax,
        node_color=colors,
        cmap=matplotlib.colormaps["viridis"],
        labels={n: g.nodes[n]["op"] for n in g.nodes},
        font_size=7,
        node_size=300,
        arrowsize=8,
    )
    ax.set_title(f"fold graph: {len(g)} nodes in {steps} steps (colour = step)")
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
