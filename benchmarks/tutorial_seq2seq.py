"""Greedy decoding with the seq2seq model of PyTorch's translation tutorial, as written there
for ONE sentence, under autobatch; against eager per sentence and hand-batched decoding.

    python benchmarks/tutorial_seq2seq.py                  # 64 sources, hidden 128, 1 thread
    python benchmarks/tutorial_seq2seq.py --reps 9 --save

The model is the tutorial's ("NLP From Scratch: Translation with a Sequence to Sequence
Network and Attention"): an ``EncoderRNN`` that runs its ``nn.GRU`` on one token at a time
(``embedded.view(1, 1, -1)``, a batch of one), and an ``AttnDecoderRNN`` with a Dropout
(eval mode here), attention over ``MAX_LENGTH`` encoder outputs by ``torch.bmm`` on batches
of one, and ``log_softmax``; decoding reads ``topi.item()`` until EOS or ``MAX_LENGTH``
steps.  Untrained (as initialised, seed 0), most decodes run to the limit.

``translate`` is the tutorial's ``evaluate`` as written: it writes each encoder output into
a preallocated buffer (``encoder_outputs[ei] = encoder_output[0, 0]``), which autobatch
records out of place (see fold/autobatch/buffers.py).  ``--stacked`` collects the outputs
in a list and stacks them instead (zero rows after them, as in the buffer).

- autobatch: ``fold.autobatch(translate, sources, stack=False)``: the two modules are run
  through (vmap cannot run their GRU), each GRU call of a step's group runs as one call;
- eager: ``translate`` sentence by sentence;
- hand: the same model run on the whole batch: the encoder's GRU over the padded, packed
  sources, then every sentence decoded in one batch step after step until all have emitted
  EOS (finished ones still computed).

All three give the same tokens (float64) before timing.  Interleaved, medians, one thread.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence, pad_sequence

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved, median, parser, setup, table, write_json  # noqa: E402

import fold  # noqa: E402

SOS, EOS, MAX_LENGTH, VOCAB = 0, 1, 40, 12


class EncoderRNN(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.hidden_size = hidden
        self.embedding = nn.Embedding(VOCAB, hidden)
        self.gru = nn.GRU(hidden, hidden)

    def forward(self, input: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        embedded = self.embedding(input).view(1, 1, -1)
        output, hidden = self.gru(embedded, hidden)
        return output, hidden


class AttnDecoderRNN(nn.Module):
    def __init__(self, hidden: int, dropout_p: float = 0.1) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, hidden)
        self.attn = nn.Linear(hidden * 2, MAX_LENGTH)
        self.attn_combine = nn.Linear(hidden * 2, hidden)
        self.dropout = nn.Dropout(dropout_p)
        self.gru = nn.GRU(hidden, hidden)
        self.out = nn.Linear(hidden, VOCAB)

    def forward(self, input, hidden, encoder_outputs):  # type: ignore[no-untyped-def]
        embedded = self.embedding(input).view(1, 1, -1)
        embedded = self.dropout(embedded)
        attn_weights = F.softmax(self.attn(torch.cat((embedded[0], hidden[0]), 1)), dim=1)
        attn_applied = torch.bmm(attn_weights.unsqueeze(0), encoder_outputs.unsqueeze(0))
        output = torch.cat((embedded[0], attn_applied[0]), 1)
        output = self.attn_combine(output).unsqueeze(0)
        output = F.relu(output)
        output, hidden = self.gru(output, hidden)
        output = F.log_softmax(self.out(output[0]), dim=1)
        return output, hidden, attn_weights


class Tutorial(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.encoder = EncoderRNN(hidden)
        self.decoder = AttnDecoderRNN(hidden)

    def translate(self, src: torch.Tensor) -> torch.Tensor:
        """ONE source (L,) -> its decoded tokens (the tutorial's ``evaluate``)."""
        hidden = torch.zeros(1, 1, self.encoder.hidden_size)
        encoder_outputs = torch.zeros(MAX_LENGTH, self.encoder.hidden_size)
        for ei in range(src.size(0)):
            encoder_output, hidden = self.encoder(src[ei], hidden)
            encoder_outputs[ei] = encoder_output[0, 0]
        return self.decode(hidden, encoder_outputs)

    def translate_stacked(self, src: torch.Tensor) -> torch.Tensor:
        """``translate`` with the encoder's outputs stacked from a list, not written into a
        buffer."""
        hidden = torch.zeros(1, 1, self.encoder.hidden_size)
        outputs = []
        for ei in range(src.size(0)):
            encoder_output, hidden = self.encoder(src[ei], hidden)
            outputs.append(encoder_output[0, 0])
        pad = [torch.zeros(self.encoder.hidden_size)] * (MAX_LENGTH - len(outputs))
        return self.decode(hidden, torch.stack(outputs + pad))

    def decode(self, hidden: torch.Tensor, encoder_outputs: torch.Tensor) -> torch.Tensor:
        decoder_input = torch.tensor([[SOS]])
        decoded = []
        for _ in range(MAX_LENGTH):
            decoder_output, hidden, _ = self.decoder(decoder_input, hidden, encoder_outputs)
            topv, topi = decoder_output.data.topk(1)
            if topi.item() == EOS:
                decoded.append(EOS)
                break
            decoded.append(topi.item())
            decoder_input = topi.squeeze().detach()
        return torch.tensor(decoded)

    def hand(self, srcs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every source at once: the encoder's GRU over the packed batch, then the decoder
        on the batch, step after step, until every sentence has emitted EOS."""
        enc, dec = self.encoder, self.decoder
        n = len(srcs)
        lengths = torch.tensor([len(s) for s in srcs])
        packed = pack_padded_sequence(
            enc.embedding(pad_sequence(srcs)), lengths, enforce_sorted=False
        )
        out, hidden = enc.gru(packed)
        mem = pad_packed_sequence(out, total_length=MAX_LENGTH)[0].transpose(0, 1)  # (n, T, H)
        tok = torch.full((n,), SOS)
        done = torch.zeros(n, dtype=torch.bool)
        steps = []
        for _ in range(MAX_LENGTH):
            e = dec.dropout(dec.embedding(tok))  # (n, H)
            w = F.softmax(dec.attn(torch.cat((e, hidden[0]), 1)), dim=1)  # (n, T)
            applied = torch.bmm(w.unsqueeze(1), mem)[:, 0]
            o = F.relu(dec.attn_combine(torch.cat((e, applied), 1))).unsqueeze(0)
            o, hidden = dec.gru(o, hidden)
            tok = F.log_softmax(dec.out(o[0]), dim=1).topk(1)[1][:, 0]
            steps.append(tok)
            done = done | (tok == EOS)
            if bool(done.all()):
                break
        out = torch.stack(steps, 1)
        ends = [(row == EOS).nonzero() for row in out]
        return [row[: int(e[0]) + 1] if len(e) else row for row, e in zip(out, ends)]


def sources(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 31, (n,), generator=g)
    return [torch.randint(2, VOCAB, (int(k),), generator=g) for k in lengths]


def main() -> None:
    ap = parser(__doc__, device=False)
    ap.add_argument("--sources", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument(
        "--stacked", action="store_true", help="the encoder's outputs stacked from a list"
    )
    args = ap.parse_args()
    setup(args)
    srcs = sources(args.sources)

    def translate(model: Tutorial) -> Any:
        return model.translate_stacked if args.stacked else model.translate

    torch.set_default_dtype(torch.float64)  # the same decisions from all three
    torch.manual_seed(0)
    model = Tutorial(args.hidden).eval()
    with torch.no_grad():
        eager = [translate(model)(s).tolist() for s in srcs]
        auto = [t.tolist() for t in fold.autobatch(translate(model), srcs, stack=False)]
        hand = [t.tolist() for t in model.hand(srcs)]
    assert eager == auto == hand
    lengths = sorted(len(e) for e in eager)
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)
    model = Tutorial(args.hidden).eval()

    def run(fn):  # type: ignore[no-untyped-def]
        def go() -> None:
            with torch.no_grad():
                fn()

        return go

    times = interleaved(
        {
            "autobatch": run(lambda: fold.autobatch(translate(model), srcs, stack=False)),
            "eager per sentence": run(lambda: [translate(model)(s) for s in srcs]),
            "hand, masked batch": run(lambda: model.hand(srcs)),
        },
        args.reps,
    )
    eager_t = median(times["eager per sentence"])
    hand_t = median(times["hand, masked batch"])
    rows = [
        {
            "method": k,
            "median_ms": 1e3 * median(v),
            "vs_eager": median(v) / eager_t,
            "vs_hand": median(v) / hand_t,
            "reps": len(v),
        }
        for k, v in times.items()
    ]
    print(
        f"the tutorial's seq2seq, {args.sources} sources, hidden {args.hidden}, "
        f"{args.threads} thread(s), {'stacked' if args.stacked else 'buffer'}; decoded lengths {lengths[0]}-{lengths[-1]}, "
        f"median {lengths[len(lengths) // 2]}"
    )
    print(table(rows, ["method", "median_ms", "vs_eager", "vs_hand", "reps"]))
    print(f"wrote {write_json('tutorial_seq2seq', {'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
