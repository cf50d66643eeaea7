"""tritonserver's thread count and RSS as a light load goes on, optionally after a burst of concurrent streams:
shows how much of tritonserver's RSS growth is the first run of its idle pool threads (each thread's stack pages
become resident the first time the thread runs; the Python backend's pool has `--max-streams` + 64 threads).

    python3 perf/pool_rss.py [--burst 320] [--batches 8] [-- SERVE_ARGS ...]

One server (random:tiny-test, --kv-tokens 16384 plus SERVE_ARGS); a burst of --burst streams of 8 tokens at once
(0: none); then --batches batches of 200 requests of 40 tokens, 16 at a time, printing (threads, RSS MB) after
each."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # python3 perf/pool_rss.py: the project root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perf.leak_probe import batch  # noqa: E402
from tests.server.conftest import Server  # noqa: E402


def threads_and_rss(server: Server) -> tuple[int, int]:
    """tritonserver's (threads, RSS in MB) from /proc."""
    pid = server.tritonserver_pids()[0]
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0]) // 1024


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--burst", type=int, default=0, help="streams sent at once before the batches (0: none)")
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--limit", type=float, default=900, help="seconds for the whole run")
    ap.add_argument("serve_args", nargs="*", help="more `triton-pd serve` options (after --)")
    a = ap.parse_args(argv)
    server = Server("--model", "random:tiny-test", "--kv-tokens", "16384", *a.serve_args, name="poolrss")
    try:
        print("start", threads_and_rss(server), flush=True)
        deadline = time.monotonic() + a.limit
        if a.burst:
            batch(server, "complete", a.burst, 8, a.burst, deadline)
            time.sleep(2)
            print(f"after a burst of {a.burst}", threads_and_rss(server), flush=True)
        for i in range(a.batches):
            batch(server, "complete", 200, 40, 16, deadline)
            time.sleep(2)
            print("after batch", i, threads_and_rss(server), flush=True)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
