"""Dynamic models four ways: eager per example, fold with list arguments (``fold.Ragged``),
fold without them (the best of the workarounds before lists), and hand-batched code.

    python benchmarks/dynamic.py                          # all five models, 1 thread
    python benchmarks/dynamic.py --only childsum gnn --reps 15

- ``childsum``: child-sum TreeLSTM over 64 dependency-like trees (0-5 children per node),
  hidden 150 and 64.  Without lists: one op per child count (``node_fixed`` with k child
  arguments; fold groups it per count).  Hand: level by level, children summed with
  ``index_add``.
- ``attention``: seq2seq decoder (GRU cell) attending over each example's own encoder states
  (5-40 words), 5-30 decoder steps, 64 examples, hidden 128.  Without lists: the memory padded
  to 40 positions with a mask, one op per step.  Hand: padded memory and per-step batching of
  the examples still decoding.
- ``spinn``: SPINN-style shift-reduce encoder with a tracker LSTM, 64 sentences of 5-35
  words, hidden 128.  Its ops have fixed arity, so fold with and without lists are the same
  graph; the two fold columns are the depth and agenda schedules.  Hand: the transitions
  processed in lockstep, one batched tracker and reduce call per transition step.
- ``gnn``: message passing over 64 graphs of 10-40 nodes (3-5 neighbours each), 3 rounds,
  hidden 128.  Without lists: neighbour lists padded to the largest degree with a zero node
  and a mask.  Hand: all graphs as one block-diagonal edge list, ``index_add`` per round.
- ``memory``: 8 examples whatever ``--examples`` says, each a memory of 1000 positions
  (hidden 16) at one of two depths and 200 GRU decoder steps, each step attending over its
  example's memory.  The graph where the agenda's fewer groups cost more: it runs every
  step's attention as one group that copies a memory per step (100 MB), where depth reads
  the memories in place.  One fold column per strategy (no lists).  Hand: the examples in
  lockstep, one GRU and one attention call per step.

Every fold variant is run with ``strategy="auto"`` (the default), ``"depth"``, ``"agenda"``
and ``"lockstep"``.  Before timing, each variant is checked against eager per-example code in
float64, values and gradients.  Timed: forward and backward of a sum over the outputs, fold
time including recording.  Interleaved runs, medians; writes ``dynamic.json``.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved, median, parser, setup, table, write_json  # noqa: E402

import fold  # noqa: E402
from fold.models import (  # noqa: E402
    ChildSumTreeLSTM,
    Graph,
    GraphNet,
    record_dep_tree,
    record_graph,
)
from fold.treebank import DepTree, random_dep_tree  # noqa: E402

STRATEGIES = ("auto", "depth", "agenda", "lockstep")


# --------------------------------------------------------------------------------------------
# Child-sum TreeLSTM


def childsum_data(rng: random.Random, n: int, vocab: int) -> list[DepTree]:
    return [random_dep_tree(rng, rng.randint(5, 35), vocab, max_children=5) for _ in range(n)]


def childsum_eager(model: ChildSumTreeLSTM, trees: list[DepTree]) -> torch.Tensor:
    return torch.cat([model.encode(t)[-1] for t in trees])


def childsum_fold(ragged: bool, strategy: str) -> Callable[..., torch.Tensor]:
    def run(model: ChildSumTreeLSTM, trees: list[DepTree]) -> torch.Tensor:
        f = fold.Fold(strategy=strategy)
        roots = [record_dep_tree(f, t, ragged)[-1] for t in trees]
        return f.apply(model, [roots])[0]

    return run


def childsum_hand(model: ChildSumTreeLSTM, trees: list[DepTree]) -> torch.Tensor:
    """Level by level (a node's level is its height): one call per level, each level's child
    states gathered with one ``index_select`` and summed per parent with ``index_add``."""
    words: list[int] = []
    levels: list[tuple[list[int], list[int], list[int]]] = []  # rows, child rows, child seg
    roots: list[int] = []
    for tree in trees:
        row: dict[int, int] = {}
        height: dict[int, int] = {}
        for t in tree.postorder():
            r = row[id(t)] = len(words)
            words.append(t.word)
            h = height[id(t)] = 1 + max((height[id(c)] for c in t.children), default=-1)
            if h == len(levels):
                levels.append(([], [], []))
            rows, kids, seg = levels[h]
            seg.extend([len(rows)] * len(t.children))
            kids.extend(row[id(c)] for c in t.children)
            rows.append(r)
        roots.append(row[id(tree)])
    hid = model.hidden
    words_t = torch.tensor(words)
    # One buffer written in place: index_select saves only its index, so autograd allows it.
    state = torch.zeros(len(words), 2 * hid, dtype=model.out.weight.dtype)
    for rows, kids, seg in levels:
        rows_t = torch.tensor(rows)
        x = model.word_gates(model.embed(words_t.index_select(0, rows_t)))
        if not kids:
            zero = x.new_zeros(len(rows), hid)
            new = model._combine(x, zero, zero)
        else:
            seg_t = torch.tensor(seg)
            h, c = state.index_select(0, torch.tensor(kids)).split(hid, 1)
            f = torch.sigmoid(x[:, 3 * hid :].index_select(0, seg_t) + model.forget_from_child(h))
            zeros = x.new_zeros(len(rows), hid)
            new = model._combine(x, zeros.index_add(0, seg_t, h), zeros.index_add(0, seg_t, f * c))
        state.index_copy_(0, rows_t, new)
    return state.index_select(0, torch.tensor(roots))


# --------------------------------------------------------------------------------------------
# Seq2seq with attention over each example's own encoder states

Example = tuple[list[int], list[int]]  # source words, target words (decoder inputs)


class Attention(nn.Module):
    """GRU encoder, GRU decoder with dot-product attention over the example's encoder states.
    ``dec_step`` takes the memory as a list argument; ``dec_step_padded`` as a padded tensor
    with a 0/1 mask (``pad_memory`` builds them from separate encoder-state arguments)."""

    def __init__(self, vocab: int, hidden: int, longest: int) -> None:
        super().__init__()
        self.hidden, self.longest = hidden, longest
        self.src_embed = nn.Embedding(vocab, hidden)
        self.tgt_embed = nn.Embedding(vocab, hidden)
        self.encoder = nn.GRUCell(hidden, hidden)
        self.bridge_ = nn.Linear(hidden, hidden)
        self.query = nn.Linear(hidden, hidden, bias=False)
        self.decoder = nn.GRUCell(2 * hidden, hidden)

    def enc_start(self, w: torch.Tensor) -> torch.Tensor:
        x = self.src_embed(w)
        return self.encoder(x, torch.zeros_like(x))

    def enc_step(self, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.src_embed(w), h)

    def bridge(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.bridge_(h))

    def _decode(self, h: torch.Tensor, y: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        return self.decoder(torch.cat([self.tgt_embed(y), ctx], 1), h)

    def dec_step(self, h: torch.Tensor, y: torch.Tensor, memory: fold.Ragged) -> torch.Tensor:
        q = self.query(h).index_select(0, memory.segment_ids)
        weights = memory.softmax((memory.values * q).sum(1))
        ctx = memory.with_values(weights[:, None] * memory.values).sum()
        return self._decode(h, y, ctx)

    def dec_step_padded(
        self, h: torch.Tensor, y: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        scores = torch.bmm(memory, self.query(h)[:, :, None])[:, :, 0]
        weights = scores.masked_fill(mask == 0, float("-inf")).softmax(1)
        return self._decode(h, y, torch.bmm(weights[:, None, :], memory)[:, 0])

    def pad_memory(self, *states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, k = states[0].shape[0], len(states)
        memory = states[0].new_zeros(n, self.longest, self.hidden)
        memory = torch.cat([torch.stack(states, 1), memory[:, k:]], 1)
        mask = torch.zeros(n, self.longest, dtype=memory.dtype)
        mask[:, :k] = 1
        return memory, mask


def attention_data(rng: random.Random, n: int, vocab: int) -> list[Example]:
    return [
        (
            rng.choices(range(vocab), k=rng.randint(5, 40)),
            rng.choices(range(vocab), k=rng.randint(5, 30)),
        )
        for _ in range(n)
    ]


def attention_eager(model: Attention, data: list[Example]) -> torch.Tensor:
    outs = []
    for src, tgt in data:
        h = model.enc_start(torch.tensor(src[:1]))
        enc = [h]
        for w in src[1:]:
            h = model.enc_step(h, torch.tensor([w]))
            enc.append(h)
        memory = torch.stack(enc, 1)  # (1, L, hidden): no padding for one example
        mask = torch.ones(1, len(src), dtype=memory.dtype)
        h = model.bridge(h)
        for y in tgt:
            h = model.dec_step_padded(h, torch.tensor([y]), memory, mask)
            outs.append(h)
    return torch.cat(outs)


def attention_fold(ragged: bool, strategy: str) -> Callable[..., torch.Tensor]:
    def run(model: Attention, data: list[Example]) -> torch.Tensor:
        f = fold.Fold(strategy=strategy)
        add = f.add
        outs = []
        for src, tgt in data:
            h = add("enc_start", src[0])
            enc = [h]
            for w in src[1:]:
                h = add("enc_step", h, w)
                enc.append(h)
            if not ragged:
                memory, mask = add("pad_memory", *enc).split(2)
            h = add("bridge", h)
            for y in tgt:
                if ragged:
                    h = add("dec_step", h, y, enc)
                else:
                    h = add("dec_step_padded", h, y, memory, mask)
                outs.append(h)
        return f.apply(model, [outs])[0]

    return run


def _sorted_prefix_batches(lengths: list[int]) -> tuple[list[int], list[int]]:
    """The order that sorts by length, longest first, and how many are running at each step."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    running = [sum(n > t for n in lengths) for t in range(lengths[order[0]])]
    return order, running


def attention_hand(model: Attention, data: list[Example]) -> torch.Tensor:
    """Length-sorted encoder steps on the running prefix, memory padded with a mask, then
    length-sorted decoder steps; outputs put back in the eager order."""
    src_len = [len(s) for s, _ in data]
    order, running = _sorted_prefix_batches(src_len)
    n, longest = len(data), max(src_len)
    words = torch.zeros(n, longest, dtype=torch.long)
    for row, i in enumerate(order):
        words[row, : src_len[i]] = torch.tensor(data[i][0])
    h = model.enc_start(words[:, 0])
    states = [h]
    for t in range(1, longest):
        k = running[t]
        h = torch.cat([model.enc_step(h[:k], words[:k, t]), h[k:]])
        states.append(h)
    memory = torch.stack(states, 1)  # rows in `order`; a row's last state stays after its end
    mask = torch.zeros(n, longest, dtype=memory.dtype)
    for row, i in enumerate(order):
        mask[row, : src_len[i]] = 1
    rank = torch.empty(n, dtype=torch.long)
    rank[torch.tensor(order)] = torch.arange(n)
    # Decoder: re-sort by target length.
    tgt_len = [len(t) for _, t in data]
    dorder, drunning = _sorted_prefix_batches(tgt_len)
    pick = rank[torch.tensor(dorder)]
    memory, mask, h = memory[pick], mask[pick], model.bridge(h[pick])
    targets = torch.zeros(n, max(tgt_len), dtype=torch.long)
    for row, i in enumerate(dorder):
        targets[row, : tgt_len[i]] = torch.tensor(data[i][1])
    outs = []
    for t in range(len(drunning)):
        k = drunning[t]
        new = model.dec_step_padded(h[:k], targets[:k, t], memory[:k], mask[:k])
        outs.append(new)
        h = torch.cat([new, h[k:]])
    # Rows of step t are examples dorder[:k]; the eager order is example by example.
    offsets = [0]
    for k in drunning:
        offsets.append(offsets[-1] + k)
    drow = {i: row for row, i in enumerate(dorder)}
    where = [offsets[t] + drow[i] for i in range(n) for t in range(tgt_len[i])]
    return torch.cat(outs).index_select(0, torch.tensor(where))


# --------------------------------------------------------------------------------------------
# SPINN shift-reduce encoder with a tracker

SHIFT, REDUCE = 0, 1


class Spinn(nn.Module):
    """SPINN (Bowman et al. 2016): a shift-reduce encoder whose reduce is a TreeLSTM node
    conditioned on a tracker LSTM that reads the buffer top and the stack's top two."""

    def __init__(self, vocab: int, hidden: int, tracker: int) -> None:
        super().__init__()
        self.hidden, self.tracker_size = hidden, tracker
        self.embed = nn.Embedding(vocab, hidden)
        self.leaf_ = nn.Linear(hidden, 2 * hidden)
        self.tracker = nn.LSTMCell(3 * hidden, tracker)
        self.compose = nn.Linear(2 * hidden + tracker, 5 * hidden)

    def zero_state(self, rows: torch.Tensor) -> torch.Tensor:
        """The empty stack's or buffer's state (an int argument only to say how many rows)."""
        return torch.zeros(rows.shape[0], self.hidden, dtype=self.compose.weight.dtype)

    def zero_tracker(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.zeros(rows.shape[0], self.tracker_size, dtype=self.compose.weight.dtype)

    def leaf(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, c = self.leaf_(self.embed(w)).chunk(2, 1)
        return torch.tanh(h), c

    def track(
        self,
        buf: torch.Tensor,
        s1: torch.Tensor,
        s2: torch.Tensor,
        th: torch.Tensor,
        tc: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tracker(torch.cat([buf, s1, s2], 1), (th, tc))

    def reduce(
        self,
        lh: torch.Tensor,
        lc: torch.Tensor,
        rh: torch.Tensor,
        rc: torch.Tensor,
        th: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        i, o, u, fl, fr = self.compose(torch.cat([lh, rh, th], 1)).chunk(5, 1)
        c = torch.sigmoid(i) * torch.tanh(u) + torch.sigmoid(fl) * lc + torch.sigmoid(fr) * rc
        return torch.sigmoid(o) * torch.tanh(c), c


def spinn_data(rng: random.Random, n: int, vocab: int) -> list[tuple[list[int], list[int]]]:
    """Sentences of 5-35 words with the transitions of a random binary tree over them."""
    out = []
    for _ in range(n):
        words = rng.choices(range(vocab), k=rng.randint(5, 35))
        trans, depth = [], 0
        for i in range(len(words)):
            trans.append(SHIFT)
            depth += 1
            while depth >= 2 and (i == len(words) - 1 or rng.random() < 0.5):
                trans.append(REDUCE)
                depth -= 1
        out.append((words, trans))
    return out


def _spinn_walk(
    sentence: tuple[list[int], list[int]],
    leaf: Callable[[int], Any],
    track: Callable[..., Any],
    reduce: Callable[..., Any],
    zeros: tuple[Any, Any],
    tzeros: tuple[Any, Any],
) -> Any:
    """The per-example transition loop, shared by the eager and fold versions: the stack holds
    (h, c) pairs; returns the root's h."""
    words, trans = sentence
    buffer = [leaf(w) for w in words]
    stack: list[Any] = []
    th, tc = tzeros
    b = 0
    for t in trans:
        top = buffer[b] if b < len(buffer) else zeros
        s1 = stack[-1] if stack else zeros
        s2 = stack[-2] if len(stack) > 1 else zeros
        th, tc = track(top[0], s1[0], s2[0], th, tc)
        if t == SHIFT:
            stack.append(buffer[b])
            b += 1
        else:
            (rh, rc), (lh, lc) = stack.pop(), stack.pop()
            stack.append(reduce(lh, lc, rh, rc, th))
    return stack[0][0]


def spinn_eager(model: Spinn, data: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    dtype = model.compose.weight.dtype
    z = torch.zeros(1, model.hidden, dtype=dtype)
    tz = torch.zeros(1, model.tracker_size, dtype=dtype)
    return torch.cat(
        [
            _spinn_walk(
                s,
                lambda w: model.leaf(torch.tensor([w])),
                model.track,
                model.reduce,
                (z, z),
                (tz, tz),
            )
            for s in data
        ]
    )


def spinn_fold(ragged: bool, strategy: str) -> Callable[..., torch.Tensor]:
    del ragged  # fixed-arity ops: the same graph either way

    def run(model: Spinn, data: list[tuple[list[int], list[int]]]) -> torch.Tensor:
        f = fold.Fold(strategy=strategy)
        leaf, track, reduce = (
            f.op("leaf", outputs=2),
            f.op("track", outputs=2),
            f.op("reduce", outputs=2),
        )
        z = f.add("zero_state", 0)  # identical records: one zero node for the graph
        tz = f.add("zero_tracker", 0)
        roots = [_spinn_walk(s, leaf, track, reduce, (z, z), (tz, tz)) for s in data]
        return f.apply(model, [roots])[0]

    return run


def spinn_hand(model: Spinn, data: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """All sentences in lockstep over transition steps (sorted by transition count, so the
    running ones are a prefix): one tracker call per step, one reduce call for the sentences
    reducing at that step.  States live in a buffer (row 0 the zero state), stacks are lists
    of rows."""
    n = len(data)
    order = sorted(range(n), key=lambda i: -len(data[i][1]))
    words = [w for i in order for w in data[i][0]]
    hid = model.hidden
    leaf_h, leaf_c = model.leaf(torch.tensor(words))
    reduces = sum(t for _, tr in data for t in tr)
    H = torch.cat([leaf_h.new_zeros(1, hid), leaf_h, leaf_h.new_zeros(reduces, hid)])
    C = torch.cat([leaf_c.new_zeros(1, hid), leaf_c, leaf_c.new_zeros(reduces, hid)])
    first = [1]
    for i in order:
        first.append(first[-1] + len(data[i][0]))
    next_row = first[-1]
    bufpos = [first[r] for r in range(n)]
    end = [first[r + 1] for r in range(n)]
    stacks: list[list[int]] = [[] for _ in range(n)]
    th = leaf_h.new_zeros(n, model.tracker_size)
    tc = th
    steps = len(data[order[0]][1])
    for t in range(steps):
        k = sum(len(data[i][1]) > t for i in order)
        top = [bufpos[r] if bufpos[r] < end[r] else 0 for r in range(k)]
        s1 = [s[-1] if s else 0 for s in stacks[:k]]
        s2 = [s[-2] if len(s) > 1 else 0 for s in stacks[:k]]
        rows = torch.tensor(top + s1 + s2)
        g = H.index_select(0, rows)
        nh, nc = model.track(g[:k], g[k : 2 * k], g[2 * k :], th[:k], tc[:k])
        th, tc = torch.cat([nh, th[k:]]), torch.cat([nc, tc[k:]])
        red = [r for r in range(k) if data[order[r]][1][t] == REDUCE]
        for r in range(k):
            if data[order[r]][1][t] == SHIFT:
                stacks[r].append(bufpos[r])
                bufpos[r] += 1
        if red:
            left = [stacks[r][-2] for r in red]
            right = [stacks[r][-1] for r in red]
            idx = torch.tensor(left + right)
            hs, cs = H.index_select(0, idx), C.index_select(0, idx)
            m = len(red)
            rh, rc = model.reduce(
                hs[:m], cs[:m], hs[m:], cs[m:], nh.index_select(0, torch.tensor(red))
            )
            new = torch.arange(next_row, next_row + m)
            H = H.index_copy(0, new, rh)
            C = C.index_copy(0, new, rc)
            for j, r in enumerate(red):
                del stacks[r][-2:]
                stacks[r].append(next_row + j)
            next_row += m
    roots = torch.empty(n, dtype=torch.long)
    for r, i in enumerate(order):
        roots[i] = stacks[r][0]
    return H.index_select(0, roots)


# --------------------------------------------------------------------------------------------
# Message-passing GNN

ROUNDS = 3


def gnn_data(rng: random.Random, n: int, types: int) -> list[Graph]:
    graphs = []
    for _ in range(n):
        size = rng.randint(10, 40)
        kinds = [rng.randrange(types) for _ in range(size)]
        nbrs = [
            rng.sample([u for u in range(size) if u != v], rng.randint(3, 5)) for v in range(size)
        ]
        graphs.append((kinds, nbrs))
    return graphs


def gnn_eager(model: GraphNet, graphs: list[Graph]) -> torch.Tensor:
    return torch.cat([model.encode(g, ROUNDS) for g in graphs])


def gnn_fold(ragged: bool, strategy: str) -> Callable[..., torch.Tensor]:
    def run(model: GraphNet, graphs: list[Graph]) -> torch.Tensor:
        f = fold.Fold(strategy=strategy)
        if ragged:
            outs = [f.add("readout", record_graph(f, g, ROUNDS)) for g in graphs]
            return f.apply(model, [outs])[0]
        # Without lists: all final states out, summed per graph outside the Fold.
        states = [h for g in graphs for h in record_graph(f, g, ROUNDS, ragged=False)]
        (h,) = f.apply(model, [states])
        seg = torch.repeat_interleave(torch.tensor([len(g[0]) for g in graphs]))
        return model.out(h.new_zeros(len(graphs), model.hidden).index_add(0, seg, h))

    return run


def gnn_hand(model: GraphNet, graphs: list[Graph]) -> torch.Tensor:
    """All graphs as one block-diagonal edge list: per round one message call, one gather of
    the sources, one ``index_add`` onto the targets, one update call."""
    kinds, src, dst, seg = [], [], [], []
    base = 0
    for gi, (k, nbrs) in enumerate(graphs):
        kinds.extend(k)
        seg.extend([gi] * len(k))
        for v, nb in enumerate(nbrs):
            src.extend(base + u for u in nb)
            dst.extend([base + v] * len(nb))
        base += len(k)
    src_t, dst_t = torch.tensor(src), torch.tensor(dst)
    h = model.start(torch.tensor(kinds))
    for _ in range(ROUNDS):
        m = model.message(h).index_select(0, src_t)
        h = model.cell(h.new_zeros(h.shape).index_add(0, dst_t, m), h)
    total = h.new_zeros(len(graphs), model.hidden).index_add(0, torch.tensor(seg), h)
    return model.out(total)


# --------------------------------------------------------------------------------------------
# Decoder steps reading per-example memories (the graph where the agenda's plan copies)

MEMORY_LEN, MEMORY_STEPS, MEMORY_EXAMPLES = 1000, 200, 8


class Memory(nn.Module):
    """Each example encodes a memory of ``MEMORY_LEN`` positions (odd examples through one
    more layer, so the memories sit at two depths); a GRU decoder runs ``MEMORY_STEPS``
    steps, and every step's state attends over its example's memory (``use``).  Nothing
    reads ``use``'s output but the loss, so the agenda lets all of them wait and runs them
    as one group that gathers one memory per step; depth runs them step by step, reading
    the memories where they are."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pre_ = nn.Linear(hidden, hidden)
        self.enc_ = nn.Linear(hidden, hidden)
        self.cell = nn.GRUCell(hidden, hidden)
        self.query = nn.Linear(hidden, hidden)

    def pre(self, m: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.pre_(m))

    def enc(self, words: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.enc_(self.embed(words)))

    def start(self, y: torch.Tensor) -> torch.Tensor:
        return self.cell(self.embed(y))

    def step(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.cell(self.embed(y), h)

    def use(self, h: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        weights = torch.bmm(memory, self.query(h)[:, :, None])[:, :, 0].softmax(1)
        return torch.bmm(weights[:, None], memory)[:, 0]


MemoryExample = tuple[torch.Tensor, list[int]]  # memory words (1, MEMORY_LEN), decoder inputs


def memory_data(rng: random.Random, vocab: int) -> list[MemoryExample]:
    """``MEMORY_EXAMPLES`` examples whatever ``--examples`` says: the graph's size is set by
    its memories and steps."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    return [
        (
            torch.randint(vocab, (1, MEMORY_LEN), generator=gen),
            [rng.randrange(vocab) for _ in range(MEMORY_STEPS + 1)],
        )
        for _ in range(MEMORY_EXAMPLES)
    ]


def _memory_of(model: Memory, i: int, words: torch.Tensor) -> torch.Tensor:
    m = model.enc(words)
    return model.pre(m) if i % 2 else m


def memory_eager(model: Memory, data: list[MemoryExample]) -> torch.Tensor:
    outs = []
    for i, (words, ys) in enumerate(data):
        memory = _memory_of(model, i, words)
        h = model.start(torch.tensor(ys[:1]))
        for y in ys[1:]:
            h = model.step(h, torch.tensor([y]))
            outs.append(model.use(h, memory))
    return torch.cat(outs)


def memory_fold(ragged: bool, strategy: str) -> Callable[..., torch.Tensor]:
    def run(model: Memory, data: list[MemoryExample]) -> torch.Tensor:
        f = fold.Fold(strategy=strategy)
        add = f.add
        outs = []
        for i, (words, ys) in enumerate(data):
            memory = add("enc", words)
            if i % 2:
                memory = add("pre", memory)
            h = add("start", ys[0])
            for y in ys[1:]:
                h = add("step", h, y)
                outs.append(add("use", h, memory))
        return f.apply(model, [outs])[0]

    return run


def memory_hand(model: Memory, data: list[MemoryExample]) -> torch.Tensor:
    """The examples in lockstep (they have the same number of steps): the memories encoded
    in one call, the odd ones' extra layer in another, then per step one GRU call and one
    attention call over all examples."""
    words = torch.cat([w for w, _ in data])
    memory = model.enc(words)
    odd = torch.arange(1, len(data), 2)
    memory = memory.index_copy(0, odd, model.pre(memory.index_select(0, odd)))
    ys = torch.tensor([y for _, y in data])
    h = model.start(ys[:, 0])
    outs = []
    for t in range(1, ys.shape[1]):
        h = model.step(h, ys[:, t])
        outs.append(model.use(h, memory))
    return torch.stack(outs, 1).reshape(-1, h.shape[1])


# --------------------------------------------------------------------------------------------
# Driver

MODELS: dict[str, dict[str, Any]] = {
    "childsum": {
        "make": lambda hidden: ChildSumTreeLSTM(10_000, hidden),
        "data": lambda rng, n: childsum_data(rng, n, 10_000),
        "eager": childsum_eager,
        "fold": childsum_fold,
        "hand": childsum_hand,
        "hidden": (150, 64),
    },
    "attention": {
        "make": lambda hidden: Attention(1000, hidden, 40),
        "data": lambda rng, n: attention_data(rng, n, 1000),
        "eager": attention_eager,
        "fold": attention_fold,
        "hand": attention_hand,
        "hidden": (128,),
    },
    "spinn": {
        "make": lambda hidden: Spinn(10_000, hidden, 64),
        "data": lambda rng, n: spinn_data(rng, n, 10_000),
        "eager": spinn_eager,
        "fold": spinn_fold,
        "hand": spinn_hand,
        "hidden": (128,),
    },
    "gnn": {
        "make": lambda hidden: GraphNet(16, hidden),
        "data": lambda rng, n: gnn_data(rng, n, 16),
        "eager": gnn_eager,
        "fold": gnn_fold,
        "hand": gnn_hand,
        "hidden": (128,),
    },
    "memory": {
        "make": lambda hidden: Memory(100, hidden),
        "data": lambda rng, n: memory_data(rng, 100),
        "eager": memory_eager,
        "fold": memory_fold,
        "hand": memory_hand,
        "hidden": (16,),
    },
}


def _grads(model: nn.Module, forward: Callable[..., torch.Tensor], data: Any) -> tuple:
    model.zero_grad(set_to_none=True)
    out = forward(model, data)
    (out * torch.linspace(-1, 1, out.numel()).view(out.shape).to(out.dtype)).sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def check(spec: dict[str, Any], hidden: int, data: Any, variants: dict[str, Callable]) -> None:
    """Every variant computes what eager per-example code computes: float64, values and
    gradients (of a weighted sum, so a misplaced row shows)."""
    torch.manual_seed(1)
    model = spec["make"](min(hidden, 32)).double()
    want, want_g = _grads(model, spec["eager"], data)
    for name, fn in variants.items():
        got, got_g = _grads(model, fn, data)
        torch.testing.assert_close(
            got, want, rtol=1e-9, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}"
        )
        assert len(got_g) == len(want_g), name
        for a, b in zip(got_g, want_g):
            torch.testing.assert_close(
                a, b, rtol=1e-8, atol=1e-9, msg=lambda m, n=name: f"{n}: {m}"
            )


def train_step(model: nn.Module, fn: Callable[..., torch.Tensor], data: Any) -> Callable[[], None]:
    """One timed step: forward and backward of a sum over ``fn(model, data)``."""

    def go() -> None:
        model.zero_grad(set_to_none=True)
        fn(model, data).sum().backward()

    return go


def main() -> None:
    ap = parser(__doc__, device=False)
    ap.add_argument("--only", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--examples", type=int, default=64)
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--eager-reps", type=int, default=3)
    ap.add_argument(
        "--default-only",
        action="store_true",
        help="time fold's default (list arguments, strategy auto) against hand alone, as a "
        "user meets it; without it every strategy, with and without list arguments, is "
        "interleaved with hand in one round-robin",
    )
    args = ap.parse_args()
    setup(args)
    rows = []
    for name in args.only:
        spec = MODELS[name]
        data = spec["data"](random.Random(0), args.examples)
        variants = {"hand": spec["hand"]}
        for strategy in ("auto",) if args.default_only else STRATEGIES:
            variants[f"ragged/{strategy}"] = spec["fold"](True, strategy)
            if name not in ("spinn", "memory") and not args.default_only:
                variants[f"without/{strategy}"] = spec["fold"](False, strategy)
        check(spec, spec["hidden"][0], data, variants)
        for hidden in spec["hidden"]:
            torch.manual_seed(0)
            model = spec["make"](hidden)

            times = interleaved(
                {k: train_step(model, v, data) for k, v in variants.items()}, args.reps
            )
            eager = train_step(model, spec["eager"], data)
            times.update(interleaved({"eager": eager}, args.eager_reps, warmup=0))
            med = {k: median(v) for k, v in times.items()}
            row: dict[str, Any] = {"model": name, "hidden": hidden, "hand ms": 1e3 * med["hand"]}
            row["eager/hand"] = med["eager"] / med["hand"]
            for k in variants:
                if k != "hand":
                    row[f"{k}/hand"] = med[k] / med["hand"]
            rows.append(row)
            print(f"  {name} hidden {hidden} done", flush=True)
    cols = sorted({k for r in rows for k in r}, key=lambda k: (k.count("/") and 1, k))
    cols = ["model", "hidden", "hand ms", "eager/hand"] + [
        c for c in cols if "/" in c and c != "eager/hand"
    ]
    print(
        f"forward+backward, {args.examples} examples, {args.threads} thread(s); ratios of medians"
    )
    print(table(rows, cols))
    print(f"wrote {write_json('dynamic', {'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
