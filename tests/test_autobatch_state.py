"""Modules that change a tensor of their own when called, under fold.autobatch: a batch norm
in training mode (running statistics and a call count), a module of one's own that counts
its calls in a buffer, a lazy module.  Eager code changes the state once per example's
call; so must autobatch, whatever path its calls take (rows recorded once, per example, in
rounds), and shape inference and vmap's trial must leave the state as they found it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fold
from fold.errors import FoldError

# Float64 throughout (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("float64")


def _twins(make):
    """Two copies of one module (one for eager code, one for autobatch)."""
    torch.manual_seed(0)
    a = make()
    torch.manual_seed(0)
    b = make()
    return a, b


def _assert_state_equal(a: nn.Module, b: nn.Module) -> None:
    for (name, x), (_, y) in zip(a.named_buffers(), b.named_buffers()):
        torch.testing.assert_close(y, x, msg=lambda m, name=name: f"buffer {name}: {m}")


def _assert_grads_equal(a: nn.Module, b: nn.Module) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=lambda m, name=name: f"grad {name}: {m}")


def _net(momentum):
    return lambda: nn.Sequential(
        nn.Linear(4, 6), nn.BatchNorm1d(6, momentum=momentum), nn.ReLU(), nn.Linear(6, 2)
    )


def _reads(m):
    """A function that reads a value between two calls of ``m`` (a round each)."""

    def fn(x):
        h = m(x)
        if float(h.detach()[0, 0]) > float(h.detach()[1, 0]):
            h = h + m(x * 2)
        return h.sum()

    return fn


@pytest.mark.parametrize(
    "path, momentum",
    [("rows", 0.1), ("rows", None), ("lists", None), ("rounds", None)],
)
def test_batch_norm_in_training_updates_its_state_once_per_example(momentum, path):
    """Each example's call normalises by its own statistics and updates the running ones,
    as eager code does: the statistics and the call count equal eager's (with momentum
    None, the count weighs the average).  Shape inference ran the norm on zeros, and the
    round's vmap trial counted a call before it failed: each moved the state.  (Calls of
    several shapes, depths or rounds are taken in eager order: see
    test_running_statistics_take_the_calls_in_eager_order.)"""
    a, b = _twins(_net(momentum))
    if path == "rows":  # one shape: the function recorded once on lazy rows
        xs = [torch.randn(3, 4) for _ in range(5)]
        fn = lambda m: lambda x: m(x).sum()  # noqa: E731
    elif path == "lists":  # several shapes: per example
        xs = [torch.randn(k, 4) for k in (2, 3, 3, 4, 2)]
        fn = lambda m: lambda x: m(x).sum()  # noqa: E731
    else:
        xs = [torch.randn(3, 4) for _ in range(5)]
        fn = _reads
    want = torch.stack([fn(a)(x) for x in xs])
    got = fold.autobatch(fn(b), xs)
    torch.testing.assert_close(got, want)
    _assert_state_equal(a, b)
    assert int(b[1].num_batches_tracked) == int(a[1].num_batches_tracked)
    want.sum().backward()
    got.sum().backward()
    _assert_grads_equal(a, b)


def test_batch_norm_per_image_training_step_matches_eager():
    """A per-sample training step of a small CNN with BatchNorm2d (one image a call, its
    own statistics): losses, gradients and running statistics equal eager's, over two
    steps (the second call reuses what the first recorded)."""

    def make():
        return nn.Sequential(
            nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 3)
        )

    a, b = _twins(make)
    for _step in range(2):
        images = [torch.randn(1, 1, 8, 8) for _ in range(6)]
        labels = [torch.randint(0, 3, (1,)) for _ in range(6)]
        want = torch.stack([F.cross_entropy(a(x), y) for x, y in zip(images, labels)])
        got = fold.autobatch(lambda x, y: F.cross_entropy(b(x), y), images, labels)
        torch.testing.assert_close(got, want)
        want.sum().backward()
        got.sum().backward()
        _assert_grads_equal(a, b)
        _assert_state_equal(a, b)


def test_batch_norm_in_eval_mode_runs_batched_and_keeps_its_state(caplog):
    """In eval mode a norm changes nothing: its groups stay one batched call (not one call
    per example), and the buffers are not touched (not even rewritten)."""
    a, b = _twins(_net(0.1))
    a.eval()
    b.eval()
    versions = [t._version for t in b.buffers()]
    xs = [torch.randn(k, 4) for k in (2, 3, 3, 4)]
    want = [a(x) for x in xs]
    got = fold.autobatch(lambda x: b(x), xs, stack=False)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    _assert_state_equal(a, b)
    assert [t._version for t in b.buffers()] == versions
    # one call a group, not one per example (which is said once per module)
    assert not [r for r in caplog.records if "one call per example" in r.getMessage()]


def test_batch_norm_switched_to_training_between_calls_matches_eager():
    """The same model in eval mode, then in training mode, in two autobatch calls of one
    function: the second call's updates equal eager's."""
    a, b = _twins(_net(None))
    xs = [torch.randn(k, 4) for k in (2, 3, 3)]
    for training in (False, True):
        a.train(training)
        b.train(training)
        want = [a(x) for x in xs]
        got = fold.autobatch(lambda x: b(x), xs, stack=False)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
        _assert_state_equal(a, b)


def test_batch_norm_runs_batched_in_eval_mode_after_looping_in_training(monkeypatch):
    """A batch norm's groups run one call per example in training mode (each call its own
    statistics, and an update of the running ones); that verdict holds in training mode
    only: evaluated after training, its groups run as one call again.  Values equal
    eager's in both modes."""
    a, b = _twins(_net(None))
    xs = [torch.randn(k, 4) for k in (2, 3, 3, 4, 2, 3)]
    fn = lambda x: b(x)  # noqa: E731
    want = [a(x) for x in xs]
    for g, w in zip(fold.autobatch(fn, xs, stack=False), want):
        torch.testing.assert_close(g, w)
    a.eval()
    b.eval()
    calls = []
    real = nn.BatchNorm1d.forward

    def counted(self, x):
        calls.append(x.shape)
        return real(self, x)

    monkeypatch.setattr(nn.BatchNorm1d, "forward", counted)
    want = [a(x) for x in xs]
    calls.clear()
    got = fold.autobatch(fn, xs, stack=False)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert len(calls) <= 3, calls  # one call a shape (3 lengths), not one per example (6)
    _assert_state_equal(a, b)


class _Counting(nn.Module):
    """A module of one's own that counts its calls in a buffer and keeps an average of its
    inputs (each call changes what the one before left)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("mean", torch.zeros(3))

    def forward(self, x):
        self.calls += 1
        self.mean.mul_(0.5).add_(0.5 * x.detach().mean(0))
        return self.lin(x)


def test_a_module_that_counts_its_calls_in_a_buffer_counts_each_example():
    """Under vmap the module's one call for the group would count once and average the
    batch (silently); its groups now run one call per example, as eager code runs them
    (examples of several shapes: recorded per example)."""
    a, b = _twins(_Counting)
    xs = [torch.randn(k, 3) for k in (1, 2, 2, 3, 2)]
    want = [a(x) for x in xs]
    got = fold.autobatch(lambda x: b(x), xs, stack=False)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert float(b.calls) == len(xs)
    _assert_state_equal(a, b)
    sum((g * g).sum() for g in got).backward()
    sum((w * w).sum() for w in want).backward()
    _assert_grads_equal(a, b)


class _Flagged(nn.Module):
    """Counts its calls only while a flag of its own is set."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("calls", torch.zeros(()))
        self.counting = False

    def forward(self, x):
        if self.counting:
            self.calls += 1
        return self.lin(x)


def test_a_buffer_changed_after_calls_that_changed_none_is_a_fold_error():
    """A module whose batched calls changed no buffer in this training mode is checked, not
    copied, on its later calls; one that then changes a buffer (a flag of its own) cannot
    be undone: a FoldError names the module, the buffer and the fix."""
    m = _Flagged()
    xs = [torch.randn(2, 3) for _ in range(4)]  # (one shape: its calls recorded whole)
    fn = lambda x: m(x)  # noqa: E731
    fold.autobatch(fn, xs, stack=False)
    m.counting = True
    with pytest.raises(FoldError, match=r"changed its buffer 'calls'.*Fix: change buffers"):
        fold.autobatch(fn, xs, stack=False)


def test_a_module_called_on_several_shapes_runs_through_and_counts_each_call():
    """The same module called on values of several shapes: run through once the shapes
    vary (see recorder._shapes_vary), so its forward runs per example, as eager code runs
    it, and a buffer it changes counts every call."""
    m = _Flagged()
    xs = [torch.randn(k, 3) for k in (1, 2, 2, 3)]
    fn = lambda x: m(x)  # noqa: E731
    fold.autobatch(fn, xs, stack=False)  # (recorded whole for the first shape)
    m.counting = True
    got = fold.autobatch(fn, xs, stack=False)
    assert int(m.calls) == len(xs)
    for g, x in zip(got, xs):
        torch.testing.assert_close(g, m.lin(x))


@pytest.mark.parametrize("shapes", [(3, 3, 3), (1, 2, 3)])
def test_a_lazy_module_is_a_fold_error_and_stays_lazy(shapes):
    """A lazy module makes its parameters on its first call; shape inference would make
    them from fake tensors (a broken module). A FoldError names it and the fix; the module
    is left as it was, and works once called eagerly."""
    m = nn.Sequential(nn.LazyLinear(4), nn.ReLU())
    xs = [torch.randn(k, 3) for k in shapes]
    with pytest.raises(FoldError, match=r"LazyLinear is a lazy module.*Fix: call the model once"):
        fold.autobatch(lambda x: m(x), xs, stack=False)
    assert isinstance(m[0], nn.LazyLinear) and m[0].has_uninitialized_params()
    m(xs[0])  # made now, from a real call
    got = fold.autobatch(lambda x: m(x), xs, stack=False)
    for g, x in zip(got, xs):
        torch.testing.assert_close(g, m(x))


def test_the_batch_norm_patch_is_put_back_after_nested_recordings():
    """``_BatchNorm.forward`` is patched while rows are recorded once (a batch norm in
    training mode recorded as one call); nested recordings (one inside another, or two
    threads at once) install it once and the last one out puts torch's own back."""
    from fold.autobatch import patches

    norm = torch.nn.modules.batchnorm._BatchNorm
    torch_own = norm.__dict__["forward"]
    with patches.recorded_calls:
        with patches.recorded_calls:
            assert norm.__dict__["forward"] is patches._norm_forward
        assert norm.__dict__["forward"] is patches._norm_forward
    assert norm.__dict__["forward"] is torch_own
    m = nn.BatchNorm1d(3)
    out = fold.autobatch(lambda x: m(x), [torch.randn(2, 3) for _ in range(3)])
    assert out.shape == (3, 2, 3) and norm.__dict__["forward"] is torch_own


@pytest.mark.parametrize("path", ["rows", "lists"])
def test_batch_norm_groups_in_training_run_as_one_computation(monkeypatch, path):
    """A batch norm in training mode, inside a ``Sequential`` (run through: the norm a call
    of its own) or called directly: its group runs as one computation on the stacked
    batches, each example normalised by its own statistics, the running ones updated in
    closed form (``tables._merged_batch_norm``), where it ran one call per example.  Values,
    gradients and state equal eager's."""
    a, b = _twins(_net(None))
    if path == "rows":
        xs = [torch.randn(3, 4) for _ in range(6)]
    else:
        xs = [torch.randn(k, 4) for k in (2, 3, 3, 2, 3, 2)]
    fn = lambda m: lambda x: m(x).sum()  # noqa: E731
    fold.autobatch(fn(b), xs)  # (shapes inferred)
    a.load_state_dict(b.state_dict())  # (the same state on both sides again)
    calls = []
    real = F.batch_norm  # (what the module's forward calls)

    def counted(x, *args, **kwargs):
        calls.append(tuple(x.shape))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(torch.nn.modules.batchnorm.F, "batch_norm", counted)
    want = torch.stack([fn(a)(x) for x in xs])
    calls.clear()
    got = fold.autobatch(fn(b), xs)
    assert len(calls) == 0, calls  # (no call of the module per example: one computation)
    torch.testing.assert_close(got, want)
    _assert_state_equal(a, b)
    want.sum().backward()
    got.sum().backward()
    _assert_grads_equal(a, b)


class _Doubled(nn.BatchNorm1d):
    """A batch norm subclass with a forward of its own (``super().forward``)."""

    def forward(self, x):
        return super().forward(x) * 2


class _OwnNorm(nn.Module):
    """A norm of one's own: ``F.batch_norm`` in training on buffers it holds."""

    def __init__(self, c):
        super().__init__()
        self.register_buffer("mean", torch.zeros(c))
        self.register_buffer("var", torch.ones(c))
        self.weight = nn.Parameter(torch.rand(c) + 0.5)

    def forward(self, x):
        return F.batch_norm(x, self.mean, self.var, self.weight, None, self.training, 0.3, 1e-5)


class _Tripled(nn.InstanceNorm1d):
    def forward(self, x):
        return super().forward(x) * 3


_NORMS = {
    "batch norm subclass": lambda: _Doubled(6),
    "batch norm subclass, momentum None": lambda: _Doubled(6, momentum=None),
    "F.batch_norm on own buffers": lambda: _OwnNorm(6),
    "instance norm with running statistics": lambda: nn.InstanceNorm1d(
        6, affine=True, track_running_stats=True
    ),
    "instance norm subclass": lambda: _Tripled(6, track_running_stats=True),
}


class _Channels(nn.Module):
    """(N, L, C) -> (N, C, L): the layout an instance norm takes."""

    def forward(self, x):
        return x.transpose(1, 2)


def _read_before(m):
    """A function that reads a value before it calls ``m`` (in the second round)."""

    def fn(x):
        h = x * 2 if float(x.sum()) > 0 else x
        return m(h).pow(2).sum()

    return fn


@pytest.mark.parametrize("path", ["rows", "lists", "rounds"])
@pytest.mark.parametrize("norm", list(_NORMS))
def test_norms_of_ones_own_update_running_statistics_once_per_example(monkeypatch, norm, path):
    """A norm that updates running statistics, reached otherwise than as a call of torch's
    batch norm classes: a subclass's ``super().forward`` (its call count once per example
    too), ``F.batch_norm`` on buffers of one's own, an instance norm with running
    statistics (its class, or a subclass).  Values, gradients, running statistics and the
    count equal eager's, on every path; where no read comes between, a group runs as one
    computation (no per-example call of torch's norm).  (The subclass and the F.batch_norm
    call ran under vmap on a copy of the statistics, which stayed as they were; the rows
    path counted a subclass's calls once or twice for the whole batch; an instance norm
    with running statistics ran one call per example.)"""
    instance = "instance" in norm

    def make():
        layers = [nn.Linear(4, 6), _Channels(), _NORMS[norm]()]
        return nn.Sequential(*(layers if instance else layers[::2]))

    a, b = _twins(make)
    sizes = (2, 2, 3, 3, 4) if path == "lists" else (3,) * 5
    xs = [torch.randn(k, 5, 4) if instance else torch.randn(k, 4) for k in sizes]
    fn = _read_before if path == "rounds" else (lambda m: lambda x: m(x).pow(2).sum())
    calls = []
    for name in ("batch_norm", "instance_norm"):
        real = getattr(torch, name)

        def counted(*args, real=real, **kwargs):
            calls.append(real)
            return real(*args, **kwargs)

        monkeypatch.setattr(torch, name, counted)
    for step in range(2):  # (the first infers shapes: on fake tensors, torch's norm runs)
        want = torch.stack([fn(a)(x) for x in xs])
        calls.clear()
        got = fold.autobatch(fn(b), xs)
        if step and path != "rounds":
            assert not calls  # (one computation per group)
        torch.testing.assert_close(got, want)
        _assert_state_equal(a, b)
        want.sum().backward()
        got.sum().backward()
        _assert_grads_equal(a, b)


_ORDER_NORMS = {"batch norm": lambda: nn.BatchNorm1d(6), **_NORMS}


@pytest.mark.parametrize(
    "norm, path",
    [
        (norm, path)
        for norm in _ORDER_NORMS
        for path in ("twice", "shapes", "rounds", "eager-finish", "per-example")
    ]
    + [("batch norm", "momentum None"), ("batch norm subclass", "momentum None")],
)
def test_running_statistics_take_the_calls_in_eager_order(monkeypatch, norm, path):
    """Eager code updates a norm's running statistics at every call: example 0's calls in
    its order, then example 1's.  With a momentum the order weighs the calls, and autobatch
    runs them in its own order: the norm's second call in an example after every
    example's first (a group a depth), calls on values of several shapes (the examples not
    in the order of their shapes) a group a shape, calls after a read in later rounds (or
    at once, as the examples finish as eager code), a norm functional on a tensor the
    example was given at once.  The statistics and the call count equal eager's on every
    path (they were updated group by group, in fold's order), as do values and gradients,
    over two calls (the first infers shapes: the norm functional's inference on zeros
    updated the statistics, once)."""
    from fold.autobatch import driver

    instance = "instance" in norm

    def make():
        norm_ = _ORDER_NORMS[norm]()
        if path == "momentum None":
            norm_.momentum = None
        layers = [nn.Linear(4, 6), _Channels(), norm_]
        return nn.Sequential(*(layers if instance else layers[::2]))

    a, b = _twins(make)
    torch.manual_seed(1)
    sizes = (4, 2, 3, 2, 3) if path == "shapes" else (3,) * 5

    def fn(m):
        def step(x):
            if path in ("rounds", "eager-finish") and float(x.sum()) > 0:  # a read
                x = x * 2
            h = m(x)
            if path == "per-example":  # the norm on the example's own tensor first
                own = torch.cat([x, x], -1)[..., :6]
                h = m[-1](own.transpose(1, 2) if instance else own) + h
            return m[-1](torch.tanh(h) * 2).pow(2).sum()

        return step

    if path == "rounds":
        monkeypatch.setattr(driver, "EAGER_GROUP", 0)  # every round batched
    for _step in range(2):
        xs = [torch.randn(k, 5, 4) if instance else torch.randn(k, 4) for k in sizes]
        want = torch.stack([fn(a)(x) for x in xs])
        got = fold.autobatch(fn(b), xs, per_example=path == "per-example")
        torch.testing.assert_close(got, want)
        _assert_state_equal(a, b)
        want.sum().backward()
        got.sum().backward()
        _assert_grads_equal(a, b)


@pytest.mark.parametrize("kind", ["batch", "instance"])
def test_shape_inference_of_a_norm_function_leaves_the_running_statistics(kind):
    """``F.batch_norm`` (or ``F.instance_norm``) in training on running statistics, called
    in the function itself on a recorded value: its shape inference runs it on zeros,
    which updated the statistics on the call that first recorded it (a silent drift of the
    statistics, once per new shape).  Statistics, values and gradients equal eager's from
    the first call on."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    stats = [torch.zeros(4), torch.ones(4)]
    norm = F.batch_norm if kind == "batch" else F.instance_norm

    def fn(x):
        h = lin(x) if kind == "batch" else lin(x).T[None]
        return norm(h, *stats, None, None, True, 0.3, 1e-5).pow(2).sum()

    xs = [torch.randn(5, 4) for _ in range(3)]
    want = torch.stack([fn(x) for x in xs])
    grad = torch.autograd.grad(want.sum(), lin.weight)
    eager = [t.clone() for t in stats]
    for t, start in zip(stats, (0.0, 1.0)):
        t.data.fill_(start)  # (as before the eager calls)
    got = fold.autobatch(fn, xs, per_example=True)
    torch.testing.assert_close(got, want)
    for t, e in zip(stats, eager):
        torch.testing.assert_close(t, e)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), lin.weight), grad)


@pytest.mark.parametrize("norm", ["module", "subclass", "functional"])
def test_an_eager_graph_through_a_batch_norm_backpropagates_after_autobatch_used_it(norm):
    """A step that runs a batch norm in eager code and under autobatch before one backward
    (a loss of both): autobatch updates the running statistics as torch's kernel does,
    without bumping their version, which the eager call's graph saved and checks (its
    backward raised "modified by an inplace operation").  Gradients equal an all-eager
    step's."""
    make = {
        "module": lambda: nn.BatchNorm1d(4),
        "subclass": lambda: _Doubled(4),
        "functional": lambda: _OwnNorm(4),
    }[norm]
    a, b = _twins(make)
    x = torch.randn(5, 4, requires_grad=True)
    xs = [torch.randn(3, 4) for _ in range(4)]
    want = a(x).pow(2).sum() + torch.stack([a(r).pow(2).sum() for r in xs]).sum()
    want.backward()
    got = b(x).pow(2).sum() + fold.autobatch(lambda r: b(r).pow(2).sum(), xs).sum()
    got.backward()
    torch.testing.assert_close(got, want)
    _assert_grads_equal(a, b)
    _assert_state_equal(a, b)
