from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

# The property tests draw the same examples on every run (a suite that passes once passes
# again: CI does not fail on an example a run happened to draw); FOLD_HYPOTHESIS_RANDOM=1
# draws new ones, to hunt (with more examples: see the settings in the tests).
settings.register_profile("fold", derandomize=not os.environ.get("FOLD_HYPOTHESIS_RANDOM"))
settings.load_profile("fold")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def float64():
    """Float64 throughout a test, so that batched and eager agree to tight tolerances (the
    autobatch test files use it for every test: ``pytestmark``)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.fixture
def recordings(monkeypatch):
    """The count of recordings of a function on lazy rows (the per-example path records
    none), and of examples started per example (coroutines or one after another), as
    autobatch calls them from now on."""
    from fold.autobatch import driver, traced

    counts = {"once": 0, "per example": 0}
    real_once, real_example = traced._record_once, driver._example

    def once(*args, **kwargs):
        counts["once"] += 1
        return real_once(*args, **kwargs)

    def example(*args, **kwargs):
        counts["per example"] += 1
        return real_example(*args, **kwargs)

    monkeypatch.setattr(traced, "_record_once", once)
    monkeypatch.setattr(driver, "_example", example)
    return counts
