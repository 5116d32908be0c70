"""``BatchModule``: N models of one architecture as one module."""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from fold.batched_ops import layers as _built_in  # noqa: F401  (registers the batched layers)
from fold.batched_ops.core import (
    AbstractBatchModule,
    _same_kind,
    count_tensors,
    from_merged,
    map_tensors,
    model_index,
    registry,
    tensors_of,
    to_merged,
)
from fold.batched_ops.rows import RowCheck
from fold.errors import FoldError
from fold.executor import ModelBatched
from fold.ragged import ModelRagged, Ragged

__all__ = ["BatchModule", "VmapFallback"]

_CPU_CHUNK_BYTES = 256 * 1024


def _cat_outputs(parts: list[Any], where: str) -> Any:
    """Concatenate per-chunk outputs (tensors, or tuples of them) along the model dim."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        for k, p in enumerate(parts):
            if p.shape[1:] != first.shape[1:]:
                raise FoldError(
                    f"{where}: the models' results differ in shape ({tuple(first.shape[1:])} "
                    f"from the first models, {tuple(p.shape[1:])} from chunk {k}). Fix: return "
                    "results of one shape from every model (pad them)."
                )
        return torch.cat(parts, 0)
    if isinstance(first, (tuple, list)):
        items = [_cat_outputs([p[i] for p in parts], where) for i in range(len(first))]
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
    if isinstance(first, dict):
        return _same_kind(first, {k: _cat_outputs([p[k] for p in parts], where) for k in first})
    return first


_UNSEEN = object()
_FAST_PATHS = (nn.TransformerEncoderLayer, nn.TransformerEncoder)


class _Plain(TorchFunctionMode):
    """A torch function mode that changes no call: while it is on, torch's fused fast paths
    (which test ``has_torch_function``) stay off."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


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

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _own_method(self.module, self.method)(*args, **kwargs)


def _model_lengths(lists: ModelRagged, n: int) -> tuple[torch.Tensor, Any]:
    """The lengths of one model's lists in ``lists`` (list ``i * n + m`` is node i's for
    model m: every model's are node i's), on the device and on the host where known."""
    if lists.models != n:
        raise FoldError(
            f"BatchModule: a list argument of {lists.models} models given to a call of {n}."
        )
    host = lists._host
    return lists.lengths[::n], None if host is None else host[::n]


class VmapFallback(AbstractBatchModule):
    """Any module without a batched layer: ``functional_call`` under ``torch.vmap``.

    Slower than a batched layer (every op is vmapped), but any architecture batches.  Also
    used for a module whose methods use raw parameters directly (``x * self.scale``).  Its
    parameters and buffers are exactly the model's, stacked along a leading model dim and
    registered under the model's own names (``scale``, ``sub.weight``), with the model's
    ``requires_grad``; the template that ``functional_call`` runs is kept out of the module
    tree, so none of its tensors is a parameter.
    """

    def __init__(self, modules: Sequence[nn.Module], path: str = "") -> None:
        super().__init__(len(modules))
        self._fb_path = path or "the root"
        # Out of the module tree: functional_call replaces every tensor of it on each call.
        self.__dict__["template"] = copy.deepcopy(modules[0])
        per_model = [
            (dict(m.named_parameters()), {k: b for k, b in m.named_buffers() if b is not None})
            for m in modules
        ]
        self._fb_names = list(per_model[0][0])
        self._fb_bnames = list(per_model[0][1])
        for k in self._fb_names:
            first = per_model[0][0][k]
            stacked = torch.stack([p[k].detach() for p, _ in per_model]).clone()
            self._register(k, nn.Parameter(stacked, requires_grad=first.requires_grad))
        for k in self._fb_bnames:
            self._register(k, torch.stack([b[k] for _, b in per_model]).clone())

    def _register(self, name: str, value: torch.Tensor) -> None:
        """Register ``value`` at dotted ``name``, making empty container modules on the way."""
        *parents, leaf = name.split(".")
        owner: nn.Module = self
        for part in parents:
            child = owner._modules.get(part)
            if child is None:
                if hasattr(owner, part):
                    raise FoldError(
                        f"BatchModule: {self._fb_path} has a submodule named {part!r}, which the "
                        "vmap fallback uses itself. Fix: rename it, or register a batched layer."
                    )
                child = nn.Module()
                owner.add_module(part, child)
            owner = child
        if leaf in owner.__dict__ or (owner is self and hasattr(owner, leaf)):
            raise FoldError(
                f"BatchModule: {self._fb_path} has a tensor named {name!r}, which the vmap "
                "fallback uses itself. Fix: rename it, or register a batched layer."
            )
        if isinstance(value, nn.Parameter):
            owner.register_parameter(leaf, value)
        else:
            owner.register_buffer(leaf, value)

    def _tensors(self) -> list[torch.Tensor]:
        """The stacked parameters, then buffers, in ``_fb_names`` / ``_fb_bnames`` order; read
        on every call, so a parameter tied to another layer's after construction is used."""
        return [self.get_parameter(k) for k in self._fb_names] + [
            self.get_buffer(k) for k in self._fb_bnames
        ]

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` of the template on merged ``(b*N, ...)`` arguments (see
        ``call_rows``)."""
        return self.call_rows(method, args, kwargs, False)

    def call_rows(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], every: bool
    ) -> Any:
        """Run ``method`` of the template on merged ``(b*N, ...)`` arguments: every tensor
        given by position holds rows (each model's its own), and so does a tensor given by
        keyword whose leading dim is the first tensor's; any other tensor (an attention mask
        ``(T, T)``) and any other value is the same for every model.  With ``every``, every
        tensor holds rows (a BatchModule's own arguments: (N, b, ...) each)."""
        n = self.n
        if self.template.training != self.training:  # (kept out of the tree: .eval() misses it)
            self.template.train(self.training)
        target = _Call(self.template, method)
        tensors = self._tensors()
        chunk = self.chunk
        if chunk is not None:
            size, index = chunk
            tensors = [t.split(size, 0)[index] for t in tensors]
        keys = [f"module.{k}" for k in self._fb_names + self._fb_bnames]
        leaves, spec = pytree.tree_flatten((args, kwargs))
        given = len(pytree.tree_leaves(args))  # the positional arguments' leaves come first
        first = next((t for t in leaves if isinstance(t, torch.Tensor) and t.dim()), None)
        rows = None if first is None else first.shape[0]
        at = [
            k
            for k, t in enumerate(leaves)
            if isinstance(t, torch.Tensor)
            and (every or k < given or t.dim() and t.shape[0] == rows)
        ]

        # The lists of N models (a list argument of a fold op): each model's own lists, as
        # a Ragged over its rows (the models' rows of an element are together, as a node
        # argument's are) with the lengths every model shares.
        lists = [k for k, t in enumerate(leaves) if isinstance(t, ModelRagged)]
        shared = [_model_lengths(leaves[k], n) for k in lists]
        result: list[Any] = []  # the result's leaves that are no tensors, and its structure

        def one(flat: list[torch.Tensor], *xs: Any) -> Any:
            values = list(leaves)
            for k, x in zip(at + lists, xs):
                values[k] = x
            for k, (lengths, host) in zip(lists, shared):
                values[k] = Ragged(values[k], lengths)
                values[k]._host = host
            a, kw = pytree.tree_unflatten(values, spec)
            out_leaves, out_spec = pytree.tree_flatten(
                functional_call(target, dict(zip(keys, flat)), a, kw)
            )
            result[:] = [out_leaves, out_spec]
            return tuple(t for t in out_leaves if isinstance(t, torch.Tensor))

        split = [leaves[k].view(-1, n, *leaves[k].shape[1:]) for k in at]
        split += [leaves[k].values.view(-1, n, *leaves[k].values.shape[1:]) for k in lists]
        try:
            run = vmap(one, in_dims=(0, *[1] * len(split)), out_dims=1, randomness="different")
            outs = iter(run(tensors, *split))
            # (an attention's weights left out: None where the model gives None)
            out = pytree.tree_unflatten(
                [next(outs) if isinstance(t, torch.Tensor) else t for t in result[0]], result[1]
            )
        except Exception as err:
            raise FoldError(
                f"BatchModule: {self._fb_path} ({type(self.template).__name__}.{method}) has no "
                f"batched layer and does not run under torch.vmap: {type(err).__name__}: {err}. "
                "Fix: register a batched layer for it with register_batch_module, or avoid "
                "data-dependent Python control flow (.item(), if on tensor values) in it."
            ) from err
        return map_tensors(lambda t: t.reshape(-1, *t.shape[2:]), out)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.call("forward", *args, **kwargs)

    def row_dims(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int | None]:
        # positional tensors hold rows; a keyword tensor may be every model's (see call)
        return [0] * count_tensors(args) + [None] * count_tensors(kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            # The model's settings (an attention's batch_first, num_heads), as its parent's
            # code reads them; never its tensors or submodules (the stacked ones are here).
            value = getattr(self.__dict__.get("template"), name, None)
            if value is None or isinstance(value, (torch.Tensor, nn.Module)) or callable(value):
                raise
            return value

    def state_of(self, i: int) -> dict[str, torch.Tensor]:
        names = self._fb_names + self._fb_bnames
        return {k: t[i] for k, t in zip(names, self._tensors())}

    def grads_of(self, i: int) -> dict[str, torch.Tensor | None]:
        return {
            k: None if p.grad is None else p.grad[i]
            for k, p in zip(self._fb_names, self._tensors())
        }

    def load_state_of(self, i: int, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for k, t in zip(self._fb_names + self._fb_bnames, self._tensors()):
                if k in state:
                    t[i].copy_(state[k])


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


def _structure(m: nn.Module) -> list[list[tuple[str, Any, str]]]:
    """What N models of one architecture share, in three sections: every submodule (path,
    class), every parameter and every buffer (name, (shape, dtype, device, requires_grad));
    each entry with the first name of the same object (ties)."""
    modules: list[tuple[str, Any, str]] = []
    first: dict[int, str] = {}
    for path, sub in m.named_modules(remove_duplicate=False):
        name = f"module {path or '(root)'}"
        modules.append((name, type(sub).__name__, first.setdefault(id(sub), name)))
    sections = [modules]
    for kind, items in (
        ("parameter", m.named_parameters(remove_duplicate=False)),
        ("buffer", m.named_buffers(remove_duplicate=False)),
    ):
        first = {}
        entries = []
        for name, t in items:
            meta = (tuple(t.shape), t.dtype, t.device.type, t.requires_grad)
            entries.append((f"{kind} {name}", meta, first.setdefault(id(t), f"{kind} {name}")))
        sections.append(entries)
    return sections


def _describe_part(value: Any) -> str:
    if isinstance(value, str):  # a module's class name
        return value
    shape, dtype, device, grad = value
    text = f"shape {shape}, {str(dtype).replace('torch.', '')} on {device}"
    return text + ("" if grad else ", requires_grad=False")


def _first_difference(want: list[Any], got: list[Any], i: int) -> str | None:
    for a_sec, b_sec in zip(want, got):
        for k in range(max(len(a_sec), len(b_sec))):
            a = a_sec[k] if k < len(a_sec) else None
            b = b_sec[k] if k < len(b_sec) else None
            if a == b:
                continue
            if a is None or (b is not None and b[0] not in {e[0] for e in a_sec}):
                return f"model {i} has {b[0]} ({_describe_part(b[1])}), which model 0 lacks"
            if b is None or a[0] not in {e[0] for e in b_sec}:
                return f"model 0 has {a[0]} ({_describe_part(a[1])}), which model {i} lacks"
            if a[0] != b[0]:
                return f"model 0 has {a[0]} where model {i} has {b[0]} (another order)"
            if a[1] != b[1]:
                return (
                    f"{a[0]} is {_describe_part(b[1])} in model {i}, "
                    f"{_describe_part(a[1])} in model 0"
                )
            return (
                f"{a[0]} is the same object as {a[2]} in model 0 but not in model {i} "
                "(weights tied differently)"
            )
    return None


def _check_architectures(modules: Sequence[Any]) -> None:
    """A FoldError naming the first difference between model 0 and any other model."""
    for i, m in enumerate(modules):
        if not isinstance(m, nn.Module):
            raise FoldError(
                f"BatchModule.from_modules: item {i} is a {type(m).__name__}, not an nn.Module. "
                "Fix: pass N modules of one architecture."
            )
    want = _structure(modules[0])
    for i, m in enumerate(modules[1:], 1):
        if m is modules[0]:
            continue
        detail = _first_difference(want, _structure(m), i)
        if detail is None:
            continue
        dtypes = {t.dtype for mm in modules for t in mm.parameters()}
        fix = (
            "convert them to one dtype first (m.float() or m.double())"
            if len(dtypes) > 1
            else "build every model with the same constructor arguments"
        )
        raise FoldError(
            f"BatchModule.from_modules: the models differ in architecture: {detail}. All N "
            f"models must share one architecture, dtype and device. Fix: {fix}."
        )


def _convert(
    modules: list[nn.Module],
    path: str,
    fallbacks: list[str],
    seen: dict[tuple[int, ...], nn.Module] | None = None,
) -> nn.Module:
    """The batched counterpart of ``modules`` (N modules of one architecture at ``path``).

    ``seen`` maps the N modules (by identity) to their counterpart, so a submodule registered
    twice in the model is one batched module, registered twice."""
    if seen is None:
        seen = {}
    key = tuple(map(id, modules))
    done = seen.get(key)
    if done is not None:
        return done
    seen[key] = out = _convert_new(modules, path, fallbacks, seen)
    return out


def _convert_new(
    modules: list[nn.Module],
    path: str,
    fallbacks: list[str],
    seen: dict[tuple[int, ...], nn.Module],
) -> nn.Module:
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
    for name, child in first._modules.items():
        if child is None:
            shell._modules[name] = None
            continue
        kids = [m._modules[name] for m in modules]
        sub = f"{path}.{name}" if path else name
        shell._modules[name] = _convert(kids, sub, fallbacks, seen)  # type: ignore[arg-type]
    return shell


def _aliases(m: nn.Module) -> dict[str, str]:
    """Tied names: every parameter or buffer name that is another name's tensor, mapped to
    the first name of that tensor (as ``named_parameters`` lists it)."""
    out: dict[str, str] = {}
    for items in (
        m.named_parameters(remove_duplicate=False),
        m.named_buffers(remove_duplicate=False),
    ):
        first: dict[int, str] = {}
        for name, t in items:
            canonical = first.setdefault(id(t), name)
            if canonical != name:
                out[name] = canonical
    return out


def _tie(root: nn.Module, aliases: dict[str, str]) -> None:
    """Make every tied name of the batched tree the one stacked tensor of its first name."""
    for name, canonical in aliases.items():
        try:
            shared = root.get_parameter(canonical)
        except AttributeError:
            try:
                shared = root.get_buffer(canonical)
            except AttributeError:
                raise FoldError(
                    f"BatchModule: {name} is tied to {canonical}, but the batched layer of "
                    f"{canonical} does not keep it under that name, so the tie cannot be kept. "
                    "Fix: register a batched layer that keeps its base class's names."
                ) from None
        owner_path, _, leaf = name.rpartition(".")
        try:
            owner = root.get_submodule(owner_path)
        except AttributeError:
            continue  # inside a vmap fallback that lists each tied tensor once
        if isinstance(shared, nn.Parameter):
            if leaf in owner._parameters:
                owner._parameters[leaf] = shared
        elif leaf in owner._buffers:
            owner._buffers[leaf] = shared


class _Keywords(dict):  # type: ignore[type-arg]
    """A call's keyword arguments, carried as its last positional argument through the
    merging and chunking of ``BatchModule.method`` (``_unpacking`` gives them back)."""


def _unpacking(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` called with a trailing ``_Keywords`` as its keyword arguments."""

    def call(*args: Any) -> Any:
        if args and isinstance(args[-1], _Keywords):
            return fn(*args[:-1], **args[-1])
        return fn(*args)

    return call


def _layer_call(
    layer: AbstractBatchModule, fn: Callable[..., Any], args: tuple[Any, ...], m: int, where: str
) -> Any:
    """``fn`` (a batched layer's method) on ``(N, ...)`` arguments: each tensor's rows merged
    in the dim the layer takes them (``row_dims``: an RNN's sequence-first input and states
    in dim 1), and its results split where it gives them (``result_row_dims``)."""
    kwargs: dict[str, Any] = {}
    if args and isinstance(args[-1], _Keywords):
        args, kwargs = args[:-1], dict(args[-1])
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    one_args, one_kwargs = pytree.tree_unflatten(
        [t[0] if isinstance(t, torch.Tensor) else t for t in leaves], spec
    )
    # (a layer alone takes its arguments from the BatchModule's: each holds rows, (N, b, ...))
    dims = iter(layer.row_dims(one_args, one_kwargs) if m > 1 else [0] * len(tensors))
    merged = [
        to_merged(t, m, where, next(dims) or 0) if isinstance(t, torch.Tensor) else t
        for t in leaves
    ]
    merged_args, merged_kwargs = pytree.tree_unflatten(merged, spec)
    out = fn(*merged_args, _Keywords(merged_kwargs)) if merged_kwargs else fn(*merged_args)
    out_leaves, out_spec = pytree.tree_flatten(out)
    out_dims = iter(layer.result_row_dims(out) if m > 1 else [0] * len(out_leaves))
    split = [
        from_merged(t, m, next(out_dims)) if isinstance(t, torch.Tensor) else t for t in out_leaves
    ]
    return pytree.tree_unflatten(split, out_spec)


def _caller_level() -> int:
    """The stack level of the first frame outside fold and torch, for ``warnings.warn``
    called from the function that calls this."""
    f, level = sys._getframe(2), 2
    while f is not None and f.f_globals.get("__name__", "").partition(".")[0] in ("fold", "torch"):
        f, level = f.f_back, level + 1
    return level


class BatchModule(nn.Module, ModelBatched):
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
        modules = list(modules)
        _check_architectures(modules)
        bm = cls.__new__(cls)
        nn.Module.__init__(bm)
        bm._build(modules)
        return bm

    def _build(self, modules: list[nn.Module]) -> None:
        self.batch = len(modules)
        # Models per pass of forward/method calls: None picks it (all on a GPU; on a CPU
        # enough to keep a pass's input within a cache-sized budget).  Set an int to force.
        self.chunk_size: int | None = None
        # Whether the first call of each kind is watched for code that mixes the rows of a
        # batch (see ``method``), and the verdicts: None where the rows stay apart.
        self.check_rows = True
        self._row_verdicts: dict[Any, str | None] = {}
        self._row_warned: set[Any] = set()
        # The architecture, for unbatch(); kept out of the module tree (not a submodule), so
        # .to() and .train() never reach a model whose own methods shadow nn.Module's.
        self.__dict__["template"] = copy.deepcopy(modules[0])
        fallbacks: list[str] = []
        self.model = _convert(modules, "", fallbacks)
        self._aliases = _aliases(modules[0])
        _tie(self.model, self._aliases)
        self._tag_parameters()
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
        # A layer whose forward may take a fused path that reads its sublayers' weights
        # itself (TransformerEncoderLayer in eval mode without gradients): such paths are
        # off in the model's own code, as a torch function mode turns them off.
        self._fast_paths = any(isinstance(m, _FAST_PATHS) for m in modules[0].modules())

    def _tag_parameters(self) -> None:
        # Every stacked parameter knows its number of models, so fold.optim infers N from
        # bm.parameters() as torch.optim needs nothing but the parameters.
        for p in self.parameters():
            p._fold_models = self.batch  # type: ignore[attr-defined]

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        # .to(), .double(), .cuda() may replace parameters (a move to another kind of device
        # makes new ones): tag what is there afterwards.
        out = super()._apply(fn, recurse)
        if "model" in self._modules:
            self._tag_parameters()
        return out

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("check_rows", True)  # (pickled before the row check)
        state.setdefault("_row_verdicts", {})
        state.setdefault("_row_warned", set())
        state.setdefault("_fast_paths", False)
        super().__setstate__(state)
        if "model" in self._modules:  # a copy (deepcopy, pickle): tag its new parameters
            self._tag_parameters()

    # ------------------------------------------------------------------ calling
    def merged(self, name: str) -> Callable[..., Any]:
        """Method ``name`` on merged ``(b*N, ...)`` rows in ``(b g)`` order (what fold uses)."""
        if isinstance(self.model, VmapFallback):
            fb = self.model
            return lambda *args, **kwargs: fb.call_rows(name, args, kwargs, True)
        return _own_method(self.model, name)

    def method(self, name: str) -> Callable[..., Any]:
        """Method ``name`` of the model, batched: ``(N, b, ...)`` in, ``(N, b, ...)`` out.

        The first call of each kind (method, input shapes and dtypes, train or eval, grad
        mode) is watched by ``RowCheck``: where the model's own code may mix the rows of a
        batch (``h - h.mean(0)``, a loss reduced over the batch, attention between the
        samples), the models' rows merged would mix, so the call runs again one model at a
        time (buffers and random state as they were before it), and so do the later calls of
        its kind, with a warning naming the call.  ``bm.check_rows = False`` skips the check."""
        fn = _unpacking(self.merged(name))
        n = self.batch
        where = f"BatchModule.{name}"

        layer = self.model if isinstance(self.model, AbstractBatchModule) else None

        def run(args: tuple[Any, ...], m: int, key: Any = None) -> Any:
            if layer is not None:  # a layer alone: its rows where it keeps them
                return _layer_call(layer, fn, args, m, where)
            merged = [map_tensors(lambda t: to_merged(t, m, where), a) for a in args]
            if key is not None:
                out = self._watched(fn, merged, m, key)
            elif self._fast_paths:
                with _Plain():  # (torch's fast path would read the layers' stacked weights)
                    out = fn(*merged)
            else:
                out = fn(*merged)
            return map_tensors(lambda t: from_merged(t, m), out)

        def calls(args: tuple[Any, ...], size: int, key: Any = None) -> Any:
            if size >= n:
                return run(args, n, key)
            parts = []
            for cut in self.chunks(size):
                chunk_args = tuple(map_tensors(lambda t, c=cut: t[c], a) for a in args)
                parts.append(run(chunk_args, cut.stop - cut.start, key if cut.start == 0 else None))
            return _cat_outputs(parts, where)

        watch = self.check_rows and not isinstance(self.model, AbstractBatchModule)

        def batched(*args: Any, **kwargs: Any) -> Any:
            if kwargs:  # (carried as a last argument, a dict: merged and split alike)
                return batched(*args, _Keywords(kwargs))
            tensors = tensors_of(args)
            for t in tensors:  # check the model dim once, on the whole inputs
                if t.dim() < 2 or t.shape[0] != n:
                    to_merged(t, n, where)  # raises, naming the shape
            size = self._chunk_for(args)
            if watch:
                key = self._row_key(name, tensors)
                verdict = self._row_verdicts.get(key, _UNSEEN)
                if verdict is _UNSEEN:
                    # (one model at a time is exact: nothing to run again)
                    before = self._state_before() if size > 1 else None
                    try:
                        out = calls(args, size, key)
                    except Exception:
                        if before is None or self._row_verdicts.get(key) is None:
                            raise  # (the call's own error)
                    if self._row_verdicts[key] is None or before is None:
                        return out
                    before()  # its buffers and random state back: it runs again
                    verdict = self._row_verdicts[key]
                if verdict is not None and size > 1:
                    if key not in self._row_warned:  # (where it costs: once a kind)
                        self._row_warned.add(key)
                        self._warn_rows(where, verdict)
                    size = 1
            return calls(args, size)

        return batched

    def _row_key(self, name: str, tensors: list[torch.Tensor]) -> tuple[Any, ...]:
        key = (name, self.training, torch.is_grad_enabled())
        return key + tuple((t.shape[1:], t.dtype) for t in tensors)

    def rows_kept(self, name: str, *args: Any) -> bool | None:
        """Whether method ``name``'s code keeps the rows of a batch apart on arguments like
        ``args`` (``(N, b, ...)``), as its first call of that kind found (None: not called
        so yet).  Rows of several batches merged (autobatch's examples) may share a call
        only where it does."""
        if not self.check_rows or isinstance(self.model, AbstractBatchModule):
            return True
        verdict = self._row_verdicts.get(self._row_key(name, tensors_of(args)), _UNSEEN)
        return None if verdict is _UNSEEN else verdict is None

    def _watched(self, fn: Callable[..., Any], merged: list[Any], models: int, key: Any) -> Any:
        """``fn(*merged)`` (the rows of ``models`` models) watched by ``RowCheck``; keeps the
        verdict under ``key``."""
        inputs = tensors_of(merged)
        rows = inputs[0].shape[0] if inputs else 0
        stacked = {
            id(t): f"{path}.{k}" if path else k
            for path, m in self.model.named_modules()
            if isinstance(m, AbstractBatchModule)
            for k, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]
        }
        check = RowCheck(rows, rows // models, inputs, stacked)
        if any(t.shape[0] != rows for t in inputs):
            check.found = "takes inputs whose batches differ in size"
        hooks = [
            m.register_forward_pre_hook(
                lambda layer, a, k: check.entering(layer, a, k), with_kwargs=True
            )
            for m in self.model.modules()
            if isinstance(m, AbstractBatchModule)
        ]
        try:
            if check.found is not None:
                return fn(*merged)
            with check:
                out = fn(*merged)
            check.returning(out)
        finally:
            for h in hooks:
                h.remove()
            if check.stacked_use is not None:
                raise FoldError(
                    f"BatchModule.{key[0]}: {type(self.template).__name__}'s code "
                    f"{check.stacked_use}, which holds all {self.batch} models' values stacked "
                    "here (one per model in each model alone). Fix: use the tensor inside a "
                    "module of its own (its forward then runs per model under torch.vmap), or "
                    "call the layer instead of reading its weights."
                )
            # Kept where the rows mixed, also if the call then failed (a loss reduced over
            # all rows: its one value has no rows to split); a call that failed with its
            # rows apart is watched again next time.
            if check.found is not None:
                self._row_verdicts[key] = check.found
        self._row_verdicts[key] = check.found
        return out

    def _state_before(self) -> Callable[[], None]:
        """A function that puts the buffers and the random generators' states back as they
        are now (a watched call that mixes rows runs again)."""
        buffers = [(b, b.clone()) for b in self.buffers()]
        cpu = torch.random.get_rng_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

        def restore() -> None:
            with torch.no_grad():
                for b, was in buffers:
                    b.copy_(was)
            torch.random.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)

        return restore

    def _warn_rows(self, where: str, found: str) -> None:
        warnings.warn(
            f"{where}: {type(self.template).__name__}'s code {found}, which may mix the rows "
            "of the models' batches merged: its calls of this kind run one model at a time "
            "(slower; each model's exact result). Fix: keep the rows apart (give a dim, "
            "reduction='none'), or set check_rows = False on the BatchModule if the call does "
            "keep them apart.",
            stacklevel=_caller_level(),
        )

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
        tensors = tensors_of(args)
        if not tensors or tensors[0].is_cuda:
            return self.batch
        per_model = sum(t[0].numel() * t.element_size() for t in tensors)
        return max(1, _CPU_CHUNK_BYTES // max(1, per_model))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.method("forward")(*args, **kwargs)

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
        """N state dicts, each with the keys of the original model's ``state_dict()``; a
        tied tensor is one tensor under each of its names, as ``state_dict()`` gives it."""
        out = []
        for i in range(self.batch):
            sd: dict[str, torch.Tensor] = {}
            for prefix, layer in self._top_layers():
                for k, v in layer.state_of(i).items():
                    sd[f"{prefix}.{k}" if prefix else k] = v.detach().clone()
            for name, canonical in self._aliases.items():
                if canonical in sd:
                    sd[name] = sd[canonical]
            out.append({k: sd[k] for k in self._template_state_keys})
        return out

    def grads_of(self, i: int) -> dict[str, torch.Tensor | None]:
        """Model ``i``'s parameter gradients, with the original model's parameter names."""
        i = self._index(i, "grads_of")
        out: dict[str, torch.Tensor | None] = {}
        for prefix, layer in self._top_layers():
            for k, g in layer.grads_of(i).items():
                out[f"{prefix}.{k}" if prefix else k] = g
        return out

    def _index(self, i: Any, where: str) -> int:
        return model_index(i, self.batch, f"BatchModule.{where}")

    def load_state_dicts(self, states: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """Load N state dicts (the original model's keys) into the N models.

        Every state dict is checked first (count, keys, that each value is a tensor of
        exactly the model's shape); on any problem nothing is loaded."""
        where = "BatchModule.load_state_dicts"
        states = list(states)
        if len(states) != self.batch:
            raise FoldError(f"{where}: got {len(states)} state dicts for {self.batch} models.")
        # The model's own state dict gives every key's per-model shape and dtype kind,
        # without cloning the N models' tensors as state_dicts() would.
        reference = self.template.state_dict()
        want = set(self._template_state_keys)
        for i, sd in enumerate(states):
            if not isinstance(sd, Mapping):
                raise FoldError(
                    f"{where}: item {i} is a {type(sd).__name__}, not a state dict. Fix: pass "
                    "a list of model.state_dict() of the same architecture."
                )
            missing, extra = sorted(want - set(sd)), sorted(set(sd) - want)
            if missing or extra:
                raise FoldError(
                    f"{where}: state dict {i} has missing keys {missing} and unexpected keys "
                    f"{extra}. Fix: pass model.state_dict() of the same architecture."
                )
            for k in self._template_state_keys:
                v, ref = sd[k], reference[k]
                if not isinstance(v, torch.Tensor) or v.shape != ref.shape:
                    got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                    raise FoldError(
                        f"{where}: state dict {i}, {k!r} is {got}; model {i} needs shape "
                        f"{tuple(ref.shape)} (values are never broadcast). Nothing was loaded. "
                        "Fix: pass model.state_dict() of the same architecture."
                    )
                if v.is_floating_point() != ref.is_floating_point() and ref.dtype != torch.bool:
                    raise FoldError(
                        f"{where}: state dict {i}, {k!r} is {v.dtype}; model {i} keeps "
                        f"{ref.dtype}. Nothing was loaded."
                    )
        for i, sd in enumerate(states):
            for prefix, layer in self._top_layers():
                cut = len(prefix) + 1 if prefix else 0
                layer.load_state_of(
                    i,
                    {k[cut:]: v for k, v in sd.items() if not prefix or k.startswith(prefix + ".")},
                )

    def unbatch(self, i: int) -> nn.Module:
        """A plain module of the original class holding model ``i``'s weights, with this
        BatchModule's dtypes, device, ties and train/eval mode."""
        i = self._index(i, "unbatch")
        m = copy.deepcopy(self.template)
        state = self.state_dicts()[i]
        # Each tensor object of the template takes model i's data (and its dtype and
        # device) in place, so tied weights stay one parameter.
        with torch.no_grad():
            for k, t in [*m.named_parameters(), *m.named_buffers()]:
                if k in state:
                    t.data = state[k]
        stack = [m]  # m.train(mode) without calling a model method that may shadow children()
        while stack:
            sub = stack.pop()
            sub.training = self.training
            stack.extend(c for c in sub._modules.values() if c is not None)
        return m

    def extra_repr(self) -> str:
        return f"batch={self.batch}"
