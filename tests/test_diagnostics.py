"""Per-model diagnostics: running means, TensorBoard curves, the text table."""

from __future__ import annotations

import pytest
import torch

from fold import FoldError
from fold.diagnostics import Aggregator, Diagnostic


def test_aggregator_keeps_weighted_running_means_per_model() -> None:
    agg = Aggregator()
    agg.update({"loss": {"nll": torch.tensor([1.0, 2.0, 3.0])}, "info": {"lr": 0.1}}, weight=1)
    agg.update({"loss": {"nll": torch.tensor([3.0, 4.0, 9.0])}, "info": {"lr": 0.1}}, weight=3)
    d = agg.data
    torch.testing.assert_close(d["loss"]["nll"], torch.tensor([2.5, 3.5, 7.5], dtype=torch.float64))
    assert d.batch == 3 and d.per_model(2) == {"loss/nll": 7.5, "info/lr": 0.1}
    agg.initialize()
    assert agg.data == {}
    with pytest.raises(FoldError, match="had 3 values, now 2"):
        agg.update({"loss": {"nll": [1.0, 2.0, 3.0]}})
        agg.update({"loss": {"nll": [1.0, 2.0]}})


def test_table_has_a_row_per_model() -> None:
    d = Diagnostic({"loss": {"ce": torch.tensor([0.5, 0.25])}, "acc": {"top1": [0.9, 0.95]}})
    text = d.table(names=["lr=0.1", "lr=0.01"])
    lines = text.splitlines()
    assert lines[0].split() == ["model", "loss/ce", "acc/top1"]
    assert lines[2].split() == ["lr=0.1", "0.5", "0.9"] and lines[3].split() == [
        "lr=0.01",
        "0.25",
        "0.95",
    ]
    with pytest.raises(FoldError, match="1 names for 2 models"):
        d.table(names=["x"])
    with pytest.raises(FoldError, match="group 'loss' holds a float"):
        Diagnostic({"loss": 1.0})


def test_log_writes_one_curve_per_model_to_tensorboard(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path))
    for step in range(3):
        Diagnostic(
            {"loss": {"ce": torch.tensor([1.0, 2.0]) / (step + 1)}, "info": {"lr": 0.5}}
        ).log(writer, step)
    writer.close()
    runs = sorted(p for p in tmp_path.rglob("events.*"))
    tags = {}
    for path in runs:
        acc = EventAccumulator(str(path))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            tags[(path.parent.name, tag)] = [e.value for e in acc.Scalars(tag)]
    # add_scalars keeps one run per curve: loss_ce_model_0, loss_ce_model_1
    model_runs = {k: v for k, v in tags.items() if "model_" in k[0]}
    assert sorted(v for v in model_runs.values()) == [
        [1.0, 0.5, pytest.approx(1 / 3)],
        [2.0, 1.0, pytest.approx(2 / 3)],
    ]
    assert any(k[1] == "info/lr" for k in tags)
