"""perf/soak.py steady's arithmetic: which windows a compared span takes."""

from __future__ import annotations

from perf.tools.soak import _mean_rate


def window(t: float, tokens: float, seconds: float = 60.0) -> dict:
    return {"t": t, "seconds": seconds, "delta": {"tokens": tokens}}


def test_compared_spans_leave_the_warm_up_window_out():
    # the loop wakes a little late: windows end at 60.1, 120.2, ... (an H200 run's times)
    ws = [window(60.1, 60 * 1800), window(120.2, 60 * 1500), window(180.3, 60 * 1500), window(240.3, 60 * 1400),
          window(300.4, 60 * 1600), window(360.5, 60 * 1600), window(420.0, 60 * 1200, seconds=59.5)]  # fmt: skip
    assert _mean_rate(ws, 60, 180) == 1500  # 60-120 and 120-180: not the warm-up minute ending at 60.1
    end = ws[-1]["t"]
    last = _mean_rate(ws, end - 120, end)  # the windows ending at 360.5 and 420
    assert last == (60 * 1600 + 60 * 1200) / 119.5
    assert _mean_rate(ws, 1000, 1100) != _mean_rate(ws, 1000, 1100)  # no window: nan
