"""Model-batched layers against N separate modules: values, gradients, isolation, state."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
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
    ("vmap-fallback", Scaled, randn(5, 4)),
]


@pytest.mark.parametrize("chunk", [None, 2], ids=["all-models", "chunks-of-2"])
@pytest.mark.parametrize("name, factory, make_inputs", CASES, ids=[c[0] for c in CASES])
def test_layer_runs_like_separate_models(name: str, factory, make_inputs, chunk) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback case warns; tested below
        modes = ("eval",) if "eval-only" in name else ("train", "eval")
        check_model_batching(factory, make_inputs, batch=N, chunk_size=chunk, modes=modes)


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
    with pytest.raises(FoldError, match=r"unbatch\(4\): there are 4 models"):
        bm.unbatch(4)
    with pytest.raises(FoldError, match="differ in type"):
        BatchModule.from_modules([nn.Linear(2, 2), nn.Conv1d(2, 2, 1)])
    with pytest.raises(FoldError, match="batch must be a positive int"):
        BatchModule(nn.Linear(2, 2), batch=0)
