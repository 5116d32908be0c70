"""Data-parallel TreeLSTM training: each rank records and runs its share of every batch.

    torchrun --nproc_per_node=2 examples/ddp_tree_lstm.py            # GPUs (NCCL), else CPU (gloo)
    torchrun --nproc_per_node=2 examples/ddp_tree_lstm.py --device cpu
    torchrun --nproc_per_node=2 examples/ddp_tree_lstm.py --epochs 4 --data path/to/sst
    python examples/ddp_tree_lstm.py                                  # one process, world of 1

``DistributedDataParallel(fold.FoldModule(model))`` runs ``graph.apply(model, lists)`` inside
DDP's forward, so gradients are averaged across ranks on backward as for any DDP model.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import fold
from fold.models import TreeLSTM, record_tree
from fold.treebank import Vocab, bundled_treebank, load_treebank


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--data")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=50, help="trees per step, over all ranks")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.003)
    ap.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: a GPU per rank with NCCL where every local rank has one, else CPU with gloo",
    )
    args = ap.parse_args()

    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cuda = args.device == "cuda" or (args.device == "auto" and gpus >= ranks_here)
    if args.device == "auto" and 0 < gpus < ranks_here and os.environ.get("LOCAL_RANK") == "0":
        print(f"{gpus} GPU(s) for {ranks_here} ranks on this machine: running on CPU with gloo")
    if "RANK" not in os.environ:  # not started by torchrun: run as a group of one process
        print("not started by torchrun: running as 1 process (launch several with")
        print("  torchrun --nproc_per_node=2 examples/ddp_tree_lstm.py)")
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    # A timeout: if one rank fails, the others stop with an error instead of waiting forever.
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    bank = load_treebank(args.data) if args.data else bundled_treebank()
    vocab = Vocab.from_trees(bank["train"])
    train = [vocab.numericalize(t) for t in bank["train"]]
    dev = [vocab.numericalize(t) for t in bank["dev"]]
    torch.manual_seed(0)  # the same initial weights on every rank
    model = TreeLSTM(len(vocab), args.hidden).to(device)
    ddp = DistributedDataParallel(fold.FoldModule(model))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    per_rank = args.batch // world
    for epoch in range(1, args.epochs + 1):
        random.Random(epoch).shuffle(train)  # the same order on every rank
        total = 0.0
        steps = len(train) // (per_rank * world)
        for s in range(steps):
            start = s * per_rank * world + rank * per_rank
            trees = train[start : start + per_rank]  # this rank's share of the batch
            f = fold.Fold()
            h, y = ddp(f, [[record_tree(f, t) for t in trees], [t.label for t in trees]])
            loss = F.cross_entropy(model.classify(h), y)
            opt.zero_grad()
            loss.backward()  # DDP averages the gradients of the ranks here
            opt.step()
            total += loss.item()
        with torch.no_grad():
            f = fold.Fold()
            (h,) = f.apply(model, [[record_tree(f, t) for t in dev]])
            acc = (
                (model.classify(h).argmax(1).cpu() == torch.tensor([t.label for t in dev]))
                .float()
                .mean()
            )
        if rank == 0:
            print(
                f"epoch {epoch}: mean loss {total / steps:.3f}, dev root accuracy {acc:.1%} ({world} ranks)"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
