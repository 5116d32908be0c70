"""Data-dependent control flow: greedy decoding until EOS, autobatch against hand batching.

    python benchmarks/control_flow.py                # 64 sources, hidden 128, 1 thread
    python benchmarks/control_flow.py --reps 7 --save
    python benchmarks/control_flow.py --only decode-long     # one workload (see --only)
    python benchmarks/control_flow.py --mode inference_mode  # under torch.inference_mode()

A GRU encoder and an attention decoder (hidden 128, vocab 8, EOS one of them) decode 64
sources of 5-30 tokens greedily, at most 40 steps, each until it emits EOS:

- autobatch: ``fold.autobatch(lambda s: model.greedy(s), sources, stack=False)``, the
  per-example code as written (``tok = int(logits.argmax())`` pauses the example; a round per
  decoding step);
- hand: careful hand-batched decoding: the sources padded and packed for the encoder, then
  every example decoded in one batch, step after step, under a mask, until all have emitted
  EOS (finished examples still cost compute);
- eager: the per-example code run example by example.

The untrained model's EOS bias makes most decodes stop after two steps and a quarter run to
the limit (lengths 2-40, median 2); ``decode-long`` leaves the bias out and stops each
example at EOS or after as many steps as its source has tokens (5-30, median 20), the
lengths of a model trained to copy or reverse its source; ``decode-limit`` leaves the bias
out and keeps the 40-step limit: the model as initialised, whose decodes mostly run to the
limit (what a harness of an untrained model meets).

And the arc-standard parser of examples/autobatch_parser.py parsing 64 sentences of the
bundled treebank with its own transitions: autobatch against a hand-batched stack machine
(per-sentence Python stacks, one batched scoring call per step), eager per sentence, and the
per-sentence code alone (eager with the scoring MLP stubbed: the Python and the small
per-sentence tensor ops that autobatch runs once per sentence as written, a floor).

``transformer`` (not run by default): greedy decoding with torch.nn's transformer written for
one source (``TinyTransformer``), autobatch against eager per example, for sources of 5-30
tokens and of one length; and its first call in a fresh process.

``step-module``: greedy decoding of 64 examples, 12 steps each, through a decoder step
written as a module of one's own holding a GRUCell (``StepModule``), autobatch against the
batch by hand and eager per example.

``first-call``: the first call of decode-long, of the parser, of the translation tutorial's
seq2seq (``tutorials.py``) and of the step module in a fresh process (what a user's script
meets: shape inference of every op not seen yet), autobatch against eager per example, each
in a process of its own.

autobatch runs as by default: once a round's groups hold fewer than ``EAGER_GROUP``
(``fold/autobatch/driver.py``) nodes on average, the examples still paused finish as eager
code (a padded call over memories of several lengths counts as one group, so the decoder's
rounds stay batched while most of its 64 examples decode).

Before timing, all three must decode the same tokens, or give the same heads (float64). Interleaved runs in one
process, medians, one thread. Also the per-round fixed cost: autobatch on a decoder whose
steps are trivial, against the number of rounds and of examples.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence, pad_sequence

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved, median, parser, setup, table, write_json  # noqa: E402

import fold  # noqa: E402

BOS, EOS, MAX_STEPS = 1, 0, 40


class Seq2Seq(nn.Module):
    """A GRU encoder and a dot-attention GRU decoder, written for one example (greedy) and
    for a padded batch (hand)."""

    def __init__(self, vocab: int = 8, hidden: int = 128, eos_bias: float = 0.3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.enc = nn.GRU(hidden, hidden)
        self.dec = nn.GRUCell(2 * hidden, hidden)
        self.attn = nn.Linear(hidden, hidden)
        self.out = nn.Linear(2 * hidden, vocab)
        with torch.no_grad():  # an untrained model: EOS after varied numbers of steps
            self.out.bias[EOS] += eos_bias

    def greedy(self, src: torch.Tensor, limit: int = MAX_STEPS) -> torch.Tensor:
        """ONE source (L,) -> its decoded tokens, up to and with EOS (at most ``limit``)."""
        mem, h = self.enc(self.embed(src))  # (L, H), (1, H)
        h, ctx = h[0], mem.mean(0)
        tok, toks = BOS, []
        for _ in range(limit):
            h = self.dec(torch.cat([self.embed(torch.tensor(tok)), ctx]), h)
            weights = torch.softmax(mem @ self.attn(h), 0)  # (L,)
            ctx = weights @ mem
            tok = int(self.out(torch.cat([h, ctx])).argmax())  # a read: the example pauses
            toks.append(tok)
            if tok == EOS:
                break
        return torch.tensor(toks)

    def hand(self, srcs: list[torch.Tensor], limits: list[int] | None = None) -> list[torch.Tensor]:
        """Every source at once: packed encoder, then a masked batch decoder run until every
        example has emitted EOS (or reached its limit)."""
        lengths = torch.tensor([len(s) for s in srcs])
        padded = pad_sequence(srcs)  # (Lmax, B)
        packed = pack_padded_sequence(self.embed(padded), lengths, enforce_sorted=False)
        mem, h = self.enc(packed)
        mem = pad_packed_sequence(mem)[0].transpose(0, 1)  # (B, Lmax, H)
        mask = torch.arange(mem.shape[1])[None, :] < lengths[:, None]
        h = h[0]
        ctx = mem.sum(1) / lengths[:, None].to(mem.dtype)
        tok = torch.full((len(srcs),), BOS)
        done = torch.zeros(len(srcs), dtype=torch.bool)
        limit = torch.tensor(limits if limits is not None else [MAX_STEPS] * len(srcs))
        steps = []
        for step in range(int(limit.max())):
            h = self.dec(torch.cat([self.embed(tok), ctx], 1), h)
            scores = (mem @ self.attn(h)[:, :, None]).squeeze(2).masked_fill(~mask, float("-inf"))
            ctx = (torch.softmax(scores, 1)[:, :, None] * mem).sum(1)
            tok = self.out(torch.cat([h, ctx], 1)).argmax(1)
            steps.append(tok)
            done = done | (tok == EOS) | (limit <= step + 1)
            if bool(done.all()):
                break
        out = torch.stack(steps, 1)  # (B, steps)
        ends = [(row == EOS).nonzero() for row in out]
        return [
            row[: min(int(e[0]) + 1, n) if len(e) else n]
            for row, e, n in zip(out, ends, limit.tolist())
        ]


def sources(n: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 31, (n,), generator=g)
    return [torch.randint(2, vocab, (int(k),), generator=g) for k in lengths]


# The mode every contender runs in (``--mode``): decoding and parsing are inference.
_MODE = {"mode": torch.no_grad}


def _no_grad(fn):  # type: ignore[no-untyped-def]
    """``fn`` run under torch.no_grad() (or torch.inference_mode(), with ``--mode``)."""

    def go() -> None:
        with _MODE["mode"]():
            fn()

    return go


def _against(times: dict[str, list[float]], base: str) -> list[dict]:
    """Per contender its median and its ratio to the median of ``base``."""
    med = {k: median(v) for k, v in times.items()}
    return [
        {"method": k, "median_ms": 1e3 * t, "vs_hand": t / med[base], "reps": len(times[k])}
        for k, t in med.items()
    ]


def decode_rows(args, long: bool = False, biased: bool = True) -> list[dict]:  # type: ignore[no-untyped-def]
    """Greedy decoding, autobatch against hand batching.  The untrained model's EOS bias
    makes most decodes stop after two steps and a quarter run to the 40-step limit; with
    ``long``, the bias is left out and each example stops at EOS or after as many steps as
    its source has tokens (5-30): the lengths a model trained to copy or reverse its source
    decodes.  Without ``biased``, the untrained model as initialised decodes until EOS or the
    40-step limit: most decodes run to the limit."""
    srcs = sources(args.sources, 8)
    limits = [len(s) for s in srcs] if long else [MAX_STEPS] * len(srcs)
    bias = 0.3 if biased and not long else 0.0
    # The same decisions from all three, in float64 (where a near tie cannot flip).
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = Seq2Seq(hidden=args.hidden, eos_bias=bias)
    with _MODE["mode"]():
        eager = [model.greedy(s, n) for s, n in zip(srcs, limits)]
        auto = fold.autobatch(lambda s, n: model.greedy(s, n), srcs, limits, stack=False)
        hand = model.hand(srcs, limits)
    for e, a, h in zip(eager, auto, hand):
        assert e.tolist() == a.tolist() == h.tolist(), (e, a, h)
    lengths = [len(e) for e in eager]
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)
    model = Seq2Seq(hidden=args.hidden, eos_bias=bias)

    def auto_run() -> None:
        fold.autobatch(lambda s, n: model.greedy(s, n), srcs, limits, stack=False)

    contenders = {
        "autobatch": _no_grad(auto_run),
        "hand, masked": _no_grad(lambda: model.hand(srcs, limits)),
    }
    if args.eager_reps:
        contenders["eager per example"] = _no_grad(
            lambda: [model.greedy(s, n) for s, n in zip(srcs, limits)]
        )
    rows = _against(interleaved(contenders, args.reps), "hand, masked")
    print(
        f"decoded lengths: min {min(lengths)}, median {sorted(lengths)[len(lengths) // 2]}, "
        f"max {max(lengths)} (sum {sum(lengths)})"
    )
    return rows


def parser_workload(n: int) -> tuple[Any, list[torch.Tensor], int]:
    """The parser of examples/autobatch_parser.py (its class), the word ids of the first
    ``n`` sentences of the bundled dev treebank, and the vocabulary's size."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from autobatch_parser import DATA, Parser, read

    raw = read(DATA / "dev.conllu")[:n]
    vocab = {w: i + 1 for i, w in enumerate(sorted({w for s, _ in raw for w in s}))}
    return Parser, [torch.tensor([vocab[w] for w in s]) for s, _ in raw], len(vocab) + 1


def hand_parse(model: Any, words: list[torch.Tensor]) -> list[list[int]]:
    """A hand-batched stack machine: the encoder run once on the packed sentences,
    per-sentence Python stacks, one batched scoring call per step."""
    from autobatch_parser import apply, legal

    lengths = torch.tensor([len(w) for w in words])
    packed = pack_padded_sequence(model.embed(pad_sequence(words)), lengths, enforce_sorted=False)
    states = pad_packed_sequence(model.lstm(packed)[0])[0].transpose(0, 1)  # (B, L, 2H)
    root = model.root.expand(len(words), 1, -1)
    enc = torch.cat([root, states], 1)  # (B, L + 1, 2H)
    pad = torch.zeros(enc.shape[2])
    stacks = [[0] for _ in words]
    buffers = [list(range(1, len(w) + 1)) for w in words]
    heads = [[0] * len(w) for w in words]
    active = list(range(len(words)))
    while active:
        rows = []
        for i in active:
            s, b = stacks[i], buffers[i]
            rows.append(
                torch.cat(
                    [
                        enc[i, s[-1]] if s else pad,
                        enc[i, s[-2]] if len(s) > 1 else pad,
                        enc[i, b[0]] if b else pad,
                    ]
                )
            )
        scores = model.mlp(torch.stack(rows))
        ok = torch.tensor([legal(stacks[i], buffers[i]) for i in active])
        actions = scores.masked_fill(~ok, float("-inf")).argmax(1).tolist()
        for i, a in zip(active, actions):
            apply(a, stacks[i], buffers[i], heads[i])
        active = [i for i in active if buffers[i] or len(stacks[i]) > 1]
    return heads


def parser_rows(args) -> list[dict]:  # type: ignore[no-untyped-def]
    """The arc-standard parser of examples/autobatch_parser.py (untrained) parsing
    ``--sentences`` sentences of the bundled treebank with its own transitions: autobatch of
    ``parse`` as written, against a hand-batched stack machine (``hand_parse``)."""
    Parser, words, vocab_size = parser_workload(args.sentences)

    def hand(model: Any) -> list[list[int]]:
        return hand_parse(model, words)

    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = Parser(vocab_size)
    with _MODE["mode"]():
        eager = [model.parse(w).tolist() for w in words]
        auto = [h.tolist() for h in fold.autobatch(lambda w: model.parse(w), words, stack=False)]
        assert eager == auto == hand(model)
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)
    model = Parser(vocab_size)

    def floor() -> None:
        """The per-sentence code alone: eager per sentence with the scoring MLP stubbed (a
        slice), so what is left is the Python of ``parse`` and its per-sentence tensor ops
        (rows of the encoder, the legal-action mask, argmax).  Batching cannot go below
        it, since autobatch runs that code once per sentence as written."""
        mlp = model.mlp
        model.mlp = _Stub()
        try:
            [model.parse(w) for w in words]
        finally:
            model.mlp = mlp

    contenders = {
        "autobatch": _no_grad(lambda: fold.autobatch(lambda w: model.parse(w), words, stack=False)),
        "hand, stack machine": _no_grad(lambda: hand(model)),
        "eager per sentence": _no_grad(lambda: [model.parse(w) for w in words]),
        "per-sentence code alone": _no_grad(floor),
    }
    return _against(interleaved(contenders, args.reps), "hand, stack machine")


class TinyTransformer(nn.Module):
    """torch.nn's transformer (2 encoder and 2 decoder layers, width 64, 4 heads, batch
    first, no dropout), greedy decoding written for ONE source as torch's modules take it:
    a batch of one, the decoder given the whole prefix and its causal mask at every step."""

    def __init__(self, vocab: int = 8, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(64, width) * 0.1)
        enc = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        dec = nn.TransformerDecoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(enc, 2, enable_nested_tensor=False)
        self.dec = nn.TransformerDecoder(dec, 2)
        self.out = nn.Linear(width, vocab)

    def greedy(self, src: torch.Tensor, limit: int = 20) -> torch.Tensor:
        mem = self.enc(self.embed(src)[None] + self.pos[: len(src)])  # (1, L, width)
        toks = [BOS]
        for _ in range(limit):
            tgt = self.embed(torch.tensor(toks))[None] + self.pos[: len(toks)]
            mask = nn.Transformer.generate_square_subsequent_mask(len(toks))
            h = self.dec(tgt, mem, tgt_mask=mask)
            tok = int(self.out(h[0, -1]).argmax())  # a read
            toks.append(tok)
            if tok == EOS:
                break
        return torch.tensor(toks[1:])


def transformer_rows(args) -> list[dict]:  # type: ignore[no-untyped-def]
    """Greedy decoding with torch.nn's transformer (``TinyTransformer``), 64 sources of 5-30
    tokens, and 64 of one length (12): autobatch against eager per example, warm
    (interleaved, medians), and for the first the first call in a fresh process.  vmap
    runs the decoder's groups with their causal masks given as one value (each example
    makes its own, alike); a group holds the examples whose memories have one length, so
    sources of many lengths make small groups."""

    g = torch.Generator().manual_seed(1)
    one_length = [torch.randint(2, 8, (12,), generator=g) for _ in range(args.sources)]
    rows = []
    for work, srcs in (("5-30 tokens", sources(args.sources, 8)), ("12 tokens", one_length)):
        rows += _transformer_times(args, work, srcs)
    first: dict[str, list[float]] = {"autobatch": [], "eager": []}
    for _ in range(args.first_reps):
        for how in first:
            first[how].append(_first_call(args, "transformer", how)["first"])
    for how, t in first.items():
        rows.append(
            {
                "sources": "5-30 tokens",
                "method": f"{how} (first call)",
                "median_ms": 1e3 * median(t),
                "vs_eager": median(t) / median(first["eager"]),
            }
        )
    return rows


def _transformer_times(args, work: str, srcs: list[torch.Tensor]) -> list[dict]:  # type: ignore[no-untyped-def]
    """``transformer_rows`` for one set of sources: the same tokens from both (float64),
    then autobatch against eager per example, interleaved."""
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = TinyTransformer().eval()
    with _MODE["mode"]():
        eager = [model.greedy(s) for s in srcs]
        auto = fold.autobatch(lambda s: model.greedy(s), srcs, stack=False)
    assert [e.tolist() for e in eager] == [a.tolist() for a in auto]
    lengths = sorted(len(e) for e in eager)
    print(
        f"sources of {work}: decoded lengths {lengths[0]}-{lengths[-1]}, median "
        f"{lengths[len(lengths) // 2]}"
    )
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)
    model = TinyTransformer().eval()
    times = interleaved(
        {
            "autobatch": _no_grad(
                lambda: fold.autobatch(lambda s: model.greedy(s), srcs, stack=False)
            ),
            "eager per example": _no_grad(lambda: [model.greedy(s) for s in srcs]),
        },
        args.reps,
    )
    eager_t = median(times["eager per example"])
    return [
        {
            "sources": work,
            "method": k,
            "median_ms": 1e3 * median(v),
            "vs_eager": median(v) / eager_t,
        }
        for k, v in times.items()
    ]


class _Stub(nn.Module):
    """The parser's scores without its MLP: three numbers of the features."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:3]


class _Counter(nn.Module):
    """A decoder step that does next to nothing: autobatch's cost per round alone.  Each step
    is a module call (a node, recorded) on the example's state and one read of it (a torch
    op on plain tensors and parameters alone would run at once as eager code, and no round
    would run)."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Linear(1, 1)
        with torch.no_grad():  # h -> h + 1: the states count the steps
            self.cell.weight.fill_(1.0)
            self.cell.bias.fill_(1.0)

    def run(self, x: torch.Tensor, steps: int) -> torch.Tensor:
        h = x
        for _ in range(steps):
            h = self.cell(h)
            if float(h.detach()) < -1:  # a read per step: a round per step
                break
        return h


def round_rows(args) -> list[dict]:  # type: ignore[no-untyped-def]
    """The cost of a batched round: every round batched (``EAGER_GROUP`` 0; by default a
    round of one small group of 16 examples would let them finish as eager code)."""
    driver = importlib.import_module("fold.autobatch.driver")
    kept, driver.EAGER_GROUP = driver.EAGER_GROUP, 0
    try:
        return _round_rows(args)
    finally:
        driver.EAGER_GROUP = kept


def _round_rows(args) -> list[dict]:  # type: ignore[no-untyped-def]
    model = _Counter()
    rows = []
    for examples, steps in ((16, 10), (64, 10), (16, 40), (64, 40)):
        xs = [torch.full((1,), float(i)) for i in range(examples)]  # distinct: not memoised

        def fn(steps: int = steps, xs: list[torch.Tensor] = xs) -> None:
            # (per example: rows of one shape whose reads agree would run in lockstep, with
            # no rounds; the rounds' own cost is what is timed here)
            fold.autobatch(lambda x: model.run(x, steps), xs, per_example=True)

        rounds = _rounds(fn)
        assert rounds == steps, (rounds, steps)  # one batched round per step, as timed
        t = median(interleaved({"x": fn}, args.reps)["x"])
        rows.append(
            {
                "examples": examples,
                "rounds": rounds,
                "median_ms": 1e3 * t,
                "us per round": 1e6 * t / steps,
                "us per example-round": 1e6 * t / (steps * examples),
            }
        )
    return rows


def _rounds(fn) -> int:  # type: ignore[no-untyped-def]
    """How many batched rounds one call of ``fn`` runs (its autobatch session's count)."""
    driver = importlib.import_module("fold.autobatch.driver")
    counted = []
    run_round = driver._Session.run_round

    def counting(session) -> None:  # type: ignore[no-untyped-def]
        counted.append(session.eager)
        run_round(session)

    driver._Session.run_round = counting
    try:
        fn()
    finally:
        driver._Session.run_round = run_round
    return len(counted)


def first_call_rows(args) -> list[dict]:  # type: ignore[no-untyped-def]
    """The first call in a fresh process, as a user's script meets it: decode-long's 64
    sources, the parser's 64 sentences, the translation tutorial's 64 sources (its
    modules of the user's own, ``benchmarks/tutorials.py``) and 64 decodes through a step
    module holding a GRUCell (``StepModule``), autobatch against eager per example, each in a
    process of its own (``--first-call-worker``), the median of ``--first-reps`` processes.
    Autobatch's first call infers the shapes of every op it has not seen (see
    ``fold/autobatch/recorder.py``, ``_stateless``); its second call is timed too."""

    rows = []
    for work in ("decode-long", "parser", "tutorial", "step-module"):
        times: dict[str, list[float]] = {"autobatch": [], "second call": [], "eager": []}
        for _ in range(args.first_reps):
            for how in ("autobatch", "eager"):
                got = _first_call(args, work, how)
                times[how].append(got["first"])
                if how == "autobatch":
                    times["second call"].append(got["second"])
        eager = median(times["eager"])
        for how, t in times.items():
            rows.append(
                {
                    "workload": work,
                    "method": f"{how} (first call)"
                    if how != "second call"
                    else "autobatch, second call",
                    "median_ms": 1e3 * median(t),
                    "vs_eager_first": median(t) / eager,
                }
            )
    return rows


def _first_call(args, work: str, how: str) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """``work``'s first (and second) call in a fresh process (``_first_call_worker``)."""
    import json
    import subprocess

    cmd = [sys.executable, __file__, "--first-call-worker", work, how]
    cmd += ["--threads", str(args.threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _first_call_worker(work: str, how: str) -> None:
    """One fresh process's first call (and autobatch's second): printed as JSON."""
    import json
    import time

    if work == "decode-long":
        srcs = sources(64, 8)
        limits = [len(s) for s in srcs]
        torch.manual_seed(0)
        model = Seq2Seq(eos_bias=0.0)
        items = (srcs, limits)

        def eager_fn(s, n):  # type: ignore[no-untyped-def]
            return model.greedy(s, n)

    elif work == "transformer":
        items = (sources(64, 8),)
        torch.manual_seed(0)
        model = TinyTransformer().eval()

        def eager_fn(s):  # type: ignore[no-untyped-def]
            return model.greedy(s)

    elif work == "step-module":
        items = ([torch.randn(128) for _ in range(64)],)
        torch.manual_seed(0)
        model = StepModule()

        def eager_fn(h):  # type: ignore[no-untyped-def]
            return model.greedy(h)

    elif work == "tutorial":  # (the translation tutorial's seq2seq: benchmarks/tutorials.py)
        tutorials = importlib.import_module("tutorials")
        items = (tutorials.sources(64),)
        torch.manual_seed(0)
        model = tutorials.Tutorial(128).eval()

        def eager_fn(s):  # type: ignore[no-untyped-def]
            return model.translate(s)

    else:
        Parser, words, vocab_size = parser_workload(64)
        items = (words,)
        torch.manual_seed(0)
        model = Parser(vocab_size)

        def eager_fn(w):  # type: ignore[no-untyped-def]
            return model.parse(w)

    def call() -> None:
        with torch.no_grad():
            if how == "autobatch":
                fold.autobatch(eager_fn, *items, stack=False)
            else:
                [eager_fn(*x) for x in zip(*items)]

    t0 = time.perf_counter()
    call()
    t1 = time.perf_counter()
    call()
    t2 = time.perf_counter()
    print(json.dumps({"first": t1 - t0, "second": t2 - t1}))


class EarlyExit(nn.Module):
    """An early-exit classifier (BranchyNet's idea) written for one example: where the first
    head is confident, it answers; else the example goes on through a second block."""

    def __init__(self, width: int = 256, classes: int = 10) -> None:
        super().__init__()
        self.first, self.head1 = nn.Linear(width, width), nn.Linear(width, classes)
        self.second, self.head2 = nn.Linear(width, width), nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x))
        p = torch.softmax(self.head1(h), -1)
        if p.max() > 0.15:  # a read: confident examples exit here
            return p
        return torch.softmax(self.head2(torch.relu(self.second(h)) + h), -1)

    def hand(self, x: torch.Tensor) -> torch.Tensor:
        """The batch at once: the first head for all, the second block for the rest."""
        h = torch.relu(self.first(x))
        p = torch.softmax(self.head1(h), -1)
        rest = (p.amax(1) <= 0.15).nonzero().squeeze(1)
        out = p.clone()
        r = h[rest]
        out[rest] = torch.softmax(self.head2(torch.relu(self.second(r)) + r), -1)
        return out


class Pointer(nn.Module):
    """A pointer network's decoder written for one example (Vinyals et al. 2015): each
    step scores the example's own items against a query, masks those already picked and
    reads the pick."""

    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.att = nn.Linear(width, width)

    def forward(self, items: torch.Tensor) -> torch.Tensor:
        q, used, picks = items.mean(0), torch.zeros(len(items), dtype=torch.bool), []
        for _ in range(len(items)):
            scores = (items @ self.att(q)).masked_fill(used, float("-inf"))
            i = int(scores.argmax())  # a read: the example pauses
            picks.append(i)
            used = used.clone()
            used[i] = True
            q = items[i]
        return torch.tensor(picks)


class Policy(nn.Module):
    """A policy-gradient (REINFORCE) loss written for one sample: the log-probability of the
    action taken, weighed by its return, and an entropy bonus, through torch.distributions
    with its argument checks on (torch's default)."""

    def __init__(self, width: int = 64, actions: int = 6) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, actions))

    def forward(self, state: torch.Tensor, action: torch.Tensor, ret: torch.Tensor) -> Any:
        d = torch.distributions.Categorical(logits=self.net(state), validate_args=True)
        return -(d.log_prob(action) * ret) - 0.01 * d.entropy()

    def hand(self, states: torch.Tensor, actions: torch.Tensor, rets: torch.Tensor) -> Any:
        return self(states, actions, rets)  # (a Categorical over the batch's rows)


class SentenceCNN(nn.Module):
    """A sentence classifier of convolutions over time (Kim 2014) written for one sentence,
    as a batch of one: embeddings (1, D, L), a Conv1d per width, ReLU, max over time, a
    Linear, the cross-entropy of the sentence's label."""

    def __init__(self, vocab: int = 1000, dim: int = 64, maps: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.convs = nn.ModuleList([nn.Conv1d(dim, maps, k) for k in (3, 4, 5)])
        self.out = nn.Linear(3 * maps, 5)

    def forward(self, words: torch.Tensor, label: torch.Tensor) -> Any:
        e = self.emb(words).t()[None]
        h = torch.cat([torch.relu(c(e)).max(dim=2)[0] for c in self.convs], 1)
        return F.cross_entropy(self.out(h), label[None])

    def hand(self, words: list[torch.Tensor], labels: torch.Tensor) -> Any:
        """The sentences padded to the longest, each conv's positions past a sentence's
        own masked out of the max: one call per layer."""
        lengths = torch.tensor([len(w) for w in words])
        e = self.emb(pad_sequence(words, batch_first=True)).transpose(1, 2)  # (B, D, L)
        pooled = []
        for c in self.convs:
            h = torch.relu(c(e))  # (B, maps, L - k + 1)
            valid = torch.arange(h.shape[2])[None, :] < (lengths - c.kernel_size[0] + 1)[:, None]
            pooled.append(h.masked_fill(~valid[:, None, :], float("-inf")).max(dim=2)[0])
        return F.cross_entropy(self.out(torch.cat(pooled, 1)), labels, reduction="none")


def _sentence_cnn_rows(args) -> list[dict]:  # type: ignore[no-untyped-def]
    """The sentence classifier's training step (forward and backward) over 64 sentences of
    6-29 words as a Dataset yields them: autobatch of the module itself, the padded batch
    by hand, eager per sentence."""
    torch.manual_seed(0)
    model = SentenceCNN()
    g = torch.Generator().manual_seed(1)
    words = [
        torch.randint(0, 1000, (int(n),), generator=g)
        for n in torch.randint(6, 30, (64,), generator=g)
    ]
    labels = list(torch.randint(0, 5, (64,), generator=g))
    want = torch.stack([model(w, y) for w, y in zip(words, labels)])
    torch.testing.assert_close(fold.autobatch(model, words, labels), want)
    torch.testing.assert_close(model.hand(words, torch.stack(labels)), want)

    def step(losses: Any) -> None:
        model.zero_grad()
        losses().sum().backward()

    times = interleaved(
        {
            "autobatch": lambda: step(lambda: fold.autobatch(model, words, labels)),
            "hand": lambda: step(lambda: model.hand(words, torch.stack(labels))),
            "eager per example": lambda: step(
                lambda: torch.stack([model(w, y) for w, y in zip(words, labels)])
            ),
        },
        args.reps,
    )
    return [
        {"workload": "sentence CNN step (64 sentences of 6-29 words)", **row}
        for row in _against(times, "hand")
    ]


class DeepSets(nn.Module):
    """A set function (Zaheer et al. 2017) written for one set: phi of each element, their
    sum, rho of it, squeezed to a number."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.phi = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, width))
        self.rho = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rho(self.phi(x).sum(0)).squeeze()

    def hand(self, sets: list[torch.Tensor]) -> torch.Tensor:
        """The sets padded with zeros, phi's padding masked out of the sum."""
        lengths = torch.tensor([len(x) for x in sets])
        keep = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]
        h = self.phi(pad_sequence(sets, batch_first=True)) * keep[:, :, None]
        return self.rho(h.sum(1)).squeeze(1)


class GCN(nn.Module):
    """Graph classification with two graph convolutions (Kipf and Welling 2017) written
    for one graph: its normalised adjacency (n, n) and node features (n, 8)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.out = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 3)

    def forward(self, a: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> Any:
        h = torch.relu(a @ self.l1(x))
        h = torch.relu(a @ self.l2(h))
        return F.cross_entropy(self.out(h.mean(0)), y)

    def hand(self, graphs: list[torch.Tensor], feats: list[torch.Tensor], labels: Any) -> Any:
        """The graphs padded to the largest (adjacency with zeros in both dims), padded
        nodes masked out of the mean: one call per layer."""
        sizes = torch.tensor([len(x) for x in feats])
        big = int(sizes.max())
        a = torch.stack([F.pad(g, (0, big - len(g), 0, big - len(g))) for g in graphs])
        h = torch.relu(a @ self.l1(pad_sequence(feats, batch_first=True)))
        h = torch.relu(a @ self.l2(h))
        keep = (torch.arange(big)[None, :] < sizes[:, None]).to(h.dtype)[:, :, None]
        pooled = (h * keep).sum(1) / sizes[:, None].to(h.dtype)
        return F.cross_entropy(self.out(pooled), labels, reduction="none")


class SelfAttention(nn.Module):
    """A sentence classifier of one self-attention block written for one sentence (L, 32):
    a fused projection cut in three, scores (L, L), a residual feed-forward, a mean over
    the words."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.width = width
        self.qkv, self.o = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.ff, self.out = nn.Linear(width, width), nn.Linear(width, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        q, k, v = self.qkv(x).chunk(3, -1)
        a = torch.softmax(q @ k.t() / self.width**0.5, -1)
        h = x + self.o(a @ v)
        h = h + torch.relu(self.ff(h))
        return F.cross_entropy(self.out(h.mean(0)), y)

    def hand(self, xs: list[torch.Tensor], labels: Any) -> Any:
        """The sentences padded, the keys past each length masked out of the softmax and
        the padded words out of the mean: one call per layer."""
        sizes = torch.tensor([len(x) for x in xs])
        big = int(sizes.max())
        x = pad_sequence(xs, batch_first=True)
        keep = torch.arange(big)[None, :] < sizes[:, None]  # (B, L)
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = (q @ k.transpose(1, 2) / self.width**0.5).masked_fill(
            ~keep[:, None, :], float("-inf")
        )
        h = x + self.o(torch.softmax(scores, -1) @ v)
        h = h + torch.relu(self.ff(h))
        pooled = (h * keep[:, :, None]).sum(1) / sizes[:, None].to(h.dtype)
        return F.cross_entropy(self.out(pooled), labels, reduction="none")


def _set_and_graph_rows(args) -> list[dict]:  # type: ignore[no-untyped-def]
    """Training steps over inputs of several sizes as a Dataset yields them: a set model
    over 128 sets of 3-39 elements, a graph classifier over 64 graphs of 5-29 nodes, a
    self-attention classifier over 64 sentences of 5-29 words (each: autobatch, the padded
    batch by hand, eager per example)."""
    rows = []
    torch.manual_seed(0)
    model = DeepSets()
    g = torch.Generator().manual_seed(2)
    sets = [torch.randn(int(n), 4, generator=g) for n in torch.randint(3, 40, (128,), generator=g)]
    want = torch.stack([model(x) for x in sets])
    torch.testing.assert_close(fold.autobatch(model, sets), want)
    torch.testing.assert_close(model.hand(sets), want)

    def step(net: nn.Module, losses: Any) -> None:
        net.zero_grad()
        losses().sum().backward()

    times = interleaved(
        {
            "autobatch": lambda: step(model, lambda: fold.autobatch(model, sets)),
            "hand": lambda: step(model, lambda: model.hand(sets)),
            "eager per example": lambda: step(model, lambda: torch.stack([model(x) for x in sets])),
        },
        args.reps,
    )
    rows += [
        {"workload": "set model step (128 sets of 3-39)", **row} for row in _against(times, "hand")
    ]
    gcn = GCN()
    sizes = [int(n) for n in torch.randint(5, 30, (64,), generator=g)]
    graphs = []
    for n in sizes:
        adj = (torch.rand(n, n, generator=g) < 0.3).float()
        adj = ((adj + adj.t()) > 0).float() + torch.eye(n)
        d = adj.sum(1).rsqrt()
        graphs.append(d[:, None] * adj * d[None, :])
    feats = [torch.randn(n, 8, generator=g) for n in sizes]
    labels = list(torch.randint(0, 3, (64,), generator=g))
    want = torch.stack([gcn(*x) for x in zip(graphs, feats, labels)])
    torch.testing.assert_close(fold.autobatch(gcn, graphs, feats, labels), want)
    torch.testing.assert_close(gcn.hand(graphs, feats, torch.stack(labels)), want)
    times = interleaved(
        {
            "autobatch": lambda: step(gcn, lambda: fold.autobatch(gcn, graphs, feats, labels)),
            "hand": lambda: step(gcn, lambda: gcn.hand(graphs, feats, torch.stack(labels))),
            "eager per example": lambda: step(
                gcn, lambda: torch.stack([gcn(*x) for x in zip(graphs, feats, labels)])
            ),
        },
        args.reps,
    )
    rows += [
        {"workload": "graph classifier step (64 graphs of 5-29 nodes)", **row}
        for row in _against(times, "hand")
    ]
    attention = SelfAttention()
    words = [torch.randn(int(n), 32, generator=g) for n in torch.randint(5, 30, (64,), generator=g)]
    classes = list(torch.randint(0, 3, (64,), generator=g))
    want = torch.stack([attention(x, y) for x, y in zip(words, classes)])
    torch.testing.assert_close(fold.autobatch(attention, words, classes), want)
    torch.testing.assert_close(attention.hand(words, torch.stack(classes)), want)
    times = interleaved(
        {
            "autobatch": lambda: step(attention, lambda: fold.autobatch(attention, words, classes)),
            "hand": lambda: step(attention, lambda: attention.hand(words, torch.stack(classes))),
            "eager per example": lambda: step(
                attention,
                lambda: torch.stack([attention(x, y) for x, y in zip(words, classes)]),
            ),
        },
        args.reps,
    )
    rows += [
        {"workload": "self-attention step (64 sentences of 5-29 words)", **row}
        for row in _against(times, "hand")
    ]
    return rows


def _policy_rows(args) -> list[dict]:  # type: ignore[no-untyped-def]
    """The REINFORCE loss over 256 samples (state, action, return) as a Dataset yields them,
    forward and backward: autobatch, the batched loss (one Categorical over the stacked
    states), eager per example."""
    torch.manual_seed(0)
    policy = Policy()
    states = list(torch.randn(256, 8))
    actions = list(torch.randint(0, 6, (256,)))
    rets = list(torch.randn(256))
    stacked = torch.stack(states), torch.stack(actions), torch.stack(rets)
    want = torch.stack([policy(*sample) for sample in zip(states, actions, rets)])
    torch.testing.assert_close(fold.autobatch(policy, states, actions, rets), want)
    torch.testing.assert_close(policy.hand(*stacked), want)

    def step(losses: Any) -> None:
        policy.zero_grad()
        losses().sum().backward()

    times = interleaved(
        {
            "autobatch": lambda: step(lambda: fold.autobatch(policy, states, actions, rets)),
            "hand": lambda: step(lambda: policy.hand(*stacked)),
            "eager per example": lambda: step(
                lambda: torch.stack([policy(*sample) for sample in zip(states, actions, rets)])
            ),
        },
        args.reps,
    )
    return [
        {"workload": "policy gradient step (256 samples, Categorical)", **row}
        for row in _against(times, "hand")
    ]


class StepModule(nn.Module):
    """A decoder's step as a module of one's own holding a GRUCell (its embedding, cell and
    output layer), as decoder classes in user code are written: greedy decoding of one
    example from its initial state, a fixed number of steps (``greedy``), and of the batch
    by hand (``hand``)."""

    def __init__(self, vocab: int = 8, hidden: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.cell = nn.GRUCell(hidden, hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, tok: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.cell(self.embed(tok), h)
        return self.out(h), h

    def greedy(self, h: torch.Tensor, steps: int = 12) -> torch.Tensor:
        tok, toks = BOS, []
        for _ in range(steps):
            logits, h = self(torch.tensor(tok), h)
            tok = int(logits.argmax())  # a read: a round a step
            toks.append(tok)
        return torch.tensor(toks)

    def hand(self, hs: list[torch.Tensor], steps: int = 12) -> list[torch.Tensor]:
        h = torch.stack(hs)
        tok = torch.full((len(hs),), BOS)
        toks = []
        for _ in range(steps):
            logits, h = self(tok, h)
            tok = logits.argmax(1)
            toks.append(tok)
        return list(torch.stack(toks, 1))


def step_module_rows(args) -> list[dict]:  # type: ignore[no-untyped-def]
    """Greedy decoding of 64 examples, 12 steps each, through a step module of one's own
    holding a GRUCell (``StepModule``): autobatch, the batch by hand, eager per example.
    Autobatch runs such a module through (its cell's group one call), where vmap would run
    the cell one call per example; all three decode the same tokens (float64) first."""
    hs = [torch.randn(args.hidden) for _ in range(args.sources)]
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = StepModule(hidden=args.hidden)
    with _MODE["mode"]():
        h64 = [h.double() for h in hs]
        eager = [model.greedy(h).tolist() for h in h64]
        auto = [t.tolist() for t in fold.autobatch(model.greedy, h64, stack=False)]
        assert eager == auto == [t.tolist() for t in model.hand(h64)]
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)
    model = StepModule(hidden=args.hidden)
    times = interleaved(
        {
            "autobatch": _no_grad(lambda: fold.autobatch(model.greedy, hs, stack=False)),
            "hand": _no_grad(lambda: model.hand(hs)),
            "eager per example": _no_grad(lambda: [model.greedy(h) for h in hs]),
        },
        args.reps,
    )
    return _against(times, "hand")


def literature_rows(args) -> list[dict]:  # type: ignore[no-untyped-def]
    """Per-example programs with reads from the literature, as a Dataset yields their
    inputs (a list of samples): an early-exit classifier over 256 samples of one shape
    (autobatch records it once for all of them, the rows split where they exit; against the
    hand-batched version and eager per example), and a pointer network over 64 inputs of
    5-20 items (per example, a round a pick; against eager per example)."""
    torch.manual_seed(0)
    rows = []
    model = EarlyExit()
    xs = list(torch.randn(256, 256))
    with _MODE["mode"]():
        want = torch.stack([model(x) for x in xs])
        torch.testing.assert_close(fold.autobatch(model, xs), want)
        torch.testing.assert_close(model.hand(torch.stack(xs)), want)
        exits = int(
            (
                torch.stack([model.head1(torch.relu(model.first(x))) for x in xs])
                .softmax(1)
                .amax(1)
                > 0.15
            ).sum()
        )
    times = interleaved(
        {
            "autobatch": _no_grad(lambda: fold.autobatch(model, xs)),
            "hand": _no_grad(lambda: model.hand(torch.stack(xs))),
            "eager per example": _no_grad(lambda: [model(x) for x in xs]),
        },
        args.reps,
    )
    for row in _against(times, "hand"):
        rows.append({"workload": f"early exit ({exits} of 256 exit)", **row})
    pointer = Pointer()
    g = torch.Generator().manual_seed(0)
    items = [
        torch.randn(int(n), 128, generator=g) for n in torch.randint(5, 21, (64,), generator=g)
    ]
    with _MODE["mode"]():
        got = fold.autobatch(pointer, items, stack=False)
        assert [t.tolist() for t in got] == [pointer(x).tolist() for x in items]
    times = interleaved(
        {
            "autobatch": _no_grad(lambda: fold.autobatch(pointer, items, stack=False)),
            "eager per example": _no_grad(lambda: [pointer(x) for x in items]),
        },
        args.reps,
    )
    for row in _against(times, "eager per example"):
        rows.append({"workload": "pointer network (64 inputs of 5-20 items)", **row})
    return rows + _policy_rows(args) + _sentence_cnn_rows(args) + _set_and_graph_rows(args)


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--first-call-worker":
        torch.set_num_threads(int(sys.argv[5]))
        _first_call_worker(sys.argv[2], sys.argv[3])
        return
    ap = parser(__doc__, device=False)
    ap.add_argument("--sources", type=int, default=64)
    ap.add_argument("--sentences", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--eager-reps", type=int, default=1)
    ap.add_argument("--first-reps", type=int, default=3, help="fresh processes per first call")
    ap.add_argument(
        "--only",
        nargs="+",
        choices=[
            "decode",
            "decode-long",
            "decode-limit",
            "parser",
            "rounds",
            "first-call",
            "transformer",
            "literature",
            "step-module",
        ],
        default=["decode", "decode-long", "decode-limit", "parser", "rounds", "first-call"],
        help="the workloads to run (all by default)",
    )
    ap.add_argument(
        "--mode",
        choices=["no_grad", "inference_mode"],
        default="no_grad",
        help="the mode every contender runs in (results of inference_mode are written apart)",
    )
    args = ap.parse_args()
    setup(args)
    _MODE["mode"] = getattr(torch, args.mode)
    out = {"args": vars(args)}
    if "decode" in args.only:
        out["decode"] = decode_rows(args)
        print(
            f"greedy decoding of {args.sources} sources, hidden {args.hidden}, "
            f"{args.threads} thread(s)"
        )
        print(table(out["decode"], ["method", "median_ms", "vs_hand", "reps"]))
    if "decode-long" in args.only:
        out["decode_long"] = decode_rows(args, long=True)
        print("\nthe same, each decode stopping at EOS or after as many steps as its source")
        print(table(out["decode_long"], ["method", "median_ms", "vs_hand", "reps"]))
    if "decode-limit" in args.only:
        out["decode_limit"] = decode_rows(args, biased=False)
        print("\nthe same model without its EOS bias, each decode until EOS or the 40-step limit")
        print(table(out["decode_limit"], ["method", "median_ms", "vs_hand", "reps"]))
    if "parser" in args.only:
        out["parser"] = parser_rows(args)
        print(f"\narc-standard parsing of {args.sentences} sentences with predicted transitions")
        print(table(out["parser"], ["method", "median_ms", "vs_hand", "reps"]))
    if "rounds" in args.only:
        out["rounds"] = round_rows(args)
        print("\nper-round cost: a step of one module call and one read")
        print(table(out["rounds"], list(out["rounds"][0])))
    if "transformer" in args.only:
        out["transformer"] = transformer_rows(args)
        print("\ngreedy decoding with torch.nn's transformer, as written for one source")
        print(table(out["transformer"], ["sources", "method", "median_ms", "vs_eager"]))
    if "literature" in args.only:
        out["literature"] = literature_rows(args)
        print("\nper-example programs with reads from the literature (ratio: to the row marked 1)")
        print(table(out["literature"], ["workload", "method", "median_ms", "vs_hand", "reps"]))
    if "step-module" in args.only:
        out["step_module"] = step_module_rows(args)
        print(
            f"\ngreedy decoding of {args.sources} examples through a step module holding a GRUCell"
        )
        print(table(out["step_module"], ["method", "median_ms", "vs_hand", "reps"]))
    if "first-call" in args.only:
        out["first_call"] = first_call_rows(args)
        print(
            "\nthe first call in a fresh process (decode-long; the parser; the translation "
            "tutorial; a step module holding a GRUCell)"
        )
        print(table(out["first_call"], list(out["first_call"][0])))
    name = "control_flow" if args.mode == "no_grad" else "control_flow_inference"
    print(f"wrote {write_json(name, out)}")


if __name__ == "__main__":
    main()
