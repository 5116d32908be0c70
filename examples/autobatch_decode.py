"""A seq2seq model written for ONE example, trained and greedy-decoded by fold.autobatch.

    python examples/autobatch_decode.py                   # reverse digit strings, a few minutes
    python examples/autobatch_decode.py --epochs 2 --train-size 500

The task: reverse a string of 3-8 digits.  The model is a GRU encoder and an attention GRU
decoder, and its code is the per-example code one writes first: ``loss(src, tgt)`` with
teacher forcing for training, ``greedy(src)`` for decoding, which feeds back its own
prediction and stops at EOS (``tok = int(logits.argmax())`` is a read: under
``fold.autobatch`` the example pauses there, and one batched round per decoding step serves
every example still decoding).  The script trains with batches of ``--batch`` examples, then
decodes the test set batched, prints the exact-match accuracy, and times decoding against
the same code run eagerly example by example.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import fold

BOS, EOS, DIGIT0 = 1, 2, 3  # token 0 unused; digits are tokens 3..12
VOCAB, MAX_LEN = 13, 12


class Seq2Seq(nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.encoder = nn.GRU(hidden, hidden)
        self.cell = nn.GRUCell(2 * hidden, hidden)
        self.attn = nn.Linear(hidden, hidden)
        self.out = nn.Linear(2 * hidden, VOCAB)

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        memory, h = self.encoder(self.embed(src))  # one unbatched sequence: (L, H), (1, H)
        return memory, h[0]

    def step(
        self, tok: torch.Tensor, h: torch.Tensor, ctx: torch.Tensor, memory: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.cell(torch.cat([self.embed(tok), ctx]), h)
        ctx = torch.softmax(memory @ self.attn(h), 0) @ memory
        return self.out(torch.cat([h, ctx])), h, ctx

    def loss(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        """Teacher forcing over one example: the mean cross-entropy of its target tokens."""
        memory, h = self.encode(src)
        ctx, prev, losses = memory.mean(0), torch.tensor(BOS), []
        for gold in tgt:
            logits, h, ctx = self.step(prev, h, ctx, memory)
            losses.append(F.cross_entropy(logits, gold))
            prev = gold
        return torch.stack(losses).mean()

    def greedy(self, src: torch.Tensor) -> torch.Tensor:
        """One example decoded until EOS (or MAX_LEN tokens)."""
        memory, h = self.encode(src)
        ctx, tok, out = memory.mean(0), BOS, []
        for _ in range(MAX_LEN):
            logits, h, ctx = self.step(torch.tensor(tok), h, ctx, memory)
            tok = int(logits.argmax())  # a read: this example pauses here under autobatch
            if tok == EOS:
                break
            out.append(tok)
        return torch.tensor(out, dtype=torch.long)


def make_data(n: int, rng: random.Random) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = []
    for _ in range(n):
        digits = [rng.randrange(10) for _ in range(rng.randint(3, 8))]
        src = torch.tensor([DIGIT0 + d for d in digits])
        tgt = torch.tensor([DIGIT0 + d for d in reversed(digits)] + [EOS])
        data.append((src, tgt))
    return data


def exact_match(model: Seq2Seq, data: list, batched: bool) -> tuple[float, float]:
    """(accuracy, seconds) of greedy decoding, batched by autobatch or example by example."""
    srcs = [s for s, _ in data]
    t0 = time.perf_counter()
    with torch.no_grad():
        if batched:
            outs = fold.autobatch(lambda s: model.greedy(s), srcs, stack=False)
        else:
            outs = [model.greedy(s) for s in srcs]
    seconds = time.perf_counter() - t0
    hits = sum(o.tolist() == t[:-1].tolist() for o, (_, t) in zip(outs, data))
    return hits / len(data), seconds


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--train-size", type=int, default=3000)
    ap.add_argument("--test-size", type=int, default=200)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    train, test = make_data(args.train_size, rng), make_data(args.test_size, rng)
    model = Seq2Seq(args.hidden)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    acc, _ = exact_match(model, test, batched=True)
    print(f"exact match before training: {100 * acc:.1f}%")
    for epoch in range(args.epochs):
        rng.shuffle(train)
        batches = [train[i : i + args.batch] for i in range(0, len(train), args.batch)]
        total = 0.0
        for batch in tqdm(batches, desc=f"epoch {epoch + 1}", leave=False):
            srcs, tgts = zip(*batch)
            loss = fold.autobatch(lambda s, t: model.loss(s, t), srcs, tgts).mean()
            opt.zero_grad()
            loss.backward()
            # (without clipping, the GRU's gradients spike in the later epochs and the
            # exact match drops from one epoch to the next)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            total += float(loss.detach()) * len(batch)
        acc, _ = exact_match(model, test, batched=True)
        print(
            f"epoch {epoch + 1}: train loss {total / len(train):.3f}, "
            f"test exact match {100 * acc:.1f}%"
        )
    acc_b, t_b = exact_match(model, test, batched=True)
    acc_e, t_e = exact_match(model, test, batched=False)
    assert acc_b == acc_e, (acc_b, acc_e)  # the same decisions either way
    print(
        f"greedy decoding of {len(test)} examples (1 thread): eager {len(test) / t_e:.0f} "
        f"examples/s, autobatch {len(test) / t_b:.0f} examples/s ({t_e / t_b:.1f}x)"
    )


if __name__ == "__main__":
    main()
