"""A soak: a steady mixed load against one server for a wall-clock bound, measured per window.

    python3 perf/soak.py steady --duration 540 --window 60 --users 64 --model random:llama3.1-8b \
        --serve-args "--device gpu --kv-tokens 16384" --out DIR            (the H200 soak, through the bundle)
    python3 perf/soak.py steady --duration 1800 --window 120 --users 24 --out DIR (CPU, SmolLM2, by hand)

Each of --users virtual users sends one streamed request after another (seeded per user): a long answer
(--long-tokens, drawn from half to one and a half times it) with probability --long-share, else a short one
(--short-tokens); with probability --cancel-share it cancels its stream at a random point of the answer. Users
start at random times within the first window: started together with equal lengths, the long answers ran in
waves (H200: windows alternating about 1,300 and 1,650 tokens/s), and a two-minute comparison read the phase
of the wave, not the server. The decode pool is sized by --serve-args so that the long
answers together overflow it (pauses, host swaps, rotations).

Per window it writes: output tokens/s (tokens the clients received), requests finished and cancelled, pauses,
rotations, recoveries by path, host swap-ins (tokens), the RSS of tritonserver and of every Python stub, the GPU
memory in use (nvidia-smi, when there is one), and decode's pool and host counts at the window's end. The report
(markdown + JSON) is rewritten after every window, so a run that is cut short keeps what it measured.

Before the load (and before the first window) --burst short streams are sent at once: tritonserver's Python
backend runs a pool of `--max-streams` + 64 threads, and each thread's stack becomes resident the first time it
runs, so under a light load tritonserver's RSS climbs for as long as new pool threads keep getting their first
task (on 2 cores: 53 -> 67 MB over 1,600 requests without a burst; after a burst of 320 streams
70 MB, then 72). A server meets its peak concurrency early in production; the burst puts the soak there before
its baseline, so that RSS growth after warm-up measures what is retained, not threads run for the first time.

At the end the users stop sending, every stream still open is read to its end or cancelled (bounded), and the
checks are made: output tokens/s of the last --compare seconds against the --compare seconds after --warmup
(within --tolerance), RSS and GPU memory at the end against the end of the warm-up (growth within --mem-growth),
and decode's running, queued, paused and recovering requests, KV slots and host slots back to 0. Exit status 1
when a check fails, 2 when the server could not start."""

from __future__ import annotations

import argparse
import json
import random
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # python3 perf/soak.py steady: the project root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from perf.tools.seed_stalls import LOOP_PARTS  # noqa: E402  (pd_decode_loop_seconds_total's parts)
from tests.server.client import StreamClient  # noqa: E402
from tests.server.conftest import Server  # noqa: E402

COUNTERS = {
    "pauses": ("pd_pauses_total", {}),
    "rotations": ("pd_rotations_total", {}),
    "rec_local": ("pd_recoveries_total", {"path": "local"}),
    "rec_host": ("pd_recoveries_total", {"path": "host"}),
    "rec_prefill": ("pd_recoveries_total", {"path": "prefill"}),
    "swapped_in": ("pd_host_swapped_tokens_total", {"direction": "in"}),
    # where decode's time went and how much prefill computed: a window that is slower says why
    **{f"loop_{k}": ("pd_decode_loop_seconds_total", {"part": k}) for k in LOOP_PARTS},
    "prefill_computed": ("pd_prefill_computed_tokens_total", {}),
    "prefill_cached": ("pd_prefill_cached_tokens_total", {}),
}
GAUGES = {
    "running": "pd_decode_running_requests",
    "queued": "pd_decode_queued_requests",
    "paused": "pd_decode_paused_requests",
    "recovering": "pd_decode_recovering_requests",
    "kv_used": "pd_kv_slots_used",
    "host_used": "pd_host_kv_slots_used",
}


def gpu_memory() -> int | None:
    """Bytes of GPU memory in use on every GPU together (nvidia-smi), or None without one."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    return sum(int(x) for x in r.stdout.split()) << 20


class Load:
    """The virtual users and what they received."""

    def __init__(self, server: Server, a):
        self.server, self.a = server, a
        self.lock = threading.Lock()
        self.tokens = self.finished = self.cancelled = self.errors = 0
        self.error_samples: list[str] = []
        # per answer sent at or after measure_from (time.monotonic()) and before the stop: the first token's wait
        # and the gaps between the chunks that followed, as the client saw them
        self.measure_from = float("inf")
        self.ttft: list[float] = []
        self.gaps: list[float] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.user, args=(u,), daemon=True) for u in range(a.users)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def user(self, u: int) -> None:
        rng = random.Random(self.a.seed * 1000 + u)
        if self.stop.wait(rng.uniform(0, self.a.window)):  # staggered starts (see the module's text)
            return
        k = 0
        while not self.stop.is_set():
            k += 1
            if rng.random() < self.a.long_share:
                n = rng.randint(self.a.long_tokens // 2, self.a.long_tokens * 3 // 2)
            else:
                n = self.a.short_tokens
            cancel_at = rng.randint(1, n - 1) if rng.random() < self.a.cancel_share else None
            text = f"User {u}, request {k}: write about the number {rng.randint(0, 10**6)} and its neighbours. " * 3
            params = {"max_tokens": n, "temperature": 0.7, "seed": rng.randrange(2**31), "ignore_eos": True}
            sent = time.monotonic()
            try:
                c = StreamClient(self.server.grpc_url, text=text, params=params)
            except Exception as e:  # the server refused the stream: an error of the soak, and the user goes on
                self._error(f"stream not started: {e}")
                time.sleep(1.0)
                continue
            got, done = 0, False
            try:
                limit = time.monotonic() + self.a.request_timeout
                while not done and time.monotonic() < limit:
                    want = got + 16 if cancel_at is None else min(cancel_at, got + 16)
                    r = c.read(until_tokens=want, timeout=max(1.0, limit - time.monotonic()))
                    new = len(r.ids) - got
                    got = len(r.ids)
                    with self.lock:
                        self.tokens += new
                    if r.error is not None:
                        self._error(r.error)
                        break
                    if r.finish_reason is not None:
                        done = True
                        with self.lock:
                            self.finished += 1
                    elif cancel_at is not None and got >= cancel_at:
                        with self.lock:
                            self.cancelled += 1
                        break
                    elif self.stop.is_set():  # the soak is over: cancel what is still streaming
                        break
            finally:
                if done:
                    c.close()
                else:
                    c.cancel()
                self._latencies(sent, c.result.times)

    def _latencies(self, sent: float, times: list[float]) -> None:
        if sent < self.measure_from or self.stop.is_set() or not times:
            return
        with self.lock:
            self.ttft.append(times[0] - sent)
            self.gaps += [b - a for a, b in zip(times, times[1:])]

    def _error(self, message: str) -> None:
        with self.lock:
            self.errors += 1
            if len(self.error_samples) < 5:
                self.error_samples.append(message[:200])

    def snapshot(self) -> dict:
        with self.lock:
            return dict(tokens=self.tokens, finished=self.finished, cancelled=self.cancelled, errors=self.errors)


def write(out: Path, a, windows: list[dict], checks: dict, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps({"command": command, "windows": windows, "checks": checks}, indent=1))
    procs = sorted({k for w in windows for k in w["rss"]})
    head = ["t (s)", "tokens/s", "finished", "cancelled", "errors", "pauses", "rotations", "rec host/prefill/local",
            "swapped in", "running/queued/paused", "KV used", "host used",
            f"decode loop s {'/'.join(LOOP_PARTS)}", "prefill tokens computed/cached"]  # fmt: skip
    head += [f"RSS {p} (MB)" for p in procs]
    head.append("GPU mem (MB)")
    lines = [f"# Soak: {a.users} users, {a.duration:.0f} s in windows of {a.window:.0f} s", "", f"`{command}`", "",
             "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]  # fmt: skip
    for w in windows:
        d, g = w["delta"], w["gauges"]
        row = [f"{w['t']:.0f}", f"{w['tokens_per_s']:.1f}", str(d["finished"]), str(d["cancelled"]), str(d["errors"]),
               f"{d['pauses']:.0f}", f"{d['rotations']:.0f}",
               f"{d['rec_host']:.0f}/{d['rec_prefill']:.0f}/{d['rec_local']:.0f}", f"{d['swapped_in']:.0f}",
               f"{g['running']:.0f}/{g['queued']:.0f}/{g['paused']:.0f}", f"{g['kv_used']:.0f}",
               f"{g['host_used']:.0f}", "/".join(f"{d['loop_' + k]:.1f}" for k in LOOP_PARTS),
               f"{d['prefill_computed']:.0f}/{d['prefill_cached']:.0f}"]  # fmt: skip
        row += [f"{w['rss'].get(p, 0) / 2**20:.0f}" for p in procs]
        row.append("-" if w["gpu_mem"] is None else f"{w['gpu_mem'] / 2**20:.0f}")
        lines.append("| " + " | ".join(row) + " |")
    if checks:
        lines += ["", "## Checks", ""]
        for k, v in checks.items():
            lines.append(f"- {k}: {v}")
    (out / "soak.md").write_text("\n".join(lines) + "\n")


def burst(server, n: int, tokens: int, deadline: float) -> None:
    """n streams of `tokens` tokens at once (each answered whole), so that every thread of the Python backend's
    pool has run before the load starts (its stack resident: see the module doc)."""
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            c = StreamClient(server.grpc_url, text=f"Burst {i}: tell me about {i}.",
                             params={"max_tokens": tokens, "temperature": 0, "ignore_eos": True})  # fmt: skip
            r = c.read(timeout=max(1.0, deadline - time.monotonic()))
            c.close()
            if r.error is not None or len(r.ids) != tokens:
                errors.append(f"request {i}: {r.error or len(r.ids)}")
        except Exception as e:  # noqa: BLE001 (reported after the burst)
            errors.append(str(e))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()) + 5)
    if errors:
        raise RuntimeError(f"{len(errors)} burst requests failed, first: {errors[0]}")


def load_options(ap: argparse.ArgumentParser, users: int, long_tokens: int, short_tokens: int) -> None:
    """The virtual users' options (`Load`), with these defaults."""
    ap.add_argument("--users", type=int, default=users)
    ap.add_argument("--long-tokens", type=int, default=long_tokens)
    ap.add_argument("--short-tokens", type=int, default=short_tokens)
    ap.add_argument("--long-share", type=float, default=0.3)
    ap.add_argument("--cancel-share", type=float, default=0.2)
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--seed", type=int, default=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=1800, help="seconds of load (the wall-clock bound)")
    ap.add_argument("--window", type=float, default=120, help="seconds per measured window")
    ap.add_argument("--warmup", type=float, default=None, help="seconds before the baseline (default: one window)")
    ap.add_argument("--compare", type=float, default=120, help="seconds compared at the start and at the end")
    load_options(ap, users=24, long_tokens=400, short_tokens=32)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--serve-args", default="--kv-tokens 2048", help="extra `triton-pd serve` options")
    ap.add_argument("--tolerance", type=float, default=0.05, help="allowed throughput change, end against start")
    ap.add_argument("--mem-growth", type=float, default=0.01, help="allowed RSS / GPU memory growth")
    ap.add_argument("--drain-timeout", type=float, default=120)
    ap.add_argument("--burst", type=int, default=256,
                    help="short streams sent at once before the load (256: the default --max-streams)")  # fmt: skip
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    warmup = a.window if a.warmup is None else a.warmup
    out = Path(a.out)
    command = "python3 perf/soak.py steady " + shlex.join(sys.argv[1:] if argv is None else argv)
    try:
        server = Server("--model", a.model, *shlex.split(a.serve_args), name="soak")
    except Exception as e:
        print(f"soak: the server did not start: {e}", file=sys.stderr)
        return 2
    windows: list[dict] = []
    checks: dict = {}
    load = Load(server, a)
    try:
        if a.burst:
            print(f"[soak] a burst of {a.burst} streams before the load", flush=True)
            burst(server, a.burst, 8, time.monotonic() + 600)
        t0 = time.monotonic()
        last_c, last_s, last_t = server.read_metrics(COUNTERS), load.snapshot(), t0
        load.start()
        while time.monotonic() - t0 < a.duration:
            time.sleep(max(0.0, min(a.window, a.duration - (time.monotonic() - t0))))
            now = time.monotonic()
            c, s = server.read_metrics(COUNTERS), load.snapshot()
            delta = {k: c[k] - last_c[k] for k in c} | {k: s[k] - last_s[k] for k in s}
            windows.append(dict(t=now - t0, seconds=now - last_t, tokens_per_s=delta["tokens"] / (now - last_t),
                                delta=delta, gauges=server.read_metrics(GAUGES), rss=server.process_rss(),
                                gpu_mem=gpu_memory()))  # fmt: skip
            last_c, last_s, last_t = c, s, now
            write(out, a, windows, checks, command)
            w = windows[-1]
            print(f"[soak] t={w['t']:.0f}s {w['tokens_per_s']:.1f} tokens/s, finished {delta['finished']}, "
                  f"cancelled {delta['cancelled']}, errors {delta['errors']}, pauses {delta['pauses']:.0f}",
                  flush=True)  # fmt: skip
        load.stop.set()
        stop_t = time.monotonic()
        for t in load.threads:
            t.join(timeout=max(0.0, a.drain_timeout - (time.monotonic() - stop_t)))
        checks.update(final_checks(server, a, windows, warmup, load))
    finally:
        load.stop.set()
        write(out, a, windows, checks, command)
        server.stop()
    print((out / "soak.md").read_text())
    return 0 if checks.get("passed") else 1


def _mean_rate(windows: list[dict], lo: float, hi: float) -> float:
    """Tokens/s over the windows that lie within [lo, hi] (a window spans t - seconds .. t; the loop wakes a little
    late, so an edge may be off by part of a window, never by the whole of the warm-up window)."""
    sel = [w for w in windows if w["t"] - w["seconds"] >= lo - w["seconds"] / 2 and w["t"] <= hi + w["seconds"] / 2]
    secs = sum(w["seconds"] for w in sel)
    return sum(w["delta"]["tokens"] for w in sel) / secs if secs else float("nan")


def final_checks(server: Server, a, windows: list[dict], warmup: float, load: Load) -> dict:
    end = windows[-1]["t"] if windows else 0.0
    first = _mean_rate(windows, warmup, warmup + a.compare)
    last = _mean_rate(windows, end - a.compare, end)
    deadline = time.monotonic() + 10
    gauges = server.read_metrics(GAUGES)
    while any(gauges.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
        gauges = server.read_metrics(GAUGES)
    base = next((w for w in windows if w["t"] >= warmup - 1e-6), None)
    growth = {}
    if base is not None:
        for name, rss in windows[-1]["rss"].items():
            if base["rss"].get(name):
                growth[f"RSS {name}"] = rss / base["rss"][name] - 1
        if base["gpu_mem"] and windows[-1]["gpu_mem"]:
            growth["GPU memory"] = windows[-1]["gpu_mem"] / base["gpu_mem"] - 1
    ratio = last / first if first == first and first > 0 else float("nan")
    ok_rate = abs(ratio - 1) <= a.tolerance
    ok_mem = all(g <= a.mem_growth for g in growth.values())
    ok_zero = not any(gauges.values())
    snap = load.snapshot()
    return {
        "throughput, first compared span (tokens/s)": round(first, 2),
        "throughput, last compared span (tokens/s)": round(last, 2),
        "last / first": round(ratio, 4),
        "memory growth since the end of warm-up": {k: f"{v * 100:+.2f}%" for k, v in growth.items()},
        "decode counts after the drain": gauges,
        "requests finished / cancelled / errors": f"{snap['finished']} / {snap['cancelled']} / {snap['errors']}",
        "error samples": load.error_samples,
        "throughput within tolerance": ok_rate,
        "memory within growth bound": ok_mem,
        "counts back to 0": ok_zero,
        "passed": ok_rate and ok_mem and ok_zero and snap["errors"] == 0,
    }


if __name__ == "__main__":
    sys.exit(main())
