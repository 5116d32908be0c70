"""Trainer: accumulation equivalence, bitwise resume, atomic and safe checkpoints."""

from __future__ import annotations

import pickle
import random

import pytest
import torch

import fold
import fold.optim
from fold.batched_ops import BatchModule, batch_loss
from fold.models import TreeLSTM, record_tree
from fold.train import Trainer
from fold.treebank import random_tree


def batches(n_batches: int = 6, size: int = 7):
    rng = random.Random(0)
    trees = [random_tree(rng, rng.randint(1, 8), 30) for _ in range(n_batches * size)]
    for i, t in enumerate(trees):
        t.label = i % 5
    return [trees[i : i + size] for i in range(0, len(trees), size)]


def step(model, trees):
    f = fold.Fold()
    h, y = f.apply(model, [[record_tree(f, t) for t in trees], [t.label for t in trees]])
    return model.loss(h, y)


def make(seed: int = 0) -> tuple[TreeLSTM, Trainer]:
    torch.manual_seed(seed)
    model = TreeLSTM(30, 8).double()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, Trainer(
        model, opt, step, torch.optim.lr_scheduler.StepLR(opt, 2, 0.5), progress=False
    )


def test_micro_batches_of_unequal_size_equal_one_step_on_the_whole_batch() -> None:
    data = batches(1, 11)[0]
    a, ta = make()
    b, tb = make()
    tb.micro_batch = 4  # 4 + 4 + 3: mean losses weighted by their share
    la, lb = ta.train_step(data), tb.train_step(data)
    torch.testing.assert_close(la, lb)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q)


def test_interrupted_and_resumed_run_is_bitwise_identical(tmp_path) -> None:
    data = batches()
    full, trainer = make()
    trainer.fit(data, epochs=2)

    crashed, t1 = make()

    def crash(tr: Trainer) -> None:
        if tr.epoch == 1 and tr.position == 3:
            raise RuntimeError("power cut")

    t1.add_hook("step_end", crash)
    with pytest.raises(RuntimeError, match="power cut"):
        t1.fit(data, epochs=2, checkpoint=tmp_path / "ckpt.pt")
    resumed, t2 = make(seed=123)  # other initial weights: everything must come from the file
    t2.load(tmp_path / "ckpt.pt")
    assert (t2.epoch, t2.position) == (1, 3)
    t2.fit(data, epochs=2, checkpoint=tmp_path / "ckpt.pt")
    for p, q in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    assert not list(tmp_path.glob(".ckpt.pt.*"))  # no temporary file left behind


def test_sweep_training_and_evaluation_per_model() -> None:
    torch.manual_seed(0)
    bm = BatchModule.from_modules([TreeLSTM(30, 8).double() for _ in range(3)])
    opt = fold.optim.Adam(bm.parameters(), batch=3, lr=[1e-4, 1e-3, 1e-2])

    def sweep_step(model, trees):
        f = fold.Fold()
        h, y = f.apply(model, [[record_tree(f, t) for t in trees], [t.label for t in trees]])
        return batch_loss(
            model.method("classify")(h), y.expand(3, -1), 3, torch.nn.functional.cross_entropy
        )

    trainer = Trainer(bm, opt, sweep_step, progress=False)
    history = trainer.fit(batches(), epochs=3)
    losses = [h["train"]["loss"] for h in history]
    assert losses[0].shape == (3,)
    assert losses[-1][2] < losses[0][2]  # the largest lr learns
    ev = trainer.evaluate(batches(2))
    assert ev["eval"]["loss"].shape == (3,)


def test_failed_loads_leave_the_model_untouched(tmp_path) -> None:
    model, trainer = make()
    trainer.save(tmp_path / "good.pt")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # another architecture
    other = Trainer(
        TreeLSTM(30, 4).double(),
        torch.optim.SGD(TreeLSTM(30, 4).parameters(), lr=1),
        step,
        progress=False,
    )
    other.save(tmp_path / "other.pt")
    with pytest.raises(fold.FoldError, match="another architecture.*left unchanged"):
        trainer.load(tmp_path / "other.pt")
    # a truncated file
    raw = (tmp_path / "good.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(fold.FoldError, match="cannot read .*cut.pt"):
        trainer.load(tmp_path / "cut.pt")
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


class Exploit:
    def __reduce__(self):
        return (
            exec,
            (
                "import pathlib; pathlib.Path(__import__('os').environ['FOLD_PWNED']).write_text('pwned')",
            ),
        )


def test_a_checkpoint_crafted_to_run_code_does_not_load(tmp_path, monkeypatch) -> None:
    flag = tmp_path / "pwned"
    monkeypatch.setenv("FOLD_PWNED", str(flag))
    evil = tmp_path / "evil.pt"
    torch.save({"model": Exploit()}, evil, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    _, trainer = make()
    with pytest.raises(fold.FoldError, match="weights_only=True"):
        trainer.load(evil)
    assert not flag.exists()


def test_bad_arguments() -> None:
    model, _ = make()
    with pytest.raises(fold.FoldError, match="micro_batch=0"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=1), step, micro_batch=0)
    with pytest.raises(fold.FoldError, match="unknown stage 'later'"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=1), step).add_hook("later", print)
