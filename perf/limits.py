"""A benchmark's wall-clock bound: whatever happens, the run ends and what it measured is written."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable


def wall_clock_limit(seconds: float, write: Callable[[str], None], servers: list) -> threading.Timer:
    """After `seconds`: write(note) with what was measured so far, stop every server still in `servers` (the caller
    keeps that list current) and exit with status 124. Cancel the returned timer once the run is done."""

    def expire() -> None:
        write(f"TIME LIMIT: stopped after {seconds:g} s")
        for server in list(servers):
            server.stop()
        os._exit(124)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    return timer
