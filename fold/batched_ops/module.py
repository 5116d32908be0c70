"""``BatchModule``: N models of one architecture as one module."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vmap

from fold.batched_ops import layers as _layers  # noqa: F401  (registers the batched layers)
from fold.batched_ops.core import (
    AbstractBatchModule,
    from_merged,
    map_tensors,
    registry,
    to_merged,
)
from fold.errors import FoldError

__all__ = ["BatchModule", "VmapFallback"]

_CPU_CHUNK_BYTES = 256 * 1024


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _cat_outputs(parts: list[Any]) -> Any:
    """Concatenate per-chunk outputs (tensors, or tuples of them) along the model dim."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts, 0)
    if isinstance(first, (tuple, list)):
        return type(first)(_cat_outputs([p[i] for p in parts]) for i in range(len(first)))
    return first


# Method names a model may define that shadow nn.Module's own (TorchFold's SPINN example calls
# its combine op `children`, which breaks .to() and .cuda(), since those walk children()).
_SHADOWED = {
    "children",
    "modules",
    "parameters",
    "buffers",
    "apply",
    "to",
    "train",
    "eval",
    "cuda",
    "cpu",
}
_warned_shadow: set[tuple[type, str]] = set()


class _Call(nn.Module):
    """Calls one method of a module, so functional_call can run methods other than forward."""

    def __init__(self, module: nn.Module, method: str) -> None:
        super().__init__()
        self.module = module
        self.method = method

    def forward(self, *args: Any) -> Any:
        return _own_method(self.module, self.method)(*args)


class VmapFallback(AbstractBatchModule):
    """Any module without a batched layer: ``functional_call`` under ``torch.vmap``.

    Slower than a batched layer (every op is vmapped), but any architecture batches.  Also
    used for a module whose methods use raw parameters directly (``x * self.scale``).
    """

    def __init__(self, modules: Sequence[nn.Module], path: str = "") -> None:
        super().__init__(len(modules))
        self.path = path or "the root"
        self.template = copy.deepcopy(modules[0])
        names = [k for k, _ in modules[0].named_parameters()]
        bnames = [k for k, _ in modules[0].named_buffers()]
        self.names, self.bnames = names, bnames
        self.params = nn.ParameterList(
            [
                nn.Parameter(
                    torch.stack([dict(m.named_parameters())[k].detach() for m in modules]).clone()
                )
                for k in names
            ]
        )
        for j, k in enumerate(bnames):
            self.register_buffer(
                f"buffer{j}", torch.stack([dict(m.named_buffers())[k] for m in modules]).clone()
            )

    def call(self, method: str, *args: Any) -> Any:
        """Run ``method`` of the template on merged ``(b*N, ...)`` arguments."""
        n = self.n
        target = _Call(self.template, method)
        tensors = [self.params[j] for j in range(len(self.names))] + [
            getattr(self, f"buffer{j}") for j in range(len(self.bnames))
        ]
        if self.chunk is not None:
            size, index = self.chunk
            tensors = [t.split(size, 0)[index] for t in tensors]
        keys = [f"module.{k}" for k in self.names + self.bnames]

        def one(flat: list[torch.Tensor], *xs: Any) -> Any:
            return functional_call(target, dict(zip(keys, flat)), xs)

        split = [map_tensors(lambda t: t.view(-1, n, *t.shape[1:]), a) for a in args]
        dims = tuple(1 if isinstance(a, torch.Tensor) else None for a in args)
        try:
            out = vmap(one, in_dims=(0, *dims), out_dims=1)(tensors, *split)
        except Exception as err:
            raise FoldError(
                f"BatchModule: {self.path} ({type(self.template).__name__}.{method}) has no batched "
                f"layer and does not run under torch.vmap: {type(err).__name__}: {err}. Fix: "
                "register a batched layer for it with register_batch_module, or avoid "
                "data-dependent Python control flow (.item(), if on tensor values) in it."
            ) from err
        return map_tensors(lambda t: t.reshape(-1, *t.shape[2:]), out)

    def forward(self, *args: Any) -> Any:
        return self.call("forward", *args)

    def state_of(self, i: int) -> dict[str, torch.Tensor]:
        out = {k: self.params[j][i] for j, k in enumerate(self.names)}
        out.update({k: getattr(self, f"buffer{j}")[i] for j, k in enumerate(self.bnames)})
        return out

    def grads_of(self, i: int) -> dict[str, torch.Tensor | None]:
        return {k: None if p.grad is None else p.grad[i] for k, p in zip(self.names, self.params)}

    def load_state_of(self, i: int, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for j, k in enumerate(self.names):
                self.params[j][i].copy_(state[k])
            for j, k in enumerate(self.bnames):
                getattr(self, f"buffer{j}")[i].copy_(state[k])


def _definer(klass: type, name: str) -> type | None:
    """The class between ``klass`` and nn.Module that defines ``name`` (the model's own), if
    any; the shells that give nn.Module's methods back (see ``_convert``) do not count."""
    for k in klass.__mro__:
        if k is nn.Module:
            return None
        if name in vars(k) and not vars(k).get("_fold_restores_module_api"):
            return k
    return None


def _own_method(module: nn.Module, name: str) -> Callable[..., Any]:
    """``module.<name>``, preferring the model's own method over nn.Module's of that name."""
    k = _definer(type(module), name)
    if k is not None:
        return vars(k)[name].__get__(module, type(module))
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        raise FoldError(
            f"BatchModule: {type(module).__name__} has no method {name!r}. Fix: define "
            f"def {name}(self, ...) on it."
        )
    return fn


def _has_own_state(module: nn.Module) -> bool:
    return bool(module._parameters) or any(b is not None for b in module._buffers.values())


def _convert(modules: list[nn.Module], path: str, fallbacks: list[str]) -> nn.Module:
    """The batched counterpart of ``modules`` (N modules of one architecture at ``path``)."""
    first = modules[0]
    if any(type(m) is not type(first) for m in modules):
        raise FoldError(
            f"BatchModule: the modules at {path or 'the root'} differ in type "
            f"({sorted({type(m).__name__ for m in modules})}); all N models must share one architecture."
        )
    layer = registry.get(type(first))
    if layer is not None:
        try:
            return layer.from_modules(modules)
        except NotImplementedError as err:
            fallbacks.append(f"{path or 'the root'} ({type(first).__name__}: {err})")
            return VmapFallback(modules, path)
    if not any(True for _ in first.parameters()) and not any(True for _ in first.buffers()):
        return copy.deepcopy(first)  # parameter-free: runs on merged rows unchanged
    if _has_own_state(first):
        fallbacks.append(
            f"{path or 'the root'} ({type(first).__name__}: uses its own parameters directly)"
        )
        return VmapFallback(modules, path)
    shell = copy.copy(first)  # the same class and attributes; fresh registries, children below
    shell._parameters, shell._buffers, shell._modules = {}, {}, {}
    shadowed = {n for n in _SHADOWED if _definer(type(first), n) is not None}
    if shadowed:
        # The model's own `children` (say) would break .train() and .to() on the BatchModule:
        # the shell gets nn.Module's back; _own_method still finds the model's for fold's ops.
        api = {n: getattr(nn.Module, n) for n in shadowed}
        shell.__class__ = type(
            type(first).__name__, (type(first),), {**api, "_fold_restores_module_api": True}
        )
    for name, _ in first.named_children():
        kids = [dict(m.named_children())[name] for m in modules]
        shell._modules[name] = _convert(kids, f"{path}.{name}" if path else name, fallbacks)
    return shell


class BatchModule(nn.Module):
    """N models of one architecture as one module.

    ``forward`` (and every other method of the model, e.g. a TreeLSTM's ``leaf``) takes
    ``(N, b, ...)`` tensors -- one slice per model -- and returns ``(N, b, ...)``.  Layers with
    a batched version compute on stacked ``(N, ...)`` weights; any other submodule, or a model
    whose methods use raw parameters, runs under ``torch.vmap`` (with a warning naming it).

    Example::

        bm = BatchModule(LeNet(), batch=8)           # 8 copies of the same weights
        bm = BatchModule.from_modules([m1, m2, m3])  # 3 distinct models
        y = bm(x)                                    # x: (3, 64, 1, 28, 28) -> (3, 64, 10)
        leaf_h, leaf_c = bm.method("leaf")(words)    # a model's own method, batched
        bm.unbatch(1)                                # a plain module with model 1's weights
    """

    def __init__(self, module: nn.Module, batch: int) -> None:
        super().__init__()
        if type(batch) is not int or batch < 1:
            raise FoldError(f"BatchModule(module, batch={batch!r}): batch must be a positive int.")
        self._build([module] * batch)

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module]) -> BatchModule:
        """N distinct models of one architecture (their weights are copied)."""
        if not modules:
            raise FoldError("BatchModule.from_modules: give at least one module.")
        bm = cls.__new__(cls)
        nn.Module.__init__(bm)
        bm._build(list(modules))
        return bm

    def _build(self, modules: list[nn.Module]) -> None:
        self.batch = len(modules)
        # Models per pass of forward/method calls: None picks it (all on a GPU; on a CPU
        # enough to keep a pass's input within a cache-sized budget).  Set an int to force.
        self.chunk_size: int | None = None
        # The architecture, for unbatch(); kept out of the module tree (not a submodule), so
        # .to() and .train() never reach a model whose own methods shadow nn.Module's.
        self.__dict__["template"] = copy.deepcopy(modules[0])
        fallbacks: list[str] = []
        self.model = _convert(modules, "", fallbacks)
        self.train(modules[0].training)
        klass = type(modules[0])
        for name in sorted(_SHADOWED):
            if _definer(klass, name) is not None and (klass, name) not in _warned_shadow:
                _warned_shadow.add((klass, name))
                warnings.warn(
                    f"{klass.__name__}.{name} shadows nn.Module.{name}, which .to(), .cuda() and "
                    f".train() call, so they break on your own model. Fix: rename the op (e.g. "
                    f"'node'). BatchModule and fold still resolve {name!r} to your method.",
                    stacklevel=3,
                )
        if fallbacks:
            warnings.warn(
                "BatchModule: no batched layer for " + "; ".join(fallbacks) + ". These run under "
                "torch.vmap (slower). Fix: register a batched layer with register_batch_module.",
                stacklevel=3,
            )
        self._template_state_keys = list(modules[0].state_dict().keys())

    # ------------------------------------------------------------------ calling
    def merged(self, name: str) -> Callable[..., Any]:
        """Method ``name`` on merged ``(b*N, ...)`` rows in ``(b g)`` order (what fold uses)."""
        if isinstance(self.model, VmapFallback):
            fb = self.model
            return lambda *args: fb.call(name, *args)
        return _own_method(self.model, name)

    def method(self, name: str) -> Callable[..., Any]:
        """Method ``name`` of the model, batched: ``(N, b, ...)`` in, ``(N, b, ...)`` out."""
        fn = self.merged(name)
        n = self.batch
        where = f"BatchModule.{name}"

        def run(args: tuple[Any, ...], m: int) -> Any:
            merged = [map_tensors(lambda t: to_merged(t, m, where), a) for a in args]
            return map_tensors(lambda t: from_merged(t, m), fn(*merged))

        def batched(*args: Any) -> Any:
            for t in _tensors(args):  # check the model dim once, on the whole inputs
                if t.dim() < 2 or t.shape[0] != n:
                    to_merged(t, n, where)  # raises, naming the shape
            size = self._chunk_for(args)
            if size >= n:
                return run(args, n)
            parts = []
            for cut in self.chunks(size):
                chunk_args = tuple(map_tensors(lambda t, c=cut: t[c], a) for a in args)
                parts.append(run(chunk_args, cut.stop - cut.start))
            return _cat_outputs(parts)

        return batched

    def chunks(self, size: int) -> Iterator[slice]:
        """Run the models ``size`` at a time: yields each chunk's model slice while the
        batched layers compute for that chunk only (views of one split of each weight)."""
        layers = [m for m in self.model.modules() if isinstance(m, AbstractBatchModule)]
        try:
            for index, start in enumerate(range(0, self.batch, size)):
                for layer in layers:
                    layer.set_chunk((size, index))
                yield slice(start, min(self.batch, start + size))
        finally:
            for layer in layers:
                layer.set_chunk(None)

    def fold_chunk(self) -> int:
        """Models per pass when fold applies a graph to this module: ``chunk_size`` if set;
        else all N on a GPU and one at a time on a CPU, where the work of a pass is cache
        bound and one recorded graph run N times is fastest (benchmarks/sweep.py)."""
        if self.chunk_size is not None:
            return max(1, self.chunk_size)
        p = next(iter(self.parameters()), None)
        return self.batch if p is None or p.is_cuda else 1

    def _chunk_for(self, args: tuple[Any, ...]) -> int:
        """Models per pass: ``chunk_size`` if set; else all N on a GPU, and on a CPU as many
        as keep one pass's input within ``_CPU_CHUNK_BYTES``: there, cache locality beats
        fewer and larger ops (benchmarks/models.py)."""
        if self.chunk_size is not None:
            return max(1, self.chunk_size)
        tensors = _tensors(args)
        if not tensors or tensors[0].is_cuda:
            return self.batch
        per_model = sum(t[0].numel() * t.element_size() for t in tensors)
        return max(1, _CPU_CHUNK_BYTES // max(1, per_model))

    def forward(self, *args: Any) -> Any:
        return self.method("forward")(*args)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self._modules.get("model")
            if model is not None and callable(getattr(type(model), name, None)):
                return self.method(name)
            raise

    # ------------------------------------------------------------------ state
    def _layers(self) -> list[tuple[str, AbstractBatchModule]]:
        if isinstance(self.model, AbstractBatchModule):
            return [("", self.model)]
        return [
            (p, m)
            for p, m in self.model.named_modules()
            if isinstance(m, AbstractBatchModule) and p
        ]

    def _top_layers(self) -> list[tuple[str, AbstractBatchModule]]:
        out: list[tuple[str, AbstractBatchModule]] = []
        for p, m in self._layers():
            if not any(p.startswith(q + ".") for q, _ in out):
                out.append((p, m))
        return out

    def state_dicts(self) -> list[dict[str, torch.Tensor]]:
        """N state dicts, each with the keys of the original model's ``state_dict()``."""
        out = []
        for i in range(self.batch):
            sd: dict[str, torch.Tensor] = {}
            for prefix, layer in self._top_layers():
                for k, v in layer.state_of(i).items():
                    sd[f"{prefix}.{k}" if prefix else k] = v.detach().clone()
            out.append({k: sd[k] for k in self._template_state_keys})
        return out

    def grads_of(self, i: int) -> dict[str, torch.Tensor | None]:
        """Model ``i``'s parameter gradients, with the original model's parameter names."""
        out: dict[str, torch.Tensor | None] = {}
        for prefix, layer in self._top_layers():
            for k, g in layer.grads_of(i).items():
                out[f"{prefix}.{k}" if prefix else k] = g
        return out

    def load_state_dicts(self, states: Sequence[dict[str, torch.Tensor]]) -> None:
        """Load N state dicts (the original model's keys) into the N models."""
        if len(states) != self.batch:
            raise FoldError(
                f"BatchModule.load_state_dicts: got {len(states)} state dicts for {self.batch} models."
            )
        want = set(self._template_state_keys)
        for i, sd in enumerate(states):
            missing, extra = sorted(want - set(sd)), sorted(set(sd) - want)
            if missing or extra:
                raise FoldError(
                    f"BatchModule.load_state_dicts: state dict {i} has missing keys {missing} and "
                    f"unexpected keys {extra}. Fix: pass model.state_dict() of the same architecture."
                )
        for i, sd in enumerate(states):
            for prefix, layer in self._top_layers():
                cut = len(prefix) + 1 if prefix else 0
                layer.load_state_of(
                    i,
                    {k[cut:]: v for k, v in sd.items() if not prefix or k.startswith(prefix + ".")},
                )

    def unbatch(self, i: int) -> nn.Module:
        """A plain module of the original class holding model ``i``'s weights."""
        if not 0 <= i < self.batch:
            raise FoldError(
                f"BatchModule.unbatch({i}): there are {self.batch} models (0..{self.batch - 1})."
            )
        m = copy.deepcopy(self.template)
        m.load_state_dict(self.state_dicts()[i])
        device = next(iter(self.parameters()), torch.empty(0)).device
        if device.type != "cpu":
            for t in [*m.parameters(), *m.buffers()]:
                t.data = t.data.to(device)
        return m

    def extra_repr(self) -> str:
        return f"batch={self.batch}"
