"""The progress watchdog with a fake clock."""

from __future__ import annotations

from backends.pd_decode.liveness import ProgressWatchdog


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_reports_a_stall_once_then_again_after_progress():
    c = Clock()
    w = ProgressWatchdog(5.0, clock=c)
    c.t += 4.9
    assert w.check(waiting=True) is None and abs(w.stalled_for(True) - 4.9) < 1e-9
    c.t += 0.2
    assert abs(w.check(waiting=True) - 5.1) < 1e-9 and w.num_stalls == 1
    c.t += 10
    assert w.check(waiting=True) is None and w.num_stalls == 1  # the same stall is reported once
    w.progress()
    assert w.stalled_for(True) == 0.0
    c.t += 6
    assert w.check(waiting=True) is not None and w.num_stalls == 2


def test_nothing_waiting_is_not_a_stall():
    c = Clock()
    w = ProgressWatchdog(1.0, clock=c)
    for _ in range(5):
        c.t += 10
        assert w.check(waiting=False) is None
    assert w.stalled_for(False) == 0.0 and w.num_stalls == 0
    c.t += 0.5
    assert w.check(waiting=True) is None  # waiting starts the clock, it does not inherit the idle time


def test_zero_disables():
    c = Clock()
    w = ProgressWatchdog(0.0, clock=c)
    c.t += 1e6
    assert w.check(waiting=True) is None and w.num_stalls == 0
