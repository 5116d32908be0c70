"""The bracket-format treebank reader and the bundled treebank."""

from __future__ import annotations

import random

import pytest

from fold import FoldError
from fold.treebank import Tree, Vocab, bundled_treebank, load_treebank, parse_tree, random_tree


@pytest.mark.parametrize(
    "line",
    ["(3 (2 it) (4 (2 is) (4 great)))", "(1 word)", "(0 (1 (2 a) (3 b)) (4 (2 c) (0 d)))"],
)
def test_parse_round_trip(line: str) -> None:
    assert parse_tree(line).to_string() == line


def test_parse_structure_and_postorder() -> None:
    t = parse_tree("(3 (2 it) (4 (2 is) (4 great)))")
    assert t.label == 3 and t.left.word == "it" and t.right.label == 4
    assert [n.word or n.label for n in t.postorder()] == ["it", "is", "great", 4, 3]
    assert t.leaves() == ["it", "is", "great"] and len(t) == 5


def test_unary_chains_collapse() -> None:
    assert parse_tree("(2 (3 (1 word)))").to_string() == "(2 word)"


@pytest.mark.parametrize("bad", ["(3 (2 it)", "(x word)", "(3 (2 a) (2 b) (2 c))", "3 word)"])
def test_parse_errors(bad: str) -> None:
    with pytest.raises(FoldError, match="parse_tree"):
        parse_tree(bad)


def test_deep_trees_need_no_recursion() -> None:
    line = "(1 a)"
    for _ in range(3000):
        line = f"(2 {line} (1 b))"
    t = parse_tree(line)
    assert len(t.postorder()) == 6001 and t.to_string() == line


def test_bundled_treebank_and_vocab() -> None:
    bank = bundled_treebank()
    assert {k: len(v) for k, v in bank.items()} == {"train": 2000, "dev": 300, "test": 300}
    assert {t.label for t in bank["train"]} == {0, 1, 2, 3, 4}
    vocab = Vocab.from_trees(bank["train"])
    t = vocab.numericalize(bank["dev"][0])
    assert all(isinstance(w, int) and 0 < w < len(vocab) for w in t.leaves())
    assert vocab.numericalize(parse_tree("(2 zzzunseen)")).word == 0


def test_load_treebank_reports_missing_files(tmp_path) -> None:
    (tmp_path / "train.txt").write_text("(1 a)\n")
    with pytest.raises(FoldError, match="dev.txt does not exist"):
        load_treebank(tmp_path)


def test_random_tree_has_the_requested_leaves() -> None:
    t = random_tree(random.Random(0), 17, 50)
    assert isinstance(t, Tree) and len(t.leaves()) == 17 and len(t) == 33


def test_conllu_trees_and_their_errors() -> None:
    from fold.treebank import DepTree, parse_conllu

    text = (
        "# sent_id = a\n"
        "1\tit\t_\tPRON\t_\t_\t2\tnsubj\t_\ttone=2\n"
        "2-3\tworks\t_\t_\t_\t_\t_\t_\t_\t_\n"
        "2\twork\t_\tVERB\t_\t_\t0\troot\t_\ttone=3\n"
        "3\ts\t_\tPART\t_\t_\t2\tdep\t_\ttone=2\n"
        "3.1\tx\t_\tX\t_\t_\t_\t_\t_\t_\n\n"
    )
    (root,) = parse_conllu(text, "misc:tone")
    assert isinstance(root, DepTree) and root.word == "work" and root.label == "3"
    assert [c.word for c in root.children] == ["it", "s"]  # sentence order; ranges skipped
    assert [t.word for t in root.postorder()] == ["it", "s", "work"]
    assert root.depth() == 2 and len(root) == 3
    assert parse_conllu(text)[0].label == "root"
    two_roots = text.replace("2\tdep", "0\tdep")
    with pytest.raises(FoldError, match="sentence a has 2 roots"):
        parse_conllu(two_roots)
    cycle = "1\ta\t_\tX\t_\t_\t0\troot\t_\t_\n2\tb\t_\tX\t_\t_\t3\tdep\t_\t_\n3\tc\t_\tX\t_\t_\t2\tdep\t_\t_\n\n"
    with pytest.raises(FoldError, match="cycle"):
        parse_conllu(cycle)
    with pytest.raises(FoldError, match="has no 'misc:nope'"):
        parse_conllu(text, "misc:nope")


def test_bundled_dependency_treebank_matches_the_bracketed_one() -> None:
    """Same sentences; each root carries its sentence's label; every word a phrase's."""
    from fold.treebank import bundled_dependency_treebank, bundled_treebank

    deps, trees = bundled_dependency_treebank(), bundled_treebank()
    for split in ("train", "dev", "test"):
        assert len(deps[split]) == len(trees[split])
        for d, t in zip(deps[split][:50], trees[split][:50]):
            assert sorted(n.word for n in d.postorder()) == sorted(t.leaves())
            assert d.label == t.label
            assert len(d) == len(t.leaves())


def test_random_dep_tree_respects_the_child_limit() -> None:
    from fold.treebank import random_dep_tree

    rng = random.Random(0)
    for n in (1, 2, 7, 40):
        t = random_dep_tree(rng, n, 100, max_children=3)
        nodes = t.postorder()
        assert len(nodes) == n and max(len(x.children) for x in nodes) <= 3
    with pytest.raises(FoldError, match="words=0"):
        random_dep_tree(rng, 0, 10)
