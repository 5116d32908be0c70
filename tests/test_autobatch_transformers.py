"""torch.nn's transformer modules under fold.autobatch, called per example on a batch of one
(``enc(src[None])``, ``dec(tgt, mem, tgt_mask=mask)``): a group of calls runs as ONE call
on the examples' merged batch, sources and memories of several lengths padded with a key
padding mask.  Everything against eager per example (float64): tokens, logits, losses and
gradients."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fold
from fold.autobatch import driver, recorder

BOS, EOS = 1, 0


# Float64 throughout (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("float64")


class _Seq2Seq(nn.Module):
    """An encoder and a decoder of torch.nn's own, written for ONE source: a batch of one,
    batch first or not, the decoder given the whole prefix and the causal mask."""

    def __init__(self, batch_first: bool, layers: bool = False) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(9, 8)
        self.pos = nn.Parameter(torch.randn(40, 8) * 0.1)
        enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=batch_first)
        dec = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=batch_first)
        if layers:  # the layers called directly
            self.enc, self.dec = enc, dec
        else:
            self.enc = nn.TransformerEncoder(enc, 2, enable_nested_tensor=False)
            self.dec = nn.TransformerDecoder(dec, 2)
        self.out = nn.Linear(8, 9)

    def one(self, x: torch.Tensor) -> torch.Tensor:
        """(L, D) -> a batch of one: (1, L, D) batch first, else (L, 1, D)."""
        return x[None] if self.batch_first else x[:, None]

    def encode(self, src: torch.Tensor) -> torch.Tensor:
        return self.enc(self.one(self.emb(src) + self.pos[: len(src)]))

    def decode(self, toks: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(len(toks))
        h = self.dec(self.one(self.emb(toks) + self.pos[: len(toks)]), mem, tgt_mask=mask)
        return self.out(h[0] if self.batch_first else h[:, 0])  # (T, vocab)

    def greedy(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Until EOS, or as many steps as the source has tokens."""
        mem = self.encode(src)
        toks, logits = [BOS], []
        for _ in range(len(src)):
            last = self.decode(torch.tensor(toks), mem)[-1]
            logits.append(last)
            toks.append(int(last.argmax()))  # a read: the example pauses
            if toks[-1] == EOS:
                break
        return torch.tensor(toks), torch.stack(logits)

    def loss(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        """Teacher forcing: the target shifted right after BOS."""
        inp = torch.cat([torch.tensor([BOS]), tgt[:-1]])
        return F.cross_entropy(self.decode(inp, self.encode(src)), tgt)


def _sources(n: int, seed: int, lengths=(3, 9)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (n,), generator=g)
    return [torch.randint(2, 9, (int(k),), generator=g) for k in sizes]


def _model(batch_first: bool, layers: bool = False) -> _Seq2Seq:
    torch.manual_seed(0)
    m = _Seq2Seq(batch_first, layers).eval()
    with torch.no_grad():  # decodes of varied lengths
        m.out.bias[EOS] += 0.3
    return m


@pytest.mark.parametrize("layers", [False, True], ids=["stacks", "layers"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "time-major"])
def test_greedy_decoding_over_sources_of_several_lengths_runs_one_decoder_call_a_round(
    monkeypatch, batch_first, layers
):
    """Sources of 3-9 tokens: the encoder's calls run as ONE call (the sources padded, an
    attention mask past each one's length), and so do the decoder's calls of a round, over
    memories of several lengths, not one call per length.  Tokens and logits equal
    eager's."""
    monkeypatch.setattr(driver, "EAGER_GROUP", 0)  # every round batched
    m = _model(batch_first, layers)
    srcs = _sources(12, 1)
    assert len({len(s) for s in srcs}) > 3
    with torch.no_grad():
        want = [m.greedy(s) for s in srcs]
        fold.autobatch(m.greedy, srcs, stack=False)  # its ops recorded: no shape inference
        calls = {"enc": 0, "dec": 0}
        for name in calls:
            real = type(getattr(m, name)).forward

            def counted(self, *args, name=name, real=real, **kwargs):
                calls[name] += 1
                return real(self, *args, **kwargs)

            monkeypatch.setattr(type(getattr(m, name)), "forward", counted)
        got = fold.autobatch(m.greedy, srcs, stack=False)
    rounds = max(len(w[0]) for w in want) - 1
    # one call a round (one per length: dozens); the encoder's one round, one call
    assert calls["dec"] <= rounds and calls["enc"] == 1, calls
    assert layers or len({len(w[0]) for w in want}) > 2  # decodes of several lengths
    for (gt, gl), (wt, wl) in zip(got, want):
        assert gt.tolist() == wt.tolist()
        torch.testing.assert_close(gl, wl)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "time-major"])
def test_teacher_forced_losses_over_sources_and_targets_of_several_lengths_match_eager(
    batch_first,
):
    """Training: the encoder over sources of several lengths (one call, a key padding
    mask), the decoder over targets of several lengths too (one call per target length,
    each over padded memories).  Losses and every parameter's gradient equal eager's."""
    m = _model(batch_first)
    m.train()  # (no dropout: p = 0)
    srcs = _sources(10, 2)
    tgts = _sources(10, 3, (2, 5))
    want = torch.stack([m.loss(s, t) for s, t in zip(srcs, tgts)])
    got = fold.autobatch(m.loss, srcs, tgts)
    torch.testing.assert_close(got, want)
    params = list(m.parameters())
    weights = torch.rand(len(srcs))
    for a, b in zip(
        torch.autograd.grad((got * weights).sum(), params),
        torch.autograd.grad((want * weights).sum(), params),
    ):
        torch.testing.assert_close(a, b)


def test_encoder_calls_with_masks_of_their_own_match_eager():
    """An encoder given a float attention mask that every example makes alike (one
    length: one merged call, the mask as one value), and one given a key padding mask of
    the user's own (not merged: it runs under vmap): values and gradients equal eager's."""
    m = _model(True)
    srcs = [torch.randint(2, 9, (5,)) for _ in range(6)]
    pads = [torch.tensor([False] * (5 - k) + [True] * k) for k in (0, 1, 2, 0, 1, 3)]

    def masked(src):
        mask = torch.triu(torch.full((5, 5), -1.0), 1)  # a soft causal bias
        return m.enc(m.one(m.emb(src)), mask=mask).sum(1)

    def padded(src, pad):
        return m.enc(m.one(m.emb(src)), src_key_padding_mask=pad[None]).sum(1)

    for fn, its in ((masked, (srcs,)), (padded, (srcs, pads))):
        want = torch.stack([fn(*x) for x in zip(*its)])
        got = fold.autobatch(fn, *its)
        torch.testing.assert_close(got, want)
        params = list(m.enc.parameters())
        for a, b in zip(
            torch.autograd.grad(got.pow(2).sum(), params),
            torch.autograd.grad(want.pow(2).sum(), params),
        ):
            torch.testing.assert_close(a, b)


def test_views_of_a_parameter_taken_under_no_grad_do_not_make_new_ops_every_call():
    """``self.pos[:n]`` under torch.no_grad() is a new leaf tensor that requires grad at
    every call: it was keyed as a parameter, by identity, so every call of the function
    made new ops (shape inference each time, and tables that grew without end).  It is
    data now: a second call records no new op, and values equal eager's."""
    m = _model(True)
    srcs = _sources(8, 4)

    def ops() -> int:
        return len(recorder._OPS) + sum(len(t) for t in recorder._MODE_OPS.values())

    with torch.no_grad():
        want = [m.greedy(s)[0] for s in srcs]
        fold.autobatch(lambda s: m.greedy(s)[0], srcs, stack=False)
        before = ops()
        got = fold.autobatch(lambda s: m.greedy(s)[0], srcs, stack=False)
        assert ops() == before
    assert [g.tolist() for g in got] == [w.tolist() for w in want]


@pytest.mark.parametrize("batched", [True, False], ids=["batch-of-one", "unbatched"])
def test_attention_without_its_weights_returns_none_beside_its_output(batched):
    """``nn.MultiheadAttention(..., need_weights=False)`` returns ``(output, None)``: the
    call's value has its None in place (it was a FoldError: "returns tuple, not tensors"),
    its groups run on its output alone.  Values and gradients equal eager's, over a read."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    xs = [torch.randn(n, 8) for n in (3, 5, 3, 4)]

    def fn(x):
        q = x[None] if batched else x
        out, weights = mha(q, q, q, need_weights=False)
        assert weights is None
        if float(out.detach().sum()) > 0:  # a read: the value is used in a later round
            out = out * 2
        return out.sum(-2).flatten()

    want = torch.stack([fn(x) for x in xs])
    got = fold.autobatch(fn, xs)
    torch.testing.assert_close(got, want)
    params = list(mha.parameters())
    for a, b in zip(
        torch.autograd.grad(got.pow(2).sum(), params),
        torch.autograd.grad(want.pow(2).sum(), params),
    ):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("form", ["batch-of-one", "unbatched"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "time-major"])
@pytest.mark.parametrize(
    "weights", ["averaged", "per-head", "none"], ids=["weights", "head-weights", "no-weights"]
)
def test_multihead_attention_over_sequences_of_several_lengths_runs_as_one_call(
    monkeypatch, form, batch_first, weights
):
    """Self-attention over each example's own sequence (3-9 tokens) with
    ``nn.MultiheadAttention``, written for one example, then a feed-forward block: the
    attention's calls run as ONE call (queries, keys and values padded, an attention mask
    past each example's keys), where they ran under vmap, one group per length; the
    feed-forward ``nn.Sequential`` as one padded call too.  Outputs, weights and gradients
    equal eager's."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=batch_first)
    ff = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    xs = _sources(10, 5)
    emb = nn.Embedding(9, 8)

    def fn(src):
        x = emb(src)
        if form == "batch-of-one":
            x = x[None] if batch_first else x[:, None]
        out, w = mha(
            x, x, x, need_weights=weights != "none", average_attn_weights=weights == "averaged"
        )
        h = ff(out).sum(-2).flatten()
        return h if w is None else (h, w.sum(-1).flatten())

    want = [fn(s) for s in xs]
    calls = []
    real = nn.MultiheadAttention.forward

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    fold.autobatch(fn, xs, stack=False)  # (its shapes inferred: a call each on zeros)
    monkeypatch.setattr(nn.MultiheadAttention, "forward", counted)
    got = fold.autobatch(fn, xs, stack=False)
    assert len(calls) == 1, calls
    params = [*mha.parameters(), *ff.parameters(), *emb.parameters()]
    flat_got = [t for g in got for t in (g if isinstance(g, tuple) else (g,))]
    flat_want = [t for w in want for t in (w if isinstance(w, tuple) else (w,))]
    for a, b in zip(flat_got, flat_want):
        torch.testing.assert_close(a, b)
    weights_ = [torch.randn_like(t) for t in flat_want]
    for a, b in zip(
        torch.autograd.grad(sum((w * t).sum() for w, t in zip(weights_, flat_got)), params),
        torch.autograd.grad(sum((w * t).sum() for w, t in zip(weights_, flat_want)), params),
    ):
        torch.testing.assert_close(a, b)


def test_cross_attention_over_memories_of_several_lengths_and_a_shared_mask_match_eager():
    """Queries of one length over memories of several lengths (cross-attention: one output
    tensor for every length), and self-attention with a causal mask every example makes
    alike over sequences of one length (one call, the mask as one value): values and
    gradients equal eager's."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    q = nn.Parameter(torch.randn(1, 3, 8))
    mems = [torch.randn(1, n, 8) for n in (2, 6, 4, 6, 3)]
    same = [torch.randn(1, 5, 8) for _ in range(4)]

    def cross(m):
        return mha(q, m, m)[0].sum(1)

    def causal(x):
        mask = nn.Transformer.generate_square_subsequent_mask(5)
        return mha(x, x, x, attn_mask=mask)[0].sum(1)

    for fn, its in ((cross, mems), (causal, same)):
        want = torch.cat([fn(x) for x in its])
        got = fold.autobatch(fn, its).flatten(0, 1)
        torch.testing.assert_close(got, want)
        params = [q, *mha.parameters()]
        for a, b in zip(
            torch.autograd.grad(got.pow(2).sum(), params, allow_unused=True),
            torch.autograd.grad(want.pow(2).sum(), params, allow_unused=True),
        ):
            if b is None:
                assert a is None or not a.any()
            else:
                torch.testing.assert_close(a, b)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "time-major"])
def test_the_whole_transformer_over_sources_of_several_lengths_runs_one_call(
    monkeypatch, batch_first
):
    """``nn.Transformer`` called per example (``model(src[None], tgt[None],
    tgt_mask=mask)``), sources of 3-9 tokens, targets of one length: one call for the
    group (the sources padded, masked where the encoder's self-attention and the decoder's
    cross-attention read them); targets of several lengths: one call per target length.
    Losses and gradients equal eager's."""
    torch.manual_seed(0)
    with warnings.catch_warnings():  # (torch's own, on nested tensors, time-major)
        warnings.simplefilter("ignore")
        model = nn.Transformer(8, 2, 1, 1, 16, dropout=0.0, batch_first=batch_first)
    emb, out = nn.Embedding(9, 8), nn.Linear(8, 9)

    def one(x):
        return x[None] if batch_first else x[:, None]

    def loss(src, tgt):
        inp = torch.cat([torch.tensor([BOS]), tgt[:-1]])
        mask = nn.Transformer.generate_square_subsequent_mask(len(inp))
        h = model(one(emb(src)), one(emb(inp)), tgt_mask=mask)
        return F.cross_entropy(out(h[0] if batch_first else h[:, 0]), tgt)

    srcs = _sources(10, 6)
    params = [*model.parameters(), *emb.parameters(), *out.parameters()]
    for tgts in (_sources(10, 7, (4, 4)), _sources(10, 8, (2, 5))):
        want = torch.stack([loss(s, t) for s, t in zip(srcs, tgts)])
        fold.autobatch(loss, srcs, tgts)  # (shapes inferred)
        calls = []
        real = nn.Transformer.forward

        def counted(self, *args, calls=calls, real=real, **kwargs):
            calls.append(1)
            return real(self, *args, **kwargs)

        with monkeypatch.context() as m:
            m.setattr(nn.Transformer, "forward", counted)
            got = fold.autobatch(loss, srcs, tgts)
        assert len(calls) == len({len(t) for t in tgts}), calls
        torch.testing.assert_close(got, want)
        weights = torch.rand(len(srcs))
        for a, b in zip(
            torch.autograd.grad((got * weights).sum(), params),
            torch.autograd.grad((want * weights).sum(), params),
        ):
            torch.testing.assert_close(a, b)


def test_attention_with_masks_that_differ_between_examples_matches_eager():
    """An attention mask of each example's own (a bias from its first token) over sequences
    of one length: the group cannot run as one call with one mask, and runs one call per
    example.  Outputs, weights and gradients equal eager's."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    xs = [torch.randn(1, 4, 8) for _ in range(5)]

    def fn(x):
        mask = torch.full((4, 4), float(x[0, 0, 0]))  # a bias of its own
        out, w = mha(x, x, x, attn_mask=mask)
        return out.sum(1), w.sum(-1)

    want = [fn(x) for x in xs]
    got = fold.autobatch(fn, xs, stack=False)
    flat_got = [t for g in got for t in g]
    flat_want = [t for w in want for t in w]
    for a, b in zip(flat_got, flat_want):
        torch.testing.assert_close(a, b)
    params = list(mha.parameters())
    for a, b in zip(
        torch.autograd.grad(sum(t.pow(2).sum() for t in flat_got), params),
        torch.autograd.grad(sum(t.pow(2).sum() for t in flat_want), params),
    ):
        torch.testing.assert_close(a, b)
