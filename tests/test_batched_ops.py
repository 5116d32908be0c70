"""Model-batched layers against N separate modules: values, gradients, isolation, state."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from fold import FoldError
from fold.batched_ops import (
    AbstractBatchModule,
    BatchModule,
    VmapFallback,
    batch_loss,
    batch_topk,
    register_batch_module,
)
from fold.models import TreeLSTM
from fold.testing import BatchingMismatch, check_model_batching

N = 3


def randn(*shape: int):
    return lambda n: (torch.randn(n, *shape),)


def ints(high: int, *shape: int):
    return lambda n: (torch.randint(0, high, (n, *shape)),)


class Scaled(nn.Module):
    """Uses a raw parameter directly: takes the vmap fallback."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return self.lin(x) * self.scale


class BatchFirst(nn.Module):
    """An LSTM/GRU whose states cross the model boundary batch-first (B, layers, H)."""

    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x, h0=None, c0=None):
        hx = None
        if h0 is not None:
            hx = h0.transpose(0, 1).contiguous()
            if c0 is not None:
                hx = (hx, c0.transpose(0, 1).contiguous())
        out, h = self.rnn(x, hx)
        states = h if isinstance(h, tuple) else (h,)
        return (out, *(s.transpose(0, 1) for s in states))


class LastStep(nn.Module):
    """A batch-first model around a sequence-first GRU: the merged batch sits in dim 1 there."""

    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x):  # x: (B, T, in)
        out, h = self.rnn(x.transpose(0, 1))
        return torch.cat([out[-1], h.sum(0)], 1)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU())
        self.head = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.head(self.body(x).flatten(1))


# (id, module factory, input maker): every layer the issue names, in several configurations.
CASES = [
    ("linear", lambda: nn.Linear(5, 3), randn(4, 5)),
    ("linear-no-bias", lambda: nn.Linear(5, 3, bias=False), randn(4, 5)),
    ("linear-3d-input", lambda: nn.Linear(5, 3), randn(4, 2, 5)),
    ("conv1d", lambda: nn.Conv1d(2, 4, 3, stride=2, padding=1), randn(4, 2, 9)),
    (
        "conv2d-groups-dilation",
        lambda: nn.Conv2d(4, 6, 3, groups=2, dilation=2, padding=2),
        randn(2, 4, 7, 7),
    ),
    ("conv2d-same", lambda: nn.Conv2d(3, 2, 4, padding="same"), randn(2, 3, 6, 6)),
    (
        "conv2d-reflect",
        lambda: nn.Conv2d(3, 2, 3, padding=1, padding_mode="reflect"),
        randn(2, 3, 5, 5),
    ),
    (
        "conv2d-circular",
        lambda: nn.Conv2d(2, 2, 3, padding=1, padding_mode="circular"),
        randn(2, 2, 5, 5),
    ),
    ("conv3d", lambda: nn.Conv3d(2, 3, 2), randn(2, 2, 4, 4, 4)),
    ("batchnorm1d", lambda: nn.BatchNorm1d(4), randn(6, 4)),
    ("batchnorm1d-3d-input", lambda: nn.BatchNorm1d(4, momentum=None), randn(5, 4, 3)),
    ("batchnorm2d", lambda: nn.BatchNorm2d(3), randn(4, 3, 5, 5)),
    ("batchnorm3d-no-affine", lambda: nn.BatchNorm3d(2, affine=False), randn(3, 2, 3, 3, 3)),
    ("layernorm", lambda: nn.LayerNorm(6), randn(4, 6)),
    ("layernorm-2d", lambda: nn.LayerNorm([3, 4]), randn(2, 5, 3, 4)),
    ("groupnorm", lambda: nn.GroupNorm(2, 4), randn(3, 4, 5)),
    ("embedding", lambda: nn.Embedding(10, 4), ints(10, 5)),
    ("embedding-padding", lambda: nn.Embedding(10, 4, padding_idx=0), ints(3, 2, 6)),
    ("rnncell", lambda: nn.RNNCell(3, 4), lambda n: (torch.randn(n, 5, 3), torch.randn(n, 5, 4))),
    ("rnncell-relu", lambda: nn.RNNCell(3, 4, nonlinearity="relu"), randn(5, 3)),
    ("grucell", lambda: nn.GRUCell(3, 4), lambda n: (torch.randn(n, 5, 3), torch.randn(n, 5, 4))),
    (
        "lstmcell",
        lambda: nn.LSTMCell(3, 4),
        lambda n: (torch.randn(n, 5, 3), (torch.randn(n, 5, 4), torch.randn(n, 5, 4))),
    ),
    (
        "conv-transpose1d",
        lambda: nn.ConvTranspose1d(2, 3, 3, stride=2, output_padding=1),
        randn(2, 2, 5),
    ),
    (
        "conv-transpose2d-groups",
        lambda: nn.ConvTranspose2d(4, 2, 3, stride=2, padding=1, groups=2),
        randn(2, 4, 4, 4),
    ),
    (
        "bilinear",
        lambda: nn.Bilinear(3, 4, 2),
        lambda n: (torch.randn(n, 5, 3), torch.randn(n, 5, 4)),
    ),
    (
        "lstm-2-layers-batch-first",
        lambda: BatchFirst(nn.LSTM(3, 4, num_layers=2, batch_first=True)),
        randn(2, 5, 3),
    ),
    (
        "gru-bidirectional-seq-first",
        lambda: LastStep(nn.GRU(3, 4, bidirectional=True)),
        randn(5, 4, 3),
    ),
    (
        "lstm-with-initial-state",
        lambda: BatchFirst(nn.LSTM(3, 4, batch_first=True)),
        lambda n: (torch.randn(n, 2, 6, 3), torch.randn(n, 2, 1, 4), torch.randn(n, 2, 1, 4)),
    ),
    (
        "gru-dropout-eval-only",
        lambda: BatchFirst(nn.GRU(3, 4, num_layers=2, batch_first=True, dropout=0.5)),
        randn(2, 5, 3),
    ),
    ("sequential-block", Block, randn(2, 3, 6, 6)),
    # RNNs alone: their sequence-first inputs and their states keep the batch in dim 1
    ("gru-alone-seq-first-2-layers", lambda: nn.GRU(3, 4, num_layers=2), randn(5, 4, 3)),
    (
        "lstm-alone-batch-first-bidirectional",
        lambda: nn.LSTM(3, 4, batch_first=True, bidirectional=True),
        randn(4, 5, 3),
    ),
    ("rnn-relu-alone", lambda: nn.RNN(3, 4, num_layers=2, nonlinearity="relu"), randn(5, 4, 3)),
    (
        "rnn-tanh-alone-with-state",
        lambda: nn.RNN(3, 4),
        lambda n: (torch.randn(n, 5, 4, 3), torch.randn(n, 1, 4, 4)),
    ),
    ("vmap-fallback", Scaled, randn(5, 4)),
]


@pytest.mark.parametrize("chunk", [None, 2], ids=["all-models", "chunks-of-2"])
@pytest.mark.parametrize("name, factory, make_inputs", CASES, ids=[c[0] for c in CASES])
def test_layer_runs_like_separate_models(name: str, factory, make_inputs, chunk) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback case warns; tested below
        modes = ("eval",) if "eval-only" in name else ("train", "eval")
        check_model_batching(factory, make_inputs, batch=N, chunk_size=chunk, modes=modes)


CONV_CASES = [c for c in CASES if c[0].startswith("conv") and "transpose" not in c[0]]


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "per-model"])
@pytest.mark.parametrize("name, factory, make_inputs", CONV_CASES, ids=[c[0] for c in CONV_CASES])
def test_convolutions_grouped_or_per_model_run_like_separate_models(
    name: str, factory, make_inputs, grouped: bool, monkeypatch
) -> None:
    """Both formulations of N models' convolutions: one grouped convolution (a GPU's
    default) and N plain ones (a CPU's), each checked here on the CPU."""
    from fold.batched_ops.layers import BatchConv

    monkeypatch.setattr(BatchConv, "grouped", grouped)
    with warnings.catch_warnings():  # torch's own warning of padding="same", even kernels
        warnings.simplefilter("ignore", UserWarning)
        check_model_batching(factory, make_inputs, batch=N)


def test_check_model_batching_reports_a_broken_layer() -> None:
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(x).flip(0)  # mixes rows across models: must be reported

    with pytest.raises(
        BatchingMismatch, match=r"Broken like 3 separate models:(.|\n)*output 0, model 0"
    ):
        check_model_batching(Broken, randn(4, 3))


def test_fallback_warns_naming_the_module() -> None:
    with pytest.warns(
        UserWarning, match=r"no batched layer for the root \(Scaled: uses its own parameters"
    ):
        bm = BatchModule(Scaled(), batch=2)
    assert isinstance(bm.model, VmapFallback)


def test_a_module_vmap_cannot_run_is_a_fold_error() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

        def forward(self, x):
            return x * self.w if x.sum().item() > 0 else x  # data-dependent control flow

    with pytest.warns(UserWarning, match="Branchy"):
        bm = BatchModule(nn.Sequential(nn.Linear(2, 2), Branchy()), batch=2)
    with pytest.raises(
        FoldError,
        match=r"BatchModule: 1 \(Branchy.forward\) has no batched layer and does not run under torch.vmap",
    ):
        bm(torch.randn(2, 3, 2))


def test_dropout_masks_are_independent_per_model() -> None:
    bm = BatchModule(nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5)), batch=4)
    x = torch.randn(1, 16, 8).expand(4, 16, 8)
    y = bm(x)
    zero = y == 0
    assert zero.float().mean().item() == pytest.approx(0.5, abs=0.1)
    assert not torch.equal(zero[0], zero[1])  # same weights, same input, different masks
    bm.eval()
    assert torch.equal(bm(x)[0], bm(x)[1])


def test_copies_of_one_model_start_equal() -> None:
    m = nn.Linear(4, 2)
    bm = BatchModule(m, batch=5)
    x = torch.randn(1, 3, 4).expand(5, 3, 4)
    y = bm(x)
    for i in range(5):
        torch.testing.assert_close(y[i], m(x[0]))


def test_model_methods_batch_too_and_shadowing_names_warn() -> None:
    class Spinn(TreeLSTM):
        def children(self, lh, lc, rh, rc):  # noqa: D102 - TorchFold's SPINN name
            return self.node(lh, lc, rh, rc)

    with pytest.warns(UserWarning, match=r"Spinn.children shadows nn.Module.children"):
        bm = BatchModule.from_modules([Spinn(20, 4) for _ in range(2)])
    words = torch.randint(0, 20, (2, 3))
    h, c = bm.leaf(words)
    assert h.shape == (2, 3, 4)
    h2, _ = bm.method("children")(h, c, h, c)  # the model's children(), not nn.Module's
    ref = bm.unbatch(1)
    rh, rc = ref.leaf(words[1])
    torch.testing.assert_close(h2[1], ref.node(rh, rc, rh, rc)[0])


# ---------------------------------------------------------------- optimizers
class LeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 5, padding=2)
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 8, 5)
        self.fc1 = nn.Linear(8 * 2 * 2, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


OPTIMIZERS = [
    (
        "sgd-momentum-nesterov-wd",
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2),
    ),
    ("adam", lambda p: torch.optim.Adam(p, lr=1e-2)),
    ("adamw", lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)),
]


@pytest.mark.parametrize("name, make_opt", OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
def test_three_optimizer_steps_equal_separate_training(name: str, make_opt) -> None:
    torch.manual_seed(0)
    models = [LeNet().double() for _ in range(N)]
    bm = BatchModule.from_modules(copy.deepcopy(models))
    bm.chunk_size = 2  # chunks of 2 and 1 models: gradients must still land per model
    opt = make_opt(bm.parameters())
    opts = [make_opt(m.parameters()) for m in models]
    for _ in range(3):
        x = torch.randn(N, 6, 1, 16, 16, dtype=torch.double)
        y = torch.randint(0, 10, (N, 6))
        opt.zero_grad()
        batch_loss(bm(x), y, N, F.cross_entropy).sum().backward()
        opt.step()
        for i, (m, o) in enumerate(zip(models, opts)):
            o.zero_grad()
            F.cross_entropy(m(x[i]), y[i]).backward()
            o.step()
    for i, m in enumerate(models):
        mine = bm.state_dicts()[i]
        for k, v in m.state_dict().items():
            torch.testing.assert_close(mine[k], v, msg=lambda s, k=k, i=i: f"model {i} {k}: {s}")


# ---------------------------------------------------------------- memory, functional, errors
def test_batched_linear_makes_no_intermediate_larger_than_its_operands() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    sizes: list[int] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    sizes.append(t.numel())
            return out

    n, b, i, o = 16, 64, 32, 8
    bm = BatchModule(nn.Linear(i, o), batch=n)
    x = torch.randn(n, b, i)
    with Record():
        y = bm(x)
    limit = max(x.numel(), y.numel(), n * o * i)
    assert sizes and max(sizes) <= limit, (max(sizes), limit)
    # A weight copy per sample (the peer's repeat-then-bmm) would need b * n * o * i elements.
    assert max(sizes) < b * n * o * i


def test_batch_loss_and_topk_match_per_model_loops() -> None:
    out = torch.randn(N, 7, 5)
    tgt = torch.randint(0, 5, (N, 7))
    for red in ("mean", "sum"):
        ref = torch.stack([F.cross_entropy(out[i], tgt[i], reduction=red) for i in range(N)])
        torch.testing.assert_close(batch_loss(out, tgt, N, F.cross_entropy, red), ref)
    acc = batch_topk(out, tgt, N, (1, 3))
    assert acc.shape == (2, N)
    for i in range(N):
        top3 = out[i].topk(3, -1).indices
        assert acc[0, i].item() == pytest.approx((top3[:, 0] == tgt[i]).float().mean().item())
        assert acc[1, i].item() == pytest.approx(
            (top3 == tgt[i, :, None]).any(1).float().mean().item()
        )


def test_custom_layer_registration() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(3))

        def forward(self, x):
            return x * self.weight

    @register_batch_module
    class BatchScale(AbstractBatchModule):
        base_class = Scale

        def __init__(self, modules):
            super().__init__(len(modules))
            self.weight = self.stack(modules, "weight")

        def forward(self, x):
            return (self.split_models(x) * self.weight).flatten(0, 1)

    bm = check_model_batching(Scale, randn(4, 3))
    assert isinstance(bm.model, BatchScale)
    with pytest.raises(FoldError, match="set base_class"):
        register_batch_module(type("NoBase", (AbstractBatchModule,), {}))


def test_bad_input_is_a_fold_error() -> None:
    bm = BatchModule(nn.Linear(3, 2), batch=4)
    with pytest.raises(
        FoldError, match=r"expected an input of shape \(N=4, b, \.\.\.\).*got \(3, 5, 3\)"
    ):
        bm(torch.randn(3, 5, 3))
    with pytest.raises(FoldError, match="got 2 state dicts for 4 models"):
        bm.load_state_dicts(bm.state_dicts()[:2])
    sds = bm.state_dicts()
    sds[1] = {"weight": sds[1]["weight"], "extra": torch.zeros(1)}
    with pytest.raises(
        FoldError, match=r"state dict 1 has missing keys \['bias'\] and unexpected keys \['extra'\]"
    ):
        bm.load_state_dicts(sds)
    with pytest.raises(FoldError, match=r"unbatch\(4\): .* from 0 to 3 \(there are 4 models\)"):
        bm.unbatch(4)
    with pytest.raises(
        FoldError, match="module \\(root\\) is Conv1d in model 1, Linear in model 0"
    ):
        BatchModule.from_modules([nn.Linear(2, 2), nn.Conv1d(2, 2, 1)])
    with pytest.raises(FoldError, match="batch must be a positive int"):
        BatchModule(nn.Linear(2, 2), batch=0)


# ---------------------------------------------------------------------- hardening


def _mlp(hidden: int = 4, depth: int = 1, bias: bool = True) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(3, hidden, bias=bias)]
    for _ in range(depth - 1):
        layers += [nn.Tanh(), nn.Linear(hidden, hidden, bias=bias)]
    return nn.Sequential(*layers)


@pytest.mark.parametrize(
    "other, match",
    [
        (_mlp(depth=2), r"model 1 has module 1 \(Tanh\), which model 0 lacks"),
        (
            _mlp(hidden=5),
            r"parameter 0.weight is shape \(5, 3\), float32 on cpu in model 1, shape \(4, 3\)",
        ),
        (_mlp(bias=False), r"model 0 has parameter 0.bias \(shape \(4,\).*\), which model 1 lacks"),
        (_mlp().double(), r"float64 .* in model 1, .*float32.*Fix: convert them to one dtype"),
        ("not a module", r"item 1 is a str, not an nn.Module"),
        (
            nn.Sequential(nn.Linear(3, 4), nn.Tanh()),
            r"model 1 has module 1 \(Tanh\), which model 0 lacks",
        ),
    ],
)
def test_from_modules_names_the_first_architecture_difference(other, match) -> None:
    with pytest.raises(FoldError, match=match):
        BatchModule.from_modules([_mlp(), other])
    with pytest.raises(FoldError, match="from_modules"):  # and in the other order
        BatchModule.from_modules([other, _mlp()])


def test_load_state_dicts_changes_nothing_unless_all_are_valid() -> None:
    bm = BatchModule.from_modules([nn.Linear(3, 2) for _ in range(N)])
    before = bm.state_dicts()
    for bad, match in [
        (
            {"weight": torch.zeros(2, 4), "bias": torch.zeros(2)},
            r"'weight' is \(2, 4\); .*\(2, 3\)",
        ),
        (
            {"weight": torch.zeros(1), "bias": torch.zeros(2)},
            r"'weight' is \(1,\).*never broadcast",
        ),
        ({"weight": torch.zeros(2, 3), "bias": [0.0, 0.0]}, r"'bias' is list"),
        (
            {"weight": torch.zeros(2, 3, dtype=torch.long), "bias": torch.zeros(2)},
            r"'weight' is torch.int64",
        ),
    ]:
        states = [{k: torch.ones_like(v) for k, v in sd.items()} for sd in before]
        states[2] = bad  # models 0 and 1 are valid: they must not load either
        with pytest.raises(FoldError, match=rf"state dict 2, {match}"):
            bm.load_state_dicts(states)
        for got, want in zip(bm.state_dicts(), before):
            for k in want:
                assert torch.equal(got[k], want[k])
    with pytest.raises(FoldError, match="item 1 is a list"):
        bm.load_state_dicts([before[0], [], before[2]])


class RawAndFrozen(nn.Module):
    """Raw parameters (the vmap fallback), one of them frozen, and a submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(3))
        self.offset = nn.Parameter(torch.randn(3), requires_grad=False)
        self.sub = nn.Module()
        self.sub.gain = nn.Parameter(torch.randn(3))
        self.register_buffer("count", torch.ones(3))

    def forward(self, x):
        return x * self.scale * self.sub.gain + self.offset + self.count


def test_fallback_parameters_are_the_models_own() -> None:
    import fold

    models = [RawAndFrozen() for _ in range(N)]
    with pytest.warns(UserWarning, match="uses its own parameters"):
        bm = BatchModule.from_modules(models)
    names = {k: (tuple(p.shape), p.requires_grad) for k, p in bm.named_parameters()}
    assert names == {
        "model.scale": ((N, 3), True),
        "model.offset": ((N, 3), False),
        "model.sub.gain": ((N, 3), True),
    }
    assert [k for k, _ in bm.named_buffers()] == ["model.count"]
    x = torch.randn(N, 5, 3)
    bm(x).sum().backward()
    for i, m in enumerate(models):
        m(x[i]).sum().backward()
        grads = bm.grads_of(i)
        torch.testing.assert_close(grads["scale"], m.scale.grad)
        torch.testing.assert_close(grads["sub.gain"], m.sub.gain.grad)
        assert grads["offset"] is None
    opt = fold.optim.SGD(bm.parameters(), lr=0.1)  # every parameter has the model dim
    opt.step()
    torch.testing.assert_close(bm.unbatch(1).offset, models[1].offset)  # frozen: unchanged


class Tied(nn.Module):
    """A language-model head tied to its embedding, and one block registered twice."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.block = nn.Linear(4, 4)
        self.again = self.block
        self.out = nn.Linear(4, 7, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.again(torch.tanh(self.block(self.emb(ids))))))


def test_tied_weights_stay_tied_per_model() -> None:
    models = [Tied().double() for _ in range(N)]
    bm = BatchModule.from_modules(models)
    assert bm.model.out.weight is bm.model.emb.weight
    assert bm.model.again is bm.model.block
    assert len(list(bm.parameters())) == 3  # emb/out weight, block weight and bias
    ids = torch.randint(0, 7, (N, 6))
    out = bm(ids)
    out.pow(2).sum().backward()
    for i, m in enumerate(models):
        want = m(ids[i])
        want.pow(2).sum().backward()
        torch.testing.assert_close(out[i], want)
        grads = bm.grads_of(i)
        torch.testing.assert_close(grads["emb.weight"], m.emb.weight.grad)
        torch.testing.assert_close(grads["block.weight"], m.block.weight.grad)
    sd = bm.state_dicts()[1]
    assert sd["out.weight"] is sd["emb.weight"]
    plain = bm.unbatch(1)
    assert plain.out.weight is plain.emb.weight and plain.again is plain.block
    torch.testing.assert_close(plain(ids[1]), models[1](ids[1]))
    with pytest.raises(FoldError, match="tied differently"):
        BatchModule.from_modules([Tied(), _untied()])


def _untied() -> nn.Module:
    m = Tied()
    m.out.weight = nn.Parameter(m.emb.weight.detach().clone())
    return m


def test_unbatch_keeps_dtype_device_and_mode() -> None:
    bm = BatchModule.from_modules([nn.Sequential(nn.Linear(3, 2), nn.Dropout(0.5))] * 2)
    bm.double().eval()
    plain = bm.unbatch(1)
    assert {p.dtype for p in plain.parameters()} == {torch.float64}
    assert not plain.training and not plain[1].training
    bm.train()
    assert bm.unbatch(0).training


@pytest.mark.parametrize("bad", [2, -1, 1.0, True, "0"])
def test_model_indices_are_checked(bad) -> None:
    import fold

    bm = BatchModule(nn.Linear(3, 2), batch=2)
    opt = fold.optim.SGD(bm.parameters(), lr=0.1)
    with pytest.raises(
        FoldError, match=r"unbatch\(.*\): expected the index of a model, an int from 0 to 1"
    ):
        bm.unbatch(bad)
    with pytest.raises(FoldError, match=r"freeze\(.*\): expected the index of a model"):
        opt.freeze(bad)
    with pytest.raises(FoldError, match=r"unfreeze\(.*\): expected the index of a model"):
        opt.unfreeze(bad)
    np = pytest.importorskip("numpy")
    assert isinstance(bm.unbatch(np.int64(1)), nn.Linear)


def test_one_batch_module_applied_from_several_threads() -> None:
    import threading

    import fold

    models = [nn.Linear(8, 8).double() for _ in range(4)]
    bm = BatchModule.from_modules(models)
    bm.chunk_size = 1  # chunks of one model: the chunk state changes on every pass

    def run(x, results, k):
        for _ in range(30):
            f = fold.Fold()
            nodes = [f.add("forward", x[i : i + 1]) for i in range(len(x))]
            (out,) = f.apply(bm, [nodes])
            results[k].append(out.detach())
            results[k].append(bm(x.expand(4, -1, -1)).detach())

    xs = [torch.randn(3, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)]
    results: list[list[torch.Tensor]] = [[], []]
    threads = [threading.Thread(target=run, args=(xs[k], results, k)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k, x in enumerate(xs):
        want = torch.stack([m(x) for m in models])
        assert len(results[k]) == 60
        for got in results[k]:
            torch.testing.assert_close(got, want)


# One instance of each base class BatchModule has a batched layer for, and an input for it.
_PICKLE_CASES = {
    nn.Linear: (lambda: nn.Linear(3, 2), (4, 3)),
    nn.Bilinear: (lambda: nn.Bilinear(3, 2, 2), None),
    nn.Conv1d: (lambda: nn.Conv1d(2, 3, 3), (4, 2, 7)),
    nn.Conv2d: (lambda: nn.Conv2d(2, 3, 3), (4, 2, 6, 6)),
    nn.Conv3d: (lambda: nn.Conv3d(2, 3, 2), (4, 2, 3, 3, 3)),
    nn.ConvTranspose1d: (lambda: nn.ConvTranspose1d(2, 3, 3), (4, 2, 5)),
    nn.ConvTranspose2d: (lambda: nn.ConvTranspose2d(2, 3, 3), (4, 2, 4, 4)),
    nn.ConvTranspose3d: (lambda: nn.ConvTranspose3d(2, 3, 2), (4, 2, 3, 3, 3)),
    nn.BatchNorm1d: (lambda: nn.BatchNorm1d(3), (4, 3)),
    nn.BatchNorm2d: (lambda: nn.BatchNorm2d(3), (4, 3, 2, 2)),
    nn.BatchNorm3d: (lambda: nn.BatchNorm3d(3), (4, 3, 2, 2, 2)),
    nn.LayerNorm: (lambda: nn.LayerNorm(3), (4, 3)),
    nn.GroupNorm: (lambda: nn.GroupNorm(2, 4), (4, 4, 3)),
    nn.Embedding: (lambda: nn.Embedding(5, 3), None),
    nn.RNNCell: (lambda: nn.RNNCell(3, 2), (4, 3)),
    nn.GRUCell: (lambda: nn.GRUCell(3, 2), (4, 3)),
    nn.LSTMCell: (lambda: nn.LSTMCell(3, 2), (4, 3)),
    nn.LSTM: (lambda: nn.LSTM(3, 2), None),
    nn.GRU: (lambda: nn.GRU(3, 2), None),
    nn.RNN: (lambda: nn.RNN(3, 2, nonlinearity="relu"), None),
}


@pytest.mark.parametrize("base", list(_PICKLE_CASES), ids=lambda b: b.__name__)
def test_every_batched_layer_pickles_and_saves(base, tmp_path) -> None:
    """pickle and torch.save round-trip a BatchModule of every layer it batches: the
    layer classes made per base class (BatchConv1d, BatchBatchNorm2d, ...) are found by
    name, and the copy computes what the original does."""
    import io
    import pickle

    from fold.batched_ops.core import registry

    built_in = {b for b, cls in registry.items() if cls.__module__.startswith("fold.")}
    assert set(_PICKLE_CASES) >= built_in, "a layer of fold's has no pickle case"
    make, shape = _PICKLE_CASES[base]
    torch.manual_seed(0)
    bm = BatchModule(make(), batch=2)
    again = pickle.loads(pickle.dumps(bm))
    buf = io.BytesIO()
    torch.save(bm, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    for copy_ in (again, saved):
        for (name, p), (name2, q) in zip(bm.state_dict().items(), copy_.state_dict().items()):
            assert name == name2
            torch.testing.assert_close(p, q, rtol=0, atol=0)
        if shape is not None:
            bm.eval(), copy_.eval()
            x = torch.randn(2, *shape)
            torch.testing.assert_close(copy_(x), bm(x), rtol=0, atol=0)


# ------------------------------------------------------- code that mixes the rows of a batch
class _Mix(nn.Module):
    """One model whose own code between its layers is ``body(self, x)``."""

    def __init__(self, body, features: int = 5) -> None:
        super().__init__()
        self.body = body
        self.lin = nn.Linear(features, 4)
        self.gru = nn.GRU(4, 4, batch_first=True, num_layers=2)
        self.seq_first = nn.GRU(4, 4)
        self.lstm = nn.LSTM(4, 3, batch_first=True, bidirectional=True)
        self.cell = nn.GRUCell(4, 4)
        self.conv = nn.Conv2d(1, 2, 3, padding=1)

    def forward(self, x, *rest):
        return self.body(self, x, *rest)


def _seq(m, x):  # (b, T, 5) -> (b, T, 4)
    return torch.tanh(m.lin(x))


# Code that keeps every row apart: runs with the models' rows merged, no warning.
ROW_WISE = {
    "flatten-by-size": (lambda m, x: m.conv(x).view(x.size(0), -1), (6, 1, 5, 5)),
    "rnn-last-state": (lambda m, x: m.gru(_seq(m, x))[1][-1], (6, 7, 5)),
    "bilstm-both-states": (
        lambda m, x: torch.cat([m.lstm(_seq(m, x))[1][0][-2], m.lstm(_seq(m, x))[1][0][-1]], -1),
        (6, 7, 5),
    ),
    "seq-first-states": (
        lambda m, x: (
            m.seq_first(_seq(m, x).transpose(0, 1))[0][-1]
            + m.seq_first(_seq(m, x).transpose(0, 1))[1].sum(0)
        ),
        (6, 7, 5),
    ),
    "attention-within-rows": (
        lambda m, x: torch.softmax(_seq(m, x) @ _seq(m, x).transpose(1, 2) / 2, -1) @ _seq(m, x),
        (6, 7, 5),
    ),
    "in-place conversions": (
        lambda m, x: m.lin(x).detach().requires_grad_() * 0 + m.lin(x).clone().zero_() + m.lin(x),
        (6, 5),
    ),
    "einsum": (
        lambda m, x: torch.einsum("btd,de->bte", _seq(m, x), torch.ones(4, 3, dtype=x.dtype)),
        (6, 7, 5),
    ),
    "loss-per-row": (
        lambda m, x, y: F.cross_entropy(m.lin(x), y, reduction="none"),
        (6, 5),
    ),
    "cell-loop-from-zeros": (
        lambda m, x: _cell_loop(m, _seq(m, x)),
        (6, 7, 5),
    ),
    "slices-masks-pads": (
        lambda m, x: (
            F.pad(m.lin(x)[..., :3].masked_fill(x[:, :3] > 0, 0.5), (1, 1))
            + F.layer_norm(m.lin(x), (4,))[:, 1:2].sum(-1, keepdim=True)
        ),
        (6, 5),
    ),
    "stack-expand-permute": (
        lambda m, x: (
            torch.stack([m.lin(x), -m.lin(x)], 1)
            .unsqueeze(2)
            .expand(-1, -1, 3, -1)
            .permute(0, 3, 1, 2)
            .amax(-1)
            .topk(2, -1)
            .values
        ),
        (6, 5),
    ),
}


def _cell_loop(m, seq):
    h = torch.zeros(seq.size(0), 4, dtype=seq.dtype)
    for t in range(seq.size(1)):
        h = m.cell(seq[:, t], h)
    return h


# Code that reads across rows: the first call finds it, and every call runs one model at a
# time (each model's exact result), with a warning naming the call.
MIXING = {
    "centred-over-the-batch": (lambda m, x: m.lin(x) - m.lin(x).mean(0), (6, 5), "mean"),
    "loss-over-the-batch": (
        lambda m, x, y: F.cross_entropy(m.lin(x), y),
        (6, 5),
        "reduces over the batch",
    ),
    "attention-between-samples": (
        lambda m, x: torch.softmax(m.lin(x) @ m.lin(x).T, -1) @ m.lin(x),
        (6, 5),
        "multiplies rows by rows",
    ),
    "whole-tensor-norm": (lambda m, x: m.lin(x) / m.lin(x).norm(), (6, 5), "whole tensor"),
    "rows-joined": (
        lambda m, x: torch.cat([m.lin(x), m.lin(x)[:1]], 0).sum(0, keepdim=True) + m.lin(x),
        (6, 5),
        "slices the rows",
    ),
    "positions-by-row-count": (
        lambda m, x: m.lin(x) + torch.arange(x.shape[0], dtype=x.dtype)[:, None],
        (6, 5),
        "made another way",
    ),
    "batch-and-time-flattened-by-size": (
        lambda m, x: torch.tanh(m.lin(x.reshape(x.shape[0] * x.shape[1], -1))).view(
            x.size(0), x.size(1), -1
        ),
        (6, 7, 5),
        "reshapes the rows' dim into others",  # (rows of one model would meet another's weights)
    ),
    "scaled-by-the-batch-size-less-one": (
        lambda m, x: m.lin(x) * (x.shape[0] - 1),
        (6, 5),
        "uses the batch's size in arithmetic",
    ),
    "divided-by-the-size-as-an-int": (
        lambda m, x: m.lin(x) / int(x.shape[0]) + round(x.size(0)) * 0.1,
        (6, 5),
        "uses the batch's size in a conversion",  # (int(n) is a plain int: unseen after it)
    ),
    "filled-with-the-size": (
        lambda m, x: m.lin(x) + m.lin(x).new_full((1, 4), x.size(0)) - torch.full((4,), x.size(0)),
        (6, 5),
        "uses the batch's size as a value",
    ),
    "divided-by-len": (
        lambda m, x: m.lin(x) / len(x),
        (6, 5),
        "reads the batch's size with len()",
    ),
    "divided-by-numel": (
        lambda m, x: m.lin(x) * (x.numel() / 5),
        (6, 5),
        "uses the batch's size in arithmetic",
    ),
    "one-row-squeezed": (lambda m, x: m.lin(x).squeeze(), (1, 5), "squeezes"),
    "divided-by-the-batch-size": (
        lambda m, x: m.lin(x).sum(1, keepdim=True) / x.shape[0],
        (6, 5),
        "uses the batch's size as a value",
    ),
    "branch-on-the-batch-size": (
        lambda m, x: m.lin(x) * (2 if x.size(0) > 4 else 3),
        (4, 5),
        "uses the batch's size in a comparison",
    ),
    "rows-sliced": (lambda m, x: m.lin(x)[:2], (6, 5), "slices the rows"),
    "states-into-a-layer-at-the-wrong-dim": (
        lambda m, x: m.gru(_seq(m, x).transpose(0, 1))[0],
        (6, 7, 5),
        "rows in dim 1 where it takes them in dim 0",
    ),
}


def _mix_inputs(shape, with_target):
    x = torch.randn(N, *shape, dtype=torch.float64)
    if with_target:
        return x, torch.randint(0, 4, (N, shape[0]))
    return (x,)


def _against_separate(name, body, shape, chunk, calls=2):
    """BatchModule(models) against each model on its own, call after call: values and
    gradients (float64)."""
    torch.manual_seed(0)
    models = [_Mix(body).double() for _ in range(N)]
    bm = BatchModule.from_modules(copy.deepcopy(models))
    bm.chunk_size = chunk
    for _ in range(calls):
        args = _mix_inputs(shape, "loss" in name)
        got = bm(*args)
        want = [m(*[a[i] for a in args]) for i, m in enumerate(models)]
        torch.testing.assert_close(got, torch.stack(want))
        _same_grads(bm, models, got, want)
    return bm


def _same_grads(bm, models, got, want) -> None:
    """Backprop of random weights through the BatchModule's result ``got`` and through each
    model's own ``want[i]``: each model's parameter gradients are its own."""
    weights = torch.randn_like(got)
    bm.zero_grad(set_to_none=True)
    (weights * got).sum().backward()
    for i, (m, y) in enumerate(zip(models, want)):
        m.zero_grad(set_to_none=True)
        (weights[i] * y).sum().backward()
        grads = bm.grads_of(i)
        for k, p in m.named_parameters():
            zero = torch.zeros_like(p)
            ref = zero if p.grad is None else p.grad
            torch.testing.assert_close(zero if grads[k] is None else grads[k], ref)


@pytest.mark.parametrize("chunk", [None, 2], ids=["all-models", "chunks-of-2"])
@pytest.mark.parametrize("name", list(ROW_WISE))
def test_code_that_keeps_rows_apart_runs_merged(name, chunk) -> None:
    body, shape = ROW_WISE[name]
    bm = _against_separate(name, body, shape, chunk)  # (a warning would fail the test)
    assert list(bm._row_verdicts.values()) == [None]
    assert bm.rows_kept("forward", *_mix_inputs(shape, "loss" in name)) is True


@pytest.mark.parametrize("chunk", [None, 2], ids=["all-models", "chunks-of-2"])
@pytest.mark.parametrize("name", list(MIXING))
def test_code_that_mixes_rows_runs_one_model_at_a_time(name, chunk) -> None:
    body, shape, why = MIXING[name]
    with pytest.warns(UserWarning, match=rf"_Mix's code .*{why}.*run one model at a time"):
        bm = _against_separate(name, body, shape, chunk)
    (verdict,) = bm._row_verdicts.values()
    assert verdict is not None and why in verdict
    assert bm.rows_kept("forward", *_mix_inputs(shape, "loss" in name)) is False


def test_a_layers_weights_read_by_the_models_code_are_a_fold_error() -> None:
    """``self.lin.weight`` in the model's own code is all N models' weights stacked: a
    FoldError naming it, where the values would be wrong."""
    body = lambda m, x: m.lin(x) * m.lin.weight.sum()  # noqa: E731
    bm = BatchModule.from_modules([_Mix(body) for _ in range(N)])
    with pytest.raises(FoldError, match=r"reads the layer's tensor lin\.weight .*Fix: use"):
        bm(torch.randn(N, 6, 5))


def test_a_call_run_again_leaves_buffers_and_random_state_as_one_run() -> None:
    """A first call found mixing rows runs again one model at a time: its batch norm's
    running statistics move once, and its dropout draws as a run one model at a time does."""

    def body(m, x):
        h = m.drop(m.norm(m.lin(x)))
        return h - h.mean(0)

    def make() -> nn.Module:
        m = _Mix(body)
        m.norm, m.drop = nn.BatchNorm1d(4), nn.Dropout(0.3)
        return m.double()

    torch.manual_seed(0)
    models = [make() for _ in range(N)]
    again = BatchModule.from_modules(copy.deepcopy(models))
    alone = BatchModule.from_modules(copy.deepcopy(models))
    alone.chunk_size = 1  # one model at a time from the start: nothing to run again
    x = torch.randn(N, 6, 5, dtype=torch.float64)
    torch.manual_seed(1)
    with pytest.warns(UserWarning, match="acts along the rows' dim"):
        got = again(x)
    after = torch.rand(3)
    torch.manual_seed(1)
    want = alone(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(after, torch.rand(3), rtol=0, atol=0)
    for a, b in zip(again.buffers(), alone.buffers()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # and the statistics moved once, as each model alone moves its own (they are read
    # before the dropout)
    for i, m in enumerate(models):
        m(x[i])
        torch.testing.assert_close(again.state_dicts()[i]["norm.running_mean"], m.norm.running_mean)
        torch.testing.assert_close(again.state_dicts()[i]["norm.running_var"], m.norm.running_var)


def test_models_whose_results_differ_in_shape_are_a_fold_error() -> None:
    body = lambda m, x: m.lin(x)[m.lin(x)[:, 0] > 0]  # noqa: E731  (rows kept by value)
    torch.manual_seed(0)
    bm = BatchModule.from_modules([_Mix(body) for _ in range(N)])
    x = torch.randn(N, 40, 5)
    with pytest.warns(UserWarning, match="indexes the rows' dim"):
        with pytest.raises(FoldError, match=r"BatchModule.forward: the models' results differ"):
            bm(x)


class _Transformer(nn.Module):
    """An encoder layer and a decoder layer with masks given by keyword: attention runs under
    the vmap fallback, called with keywords, returning None for its weights."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.dec = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

    def forward(self, x, pad):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
        h = self.enc(x, src_mask=mask, src_key_padding_mask=pad.to(x.dtype) * -1e9)
        return self.dec(h, x, tgt_mask=mask)


@pytest.mark.parametrize("mode", ["train", "eval", "eval-no-grad"])
def test_transformer_layers_run_like_separate_models(mode) -> None:
    """Two calls in each mode; in eval mode without gradients torch's fused encoder path
    (which would read the stacked weights) stays off."""
    torch.manual_seed(0)
    models = [_Transformer().double().train(mode == "train") for _ in range(N)]
    with pytest.warns(UserWarning, match="no batched layer for enc.self_attn"):
        bm = BatchModule.from_modules(copy.deepcopy(models))
    bm.train(mode == "train")
    with warnings.catch_warnings():  # torch's own: vmap of attention has no fused rule
        warnings.filterwarnings("ignore", "There is a performance drop")
        for _ in range(2):
            x = torch.randn(N, 4, 6, 8, dtype=torch.float64)
            pad = torch.zeros(N, 4, 6, dtype=torch.bool)
            pad[:, :, -1] = True
            with torch.set_grad_enabled(mode != "eval-no-grad"):
                got = bm(x, pad)
                want = [m(x[i], pad[i]) for i, m in enumerate(models)]
            torch.testing.assert_close(got, torch.stack(want))
            if mode != "eval-no-grad":
                _same_grads(bm, models, got, want)
    assert list(bm._row_verdicts.values()) == [None]


def test_a_mask_as_long_as_the_merged_batch_is_not_taken_for_rows() -> None:
    """Three models of two sequences of six: the (6, 6) attention mask has the merged rows'
    length; the row check sees it is no rows, and the calls run one model at a time."""
    torch.manual_seed(0)
    models = [_Transformer().double() for _ in range(N)]
    with pytest.warns(UserWarning, match="no batched layer"):
        bm = BatchModule.from_modules(copy.deepcopy(models))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "There is a performance drop")
        for _ in range(2):
            x = torch.randn(N, 2, 6, 8, dtype=torch.float64)
            pad = torch.zeros(N, 2, 6, dtype=torch.bool)
            with pytest.warns(UserWarning, match="gives VmapFallback a tensor made another way"):
                got = bm(x, pad)
            want = torch.stack([m(x[i], pad[i]) for i, m in enumerate(models)])
            torch.testing.assert_close(got, want)
            bm._row_warned.clear()  # (it warns once a kind: again for the second call)


def test_dropout_under_the_vmap_fallback_draws_per_model() -> None:
    """Attention dropout inside the vmap fallback: each model draws its own mask (vmap's
    randomness="different"), as N separate models would."""
    with pytest.warns(UserWarning, match="no batched layer"):
        bm = BatchModule(nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True), batch=3)
    x = torch.randn(1, 4, 6, 8).expand(3, 4, 6, 8)
    y = bm(x, x, x)[0]
    assert not torch.allclose(y[0], y[1])  # same weights, same input, different masks
    bm.eval()
    y = bm(x, x, x)[0]
    torch.testing.assert_close(y[0], y[1])


def test_the_vmap_fallback_follows_train_and_eval() -> None:
    """A model with a raw parameter runs under the vmap fallback whole: .eval() reaches its
    batch norm (running statistics used, not moved) and its dropout."""

    class Raw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.rand(4) + 0.5)
            self.norm = nn.BatchNorm1d(4)
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(self.norm(x * self.scale))

    torch.manual_seed(0)
    models = [Raw().double() for _ in range(N)]
    for m in models:  # running statistics of their own
        m(torch.randn(8, 4, dtype=torch.float64) * 3 + 1)
    with pytest.warns(UserWarning, match="uses its own parameters directly"):
        bm = BatchModule.from_modules(copy.deepcopy(models))  # (in training mode)
    bm.eval()
    for m in models:
        m.eval()
    x = torch.randn(N, 5, 4, dtype=torch.float64)
    torch.testing.assert_close(bm(x), torch.stack([m(x[i]) for i, m in enumerate(models)]))
    for i, m in enumerate(models):  # not moved
        torch.testing.assert_close(bm.state_dicts()[i]["norm.running_mean"], m.norm.running_mean)


def test_keyword_and_dict_arguments_are_per_model_like_positional_ones() -> None:
    """bm(x, mask=m) and a dict of tensors: each tensor (N, b, ...), one slice per model."""

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(5, 4)

        def forward(self, x, extra=None, *, mask=None, scale=1.0):
            h = self.lin(x) * scale
            if extra is not None:
                h = h + extra["bias"]
            return h.masked_fill(mask, 0.0) if mask is not None else h

    torch.manual_seed(0)
    models = [Masked().double() for _ in range(N)]
    bm = BatchModule.from_modules(copy.deepcopy(models))
    x = torch.randn(N, 6, 5, dtype=torch.float64)
    mask = torch.rand(N, 6, 4) > 0.5
    extra = {"bias": torch.randn(N, 6, 4, dtype=torch.float64)}
    for _ in range(2):
        got = bm(x, extra, mask=mask, scale=2.0)
        want = [
            m(x[i], {"bias": extra["bias"][i]}, mask=mask[i], scale=2.0)
            for i, m in enumerate(models)
        ]
        torch.testing.assert_close(got, torch.stack(want))
    rnn = BatchModule(nn.GRU(5, 4), batch=N)  # a layer alone, its state by keyword
    seq, h0 = torch.randn(N, 7, 6, 5), torch.randn(N, 1, 6, 4)
    torch.testing.assert_close(rnn(seq, hx=h0)[0], rnn(seq, h0)[0])
    torch.testing.assert_close(rnn(seq, hx=h0)[0][1], rnn.unbatch(1)(seq[1], h0[1])[0])


@pytest.mark.parametrize("chunk", [None, 2], ids=["all-models", "chunks-of-2"])
def test_results_in_dicts_and_named_tuples_come_back_per_model(chunk) -> None:
    from collections import namedtuple

    Out = namedtuple("Out", "logits hidden")

    class Structured(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(5, 4)

        def forward(self, x):
            h = torch.tanh(self.lin(x))
            return {"out": Out(h * 2, h), "h": h}

    torch.manual_seed(0)
    models = [Structured().double() for _ in range(N)]
    bm = BatchModule.from_modules(copy.deepcopy(models))
    bm.chunk_size = chunk
    x = torch.randn(N, 6, 5, dtype=torch.float64)
    got = bm(x)
    assert isinstance(got["out"], Out)
    for i, m in enumerate(models):
        want = m(x[i])
        torch.testing.assert_close(got["h"][i], want["h"])
        torch.testing.assert_close(got["out"].logits[i], want["out"].logits)


class _CausalSelfAttention(nn.Module):
    """Attention written by hand, as small GPTs write it: the model's own code reshapes by
    the batch's size, splits heads, masks and softmaxes within each sequence."""

    def __init__(self, width: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.qkv, self.proj, self.heads = (
            nn.Linear(width, 3 * width),
            nn.Linear(width, width),
            heads,
        )

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        att = F.softmax(att.masked_fill(~causal, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class _TinyGPT(nn.Module):
    def __init__(self, vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(16, width)
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = _CausalSelfAttention(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        b, t = idx.size()
        # positions for every row (the same in each): given as arange(t) alone, one tensor
        # for all rows, the embedding could not tell the models' rows apart
        pos = torch.arange(0, t, dtype=torch.long).unsqueeze(0).expand(b, t)
        x = self.tok(idx) + self.pos(pos)
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        logits = self.head(x)
        probs = F.softmax(logits[:, -1, :], dim=-1)
        return logits, torch.multinomial(probs, 1), F.gumbel_softmax(logits, tau=0.5) * 0


def test_a_small_gpt_runs_with_its_rows_merged() -> None:
    """No call of a hand-written GPT block mixes rows: the row check keeps it merged (no
    warning), and its values and gradients are each model's own."""
    torch.manual_seed(0)
    models = [_TinyGPT().double() for _ in range(N)]
    bm = BatchModule.from_modules(copy.deepcopy(models))
    idx = torch.randint(0, 11, (N, 4, 6))
    logits, _, _ = bm(idx)
    want = [m(idx[i])[0] for i, m in enumerate(models)]
    torch.testing.assert_close(logits, torch.stack(want))
    _same_grads(bm, models, logits, want)
    assert list(bm._row_verdicts.values()) == [None]


def test_positions_shared_by_every_row_given_to_a_layer_run_one_model_at_a_time() -> None:
    """nanoGPT's `self.pos(torch.arange(t))`: one tensor for all rows given to a batched
    layer, which would read it as rows of the models merged; found, and exact."""

    class Positions(_TinyGPT):
        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.size(1)))
            return self.head(x + self.attn(self.ln1(x)))

    torch.manual_seed(0)
    models = [Positions().double() for _ in range(N)]
    bm = BatchModule.from_modules(copy.deepcopy(models))
    idx = torch.randint(0, 11, (N, 4, 6))
    with pytest.warns(UserWarning, match="gives BatchEmbedding a tensor made another way"):
        got = bm(idx)
    torch.testing.assert_close(got, torch.stack([m(idx[i]) for i, m in enumerate(models)]))


# ------------------------------------------------ random chains of row-wise and mixing code
_W = torch.randn(6, 6, dtype=torch.float64) / 3
_PERM = torch.tensor([3, 0, 5, 1, 4, 2])
# Each takes (model, h (b, 6), x (b, 6)) and gives (b, 6): the rows kept apart, or not.
CHAIN_OPS = [
    lambda m, h, x: torch.tanh(m.lin(h)),
    lambda m, h, x: h.softmax(-1),
    lambda m, h, x: h.cumsum(1) / 6,
    lambda m, h, x: (
        h.flip(1) * h.norm(dim=1, keepdim=True) + torch.linalg.vector_norm(h, dim=-1)[:, None]
    ),
    lambda m, h, x: h.view(h.size(0), -1)[:, _PERM],
    lambda m, h, x: torch.einsum("bi,ij->bj", h, _W),
    lambda m, h, x: h.T.T + F.layer_norm(h, (6,)),
    lambda m, h, x: torch.stack([h, x], 1).sum(1),
    lambda m, h, x: h.reshape(h.shape[0], 2, 3).transpose(1, 2).flatten(1),
    lambda m, h, x: torch.cat([h[:, 3:], h[:, :3]], 1) + x.size(1),
    lambda m, h, x: h.unsqueeze(0).expand(2, -1, -1).mean(0),
    lambda m, h, x: torch.where(h > 0, h, x) @ _W,
    lambda m, h, x: (h.t() @ _W.t()).t() if False else (_W @ h.t()).t(),
    lambda m, h, x: torch.einsum("ij,bj->bi", _W, h),
    lambda m, h, x: h.gather(1, _PERM.expand(h.size(0), 6)),
    lambda m, h, x: h[:, None].expand(-1, 2, -1).permute(0, 2, 1)[..., 0],
    lambda m, h, x: h.masked_fill(h > 0.5, 0.0) + torch.zeros_like(h) + x.new_zeros(x.shape),
    lambda m, h, x: torch.bmm(h[:, None], _W.expand(h.size(0), 6, 6))[:, 0],
    lambda m, h, x: h.mT.mT * h.softmax(dim=1).sum(1, keepdim=True),
    lambda m, h, x: h.index_select(1, _PERM) + h.narrow(1, 0, 6),
    lambda m, h, x: torch.stack(h.unbind(1), 1),
    lambda m, h, x: h.view(x.size(0), 3, 2).sum(-1).repeat(1, 2),
    lambda m, h, x: h.reshape(-1, 6),
    lambda m, h, x: h.view(x.size(0), 2, 3)[:, [1, 0]][:, :, [0, 2, 1]].flatten(1),
    lambda m, h, x: h[:, None, None].expand(-1, 2, 3, -1).unfold(3, 2, 2).flatten(3).sum((1, 2)),
    lambda m, h, x: m.norm(h),  # (a batch norm of each model's rows)
    lambda m, h, x: m.cell(h, torch.tanh(x)),
    lambda m, h, x: m.scaled(h),  # (a child under the vmap fallback)
    lambda m, h, x: m.seq_first(h[None])[0][0],  # (rows in dim 1 of a sequence)
    lambda m, h, x: m.attn(h[:, None], x[:, None], x[:, None], need_weights=False)[0][:, 0],
    # these read across rows
    lambda m, h, x: h - h.mean(0),
    lambda m, h, x: h.t() @ h,
    lambda m, h, x: torch.einsum("bi,bj->ij", h, h),
    lambda m, h, x: h.gather(0, torch.zeros_like(h, dtype=torch.long)),
    lambda m, h, x: torch.stack(h.unbind(0), 1).t(),
    lambda m, h, x: h.view(6, -1).view(h.shape) if h.shape[0] == 6 else h.flip(0),
    lambda m, h, x: torch.where(h > h.median(), h, -h),
    lambda m, h, x: h * (x.size(0) - 1 + 1),
    lambda m, h, x: h[torch.tensor([0] * h.size(0))],
    lambda m, h, x: h[:, None, None].expand(-1, 2, 3, -1).unfold(0, 2, 1)[..., 0].sum((1, 2)),
    lambda m, h, x: h.cumsum(0) / 6,
    lambda m, h, x: h.roll(1, 0),
    lambda m, h, x: h * h.std(),
    lambda m, h, x: (h @ h.T) @ h / 36,
    lambda m, h, x: h + h[:1],
    lambda m, h, x: h / x.shape[0],
    lambda m, h, x: torch.cat([h[1:], h[:1]]),
    lambda m, h, x: h.sort(0).values,
    lambda m, h, x: F.normalize(h, dim=0),
    lambda m, h, x: h / torch.linalg.vector_norm(h),
    lambda m, h, x: h.view(x.size(0), 1, 2, 3)[:, [0], :, [0, 1, 2]].reshape(h.shape),
    lambda m, h, x: h.T.reshape(h.shape),
    lambda m, h, x: h + torch.arange(h.shape[0], dtype=h.dtype)[:, None],
    lambda m, h, x: m.lin(h.T.contiguous().view(-1, 6)).view(h.shape),
]


class _Scaled6(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(6) + 0.5)

    def forward(self, h):
        return h * self.scale


class _Chain(nn.Module):
    def __init__(self, ops) -> None:
        super().__init__()
        self.lin, self.ops = nn.Linear(6, 6), ops
        self.norm, self.cell = nn.BatchNorm1d(6), nn.GRUCell(6, 6)
        self.scaled, self.seq_first = _Scaled6(), nn.GRU(6, 6)
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True)

    def forward(self, x):
        h = self.lin(x)
        for k in self.ops:
            h = CHAIN_OPS[k](self, h, x)
        return h


@settings(max_examples=60, deadline=None)
# rows and features of one size (6 = 2 rows x 3 models): a result with its rows in dim 1, and a
# reshape to a size equal to all the models' rows by chance (each model's own is 2)
@example(ops=[22], rows=2, chunk=None)
@example(ops=[22, 22], rows=2, chunk=None)
@given(
    ops=st.lists(st.integers(0, len(CHAIN_OPS) - 1), min_size=1, max_size=5),
    rows=st.sampled_from([1, 2, 6]),
    chunk=st.sampled_from([None, 2]),
)
def test_random_chains_of_the_models_code_equal_the_models_alone(ops, rows, chunk) -> None:
    """Whatever the model's own code does, with or without reads across rows: each model's
    result is its own, in values and gradients, call after call."""
    torch.manual_seed(0)
    models = [_Chain(ops).double() for _ in range(N)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (mixing code warns, the fallbacks too)
        bm = BatchModule.from_modules(copy.deepcopy(models))
        bm.chunk_size = chunk
        for _ in range(2):
            x = torch.randn(N, rows, 6, dtype=torch.float64)
            try:
                want = [m(x[i]) for i, m in enumerate(models)]
            except (RuntimeError, ValueError):  # (what the models alone refuse too)
                with pytest.raises((RuntimeError, ValueError)):
                    bm(x)
                return
            got = bm(x)
            torch.testing.assert_close(got, torch.stack(want))
            _same_grads(bm, models, got, want)


def test_a_model_under_the_vmap_fallback_takes_keyword_tensors_per_model() -> None:
    """A model run whole under the vmap fallback, called with a keyword tensor of a length
    of its own (a memory of 5 rows beside a batch of 2): each model gets its own slice."""

    class Read(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))

        def forward(self, x, memory=None):
            return x * self.w + memory.softmax(0).sum(0)

    with pytest.warns(UserWarning, match="uses its own parameters directly"):
        bm = BatchModule.from_modules([Read() for _ in range(N)])
    x, memory = torch.randn(N, 2, 4), torch.randn(N, 5, 4)
    got = bm(x, memory=memory)
    for i in range(N):
        torch.testing.assert_close(got[i], bm.unbatch(i)(x[i], memory=memory[i]))


@pytest.mark.parametrize("cls", [nn.RNNCell, nn.GRUCell, nn.LSTMCell, nn.GRU, nn.LSTM, nn.RNN])
def test_a_state_of_another_batch_is_a_fold_error(cls) -> None:
    """torch's cells and RNNs refuse a state whose batch is not the input's; merged rows
    would have broadcast one state row over every input row."""
    bm = BatchModule(cls(6, 4), batch=N)
    cell = "Cell" in cls.__name__
    x = torch.randn(N, 3, 6) if cell else torch.randn(N, 5, 3, 6)
    h = torch.randn(N, 1, 4) if cell else torch.randn(N, 1, 1, 4)
    state = (h, h) if cls in (nn.LSTMCell, nn.LSTM) else h
    with pytest.raises(RuntimeError):  # as the model alone
        bm.unbatch(0)(x[0], tuple(s[0] for s in state) if isinstance(state, tuple) else state[0])
    with pytest.raises(FoldError, match=r"the input's batch of 3 .*does not match the state's"):
        bm(x, state)
