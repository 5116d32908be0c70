"""Value tables sized to what they hold: per-example memories read by many decoder steps.

8 examples, each with a memory of shape (1000, 16) (an encoder's states), read by a decoder
of 200 steps that attends over its example's memory (a softmax over the 1000 rows).  Two
graphs with the same ops and values:

- ``spread``: the memories are made at different depths (example i's memory after i
  ``pre`` steps), so they are outputs of 8 different groups, and every decoder step's memory
  column draws rows from several of them: a value table of the memories' class, read by an
  ``index_select`` per step, whose backward fills a gradient of the whole table.
- ``one depth``: all memories made by one group: each step's column is rows of one source.

Before value tables were sized per class, the table reserved a row for every node left in
the plan (3211 rows of 1000 x 16 here), and backward took 50 s instead of 56 ms.  Printed:
forward+backward medians of both graphs (interleaved reps, one thread) and their ratio
(target: spread / one depth <= 2), with values and gradients checked against eager first.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved, median, parser, setup, table, write_json  # noqa: E402

import fold  # noqa: E402


class Attend(nn.Module):
    def __init__(self, rows: int = 1000, dim: int = 16) -> None:
        super().__init__()
        self.memory = nn.Parameter(torch.randn(rows, dim) / dim**0.5)
        self.cell = nn.Linear(2 * dim, dim)
        self.dim = dim

    def pre(self, k: torch.Tensor) -> torch.Tensor:  # a step before the memory (depth)
        return k * 0.5

    def mem(self, k: torch.Tensor) -> torch.Tensor:  # example k's memory: (n, rows, dim)
        k = k.to(self.memory.dtype)
        return torch.tanh(self.memory[None] * (1 + 0.1 * k[:, None, None]))

    def start(self, k: torch.Tensor) -> torch.Tensor:
        return k[:, None].to(self.memory.dtype).expand(-1, self.dim) * 0.01

    def step(self, h: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        scores = torch.einsum("nrd,nd->nr", memory, h)
        read = torch.einsum("nr,nrd->nd", scores.softmax(-1), memory)
        return torch.tanh(self.cell(torch.cat([h, read], -1)))


def record(f: fold.Fold | fold.Unfold, examples: int, steps: int, spread: bool) -> list:
    outs = []
    for i in range(examples):
        k = f.add("pre", float(i))
        for _ in range(i if spread else 0):
            k = f.add("pre", k)
        memory = f.add("mem", k) if spread else f.add("mem", float(i) / 2**i)
        h = f.add("start", float(i))
        for _ in range(steps):
            h = f.add("step", h, memory)
        outs.append(h)
    return outs


def main() -> None:
    ap = parser(__doc__, device=False)
    ap.add_argument("--examples", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    setup(args)
    torch.manual_seed(0)
    model = Attend().double()

    def run(spread: bool):
        def go() -> None:
            f = fold.Fold()
            (h,) = f.apply(model, [record(f, args.examples, args.steps, spread)])
            model.zero_grad(set_to_none=True)
            h.square().sum().backward()

        return go

    for spread in (True, False):  # fold == eager, values and gradients, float64
        f, u = fold.Fold(), fold.Unfold(model)
        (got,) = f.apply(model, [record(f, args.examples, 20, spread)])
        (want,) = u.apply(model, [record(u, args.examples, 20, spread)])
        g = torch.autograd.grad(got.square().sum(), list(model.parameters()))
        w = torch.autograd.grad(want.square().sum(), list(model.parameters()))
        torch.testing.assert_close(got, want)
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b)
    model = model.float()
    times = interleaved({"spread": run(True), "one depth": run(False)}, args.reps)
    med = {k: median(v) for k, v in times.items()}
    rows = [
        {"graph": k, "median_ms": 1e3 * v, "vs_one_depth": v / med["one depth"]}
        for k, v in med.items()
    ]
    print(
        f"{args.examples} memories of (1000, 16) read by {args.steps} decoder steps each, "
        f"forward+backward, {args.threads} thread(s), {args.reps} reps"
    )
    print(table(rows, ["graph", "median_ms", "vs_one_depth"]))
    print(f"wrote {write_json('memory_tables', {'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
