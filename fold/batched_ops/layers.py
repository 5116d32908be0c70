"""Model-batched layers: each computes on its stored ``(N, ...)`` weights directly.

Inputs and outputs are ``(b*N, ...)`` rows in ``(b g)`` order (see ``core``).  No layer copies
a weight per sample: linear maps are one ``baddbmm`` over the model dim, convolutions one
grouped convolution, normalisations one call on ``(b, N*C, ...)`` plus a per-model affine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fold.batched_ops.core import AbstractBatchModule, count_tensors, register_batch_module
from fold.errors import FoldError

__all__ = [
    "BatchBatchNorm",
    "BatchBilinear",
    "BatchConvTranspose",
    "BatchGRU",
    "BatchRNN",
    "BatchLSTM",
    "BatchConv",
    "BatchEmbedding",
    "BatchGRUCell",
    "BatchGroupNorm",
    "BatchLSTMCell",
    "BatchLayerNorm",
    "BatchLinear",
    "BatchRNNCell",
    "batched_linear",
]


def batched_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ weight[g].T + bias[g]`` for the rows of model g: x ``(b*N, ..., in)``, weight ``(N, out, in)``."""
    n, out_f, in_f = weight.shape
    if n == 1:  # one model (a chunk of one): a plain linear map
        return F.linear(x, weight[0], None if bias is None else bias[0])
    rest = x.shape[1:-1]
    # (b*N, ..., in) -> (N, b*..., in): one copy of the input, then one batched matmul.
    xt = x.reshape(-1, n, *rest, in_f).movedim(1, 0).reshape(n, -1, in_f)
    if bias is None:
        y = torch.bmm(xt, weight.transpose(1, 2))
    else:
        y = torch.baddbmm(bias.unsqueeze(1), xt, weight.transpose(1, 2))
    return y.reshape(n, -1, *rest, out_f).movedim(0, 1).reshape(-1, *rest, out_f)


@register_batch_module
class BatchLinear(AbstractBatchModule):
    base_class = nn.Linear

    def __init__(self, modules: Sequence[nn.Linear]) -> None:
        super().__init__(len(modules))
        self.in_features = modules[0].in_features
        self.out_features = modules[0].out_features
        self.weight = self.stack(modules, "weight")
        self.register_parameter("bias", self.stack(modules, "bias"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return batched_linear(x, self.p("weight"), self.p("bias"))


class BatchConv(AbstractBatchModule):
    """Conv1d/2d/3d of N models as one convolution with N times the groups.

    ``grouped``: None (the default) runs one grouped convolution for all N models on a GPU
    and N plain ones on a CPU (where a grouped one is slower, benchmarks/models.py); True or
    False forces one formulation (same values)."""

    grouped: bool | None = None

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        super().__init__(len(modules))
        m: Any = modules[0]
        self.stride, self.padding, self.dilation = m.stride, m.padding, m.dilation
        self.groups, self.padding_mode = m.groups, m.padding_mode
        self.out_channels = m.out_channels
        self._pad_twice = m._reversed_padding_repeated_twice
        self._conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[len(m.kernel_size)]
        self.weight = self.stack(modules, "weight")
        self.register_parameter("bias", self.stack(modules, "bias"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, weight, bias = self.n, self.p("weight"), self.p("bias")
        xg = x.reshape(-1, n * x.shape[1], *x.shape[2:])  # (b, N*C, ...): the same memory
        padding: Any = self.padding
        if self.padding_mode != "zeros":
            xg = F.pad(xg, self._pad_twice, mode=self.padding_mode)
            padding = 0
        if n == 1:  # one model (a chunk of one): a plain convolution
            y = self._conv(
                xg,
                weight[0],
                None if bias is None else bias[0],
                self.stride,
                padding,
                self.dilation,
                self.groups,
            )
            return y
        grouped = xg.is_cuda if self.grouped is None else self.grouped
        if grouped:  # cuDNN runs grouped convolutions well: one call for all N models
            w = weight.reshape(n * weight.shape[1], *weight.shape[2:])
            b = None if bias is None else bias.reshape(-1)
            y = self._conv(xg, w, b, self.stride, padding, self.dilation, n * self.groups)
            return y.reshape(-1, self.out_channels, *y.shape[2:])
        # On CPU a grouped convolution is ~1.6x slower than N plain ones (benchmarks/models.py):
        # move the model dim first (one copy), convolve each model's contiguous slice, and
        # stack back into (b g) order (one copy).
        xs = xg.reshape(xg.shape[0], n, -1, *xg.shape[2:]).transpose(0, 1).contiguous()
        biases = [None] * n if bias is None else bias.unbind(0)
        ys = [
            self._conv(xi, wi, bi, self.stride, padding, self.dilation, self.groups)
            for xi, wi, bi in zip(xs.unbind(0), weight.unbind(0), biases)
        ]
        y = torch.stack(ys, 1)
        return y.reshape(-1, *y.shape[2:])


def _define(name: str, base: type, base_class: type) -> None:
    """A layer class for ``base_class`` made from a generic one, defined as a module global
    of this module (under its ``__qualname__``) so that pickle and ``torch.save`` find it."""
    cls = type(name, (base,), {"base_class": base_class, "__module__": __name__})
    cls.__qualname__ = name
    globals()[name] = register_batch_module(cls)


for _base in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
    _define(f"Batch{_base.__name__}", BatchConv, _base)


class BatchBatchNorm(AbstractBatchModule):
    """BatchNorm of N models: per-model batch statistics and running statistics."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        super().__init__(len(modules))
        m: Any = modules[0]
        self.num_features, self.eps, self.momentum = m.num_features, m.eps, m.momentum
        self.track_running_stats = m.track_running_stats
        self.register_parameter("weight", self.stack(modules, "weight"))
        self.register_parameter("bias", self.stack(modules, "bias"))
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            self.register_buffer(name, self.stack(modules, name, buffer=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.n
        mean, var, tracked = (
            self.p("running_mean"),
            self.p("running_var"),
            self.p("num_batches_tracked"),
        )
        weight, bias = self.p("weight"), self.p("bias")
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and tracked is not None:
            tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as nn.BatchNorm
                factor = 1.0 / float(tracked[0])
        use_batch = self.training or mean is None
        xg = x.reshape(-1, n * x.shape[1], *x.shape[2:])
        y = F.batch_norm(
            xg,
            None if mean is None else mean.view(-1),
            None if var is None else var.view(-1),
            None if weight is None else weight.reshape(-1),
            None if bias is None else bias.reshape(-1),
            use_batch,
            factor,
            self.eps,
        )
        return y.reshape(x.shape)


for _base in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d):
    _define(f"Batch{_base.__name__}", BatchBatchNorm, _base)


def _affine(
    y: torch.Tensor, n: int, weight: Any, bias: Any, feature_dims: int, channel_dim: int
) -> torch.Tensor:
    """Per-model affine on ``y`` (b*N, ...): weight/bias (N, *features) at ``channel_dim``."""
    ys = y.view(-1, n, *y.shape[1:])
    shape = [1, n] + [1] * (y.dim() - 1)
    shape[1 + channel_dim : 1 + channel_dim + feature_dims] = (
        weight.shape[1:] if weight is not None else bias.shape[1:]
    )
    if weight is not None:
        ys = ys * weight.view(shape)
    if bias is not None:
        ys = ys + bias.view(shape)
    return ys.reshape(y.shape)


@register_batch_module
class BatchLayerNorm(AbstractBatchModule):
    base_class = nn.LayerNorm

    def __init__(self, modules: Sequence[nn.LayerNorm]) -> None:
        super().__init__(len(modules))
        m = modules[0]
        self.normalized_shape, self.eps = m.normalized_shape, m.eps
        self.register_parameter("weight", self.stack(modules, "weight"))
        self.register_parameter("bias", self.stack(modules, "bias"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x, self.normalized_shape, None, None, self.eps)
        k = len(self.normalized_shape)
        return _affine(y, self.n, self.p("weight"), self.p("bias"), k, x.dim() - k)


@register_batch_module
class BatchGroupNorm(AbstractBatchModule):
    base_class = nn.GroupNorm

    def __init__(self, modules: Sequence[nn.GroupNorm]) -> None:
        super().__init__(len(modules))
        m = modules[0]
        self.num_groups, self.eps = m.num_groups, m.eps
        self.register_parameter("weight", self.stack(modules, "weight"))
        self.register_parameter("bias", self.stack(modules, "bias"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.group_norm(x, self.num_groups, None, None, self.eps)
        return _affine(y, self.n, self.p("weight"), self.p("bias"), 1, 1)


@register_batch_module
class BatchEmbedding(AbstractBatchModule):
    base_class = nn.Embedding

    def __init__(self, modules: Sequence[nn.Embedding]) -> None:
        super().__init__(len(modules))
        m = modules[0]
        if m.max_norm is not None or m.sparse:
            raise NotImplementedError("max_norm and sparse embeddings")
        self.num_embeddings, self.padding_idx = m.num_embeddings, m.padding_idx
        self.weight = self.stack(modules, "weight")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n, v = self.n, self.num_embeddings
        model = torch.arange(ids.shape[0], device=ids.device) % n
        offset = (model * v).view(-1, *([1] * (ids.dim() - 1)))
        out = F.embedding(ids + offset, self.p("weight").reshape(n * v, -1))
        if self.padding_idx is not None:  # no gradient into the padding row, as nn.Embedding
            keep = (ids != self.padding_idx).unsqueeze(-1)
            out = torch.where(keep, out, out.detach())
        return out


def lstm_step(
    gi: torch.Tensor, gh: torch.Tensor, c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One LSTM step from its input and hidden gate pre-activations: (h, c)."""
    i, f, g, o = (gi + gh).chunk(4, 1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def gru_step(gi: torch.Tensor, gh: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """One GRU step from its input and hidden gate pre-activations: the new h."""
    ir, iz, in_ = gi.chunk(3, 1)
    hr, hz, hn = gh.chunk(3, 1)
    r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
    return (1 - z) * torch.tanh(in_ + r * hn) + z * h


class _BatchCell(AbstractBatchModule):
    def __init__(self, modules: Sequence[nn.Module]) -> None:
        super().__init__(len(modules))
        m: Any = modules[0]
        self.hidden_size = m.hidden_size
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            self.register_parameter(name, self.stack(modules, name))

    def _gates(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            batched_linear(x, self.p("weight_ih"), self.p("bias_ih")),
            batched_linear(h, self.p("weight_hh"), self.p("bias_hh")),
        )

    def _zeros(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(x.shape[0], self.hidden_size)

    def _same_batch(self, x: torch.Tensor, *states: torch.Tensor) -> None:
        """torch's cells refuse a state of another batch size; merged rows would broadcast
        (one state row for all inputs) instead."""
        for s in states:
            if s.dim() != x.dim() or s.shape[0] != x.shape[0]:
                n = self.n
                raise FoldError(
                    f"{type(self).__name__}: the input's batch of {x.shape[0] // n} rows does "
                    f"not match the state's shape {(s.shape[0] // n, *s.shape[1:])} (as "
                    f"{self.base_class.__name__} refuses it). Fix: give the state one row per "
                    "input row."
                )


@register_batch_module
class BatchRNNCell(_BatchCell):
    base_class = nn.RNNCell

    def __init__(self, modules: Sequence[nn.RNNCell]) -> None:
        super().__init__(modules)
        self.nonlinearity = modules[0].nonlinearity

    def forward(self, x: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
        h = self._zeros(x) if h is None else h
        self._same_batch(x, h)
        gi, gh = self._gates(x, h)
        return torch.tanh(gi + gh) if self.nonlinearity == "tanh" else torch.relu(gi + gh)


@register_batch_module
class BatchGRUCell(_BatchCell):
    base_class = nn.GRUCell

    def forward(self, x: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
        h = self._zeros(x) if h is None else h
        self._same_batch(x, h)
        return gru_step(*self._gates(x, h), h)


@register_batch_module
class BatchLSTMCell(_BatchCell):
    base_class = nn.LSTMCell

    def forward(
        self, x: torch.Tensor, hx: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, c = (self._zeros(x), self._zeros(x)) if hx is None else hx
        self._same_batch(x, h, c)
        return lstm_step(*self._gates(x, h), c)


class _BatchRNN(AbstractBatchModule):
    """Multi-layer (bi)LSTM/GRU of N models.  Every tensor keeps its batch dim merged in
    ``(b g)`` order: dim 0 of a batch-first input/output, dim 1 otherwise and of h_n/c_n."""

    mode = ""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        super().__init__(len(modules))
        m: Any = modules[0]
        if getattr(m, "proj_size", 0):
            raise NotImplementedError("LSTM proj_size")
        self.hidden_size, self.num_layers, self.bias_on = m.hidden_size, m.num_layers, m.bias
        self.batch_first, self.dropout, self.dirs = (
            m.batch_first,
            m.dropout,
            2 if m.bidirectional else 1,
        )
        for name, _ in m.named_parameters():
            self.register_parameter(name, self.stack(modules, name))

    def _cell(
        self, gi: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None, w: Any, b: Any
    ) -> tuple[torch.Tensor, Any]:
        gh = batched_linear(h, w, b)
        if self.mode == "LSTM":
            return lstm_step(gi, gh, c)
        if self.mode == "GRU":
            return gru_step(gi, gh, h), None
        return (torch.relu if self.mode == "RNN_RELU" else torch.tanh)(gi + gh), None

    def row_dims(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int]:
        # the input's batch dim (0 batch-first, else 1), then the states' (1)
        return [0 if self.batch_first else 1] + [1] * (count_tensors((args, kwargs)) - 1)

    def result_row_dims(self, out: Any) -> list[int]:
        return [0 if self.batch_first else 1] + [1] * (count_tensors(out) - 1)

    def forward(self, x: torch.Tensor, hx: Any = None) -> tuple[torch.Tensor, Any]:
        seq = x if self.batch_first else x.transpose(0, 1)  # (B*N, T, in)
        rows, steps = seq.shape[0], seq.shape[1]
        lstm = self.mode == "LSTM"
        if hx is None:
            zeros = seq.new_zeros(self.num_layers * self.dirs, rows, self.hidden_size)
            h0, c0 = zeros, zeros if lstm else None
        else:
            h0, c0 = hx if lstm else (hx, None)
            for s in (h0,) if c0 is None else (h0, c0):
                if s.dim() != 3 or s.shape[1] != rows:
                    n = self.n
                    raise FoldError(
                        f"{type(self).__name__}: the input's batch of {rows // n} sequences "
                        f"does not match the state's shape {(s.shape[0], s.shape[1] // n, *s.shape[2:])}"
                        f" (as {self.base_class.__name__} refuses it). Fix: give the state "
                        "(layers * directions, batch, hidden)."
                    )
        hs, cs = [], []
        for layer in range(self.num_layers):
            outs = []
            for d in range(self.dirs):
                sfx = f"_l{layer}" + ("_reverse" if d else "")
                bias_ih = self.p("bias_ih" + sfx) if self.bias_on else None
                bias_hh = self.p("bias_hh" + sfx) if self.bias_on else None
                gates = batched_linear(seq, self.p("weight_ih" + sfx), bias_ih)  # (B*N, T, G)
                k = layer * self.dirs + d
                h, c = h0[k], (c0[k] if lstm else None)
                order = range(steps - 1, -1, -1) if d else range(steps)
                ys: list[torch.Tensor] = [seq] * steps
                for t in order:
                    h, c = self._cell(gates[:, t], h, c, self.p("weight_hh" + sfx), bias_hh)
                    ys[t] = h
                outs.append(torch.stack(ys, 1))
                hs.append(h)
                if lstm:
                    cs.append(c)
            seq = outs[0] if self.dirs == 1 else torch.cat(outs, 2)
            if self.dropout and self.training and layer < self.num_layers - 1:
                seq = F.dropout(seq, self.dropout, True)
        out = seq if self.batch_first else seq.transpose(0, 1)
        h_n = torch.stack(hs)
        return out, ((h_n, torch.stack(cs)) if lstm else h_n)


@register_batch_module
class BatchLSTM(_BatchRNN):
    base_class = nn.LSTM
    mode = "LSTM"


@register_batch_module
class BatchGRU(_BatchRNN):
    base_class = nn.GRU
    mode = "GRU"


@register_batch_module
class BatchRNN(_BatchRNN):
    """Multi-layer (bi)directional Elman RNNs of N models (tanh or relu)."""

    base_class = nn.RNN

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        super().__init__(modules)
        self.mode = "RNN_RELU" if modules[0].nonlinearity == "relu" else "RNN_TANH"


class BatchConvTranspose(BatchConv):
    """ConvTranspose1d/2d of N models (grouped on a GPU, per model on a CPU)."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        super().__init__(modules)
        m: Any = modules[0]
        self.output_padding = m.output_padding
        self._transposed = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[
            len(m.kernel_size)
        ]
        # A bound method, not a lambda, so that the layer pickles.
        self._conv = self._conv_transpose
        self.out_channels = m.out_channels

    def _conv_transpose(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        b: Any,
        stride: Any,
        padding: Any,
        dilation: Any,
        groups: int,
    ) -> torch.Tensor:
        """A transposed convolution with a convolution's call shape (x, w, b, stride,
        padding, dilation, groups)."""
        return self._transposed(x, w, b, stride, padding, self.output_padding, groups, dilation)


for _base in (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d):
    _define(f"Batch{_base.__name__}", BatchConvTranspose, _base)


@register_batch_module
class BatchBilinear(AbstractBatchModule):
    base_class = nn.Bilinear

    def __init__(self, modules: Sequence[nn.Bilinear]) -> None:
        super().__init__(len(modules))
        self.weight = self.stack(modules, "weight")  # (N, out, in1, in2)
        self.register_parameter("bias", self.stack(modules, "bias"))

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        n = self.n
        a = x1.reshape(-1, n, x1.shape[-1])
        b = x2.reshape(-1, n, x2.shape[-1])
        y = torch.einsum("rni,noij,rnj->rno", a, self.p("weight"), b)
        bias = self.p("bias")
        if bias is not None:
            y = y + bias
        return y.reshape(*x1.shape[:-1], y.shape[-1])
