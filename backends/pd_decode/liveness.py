"""Decode's progress watchdog: notices when requests wait and nothing moves for a while (no token sent, no
transfer started or answered, no request ended), so an idle decode with work waiting is reported in metrics and in
the log instead of going unseen. Plain Python with an injectable clock."""

from __future__ import annotations

import time
from collections.abc import Callable


class ProgressWatchdog:
    """`progress()` on every sign of life; `check(waiting)` once per loop iteration. A stall is reported once, when
    it passes `stall_seconds`; progress (or nothing waiting) ends it."""

    def __init__(self, stall_seconds: float, clock: Callable[[], float] = time.monotonic):
        self.stall_seconds, self.clock = stall_seconds, clock
        self.last = clock()
        self.reported = False
        self.num_stalls = 0

    def progress(self) -> None:
        self.last = self.clock()
        self.reported = False

    def stalled_for(self, waiting: bool) -> float:
        """Seconds without progress while work waits (0 when nothing waits)."""
        return self.clock() - self.last if waiting else 0.0

    def check(self, waiting: bool) -> float | None:
        """The stall's length the first time it passes the limit; None otherwise."""
        if not waiting:
            self.progress()
            return None
        idle = self.clock() - self.last
        if self.stall_seconds > 0 and idle >= self.stall_seconds and not self.reported:
            self.reported = True
            self.num_stalls += 1
            return idle
        return None
