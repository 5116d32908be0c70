"""Execution of a :class:`fold.scheduler.Plan`.

Each group's outputs stay one batched tensor (a *source*); a node's value is the pair
(source, row).  Gathering an argument column costs one ``index_select`` per source plus one
``cat`` (and a final ``index_select`` when members from different sources interleave), and
nothing when the rows are a whole source in order or a contiguous run (``narrow``).  So the
number of tensor ops grows with steps x groups x arguments, never with nodes, and autograd
flows back through these out-of-place gathers unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fold.errors import FoldError
from fold.graph import (
    BOOL,
    ID_MASK,
    ID_SHIFT,
    INT,
    NODE,
    OUT_MASK,
    SRC_MASK,
    SRC_SHIFT,
    Fold,
    node_id,
    op_name,
)
from fold.scheduler.plan import Plan

__all__ = ["Executor", "device_of"]

_NUMBER_DTYPES = {INT: torch.long, BOOL: torch.bool}
_NO_SOURCE = -(1 << 62)  # the whole-node source of a multi-output node: using it is an error


def device_of(obj: Any) -> torch.device:
    """The device of ``obj``'s first parameter (or buffer); CPU for plain objects."""
    if isinstance(obj, torch.nn.Module):
        for p in obj.parameters():
            return p.device
        for b in obj.buffers():
            return b.device
    return torch.device("cpu")


def _describe(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        dt = (
            "" if t.dtype == torch.get_default_dtype() else f" {str(t.dtype).replace('torch.', '')}"
        )
        return f"{tuple(t.shape)}{dt}"
    return type(t).__name__


# A gather recipe: pieces (source, start, length, index position or -1) concatenated in
# order, then an optional permutation (index position) putting rows back in member order.
# A negative source -1 - b stands for value table b, always read with index_select.
_Recipe = tuple[list[tuple[int, int, int, int]], int]


class Executor:
    """Runs one ``apply``: executes a plan's groups, then gathers the requested outputs.

    Value tables: a signature that runs as several groups (a TreeLSTM's ``node`` op, once per
    level) also copies each group's outputs into one table per output, so that a consumer
    whose arguments come from many of those groups gathers them with ONE ``index_select``
    instead of one per group.  Tables are written in place (``narrow(...).copy_``) but only
    ever read by ``index_select``, which saves its index and not its input for backward, so
    the in-place writes never invalidate a saved tensor; a group's own output tensor, which
    ops may save, is never written to.
    """

    def __init__(self, graph: Fold, obj: Any) -> None:
        self.graph = graph
        self.obj = obj
        self.device = device_of(obj)
        self.on_cpu = self.device.type == "cpu"
        n = len(graph.sig)
        # Per node, two entries: [2 * id] the source of the whole node, [2 * id + 1] the
        # source of split output 0 (output k: + k).  A handle indexes it directly.
        self.src2 = [_NO_SOURCE] * (2 * n)
        self.node_row = [0] * n  # row of the node in its sources; -1: the whole source
        self.sources: list[torch.Tensor] = []
        self.src_table: list[int] = []  # per source: value table holding a copy, or -1
        self.src_offset: list[int] = []  # per source: its first row in that table
        self.tables: list[torch.Tensor] = []
        self._table_of: dict[tuple[Any, int], int] = {}
        self._table_fill: list[int] = []
        self._table_rows: dict[Any, int] = {}
        self.report: list[tuple[int, str, int, tuple[str, ...]]] = []
        self._fns: dict[Any, Callable[..., Any]] = {}

    # ------------------------------------------------------------------ ops
    def _resolve(self, op: Any) -> Callable[..., Any]:
        fn = self._fns.get(op)
        if fn is None:
            if isinstance(op, str):
                fn = getattr(self.obj, op, None)
                if fn is None or not callable(fn):
                    raise FoldError(
                        f"apply: op {op!r} is not a method of the {type(self.obj).__name__} "
                        f"given to apply. Fix: define def {op}(self, ...) on "
                        f"{type(self.obj).__name__}, or record a callable instead of a name."
                    )
            else:
                fn = op
            self._fns[op] = fn
        return fn

    def run(self, plan: Plan) -> None:
        rows: dict[Any, int] = {}
        groups: dict[Any, int] = {}
        for step in plan.steps:
            for group in step.groups:
                rows[group.key] = rows.get(group.key, 0) + len(group.nodes)
                groups[group.key] = groups.get(group.key, 0) + 1
        self._table_rows = {k: r for k, r in rows.items() if groups[k] > 1}
        for s, step in enumerate(plan.steps):
            for group in step.groups:
                self._run_group(s, group.key, group.nodes)

    # ------------------------------------------------------------------ gathers
    def _column(self, handles: tuple[int, ...] | list[int]) -> tuple[list[int], list[int]]:
        """Source and row of every handle of an argument column."""
        s2, nr = self.src2, self.node_row
        srcs = [s2[(h >> SRC_SHIFT) & SRC_MASK] + (h & OUT_MASK) for h in handles]
        if min(srcs) < 0:
            bad = next(h for h, s in zip(handles, srcs) if s < 0)
            self._whole_use_error(bad)
        return srcs, [nr[(h >> ID_SHIFT) & ID_MASK] for h in handles]

    def _whole_use_error(self, h: int) -> None:
        nid = node_id(h)
        n = self.graph.nsplit.get(nid, 0)
        raise FoldError(
            f"apply: node {nid} ({op_name(self.graph.op_of(nid))!r}) is used whole, but it was "
            f"split into {n} outputs. Fix: use the handles returned by .split({n})."
        )

    def _recipe(self, srcs: list[int], rows: list[int], idx: list[list[int]]) -> _Recipe:
        """Plan a gather of ``rows`` of ``srcs``; index lists are appended to ``idx``."""
        n = len(srcs)
        s0 = srcs[0]
        if srcs.count(s0) == n:
            return [self._piece(s0, rows, idx)], -1
        table = self.src_table[s0]
        if table >= 0:
            st = self.src_table
            if all(st[s] == table for s in set(srcs)):
                so = self.src_offset
                idx.append([so[s] + r for s, r in zip(srcs, rows)])
                return [(-1 - table, 0, n, len(idx) - 1)], -1
        positions: dict[int, list[int]] = {}
        for i, s in enumerate(srcs):
            p = positions.get(s)
            if p is None:
                positions[s] = [i]
            else:
                p.append(i)
        pieces = []
        perm = [0] * n
        offset = 0
        for s, pos in positions.items():
            pieces.append(self._piece(s, [rows[i] for i in pos], idx))
            for k, i in enumerate(pos, offset):
                perm[i] = k
            offset += len(pos)
        if perm == list(range(n)):
            return pieces, -1
        idx.append(perm)
        return pieces, len(idx) - 1

    def _piece(self, src: int, rows: list[int], idx: list[list[int]]) -> tuple[int, int, int, int]:
        m = len(rows)
        r0 = rows[0]
        if rows[-1] - r0 == m - 1 and rows == list(range(r0, r0 + m)):
            return src, r0, m, -1
        idx.append(rows)
        return src, r0, m, len(idx) - 1

    def _index_tensors(self, idx: list[list[int]]) -> list[torch.Tensor]:
        """All index lists of a group as tensors: one ``torch.tensor`` call, one transfer."""
        if not idx:
            return []
        if len(idx) == 1:
            flat = torch.tensor(idx[0], dtype=torch.long)
        else:
            flat = torch.tensor([i for lst in idx for i in lst], dtype=torch.long)
        if not self.on_cpu:
            flat = flat.to(self.device, non_blocking=True)
        if len(idx) == 1:
            return [flat]
        return list(flat.split([len(lst) for lst in idx]))

    def _gather(self, recipe: _Recipe, itensors: list[torch.Tensor]) -> torch.Tensor:
        pieces, perm = recipe
        sources = self.sources
        parts = []
        for src, start, length, ix in pieces:
            if src < 0:
                parts.append(self.tables[-1 - src].index_select(0, itensors[ix]))
                continue
            t = sources[src]
            if ix >= 0:
                parts.append(t.index_select(0, itensors[ix]))
            elif start == 0 and length == t.shape[0]:
                parts.append(t)
            else:
                parts.append(t.narrow(0, start, length))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, 0)
        if perm >= 0:
            out = out.index_select(0, itensors[perm])
        return out

    def _meta(self, src: int) -> tuple[Any, torch.dtype]:
        t = self.sources[src]
        return t.shape[1:], t.dtype

    # ------------------------------------------------------------------ groups
    def _run_group(self, step: int, key: Any, members: list[int]) -> None:
        g = self.graph
        nid0 = members[0]
        op, kinds = g.signatures[g.sig[nid0]]
        fn = self._resolve(op)
        nobatch = g.nobatch_ids
        alone = bool(nobatch) and nid0 in nobatch
        n = len(members)
        cols = list(zip(*[g.args[m] for m in members])) if kinds else []

        # Phase 1: plan every argument column (and find columns whose sources differ in shape).
        idx: list[list[int]] = []
        plans: list[Any] = []
        mixed: list[list[int]] = []
        for j, k in enumerate(kinds):
            if k == NODE:
                handles = cols[j]
                h0 = handles[0]
                if nobatch and node_id(h0) in nobatch:
                    src = self.src2[(h0 >> SRC_SHIFT) & SRC_MASK] + (h0 & OUT_MASK)
                    if src < 0:
                        self._whole_use_error(h0)
                    plans.append(("whole", src))
                    continue
                srcs, rows = self._column(handles)
                if srcs.count(srcs[0]) != n and len({self._meta(s) for s in set(srcs)}) > 1:
                    mixed.append(srcs)
                    continue
                plans.append(("gather", self._recipe(srcs, rows, idx)))
            else:
                plans.append(("literal", k))
        if mixed:
            self._run_subgroups(step, key, members, mixed)
            return

        # Phase 2: index tensors, then the argument values.
        itensors = self._index_tensors(idx)
        values: list[torch.Tensor] = []
        for j, (what, p) in enumerate(plans):
            if what == "gather":
                values.append(self._gather(p, itensors))
            elif what == "whole":
                values.append(self.sources[p])
            elif type(p) is tuple:  # literal tensors: batch-of-one, concatenated
                t = torch.cat(cols[j], 0) if n > 1 else cols[j][0]
                values.append(t if t.device == self.device else t.to(self.device))
            else:
                t = torch.tensor(cols[j], dtype=_NUMBER_DTYPES.get(p, torch.get_default_dtype()))
                values.append(t if self.on_cpu else t.to(self.device, non_blocking=True))

        # Phase 3: the batched call.
        try:
            out = fn(*values)
        except Exception as err:
            raise FoldError(
                f"apply: op {op_name(op)!r} failed at step {step} on a group of {n} node(s) "
                f"with arguments ({', '.join(_describe(v) for v in values)}): "
                f"{type(err).__name__}: {err}. Fix: run the same graph with fold.Unfold(obj) to "
                "debug the op on one example; a batched op must treat dim 0 as the batch."
            ) from err
        outs = self._check_outputs(op, step, members, out, alone)
        base = len(self.sources)
        self._add_sources(key, outs, n, alone)
        s2, nr = self.src2, self.node_row
        whole = base if len(outs) == 1 else _NO_SOURCE
        if alone:
            s2[2 * nid0] = whole
            s2[2 * nid0 + 1] = base
            nr[nid0] = -1
        else:
            for i, m in enumerate(members):
                s2[2 * m] = whole
                s2[2 * m + 1] = base
                nr[m] = i
        self.report.append((step, op_name(op), n, tuple(_describe(v) for v in values)))

    def _add_sources(self, key: Any, outs: tuple[torch.Tensor, ...], n: int, alone: bool) -> None:
        """Register a group's outputs, copying them into their value tables where planned."""
        total = None if alone else self._table_rows.get(key)
        for k, t in enumerate(outs):
            self.sources.append(t)
            table = -1
            if total is not None:
                table = self._table_of.get((key, k), -1)
                if table < 0:
                    table = len(self.tables)
                    self._table_of[key, k] = table
                    self.tables.append(t.new_empty((total, *t.shape[1:])))
                    self._table_fill.append(0)
                buf = self.tables[table]
                fill = self._table_fill[table]
                if buf.shape[1:] == t.shape[1:] and buf.dtype == t.dtype and fill + n <= total:
                    buf.narrow(0, fill, n).copy_(t)
                    self._table_fill[table] = fill + n
                else:  # a sub-group of another shape: it stays a plain source
                    table = -1
            self.src_table.append(table)
            self.src_offset.append(self._table_fill[table] - n if table >= 0 else 0)

    def _run_subgroups(
        self, step: int, key: Any, members: list[int], mixed: list[list[int]]
    ) -> None:
        """Split a group whose gathered arguments differ in shape or dtype, and run each part."""
        parts: dict[tuple[Any, ...], list[int]] = {}
        for i, m in enumerate(members):
            part_key = tuple(self._meta(srcs[i]) for srcs in mixed)
            p = parts.get(part_key)
            if p is None:
                parts[part_key] = [m]
            else:
                p.append(m)
        for sub in parts.values():
            self._run_group(step, key, sub)

    def _check_outputs(
        self, op: Any, step: int, members: list[int], out: Any, alone: bool
    ) -> tuple[torch.Tensor, ...]:
        if isinstance(out, torch.Tensor):
            outs: tuple[torch.Tensor, ...] = (out,)
        elif (
            isinstance(out, (tuple, list)) and out and all(isinstance(t, torch.Tensor) for t in out)
        ):
            outs = tuple(out)
        else:
            raise FoldError(
                f"apply: op {op_name(op)!r} (step {step}) returned {_describe_output(out)}; an op "
                "must return a tensor or a tuple of tensors. Fix: return torch tensors, e.g. "
                "torch.as_tensor(value)."
            )
        n = len(members)
        if not alone:
            for k, t in enumerate(outs):
                if t.dim() == 0 or t.shape[0] != n:
                    raise FoldError(
                        f"apply: op {op_name(op)!r} (step {step}) returned output {k} of shape "
                        f"{tuple(t.shape)} for a group of {n} node(s); outputs must have one row "
                        "per node in dim 0. Fix: keep the batch dim (no .sum() or .view(-1) over "
                        "it), or mark a node whose value is shared with .nobatch()."
                    )
        nsplit = self.graph.nsplit
        m = len(outs)
        if m > 1 or nsplit:
            for nid in members:
                want = nsplit.get(nid, 0)
                if want == m or (want == 0 and m == 1):
                    continue
                if want == 0:
                    raise FoldError(
                        f"apply: op {op_name(op)!r} returned {m} outputs, but node {nid} is used "
                        f"without split. Fix: h = f.add({op_name(op)!r}, ...).split({m})."
                    )
                raise FoldError(
                    f"apply: node {nid} was split with .split({want}), but op {op_name(op)!r} "
                    f"returned {m} output(s). Fix: call .split({m}), or return {want} tensors."
                )
        return outs

    # ------------------------------------------------------------------ results
    def output(self, kind: str, items: list[Any], i: int) -> torch.Tensor:
        """The value of one list given to apply."""
        if kind == "numbers":
            t = torch.tensor(items)
            return t if self.on_cpu else t.to(self.device, non_blocking=True)
        if kind == "tensors":
            shapes = {(t.shape[1:], t.dtype) for t in items}
            if len(shapes) > 1:
                raise FoldError(
                    f"apply: lists[{i}] holds tensors of different shapes or dtypes "
                    f"({sorted(map(str, shapes))}); they cannot be concatenated along dim 0."
                )
            return torch.cat([t.to(self.device) for t in items], 0)
        node_type = self.graph._node_type
        if not all(type(h) is node_type for h in items):
            raise FoldError(
                f"apply: lists[{i}] holds nodes that this Fold did not record. Fix: pass nodes "
                "returned by this Fold's add()."
            )
        srcs, rows = self._column(items)
        metas = {self._meta(s) for s in set(srcs)}
        if len(metas) > 1:
            raise FoldError(
                f"apply: lists[{i}] holds output nodes of different shapes or dtypes "
                f"({', '.join(sorted(f'{tuple(s)} {d}' for s, d in metas))}); they cannot be "
                "concatenated along dim 0. Fix: put nodes of each shape in their own list."
            )
        if min(rows) < 0:  # nobatch values are returned whole
            parts = [
                self.sources[s] if r < 0 else self.sources[s].narrow(0, r, 1)
                for s, r in zip(srcs, rows)
            ]
            return torch.cat(parts, 0)
        idx: list[list[int]] = []
        recipe = self._recipe(srcs, rows, idx)
        return self._gather(recipe, self._index_tensors(idx))


def _describe_output(out: Any) -> str:
    if isinstance(out, (tuple, list)):
        inner = ", ".join(type(x).__name__ for x in out)
        return f"a {type(out).__name__} of ({inner})"
    return f"a {type(out).__name__}"
