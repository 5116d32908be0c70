"""Generate the small synthetic sentiment treebank bundled with fold (fold/data/*.txt, and
the same sentences as dependency trees in fold/data/*.conllu).

    python scripts/make_treebank.py            # deterministic: same files every time

Sentences come from a tiny grammar ("the plot was not very good but the cast is superb");
every constituent is labelled 0-4 like SST, from a score that composes the words: adjectives
carry a polarity, intensifiers double the phrase they modify, negators flip it, clauses joined
by "and" add up, and after "but"/"yet" the second clause counts twice.  Labels depend on
words *and* structure, so a TreeLSTM's accuracy climbs visibly as it learns, and a bag of
words cannot reach 100%.

The CoNLL-U files hold each sentence as a dependency tree, converted by head rules: a phrase's
head is its right part's head (the noun of "the plot", the adjective of "was good", the
predicate of a clause), except that a clause joined by a conjunction hangs off the first
clause.  Each word's MISC ``sentiment`` is the label of the largest phrase it heads, so the
root word carries the sentence's label, and a child-sum TreeLSTM over the dependency tree
has the same targets as the binary TreeLSTM over the constituents.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fold.treebank import Tree  # noqa: E402

POLARITY = {
    **dict.fromkeys(
        "good nice fine pleasant decent charming solid funny warm clever fresh smart lively "
        "engaging likable sweet honest neat tidy sharp".split(),
        1,
    ),
    **dict.fromkeys("brilliant superb wonderful masterful stunning moving gorgeous".split(), 2),
    **dict.fromkeys(
        "bad dull weak flat tired bland silly slow stale clumsy thin muddled shallow sloppy "
        "forced cheap lazy messy".split(),
        -1,
    ),
    **dict.fromkeys("awful terrible dreadful painful unwatchable dire hideous".split(), -2),
    **dict.fromkeys("long loud dark quiet strange odd big new old".split(), 0),
}
NOUNS = [
    "movie",
    "film",
    "plot",
    "acting",
    "story",
    "cast",
    "script",
    "score",
    "ending",
    "pacing",
    "dialogue",
]
DETS = ["the", "this", "its", "a"]
VERBS = ["is", "was", "seems", "feels"]
NEGATORS = ["not", "never", "hardly"]
INTENSIFIERS = ["very", "truly", "remarkably", "really"]
CONJ = ["and", "but", "yet"]


def label(score: int) -> int:
    return max(0, min(4, score + 2))


def leaf(word: str, score: int = 0) -> tuple[Tree, int]:
    return Tree(label(score), word=word), score


def join(left: tuple[Tree, int], right: tuple[Tree, int], score: int) -> tuple[Tree, int]:
    return Tree(label(score), left=left[0], right=right[0]), score


def adjective_phrase(rng: random.Random, depth: int = 0) -> tuple[Tree, int]:
    r = rng.random()
    if r < 0.2 and depth < 2:
        inner = adjective_phrase(rng, depth + 1)
        return join(leaf(rng.choice(NEGATORS)), inner, -inner[1])
    if r < 0.45 and depth < 2:
        inner = adjective_phrase(rng, depth + 1)
        return join(leaf(rng.choice(INTENSIFIERS)), inner, 2 * inner[1])
    word = rng.choice(sorted(POLARITY))
    return leaf(word, POLARITY[word])


def clause(rng: random.Random) -> tuple[Tree, int]:
    np_ = join(leaf(rng.choice(DETS)), leaf(rng.choice(NOUNS)), 0)
    ap = adjective_phrase(rng)
    vp = join(leaf(rng.choice(VERBS)), ap, ap[1])
    return join(np_, vp, ap[1])


def sentence(rng: random.Random) -> Tree:
    s = clause(rng)
    for _ in range(rng.choice([0, 0, 1, 1, 2])):
        c = clause(rng)
        word = rng.choice(CONJ)
        # "and" adds the clauses up; "but"/"yet" let the second clause dominate.
        total = s[1] + c[1] if word == "and" else s[1] + 2 * c[1]
        conj = join(leaf(word), c, c[1] if word == "and" else 2 * c[1])
        s = join(s, conj, total)
    return s[0]


UPOS = {
    **dict.fromkeys(POLARITY, "ADJ"),
    **dict.fromkeys(NOUNS, "NOUN"),
    **dict.fromkeys(DETS, "DET"),
    **dict.fromkeys(VERBS, "AUX"),
    **dict.fromkeys(NEGATORS, "PART"),
    **dict.fromkeys(INTENSIFIERS, "ADV"),
    **dict.fromkeys(CONJ, "CCONJ"),
}
DEPREL = {"ADJ": "amod", "NOUN": "nsubj", "DET": "det", "AUX": "cop", "PART": "advmod"}
DEPREL.update({"ADV": "advmod", "CCONJ": "cc"})


def to_conllu(tree: Tree, sent_id: str) -> str:
    """One sentence in CoNLL-U, by the head rules of the module docstring."""
    words: list[Tree] = []
    head_of: dict[int, int] = {}  # constituent id -> index of its head word
    attach: dict[int, tuple[int, str]] = {}  # word index -> (head word index, deprel)
    sentiment: dict[int, int] = {}  # word index -> label of the largest phrase it heads
    for t in tree.postorder():
        if t.left is None:
            words.append(t)
            head_of[id(t)] = len(words) - 1
        else:
            left, right = head_of[id(t.left)], head_of[id(t.right)]
            conj = t.right.left is not None and t.right.left.word in CONJ
            head, dep = (left, right) if conj else (right, left)
            rel = "conj" if conj else DEPREL[UPOS[words[dep].word]]
            attach[dep] = (head, rel)
            head_of[id(t)] = head
        sentiment[head_of[id(t)]] = t.label
    lines = [f"# sent_id = {sent_id}", f"# text = {' '.join(w.word for w in words)}"]
    for i, w in enumerate(words):
        head, rel = attach.get(i, (-1, "root"))
        misc = f"sentiment={sentiment[i]}"
        lines.append(f"{i + 1}\t{w.word}\t_\t{UPOS[w.word]}\t_\t_\t{head + 1}\t{rel}\t_\t{misc}")
    return "\n".join(lines) + "\n"


def main() -> None:
    out = Path(__file__).resolve().parents[1] / "fold" / "data"
    out.mkdir(exist_ok=True)
    rng = random.Random(20261122)
    for split, n in (("train", 2000), ("dev", 300), ("test", 300)):
        trees = [sentence(rng) for _ in range(n)]
        lines = [t.to_string() for t in trees]
        (out / f"{split}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        conll = [to_conllu(t, f"{split}-{i + 1}") for i, t in enumerate(trees)]
        (out / f"{split}.conllu").write_text("\n".join(conll) + "\n", encoding="utf-8")
        print(f"wrote {n} trees to {out / (split + '.txt')} and {split}.conllu")


if __name__ == "__main__":
    main()
