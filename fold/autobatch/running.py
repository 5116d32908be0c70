"""The running statistics of the norms an autobatch call runs in training mode (a batch
norm, an instance norm with running statistics, ``F.batch_norm`` on buffers of one's own),
updated as eager code updates them: one call after another, example by example.

Eager code updates them at every call: example 0's calls in the order it makes them, then
example 1's, and so on.  Autobatch runs a group of such calls as one computation
(``tables._merged_batch_norm``), its groups in its own order: a second call of the norm in
one example runs in a later group than every example's first, calls on values of several
shapes in groups of their own, calls after a read in a later round.  With a momentum (an
exponential average) the order weighs the calls, so each group's statistics are kept here
(``Updates.add``), each row under the key of its call in eager order, and applied when the
call ends, sorted (``Updates.apply``); the call count too.  The keys: ``(example, round,
node id)`` for a recorded call (an example records its calls in its own order, and a round
after its earlier ones); for a call run at once (the examples finishing as eager code, a
call inside a torch.func transform), ``(example, round, the next node id)`` and a count,
before the node recorded after it; for a function recorded once for every row (``traced``),
``(row, the call's place in the recording)``.

While the call runs, the running statistics keep their value from before it (in training
mode no norm reads them), and a call that fails leaves them so.  Where a group's rows
cannot be told (a call run outside an executor's group), its update is made at once, in
the group's order, as before this module.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fold.executor import group_rows

_LOCAL = threading.local()  # (the updates of the autobatch call running on this thread)
_BATCH_NORM, _INSTANCE_NORM = F.batch_norm, F.instance_norm


def active() -> Updates | None:
    """The updates of the autobatch call running on this thread, if any."""
    return getattr(_LOCAL, "updates", None)


class Updates:
    """The running-statistic updates of one autobatch call, kept until it ends (a ``with``
    block around the call: applied where it returns, dropped where it raises)."""

    __slots__ = ("count", "entries", "outer", "rec", "session", "traced")

    def __init__(self) -> None:
        self.session: Any = None  # the call's rounds (driver._Session), once it records
        self.rec: Any = None  # the recorder whose graph runs now (node ids -> examples)
        self.traced = False  # a function recorded once for every row runs now
        self.count = 0  # (a sequence number per key made here: their order among equals)
        # (keys, running mean, running var, call count tensor or None, momentum, means
        # (k, C), unbiased variances (k, C)), per group or call, as they ran
        self.entries: list[tuple[Any, ...]] = []
        self.outer: Updates | None = None

    def __enter__(self) -> Updates:
        self.outer = active()
        _LOCAL.updates = self
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        _LOCAL.updates = self.outer
        self.rec = self.session = None
        if kind is None:
            self.apply()
        self.entries.clear()

    def group_keys(self, n: int) -> np.ndarray | None:
        """The eager-order keys of the ``n`` rows of the group running now (an array of five
        rows: example, round, node id, 1, 0; see the module's docstring); None where its
        rows cannot be told."""
        self.count += 1
        if self.traced:  # the rows are the examples, the calls run in recording order
            keys = np.zeros((5, n), np.int64)
            keys[0] = np.arange(n)
            keys[2] = self.count
            keys[3] = 1
            return keys
        rec, session = self.rec, self.session
        ids = group_rows(n)
        if ids is None or rec is None or session is None or not rec.segments:
            return None
        segments = np.array(rec.segments, np.int64).reshape(-1, 2)
        at = np.searchsorted(segments[:, 0], ids, side="right") - 1
        if (at < 0).any():
            return None
        keys = np.zeros((5, n), np.int64)
        keys[0] = segments[at, 1]
        keys[1] = session.rounds
        keys[2] = ids
        keys[3] = 1
        return keys

    def eager_key(self, rec: Any) -> np.ndarray | None:
        """The key of a norm call run at once by the example ``rec`` records (example, round,
        the next node id, 0, a count; None where none records: the call is then made at
        once)."""
        session = self.session
        if session is None or rec is None or rec.session is not session or rec.fold is None:
            return None
        self.count += 1
        key = (rec.example, session.rounds, rec.fold.issued(), 0, self.count)
        return np.array(key, np.int64).reshape(5, 1)

    def add(
        self,
        keys: np.ndarray,
        running_mean: torch.Tensor,
        running_var: torch.Tensor,
        calls: torch.Tensor | None,
        momentum: float | None,
        means: torch.Tensor,
        variances: torch.Tensor,
    ) -> None:
        """A group's (or a call's) statistics per row, under their keys: ``means`` and the
        unbiased ``variances`` (k, C) that torch's kernel would take into the running ones;
        ``calls`` the call count that grows by one per row (None: none)."""
        with torch.no_grad():
            self.entries.append(
                (
                    keys,
                    running_mean,
                    running_var,
                    calls,
                    momentum,
                    means.detach().to(running_mean.dtype),
                    variances.detach().to(running_var.dtype),
                )
            )

    def apply(self) -> None:
        """Every update kept, per running statistics in the order of their keys."""
        targets: dict[tuple[int, int], list[tuple[Any, ...]]] = {}
        for entry in self.entries:
            targets.setdefault((id(entry[1]), id(entry[2])), []).append(entry)
        for entries in targets.values():
            _, running_mean, running_var, calls, _, _, _ = entries[0]
            keys = np.concatenate([e[0] for e in entries], 1)
            order = torch.from_numpy(np.lexsort(keys[::-1]))
            means = torch.cat([e[5] for e in entries])
            at = order.to(means.device)  # (the statistics' device: a GPU's norm)
            means = means.index_select(0, at)
            variances = torch.cat([e[6] for e in entries]).index_select(0, at)
            momenta = [m for e in entries for m in [e[4]] * e[0].shape[1]]
            momenta = [momenta[i] for i in order.tolist()]
            before = int(calls) if calls is not None else 0
            start = 0
            while start < len(momenta):  # (runs of one momentum: F.batch_norm may vary it)
                stop = start + 1
                while stop < len(momenta) and momenta[stop] == momenta[start]:
                    stop += 1
                part = slice(start, stop)
                update(
                    running_mean, running_var, momenta[start], before, means[part], variances[part]
                )
                before += stop - start
                start = stop
            for counter in {id(e[3]): e[3] for e in entries if e[3] is not None}.values():
                with torch.no_grad():
                    counter.add_(sum(e[0].shape[1] for e in entries if e[3] is counter))


def update(
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    momentum: float | None,
    before: int,
    means: torch.Tensor,
    variances: torch.Tensor,
) -> None:
    """Running statistics after k calls whose batches' statistics are ``means`` (k, C) and
    unbiased ``variances``, in the order of their rows, in closed form: with a momentum m,
    k calls give ``(1 - m)^k r + sum_j m (1 - m)^(k-1-j) s_j``; without (``None``), the
    cumulative average over every call counted (``before`` of them before these)."""
    k = means.shape[0]
    m = momentum
    with torch.no_grad():
        # (through .data: written as torch's kernel writes them, without a bump of their
        # version, which a graph that saved them (an eager call's batch norm, before this
        # one) checks in its backward)
        for running, stats in ((running_mean.data, means), (running_var.data, variances)):
            stats = stats.to(running.dtype)
            if m is None:  # the cumulative average over every call counted
                running.mul_(before).add_(stats.sum(0)).div_(before + k)
            else:
                powers = torch.arange(k - 1, -1, -1, dtype=stats.dtype, device=stats.device)
                weights = m * (1 - m) ** powers
                running.mul_((1 - m) ** k).add_((weights[:, None] * stats).sum(0))


def eager_norm(
    rec: Any,
    input: torch.Tensor,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    calls: torch.Tensor | None,
    weight: Any,
    bias: Any,
    momentum: float | None,
    eps: float,
    instance: bool = False,
) -> torch.Tensor | None:
    """A norm call in training that example ``rec.example`` runs at once (its output, by the
    batch's statistics as eager's), its update kept under its eager key; None where it has
    none (no autobatch call keeps updates): the caller runs it as it is.  The statistics
    are what torch's kernel takes into running ones: those it writes with a momentum of 1
    into fresh tensors."""
    updates = active()
    key = None if updates is None else updates.eager_key(rec)
    if key is None:
        return None
    with torch.no_grad():
        mean, var = torch.zeros_like(running_mean), torch.ones_like(running_var)
    norm = _INSTANCE_NORM if instance else _BATCH_NORM  # (torch's own, not a patch of them)
    out = norm(input, mean, var, weight, bias, True, 1.0, eps)
    updates.add(key, running_mean, running_var, calls, momentum, mean[None], var[None])
    return out
