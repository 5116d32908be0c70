"""DistributedDataParallel over FoldModule on 2 CPU processes (gloo) against one process."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

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


def worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        trees, labels = trees_and_labels()
        share = slice(rank * len(trees) // world, (rank + 1) * len(trees) // world)
        ddp = DistributedDataParallel(fold.FoldModule(model()))
        train(ddp, ddp, trees[share], labels[share])
        if rank == 0:
            torch.save(ddp.module.model.state_dict(), out)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_on_two_ranks_equals_one_process_on_all_trees(tmp_path: Path) -> None:
    out = str(tmp_path / "rank0.pt")
    mp.spawn(worker, args=(2, free_port(), out), nprocs=2, join=True)
    trees, labels = trees_and_labels()
    single = model()
    train(single, lambda f, lists: f.apply(single, lists), trees, labels)
    got = torch.load(out, weights_only=True)
    for k, v in single.state_dict().items():
        torch.testing.assert_close(got[k], v, msg=lambda s, k=k: f"{k}: {s}")
    assert not torch.equal(got["node_gates.weight"], model().state_dict()["node_gates.weight"])
