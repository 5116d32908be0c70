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


def test_an_empty_batch_in_micro_batches_is_a_fold_error() -> None:
    _, trainer = make()
    trainer.micro_batch = 4
    with pytest.raises(fold.FoldError, match=r"empty batch \(micro_batch=4\).*Fix: drop"):
        trainer.train_step([])


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


def _snapshot(trainer: Trainer) -> dict:
    import copy

    return copy.deepcopy(
        {
            "model": trainer.model.state_dict(),
            "opt": trainer.optimizer.state_dict(),
            "sched": {
                k: v for k, v in trainer.scheduler.state_dict().items() if k != "load_state_dict"
            },
            "rng": torch.get_rng_state(),
            "py": random.getstate(),
            "pos": (trainer.epoch, trainer.position, trainer.steps),
        }
    )


def _same(a: dict, b: dict) -> None:
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k])
    assert str(a["opt"]) == str(b["opt"]) and a["sched"] == b["sched"]
    assert torch.equal(a["rng"], b["rng"]) and a["py"] == b["py"] and a["pos"] == b["pos"]


def test_load_changes_nothing_unless_the_whole_file_is_valid(tmp_path) -> None:
    model, trainer = make()
    trainer.fit(batches(2), epochs=1)
    good = tmp_path / "good.pt"
    trainer.save(good)
    state = torch.load(good, weights_only=True)
    (tmp_path / "empty.pt").write_bytes(b"")
    edits = {
        "groups": lambda s: s["optimizer"]["param_groups"].append(
            dict(s["optimizer"]["param_groups"][0])
        ),
        "exp_avg": lambda s: s["optimizer"]["state"][0].update(exp_avg=torch.zeros(2, 2)),
        "unknown": lambda s: s["optimizer"]["state"].update({99: {}}),
        "rng": lambda s: s.update(torch_rng=torch.zeros(3, dtype=torch.uint8)),
        "pyrng": lambda s: s.update(python_rng=(3, (1, 2), None)),
        "epoch": lambda s: s.update(epoch=-1),
        "weights": lambda s: s["model"].update({k: "x" for k in list(s["model"])[:1]}),
        "scheduler": lambda s: s.update(scheduler=None),
    }
    torch.manual_seed(5)
    random.seed(5)
    before = _snapshot(trainer)
    with pytest.raises(fold.FoldError, match=r"empty \(0 bytes\)"):
        trainer.load(tmp_path / "empty.pt")
    _same(before, _snapshot(trainer))
    for name, edit in edits.items():
        import copy

        bad = copy.deepcopy(state)
        edit(bad)
        torch.save(bad, tmp_path / f"{name}.pt")
        with pytest.raises(fold.FoldError, match="Trainer.load"):
            trainer.load(tmp_path / f"{name}.pt")
        _same(before, _snapshot(trainer))

    # a failure while applying (after the model and optimizer took the file): all put back
    def refuse(_state):
        raise RuntimeError("scheduler says no")

    trainer.scheduler.load_state_dict = refuse
    with pytest.raises(fold.FoldError, match="scheduler says no.*put back"):
        trainer.load(good)
    _same(before, _snapshot(trainer))
    del trainer.scheduler.load_state_dict
    trainer.load(good)  # the valid file still loads


def test_fit_takes_a_data_loader_and_logs_to_a_writer() -> None:
    from torch.utils.data import DataLoader

    data = [t for b in batches(3, 6) for t in b]

    class Writer:
        def __init__(self) -> None:
            self.calls: list[tuple[str, float, int]] = []

        def add_scalar(self, tag, value, step):
            self.calls.append((tag, value, step))

    _, a = make()
    loader = DataLoader(data, batch_size=6, shuffle=False, collate_fn=list)
    w = Writer()
    history = a.fit(loader, epochs=2, writer=w)
    assert len(history) == 2 and a.steps == 6
    steps = [s for tag, _, s in w.calls if tag == "train/loss"]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert [s for tag, _, s in w.calls if tag == "train/epoch_loss"] == [1, 2]
    # the same batches as a list, in the same order (seeded shuffle off: an identity order)
    model_b, b = make()
    b._order = lambda n: list(range(n))  # type: ignore[method-assign]
    b.fit([data[i : i + 6] for i in range(0, 18, 6)], epochs=2)
    for p, q in zip(a.model.parameters(), model_b.parameters()):
        torch.testing.assert_close(p, q)
    # a generator of batches works too (no len: the bar has no total)
    _, c = make()
    c.fit((data[i : i + 6] for i in range(0, 18, 6)), epochs=1)
    assert c.steps == 3
    with pytest.raises(fold.FoldError, match="has no add_scalar"):
        c.fit(loader, epochs=2, writer=object())


def test_sweep_losses_log_one_curve_per_model() -> None:
    torch.manual_seed(0)
    bm = BatchModule.from_modules([TreeLSTM(30, 8).double() for _ in range(2)])
    opt = fold.optim.Adam(bm.parameters(), lr=[1e-3, 1e-2])

    def sweep_step(model, trees):
        f = fold.Fold()
        h, y = f.apply(model, [[record_tree(f, t) for t in trees], [t.label for t in trees]])
        logits = model.method("classify")(h)
        return batch_loss(logits, y.expand(2, -1), torch.nn.functional.cross_entropy)

    tags: list[str] = []

    class Writer:
        def add_scalar(self, tag, value, step):
            tags.append(tag)

    Trainer(bm, opt, sweep_step, progress=False).fit(batches(1), epochs=1, writer=Writer())
    assert tags == ["train/loss", "train/loss/model_0", "train/loss/model_1"] + [
        "train/epoch_loss",
        "train/epoch_loss/model_0",
        "train/epoch_loss/model_1",
    ]
