"""Sustained overload in rounds: N concurrent streams at a time against one server, round after round, with what
each round cost and what decode and prefill did in it (from their Prometheus counters), so that a slowdown shows
where the extra work comes from.

    python perf/soak.py overload --rounds 7 --streams 200 --serve-args "--cpu-threads 2 --kv-tokens 16384"
    python perf/soak.py overload --rounds 3 --streams 1024 --model random:tiny-test --layout split \
        --serve-args "--max-streams 1024 --kv-tokens 16384"    (a server per role: no BLS between roles)
    python3 perf/soak.py overload --duration 1800 --window 300 --streams 256 --model random:llama3.1-8b \
        --serve-args "--device gpu --kv-tokens 65536" --out DIR        (the H200 soak, through the bundle)

Each stream asks for --new-tokens tokens (greedy, EOS ignored) after a prompt of its own (a shared preamble and a
distinct question, so the prefix cache fills with distinct entries as in the runs that first showed the slowdown).
With --duration the rounds go on until that many seconds have passed and the report compares the output tokens/s
of the first and the last --window seconds. Every round has a wall-clock limit; the report is written after each
round, and at the end the pool's accounting is checked once every request is done.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import threading
import time
from pathlib import Path

from backends.server_process import ROOT, SplitDeployment
from tests.server.client import StreamClient
from tests.server.conftest import Server

COUNTERS = {
    "pauses": ("pd_pauses_total", {}),
    "rec_local": ("pd_recoveries_total", {"path": "local"}),
    "rec_host": ("pd_recoveries_total", {"path": "host"}),
    "rec_prefill": ("pd_recoveries_total", {"path": "prefill"}),
    "rotations": ("pd_rotations_total", {}),
    "prefill_tokens": ("pd_prefill_computed_tokens_total", {}),
    "prefill_cached": ("pd_prefill_cached_tokens_total", {}),
    "prefill_recovery_jobs": ("pd_prefill_jobs_total", {"kind": "recovery"}),
    "stale": ("pd_stale_messages_total", {}),
}


def one_round(server: Server, r: int, a, limit: float) -> dict:
    preamble = "You are a careful assistant. Answer briefly and precisely. "
    results, first = [None] * a.streams, [None] * a.streams
    t0 = time.monotonic()

    def go(i: int) -> None:
        c = StreamClient(
            server.grpc_url,
            text=f"{preamble}Round {r}, question {i}: what is {i} times {r + 3}?",
            params={"max_tokens": a.new_tokens, "temperature": 0, "ignore_eos": True},
        )
        try:
            c.read(until_tokens=1, timeout=limit)
            first[i] = time.monotonic() - t0
            results[i] = c.read(timeout=max(1.0, limit - (time.monotonic() - t0)))
        finally:
            if results[i] is not None and results[i].finish_reason is not None:
                c.close()
            else:  # a plain close would wait for the server to finish the stream
                c.cancel()

    before = server.read_metrics(COUNTERS)
    threads = [threading.Thread(target=go, args=(i,), daemon=True) for i in range(a.streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, limit + 30 - (time.monotonic() - t0)))
    wall = time.monotonic() - t0
    after = server.read_metrics(COUNTERS)
    done = [x for x in results if x is not None and x.error is None and len(x.ids) == a.new_tokens]
    ttft = [x for x in first if x is not None]
    row = {
        "round": r,
        "wall_s": round(wall, 2),
        "completed": len(done),
        "errors": sum(1 for x in results if x is None or x.error is not None),
        "tokens_per_s": round(sum(len(x.ids) for x in done) / wall, 1),
        "ttft_p50_s": round(statistics.median(ttft), 2) if ttft else None,
        "kv_cached": server.metric("pd_kv_slots_cached"),
    }
    row.update({k: after[k] - before[k] for k in COUNTERS})
    rss = server.process_rss()  # MB after the round: tritonserver(s), and the Python stubs together
    triton = sum(v for k, v in rss.items() if k.split(":")[-1] == "tritonserver")
    row["triton_rss_mb"] = round(triton / 2**20)
    row["stubs_rss_mb"] = round((sum(rss.values()) - triton) / 2**20)
    return row


def report(a, rows: list[dict], extra: list[str]) -> str:
    cols = ["round", "wall_s", "completed", "errors", "tokens_per_s", "ttft_p50_s", "kv_cached", *COUNTERS,
            "triton_rss_mb", "stubs_rss_mb"]  # fmt: skip
    lines = [f"Overload rounds: {a.streams} concurrent streams of {a.new_tokens} tokens, model {a.model}, "
             f"serve args `{a.serve_args}`", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]  # fmt: skip
    lines += ["| " + " | ".join(str(row.get(c)) for c in cols) + " |" for row in rows]
    return "\n".join(lines + [""] + extra) + "\n"


def windows(rows: list[dict], starts: list[float], window: float) -> list[str]:
    """Output tokens/s in the first and the last `window` seconds (rounds that started in each)."""
    if not rows:
        return []
    end = starts[-1] + rows[-1]["wall_s"]

    def rate(sel):
        toks = sum(r["tokens_per_s"] * r["wall_s"] for r in sel)
        secs = sum(r["wall_s"] for r in sel)
        return toks / secs if secs else float("nan")

    first = rate([r for r, s in zip(rows, starts) if s < window])
    last = rate([r for r, s in zip(rows, starts) if s >= end - window])
    return [f"first {window:g} s: {first:.1f} tokens/s; last {window:g} s: {last:.1f} tokens/s; "
            f"last / first = {last / first:.3f}"]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=7, help="rounds (ignored with --duration)")
    ap.add_argument("--duration", type=float, default=0, help="seconds: run rounds until then (a soak)")
    ap.add_argument("--window", type=float, default=300, help="with --duration: the first/last window compared")
    ap.add_argument("--round-limit", type=float, default=600, help="seconds one round may take")
    ap.add_argument("--serve-args", default="", help="more `triton-pd serve` options")
    ap.add_argument(
        "--layout",
        choices=("one", "split"),
        default="one",
        help="one tritonserver with every role (BLS between roles), or one server per role (gRPC between roles, "
        "no BLS); with split, decode's counters are read and prefill's read as 0",
    )
    ap.add_argument("--out", default=None, help="folder for report.md and rounds.json, written after each round")
    a = ap.parse_args()
    out = Path(a.out) if a.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    if a.layout == "split":
        log_dir = ROOT / ".run" / f"overload-split-{os.getpid()}"
        server = SplitDeployment(["--model", a.model, *shlex.split(a.serve_args)], log_dir, ready_timeout=300)
    else:
        server = Server("--model", a.model, *shlex.split(a.serve_args), name="overload")
    rows, starts, extra = [], [], []
    t_start = time.monotonic()
    try:
        r = 0
        while (time.monotonic() - t_start < a.duration) if a.duration else r < a.rounds:
            starts.append(time.monotonic() - t_start)
            rows.append(one_round(server, r, a, a.round_limit))
            print(json.dumps(rows[-1]), flush=True)
            if out:
                (out / "rounds.json").write_text(json.dumps(rows, indent=1))
                (out / "report.md").write_text(report(a, rows, extra))
            r += 1
        if a.duration:
            extra += windows(rows, starts, a.window)
        held = {k: server.wait_metric(k, lambda v: v == 0, timeout=30) for k in (
            "pd_decode_running_requests", "pd_decode_queued_requests", "pd_decode_paused_requests",
            "pd_decode_recovering_requests", "pd_kv_slots_used")}  # fmt: skip
        # read once every request has let go (gauges update every 50 ms, so read them together after the wait)
        free, used, cached, total = (server.metric(f"pd_kv_slots_{k}") for k in ("free", "used", "cached", "total"))
        exact = free + used + cached == total
        extra.append(f"after the last round: {held}; free {free:.0f} + used {used:.0f} + cached {cached:.0f} "
                     f"{'==' if exact else '!='} total {total:.0f}")  # fmt: skip
    finally:
        server.stop()
    text = report(a, rows, extra)
    print(text, flush=True)
    if out:
        (out / "report.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
