"""fold.autobatch against explicit fold, eager per example and plain batched code.

    python benchmarks/autobatch.py                   # TreeLSTM h150 and h32, MNIST, recording
    python benchmarks/autobatch.py --hidden 32 --reps 11 --save

- TreeLSTM, 256 random binary trees, forward+backward: the per-example code of
  ``examples/autobatch_tree_lstm.py`` run by ``fold.autobatch``, with ``@fold.batchable``
  cells, with no annotation at all (every torch op and module call a node), and with the
  cells written as modules of one's own (each call a node), against the explicit fold of
  ``benchmarks/tree_lstm.py`` (recording included) and eager per example.
- Per-sample MNIST MLP training step written as a plain per-example loss, autobatch against
  the plain batched step (the rows of a tensor: recorded once), the same with
  ``per_example=True``; and the floor of any engine that runs the per-example code once
  per example: the batched step plus that code's own Python with every torch call a
  stand-in that returns at once.
- Per-sample MNIST as a Dataset yields it (a list of per-sample tensors):
  ``fold.autobatch(lambda x: model(x)[0], samples)`` then the loss, against the step on
  DataLoader-collated batches.
- A BiLSTM encoder written per sentence (the parser's of examples/autobatch_parser.py) over
  64 sentences of the bundled treebank, forward+backward and forward alone, against the
  sentences padded and packed by hand (one BiLSTM call).
- A per-image CNN training step with ``BatchNorm2d`` in training mode (each image its own
  statistics; ``--only cnn-bn``), against eager per image.
- A self-attention block written per sentence (``nn.MultiheadAttention``, a residual
  ``LayerNorm``, a feed-forward ``nn.Sequential``; ``--only attention``) over the same
  sentences, against the sentences padded by hand (one call, a key padding mask).
- Where the TreeLSTM time goes: recording, apply, backward, against explicit fold.
- Recording cost per lazy op, at growing graph sizes (it must stay linear), and for chains
  of views.

Every variant is checked against eager per example (values and gradients, float64) first.
Runs are interleaved, one process, medians; ratios are of medians.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved, median, parser, setup, table, write_json  # noqa: E402
from tree_lstm import fold_forward, make_trees  # noqa: E402

import fold  # noqa: E402
from fold.models import TreeLSTM, record_tree  # noqa: E402
from fold.treebank import Tree  # noqa: E402


class Cells(nn.Module):
    """The TreeLSTM of fold.models written for ONE example (no batch dim), on its weights."""

    def __init__(self, model: TreeLSTM) -> None:
        super().__init__()
        self.m = model

    def leaf(self, word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i, o, u = self.m.leaf_gates(self.m.embed(word)).chunk(3)
        c = torch.sigmoid(i) * torch.tanh(u)
        return torch.sigmoid(o) * torch.tanh(c), c

    def node(self, lh, lc, rh, rc):  # type: ignore[no-untyped-def]
        i, o, u, fl, fr = self.m.node_gates(torch.cat([lh, rh])).chunk(5)
        c = torch.sigmoid(i) * torch.tanh(u) + torch.sigmoid(fl) * lc + torch.sigmoid(fr) * rc
        return torch.sigmoid(o) * torch.tanh(c), c


class BatchableCells(Cells):
    leaf = fold.batchable(Cells.leaf)
    node = fold.batchable(Cells.node)


class _Step(nn.Module):
    """One of ``Cells``' methods as a module of one's own (its forward)."""

    def __init__(self, model: TreeLSTM, name: str) -> None:
        super().__init__()
        self.m, self.name = model, name

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(Cells, self.name)(self, *args)  # type: ignore[arg-type]


class ModuleCells(nn.Module):
    """The same cells written as modules of one's own (``nn.Module`` subclasses with a
    forward), as PyTorch code usually writes a cell: each call one node, recorded whole."""

    def __init__(self, model: TreeLSTM) -> None:
        super().__init__()
        self.leaf, self.node = _Step(model, "leaf"), _Step(model, "node")


def encode(cells: Cells, tree: Tree) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain recursive eager code over one tree."""
    if tree.left is None:
        return cells.leaf(torch.tensor(tree.word))
    (lh, lc), (rh, rc) = encode(cells, tree.left), encode(cells, tree.right)
    return cells.node(lh, lc, rh, rc)


def autobatch_roots(cells: Cells, trees: list[Tree]) -> torch.Tensor:
    return fold.autobatch(lambda t: encode(cells, t)[0], trees)


def eager_roots(cells: Cells, trees: list[Tree]) -> torch.Tensor:
    return torch.stack([encode(cells, t)[0] for t in trees])


def check(model: TreeLSTM, trees: list[Tree], variants: dict) -> None:
    """Every variant equals eager per example in float64, values and gradients."""
    model = model.double()
    params = [p for n, p in model.named_parameters() if not n.startswith("out.")]
    ref = eager_roots(Cells(model), trees)
    ref_g = torch.autograd.grad(ref.square().sum(), params)
    for name, fn in variants.items():
        out = fn(model, trees)
        torch.testing.assert_close(out, ref, msg=f"{name}: values")
        g = torch.autograd.grad(out.square().sum(), params)
        for a, b in zip(g, ref_g):
            torch.testing.assert_close(a, b, msg=f"{name}: gradients")
    model.float()


def tree_variants(model: TreeLSTM) -> dict:
    """The variants timed, on ``model``'s weights.  The per-example cells are built once, as
    a user builds a model once: autobatch keys its ops by the modules they call, so cells
    built afresh per step would be new ops each step (shapes inferred again)."""
    cells, plain, modules = BatchableCells(model), Cells(model), ModuleCells(model)
    return {
        "autobatch": lambda m, t: autobatch_roots(cells, t),
        "autobatch, no annotation": lambda m, t: autobatch_roots(plain, t),
        "autobatch, module cells": lambda m, t: autobatch_roots(modules, t),
        "explicit fold": fold_forward,
    }


def tree_rows(args) -> list[dict]:  # type: ignore[no-untyped-def]
    trees = make_trees(args.trees, 5, 35, args.vocab)
    rows = []
    for hidden in args.hidden:
        torch.manual_seed(0)
        model = TreeLSTM(args.vocab, hidden)
        variants = tree_variants(model)
        check(model, trees[:16], variants)

        def step(fn, model=model):  # type: ignore[no-untyped-def]
            def run() -> None:
                model.zero_grad(set_to_none=True)
                fn(model, trees).sum().backward()

            return run

        times = interleaved({k: step(v) for k, v in variants.items()}, args.reps)
        if args.eager_reps:  # (0: no eager runs, as benchmarks/ab.py asks)
            eager = {"eager": step(lambda m, t: eager_roots(Cells(m), t))}
            times.update(interleaved(eager, args.eager_reps, warmup=0))
        med = {k: median(v) for k, v in times.items()}
        for name, t in med.items():
            row = {"hidden": hidden, "method": name, "median_ms": 1e3 * t}
            row["vs_fold"] = t / med["explicit fold"]
            if "eager" in med:
                row["eager_speedup"] = med["eager"] / t
            rows.append(row | {"reps": len(times[name])})
    return rows


def phase_rows(args) -> list[dict]:  # type: ignore[no-untyped-def]
    """Where the time goes: recording, apply and backward, autobatch against explicit fold
    (medians of --reps runs), and the user's own tree walk with torch.tensor per leaf."""
    from fold.autobatch.driver import _stack, record_examples

    trees = make_trees(args.trees, 5, 35, args.vocab)
    rows = []
    for hidden in args.hidden:
        torch.manual_seed(0)
        model = TreeLSTM(args.vocab, hidden)
        cells = BatchableCells(model)
        t: dict[str, list[float]] = {k: [] for k in ("record", "apply", "backward")}
        e: dict[str, list[float]] = {k: [] for k in ("record", "apply", "backward")}
        walk: list[float] = []

        def plain(tree: Tree) -> torch.Tensor:
            if tree.left is None:
                return torch.tensor(tree.word)
            plain(tree.left)
            return plain(tree.right)

        for _ in range(args.reps):
            t0 = time.perf_counter()
            rec, results, _ = record_examples(lambda tr, c=cells: encode(c, tr)[0], trees)
            t1 = time.perf_counter()
            (out,) = _stack(rec, results)
            t2 = time.perf_counter()
            out.sum().backward()
            t3 = time.perf_counter()
            f = fold.Fold()
            roots = [record_tree(f, tr) for tr in trees]
            t4 = time.perf_counter()
            (ref,) = f.apply(model, [roots])
            t5 = time.perf_counter()
            ref.sum().backward()
            t6 = time.perf_counter()
            for tr in trees:
                plain(tr)
            t7 = time.perf_counter()
            for d, a, b, c in ((t, t1 - t0, t2 - t1, t3 - t2), (e, t4 - t3, t5 - t4, t6 - t5)):
                d["record"].append(a)
                d["apply"].append(b)
                d["backward"].append(c)
            walk.append(t7 - t6)
        for name, d in (("autobatch", t), ("explicit fold", e)):
            rows.append(
                {"hidden": hidden, "method": name}
                | {f"{k}_ms": 1e3 * median(v) for k, v in d.items()}
            )
        rows.append(
            {
                "hidden": hidden,
                "method": "tree walk + torch.tensor",
                "record_ms": 1e3 * median(walk),
            }
        )
    return rows


class _StandIn:
    """A value every torch function maps to itself at once: no computation, no recording."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return _STAND_IN


_STAND_IN = _StandIn()


def _stand_in_model(x: torch.Tensor) -> _StandIn:
    return _STAND_IN


def _step(model: nn.Module, loss):  # type: ignore[no-untyped-def]
    """A training step of ``model``: its gradients zeroed, ``loss()`` backpropagated."""

    def run() -> None:
        model.zero_grad(set_to_none=True)
        loss().backward()

    return run


def mnist_rows(args) -> list[dict]:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    x = torch.randn(args.mnist_batch, 784)
    y = torch.randint(0, 10, (args.mnist_batch,))

    def loss_of(net):  # type: ignore[no-untyped-def]
        def per_example(img: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(net(img), label)

        return per_example

    per_example = loss_of(model)

    def autobatched() -> torch.Tensor:
        return fold.autobatch(per_example, x, y).mean()

    def autobatched_per_example() -> torch.Tensor:
        return fold.autobatch(per_example, x, y, per_example=True).mean()

    def batched() -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    def eager() -> torch.Tensor:
        return torch.stack([per_example(a, b) for a, b in zip(x, y)]).mean()

    params = list(model.parameters())
    ref = torch.autograd.grad(eager(), params)
    for name, fn in (
        ("autobatch", autobatched),
        ("per example", autobatched_per_example),
        ("batched", batched),
    ):
        for a, b in zip(torch.autograd.grad(fn(), params), ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)

    # The floor of running the per-example code once per example: the same Python per
    # example (the loop over the rows, the call, the model call, F.cross_entropy's own Python
    # and its __torch_function__ dispatch, flattening the result) with every torch call a
    # stand-in that returns at once.  autobatch with per_example=True pays it on top of the
    # batched work; plain autobatch records tensor rows once and does not.
    stand_in = loss_of(_stand_in_model)

    def python_only() -> None:
        for a, b in zip(x, y):
            pytree.tree_flatten(stand_in(a, b))

    times = interleaved(
        {
            "autobatch": _step(model, autobatched),
            "autobatch, per_example=True": _step(model, autobatched_per_example),
            "plain batched": _step(model, batched),
            "eager": _step(model, eager),
            "per-example Python only": python_only,
        },
        args.reps * 4,
    )
    med = {k: median(v) for k, v in times.items()}
    med["floor: batched + per-example Python"] = (
        med["plain batched"] + med["per-example Python only"]
    )
    times["floor: batched + per-example Python"] = times["plain batched"]
    return [
        {
            "method": k,
            "median_ms": 1e3 * t,
            "vs_batched": t / med["plain batched"],
            "reps": len(times[k]),
        }
        for k, t in med.items()
    ]


def mnist_list_rows(args) -> list[dict]:  # type: ignore[no-untyped-def]
    """Per-sample MNIST as a Dataset yields it: a Python list of per-sample tensors (1, 784),
    ``fold.autobatch(lambda x: model(x)[0], samples)`` then the loss, against the step on
    DataLoader-collated batches (``default_collate``, then one batched forward)."""
    from torch.utils.data import default_collate

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    samples = [torch.randn(1, 784) for _ in range(args.mnist_batch)]
    labels = torch.randint(0, 10, (args.mnist_batch,))

    def autobatched() -> torch.Tensor:
        return F.cross_entropy(fold.autobatch(lambda x: model(x)[0], samples), labels)

    def collated() -> torch.Tensor:
        return F.cross_entropy(model(default_collate(samples))[:, 0], labels)

    def eager() -> torch.Tensor:
        return F.cross_entropy(torch.stack([model(x)[0] for x in samples]), labels)

    # The same step from (image, label) pairs, as a Dataset of labelled samples yields them,
    # the loss written for one pair (a batch of one).
    pairs = list(zip(samples, labels))

    def pair_loss(pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = pair
        return F.cross_entropy(model(x), y[None])

    def autobatched_pairs() -> torch.Tensor:
        return fold.autobatch(pair_loss, pairs).mean()

    # The same pairs as torchvision's datasets yield them: the label a Python int, the loss
    # written for one sample with torch.tensor([y]).
    int_pairs = [(x, int(y)) for x, y in pairs]

    def int_pair_loss(pair: tuple[torch.Tensor, int]) -> torch.Tensor:
        x, y = pair
        return F.cross_entropy(model(x), torch.tensor([y]))

    def autobatched_int_pairs() -> torch.Tensor:
        return fold.autobatch(int_pair_loss, int_pairs).mean()

    params = list(model.parameters())
    ref = torch.autograd.grad(eager(), params)
    for name, fn in (
        ("autobatch", autobatched),
        ("collated", collated),
        ("pairs", autobatched_pairs),
        ("int pairs", autobatched_int_pairs),
    ):
        for a, b in zip(torch.autograd.grad(fn(), params), ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)

    times = interleaved(
        {
            "autobatch, list of samples": _step(model, autobatched),
            "autobatch, (x, y) pairs": _step(model, autobatched_pairs),
            "autobatch, (x, int y) pairs": _step(model, autobatched_int_pairs),
            "DataLoader-collated batch": _step(model, collated),
            "eager per sample": _step(model, eager),
        },
        args.reps * 4,
    )
    med = {k: median(v) for k, v in times.items()}
    base = med["DataLoader-collated batch"]
    return [
        {"method": k, "median_ms": 1e3 * t, "vs_collated": t / base, "reps": len(times[k])}
        for k, t in med.items()
    ]


def recording_rows(args) -> list[dict]:  # type: ignore[no-untyped-def]
    """Recording alone (no apply): us per lazy op for per-example chains of growing length,
    the same total number of ops each time; then chains of views (``y.view(4, 4)``, a
    slice, ``reshape``, then ``* 0.5``), whose outputs autobatch logs for in-place changes
    (``_Recorder.views``)."""
    from fold.autobatch import record_examples

    lin = nn.Linear(16, 16)

    def chain(x: torch.Tensor, ops: int) -> torch.Tensor:
        y = lin(x)
        for _ in range(ops):
            y = torch.tanh(y) * 0.5
        return y

    def views(x: torch.Tensor, ops: int) -> torch.Tensor:
        y = lin(x)
        for _ in range(ops):
            y = y.view(4, 4)[0:4].reshape(16) * 0.5
        return y

    # Dims given by position and by keyword, as people write both: the same calls.
    def positional(x: torch.Tensor, ops: int) -> torch.Tensor:
        y = lin(x)
        for _ in range(ops):
            y = y.softmax(0) * y.sum(0, True) + F.softmax(y, 0)
        return y

    def keywords(x: torch.Tensor, ops: int) -> torch.Tensor:
        y = lin(x)
        for _ in range(ops):
            y = y.softmax(dim=0) * y.sum(dim=0, keepdim=True) + F.softmax(y, dim=0)
        return y

    rows = []
    for fn, per, name in (
        (chain, 2, "tanh, * 0.5"),
        (views, 4, "3 views, * 0.5"),
        (positional, 5, "dims by position: softmax, sum, F.softmax, *, +"),
        (keywords, 5, "dims by keyword: the same"),
    ):
        for ops in (10, 100, 1000, 10000) if fn is chain else (10, 1000):
            examples = [torch.randn(16) for _ in range(max(1, 20000 // ops))]
            n_ops = (per * ops + 1) * len(examples)
            times = interleaved(
                {
                    "record": lambda fn=fn, ops=ops, ex=examples: record_examples(
                        lambda x: fn(x, ops), ex
                    )
                },
                args.reps,
            )
            rows.append(
                {
                    "chain": name,
                    "ops per example": per * ops + 1,
                    "examples": len(examples),
                    "lazy ops": n_ops,
                    "us/op": 1e6 * median(times["record"]) / n_ops,
                }
            )
    return rows


def encoder_rows(args) -> list[dict]:  # type: ignore[no-untyped-def]
    """A tagger's or parser's encoder written for ONE sentence (``Parser.encode`` of
    examples/autobatch_parser.py: an embedding and a BiLSTM over the sentence, a root row
    before it) over ``--sentences`` sentences of the bundled treebank: ``fold.autobatch``
    (``stack=False``: each sentence's states, its own length) against the hand-batched
    encoder (the sentences padded and packed, one BiLSTM call, unpacked), forward and
    backward of the sum of every state, and the forward alone under ``torch.no_grad()``;
    eager per sentence too.  Values and gradients are checked against eager first."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from autobatch_parser import Parser
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence, pad_sequence

    words, vocab_size = _treebank_words(args.sentences)

    def hand(model: Parser) -> torch.Tensor:
        lengths = torch.tensor([len(w) for w in words])
        packed = pack_padded_sequence(
            model.embed(pad_sequence(words)), lengths, enforce_sorted=False
        )
        states = pad_packed_sequence(model.lstm(packed)[0])[0]  # zeros past each length
        return states.sum() + model.root.sum() * len(words)

    def auto(model: Parser) -> torch.Tensor:
        encoded = fold.autobatch(lambda w: model.encode(w), words, stack=False)
        return torch.stack([e.sum() for e in encoded]).sum()

    def eager(model: Parser) -> torch.Tensor:
        return torch.stack([model.encode(w).sum() for w in words]).sum()

    def used(model: Parser) -> list[torch.Tensor]:  # (the MLP takes no part)
        return [*model.embed.parameters(), *model.lstm.parameters(), model.root]

    return _per_sentence_rows(
        args, lambda: Parser(vocab_size), auto, eager, ("hand, packed", hand), used
    )


class _SelfAttention(nn.Module):
    """A transformer block written for ONE sentence, as torch's modules take it: the words'
    embeddings as a batch of one, ``nn.MultiheadAttention`` over them (its weights asked
    for, the default), a residual ``LayerNorm`` and a feed-forward ``nn.Sequential``."""

    def __init__(self, vocab: int, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.mha = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))

    def encode(self, words: torch.Tensor) -> torch.Tensor:
        """ONE sentence (L,) -> its states (L, width)."""
        x = self.emb(words)[None]
        h, _ = self.mha(x, x, x)
        h = self.norm(x + h)
        return (h + self.ff(h))[0]

    def hand(self, words: list[torch.Tensor]) -> torch.Tensor:
        """Every sentence at once, padded, a key padding mask: the sum of every state."""
        from torch.nn.utils.rnn import pad_sequence

        lengths = torch.tensor([len(w) for w in words])
        x = self.emb(pad_sequence(words, batch_first=True))
        pad = torch.arange(x.shape[1])[None, :] >= lengths[:, None]
        h, _ = self.mha(x, x, x, key_padding_mask=pad)
        h = self.norm(x + h)
        out = h + self.ff(h)
        return (out * (~pad)[..., None]).sum()


def attention_rows(args) -> list[dict]:  # type: ignore[no-untyped-def]
    """The transformer block of ``_SelfAttention`` written for ONE sentence over
    ``--sentences`` sentences of the bundled treebank: ``fold.autobatch`` (``stack=False``)
    against the hand-batched block (the sentences padded, one call with a key padding mask)
    and eager per sentence, forward and backward of the sum of every state, and the forward
    alone under ``torch.no_grad()``.  Values and gradients are checked against eager first."""
    words, vocab_size = _treebank_words(args.sentences)

    def auto(model: _SelfAttention) -> torch.Tensor:
        states = fold.autobatch(lambda w: model.encode(w), words, stack=False)
        return torch.stack([s.sum() for s in states]).sum()

    def eager(model: _SelfAttention) -> torch.Tensor:
        return torch.stack([model.encode(w).sum() for w in words]).sum()

    def hand(model: _SelfAttention) -> torch.Tensor:
        return model.hand(words)

    return _per_sentence_rows(
        args,
        lambda: _SelfAttention(vocab_size),
        auto,
        eager,
        ("hand, padded", hand),
        lambda model: list(model.parameters()),
    )


def _treebank_words(n: int) -> tuple[list[torch.Tensor], int]:
    """The word ids of the first ``n`` sentences of the bundled dev treebank, and the size of
    their vocabulary (0 kept for padding)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from autobatch_parser import DATA, read

    raw = read(DATA / "dev.conllu")[:n]
    vocab = {w: i + 1 for i, w in enumerate(sorted({w for s, _ in raw for w in s}))}
    return [torch.tensor([vocab[w] for w in s]) for s, _ in raw], len(vocab) + 1


def _per_sentence_rows(args, make, auto, eager, hand, params) -> list[dict]:  # type: ignore[no-untyped-def]
    """A model written per sentence (``make()``), its three sums of every state over the
    sentences (``auto``, ``eager``, and ``hand``: ``(its name, its function)``) checked
    against eager first (the sum and the gradients of ``params(model)``, float64), then
    timed interleaved: forward and backward, and the forward alone under
    ``torch.no_grad()``; ratios to the hand-batched one."""
    hand_name, hand_fn = hand
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = make()
        got = []
        for f in (eager, auto, hand_fn):
            loss = f(model)
            got.append((loss.detach(), torch.autograd.grad(loss, params(model))))
        for loss, gs in got[1:]:
            torch.testing.assert_close(loss, got[0][0])
            for a, b in zip(gs, got[0][1]):
                torch.testing.assert_close(a, b)
    finally:
        torch.set_default_dtype(old)
    torch.manual_seed(0)
    model = make()
    rows = []
    for how in ("forward+backward", "forward, no_grad"):

        def wrap(f, how=how):  # type: ignore[no-untyped-def]
            def step() -> None:
                if how == "forward+backward":
                    model.zero_grad()
                    f(model).backward()
                else:
                    with torch.no_grad():
                        f(model)

            return step

        contenders = {"autobatch": wrap(auto), hand_name: wrap(hand_fn)}
        if args.eager_reps:
            contenders["eager per sentence"] = wrap(eager)
        times = interleaved(contenders, args.reps)
        base = median(times[hand_name])
        rows += [
            {
                "pass": how,
                "method": k,
                "median_ms": 1e3 * median(v),
                "vs_hand": median(v) / base,
                "reps": len(v),
            }
            for k, v in times.items()
        ]
    return rows


def cnn_bn_rows(args) -> list[dict]:  # type: ignore[no-untyped-def]
    """A per-image CNN training step with ``BatchNorm2d`` in training mode (each image a
    batch of one: the norm takes that image's statistics, as eager code gives them), over a
    list of ``--mnist-batch`` 28x28 images: ``fold.autobatch`` of the per-image loss against
    eager per image (no batched equivalent: a batched step would normalise over the batch).
    Losses, gradients and the running statistics are checked against eager first."""
    import torch.nn.functional as F

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(1, 8, 3),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(16 * 11 * 11, 10),
        )

    g = torch.Generator().manual_seed(0)
    images = [torch.randn(1, 1, 28, 28, generator=g) for _ in range(args.mnist_batch)]
    labels = [torch.randint(0, 10, (1,), generator=g) for _ in range(args.mnist_batch)]
    data = {torch.float32: images, torch.float64: [x.double() for x in images]}

    def step(model: nn.Module, auto: bool) -> torch.Tensor:
        images = data[torch.get_default_dtype()]

        def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(model(x), y)

        if auto:
            losses = fold.autobatch(loss, images, labels)
        else:
            losses = torch.stack([loss(x, y) for x, y in zip(images, labels)])
        total = losses.sum()
        total.backward()
        return total.detach()

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        eager_model, auto_model = make(), make()
        torch.testing.assert_close(step(auto_model, True), step(eager_model, False))
        for p, q in zip(auto_model.parameters(), eager_model.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        for p, q in zip(auto_model.buffers(), eager_model.buffers()):
            torch.testing.assert_close(p, q)
    finally:
        torch.set_default_dtype(old)
    model = make()
    times = interleaved(
        {
            "autobatch": lambda: step(model, True),
            "eager per image": lambda: step(model, False),
        },
        args.reps,
    )
    base = median(times["eager per image"])
    return [
        {"method": k, "median_ms": 1e3 * median(v), "vs_eager": median(v) / base, "reps": len(v)}
        for k, v in times.items()
    ]


def main() -> None:
    ap = parser(__doc__, device=False)
    ap.add_argument("--hidden", type=int, nargs="+", default=[150, 32])
    ap.add_argument("--trees", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=10_000)
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--eager-reps", type=int, default=3)
    ap.add_argument("--mnist-batch", type=int, default=32)
    ap.add_argument("--sentences", type=int, default=64, help="for the encoder")
    every = [
        "trees",
        "phases",
        "mnist",
        "mnist-list",
        "cnn-bn",
        "encoder",
        "attention",
        "recording",
    ]
    ap.add_argument("--only", choices=every, nargs="+")
    args = ap.parse_args()
    setup(args)
    out: dict = {"args": vars(args)}
    parts = args.only or every
    if "trees" in parts:
        out["trees"] = tree_rows(args)
        print(f"TreeLSTM, {args.trees} trees, forward+backward, {args.threads} thread(s)")
        print(
            table(
                out["trees"], ["hidden", "method", "median_ms", "vs_fold", "eager_speedup", "reps"]
            )
        )
    if "phases" in parts:
        out["phases"] = phase_rows(args)
        print("\nTreeLSTM phases (medians), autobatch with @fold.batchable cells")
        cols = ["hidden", "method", "record_ms", "apply_ms", "backward_ms"]
        print(table(out["phases"], cols))
    if "mnist" in parts:
        out["mnist"] = mnist_rows(args)
        print(f"\nPer-sample MNIST MLP, {args.mnist_batch} samples, one training step")
        print(table(out["mnist"], ["method", "median_ms", "vs_batched", "reps"]))
    if "mnist-list" in parts:
        out["mnist_list"] = mnist_list_rows(args)
        print(f"\nPer-sample MNIST from a list of {args.mnist_batch} samples, one training step")
        print(table(out["mnist_list"], ["method", "median_ms", "vs_collated", "reps"]))
    if "cnn-bn" in parts:
        out["cnn_bn"] = cnn_bn_rows(args)
        print(f"\nA per-image CNN with BatchNorm2d in training mode, {args.mnist_batch} images")
        print(table(out["cnn_bn"], ["method", "median_ms", "vs_eager", "reps"]))
    if "encoder" in parts:
        out["encoder"] = encoder_rows(args)
        print(f"\nA BiLSTM encoder written per sentence, {args.sentences} sentences")
        print(table(out["encoder"], ["pass", "method", "median_ms", "vs_hand", "reps"]))
    if "attention" in parts:
        out["attention"] = attention_rows(args)
        print(f"\nA self-attention block written per sentence, {args.sentences} sentences")
        print(table(out["attention"], ["pass", "method", "median_ms", "vs_hand", "reps"]))
    if "recording" in parts:
        out["recording"] = recording_rows(args)
        print("\nRecording alone, per example a Linear then a chain of tanh and * 0.5")
        cols = ["chain", "ops per example", "examples", "lazy ops", "us/op"]
        print(table(out["recording"], cols))
    print(f"wrote {write_json('autobatch', out)}")


if __name__ == "__main__":
    main()
