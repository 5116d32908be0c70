"""Models of PyTorch's NLP tutorials, run as the tutorials write them, for ONE example, under
autobatch; against eager per example and the same model run on the whole batch by hand.

    python benchmarks/tutorials.py                  # both, 64 examples, 1 thread
    python benchmarks/tutorials.py --reps 9 --save
    python benchmarks/tutorials.py --only names     # one workload

``seq2seq``: greedy decoding with the model of the translation tutorial.  The model is the
tutorial's ("NLP From Scratch: Translation with a Sequence to Sequence
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

``names``: the character-level name generator of "NLP From Scratch: Generating Names with
a Character-Level RNN": an ``RNN`` module of the tutorial's own (``Linear`` layers over
``torch.cat((category, input, hidden), 1)``, a Dropout, ``LogSoftmax``, all on batches of
one), and its ``sample``: one-hot inputs made per letter (``torch.zeros`` and an in-place
1), ``topi = output.topk(1)[1][0][0]``, ``if topi == n_letters - 1: break``, the letter
``all_letters[topi]`` (reads), untrained, greedy, for 64 (category, first letter) pairs;
hand: the module on the batch of 64, letter after letter, until every name has ended.

All three give the same tokens (float64) before timing.  Interleaved, medians, one thread.
"""

from __future__ import annotations

import string
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


ALL_LETTERS = string.ascii_letters + " .,;'-"
N_LETTERS = len(ALL_LETTERS) + 1  # and EOS
N_CATEGORIES = 18
MAX_NAME = 20


class NameRNN(nn.Module):
    """The tutorial's ``RNN`` (its category, input and hidden concatenated per step)."""

    def __init__(self, input_size: int, hidden_size: int, output_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.i2h = nn.Linear(N_CATEGORIES + input_size + hidden_size, hidden_size)
        self.i2o = nn.Linear(N_CATEGORIES + input_size + hidden_size, output_size)
        self.o2o = nn.Linear(hidden_size + output_size, output_size)
        self.dropout = nn.Dropout(0.1)
        self.softmax = nn.LogSoftmax(dim=1)

    def forward(self, category, input, hidden):  # type: ignore[no-untyped-def]
        input_combined = torch.cat((category, input, hidden), 1)
        hidden = self.i2h(input_combined)
        output = self.i2o(input_combined)
        output_combined = torch.cat((hidden, output), 1)
        output = self.o2o(output_combined)
        output = self.dropout(output)
        output = self.softmax(output)
        return output, hidden

    def initHidden(self) -> torch.Tensor:  # noqa: N802  (the tutorial's name)
        return torch.zeros(1, self.hidden_size)


def category_tensor(i: int) -> torch.Tensor:
    tensor = torch.zeros(1, N_CATEGORIES)
    tensor[0][i] = 1
    return tensor


def input_tensor(line: str) -> torch.Tensor:
    tensor = torch.zeros(len(line), 1, N_LETTERS)
    for li in range(len(line)):
        tensor[li][0][ALL_LETTERS.find(line[li])] = 1
    return tensor


def sample(rnn: NameRNN, category: int, start_letter: str) -> str:
    """The tutorial's ``sample`` (greedy): one name, letter after letter, until EOS."""
    category_t = category_tensor(category)
    input = input_tensor(start_letter)
    hidden = rnn.initHidden()
    output_name = start_letter
    for _ in range(MAX_NAME):
        output, hidden = rnn(category_t, input[0], hidden)
        topv, topi = output.topk(1)
        topi = topi[0][0]
        if topi == N_LETTERS - 1:
            break
        letter = ALL_LETTERS[topi]
        output_name += letter
        input = input_tensor(letter)
    return output_name


def sample_hand(rnn: NameRNN, categories: list[int], starts: list[str]) -> list[str]:
    """Every name at once: the module on the batch, letter after letter, until all ended."""
    n = len(categories)
    category_t = torch.zeros(n, N_CATEGORIES)
    category_t[torch.arange(n), torch.tensor(categories)] = 1
    letters = torch.tensor([ALL_LETTERS.find(c) for c in starts])
    hidden = torch.zeros(n, rnn.hidden_size)
    names, done = list(starts), [False] * n
    for _ in range(MAX_NAME):
        input = torch.zeros(n, N_LETTERS)
        input[torch.arange(n), letters] = 1
        output, hidden = rnn(category_t, input, hidden)
        letters = output.topk(1)[1][:, 0]
        for i, t in enumerate(letters.tolist()):
            if not done[i]:
                if t == N_LETTERS - 1:
                    done[i] = True
                else:
                    names[i] += ALL_LETTERS[t]
        if all(done):
            break
        letters = letters.clamp(max=N_LETTERS - 2)  # (ended names: any letter, unread)
    return names


def sources(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 31, (n,), generator=g)
    return [torch.randint(2, VOCAB, (int(k),), generator=g) for k in lengths]


def _rows(times: dict[str, list[float]]) -> list[dict]:
    eager_t = median(times["eager per example"])
    hand_t = median(times["hand, batched"])
    return [
        {
            "method": k,
            "median_ms": 1e3 * median(v),
            "vs_eager": median(v) / eager_t,
            "vs_hand": median(v) / hand_t,
            "reps": len(v),
        }
        for k, v in times.items()
    ]


def _no_grad(fn):  # type: ignore[no-untyped-def]
    def go() -> None:
        with torch.no_grad():
            fn()

    return go


def seq2seq_rows(args) -> tuple[list[dict], str]:  # type: ignore[no-untyped-def]
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
    times = interleaved(
        {
            "autobatch": _no_grad(lambda: fold.autobatch(translate(model), srcs, stack=False)),
            "eager per example": _no_grad(lambda: [translate(model)(s) for s in srcs]),
            "hand, batched": _no_grad(lambda: model.hand(srcs)),
        },
        args.reps,
    )
    title = (
        f"the translation tutorial's seq2seq, {args.sources} sources, hidden {args.hidden}, "
        f"{'stacked' if args.stacked else 'buffer'}; decoded lengths {lengths[0]}-"
        f"{lengths[-1]}, median {lengths[len(lengths) // 2]}"
    )
    return _rows(times), title


def names_rows(args) -> tuple[list[dict], str]:  # type: ignore[no-untyped-def]
    categories = [i % N_CATEGORIES for i in range(args.sources)]
    starts = [ALL_LETTERS[26 + i % 26] for i in range(args.sources)]
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    rnn = NameRNN(N_LETTERS, args.hidden, N_LETTERS).eval()

    def auto() -> list[str]:
        return fold.autobatch(lambda c, s: sample(rnn, c, s), categories, starts, stack=False)

    with torch.no_grad():
        eager = [sample(rnn, c, s) for c, s in zip(categories, starts)]
        assert eager == auto() == sample_hand(rnn, categories, starts)
    lengths = sorted(len(e) for e in eager)
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)
    rnn = NameRNN(N_LETTERS, args.hidden, N_LETTERS).eval()
    times = interleaved(
        {
            "autobatch": _no_grad(auto),
            "eager per example": _no_grad(
                lambda: [sample(rnn, c, s) for c, s in zip(categories, starts)]
            ),
            "hand, batched": _no_grad(lambda: sample_hand(rnn, categories, starts)),
        },
        args.reps,
    )
    title = (
        f"the name-generation tutorial's RNN, {args.sources} names, hidden {args.hidden}; "
        f"lengths {lengths[0]}-{lengths[-1]}, median {lengths[len(lengths) // 2]}"
    )
    return _rows(times), title


def main() -> None:
    ap = parser(__doc__, device=False)
    ap.add_argument("--sources", type=int, default=64, help="examples (sources, names)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument(
        "--stacked", action="store_true", help="seq2seq: the encoder's outputs stacked from a list"
    )
    ap.add_argument("--only", nargs="+", choices=["seq2seq", "names"], default=["seq2seq", "names"])
    args = ap.parse_args()
    setup(args)
    out: dict[str, Any] = {"args": vars(args)}
    for name, rows_of in (("seq2seq", seq2seq_rows), ("names", names_rows)):
        if name in args.only:
            rows, title = rows_of(args)
            out[name] = rows
            print(f"\n{title}, {args.threads} thread(s)")
            print(table(rows, ["method", "median_ms", "vs_eager", "vs_hand", "reps"]))
    print(f"wrote {write_json('tutorials', out)}")


if __name__ == "__main__":
    main()
