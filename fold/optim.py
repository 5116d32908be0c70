"""Per-model optimizers, schedules and clipping for parameters whose dim 0 is the model axis.

A ``BatchModule`` of N models keeps every parameter as ``(N, ...)``.  These optimizers take
each hyperparameter as a scalar or as N values, and step model i exactly as ``torch.optim``
would step a standalone model i with its own scalar hyperparameters.  Nothing mixes models:
a NaN or a huge gradient in model j changes model j alone, and a frozen model (early
stopping) keeps its parameters and optimizer state bitwise unchanged::

    opt = fold.optim.Adam(bm.parameters(), batch=8, lr=[1e-3 * 2**i for i in range(8)])
    sched = fold.optim.CosineLR(opt, total_steps=[100] * 8)
    for batch in data:
        opt.zero_grad(); loss(batch).sum().backward()
        fold.optim.clip_grad_norm_(bm.parameters(), max_norm=1.0, batch=8)
        opt.step(); sched.step()
    opt.freeze(3)          # model 3 stops here; the others go on
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from fold.errors import FoldError

__all__ = ["SGD", "Adam", "AdamW", "CosineLR", "LinearWarmup", "StepLR", "clip_grad_norm_"]

Hyper = float | Sequence[float] | torch.Tensor


def _per_model(name: str, value: Hyper, batch: int, where: str) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=torch.float64).flatten()
    if t.numel() == 1:
        return t.expand(batch).clone()
    if t.numel() != batch:
        raise FoldError(
            f"{where}: {name} has {t.numel()} values for {batch} models. Fix: give one value, or N={batch}."
        )
    return t.clone()


class _PerModelOptimizer(torch.optim.Optimizer):
    """Base: per-model hyperparameters as (N,) float64 tensors in the param group; a frozen
    mask; per-model step counts in the state of every parameter."""

    hypers: tuple[str, ...] = ()

    def __init__(self, params: Iterable[torch.Tensor], batch: int, **hyper: Any) -> None:
        where = type(self).__name__
        if type(batch) is not int or batch < 1:
            raise FoldError(
                f"{where}: batch must be the number of models, a positive int; got {batch!r}."
            )
        self.batch = batch
        defaults = {k: _per_model(k, v, batch, where) for k, v in hyper.items() if k in self.hypers}
        defaults.update({k: v for k, v in hyper.items() if k not in self.hypers})
        defaults["frozen"] = torch.zeros(batch, dtype=torch.bool)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() == 0 or p.shape[0] != batch:
                    raise FoldError(
                        f"{where}: a parameter of shape {tuple(p.shape)} has no model dim of "
                        f"size {batch} first. Fix: pass BatchModule parameters, whose dim 0 is the model."
                    )

    def _h(self, group: dict[str, Any], name: str, like: torch.Tensor) -> torch.Tensor:
        """Hyperparameter ``name`` shaped to broadcast over ``like`` (N, ...)."""
        return group[name].to(like.device, like.dtype).view(-1, *([1] * (like.dim() - 1)))

    def freeze(self, i: int) -> None:
        """Stop model ``i``: its parameters and state stay bitwise unchanged from now on."""
        for group in self.param_groups:
            group["frozen"][i] = True

    def unfreeze(self, i: int) -> None:
        for group in self.param_groups:
            group["frozen"][i] = False

    def set_hyper(self, name: str, values: Hyper) -> None:
        """Set hyperparameter ``name`` (e.g. ``lr``) of every model: a scalar or N values."""
        for group in self.param_groups:
            group[name] = _per_model(name, values, self.batch, type(self).__name__)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                active = (~group["frozen"]).to(p.device).view(-1, *([1] * (p.dim() - 1)))
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros(self.batch, dtype=torch.float64, device=p.device)
                    self._init_state(state, p)
                step = state["step"] + (~group["frozen"]).to(p.device).to(torch.float64)
                new_p, new_state = self._update(group, p, p.grad, state, step)
                p.copy_(torch.where(active, new_p, p))
                for k, v in new_state.items():
                    state[k] = torch.where(active, v, state[k])
                state["step"] = step
        return loss

    def _init_state(self, state: dict[str, Any], p: torch.Tensor) -> None:
        raise NotImplementedError

    def _update(
        self,
        group: dict[str, Any],
        p: torch.Tensor,
        g: torch.Tensor,
        state: dict[str, Any],
        step: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError


class SGD(_PerModelOptimizer):
    """``torch.optim.SGD`` per model: lr, momentum, dampening, weight_decay each a scalar or N values."""

    hypers = ("lr", "momentum", "dampening", "weight_decay")

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        batch: int,
        lr: Hyper = 1e-3,
        momentum: Hyper = 0.0,
        dampening: Hyper = 0.0,
        weight_decay: Hyper = 0.0,
        nesterov: bool = False,
    ) -> None:
        super().__init__(
            params,
            batch,
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
        )

    def _init_state(self, state: dict[str, Any], p: torch.Tensor) -> None:
        state["momentum_buffer"] = torch.zeros_like(p)

    def _update(self, group, p, g, state, step):  # type: ignore[no-untyped-def]
        d = g + self._h(group, "weight_decay", p) * p
        mom = self._h(group, "momentum", p)
        first = (step == 1).view(-1, *([1] * (p.dim() - 1)))
        buf = torch.where(
            first, d, mom * state["momentum_buffer"] + (1 - self._h(group, "dampening", p)) * d
        )
        use = d + mom * buf if group["nesterov"] else buf
        d = torch.where(mom != 0, use, d)
        return p - self._h(group, "lr", p) * d, {"momentum_buffer": buf}


class Adam(_PerModelOptimizer):
    """``torch.optim.Adam`` per model: lr, beta1, beta2, eps, weight_decay (L2) each a scalar or N values."""

    hypers = ("lr", "beta1", "beta2", "eps", "weight_decay")
    decoupled = False

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        batch: int,
        lr: Hyper = 1e-3,
        betas: tuple[Hyper, Hyper] = (0.9, 0.999),
        eps: Hyper = 1e-8,
        weight_decay: Hyper = 0.0,
    ) -> None:
        super().__init__(
            params, batch, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay
        )

    def _init_state(self, state: dict[str, Any], p: torch.Tensor) -> None:
        state["exp_avg"] = torch.zeros_like(p)
        state["exp_avg_sq"] = torch.zeros_like(p)

    def _update(self, group, p, g, state, step):  # type: ignore[no-untyped-def]
        lr, wd = self._h(group, "lr", p), self._h(group, "weight_decay", p)
        b1, b2, eps = (
            self._h(group, "beta1", p),
            self._h(group, "beta2", p),
            self._h(group, "eps", p),
        )
        if self.decoupled:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
        m = state["exp_avg"] + (g - state["exp_avg"]) * (1 - b1)
        v = state["exp_avg_sq"] * b2 + (1 - b2) * g * g
        t = step.to(p.dtype).view(-1, *([1] * (p.dim() - 1))).clamp(min=1)
        bias1, bias2 = 1 - b1**t, 1 - b2**t
        denom = v.sqrt() / bias2.sqrt() + eps
        return p - (lr / bias1) * m / denom, {"exp_avg": m, "exp_avg_sq": v}


class AdamW(Adam):
    """``torch.optim.AdamW`` per model (decoupled weight decay, default 0.01)."""

    decoupled = True

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        batch: int,
        lr: Hyper = 1e-3,
        betas: tuple[Hyper, Hyper] = (0.9, 0.999),
        eps: Hyper = 1e-8,
        weight_decay: Hyper = 1e-2,
    ) -> None:
        super().__init__(params, batch, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


@torch.no_grad()
def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: Hyper, batch: int) -> torch.Tensor:
    """Clip each model's gradients by its own total norm; returns the (N,) norms before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(batch)
    for g in grads:
        if g.dim() == 0 or g.shape[0] != batch:
            raise FoldError(
                f"clip_grad_norm_: a gradient of shape {tuple(g.shape)} has no model dim of size {batch} first."
            )
    norms = torch.stack([g.reshape(batch, -1).pow(2).sum(1) for g in grads]).sum(0).sqrt()
    limit = _per_model("max_norm", max_norm, batch, "clip_grad_norm_").to(norms)
    coef = (limit / (norms + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype).view(-1, *([1] * (g.dim() - 1))))
    return norms


class _Schedule:
    """A per-model learning-rate schedule: ``lr_i(t)`` from each model's base lr and settings."""

    def __init__(self, optimizer: _PerModelOptimizer) -> None:
        self.optimizer = optimizer
        self.base = optimizer.param_groups[0]["lr"].clone()
        self.t = 0
        self.optimizer.set_hyper("lr", self.lr_at(0))

    def lr_at(self, t: int) -> torch.Tensor:
        raise NotImplementedError

    def step(self) -> None:
        self.t += 1
        self.optimizer.set_hyper("lr", self.lr_at(self.t))

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "base": self.base.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.t, self.base = state["t"], state["base"].clone()
        self.optimizer.set_hyper("lr", self.lr_at(self.t))


class StepLR(_Schedule):
    """``lr_i * gamma_i ** (t // step_size_i)``, settings per model."""

    def __init__(self, optimizer: _PerModelOptimizer, step_size: Hyper, gamma: Hyper = 0.1) -> None:
        n = optimizer.batch
        self.step_size = _per_model("step_size", step_size, n, "StepLR")
        self.gamma = _per_model("gamma", gamma, n, "StepLR")
        super().__init__(optimizer)

    def lr_at(self, t: int) -> torch.Tensor:
        return self.base * self.gamma ** torch.floor(t / self.step_size)


class CosineLR(_Schedule):
    """Cosine annealing from ``lr_i`` to ``min_lr_i`` over ``total_steps_i``, settings per model."""

    def __init__(
        self, optimizer: _PerModelOptimizer, total_steps: Hyper, min_lr: Hyper = 0.0
    ) -> None:
        n = optimizer.batch
        self.total = _per_model("total_steps", total_steps, n, "CosineLR")
        self.min_lr = _per_model("min_lr", min_lr, n, "CosineLR")
        super().__init__(optimizer)

    def lr_at(self, t: int) -> torch.Tensor:
        frac = (t / self.total).clamp(max=1.0)
        return self.min_lr + (self.base - self.min_lr) * (1 + torch.cos(math.pi * frac)) / 2


class LinearWarmup(_Schedule):
    """``lr_i * min(1, (t + 1) / warmup_i)``: linear warm-up over ``warmup_i`` steps, per model."""

    def __init__(self, optimizer: _PerModelOptimizer, warmup_steps: Hyper) -> None:
        self.warmup = _per_model("warmup_steps", warmup_steps, optimizer.batch, "LinearWarmup")
        super().__init__(optimizer)

    def lr_at(self, t: int) -> torch.Tensor:
        return self.base * ((t + 1) / self.warmup).clamp(max=1.0)
