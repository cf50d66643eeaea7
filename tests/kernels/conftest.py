"""Each test tunes afresh: kernels.linear's and kernels.delta_tune's tuning caches are files of the test's own (not
the user's cache)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _own_tuning_cache(tmp_path, monkeypatch):
    try:
        from kernels import delta_tune, linear
    except ImportError:  # no triton: the modules here skip
        yield
        return
    monkeypatch.setattr(linear, "_TUNE_CACHE", linear.TuneCache(tmp_path / "linear-tune.json"))
    monkeypatch.setattr(delta_tune, "_STEP_CACHE", linear.TuneCache(tmp_path / "delta-tune.json", "test"))
    yield
