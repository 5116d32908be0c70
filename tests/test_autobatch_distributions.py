"""torch.distributions inside fold.autobatch: a policy's Categorical, a VAE's Normal, over
recorded parameters and recorded or input values, with torch's argument validation on (its
default).  A lazy value is no instance of torch.Tensor, and two places of
torch.distributions test that: a sample's validation, and ``broadcast_all``, which makes a
number argument a tensor of the first tensor's dtype and device.  Values, gradients, and the
errors of invalid values, against eager per example."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.distributions import Bernoulli, Categorical, Normal, kl_divergence

import fold


@pytest.fixture(autouse=True)
def _validated():
    """torch's argument checks on, as torch sets them (torch.compile turns them off for the
    whole process once it runs, as an earlier test may)."""
    from torch.distributions import Distribution

    before = Distribution._validate_args
    Distribution.set_default_validate_args(True)
    yield
    Distribution.set_default_validate_args(before)


def _net(dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 6)).to(dtype)


def _policy(net):
    def fn(x, action):
        d = Categorical(logits=net(x))
        return d.log_prob(action) + 0.1 * d.entropy()

    return fn


def _gaussian(net, scale=None):
    """A Gaussian head: its log-density of a recorded value (half its mean), and its KL
    from a standard normal; the scale a number where given."""

    def fn(x):
        h = net(x)
        mu = h[:3]
        target = mu.detach() * 0.5  # (made before the distribution reads its validation)
        d = Normal(mu, h[3:].exp() if scale is None else scale)
        prior = Normal(torch.zeros(3, dtype=h.dtype), torch.ones(3, dtype=h.dtype))
        return d.log_prob(target).sum() + kl_divergence(d, prior).sum()

    return fn


def _check(fn, net, *inputs, **kwargs):
    """``fold.autobatch(fn, *inputs)`` against eager per example: values and gradients."""
    got = fold.autobatch(fn, *inputs, **kwargs)
    grads = torch.autograd.grad(got.sum(), list(net.parameters()))
    want = torch.stack([fn(*args) for args in zip(*inputs)])
    want_grads = torch.autograd.grad(want.sum(), list(net.parameters()))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, h in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, h, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("per_example", [False, True])
def test_a_policy_and_a_gaussian_head_equal_eager(per_example):
    """A Categorical policy's log-probability of each example's action (an input) and its
    entropy; a Normal's log-density of a recorded value and its KL from a prior; validation
    on.  (log_prob of a lazy value raised "must be a Tensor": an input row's on the rows
    path, which then recorded per example; a recorded value's on every path.)"""
    net = _net()
    xs = [torch.randn(4, dtype=torch.float64) for _ in range(6)]
    actions = [torch.tensor(i % 6) for i in range(6)]
    _check(_policy(net), net, xs, actions, per_example=per_example)
    _check(_gaussian(net), net, xs, per_example=per_example)


def test_the_rows_of_a_policy_are_recorded_once(recordings, caplog):
    """A Dataset's samples of one shape and their actions: the policy is recorded once for
    all rows (its validation reads agree: every row valid), the second call too, where
    its module calls are recorded whole (a call without a direct form: the broadcast of the
    distribution's parameters), and no call falls back to one per example (a logged
    warning: the lockstep's reads ran the module calls recorded whole while recording,
    which recorded their inner calls again, on the batch)."""
    counts = recordings
    net = _net()
    xs = [torch.randn(4, dtype=torch.float64) for _ in range(16)]
    actions = [torch.tensor(i % 6) for i in range(16)]
    with caplog.at_level(logging.WARNING, logger="fold"):
        for _ in range(2):
            _check(_policy(net), net, xs, actions)
    assert counts["per example"] == 0 and counts["once"] >= 2
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("per_example", [False, True])
def test_a_number_parameter_takes_the_recorded_values_dtype(per_example):
    """``Normal(mu, 0.1)`` of a float64 ``mu`` where the default dtype is float32: eager
    makes the scale a float64 tensor (the first tensor's dtype); so does autobatch (it
    made it float32, 4e-6 off in float64)."""
    assert torch.get_default_dtype() is torch.float32
    net = _net(torch.float64)
    xs = [torch.randn(4, dtype=torch.float64) for _ in range(5)]
    _check(_gaussian(net, scale=0.1), net, xs, per_example=per_example)


@pytest.mark.parametrize("per_example", [False, True])
def test_invalid_values_raise_as_in_eager_code(per_example):
    """An action out of a Categorical's support, a Bernoulli's value that is not 0 or 1, a
    value of the wrong shape: torch's ValueError, as eager code raises it, on every path."""
    net = _net()
    xs = [torch.randn(4, dtype=torch.float64) for _ in range(4)]
    actions = [torch.tensor(i) for i in (0, 1, 7, 2)]  # (7: no action of 6)
    with pytest.raises(ValueError, match="support"):
        _policy(net)(xs[2], actions[2])
    with pytest.raises(ValueError, match="support"):
        fold.autobatch(_policy(net), xs, actions, per_example=per_example)

    def coins(x):
        h = net(x)
        return Bernoulli(logits=h).log_prob(h.detach()).sum()  # (values not 0 or 1)

    with pytest.raises(ValueError, match="support"):
        fold.autobatch(coins, xs, per_example=per_example)

    def wrong_shape(x):
        h = net(x)
        return Normal(h[:3], 1.0).log_prob(h[:2]).sum()

    with pytest.raises(ValueError, match="broadcastable"):
        wrong_shape(xs[0])
    with pytest.raises(ValueError, match="broadcastable"):
        fold.autobatch(wrong_shape, xs, per_example=per_example)


def test_torch_distributions_are_as_torch_made_them_after_the_call():
    """The patches are installed for the call alone: after it (and after one that raised),
    Distribution._validate_sample and each module's broadcast_all are torch's own."""
    import torch.distributions.normal as normal_module
    from torch.distributions import Distribution
    from torch.distributions.utils import broadcast_all

    own_validate = Distribution.__dict__["_validate_sample"]
    net = _net()
    xs = [torch.randn(4, dtype=torch.float64) for _ in range(3)]
    fold.autobatch(_gaussian(net, scale=0.1), xs)
    with pytest.raises(ValueError):
        fold.autobatch(_policy(net), xs, [torch.tensor(9)] * 3)
    assert Distribution.__dict__["_validate_sample"] is own_validate
    assert normal_module.broadcast_all is broadcast_all
    with pytest.raises(ValueError, match="must be a Tensor"):
        Normal(torch.zeros(2), 1.0).log_prob([0.0, 0.0])  # (torch's own check again)
