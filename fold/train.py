"""A small training loop: epochs, micro-batches, hooks, progress, diagnostics, checkpoints.

``Trainer`` runs a user step function over batches (a list of them, or any iterable such as a
``DataLoader``; each batch a list of examples, e.g. trees, or whatever the step takes), for a
plain module or a ``BatchModule`` sweep (then the step's loss is ``(N,)``, one
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

import copy
import itertools
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fold._io import atomic_save
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
        self.steps = 0  # optimizer steps taken (the step of TensorBoard curves)
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
        if self.micro_batch is None:  # any batch: a list of trees, a DataLoader's (x, y), a dict
            loss = self.step_fn(self.model, batch)
            (loss.sum() if loss.dim() else loss).backward()
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
            return loss.detach()
        if not isinstance(batch, Sequence):
            raise FoldError(
                f"Trainer: micro_batch={self.micro_batch} splits a batch into micro-batches of "
                f"examples, but a batch is a {type(batch).__name__}. Fix: give batches as lists "
                "of examples (a DataLoader with collate_fn=list), or micro_batch=None."
            )
        if not len(batch):
            raise FoldError(
                f"Trainer: an empty batch (micro_batch={self.micro_batch}); a step needs at "
                "least one example. Fix: drop empty batches (a DataLoader with drop_last=True "
                "never yields one)."
            )
        size = self.micro_batch
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
        batches: Iterable[Sequence[Any]],
        epochs: int,
        checkpoint: str | Path | None = None,
        every: int = 1,
        writer: Any = None,
    ) -> list[Diagnostic]:
        """Train until ``epochs`` epochs are complete (continuing a loaded run where it stopped).

        ``batches``: a sequence of batches (a list: shuffled per epoch with ``seed + epoch``),
        or any iterable of them, such as a ``torch.utils.data.DataLoader`` (iterated afresh
        each epoch in its own order; a resumed run skips the batches of the epoch already
        done, so it repeats the interrupted run exactly when the loader's order is seeded).
        The scheduler, if any, steps once per optimizer step, right after it (per batch, as
        ``torch.optim.lr_scheduler`` schedulers expect when they count steps); for one that
        counts epochs, pass ``scheduler=None`` and step it in an ``epoch_end`` hook.

        With ``checkpoint``, the state is saved there every ``every`` batches and at the end of
        each epoch.  ``writer``: a TensorBoard ``SummaryWriter`` (anything with
        ``add_scalar``) that gets the loss of every step (``train/loss``, and
        ``train/loss/model_<i>`` per model of a sweep) and the epoch mean
        (``train/epoch_loss``).  Returns the per-epoch diagnostics (mean training loss, per model).
        """
        if type(epochs) is not int or epochs < 0:
            raise FoldError(f"Trainer.fit: epochs={epochs!r}; expected a non-negative int.")
        if type(every) is not int or every < 1:
            raise FoldError(f"Trainer.fit: every={every!r}; expected a positive int.")
        if writer is not None and not callable(getattr(writer, "add_scalar", None)):
            raise FoldError(
                f"Trainer.fit: writer is a {type(writer).__name__}, which has no add_scalar. "
                "Fix: pass torch.utils.tensorboard.SummaryWriter(log_dir)."
            )
        indexable = isinstance(batches, Sequence) and not isinstance(batches, (str, bytes))
        if not indexable and not isinstance(batches, Iterable):
            raise FoldError(
                f"Trainer.fit: batches is a {type(batches).__name__}; expected a list of batches "
                "or an iterable of them (e.g. a DataLoader)."
            )
        self._checkpoint = Path(checkpoint) if checkpoint is not None else None
        self._every = every
        bar_cls = _tqdm() if self.progress else None
        while self.epoch < epochs:
            total = len(batches) if hasattr(batches, "__len__") else None  # type: ignore[arg-type]
            if indexable:
                order = self._order(len(batches))  # type: ignore[arg-type]
                stream: Iterator[Any] = (batches[i] for i in order[self.position :])  # type: ignore[index]
            else:
                stream = itertools.islice(iter(batches), self.position, None)
            agg = Aggregator()
            self._run_hooks("epoch_start")
            bar = (
                bar_cls(
                    total=total,
                    initial=self.position,
                    desc=f"epoch {self.epoch + 1}/{epochs}",
                    leave=False,
                )
                if bar_cls
                else None
            )
            for batch in stream:
                self._run_hooks("batch_start")
                self.last_loss = self.train_step(batch)
                agg.update({"train": {"loss": self.last_loss}}, weight=_size(batch))
                self.position += 1
                self.steps += 1
                if writer is not None:
                    _log_loss(writer, "train/loss", self.last_loss, self.steps)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{float(self.last_loss.mean()):.4f}")
                if self._checkpoint is not None and self.position % self._every == 0:
                    self.save(self._checkpoint)
                self._run_hooks("step_end")
            if bar is not None:
                bar.close()
            self.history.append(agg.data)
            if writer is not None and "train" in agg.data:
                _log_loss(writer, "train/epoch_loss", agg.data["train"]["loss"], self.epoch + 1)
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
                agg.update({"eval": values}, weight=_size(batch))
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
            "steps": self.steps,
        }

    def save(self, path: str | Path) -> None:
        """Write a checkpoint atomically: a temporary file in the same folder, then a rename."""
        atomic_save(self.state(), path)

    def load(self, path: str | Path) -> None:
        """Resume from a checkpoint.  Nothing changes unless the whole file is valid: it is
        read and checked first (model tensors, optimizer groups and state, RNG states,
        position), then applied; should applying still fail, everything is put back."""
        path = Path(path)
        if path.is_file() and path.stat().st_size == 0:
            raise FoldError(
                f"Trainer.load: {path} is empty (0 bytes), not a checkpoint; an interrupted copy? "
                "The live model was left unchanged."
            )
        try:
            state = torch.load(path, weights_only=True, map_location="cpu")
        except Exception as err:
            raise FoldError(
                f"Trainer.load: cannot read {path} as a fold checkpoint ({type(err).__name__}: "
                f"{(str(err).splitlines() or [''])[0][:200]}). Checkpoints are read with "
                "weights_only=True: truncated files and files holding arbitrary Python objects "
                "are refused."
            ) from err
        self._check_state(state, path)
        before = copy.deepcopy(self.state())
        try:
            self._apply_state(state)
        except Exception as err:
            self._apply_state(before, rollback=True)
            raise FoldError(
                f"Trainer.load: {path} could not be applied ({type(err).__name__}: "
                f"{(str(err).splitlines() or [''])[0][:200]}); the model, optimizer, scheduler "
                "and RNG states were put back as they were."
            ) from err

    def _check_state(self, state: Any, path: Path) -> None:
        want = {"model", "optimizer", "scheduler", "torch_rng", "python_rng", "epoch", "position"}
        if not isinstance(state, dict) or not want <= set(state) <= want | {"steps"}:
            raise FoldError(
                f"Trainer.load: {path} is not a Trainer checkpoint (expected keys {sorted(want)})."
            )
        bad = f"Trainer.load: {path} "
        current = self.model.state_dict()
        saved = state["model"]
        if not isinstance(saved, dict):
            raise FoldError(bad + "holds no model state dict.")
        problems = sorted(set(current) ^ set(saved))
        problems += [
            f"{k}: {_shape(saved[k])} != {tuple(v.shape)}"
            for k, v in current.items()
            if k in saved and (not isinstance(saved[k], torch.Tensor) or saved[k].shape != v.shape)
        ]
        if problems:
            raise FoldError(
                bad + f"holds another architecture; differences: {problems[:5]}. "
                "The live model was left unchanged."
            )
        opt, live = state["optimizer"], self.optimizer.state_dict()
        if not isinstance(opt, dict) or set(opt) != set(live):
            raise FoldError(bad + "holds no optimizer state of this optimizer's kind.")
        groups = opt["param_groups"]
        if not isinstance(groups, list) or [len(g.get("params", ())) for g in groups] != [
            len(g["params"]) for g in live["param_groups"]
        ]:
            raise FoldError(
                bad + "holds optimizer state for other parameter groups "
                f"({[len(g.get('params', ())) for g in groups] if isinstance(groups, list) else groups!r} "
                f"parameters per group; this optimizer has "
                f"{[len(g['params']) for g in live['param_groups']]})."
            )
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        ids = [i for g in groups for i in g["params"]]
        by_id = dict(zip(ids, params))
        for pid, st in opt["state"].items():
            p = by_id.get(pid)
            if p is None or not isinstance(st, dict):
                raise FoldError(bad + f"holds optimizer state for unknown parameter {pid!r}.")
            for key, v in st.items():
                if isinstance(v, torch.Tensor) and v.numel() > 1 and v.shape != p.shape:
                    if not (
                        key == "step" and v.dim() == 1 and p.dim() and v.shape[0] == p.shape[0]
                    ):
                        raise FoldError(
                            bad + f"holds optimizer state {key!r} of shape {tuple(v.shape)} for "
                            f"a parameter of shape {tuple(p.shape)}."
                        )
        if (self.scheduler is None) != (state["scheduler"] is None):
            raise FoldError(
                bad
                + (
                    "holds no scheduler state, but this Trainer has a scheduler."
                    if state["scheduler"] is None
                    else "holds scheduler state, but this Trainer has no scheduler."
                )
            )
        rng = state["torch_rng"]
        live_rng = torch.get_rng_state()
        if (
            not isinstance(rng, torch.Tensor)
            or rng.dtype != live_rng.dtype
            or rng.shape != live_rng.shape
        ):
            raise FoldError(bad + "holds no valid torch RNG state.")
        try:
            random.Random().setstate(_as_tuple(state["python_rng"]))
        except (TypeError, ValueError) as err:
            raise FoldError(bad + f"holds no valid Python RNG state ({err}).") from None
        for key in ("epoch", "position", "steps"):
            v = state.get(key, 0)
            if type(v) is not int or v < 0:
                raise FoldError(bad + f"holds {key}={v!r}; expected a non-negative int.")

    def _apply_state(self, state: dict[str, Any], rollback: bool = False) -> None:
        """Load every part of ``state``; a ``rollback`` goes on past a part that fails (that
        part raised before it changed anything, or it would not need putting back)."""

        def position() -> None:
            self.epoch, self.position = int(state["epoch"]), int(state["position"])
            self.steps = int(state.get("steps", 0))

        parts = [
            lambda: self.model.load_state_dict(state["model"]),
            lambda: self.optimizer.load_state_dict(state["optimizer"]),
            lambda: (
                self.scheduler is None
                or state["scheduler"] is None
                or self.scheduler.load_state_dict(state["scheduler"])
            ),
            lambda: torch.set_rng_state(state["torch_rng"]),
            lambda: random.setstate(_as_tuple(state["python_rng"])),
            position,
        ]
        for part in parts:
            if not rollback:
                part()
                continue
            try:
                part()
            except Exception:  # noqa: BLE001 - put back what can be put back
                continue


def _size(batch: Any) -> int:
    """How many examples a batch holds: a list of examples, or tensors with a batch dim."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if (
        isinstance(batch, (tuple, list))
        and batch
        and all(isinstance(b, torch.Tensor) for b in batch)
    ):
        return batch[0].shape[0] if batch[0].dim() else 1
    if isinstance(batch, dict):
        first = next(iter(batch.values()), None)
        return first.shape[0] if isinstance(first, torch.Tensor) and first.dim() else 1
    return len(batch) if hasattr(batch, "__len__") else 1


def _shape(v: Any) -> Any:
    return tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__


def _log_loss(writer: Any, tag: str, loss: torch.Tensor, step: int) -> None:
    """One TensorBoard curve for a mean loss; for (N,) losses the mean and one per model."""
    loss = loss.detach().float().cpu()
    writer.add_scalar(tag, float(loss.mean()), step)
    if loss.dim() and loss.numel() > 1:
        for i, v in enumerate(loss.tolist()):
            writer.add_scalar(f"{tag}/model_{i}", v, step)


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def _tqdm() -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm
