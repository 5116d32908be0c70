"""An arc-standard transition parser written for ONE sentence, trained and run by autobatch.

    python examples/autobatch_parser.py                   # the bundled CoNLL-U treebank
    python examples/autobatch_parser.py --data DIR        # train.conllu / dev.conllu there

A BiLSTM reads the sentence's words (``nn.LSTM`` on one unbatched sequence); an MLP scores
the three transitions (SHIFT, LEFT-ARC, RIGHT-ARC) from the top two words of the stack and
the first of the buffer.  Training follows the oracle's transitions (``loss(words,
heads)``: no value is read, so a batch of sentences is one round).  Parsing follows the
parser's own predictions (``parse(words)``: ``int(scores.argmax())`` is a read: under
``fold.autobatch`` each sentence pauses there, and one batched round per step serves every
sentence still parsing, however far along its own stack and buffer are).  The script
prints the unlabelled attachment score (UAS) on the dev set and the parsing speed against
the same code run eagerly sentence by sentence.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import conllu
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import fold

SHIFT, LEFT, RIGHT = 0, 1, 2
DATA = Path(__file__).resolve().parents[1] / "fold" / "data"


def read(path: Path) -> list[tuple[list[str], list[int]]]:
    """(words, heads) per sentence, heads 1-based with 0 the root (the CoNLL-U columns)."""
    out = []
    for sentence in conllu.parse(path.read_text()):
        tokens = [t for t in sentence if isinstance(t["id"], int)]
        out.append(([t["form"] for t in tokens], [t["head"] for t in tokens]))
    return out


def oracle(heads: list[int]) -> list[int] | None:
    """The arc-standard transitions that build ``heads`` (None where the tree is not
    projective)."""
    n = len(heads)
    deps = [0] * (n + 1)
    for h in heads:
        deps[h] += 1
    stack, buffer, actions, attached = [0], list(range(1, n + 1)), [], [0] * (n + 1)
    while buffer or len(stack) > 1:
        if len(stack) > 1:
            s0, s1 = stack[-1], stack[-2]
            if s1 and heads[s1 - 1] == s0:
                actions.append(LEFT)
                attached[s0] += 1
                stack.pop(-2)
                continue
            if heads[s0 - 1] == s1 and attached[s0] == deps[s0]:
                actions.append(RIGHT)
                attached[s1] += 1
                stack.pop()
                continue
        if not buffer:
            return None
        actions.append(SHIFT)
        stack.append(buffer.pop(0))
    return actions


def legal(stack: list[int], buffer: list[int]) -> list[bool]:
    return [bool(buffer), len(stack) > 2, len(stack) > 1 and (len(stack) > 2 or not buffer)]


class Parser(nn.Module):
    def __init__(self, vocab: int, dim: int = 32, hidden: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, hidden, bidirectional=True)
        self.root = nn.Parameter(torch.zeros(1, 2 * hidden))
        self.mlp = nn.Sequential(nn.Linear(6 * hidden, 64), nn.Tanh(), nn.Linear(64, 3))

    def encode(self, words: torch.Tensor) -> torch.Tensor:
        """(n,) word ids -> (n + 1, 2 * hidden): the root, then each word in context."""
        states, _ = self.lstm(self.embed(words))  # one unbatched sequence
        return torch.cat([self.root, states])

    def scores(self, enc: torch.Tensor, stack: list[int], buffer: list[int]) -> torch.Tensor:
        pad = enc[0] * 0
        feats = [
            enc[stack[-1]] if stack else pad,
            enc[stack[-2]] if len(stack) > 1 else pad,
            enc[buffer[0]] if buffer else pad,
        ]
        return self.mlp(torch.cat(feats))

    def loss(self, words: torch.Tensor, actions: list[int]) -> torch.Tensor:
        """The mean cross-entropy of the oracle's transitions over one sentence."""
        enc = self.encode(words)
        stack, buffer, losses = [0], list(range(1, len(words) + 1)), []
        for a in actions:
            losses.append(F.cross_entropy(self.scores(enc, stack, buffer), torch.tensor(a)))
            apply(a, stack, buffer, None)
        return torch.stack(losses).mean()

    def parse(self, words: torch.Tensor) -> torch.Tensor:
        """The heads the parser's own transitions give one sentence."""
        enc = self.encode(words)
        heads = [0] * len(words)
        stack, buffer = [0], list(range(1, len(words) + 1))
        while buffer or len(stack) > 1:
            ok = legal(stack, buffer)
            masked = self.scores(enc, stack, buffer) + torch.tensor(
                [0.0 if o else float("-inf") for o in ok]
            )
            a = int(masked.argmax())  # a read: this sentence pauses here under autobatch
            apply(a, stack, buffer, heads)
        return torch.tensor(heads)


def apply(a: int, stack: list[int], buffer: list[int], heads: list[int] | None) -> None:
    if a == SHIFT:
        stack.append(buffer.pop(0))
    elif a == LEFT:
        dep = stack.pop(-2)
        if heads is not None:
            heads[dep - 1] = stack[-1]
    else:
        dep = stack.pop()
        if heads is not None:
            heads[dep - 1] = stack[-1]


def uas(model: Parser, data: list, batched: bool) -> tuple[float, float]:
    """(unlabelled attachment score, seconds) on ``data`` = [(word ids, gold heads)]."""
    words = [w for w, _ in data]
    t0 = time.perf_counter()
    with torch.no_grad():
        if batched:
            got = fold.autobatch(lambda w: model.parse(w), words, stack=False)
        else:
            got = [model.parse(w) for w in words]
    seconds = time.perf_counter() - t0
    right = sum(int((g == torch.tensor(h)).sum()) for g, (_, h) in zip(got, data))
    return right / sum(len(h) for _, h in data), seconds


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--data", type=Path, default=DATA, help="train.conllu and dev.conllu")
    ap.add_argument("--train-size", type=int, default=2000)
    ap.add_argument("--dev-size", type=int, default=300)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    train_raw = read(args.data / "train.conllu")[: args.train_size]
    dev_raw = read(args.data / "dev.conllu")[: args.dev_size]
    vocab = {w: i + 1 for i, w in enumerate(sorted({w for s, _ in train_raw for w in s}))}

    def ids(words: list[str]) -> torch.Tensor:
        return torch.tensor([vocab.get(w, 0) for w in words])

    train = [(ids(w), o) for w, h in train_raw if (o := oracle(h)) is not None]
    dev = [(ids(w), h) for w, h in dev_raw]
    print(f"{len(train)} projective training sentences, {len(dev)} dev sentences")
    model = Parser(len(vocab) + 1)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    score, _ = uas(model, dev, batched=True)
    print(f"dev UAS before training: {100 * score:.1f}%")
    rng = random.Random(args.seed)
    for epoch in range(args.epochs):
        rng.shuffle(train)
        batches = [train[i : i + args.batch] for i in range(0, len(train), args.batch)]
        total = 0.0
        for batch in tqdm(batches, desc=f"epoch {epoch + 1}", leave=False):
            words, actions = zip(*batch)
            loss = fold.autobatch(lambda w, a: model.loss(w, a), words, actions).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(batch)
        score, _ = uas(model, dev, batched=True)
        print(f"epoch {epoch + 1}: train loss {total / len(train):.3f}, dev UAS {100 * score:.1f}%")
    score_b, t_b = uas(model, dev, batched=True)
    score_e, t_e = uas(model, dev, batched=False)
    assert score_b == score_e, (score_b, score_e)  # the same transitions either way
    print(
        f"parsing {len(dev)} sentences with the parser's own transitions (1 thread): eager "
        f"{len(dev) / t_e:.0f} sentences/s, autobatch {len(dev) / t_b:.0f} sentences/s "
        f"({t_e / t_b:.1f}x)"
    )


if __name__ == "__main__":
    main()
