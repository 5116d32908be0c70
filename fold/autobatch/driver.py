"""The driver: ``autobatch`` and ``record_examples`` (the per-example recording, with the
patches installed), the results stacked through one ``apply``, and the errors that name the
example."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fold.autobatch.common import _BATCHED, _DIRECT, _LOCAL, _MISS, _MODELS, _RNN, _VMAP
from fold.autobatch.ops import _Op, _op_device, _OpFailed
from fold.autobatch.patches import _PLAIN, _installed
from fold.autobatch.recorder import _KW_PARTS, _MODE_OPS, _OPS, _Recorder
from fold.autobatch.traced import _UNTRACEABLE, _WITH_MODULES, _call_programs, _flatten, _traced
from fold.autobatch.values import _METAS, Lazy
from fold.errors import FoldError, describe
from fold.run import collector_paused


def clear_cache() -> None:
    """Forget every recorded op signature and its inferred shapes (and the modules and
    parameters they hold)."""
    _OPS.clear()
    _MODE_OPS.clear()
    _METAS.clear()
    _KW_PARTS.clear()
    _UNTRACEABLE.clear()
    _WITH_MODULES.clear()
    _PLAIN.clear()


class _DeviceAnchor(nn.Module):
    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.register_buffer("anchor", torch.empty(0, device=device))


def autobatch(fn: Callable[..., Any], *iterables: Iterable[Any], per_example: bool = False) -> Any:
    """Run ``fn`` once per example (the zip of ``iterables``) with recording on, then the
    recorded graph batched; returns the per-example results stacked along a new dim 0, in
    ``fn``'s output structure (tensor, tuple, list, dict).  See the docstring of fold/autobatch/__init__.py.

    Where every iterable is a tensor (the examples are its rows), ``fn`` is first recorded
    ONCE, on lazy rows standing for all examples, and each recorded call runs once on the
    whole batch (see "One recording for tensor rows" in the docstring of fold/autobatch/__init__.py); where that cannot
    be done it records per example.  ``per_example=True`` always records per example (for a
    function whose per-call side effects matter).

    Records with the cyclic garbage collector paused, as ``Fold.apply`` runs: recording
    makes a few tracked objects per call (Lazy values, tuples), enough to set off full
    collections of the whole heap; they are freed by reference counting.
    """
    if _LOCAL.rec is not None:
        raise FoldError(
            "autobatch: called inside a function autobatch is running. Fix: call the inner "
            "function directly; it is recorded into the same graph."
        )
    if not per_example and iterables:
        out = _traced(fn, iterables)  # installs the patches where it needs them
        if out is not _MISS:
            return out
    with _installed():
        rec, results, spec = record_examples(fn, *iterables)
        return pytree.tree_unflatten(_stack(rec, results), spec)


def record_examples(fn: Callable[..., Any], *iterables: Iterable[Any]) -> tuple[Any, ...]:
    """The recording half of :func:`autobatch`: ``(recorder, per-example flat results,
    their structure)``; ``recorder.fold`` is the graph.  For benchmarks and inspection."""
    rec = _Recorder()
    results: list[list[Any]] = []
    spec = None
    _LOCAL.rec = rec
    installed = _installed()
    installed.__enter__()
    try:
        iterables = tuple(
            rec.rows(it) if isinstance(it, torch.Tensor) and it.ndim else it for it in iterables
        )
        with collector_paused():
            for i, example in enumerate(zip(*iterables)):
                rec.example = i
                try:
                    result = fn(*example)
                except (TypeError, ValueError) as err:
                    explained = _misuse(err, i)
                    if explained is err:
                        raise
                    raise explained from err
                leaves, s = _flatten(result)
                if spec is None:
                    spec = s
                elif s is not spec and s != spec:
                    raise FoldError(
                        f"autobatch: example {i} returned a structure {s} but example 0 "
                        f"returned {spec}; results are stacked per position, so every example "
                        "must return the same structure."
                    )
                results.append(leaves)
    finally:
        _LOCAL.rec = None
        rec.close()
        installed.__exit__(None, None, None)
    if spec is None:
        raise FoldError("autobatch: no examples (the iterables are empty). Fix: pass at least one.")
    return rec, results, spec


def _misuse(err: Exception, i: int) -> Exception:
    """A FoldError for what torch raises where it meets a lazy value it cannot take
    (``err`` itself for any other error): an unbound tensor method, or ``torch.func.vmap``
    inside the per-example function."""
    text = str(err)
    if isinstance(err, FoldError) or "Lazy" not in text:
        return err
    if "vmap" in text:
        fix = (
            "torch.func.vmap (or torch.vmap) inside the function autobatch runs: autobatch "
            "already batches it. Fix: call the vmapped function on the example's values "
            "directly, or loop over them."
        )
    elif "descriptor" in text:
        fix = (
            "an unbound tensor method (torch.Tensor.add(x, 1)) was called on a lazy value, "
            "which is not a torch.Tensor. Fix: call it as a method (x.add(1)) or as a torch "
            "function (torch.add(x, 1))."
        )
    else:
        fix = (
            "a lazy value reached code that takes only torch.Tensor objects. Fix: use torch "
            "functions, tensor methods and operators on it."
        )
    return FoldError(f"autobatch: example {i}: {fix} ({type(err).__name__}: {text})")


def _stack(rec: _Recorder, results: list[list[Any]]) -> list[Any]:
    """Per output position, the examples' values stacked: lazy ones through one apply."""
    columns = list(zip(*results)) if results[0] else []
    lists: list[list[Any]] = []
    where: list[int | None] = []
    out: list[Any] = []
    for j, col in enumerate(columns):
        _check_column(rec, j, col)
        if all(type(v) is Lazy for v in col):
            where.append(len(lists))
            lists.append([v.node for v in col])
            out.append(None)
        elif all(isinstance(v, torch.Tensor) for v in col):
            where.append(None)
            out.append(torch.stack(col))
        elif all(isinstance(v, (torch.Tensor, Lazy)) for v in col):
            where.append(len(lists))
            lists.append(
                [v.node if type(v) is Lazy else rec.fold.add(_same, v.unsqueeze(0)) for v in col]
            )
            out.append(None)
        elif all(v is None for v in col):
            where.append(None)
            out.append(None)
        elif all(type(v) in (int, float, bool) for v in col):
            where.append(None)
            out.append(torch.tensor(col))
        else:
            bad = next(v for v in col if not isinstance(v, (torch.Tensor, Lazy)))
            raise FoldError(
                f"autobatch: output {j} holds a {type(bad).__name__}; results are stacked, so "
                "they must be tensors (or numbers, or None throughout)."
            )
    if lists:
        device = _device(rec)
        obj = _DeviceAnchor(device) if device is not None and device.type != "cpu" else None
        try:
            with _call_programs():
                values = rec.fold.apply(obj, lists)
        except FoldError as err:
            cause = err.__cause__
            if isinstance(cause, _OpFailed):  # chained to the user's exception, as apply is
                raise _explained(err) from cause.__cause__
            raise
        for j, w in enumerate(where):
            if w is not None:
                out[j] = values[w]
    return out


def _check_column(rec: _Recorder, j: int, col: tuple[Any, ...]) -> None:
    """Output ``j`` of every example: lazy values of this call, and one shape and dtype
    where they are tensors or lazy values (they are stacked); a FoldError naming the first
    example that differs."""
    first: Any = None
    for i, v in enumerate(col):
        t = type(v)
        if t is Lazy:
            if v.rec is not rec:
                raise FoldError(
                    f"autobatch: example {i} returned (as output {j}) a lazy value of an "
                    "earlier autobatch call, kept beyond it. Its value exists only in that "
                    "call's results. Fix: pass that call's result in as an input."
                )
            shape, dtype = v.meta.shape, v.meta.dtype
        elif isinstance(v, torch.Tensor):
            shape, dtype = v.shape, v.dtype
        else:
            continue
        if first is None:
            first = (i, shape, dtype)
        elif shape != first[1] or dtype != first[2]:
            raise FoldError(
                f"autobatch: example {i} returned {describe(shape, dtype)} as output {j}, "
                f"example {first[0]} {describe(first[1], first[2])}; results are stacked "
                "along a new dim 0, so every example's output must have one shape and dtype. "
                "Fix: pad or reduce to a common shape inside the function."
            )


def _device(rec: _Recorder) -> torch.device | None:
    """Where the graph's literals go: the device of the recorded calls' parameters (of
    modules called, or shared tensors), else of the tensors made per example."""
    for op, _ in rec.fold.signatures:
        if type(op) is _Op:
            device = _op_device(op)
            if device is not None:
                return device
    return rec.device


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def _explained(err: FoldError) -> FoldError:
    cause = err.__cause__
    if not isinstance(cause, _OpFailed):
        return err
    op, orig = cause.op, cause.__cause__
    shapes = ", ".join(
        describe(v.shape, v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__
        for v in cause.values
    )
    how = {
        _DIRECT: "directly on the stacked values",
        _VMAP: "under torch.func.vmap",
        _BATCHED: "directly (batched=True)",
        _MODELS: "with the models' rows merged",
        _RNN: "as one batch of sequences",
    }[op.mode]
    if op.mode is _VMAP:
        how = "under torch.func.vmap, then one call per example"
    return FoldError(
        f"autobatch: {op.name}, recorded at {op.where or '?'}, failed on a group of "
        f"{cause.values[0].shape[0] if cause.values and isinstance(cause.values[0], torch.Tensor) else '?'} "
        f"calls run {how} (stacked arguments {shapes}): {type(orig).__name__}: {orig}. Fix: run "
        "the function eagerly on one example (outside autobatch) to debug it; under vmap, "
        "per-example code must not read values (.item()) or change tensors in place."
    )
