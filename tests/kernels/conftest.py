"""Each test tunes afresh: kernels.linear's tuning cache is a file of the test's own (not the user's cache)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _own_tuning_cache(tmp_path, monkeypatch):
    try:
        from kernels import linear
    except ImportError:  # no triton: the modules here skip
        yield
        return
    monkeypatch.setattr(linear, "_TUNE_CACHE", linear.TuneCache(tmp_path / "linear-tune.json"))
    yield
