"""A small training loop: epochs, micro-batches, hooks, progress, diagnostics, checkpoints.

``Trainer`` runs a user step function over a list of batches (each a list of examples, e.g.
trees), for a plain module or a ``BatchModule`` sweep (then the step's loss is ``(N,)``, one
per model)::

    def step(model, trees):                      # -> a mean loss (or (N,) losses)
        f = fold.Fold()
        h, y = f.apply(model, [[record_tree(f, t) for t in trees], [t.label for t in trees]])
        return model.loss(h, y)

    trainer = Trainer(model, torch.optim.Adam(model.parameters()), step, micro_batch=32)
    trainer.fit(batches, epochs=5, checkpoint="run/ckpt.pt")
    print(trainer.evaluate(dev_batches).table())

A batch larger than memory is split into micro-batches of ``micro_batch`` examples whose
gradients accumulate, each mean loss weighted by its share of the batch, so one step equals
a step on the whole batch.  Checkpoints hold the model, optimizer, scheduler, RNG states
and the position in the epoch; they are written atomically (temporary file + rename) and
read with ``torch.load(weights_only=True)``, so a crafted file cannot run code.  A run that
stops mid-epoch and resumes from its checkpoint ends with bitwise the same weights as one
that never stopped.
"""

from __future__ import annotations

import os
import random
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fold.diagnostics import Aggregator, Diagnostic
from fold.errors import FoldError

__all__ = ["Trainer"]

STAGES = ("epoch_start", "batch_start", "step_end", "epoch_end")


class Trainer:
    """Fit ``model`` with ``step(model, batch) -> loss`` (a mean, or (N,) per-model means).

    Args:
        micro_batch: split each batch into chunks of this many examples and accumulate.
        hooks: ``{stage: [fn(trainer)]}`` for stages ``epoch_start``, ``batch_start``,
            ``step_end``, ``epoch_end``; or add them later with :meth:`add_hook`.
        seed: the order of the batches in epoch e is a shuffle seeded by ``seed + e``.
        progress: show a tqdm progress bar with the running loss (if tqdm is installed).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        step: Callable[[nn.Module, Sequence[Any]], Any],
        scheduler: Any = None,
        *,
        micro_batch: int | None = None,
        hooks: dict[str, list[Callable[[Trainer], None]]] | None = None,
        seed: int = 0,
        progress: bool = True,
    ) -> None:
        if micro_batch is not None and (type(micro_batch) is not int or micro_batch < 1):
            raise FoldError(
                f"Trainer: micro_batch={micro_batch!r}; expected a positive int or None."
            )
        self.model, self.optimizer, self.step_fn, self.scheduler = model, optimizer, step, scheduler
        self.micro_batch, self.seed, self.progress = micro_batch, seed, progress
        self.hooks: dict[str, list[Callable[[Trainer], None]]] = {s: [] for s in STAGES}
        for stage, fns in (hooks or {}).items():
            for fn in fns:
                self.add_hook(stage, fn)
        self.epoch = 0  # epochs completed
        self.position = 0  # batches of the current epoch completed
        self.history: list[Diagnostic] = []
        self.last_loss: torch.Tensor | None = None
        self._checkpoint: Path | None = None
        self._every = 0

    def add_hook(self, stage: str, fn: Callable[[Trainer], None]) -> None:
        if stage not in self.hooks:
            raise FoldError(f"Trainer.add_hook: unknown stage {stage!r}; expected one of {STAGES}.")
        self.hooks[stage].append(fn)

    def _run_hooks(self, stage: str) -> None:
        for fn in self.hooks[stage]:
            fn(self)

    # ------------------------------------------------------------------ training
    def _order(self, n: int) -> list[int]:
        order = list(range(n))
        random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def train_step(self, batch: Sequence[Any]) -> torch.Tensor:
        """One optimizer step on ``batch`` (accumulated over micro-batches); returns the loss."""
        self.optimizer.zero_grad(set_to_none=True)
        size = self.micro_batch or len(batch)
        total: torch.Tensor | None = None
        for start in range(0, len(batch), size):
            chunk = batch[start : start + size]
            loss = self.step_fn(self.model, chunk)
            weighted = loss * (len(chunk) / len(batch))
            (weighted.sum() if weighted.dim() else weighted).backward()
            total = weighted.detach() if total is None else total + weighted.detach()
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        assert total is not None
        return total

    def fit(
        self,
        batches: Sequence[Sequence[Any]],
        epochs: int,
        checkpoint: str | Path | None = None,
        every: int = 1,
    ) -> list[Diagnostic]:
        """Train until ``epochs`` epochs are complete (continuing a loaded run where it stopped).

        With ``checkpoint``, the state is saved there every ``every`` batches and at the end of
        each epoch.  Returns the per-epoch diagnostics (mean training loss, per model).
        """
        self._checkpoint = Path(checkpoint) if checkpoint is not None else None
        self._every = every
        bar_cls = _tqdm() if self.progress else None
        while self.epoch < epochs:
            order = self._order(len(batches))
            agg = Aggregator()
            self._run_hooks("epoch_start")
            bar = (
                bar_cls(
                    total=len(batches),
                    initial=self.position,
                    desc=f"epoch {self.epoch + 1}/{epochs}",
                    leave=False,
                )
                if bar_cls
                else None
            )
            while self.position < len(batches):
                batch = batches[order[self.position]]
                self._run_hooks("batch_start")
                self.last_loss = self.train_step(batch)
                agg.update({"train": {"loss": self.last_loss}}, weight=len(batch))
                self.position += 1
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{float(self.last_loss.mean()):.4f}")
                if self._checkpoint is not None and self.position % self._every == 0:
                    self.save(self._checkpoint)
                self._run_hooks("step_end")
            if bar is not None:
                bar.close()
            self.history.append(agg.data)
            self.epoch += 1
            self.position = 0
            if self._checkpoint is not None:
                self.save(self._checkpoint)
            self._run_hooks("epoch_end")
        return self.history

    @torch.no_grad()
    def evaluate(
        self,
        batches: Sequence[Sequence[Any]],
        metrics: Callable[[nn.Module, Sequence[Any]], dict[str, Any]] | None = None,
    ) -> Diagnostic:
        """Mean loss (and ``metrics(model, batch)`` values) over ``batches``, per model."""
        was = self.model.training
        self.model.eval()
        agg = Aggregator()
        try:
            for batch in batches:
                values = {"loss": self.step_fn(self.model, batch)}
                if metrics is not None:
                    values.update(metrics(self.model, batch))
                agg.update({"eval": values}, weight=len(batch))
        finally:
            self.model.train(was)
        return agg.data

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "epoch": self.epoch,
            "position": self.position,
        }

    def save(self, path: str | Path) -> None:
        """Write a checkpoint atomically: a temporary file in the same folder, then a rename."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                torch.save(self.state(), fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def load(self, path: str | Path) -> None:
        """Resume from a checkpoint.  Nothing changes unless the whole file is valid."""
        path = Path(path)
        try:
            state = torch.load(path, weights_only=True, map_location="cpu")
        except Exception as err:
            raise FoldError(
                f"Trainer.load: cannot read {path} as a fold checkpoint ({type(err).__name__}: "
                f"{str(err).splitlines()[0][:200]}). Checkpoints are read with weights_only=True: "
                "truncated files and files holding arbitrary Python objects are refused."
            ) from err
        want = {"model", "optimizer", "scheduler", "torch_rng", "python_rng", "epoch", "position"}
        if not isinstance(state, dict) or set(state) != want:
            raise FoldError(
                f"Trainer.load: {path} is not a Trainer checkpoint (expected keys {sorted(want)})."
            )
        current = self.model.state_dict()
        saved = state["model"]
        problems = sorted(set(current) ^ set(saved))
        problems += [
            f"{k}: {tuple(saved[k].shape)} != {tuple(v.shape)}"
            for k, v in current.items()
            if k in saved and saved[k].shape != v.shape
        ]
        if problems:
            raise FoldError(
                f"Trainer.load: {path} holds another architecture; differences: {problems[:5]}. "
                "The live model was left unchanged."
            )
        self.model.load_state_dict(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(_as_tuple(state["python_rng"]))
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def _tqdm() -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm
