"""Generate the small synthetic sentiment treebank bundled with fold (fold/data/*.txt).

    python scripts/make_treebank.py            # deterministic: same files every time

Sentences come from a tiny grammar ("the plot was not very good but the cast is superb");
every constituent is labelled 0-4 like SST, from a score that composes the words: adjectives
carry a polarity, intensifiers double the phrase they modify, negators flip it, clauses joined
by "and" add up, and after "but"/"yet" the second clause counts twice.  Labels depend on
words *and* structure, so a TreeLSTM's accuracy climbs visibly as it learns, and a bag of
words cannot reach 100%.
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


def main() -> None:
    out = Path(__file__).resolve().parents[1] / "fold" / "data"
    out.mkdir(exist_ok=True)
    rng = random.Random(20261122)
    for split, n in (("train", 2000), ("dev", 300), ("test", 300)):
        lines = [sentence(rng).to_string() for _ in range(n)]
        (out / f"{split}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        print(f"wrote {n} trees to {out / (split + '.txt')}")


if __name__ == "__main__":
    main()
