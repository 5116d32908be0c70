"""Per-model optimizers, schedules and clipping for parameters whose dim 0 is the model axis.

A ``BatchModule`` of N models keeps every parameter as ``(N, ...)``.  These optimizers take
each hyperparameter as a scalar or as N values, and step model i exactly as ``torch.optim``
would step a standalone model i with its own scalar hyperparameters.  Nothing mixes models:
a NaN or a huge gradient in model j changes model j alone, and a frozen model (early
stopping) keeps its parameters and optimizer state bitwise unchanged::

    opt = fold.optim.Adam(bm.parameters(), lr=[1e-3 * 2**i for i in range(8)])  # N = 8
    sched = fold.optim.CosineLR(opt, total_steps=[100] * 8)
    for batch in data:
        opt.zero_grad(); loss(batch).sum().backward()
        fold.optim.clip_grad_norm_(bm.parameters(), max_norm=1.0)
        opt.step(); sched.step()
    opt.freeze(3)          # model 3 stops here; the others go on

They are called as ``torch.optim`` is called (``lr`` second); N comes from a BatchModule's
parameters (each knows its number of models), else from the per-model lists, else
``batch=N``.  ``torch.optim.lr_scheduler`` schedulers work too: they step a common factor
on every model's own lr (see ``_PerModelOptimizer``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from fold.batched_ops.core import model_index
from fold.errors import FoldError

__all__ = [
    "SGD",
    "Adam",
    "AdamW",
    "CosineLR",
    "LinearWarmup",
    "StepLR",
    "clip_grad_norm_",
    "infer_models",
]

Hyper = float | Sequence[float] | torch.Tensor

# Valid ranges, as torch.optim checks them: name -> (test, what is expected).
_RANGES: dict[str, tuple[Any, str]] = {
    "lr": (lambda t: t >= 0, ">= 0"),
    "momentum": (lambda t: t >= 0, ">= 0"),
    "dampening": (lambda t: t == t, "a number"),
    "weight_decay": (lambda t: t >= 0, ">= 0"),
    "eps": (lambda t: t >= 0, ">= 0"),
    "beta1": (lambda t: (t >= 0) & (t < 1), "in [0, 1)"),
    "beta2": (lambda t: (t >= 0) & (t < 1), "in [0, 1)"),
    "max_norm": (lambda t: t >= 0, ">= 0"),
    "step_size": (lambda t: t > 0, "> 0"),
    "gamma": (lambda t: t >= 0, ">= 0"),
    "total_steps": (lambda t: t > 0, "> 0"),
    "min_lr": (lambda t: t >= 0, ">= 0"),
    "warmup_steps": (lambda t: t > 0, "> 0"),
}


def _per_model(name: str, value: Hyper, batch: int, where: str) -> torch.Tensor:
    """``value`` as (N,) float64, checked against ``name``'s valid range per model."""
    try:
        t = torch.as_tensor(value, dtype=torch.float64).flatten()
    except (TypeError, ValueError, RuntimeError):
        raise FoldError(
            f"{where}: {name}={value!r}; expected a number, or N={batch} numbers (one per model)."
        ) from None
    if t.numel() == 1:
        t = t.expand(batch)
    elif t.numel() != batch:
        raise FoldError(
            f"{where}: {name} has {t.numel()} values for {batch} models. Fix: give one value, or N={batch}."
        )
    rule = _RANGES.get(name)
    if rule is not None:
        bad = ~rule[0](t)
        if bad.any():
            i = int(bad.nonzero()[0])
            raise FoldError(
                f"{where}: {name} of model {i} is {float(t[i])!r}; expected {rule[1]}, as "
                "torch.optim requires."
            )
    return t.clone()


def _models_of(values: Iterable[Any]) -> set[int]:
    """The N that per-model hyperparameter lists tell (their lengths, where more than one)."""
    out = set()
    for v in values:
        if isinstance(v, torch.Tensor) and v.numel() > 1:
            out.add(v.numel())
        elif isinstance(v, Sequence) and not isinstance(v, str) and len(v) > 1:
            out.add(len(v))
    return out


def infer_models(
    params: Iterable[Any], hypers: Iterable[Any], batch: int | None, where: str
) -> int:
    """The number of models: ``batch``, else what the parameters know (a BatchModule tags
    its parameters), else the length of the per-model hyperparameter lists."""
    tagged = {getattr(p, "_fold_models", None) for p in params} - {None}
    if batch is not None:
        if type(batch) is not int or batch < 1:
            raise FoldError(
                f"{where}: batch must be the number of models, a positive int; got {batch!r}."
            )
        if tagged and tagged != {batch}:
            raise FoldError(
                f"{where}: batch={batch}, but the parameters belong to a BatchModule of "
                f"{sorted(tagged)} models. Fix: leave batch out; it is inferred."
            )
        return batch
    if len(tagged) == 1:
        return tagged.pop()
    if len(tagged) > 1:
        raise FoldError(
            f"{where}: the parameters come from BatchModules of {sorted(tagged)} models; one "
            "optimizer steps models of one sweep. Fix: one optimizer per BatchModule."
        )
    lengths = _models_of(hypers)
    if len(lengths) == 1:
        return lengths.pop()
    raise FoldError(
        f"{where}: cannot tell the number of models N: the parameters are not a BatchModule's "
        + (
            "and no hyperparameter is a per-model list"
            if not lengths
            else f"and the per-model lists have lengths {sorted(lengths)}"
        )
        + ". Fix: pass batch=N."
    )


class _PerModelOptimizer(torch.optim.Optimizer):
    """Base: per-model hyperparameters as (N,) float64 tensors in each param group; a frozen
    mask; per-model step counts in the state of every parameter.

    ``group["lr"]`` is a plain number, a factor on every model's own lr (``group["model_lr"]``,
    N values) that starts at 1.0: ``torch.optim.lr_scheduler`` schedulers step it, so they
    scale each model's lr (``ExponentialLR(opt, 0.9)`` multiplies every model's lr by 0.9 per
    step).  fold's own schedulers (``StepLR``, ``CosineLR``, ``LinearWarmup``) set each model's
    lr with its own settings.  The lr a model steps with is ``model_lr * lr``.
    """

    hypers: tuple[str, ...] = ()

    def __init__(self, params: Iterable[Any], batch: int | None, **hyper: Any) -> None:
        where = type(self).__name__
        groups = list(params)
        if not groups:
            raise FoldError(f"{where}: got no parameters. Fix: pass model.parameters().")
        flat = [
            p
            for g in groups
            for p in (g["params"] if isinstance(g, dict) else [g])
            if isinstance(p, torch.Tensor)
        ]
        per_group = [g.get(k) for g in groups if isinstance(g, dict) for k in self.hypers]
        self.batch = infer_models(flat, [*hyper.values(), *per_group], batch, where)
        defaults = dict(hyper)
        defaults["frozen"] = torch.zeros(self.batch, dtype=torch.bool)
        super().__init__(groups, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (as ``torch.optim``); its hyperparameters become per-model (N,)."""
        where = type(self).__name__
        group = dict(param_group)
        if "lr" in group and "model_lr" not in group:
            group["model_lr"] = group.pop("lr")
        for k in self.hypers:
            key = "model_lr" if k == "lr" else k
            value = group.get(key, self.defaults.get(k))
            if value is not None:
                group[key] = _per_model(k, value, self.batch, where)
        group.setdefault("lr", 1.0)
        group["frozen"] = group.get("frozen", self.defaults["frozen"]).clone()
        self._check_extra(group, where)
        super().add_param_group(group)
        for p in self.param_groups[-1]["params"]:
            if p.dim() == 0 or p.shape[0] != self.batch:
                raise FoldError(
                    f"{where}: a parameter of shape {tuple(p.shape)} has no model dim of "
                    f"size {self.batch} first. Fix: pass BatchModule parameters, whose dim 0 is the model."
                )

    def _check_extra(self, group: dict[str, Any], where: str) -> None:
        """Checks of one group that span hyperparameters (nesterov)."""

    def _h(self, group: dict[str, Any], name: str, like: torch.Tensor) -> torch.Tensor:
        """Hyperparameter ``name`` shaped to broadcast over ``like`` (N, ...)."""
        value = group["model_lr"] * float(group["lr"]) if name == "lr" else group[name]
        return value.to(like.device, like.dtype).view(-1, *([1] * (like.dim() - 1)))

    def hyper(self, name: str, group: int = 0) -> torch.Tensor:
        """The (N,) values of hyperparameter ``name`` that the next step uses (for ``lr``:
        each model's lr times the factor torch's schedulers step)."""
        g = self.param_groups[group]
        if name == "lr":
            return g["model_lr"] * float(g["lr"])
        return g[name].clone()

    def freeze(self, i: int) -> None:
        """Stop model ``i``: its parameters and state stay bitwise unchanged from now on."""
        i = model_index(i, self.batch, f"{type(self).__name__}.freeze")
        for group in self.param_groups:
            group["frozen"][i] = True

    def unfreeze(self, i: int) -> None:
        i = model_index(i, self.batch, f"{type(self).__name__}.unfreeze")
        for group in self.param_groups:
            group["frozen"][i] = False

    def set_hyper(self, name: str, values: Hyper) -> None:
        """Set hyperparameter ``name`` (e.g. ``lr``) of every model: a scalar or N values."""
        if name not in self.hypers:
            raise FoldError(
                f"{type(self).__name__}.set_hyper: unknown hyperparameter {name!r}; expected "
                f"one of {list(self.hypers)}."
            )
        value = _per_model(name, values, self.batch, type(self).__name__)
        for group in self.param_groups:
            group["model_lr" if name == "lr" else name] = value.clone()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by ``state_dict()``; everything is checked first (groups,
        parameters per group, per-model hyperparameters of N values, state tensor shapes),
        and nothing changes on failure."""
        where = f"{type(self).__name__}.load_state_dict"
        if not isinstance(state_dict, dict) or set(state_dict) != {"state", "param_groups"}:
            raise FoldError(f"{where}: expected a dict with 'state' and 'param_groups'.")
        groups = state_dict["param_groups"]
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            raise FoldError(
                f"{where}: the state has {len(groups) if isinstance(groups, list) else '?'} "
                f"param groups, this optimizer {len(self.param_groups)}."
            )
        shapes: dict[Any, tuple[int, ...]] = {}
        for k, (mine, theirs) in enumerate(zip(self.param_groups, groups)):
            if not isinstance(theirs, dict) or len(theirs.get("params", ())) != len(mine["params"]):
                raise FoldError(
                    f"{where}: param group {k} holds another number of parameters than this "
                    "optimizer's."
                )
            for key, value in mine.items():
                if isinstance(value, torch.Tensor):
                    got = theirs.get(key)
                    if not isinstance(got, torch.Tensor) or got.shape != value.shape:
                        raise FoldError(
                            f"{where}: param group {k}, {key!r} is "
                            f"{tuple(got.shape) if isinstance(got, torch.Tensor) else got!r}; "
                            f"this optimizer keeps {tuple(value.shape)} (N={self.batch})."
                        )
                    if key in self.hypers or key == "model_lr":
                        _per_model("lr" if key == "model_lr" else key, got, self.batch, where)
            for pid, p in zip(theirs["params"], mine["params"]):
                shapes[pid] = tuple(p.shape)
        for pid, st in state_dict["state"].items():
            if pid not in shapes or not isinstance(st, dict):
                raise FoldError(f"{where}: the state names parameter {pid!r}, which no group has.")
            for key, value in st.items():
                want = (self.batch,) if key == "step" else shapes[pid]
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != want:
                    got = tuple(value.shape) if isinstance(value, torch.Tensor) else value
                    raise FoldError(
                        f"{where}: state {key!r} of parameter {pid} is {got!r}; expected a "
                        f"tensor of shape {want}. Nothing was loaded."
                    )
        super().load_state_dict(state_dict)

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
                all_active = not bool(group["frozen"].any())  # host tensors: no device sync
                new_p, new_state = self._update(group, p, p.grad, state, step)
                if new_p is not None:  # (None: updated in place, every model active)
                    p.copy_(new_p if all_active else torch.where(active, new_p, p))
                for k, v in new_state.items():
                    state[k] = v if all_active else torch.where(active, v, state[k])
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
    """``torch.optim.SGD`` per model: lr, momentum, dampening, weight_decay each a scalar or
    N values; called as ``torch.optim.SGD`` is (``SGD(bm.parameters(), lr=[...])``), with N
    inferred from a BatchModule's parameters or the per-model lists (or ``batch=N``)."""

    hypers = ("lr", "momentum", "dampening", "weight_decay")

    def __init__(
        self,
        params: Iterable[Any],
        lr: Hyper = 1e-3,
        momentum: Hyper = 0.0,
        dampening: Hyper = 0.0,
        weight_decay: Hyper = 0.0,
        nesterov: bool = False,
        *,
        batch: int | None = None,
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

    def _check_extra(self, group: dict[str, Any], where: str) -> None:
        if group.get("nesterov", self.defaults["nesterov"]):
            bad = (group["momentum"] <= 0) | (group["dampening"] != 0)
            if bad.any():
                i = int(bad.nonzero()[0])
                raise FoldError(
                    f"{where}: nesterov needs momentum > 0 and dampening 0 for every model; "
                    f"model {i} has momentum {float(group['momentum'][i])!r}, dampening "
                    f"{float(group['dampening'][i])!r}, as torch.optim.SGD requires."
                )

    def _init_state(self, state: dict[str, Any], p: torch.Tensor) -> None:
        state["momentum_buffer"] = torch.zeros_like(p)

    def _update(self, group, p, g, state, step):  # type: ignore[no-untyped-def]
        if (
            not group["nesterov"]
            and not bool(group["momentum"].any())
            and not bool(group["weight_decay"].any())
            and not bool(group["frozen"].any())
        ):  # plain SGD for every model (host tensors: no device sync): one pass, in place
            p.addcmul_(self._h(group, "lr", p), g, value=-1)
            return None, {}
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
    """``torch.optim.Adam`` per model: lr, beta1, beta2, eps, weight_decay (L2) each a scalar
    or N values; called as ``torch.optim.Adam`` is (see :class:`SGD` for N)."""

    hypers = ("lr", "beta1", "beta2", "eps", "weight_decay")
    decoupled = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: Hyper = 1e-3,
        betas: tuple[Hyper, Hyper] = (0.9, 0.999),
        eps: Hyper = 1e-8,
        weight_decay: Hyper = 0.0,
        *,
        batch: int | None = None,
    ) -> None:
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise FoldError(
                f"{type(self).__name__}: betas={betas!r}; expected a pair (beta1, beta2), each "
                "a number or N numbers."
            )
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
        params: Iterable[Any],
        lr: Hyper = 1e-3,
        betas: tuple[Hyper, Hyper] = (0.9, 0.999),
        eps: Hyper = 1e-8,
        weight_decay: Hyper = 1e-2,
        *,
        batch: int | None = None,
    ) -> None:
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, batch=batch
        )


@torch.no_grad()
def clip_grad_norm_(
    params: Iterable[torch.Tensor], max_norm: Hyper, batch: int | None = None
) -> torch.Tensor:
    """Clip each model's gradients by its own total norm; returns the (N,) norms before
    clipping.  N is inferred as the optimizers infer it (or give ``batch=N``)."""
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    batch = infer_models(params, [max_norm], batch, "clip_grad_norm_")
    grads = [p.grad for p in params if p.grad is not None]
    limit = _per_model("max_norm", max_norm, batch, "clip_grad_norm_")
    if not grads:
        return torch.zeros(batch)
    for g in grads:
        if g.dim() == 0 or g.shape[0] != batch:
            raise FoldError(
                f"clip_grad_norm_: a gradient of shape {tuple(g.shape)} has no model dim of size {batch} first."
            )
    norms = torch.stack([g.reshape(batch, -1).pow(2).sum(1) for g in grads]).sum(0).sqrt()
    coef = (limit.to(norms) / (norms + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype).view(-1, *([1] * (g.dim() - 1))))
    return norms


def _models_of_optimizer(optimizer: Any, where: str) -> int:
    if not isinstance(optimizer, _PerModelOptimizer):
        raise FoldError(
            f"{where}: expected a fold.optim optimizer (SGD, Adam, AdamW), got "
            f"{type(optimizer).__name__}. Fix: use torch.optim.lr_scheduler with torch.optim."
        )
    return optimizer.batch


class _Schedule:
    """A per-model learning-rate schedule: ``lr_i(t)`` from each model's base lr and settings,
    in every param group from that group's own base lrs (as ``torch.optim.lr_scheduler``
    schedules each group from its own lr)."""

    def __init__(self, optimizer: _PerModelOptimizer) -> None:
        self.optimizer = optimizer
        self.base = [g["model_lr"].clone() for g in optimizer.param_groups]
        self.t = 0
        self._set()

    def lr_at(self, t: int, base: torch.Tensor | None = None) -> torch.Tensor:
        """The (N,) lrs at step ``t`` from ``base`` (the first param group's base lrs)."""
        return self._lr(t, self.base[0] if base is None else base)

    def _lr(self, t: int, base: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _set(self) -> None:
        groups = self.optimizer.param_groups
        self.base += [g["model_lr"].clone() for g in groups[len(self.base) :]]  # (added since)
        where = type(self).__name__
        for group, base in zip(groups, self.base):
            group["model_lr"] = _per_model("lr", self.lr_at(self.t, base), len(base), where)

    def step(self) -> None:
        self.t += 1
        self._set()

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "base": [b.clone() for b in self.base]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        base = state["base"]  # (one tensor: saved before the schedules kept a base per group)
        bases = [base] if isinstance(base, torch.Tensor) else list(base)
        self.t, self.base = state["t"], [b.clone() for b in bases]
        self._set()


class StepLR(_Schedule):
    """``lr_i * gamma_i ** (t // step_size_i)``, settings per model."""

    def __init__(self, optimizer: _PerModelOptimizer, step_size: Hyper, gamma: Hyper = 0.1) -> None:
        n = _models_of_optimizer(optimizer, "StepLR")
        self.step_size = _per_model("step_size", step_size, n, "StepLR")
        self.gamma = _per_model("gamma", gamma, n, "StepLR")
        super().__init__(optimizer)

    def _lr(self, t: int, base: torch.Tensor) -> torch.Tensor:
        return base * self.gamma ** torch.floor(t / self.step_size)


class CosineLR(_Schedule):
    """Cosine annealing from ``lr_i`` to ``min_lr_i`` over ``total_steps_i``, settings per model."""

    def __init__(
        self, optimizer: _PerModelOptimizer, total_steps: Hyper, min_lr: Hyper = 0.0
    ) -> None:
        n = _models_of_optimizer(optimizer, "CosineLR")
        self.total = _per_model("total_steps", total_steps, n, "CosineLR")
        self.min_lr = _per_model("min_lr", min_lr, n, "CosineLR")
        super().__init__(optimizer)

    def _lr(self, t: int, base: torch.Tensor) -> torch.Tensor:
        frac = (t / self.total).clamp(max=1.0)
        return self.min_lr + (base - self.min_lr) * (1 + torch.cos(math.pi * frac)) / 2


class LinearWarmup(_Schedule):
    """``lr_i * min(1, (t + 1) / warmup_i)``: linear warm-up over ``warmup_i`` steps, per model."""

    def __init__(self, optimizer: _PerModelOptimizer, warmup_steps: Hyper) -> None:
        n = _models_of_optimizer(optimizer, "LinearWarmup")
        self.warmup = _per_model("warmup_steps", warmup_steps, n, "LinearWarmup")
        super().__init__(optimizer)

    def _lr(self, t: int, base: torch.Tensor) -> torch.Tensor:
        return base * ((t + 1) / self.warmup).clamp(max=1.0)
