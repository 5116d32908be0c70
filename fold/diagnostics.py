"""Per-model diagnostics, in the spirit of Booster's Diagnostic and Aggregator.

A :class:`Diagnostic` is a two-level mapping ``{group: {name: value}}`` whose values are
per-model tensors of shape ``(N,)`` (or plain numbers shared by all models).  An
:class:`Aggregator` keeps running means per model; ``.log(writer, step)`` writes one chart per
value with one curve per model to a TensorBoard ``SummaryWriter``; ``.table()`` is a text
table of the latest values::

    agg = Aggregator()
    for batch in data:
        losses = ...                                   # (N,)
        agg.update({"loss": {"ce": losses}, "accuracy": {"top1": accs}})
    summary = agg.data                                 # a Diagnostic of per-model means
    summary.log(writer, epoch)
    print(summary.table(names=[f"lr={lr}" for lr in lrs]))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fold.errors import FoldError

__all__ = ["Aggregator", "Diagnostic"]


def _as_tensor(value: Any) -> torch.Tensor:
    """A value as float64 on the CPU: a number or 0-d tensor (shared by all models) stays
    0-d; anything else is per model, flattened to ``(N,)`` (``(1,)`` for a sweep's one
    model, which is not a shared value: ``gather_diagnostics`` concatenates it)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().to(torch.float64).cpu()
    else:
        t = torch.as_tensor(value, dtype=torch.float64)
    return t if t.dim() == 0 else t.flatten()


class Diagnostic(dict):  # type: ignore[type-arg]
    """``{group: {name: (N,) tensor}}``; numbers and 0-d tensors (kept 0-d) are shared by
    every model."""

    def __init__(self, data: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        super().__init__()
        for group, values in (data or {}).items():
            if not isinstance(values, Mapping):
                raise FoldError(
                    f"Diagnostic: group {group!r} holds a {type(values).__name__}; expected a "
                    "mapping of names to values, e.g. {'loss': {'nll': losses}}."
                )
            self[group] = {name: _as_tensor(v) for name, v in values.items()}

    @property
    def batch(self) -> int:
        """The number of models (the longest value); 1 if every value is shared."""
        return max((v.numel() for values in self.values() for v in values.values()), default=1)

    def to(self, device: str | torch.device) -> Diagnostic:
        out = Diagnostic()
        for group, values in self.items():
            out[group] = {k: v.to(device) for k, v in values.items()}
        return out

    def per_model(self, i: int) -> dict[str, float]:
        """Model ``i``'s values as ``{"group/name": float}``."""
        return {
            f"{g}/{k}": float(v[i] if v.numel() > 1 else v.reshape(-1)[0])
            for g, vs in self.items()
            for k, v in vs.items()
        }

    def log(self, writer: Any, step: int, prefix: str = "") -> None:
        """Write every value to a TensorBoard ``SummaryWriter``: one chart, one curve per model."""
        for group, values in self.items():
            for name, v in values.items():
                tag = f"{prefix}{group}/{name}"
                if v.numel() == 1:
                    writer.add_scalar(tag, float(v.reshape(-1)[0]), step)
                else:
                    writer.add_scalars(tag, {f"model_{i}": float(x) for i, x in enumerate(v)}, step)

    def table(self, names: Sequence[str] | None = None, digits: int = 4) -> str:
        """A text table: one row per model, one column per value."""
        n = self.batch
        names = list(names) if names is not None else [f"model {i}" for i in range(n)]
        if len(names) != n:
            raise FoldError(f"Diagnostic.table: {len(names)} names for {n} models.")
        cols = [f"{g}/{k}" for g, vs in self.items() for k in vs]
        rows = [[names[i]] + [f"{self.per_model(i)[c]:.{digits}g}" for c in cols] for i in range(n)]
        header = ["model", *cols]
        widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
        lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
        lines.append("  ".join("-" * w for w in widths))
        lines += ["  ".join(x.ljust(w) for x, w in zip(r, widths)) for r in rows]
        return "\n".join(lines)


class Aggregator:
    """Running means of diagnostics per model, weighted by ``weight`` (e.g. batch size)."""

    def __init__(self) -> None:
        self.initialize()

    def initialize(self) -> None:
        """Forget everything (start of an epoch)."""
        self._sums: dict[str, dict[str, torch.Tensor]] = {}
        self._weights: dict[str, dict[str, float]] = {}

    def update(self, data: Mapping[str, Mapping[str, Any]], weight: float = 1.0) -> None:
        diag = data if isinstance(data, Diagnostic) else Diagnostic(data)
        for group, values in diag.items():
            sums = self._sums.setdefault(group, {})
            weights = self._weights.setdefault(group, {})
            for name, v in values.items():
                if name in sums and sums[name].numel() != v.numel():
                    raise FoldError(
                        f"Aggregator.update: {group}/{name} had {sums[name].numel()} values, now {v.numel()}."
                    )
                sums[name] = sums.get(name, torch.zeros_like(v)) + weight * v
                weights[name] = weights.get(name, 0.0) + weight

    @property
    def data(self) -> Diagnostic:
        """The per-model means so far."""
        out = Diagnostic()
        for group, sums in self._sums.items():
            out[group] = {k: s / self._weights[group][k] for k, s in sums.items()}
        return out
