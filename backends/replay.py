"""Trace replay against a running server over gRPC streaming (`triton-pd bench replay`), a side-by-side
comparison of `--on-decode-oom pause` and `restart` (`triton-pd bench compare`), and a converter to perf_analyzer
input (`triton-pd bench to-perf-analyzer`).

Traces: Mooncake JSONL (`timestamp` ms, `input_length`, `output_length`, `hash_ids`), Azure 2023 CSV
(`TIMESTAMP`, `ContextTokens`, `GeneratedTokens`), or `synthetic:N,RATE` (Poisson arrivals, lengths uniform).
Prompts are token ids built so that equal `hash_ids` give equal token blocks (a shared prefix stays shared after
scaling). Lengths that do not fit the model are scaled (`--input-scale`, `--output-scale`) and/or clipped
(`--max-input`, `--max-output`, and input + output < context); the report says how many were changed.
"""

from __future__ import annotations

import csv
import json
import math
import random
import signal
import statistics
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

BLOCK = 512  # tokens per hash id in the Mooncake trace


@dataclass
class TraceRequest:
    arrival: float  # seconds from the trace's start
    input_len: int
    output_len: int
    hash_ids: list[int] = field(default_factory=list)


@dataclass
class Record:
    idx: int
    scheduled: float  # arrival in the replay (s from its start)
    sent: float = math.nan
    input_len: int = 0
    output_len: int = 0
    token_times: list[float] = field(default_factory=list)  # one per output token (coalesced ones share a time)
    finish_reason: str | None = None
    error: str | None = None
    error_kind: str | None = None  # busy | timeout | error | stuck | unfinished | unsent


# ---------------------------------------------------------------------------------------------------------------
# traces


def load_trace(spec: str, seed: int = 0) -> list[TraceRequest]:
    if spec.startswith("synthetic:"):
        n, rate = spec.split(":", 1)[1].split(",")
        rng = random.Random(seed)
        t, out = 0.0, []
        for _ in range(int(n)):
            t += rng.expovariate(float(rate))
            out.append(TraceRequest(t, rng.randint(64, 2048), rng.randint(16, 512)))
        return out
    path = Path(spec)
    if path.suffix == ".jsonl":
        out = []
        with open(path) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    out.append(
                        TraceRequest(r["timestamp"] / 1e3, r["input_length"], r["output_length"], r.get("hash_ids", []))
                    )
        return out
    if path.suffix == ".csv":
        out, t0 = [], None
        with open(path) as f:
            for r in csv.DictReader(f):
                ts = datetime.fromisoformat(r["TIMESTAMP"][:26]).timestamp()
                t0 = ts if t0 is None else t0
                out.append(TraceRequest(ts - t0, int(r["ContextTokens"]), int(r["GeneratedTokens"])))
        return out
    raise SystemExit(f"replay: unknown trace format {spec!r} (.jsonl Mooncake, .csv Azure, synthetic:N,RATE)")


@dataclass
class Shaping:
    time_scale: float = 1.0  # arrival times are multiplied by this (0.5 = twice as fast)
    sample: float = 1.0
    seed: int = 0
    start: float = 0.0  # seconds into the trace
    duration: float | None = None
    max_requests: int | None = None
    input_scale: float = 1.0
    output_scale: float = 1.0
    max_input: int | None = None
    max_output: int | None = None
    context: int = 8192


def shape(trace: list[TraceRequest], s: Shaping) -> tuple[list[TraceRequest], dict]:
    rng = random.Random(s.seed)
    sel = [r for r in trace if r.arrival >= s.start and (s.duration is None or r.arrival < s.start + s.duration)]
    if s.sample < 1.0:
        sel = [r for r in sel if rng.random() < s.sample]
    if s.max_requests:
        sel = sel[: s.max_requests]
    t0 = sel[0].arrival if sel else 0.0
    clipped_in = clipped_out = 0
    out = []
    for r in sel:
        i = max(1, round(r.input_len * s.input_scale))
        o = max(1, round(r.output_len * s.output_scale))
        if s.max_input and i > s.max_input:
            i, clipped_in = s.max_input, clipped_in + 1
        if s.max_output and o > s.max_output:
            o, clipped_out = s.max_output, clipped_out + 1
        if i + o >= s.context:
            i2 = max(1, s.context - 1 - o)
            if i2 < i:
                i, clipped_in = i2, clipped_in + 1
            if i + o >= s.context:
                o, clipped_out = s.context - 1 - i, clipped_out + 1
        out.append(TraceRequest((r.arrival - t0) * s.time_scale, i, o, r.hash_ids))
    info = {
        "requests": len(out),
        "input_scale": s.input_scale,
        "output_scale": s.output_scale,
        "time_scale": s.time_scale,
        "sample": s.sample,
        "inputs_clipped": clipped_in,
        "outputs_clipped": clipped_out,
        "max_input": s.max_input,
        "max_output": s.max_output,
        "context": s.context,
        "span_s": out[-1].arrival if out else 0.0,
    }
    return out, info


def as_conversations(reqs: list[TraceRequest], n: int, seed: int = 0, input_scale: float = 1.0) -> list[TraceRequest]:
    """For traces without prefix information (Azure): spread the requests over `n` multi-turn conversations. Each
    request continues a conversation chosen at random, and its prompt starts with that conversation's blocks, so
    two turns of one conversation share their common length as a prefix (as a chat's growing history does)."""
    rng = random.Random(f"{seed}-conversations")
    size = max(1, round(BLOCK * input_scale))  # tokens per block, as build_prompt lays them
    out = []
    for r in reqs:
        c = rng.randrange(n)
        blocks = math.ceil(r.input_len / size)
        out.append(TraceRequest(r.arrival, r.input_len, r.output_len, [c * 1_000_000 + j for j in range(blocks)]))
    return out


def build_prompt(r: TraceRequest, vocab: int, input_scale: float, seed: int, idx: int) -> list[int]:
    """Equal hash ids give equal blocks (of BLOCK x input_scale tokens); requests without hash ids get their own
    random tokens. Ids avoid the lowest 256 (special tokens in many vocabularies)."""
    lo = min(256, vocab // 4)
    if not r.hash_ids:
        rng = random.Random(f"{seed}-req-{idx}")
        return [rng.randrange(lo, vocab) for _ in range(r.input_len)]
    block = max(1, round(BLOCK * input_scale))
    ids: list[int] = []
    for h in r.hash_ids:
        rng = random.Random(f"{seed}-block-{h}")
        ids.extend(rng.randrange(lo, vocab) for _ in range(block))
        if len(ids) >= r.input_len:
            break
    rng = random.Random(f"{seed}-tail-{idx}")
    while len(ids) < r.input_len:
        ids.append(rng.randrange(lo, vocab))
    return ids[: r.input_len]


# ---------------------------------------------------------------------------------------------------------------
# metrics sampler

SAMPLED = {
    "running": "pd_decode_running_requests",
    "queued": "pd_decode_queued_requests",
    "paused": "pd_decode_paused_requests",
    "recovering": "pd_decode_recovering_requests",
    "kv_used": "pd_kv_slots_used",
    "kv_cached": "pd_kv_slots_cached",
    "kv_total": "pd_kv_slots_total",
    "pauses": "pd_pauses_total",
    "recoveries_local": 'pd_recoveries_total{path="local"',
    "recoveries_host": 'pd_recoveries_total{path="host"',
    "recoveries_prefill": 'pd_recoveries_total{path="prefill"',
    "rotations": "pd_rotations_total",
    "host_kv_used": "pd_host_kv_slots_used",
    "epoch_max": "pd_recovery_epoch_max",
    "restarts": "pd_decode_restarts_total",
    "stale": "pd_stale_messages_total",
}


def scrape(url: str, names: dict[str, str] = SAMPLED) -> dict[str, float]:
    """Each key's metric summed over its samples; a name may carry the start of a label set (`name{path="x"`)."""
    with urllib.request.urlopen(f"http://{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        for key, prefix in names.items():
            name = prefix.split("{")[0]
            if line.startswith(name + "{") or line.startswith(name + " "):
                if "{" in prefix and prefix.split("{", 1)[1] not in line:
                    continue
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


class Sampler(threading.Thread):
    def __init__(self, url: str, t0: float, period: float = 0.5):
        super().__init__(daemon=True)
        self.url, self.t0, self.period = url, t0, period
        self.samples: list[dict] = []
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            try:
                s = scrape(self.url)
                s["t"] = time.monotonic() - self.t0
                self.samples.append(s)
            except Exception:
                pass
            self.stop.wait(self.period)


# ---------------------------------------------------------------------------------------------------------------
# replay


def _send(url: str, rec: Record, prompt: list[int], t0: float, timeout: float, stuck_after: float, stop) -> None:
    """One request over its own gRPC stream. Ends however the server behaves: a finished answer, an error, no
    response for `stuck_after` s once tokens flow ("stuck"; the wait for the first token is a queue wait, bounded
    by `timeout`), the per-request `timeout` ("timeout"), or the run's end (`stop` set: "unfinished"). Any stream
    that did not finish is cancelled, so the server frees it and the client never waits on a plain stop_stream()
    for a stream the server does not end."""
    import queue as q_

    import tritonclient.grpc as grpcclient

    from backends.client import infer_inputs
    from backends.common.serving.wire import MasterRequest

    q: q_.Queue = q_.Queue()
    client = grpcclient.InferenceServerClient(url)
    params = {"max_tokens": rec.output_len, "temperature": 0, "ignore_eos": True}

    inputs = infer_inputs(grpcclient, MasterRequest(ids=list(prompt), params=params).encode())
    finished = False
    try:
        client.start_stream(callback=lambda result, error: q.put((time.monotonic(), result, error)))
        rec.sent = time.monotonic() - t0
        client.async_stream_infer("pd_master", inputs, enable_empty_final_response=True)
        deadline = time.monotonic() + timeout
        last = time.monotonic()
        while True:
            try:
                now, res, err = q.get(timeout=0.25)
            except q_.Empty:
                now = time.monotonic()
                if stop.is_set():
                    rec.error, rec.error_kind = "unfinished when the run's wall-clock limit was reached", "unfinished"
                elif rec.token_times and now - last >= stuck_after:
                    rec.error, rec.error_kind = f"no response for {now - last:.0f} s", "stuck"
                elif now >= deadline:
                    rec.error, rec.error_kind = f"client-side limit of {timeout:g} s reached", "timeout"
                else:
                    continue
                return
            last = now
            if err is not None:
                msg = err.message() if hasattr(err, "message") else str(err)
                rec.error = msg
                rec.error_kind = "busy" if "busy" in msg or "UNAVAILABLE" in msg else "error"
                finished = True  # the server ended the stream
                return
            out = res.as_numpy("output_ids")
            if out is not None and out.size:
                rec.token_times += [now - t0] * int(out.size)
            fr = res.as_numpy("finish_reason")
            if fr is not None and fr.size and fr.reshape(-1)[0]:
                rec.finish_reason = fr.reshape(-1)[0].decode()
            final = res.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                finished = True
                if rec.finish_reason in (None, "", "error"):
                    em = res.as_numpy("error_message")
                    rec.error = (em.reshape(-1)[0].decode() if em is not None and em.size else "") or "no finish"
                    rec.error_kind = "timeout" if "deadline" in rec.error or "timed out" in rec.error else "error"
                return
    except Exception as e:  # a transport error
        rec.error = f"{type(e).__name__}: {e}"
        rec.error_kind = "error"
    finally:
        try:
            client.stop_stream(cancel_requests=not finished)
            client.close()
        except Exception:
            pass


def replay(
    url: str,
    metrics_url: str | None,
    reqs: list[TraceRequest],
    prompts: list[list[int]],
    max_users: int = 256,
    timeout: float = 1800,
    progress: float = 5.0,
    run_limit: float | None = None,
    stuck_after: float = 120.0,
) -> tuple[list[Record], list[dict], float]:
    """Replay the requests at their arrival times. The run ends by `run_limit` seconds of wall clock whatever the
    server does: then every stream still open is cancelled and counted as "unfinished", and threads that do not
    return within 10 s more are left behind (daemons), their records marked so."""
    t0 = time.monotonic()
    stop = threading.Event()
    previous = None
    if threading.current_thread() is threading.main_thread():  # a SIGTERM ends the run like its limit does
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    sampler = Sampler(metrics_url, t0) if metrics_url else None
    if sampler:
        sampler.start()
    users = threading.Semaphore(max_users)
    records = [Record(i, r.arrival, input_len=r.input_len, output_len=r.output_len) for i, r in enumerate(reqs)]
    threads = []
    end = t0 + run_limit if run_limit else math.inf

    def user(rec, prompt):
        try:
            _send(url, rec, prompt, t0, timeout, stuck_after, stop)
        finally:
            users.release()

    last = time.monotonic()
    try:
        for rec, prompt in zip(records, prompts):
            while time.monotonic() < end and not stop.is_set():
                wait = t0 + rec.scheduled - time.monotonic()
                if wait <= 0 and users.acquire(timeout=0.2):  # the cap on concurrent virtual users
                    break
                time.sleep(min(max(wait, 0), 0.2))
                last = _progress(records, t0, last, progress)
            else:
                break  # the run's limit: the rest are never sent
            th = threading.Thread(target=user, args=(rec, prompt), daemon=True)
            th.start()
            threads.append(th)
        while any(th.is_alive() for th in threads) and time.monotonic() < end and not stop.is_set():
            time.sleep(0.2)
            last = _progress(records, t0, last, progress)
    finally:
        stop.set()
        grace = time.monotonic() + 10
        for th in threads:
            th.join(max(0.0, grace - time.monotonic()))
        for rec in records:
            if math.isnan(rec.sent) and rec.error is None:
                rec.error, rec.error_kind = "never sent: the run's wall-clock limit came first", "unsent"
            elif rec.error is None and rec.finish_reason is None:
                rec.error, rec.error_kind = "client thread still blocked after the run's end", "stuck"
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    wall = time.monotonic() - t0
    if sampler:
        sampler.stop.set()
        sampler.join(5)
    return records, (sampler.samples if sampler else []), wall


def _progress(records, t0, last, every):
    now = time.monotonic()
    if now - last < every:
        return last
    sent = sum(not math.isnan(r.sent) for r in records)
    done = sum(r.finish_reason is not None or r.error is not None for r in records)
    toks = sum(len(r.token_times) for r in records)
    errs = sum(r.error is not None for r in records)
    print(f"[replay {now - t0:7.1f} s] sent {sent}/{len(records)}, done {done}, in flight {sent - done}, "
          f"errors {errs}, tokens {toks}", flush=True)  # fmt: skip
    return now


# ---------------------------------------------------------------------------------------------------------------
# report


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return math.nan
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    f = math.floor(k)
    return xs[f] + (xs[min(f + 1, len(xs) - 1)] - xs[f]) * (k - f)


def summarize(records: list[Record], samples: list[dict], wall: float) -> dict:
    ok = [r for r in records if r.error is None and r.finish_reason in ("length", "stop")]
    ttft = [r.token_times[0] - r.sent for r in ok if r.token_times]
    tpot = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in ok if len(r.token_times) > 1]
    gaps = [max(b - a for a, b in zip(r.token_times, r.token_times[1:])) for r in ok if len(r.token_times) > 1]
    kinds: dict[str, int] = {}
    messages: dict[str, dict[str, int]] = {}
    for r in records:
        if r.error_kind:
            kinds[r.error_kind] = kinds.get(r.error_kind, 0) + 1
            per = messages.setdefault(r.error_kind, {})
            per[r.error or ""] = per.get(r.error or "", 0) + 1
    tokens = sum(len(r.token_times) for r in records)
    first = min((r.sent for r in records if not math.isnan(r.sent)), default=0.0)
    end = max((r.token_times[-1] for r in records if r.token_times), default=wall)
    s = {
        "requests": len(records),
        "succeeded": len(ok),
        "success_rate": len(ok) / len(records) if records else math.nan,
        "rejected_busy": kinds.get("busy", 0),
        "errors_by_kind": kinds,
        "error_messages": {k: sorted(v.items(), key=lambda kv: -kv[1])[:5] for k, v in messages.items()},
        "short_answers": sum(1 for r in ok if len(r.token_times) != r.output_len),
        "ttft_p50": pct(ttft, 50),
        "ttft_p90": pct(ttft, 90),
        "ttft_p95": pct(ttft, 95),
        "ttft_p99": pct(ttft, 99),
        "tpot_p50": pct(tpot, 50),
        "tpot_p90": pct(tpot, 90),
        "tpot_p95": pct(tpot, 95),
        "max_gap": max(gaps, default=math.nan),
        "gap_p99": pct(gaps, 99),
        "output_tokens": tokens,
        "output_tok_s": tokens / max(end - first, 1e-9),
        "wall_s": wall,
    }
    if samples:
        a, b = samples[0], samples[-1]
        s["pauses"] = b["pauses"] - a["pauses"]
        s["recoveries_local"] = b["recoveries_local"] - a["recoveries_local"]
        for k in ("recoveries_host", "recoveries_prefill", "rotations"):
            s[k] = b.get(k, 0.0) - a.get(k, 0.0)
        s["epoch_max"] = b.get("epoch_max", 0.0)
        s["restarts"] = b["restarts"] - a["restarts"]
        s["stale"] = b["stale"] - a["stale"]
        s["max_paused"] = max(x["paused"] for x in samples)
        s["max_running"] = max(x["running"] for x in samples)
        total = max(x["kv_total"] for x in samples) or 1
        s["max_kv_used_frac"] = max(x["kv_used"] for x in samples) / total
    return s


ROWS = [
    ("requests", "requests", "{:.0f}"),
    ("success rate", "success_rate", "{:.1%}"),
    ("rejected (server busy)", "rejected_busy", "{:.0f}"),
    ("errors by kind", "errors_by_kind", "{}"),
    ("answers shorter than asked", "short_answers", "{:.0f}"),
    ("TTFT P50 / P90 / P95 / P99 (s)", ("ttft_p50", "ttft_p90", "ttft_p95", "ttft_p99"), "{:.2f}"),
    ("TPOT P50 / P90 / P95 (ms)", ("tpot_p50", "tpot_p90", "tpot_p95"), "ms"),
    ("largest gap between two tokens (s)", "max_gap", "{:.2f}"),
    ("P99 of per-answer largest gap (s)", "gap_p99", "{:.2f}"),
    ("output throughput (tokens/s)", "output_tok_s", "{:.1f}"),
    ("pauses", "pauses", "{:.0f}"),
    ("recoveries: local / host / prefill", ("recoveries_local", "recoveries_host", "recoveries_prefill"), "{:.0f}"),
    ("rotations (turns given to paused answers)", "rotations", "{:.0f}"),
    ("highest recovery epoch", "epoch_max", "{:.0f}"),
    ("segment restarts", "restarts", "{:.0f}"),
    ("stale completions dropped", "stale", "{:.0f}"),
    ("most paused at once", "max_paused", "{:.0f}"),
    ("peak KV slots used", "max_kv_used_frac", "{:.1%}"),
]


def _cell(s: dict, key, fmt: str) -> str:
    keys = key if isinstance(key, tuple) else (key,)
    if any(k not in s for k in keys):
        return "-"
    if fmt == "ms":
        return " / ".join(f"{s[k] * 1e3:.1f}" for k in keys)
    if fmt == "{}":
        return json.dumps(s[keys[0]]) if s[keys[0]] else "none"
    return " / ".join(fmt.format(s[k]) for k in keys)


def table(runs: dict[str, dict]) -> str:
    names = list(runs)
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, key, fmt in ROWS:
        lines.append(f"| {label} | " + " | ".join(_cell(runs[n], key, fmt) for n in names) + " |")
    return "\n".join(lines)


def plots(runs: dict[str, tuple[list[Record], list[dict]]], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for metric, fn in (("TTFT (s)", "ttft_cdf.png"), ("TPOT (ms)", "tpot_cdf.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, (recs, _) in runs.items():
            ok = [r for r in recs if r.error is None and len(r.token_times) > 1]
            if metric.startswith("TTFT"):
                xs = sorted(r.token_times[0] - r.sent for r in ok)
            else:
                xs = sorted(1e3 * (r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in ok)
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
        ax.set_xlabel(metric)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / fn, dpi=110)
        plt.close(fig)
        files.append(fn)
    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 3 * len(runs)), squeeze=False)
    for ax, (name, (_, samples)) in zip(axes[:, 0], runs.items()):
        if samples:
            t = [s["t"] for s in samples]
            total = max(s["kv_total"] for s in samples) or 1
            ax.plot(t, [s["kv_used"] / total for s in samples], label="KV slots used (fraction)")
            ax.set_ylim(0, 1.05)
            ax2 = ax.twinx()
            ax2.plot(t, [s["paused"] for s in samples], color="tab:red", label="paused")
            ax2.plot(t, [s["running"] for s in samples], color="tab:green", alpha=0.6, label="running")
            ax2.set_ylabel("requests")
            ax2.legend(loc="upper right")
        ax.set_title(name)
        ax.set_xlabel("time (s)")
        ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "kv_timeline.png", dpi=110)
    plt.close(fig)
    files.append("kv_timeline.png")
    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 3 * len(runs)), squeeze=False)
    for ax, (name, (recs, _)) in zip(axes[:, 0], runs.items()):
        ok = [r for r in recs if len(r.token_times) > 1]
        ok.sort(key=lambda r: -max(b - a for a, b in zip(r.token_times, r.token_times[1:])))
        for r in ok[:4]:  # the answers with the longest stalls
            ax.plot(r.token_times, range(1, len(r.token_times) + 1), label=f"request {r.idx}")
        ax.set_title(f"{name}: token timelines of the 4 answers with the largest gaps")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("tokens received")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "token_timelines.png", dpi=110)
    plt.close(fig)
    files.append("token_timelines.png")
    return files


def write_run(out: Path, name: str, records, samples, summary, info) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{name}.records.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(asdict(r)) + "\n")
    with open(out / f"{name}.metrics.jsonl", "w") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")
    (out / f"{name}.summary.json").write_text(json.dumps({"summary": summary, "trace": info}, indent=1))


# ---------------------------------------------------------------------------------------------------------------
# perf_analyzer input


def to_perf_analyzer(reqs: list[TraceRequest], prompts: list[list[int]], out: Path) -> tuple[Path, Path]:
    """--input-data JSON (one entry per request, in arrival order) and --request-intervals (microseconds between
    consecutive sends, one per line)."""
    out.mkdir(parents=True, exist_ok=True)
    data = {
        "data": [
            {
                "input_ids": {"content": p, "shape": [len(p)]},
                "stream": [True],
                "sampling_parameters": [json.dumps({"max_tokens": r.output_len, "temperature": 0, "ignore_eos": True})],
            }
            for r, p in zip(reqs, prompts)
        ]
    }
    inp = out / "perf_analyzer_input.json"
    inp.write_text(json.dumps(data))
    iv = out / "perf_analyzer_intervals.txt"
    prev = 0.0
    lines = []
    for r in reqs:
        lines.append(str(max(0, round((r.arrival - prev) * 1e6))))
        prev = r.arrival
    iv.write_text("\n".join(lines) + "\n")
    return inp, iv


PERF_ANALYZER_CMD = (
    "{triton_pd} perf-analyzer -m pd_master -u {url} -i grpc --streaming --input-data {inp} --request-intervals {iv} "
    "--request-count {n} --profile-export-file {out}/pa_profile.json"
)


def perf_analyzer_command(url: str, inp: Path, iv: Path, n: int, out: Path) -> str:
    """The command line that drives a server with perf_analyzer from these files, runnable as printed (through
    `triton-pd perf-analyzer`, which resolves perf_analyzer's CUDA runtime library)."""
    exe = Path(sys.executable).parent / "triton-pd"
    triton_pd = str(exe) if exe.exists() else "triton-pd"
    return PERF_ANALYZER_CMD.format(triton_pd=triton_pd, url=url, inp=inp.resolve(), iv=iv.resolve(), n=n,
                                    out=out.resolve())  # fmt: skip


def median(xs):
    return statistics.median(xs) if xs else math.nan
