"""DistributedDataParallel over FoldModule on 2 CPU processes (gloo) against one process."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import fold
from fold.models import TreeLSTM, record_tree
from fold.treebank import random_tree

STEPS = 3


def trees_and_labels() -> tuple[list, torch.Tensor]:
    rng = random.Random(0)
    trees = [random_tree(rng, rng.randint(1, 10), 40) for _ in range(16)]
    return trees, torch.tensor([i % 5 for i in range(len(trees))])


def model() -> TreeLSTM:
    torch.manual_seed(0)
    return TreeLSTM(40, 8).double()


def train(m: torch.nn.Module, forward, trees, labels) -> None:
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    for _ in range(STEPS):
        f = fold.Fold()
        roots = [record_tree(f, t) for t in trees]
        (h,) = forward(f, [roots])
        opt.zero_grad()
        net = m.module.model if hasattr(m, "module") else m
        net.loss(h, labels).backward()
        opt.step()


def start(rank: int, world: int, init: str, **kwargs) -> None:
    """Join the process group through a file (no TCP port to race for)."""
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=world, **kwargs
    )


def finish() -> None:
    """Leave without running gloo's destructors, which may abort while a peer tears down."""
    dist.barrier()
    os._exit(0)


def worker(rank: int, world: int, init: str, out: str) -> None:
    start(rank, world, init)
    try:
        trees, labels = trees_and_labels()
        share = slice(rank * len(trees) // world, (rank + 1) * len(trees) // world)
        ddp = DistributedDataParallel(fold.FoldModule(model()))
        train(ddp, ddp, trees[share], labels[share])
        if rank == 0:
            torch.save(ddp.module.model.state_dict(), out)
    except BaseException:
        dist.destroy_process_group()
        raise
    finish()


def test_ddp_on_two_ranks_equals_one_process_on_all_trees(tmp_path: Path) -> None:
    out = str(tmp_path / "rank0.pt")
    mp.spawn(worker, args=(2, str(tmp_path / "init"), out), nprocs=2, join=True)
    trees, labels = trees_and_labels()
    single = model()
    train(single, lambda f, lists: f.apply(single, lists), trees, labels)
    got = torch.load(out, weights_only=True)
    for k, v in single.state_dict().items():
        torch.testing.assert_close(got[k], v, msg=lambda s, k=k: f"{k}: {s}")
    assert not torch.equal(got["node_gates.weight"], model().state_dict()["node_gates.weight"])


LRS = [0.5, 0.1, 0.05, 0.01]


def sweep_model(i: int) -> TreeLSTM:
    torch.manual_seed(100 + i)
    return TreeLSTM(40, 8).double()


def sweep_worker(rank: int, world: int, init: str, out: str, models: int) -> None:
    import torch.nn.functional as F

    import fold.optim
    from fold.batched_ops import BatchModule, batch_loss
    from fold.diagnostics import Diagnostic
    from fold.distributed import gather_diagnostics, save_sweep, shard

    start(rank, world, init)
    try:
        mine = shard(models)
        bm = BatchModule.from_modules([sweep_model(i) for i in range(models)[mine]])
        n = bm.batch
        opt = fold.optim.SGD(bm.parameters(), batch=n, lr=LRS[:models][mine])
        trees, labels = trees_and_labels()
        for _ in range(STEPS):
            f = fold.Fold()
            (h,) = f.apply(bm, [[record_tree(f, t) for t in trees]])
            losses = batch_loss(bm.method("classify")(h), labels.expand(n, -1), n, F.cross_entropy)
            opt.zero_grad()
            losses.sum().backward()
            opt.step()
        summary = gather_diagnostics(Diagnostic({"train": {"loss": losses, "lr": 0.0}}))
        if rank == 0:
            assert summary is not None and summary["train"]["loss"].shape == (models,)
            assert summary["train"]["lr"].shape == ()  # shared: rank 0's
            torch.save(summary["train"]["loss"], out + ".losses")
        else:
            assert summary is None
        save_sweep(bm, out)
    except BaseException:
        dist.destroy_process_group()
        raise
    finish()


@pytest.mark.parametrize("models", [4, 2])
def test_sharded_sweep_trains_each_model_as_if_alone(tmp_path: Path, models: int) -> None:
    """Two ranks, each a BatchModule of its share; with 2 models, a share of one model
    (whose per-model values are (1,): gathered as one model's, not as a shared value)."""
    out = str(tmp_path / "sweep.pt")
    mp.spawn(sweep_worker, args=(2, str(tmp_path / "init"), out, models), nprocs=2, join=True)
    states = torch.load(out, weights_only=True)
    losses = torch.load(out + ".losses", weights_only=True)
    assert len(states) == len(losses) == models
    trees, labels = trees_and_labels()
    for i, lr in enumerate(LRS[:models]):
        alone = sweep_model(i)
        opt = torch.optim.SGD(alone.parameters(), lr=lr)
        for _ in range(STEPS):
            f = fold.Fold()
            (h,) = f.apply(alone, [[record_tree(f, t) for t in trees]])
            loss = alone.loss(h, labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
        torch.testing.assert_close(losses[i], loss.detach())
        for k, v in alone.state_dict().items():
            torch.testing.assert_close(
                states[i][k], v, msg=lambda s, k=k, i=i: f"model {i} {k}: {s}"
            )


def failing_worker(rank: int, world: int, init: str, out_dir: str) -> None:
    from datetime import timedelta

    from fold.train import Trainer

    start(rank, world, init, timeout=timedelta(seconds=20))
    outcome = "finished"
    try:
        m = model()
        ddp = DistributedDataParallel(fold.FoldModule(m))
        trainer = Trainer(
            m, torch.optim.SGD(m.parameters(), lr=0.1), lambda *a: None, progress=False
        )
        if rank == 0:
            trainer.save(Path(out_dir) / "ckpt.pt")
        trees, labels = trees_and_labels()
        f = fold.Fold()
        roots = [record_tree(f, t) for t in trees]
        if rank == 1:
            f.add("no_such_op", 1)  # this rank's apply fails
        (h,) = ddp(f, [roots])
        m.loss(h, labels).backward()  # rank 0 waits here for rank 1's gradients
        if rank == 0:
            trainer.save(Path(out_dir) / "ckpt.pt")
    except Exception as err:  # noqa: BLE001 - record what each rank saw
        outcome = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    (Path(out_dir) / f"rank{rank}.txt").write_text(outcome)
    os._exit(0)  # the group is broken: skip gloo's destructors


def test_a_failing_rank_makes_the_others_fail_instead_of_hanging(tmp_path: Path) -> None:
    import time

    start = time.perf_counter()
    mp.spawn(failing_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    assert time.perf_counter() - start < 60
    assert (
        (tmp_path / "rank1.txt")
        .read_text()
        .startswith("FoldError: apply: op 'no_such_op' is not a method")
    )
    rank0 = (tmp_path / "rank0.txt").read_text()
    assert rank0 != "finished" and "Error" in rank0, rank0
    # the checkpoint written before the failure is whole, and no temporary file is left
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert set(state["model"]) == set(model().state_dict())
    assert not list(tmp_path.glob(".ckpt.pt.*"))


@pytest.mark.parametrize(
    "args, match",
    [
        ((4, 2, 2), r"rank=2; expected an int in \[0, world=2\)"),
        ((4, -1, 2), r"rank=-1"),
        ((4, 0, 0), r"world=0; expected a positive int"),
        ((0, 0, 1), r"n_models=0"),
        ((3, 0, 4), r"3 models cannot be shared by 4 ranks"),
    ],
)
def test_shard_checks_its_arguments(args, match) -> None:
    from fold.distributed import shard

    with pytest.raises(fold.FoldError, match=match):
        shard(*args)
    assert shard(5, 1, 2) == slice(2, 5)
