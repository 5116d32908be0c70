"""The README quickstart and the examples run end to end (with small settings)."""

from __future__ import annotations

import re
import struct
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> str:
    res = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_readme_quickstart_runs() -> None:
    code = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[0]
    namespace: dict[str, object] = {}
    exec(compile(code, "README quickstart", "exec"), namespace)
    assert namespace["h"].shape == (2, 64)  # type: ignore[attr-defined]
    assert namespace["model"].node_gates.weight.grad is not None  # type: ignore[attr-defined]


def test_tree_lstm_example_learns(tmp_path: Path) -> None:
    out = run(
        "examples/tree_lstm.py",
        "--epochs",
        "2",
        "--train-size",
        "400",
        "--speed-trees",
        "20",
        "--lr",
        "0.01",
        "--save",
        str(tmp_path / "tree.pt"),
    )
    saved = torch.load(tmp_path / "tree.pt", weights_only=True)
    assert "node_gates.weight" in saved
    assert "1 thread)" in out  # the speed line says how it was measured
    before = float(re.search(r"before training: ([\d.]+)%", out).group(1))
    last = float(re.findall(r"dev accuracy ([\d.]+)%", out)[-1])
    assert last > before + 20, out
    assert re.search(r"eager \d+ trees/s, fold \d+ trees/s", out)


def write_idx(path: Path, t: torch.Tensor) -> None:
    header = bytes([0, 0, 8, t.dim()]) + struct.pack(f">{t.dim()}I", *t.shape)
    path.write_bytes(header + t.to(torch.uint8).numpy().tobytes())


def write_fake_mnist(directory: Path) -> None:
    """IDX files of 320 28x28 images that encode their label in one bright row."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 10, (320,), generator=g)
    # Images that encode their label, so the MLP can learn something in one epoch.
    images = torch.zeros(320, 28, 28)
    images[torch.arange(320), labels * 2, 5:20] = 255
    for stem, sl in (("train", slice(0, 256)), ("t10k", slice(256, 320))):
        write_idx(directory / f"{stem}-images-idx3-ubyte", images[sl])
        write_idx(directory / f"{stem}-labels-idx1-ubyte", labels[sl])


def test_mnist_example_reads_idx_files(tmp_path: Path) -> None:
    write_fake_mnist(tmp_path)
    out = run(
        "examples/mnist_per_sample.py",
        "--data",
        str(tmp_path),
        "--epochs",
        "3",
        "--speed-steps",
        "2",
        "--save",
        str(tmp_path / "mlp.pt"),
    )
    assert (tmp_path / "mlp.pt").exists()
    assert "256 training images of (28, 28)" in out
    acc = float(re.findall(r"test accuracy ([\d.]+)%", out)[-1])
    assert acc > 50, out


def test_sweep_example_trains_models_with_their_own_learning_rates(tmp_path: Path) -> None:
    out = run(
        "examples/sweep_tree_lstm.py",
        "--models",
        "3",
        "--epochs",
        "2",
        "--train-size",
        "300",
        "--speed-trees",
        "20",
        "--lr-min",
        "1e-4",
        "--lr-max",
        "3e-2",
        "--out",
        str(tmp_path),
    )
    rows = re.findall(r"^lr=(\S+) +(\S+) +(\S+) +(\S+)", out, re.M)
    assert len(rows) == 3, out
    # the largest learning rate learns the most in two epochs; the smallest barely moves
    assert float(rows[-1][1]) < float(rows[0][1]), out
    assert (tmp_path / "accuracy.png").exists() and list(tmp_path.glob("events.*"))
    assert re.search(r"one fold \d+ trees/s, 3 models one after another \d+ trees/s", out)


def test_mnist_sweep_example(tmp_path: Path) -> None:
    write_fake_mnist(tmp_path)
    out = run("examples/mnist_sweep.py", "--data", str(tmp_path), "--models", "3", "--epochs", "2")
    rows = re.findall(r"^lr=(\S+) +(\S+) +(\S+) +(\S+)", out, re.M)
    assert len(rows) == 3, out
    assert max(float(r[3]) for r in rows) > 0.5, out  # the images encode their label
    assert "one BatchModule" in out


def test_ddp_example_runs_on_two_cpu_ranks() -> None:
    out = run(
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "examples/ddp_tree_lstm.py",
        "--epochs",
        "1",
        "--device",
        "cpu",
    )
    assert re.search(r"epoch 1: mean loss [\d.]+, dev root accuracy [\d.]+% \(2 ranks\)", out), out


def test_ddp_example_runs_without_torchrun() -> None:
    out = run("examples/ddp_tree_lstm.py", "--epochs", "1")
    assert "not started by torchrun: running as 1 process" in out
    assert re.search(r"epoch 1: mean loss [\d.]+, dev root accuracy [\d.]+% \(1 ranks\)", out), out


CONLLU = """# sent_id = {i}
1\tthe\t_\tDET\t_\t_\t2\tdet\t_\t_
2\tcat\t_\tNOUN\t_\t_\t3\tnsubj\t_\t_
3\tsat\t_\tVERB\t_\t_\t0\troot\t_\t_
4\ton\t_\tADP\t_\t_\t6\tcase\t_\t_
5\tthe\t_\tDET\t_\t_\t6\tdet\t_\t_
6\tmat\t_\tNOUN\t_\t_\t3\tobl\t_\t_

"""


def test_childsum_example_learns_on_bundled_trees_and_reads_conllu(tmp_path: Path) -> None:
    out = run(
        "examples/childsum_tree_lstm.py",
        "--epochs",
        "2",
        "--train-size",
        "400",
        "--speed-trees",
        "20",
        "--lr",
        "0.01",
    )
    before = float(re.search(r"before training: ([\d.]+)%", out).group(1))
    last = float(re.findall(r"dev root accuracy ([\d.]+)%", out)[-1])
    assert last > before + 10, out
    assert re.search(r"eager \d+ trees/s, fold \d+ trees/s", out)
    for split in ("train", "dev", "test"):
        text = "".join(CONLLU.format(i=i) for i in range(20))
        (tmp_path / f"xx_{split}.conllu").write_text(text)
    out = run(
        "examples/childsum_tree_lstm.py",
        "--data",
        str(tmp_path),
        "--label",
        "upos",
        "--epochs",
        "1",
        "--speed-trees",
        "5",
    )
    assert "train 20, dev 20, test 20 trees" in out and "4 labels, 0-2 children" in out, out


def test_gnn_example_learns() -> None:
    out = run("examples/gnn.py", "--graphs", "600", "--epochs", "3", "--speed-graphs", "32")
    first = float(re.search(r"before training: ([\d.]+)%", out).group(1))
    last = float(re.findall(r"test accuracy ([\d.]+)%", out)[-1])
    assert last > max(first, 50.0) + 25, out
    assert re.search(r"eager \d+ graphs/s, fold \d+ graphs/s", out)


def test_autobatch_tree_lstm_example_learns() -> None:
    out = run(
        "examples/autobatch_tree_lstm.py",
        "--epochs",
        "2",
        "--train-size",
        "800",
        "--speed-trees",
        "25",
        "--hidden",
        "32",
        "--lr",
        "0.01",
    )
    accs = [float(a) for a in re.findall(r"dev accuracy ([\d.]+)%", out)]
    assert accs[-1] > accs[0] + 10 and accs[-1] > 60, out
    assert re.search(r"eager \d+ trees/s, autobatch \d+ trees/s", out)


def test_autobatch_mnist_example_learns(tmp_path: Path) -> None:
    write_fake_mnist(tmp_path)
    out = run(
        "examples/autobatch_mnist.py",
        "--data",
        str(tmp_path),
        "--epochs",
        "3",
        "--speed-steps",
        "2",
    )
    acc = float(re.findall(r"test accuracy ([\d.]+)%", out)[-1])
    assert acc > 50, out
    assert "autobatch / batched" in out


def test_autobatch_decode_example_learns_and_decodes_batched() -> None:
    """The per-example seq2seq trained through autobatch (teacher forcing) learns to reverse
    digit strings; its greedy decoding (a read per step) makes the same decisions batched
    as eagerly (the script checks that) and says how fast each was."""
    out = run(
        "examples/autobatch_decode.py",
        "--epochs",
        "2",
        "--train-size",
        "800",
        "--test-size",
        "60",
    )
    before = float(re.search(r"before training: ([\d.]+)%", out).group(1))
    last = float(re.findall(r"test exact match ([\d.]+)%", out)[-1])
    assert last > before + 10, out
    assert re.search(r"eager \d+ examples/s, autobatch \d+ examples/s", out), out


def test_autobatch_parser_example_learns_and_parses_batched() -> None:
    """The per-sentence arc-standard parser trained on oracle transitions through autobatch
    learns the bundled treebank; parsing with its own transitions (a read per step) gives
    the same heads batched as eagerly (the script checks that) and says how fast each was."""
    out = run(
        "examples/autobatch_parser.py",
        "--epochs",
        "1",
        "--train-size",
        "400",
        "--dev-size",
        "40",
    )
    before = float(re.search(r"before training: ([\d.]+)%", out).group(1))
    last = float(re.findall(r"dev UAS ([\d.]+)%", out)[-1])
    assert last > before + 20, out
    assert re.search(r"eager \d+ sentences/s, autobatch \d+ sentences/s", out), out
