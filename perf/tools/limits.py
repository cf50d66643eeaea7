"""A benchmark's wall-clock bound: whatever happens, the run ends and what it measured is written."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
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


def report_writer(lines: list[str], out: str | None, rows: list | None = None) -> Callable[[str], None]:
    """write(note=""): print the markdown report `lines` (plus a closing note), and, with `out`, write it there and
    `rows` as JSON beside it (FILE.json). The lists are read at each call, so a report can be written whenever the
    run stops: pass write to `wall_clock_limit`."""

    def write(note: str = "") -> None:
        text = "\n".join(lines + ([f"\n{note}"] if note else [])) + "\n"
        print(text, flush=True)
        if out:
            with open(out, "w") as f:
                f.write(text)
            if rows is not None:
                with open(out.rsplit(".", 1)[0] + ".json", "w") as f:
                    json.dump(rows, f, indent=1)

    return write


def finish(timer: threading.Timer, lines: list[str], write: Callable[[str], None]) -> int:
    """The end of a bounded run: cancel `wall_clock_limit`'s timer, close the report with the time of measuring,
    write it, and give main's exit status 0."""
    timer.cancel()
    lines += ["", f"Measured {time.strftime('%Y-%m-%d %H:%M')}."]
    write("")
    return 0


def bounded_report(lines: list[str], out: str | None, rows: list | None, seconds: float, servers: list | None = None):
    """(write, timer): `report_writer`'s write for `lines` and `rows`, and a `wall_clock_limit` of `seconds` that
    writes through it; pass the timer to `finish` at the end."""
    write = report_writer(lines, out, rows)
    return write, wall_clock_limit(seconds, write, [] if servers is None else servers)


def needs_cuda(tool: str) -> bool:
    """True, after saying so on stderr, when there is no CUDA GPU for `tool` (its main then returns 2)."""
    import torch

    if torch.cuda.is_available():
        return False
    print(f"{tool}: needs a CUDA GPU", file=sys.stderr)
    return True
