"""Every scheduler test here also checks `DecodeScheduler.quiet`'s promise, which decode's overlapped steps rely on:
whenever a full plan leaves the scheduler quiet until time T, a second full plan (on a copy) just before T (1,000 s
on when T is never: with no input, nothing falls due) is one more decode token for every running request and
nothing else. That covers a second plan at once too: with no input, what is due only grows with time (waits and
quanta only lengthen)."""

from __future__ import annotations

import copy

import pytest

from backends.pd_decode.scheduler import DecodeScheduler

ACTIONS = ("paused", "transfers", "swap_outs", "swap_ins", "recomputes", "restarted", "resumed_local", "ended",
           "failed", "rotated")  # fmt: skip


def actions(plan) -> list[str]:
    return [k for k in ACTIONS if getattr(plan, k)]


@pytest.fixture(autouse=True)
def quiet_means_nothing_due(monkeypatch, request):
    if request.node.get_closest_marker("no_quiet_probe"):
        yield
        return
    sample = request.node.get_closest_marker("quiet_probe")
    every = sample.kwargs.get("every", 1) if sample else 1
    schedule, seen = DecodeScheduler.schedule, [0]

    def checked(self, decode_only: bool = False):
        plan = schedule(self, decode_only)
        if decode_only or not self.quiet():
            return plan
        seen[0] += 1
        if seen[0] % every == 0:
            now, until = self.clock(), self._quiet_until
            at = max(now, min(until - 1e-6, now + 1000.0))
            later = copy.deepcopy(self)
            later.clock = lambda: at
            again = schedule(later)
            assert not actions(again), (
                f"quiet until {until} after {actions(plan)} at {now}, yet a plan at {at} does {actions(again)}"
            )
        return plan

    monkeypatch.setattr(DecodeScheduler, "schedule", checked)
    yield
