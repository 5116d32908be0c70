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


class _Decoder(torch.nn.Module):
    """A GRU encoder over each source and a dot-attention GRU decoder, greedy until EOS (0)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(6, 8)
        self.enc = torch.nn.GRU(8, 8)
        self.dec = torch.nn.GRUCell(16, 8)
        self.out = torch.nn.Linear(16, 6)
        with torch.no_grad():  # EOS after varied numbers of steps
            self.out.bias[0] += 0.2

    def greedy(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mem, h = self.enc(self.embed(src))
        h, ctx, toks, score = h[0], mem.mean(0), [], 0
        tok = 1
        for _ in range(8):
            h = self.dec(torch.cat([self.embed(torch.tensor(tok, device=src.device)), ctx]), h)
            ctx = torch.softmax(mem @ h, 0) @ mem
            logits = self.out(torch.cat([h, ctx]))
            tok = int(logits.argmax())  # a read: the example pauses
            score = score + logits.log_softmax(0)[tok]
            toks.append(tok)
            if tok == 0:
                break
        return torch.tensor(toks, device=src.device), score


def test_autobatch_decoding_with_reads_on_the_gpu_matches_eager() -> None:
    """Greedy decoding with reads, batched in rounds on the GPU: the tokens, scores and
    gradients equal eager decoding on the GPU, example by example (float64)."""
    torch.manual_seed(3)
    model = _Decoder().double().cuda()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 9, (12,), generator=g)
    srcs = [torch.randint(1, 6, (int(n),), generator=g).cuda() for n in lengths]
    got = fold.autobatch(lambda s: model.greedy(s), srcs, stack=False)
    want = [model.greedy(s) for s in srcs]
    assert len({len(w[0]) for w in want}) > 2  # EOS-driven lengths (1, 2 and 8 tokens)
    assert [t.tolist() for t, _ in got] == [t.tolist() for t, _ in want]
    assert all(s.device.type == "cuda" for _, s in got)
    params = list(model.parameters())
    g_got = torch.autograd.grad(sum(s for _, s in got), params)
    g_want = torch.autograd.grad(sum(s for _, s in want), params)
    torch.testing.assert_close(torch.stack([s for _, s in got]), torch.stack([s for _, s in want]))
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b)


def test_child_sum_lists_and_a_batch_module_on_the_gpu_equal_separate_cpu_folds() -> None:
    """List arguments (child-sum TreeLSTMs) for 3 models as one BatchModule on the GPU:
    every model's states and gradients equal its own fold on the CPU (float64)."""
    from fold.batched_ops import BatchModule
    from fold.models import ChildSumTreeLSTM, record_dep_tree
    from fold.treebank import random_dep_tree

    rng = random.Random(2)
    trees = [random_dep_tree(rng, rng.randint(2, 12), 50) for _ in range(10)]
    models = [ChildSumTreeLSTM(50, 8).double() for _ in range(3)]
    bm = BatchModule.from_modules(models).cuda()
    f = fold.Fold()
    (h,) = f.apply(bm, [[record_dep_tree(f, t)[-1] for t in trees]])
    assert h.device.type == "cuda" and h.shape[:2] == (3, len(trees))
    h.pow(2).sum().backward()
    for i, m in enumerate(models):
        g = fold.Fold()
        (want,) = g.apply(m, [[record_dep_tree(g, t)[-1] for t in trees]])
        want.pow(2).sum().backward()
        torch.testing.assert_close(h[i].cpu(), want)
        stacked = dict(bm.named_parameters())
        for name, p in m.named_parameters():
            if p.grad is not None:  # (the classifier is not used)
                mine = stacked[f"model.{name}"].grad[i]
                torch.testing.assert_close(mine.cpu(), p.grad, msg=name)


def test_memory_limits_on_the_gpu_give_the_same_values_and_gradients() -> None:
    """``max_rows`` and ``offload="cpu"`` (pinned host memory) on the GPU: the same states
    and gradients as a plain apply."""
    rng = random.Random(3)
    trees = [random_tree(rng, rng.randint(2, 15), 100) for _ in range(24)]
    model = TreeLSTM(100, 16).double().cuda()
    results = []
    for limits in ({}, {"max_rows": 5}, {"offload": "cpu"}, {"max_rows": 5, "offload": "cpu"}):
        model.zero_grad(set_to_none=True)
        f = fold.Fold()
        (h,) = f.apply(model, [[record_tree(f, t) for t in trees]], **limits)
        h.pow(2).sum().backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        results.append((h.detach(), grads))
    for h, grads in results[1:]:
        torch.testing.assert_close(h, results[0][0])
        assert grads.keys() == results[0][1].keys()
        for k in grads:
            torch.testing.assert_close(grads[k], results[0][1][k], msg=k)


def test_attention_over_list_memories_never_synchronises_and_matches_cpu() -> None:
    """Decoders whose every step attends over its example's memory (a list argument: the
    Ragged's softmax through its slots, the memories' table rows kept between steps) on the
    GPU under ``set_sync_debug_mode("error")``: no host synchronisation in apply, values and
    gradients equal the CPU's (float64).  (Written without a GPU at hand: it skips here.)"""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_ragged import Attend, _decoders

    sources, steps = [3, 5, 2, 4, 6, 1], [4, 1, 6, 3, 5, 2]
    cpu = Attend()
    gpu = Attend().cuda()
    f = fold.Fold()
    outs = _decoders(f, sources, steps, True)
    torch.cuda.synchronize()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        (got,) = f.apply(gpu, [outs])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    g = fold.Fold()
    (want,) = g.apply(cpu, [_decoders(g, sources, steps, True)])
    torch.testing.assert_close(got.cpu(), want)
    gg = torch.autograd.grad(got.square().sum(), list(gpu.parameters()))
    gw = torch.autograd.grad(want.square().sum(), list(cpu.parameters()))
    for a, b in zip(gg, gw):
        torch.testing.assert_close(a.cpu(), b)
