"""GPU checks: skipped without CUDA (CI has none)."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

import fold
from fold.models import TreeLSTM, record_tree
from fold.treebank import random_tree

pytestmark = pytest.mark.gpu


def test_apply_never_synchronises_with_the_host() -> None:
    rng = random.Random(0)
    model = TreeLSTM(1000, 32).cuda()
    trees = [random_tree(rng, rng.randint(2, 20), 1000) for _ in range(64)]
    f = fold.Fold()
    roots = [record_tree(f, t) for t in trees]
    torch.cuda.synchronize()
    try:
        with warnings.catch_warnings():  # "a prototype feature": a warning, here an error
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        h, y = f.apply(model, [roots, [1] * len(roots)])
        loss = model.loss(h, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    loss.backward()
    ref = torch.cat([model.encode(t) for t in trees])
    torch.testing.assert_close(h, ref, rtol=1e-4, atol=1e-5)


def test_gpu_values_and_gradients_match_cpu() -> None:
    rng = random.Random(1)
    trees = [random_tree(rng, rng.randint(1, 12), 100) for _ in range(16)]
    cpu = TreeLSTM(100, 16).double()
    gpu = TreeLSTM(100, 16).double().cuda()
    gpu.load_state_dict(cpu.state_dict())
    outs = []
    for model in (cpu, gpu):
        f = fold.Fold()
        (h,) = f.apply(model, [[record_tree(f, t) for t in trees]])
        h.pow(2).sum().backward()
        grads = {k: p.grad.cpu() for k, p in model.named_parameters() if p.grad is not None}
        outs.append((h.cpu(), grads))
    torch.testing.assert_close(outs[0][0], outs[1][0])
    assert outs[0][1].keys() == outs[1][1].keys() and outs[0][1]
    for k in outs[0][1]:
        torch.testing.assert_close(outs[0][1][k], outs[1][1][k])
