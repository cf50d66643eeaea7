"""kernels.linear.tune's search as its declared stages (TUNE_STAGES) run it, on the CPU: timings stood in for
(each setting gets a fixed pseudo-random time), so what is checked is which settings each stage times, in which
order, and that the pick is the fastest of them. The timings themselves need a GPU (tests/kernels/test_kernels.py)."""

from __future__ import annotations

import ast
import hashlib

import pytest
import torch

pytest.importorskip("triton")

from kernels import linear  # noqa: E402
from kernels import norm as kn  # noqa: E402


@pytest.fixture
def timed(monkeypatch):
    """The settings timed, in order (cuBLAS as "cublas"); each setting's time a fixed function of its text."""
    order: list[str] = []

    def graph_time(fn, reps=20):
        defaults = getattr(fn, "__defaults__", None)
        key = str(defaults[0]) if defaults else "cublas"
        order.append(key)
        return 1e-5 * (1 + int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 1000 / 1000)

    class NoCache:
        def get(self, key):
            return None

        def put(self, *a):
            pass

    monkeypatch.setattr(linear, "graph_time", graph_time)
    monkeypatch.setattr(linear, "_TUNE_CACHE", NoCache())
    # the pick's check against the unfused launches: the same zeros either way
    monkeypatch.setattr(linear, "prologue_linear", lambda p, x, w, *a, **k: torch.zeros(x.shape[0], w.shape[0]))
    monkeypatch.setattr(linear, "glu_after", lambda y, s: y)
    monkeypatch.setattr(kn, "add_rms_norm", lambda y, *a, **k: y)
    return order


def weights(n=2048, k=1024):
    return [torch.zeros(n, k, dtype=torch.bfloat16) for _ in range(2)]


def test_the_stages_are_declared_in_their_order():
    assert [s.name for s in linear.TUNE_STAGES] == ["candidates", "prefetch", "defer", "unroll", "preload"]


def test_many_rows_with_a_norm_prologue_and_epilogue_time_each_stage_after_the_last(timed):
    choice, times = linear.tune(weights(), 32, "norm", epilogue="norm")
    assert timed[0] == "cublas"
    flags = [ast.literal_eval(k) for k in timed[1:]]  # each setting's str(), as `fastest` keys its time
    kinds = ["preload" if f.get("preload") else "defer" if f.get("defer") else "prefetch" if f.get("prefetch")
             else "candidate" for f in flags]  # fmt: skip
    first = {k: kinds.index(k) for k in set(kinds)}
    assert first["candidate"] < first["prefetch"] < first["defer"] < first["preload"], kinds
    assert kinds.count("prefetch") in (2, 3) and kinds.count("defer") == 2 and kinds.count("preload") == 1
    assert all(f.get("norm") for f, k in zip(flags, kinds) if k == "prefetch")  # prefetch: fused prologues only
    assert all(f.get("splits", 1) > 1 for f, k in zip(flags, kinds) if k == "defer")
    assert not any(f.get("unroll") for f in flags)  # unrolled loops: one row only
    fastest = min((t, k) for k, t in times.items() if isinstance(t, float))[1]
    assert (str(choice) if choice is not None else "cublas") == fastest or (
        choice is None and 32 > linear.CUBLAS_MARGIN_ROWS
    )


def test_one_row_unrolls_the_three_fastest_then_preloads_the_pick(timed):
    choice, times = linear.tune(weights(256, 1024), 1, None)
    flags = [ast.literal_eval(k) for k in timed[1:]]
    unrolled = [i for i, f in enumerate(flags) if f.get("unroll")]
    assert len(unrolled) == 3 and not any(f.get("prefetch") or f.get("defer") for f in flags)
    assert all(not f.get("unroll") for f in flags[: unrolled[0]])  # the candidates first
    last = flags[-1]
    assert last.get("preload") and unrolled[-1] < len(flags) - 1
    assert choice is not None and str(choice) == min((t, k) for k, t in times.items() if k != "cublas")[1]
