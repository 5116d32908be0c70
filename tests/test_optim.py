"""Per-model optimizers against torch.optim on each model alone (float64), isolation, freezing."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fold.optim as fo
from fold import FoldError
from fold.batched_ops import BatchModule, batch_loss

N = 3


def make() -> tuple[list[nn.Module], BatchModule]:
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double() for _ in range(N)]
    return models, BatchModule.from_modules(copy.deepcopy(models))


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(N, 5, 4, generator=g, dtype=torch.double), torch.randint(
        0, 3, (N, 5), generator=g
    )


CASES = [
    (
        "sgd",
        lambda p: fo.SGD(
            p,
            lr=[0.1, 0.05, 0.2],
            momentum=[0.0, 0.9, 0.5],
            weight_decay=[0, 1e-2, 1e-3],
            nesterov=False,
        ),
        lambda p, i: torch.optim.SGD(
            p, lr=[0.1, 0.05, 0.2][i], momentum=[0.0, 0.9, 0.5][i], weight_decay=[0, 1e-2, 1e-3][i]
        ),
    ),
    (
        "sgd-nesterov-dampening",
        lambda p: fo.SGD(
            p, batch=N, lr=0.1, momentum=[0.9, 0.8, 0.7], nesterov=True, weight_decay=1e-3
        ),
        lambda p, i: torch.optim.SGD(
            p, lr=0.1, momentum=[0.9, 0.8, 0.7][i], nesterov=True, weight_decay=1e-3
        ),
    ),
    (
        "adam",
        lambda p: fo.Adam(
            p,
            lr=[1e-2, 3e-3, 1e-3],
            betas=([0.9, 0.8, 0.95], 0.99),
            eps=[1e-8, 1e-6, 1e-7],
            weight_decay=[0, 0.1, 0],
        ),
        lambda p, i: torch.optim.Adam(
            p,
            lr=[1e-2, 3e-3, 1e-3][i],
            betas=([0.9, 0.8, 0.95][i], 0.99),
            eps=[1e-8, 1e-6, 1e-7][i],
            weight_decay=[0, 0.1, 0][i],
        ),
    ),
    (
        "adamw",
        lambda p: fo.AdamW(p, lr=[1e-2, 3e-3, 1e-3], weight_decay=[0.1, 0.01, 0.0]),
        lambda p, i: torch.optim.AdamW(
            p, lr=[1e-2, 3e-3, 1e-3][i], weight_decay=[0.1, 0.01, 0.0][i]
        ),
    ),
]


def train(bm: BatchModule, opt, steps: int = 3, poison: tuple[int, float] | None = None) -> None:
    for s in range(steps):
        x, y = data(s)
        opt.zero_grad()
        batch_loss(bm(x), y, N, F.cross_entropy).sum().backward()
        if poison is not None:
            j, value = poison
            for p in bm.parameters():
                p.grad[j] = p.grad[j] * value if math.isfinite(value) else float("nan")
        opt.step()


@pytest.mark.parametrize("name, make_fold, make_torch", CASES, ids=[c[0] for c in CASES])
def test_three_steps_equal_torch_optim_per_model(name, make_fold, make_torch) -> None:
    models, bm = make()
    train(bm, make_fold(bm.parameters()))
    for i, m in enumerate(models):
        opt = make_torch(m.parameters(), i)
        for s in range(3):
            x, y = data(s)
            opt.zero_grad()
            F.cross_entropy(m(x[i]), y[i]).backward()
            opt.step()
        mine = bm.state_dicts()[i]
        for k, v in m.state_dict().items():
            torch.testing.assert_close(
                mine[k], v, msg=lambda s, k=k, i=i: f"{name} model {i} {k}: {s}"
            )


@pytest.mark.parametrize("value", [float("nan"), 1e6])
@pytest.mark.parametrize("name, make_fold, make_torch", CASES, ids=[c[0] for c in CASES])
def test_a_poisoned_gradient_stays_in_its_model(name, make_fold, make_torch, value) -> None:
    _, clean = make()
    _, dirty = make()
    train(clean, make_fold(clean.parameters()))
    train(dirty, make_fold(dirty.parameters()), poison=(1, value))
    for a, b in zip(clean.parameters(), dirty.parameters()):
        for i in (0, 2):
            assert torch.equal(a[i], b[i]), (name, i)
        assert not torch.equal(a[1], b[1])


@pytest.mark.parametrize("name, make_fold, make_torch", CASES, ids=[c[0] for c in CASES])
def test_a_frozen_model_is_bitwise_unchanged(name, make_fold, make_torch) -> None:
    _, bm = make()
    opt = make_fold(bm.parameters())
    train(bm, opt, steps=2)
    opt.freeze(2)
    before = [p[2].clone() for p in bm.parameters()]
    state_before = [{k: v.clone() for k, v in opt.state[p].items()} for p in bm.parameters()]
    train(bm, opt, steps=3)
    for p, b in zip(bm.parameters(), before):
        assert torch.equal(p[2], b)
    for p, sb in zip(bm.parameters(), state_before):
        for k, v in opt.state[p].items():
            assert torch.equal(v[2], sb[k][2]), k
            if k != "step":
                assert not torch.equal(v[0], sb[k][0]), k  # the others moved on


def test_state_dict_round_trip_continues_identically() -> None:
    _, a = make()
    _, b = make()
    oa, ob = fo.Adam(a.parameters(), lr=[1e-2, 1e-3, 5e-3]), fo.Adam(b.parameters(), 0.5, batch=N)
    train(a, oa, steps=2)
    b.load_state_dicts(a.state_dicts())
    ob.load_state_dict(oa.state_dict())
    train(a, oa, steps=2)
    train(b, ob, steps=2)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_clip_grad_norm_clips_each_model_by_its_own_norm() -> None:
    _, bm = make()
    x, y = data(0)
    batch_loss(bm(x), y, N, F.cross_entropy).sum().backward()
    for p in bm.parameters():
        p.grad[1] *= 1000
    grads = [p.grad.clone() for p in bm.parameters()]
    norms = fo.clip_grad_norm_(bm.parameters(), max_norm=[10.0, 1.0, 1e9], batch=N)
    for i in range(N):
        ref = torch.cat([g[i].flatten() for g in grads]).norm()
        torch.testing.assert_close(norms[i], ref)
    after = torch.stack(
        [torch.cat([p.grad[i].flatten() for p in bm.parameters()]).norm() for i in range(N)]
    )
    torch.testing.assert_close(after[1], torch.tensor(1.0, dtype=after.dtype), atol=1e-5, rtol=0)
    for p, g in zip(bm.parameters(), grads):  # model 2's limit is huge: untouched
        assert torch.equal(p.grad[2], g[2])
    assert after[0] <= 10.0 + 1e-6


def test_schedules_follow_their_closed_forms_per_model() -> None:
    _, bm = make()
    opt = fo.SGD(bm.parameters(), lr=[1.0, 0.5, 0.1])
    step = fo.StepLR(opt, step_size=[1, 2, 3], gamma=[0.5, 0.1, 0.9])
    for _ in range(4):
        step.step()
    torch.testing.assert_close(
        opt.hyper("lr"),
        torch.tensor([0.5**4, 0.5 * 0.01, 0.1 * 0.9], dtype=torch.float64),
    )
    opt = fo.SGD(bm.parameters(), lr=[1.0, 2.0, 3.0])
    cos = fo.CosineLR(opt, total_steps=[4, 8, 2], min_lr=[0.0, 1.0, 0.0])
    for _ in range(2):
        cos.step()
    expected = [0.5, 1.0 + 1.0 * (1 + math.cos(math.pi / 4)) / 2, 0.0]
    torch.testing.assert_close(opt.hyper("lr"), torch.tensor(expected, dtype=torch.float64))
    opt = fo.SGD(bm.parameters(), lr=[1.0, 1.0, 1.0])
    warm = fo.LinearWarmup(opt, warmup_steps=[1, 4, 10])
    torch.testing.assert_close(opt.hyper("lr"), torch.tensor([1.0, 0.25, 0.1], dtype=torch.float64))
    warm.step()
    torch.testing.assert_close(opt.hyper("lr"), torch.tensor([1.0, 0.5, 0.2], dtype=torch.float64))


SCHEDULES = [
    (
        lambda o: fo.StepLR(o, step_size=2, gamma=0.5),
        lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5),
    ),
    (
        lambda o: fo.CosineLR(o, total_steps=4, min_lr=1e-3),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 4, 1e-3),
    ),
    (
        lambda o: fo.LinearWarmup(o, warmup_steps=3),
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda t: min(1.0, (t + 1) / 3)),
    ),
]


@pytest.mark.parametrize("make_fold, make_torch", SCHEDULES, ids=["step", "cosine", "warmup"])
def test_a_schedule_steps_each_param_group_from_its_own_lrs(make_fold, make_torch) -> None:
    """Two param groups with lrs of their own (each model's), a fold schedule against torch's
    scheduler on each model alone: each group keeps its own base lrs (group 0's lrs were set
    on every group); and through a state_dict round trip."""
    models, bm = make()
    first = [p for k, p in bm.named_parameters() if k.startswith("model.0.")]
    rest = [p for k, p in bm.named_parameters() if not k.startswith("model.0.")]
    lrs = ([0.1, 0.05, 0.2], [0.01, 0.3, 0.02])
    opt = fo.SGD([{"params": first, "lr": lrs[0]}, {"params": rest, "lr": lrs[1]}], momentum=0.5)
    schedule = make_fold(opt)
    refs = []
    for i, m in enumerate(models):
        groups = [{"params": list(m[0].parameters()), "lr": lrs[0][i]}]
        groups.append({"params": list(m[2].parameters()), "lr": lrs[1][i]})
        o = torch.optim.SGD(groups, momentum=0.5)
        refs.append((o, make_torch(o)))
    for s in range(4):
        if s == 2:  # a schedule saved and loaded into a fresh one continues alike
            state = schedule.state_dict()
            schedule = make_fold(opt)
            schedule.load_state_dict(state)
        x, y = data(s)
        opt.zero_grad()
        batch_loss(bm(x), y, N, F.cross_entropy).sum().backward()
        opt.step()
        schedule.step()
        for i, (m, (o, sched)) in enumerate(zip(models, refs)):
            o.zero_grad()
            F.cross_entropy(m(x[i]), y[i]).backward()
            o.step()
            sched.step()
    for i, m in enumerate(models):
        for (name, p), q in zip(bm.unbatch(i).named_parameters(), m.parameters()):
            torch.testing.assert_close(p, q, msg=name)
    for g, k in zip(opt.param_groups, range(2)):
        want = [o.param_groups[k]["lr"] for o, _ in refs]
        torch.testing.assert_close(g["model_lr"], torch.tensor(want, dtype=torch.float64))


def test_bad_hyperparameters_and_parameters() -> None:
    _, bm = make()
    with pytest.raises(FoldError, match="lr has 2 values for 3 models"):
        fo.Adam(bm.parameters(), lr=[1e-3, 1e-2])
    with pytest.raises(FoldError, match=r"shape \(4,\) has no model dim of size 3"):
        fo.SGD([nn.Parameter(torch.zeros(4))], lr=0.1, batch=N)
    with pytest.raises(FoldError, match="batch must be the number of models"):
        fo.SGD(bm.parameters(), batch=0)


# ---------------------------------------------------------------------- conventions


def test_called_as_torch_optim_is_called() -> None:
    models, bm = make()
    plain = [p.detach().clone() for p in bm.parameters()]
    opt = fo.SGD(bm.parameters(), 0.1)  # lr second, N from the BatchModule's parameters
    assert opt.batch == N
    # N from per-model lists when the parameters do not tell it
    raw = [nn.Parameter(p.clone()) for p in plain]
    assert fo.Adam(raw, lr=[1e-3, 1e-2, 1e-1]).batch == N
    with pytest.raises(FoldError, match=r"cannot tell the number of models N.*Fix: pass batch=N"):
        fo.SGD(raw, 0.1)
    with pytest.raises(
        FoldError, match=r"batch=2, but the parameters belong to a BatchModule of \[3\]"
    ):
        fo.SGD(bm.parameters(), 0.1, batch=2)
    # param groups with their own lr, as torch.optim takes them
    ps = list(bm.parameters())
    opt = fo.SGD([{"params": ps[:2], "lr": [0.1, 0.2, 0.3]}, {"params": ps[2:]}], lr=0.5)
    torch.testing.assert_close(
        opt.hyper("lr", 0), torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64)
    )
    torch.testing.assert_close(opt.hyper("lr", 1), torch.full((N,), 0.5, dtype=torch.float64))
    # a deep copy of a BatchModule knows N too
    assert fo.AdamW(copy.deepcopy(bm).parameters()).batch == N
    x, y = data(0)
    bm(x).sum().backward()
    norms = fo.clip_grad_norm_(bm.parameters(), 1.0)  # N inferred
    assert norms.shape == (N,)
    losses = batch_loss(bm(x), y, F.cross_entropy)  # N from the outputs
    assert losses.shape == (N,)
    torch.testing.assert_close(losses, batch_loss(bm(x), y, N, F.cross_entropy))
    with pytest.raises(FoldError, match=r"targets \(2, 5\) must both have the model dim N=3"):
        batch_loss(bm(x), y[:2], F.cross_entropy)


@pytest.mark.parametrize(
    "make_opt, match",
    [
        (lambda p: fo.SGD(p, lr=[0.1, -0.1, 0.1]), r"SGD: lr of model 1 is -0.1; expected >= 0"),
        (lambda p: fo.SGD(p, lr=0.1, momentum=-0.5), r"momentum of model 0 is -0.5"),
        (lambda p: fo.SGD(p, lr=0.1, weight_decay=[0, 0, -1]), r"weight_decay of model 2"),
        (lambda p: fo.SGD(p, lr=0.1, momentum=[0.9, 0, 0.9], nesterov=True), r"nesterov.*model 1"),
        (
            lambda p: fo.Adam(p, betas=(1.0, 0.999)),
            r"beta1 of model 0 is 1.0; expected in \[0, 1\)",
        ),
        (lambda p: fo.Adam(p, betas=(0.9, [0.9, -0.1, 0.9])), r"beta2 of model 1 is -0.1"),
        (lambda p: fo.AdamW(p, eps=[1e-8, 1e-8, -1e-8]), r"eps of model 2"),
        (lambda p: fo.Adam(p, lr=float("nan")), r"lr of model 0 is nan"),
        (
            lambda p: fo.StepLR(fo.SGD(p, 0.1), step_size=[1, 0, 1]),
            r"StepLR: step_size of model 1 is 0.0; expected > 0",
        ),
        (lambda p: fo.CosineLR(fo.SGD(p, 0.1), total_steps=-3), r"total_steps of model 0"),
        (
            lambda p: fo.LinearWarmup(fo.SGD(p, 0.1), warmup_steps=[5, 5, 0]),
            r"warmup_steps of model 2",
        ),
        (
            lambda p: fo.StepLR(torch.optim.SGD(p, 0.1), step_size=1),
            r"expected a fold.optim optimizer",
        ),
    ],
)
def test_hyperparameters_are_validated_per_model(make_opt, match) -> None:
    _, bm = make()
    with pytest.raises(FoldError, match=match):
        make_opt(bm.parameters())


def test_torch_lr_schedulers_scale_every_models_lr() -> None:
    from torch.optim import lr_scheduler

    _, bm = make()
    lrs = torch.tensor([0.1, 0.2, 0.4], dtype=torch.float64)
    opt = fo.SGD(bm.parameters(), lr=lrs)
    sched = lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(4):
        opt.step()
        sched.step()
    torch.testing.assert_close(opt.hyper("lr"), lrs * 0.25)
    opt = fo.Adam(bm.parameters(), lr=lrs)
    plateau = lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.1)
    for _ in range(3):
        opt.step()
        plateau.step(1.0)
    torch.testing.assert_close(opt.hyper("lr"), lrs * 0.01)
    # a fold schedule and a torch one compose: per-model settings times a common factor
    opt = fo.SGD(bm.parameters(), lr=lrs)
    mine = fo.StepLR(opt, step_size=[1, 2, 100], gamma=0.5)
    theirs = lr_scheduler.ExponentialLR(opt, gamma=0.9)
    for _ in range(2):
        opt.step()
        mine.step()
        theirs.step()
    torch.testing.assert_close(
        opt.hyper("lr"), lrs * torch.tensor([0.25, 0.5, 1.0], dtype=torch.float64) * 0.81
    )


def test_optimizer_load_state_dict_checks_everything_first() -> None:
    models, bm = make()
    opt = fo.Adam(bm.parameters(), lr=[1e-2, 1e-3, 1e-4])
    train(bm, opt, steps=2)
    good = copy.deepcopy(opt.state_dict())
    before = copy.deepcopy(opt.state_dict())

    def broken(edit):
        sd = copy.deepcopy(good)
        edit(sd)
        return sd

    cases = [
        (
            broken(lambda sd: sd["param_groups"].append(dict(sd["param_groups"][0]))),
            r"2 param groups, this optimizer 1",
        ),
        (
            broken(
                lambda sd: sd["param_groups"][0].update(model_lr=torch.ones(2, dtype=torch.float64))
            ),
            r"'model_lr' is \(2,\); this optimizer keeps \(3,\)",
        ),
        (
            broken(
                lambda sd: sd["param_groups"][0].update(
                    beta1=torch.full((3,), 2.0, dtype=torch.float64)
                )
            ),
            r"beta1 of model 0 is 2.0",
        ),
        (
            broken(lambda sd: sd["state"][0].update(exp_avg=torch.zeros(1))),
            r"state 'exp_avg' of parameter 0 is \(1,\)",
        ),
        (
            broken(lambda sd: sd["state"][1].update(step=torch.zeros(2))),
            r"state 'step' of parameter 1",
        ),
        (
            broken(lambda sd: sd["param_groups"][0].update(params=[0])),
            r"another number of parameters",
        ),
    ]
    for sd, match in cases:
        with pytest.raises(FoldError, match=match):
            opt.load_state_dict(sd)
        now = opt.state_dict()
        for k, st in before["state"].items():
            for key, v in st.items():
                assert torch.equal(now["state"][k][key], v)
        torch.testing.assert_close(
            now["param_groups"][0]["model_lr"], before["param_groups"][0]["model_lr"]
        )
    opt.load_state_dict(good)  # the valid one still loads
