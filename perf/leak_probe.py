"""tritonserver's and each stub's RSS growth per request, by kind of request: completed or cancelled early. A soak
shows that memory grows; this shows how much per request, and whether the growth per request shrinks (an
allocator settling) or stays (a leak).

    python3 perf/leak_probe.py --modes complete,cancel --batch 600 --reps 3
    python3 perf/leak_probe.py --modes complete --batch 600 --reps 9 --out run.jsonl

One server (random:tiny-test by default), 16 concurrent streams of --tokens tokens each; --warmup requests first,
then for each mode --reps batches of --batch requests, with the RSS of every process read after each batch (2 s
after, so that the last streams are let go). One line of JSON per batch: bytes per request for each process. The
whole run stops after --limit seconds, with what it measured printed."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # python3 perf/leak_probe.py: the project root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.server.client import StreamClient  # noqa: E402
from tests.server.conftest import Server  # noqa: E402


def one(server: Server, mode: str, i: int, tokens: int) -> None:
    c = StreamClient(server.grpc_url, text=f"Leak probe {mode} {i}: tell me about {i}.",
                     params={"max_tokens": tokens, "temperature": 0, "ignore_eos": True})  # fmt: skip
    if mode == "cancel":  # cancelled after its first 3 tokens
        c.read(until_tokens=3, timeout=60)
        c.cancel()
        return
    r = c.read(timeout=120)
    if r.error is not None or len(r.ids) != tokens:
        raise RuntimeError(f"request {i}: {r.error or len(r.ids)}")
    c.close()


def batch(server: Server, mode: str, n: int, tokens: int, concurrency: int, deadline: float) -> None:
    todo, lock, errors = iter(range(n)), threading.Lock(), []

    def work() -> None:
        while time.monotonic() < deadline:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            try:
                one(server, mode, i, tokens)
            except Exception as e:  # noqa: BLE001 (reported after the batch)
                errors.append(str(e))

    threads = [threading.Thread(target=work, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()) + 5)
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:tiny-test")
    ap.add_argument("--modes", default="complete,cancel", help="comma-separated: complete, cancel")
    ap.add_argument("--batch", type=int, default=600, help="requests per measured batch")
    ap.add_argument("--reps", type=int, default=3, help="batches per mode")
    ap.add_argument("--warmup", type=int, default=300, help="completed requests before the first measure")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--serve-args", default="--kv-tokens 16384")
    ap.add_argument("--limit", type=float, default=1200, help="seconds for the whole run")
    ap.add_argument("--out", default=None, help="also append the lines to this file")
    a = ap.parse_args(argv)
    deadline = time.monotonic() + a.limit
    server = Server("--model", a.model, *a.serve_args.split(), name="leak")
    try:
        batch(server, "complete", a.warmup, a.tokens, a.concurrency, deadline)
        time.sleep(2)
        for mode in a.modes.split(","):
            for rep in range(a.reps):
                if time.monotonic() > deadline:
                    print("leak_probe: --limit reached", file=sys.stderr)
                    return 1
                before, t0 = server.process_rss(), time.monotonic()
                batch(server, mode, a.batch, a.tokens, a.concurrency, deadline)
                time.sleep(2)
                after = server.process_rss()
                row = {"mode": mode, "rep": rep, "n": a.batch, "secs": round(time.monotonic() - t0, 1)}
                row.update({k: round((after[k] - before.get(k, after[k])) / a.batch) for k in after})
                row["triton_mb"] = round(after.get("tritonserver", 0) / 2**20, 1)
                print(json.dumps(row), flush=True)
                if a.out:
                    with open(a.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
