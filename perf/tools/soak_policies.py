"""The soak's mixed load against each decode-OOM policy in one run: rotate (the default), plain and restart on the
same load and server settings, one server after another, compared with each other.

    bash .bundle/bootstrap.sh python3 perf/soak.py policies --users 64 --duration 100 --warmup 20 \\
        --long-tokens 1500 --short-tokens 64 --model random:llama3.1-8b \\
        --serve-args "--device gpu --kv-tokens 16384 --max-batch 64" --deadline 560 --out DIR   (H100 / H200)
    python3 perf/soak.py policies --users 8 --duration 20 --warmup 5 --model random:tiny-test \\
        --serve-args "--kv-tokens 1024" --long-tokens 300 --out DIR                              (CPU smoke)

The load is perf/soak.py steady's (--users virtual users, long and short answers, cancels, staggered starts).
Policies: rotate (no option), fixed-turns (`--rotation-turns 0`: rotation without the turns' bound), plain
(`--rotation-quantum 0`), restart (`--on-decode-oom restart`). Per policy, over the --duration - --warmup seconds
after the warm-up: output tokens/s (tokens the clients received), answers finished and cancelled, errors, TTFT
and inter-chunk gap percentiles (p50, p99, largest; as the clients saw them, answers sent after the warm-up),
pauses, rotations, recoveries by path, and host swap traffic (tokens/s in and out, and in per output token); then
the users stop, open streams are cancelled, and decode's counts must come back to 0.

The checks (issue #72, on a GPU): rotate's output tokens/s >= --min-share x the best of plain and restart, its p99
gap <= --max-p99-gap s, its swapped-in tokens <= --max-swap-ratio x its output tokens; every policy's counts back
to 0 and no errors. The report (markdown + JSON) is rewritten after each policy, so a run cut short by --deadline
(no policy is started that could not finish before it) or a failure keeps what it measured. Exit status 1 when a
check fails or a policy did not run."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # python3 perf/soak.py policies: the project root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from perf.tools.soak import GAUGES, Load, load_options  # noqa: E402
from tests.server.conftest import Server  # noqa: E402

POLICY_ARGS = {
    "rotate": [],
    "fixed-turns": ["--rotation-turns", "0"],
    "plain": ["--rotation-quantum", "0"],
    "restart": ["--on-decode-oom", "restart"],
}
COUNTERS = {
    "pauses": ("pd_pauses_total", {}),
    "rotations": ("pd_rotations_total", {}),
    **{f"rec_{p}": ("pd_recoveries_total", {"path": p}) for p in ("local", "host", "prefill", "recompute")},
    "swapped_in": ("pd_host_swapped_tokens_total", {"direction": "in"}),
    "swapped_out": ("pd_host_swapped_tokens_total", {"direction": "out"}),
}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def summarize(seconds: float, before: dict, after: dict, end_counts: dict, ttft: list[float],
              gaps: list[float]) -> dict:  # fmt: skip
    """One policy's row from the counters and the load's snapshot at the start and the end of the measured span;
    end_counts: decode's gauges after the drain."""
    d = {k: after[k] - before[k] for k in before}
    tokens = d["tokens"]
    return {
        "seconds": round(seconds, 2),
        "tokens_per_s": tokens / seconds if seconds > 0 else float("nan"),
        "finished": d["finished"], "cancelled": d["cancelled"], "errors": d["errors"],
        "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
        "gap_p50": percentile(gaps, 0.5), "gap_p99": percentile(gaps, 0.99), "gap_max": max(gaps, default=float("nan")),
        "pauses": d["pauses"], "rotations": d["rotations"],
        "recoveries": {p: d[f"rec_{p}"] for p in ("local", "host", "prefill", "recompute")},
        "swapped_in_per_s": d["swapped_in"] / seconds if seconds > 0 else float("nan"),
        "swapped_out_per_s": d["swapped_out"] / seconds if seconds > 0 else float("nan"),
        "swapped_in_per_token": d["swapped_in"] / tokens if tokens else float("nan"),
        "end_counts": end_counts,
    }  # fmt: skip


def checks(rows: dict, a) -> dict:
    """The issue's comparisons where the policies they need ran; every policy's counts and errors."""
    out: dict[str, bool] = {}
    rot = rows.get("rotate")
    others = [rows[p]["tokens_per_s"] for p in ("plain", "restart") if p in rows]
    if rot is not None and others:
        share = rot["tokens_per_s"] / max(others)
        out[f"rotate tokens/s >= {a.min_share} x the best of plain and restart"] = share >= a.min_share
    if rot is not None:
        out[f"rotate p99 gap <= {a.max_p99_gap} s"] = rot["gap_p99"] <= a.max_p99_gap
        out[f"rotate swapped in <= {a.max_swap_ratio} x output tokens"] = (
            rot["swapped_in_per_token"] <= a.max_swap_ratio
        )
    for p, r in rows.items():
        out[f"{p}: counts back to 0, no errors"] = not any(r["end_counts"].values()) and r["errors"] == 0
    out["every policy ran"] = set(rows) == set(a.policies)
    return out


def report(rows: dict, result: dict, command: str) -> str:
    best = max((r["tokens_per_s"] for r in rows.values()), default=float("nan"))
    lines = [f"# Soak per policy: {', '.join(rows) or 'none ran'}", "", f"`{command}`", "",
             "| policy | output tokens/s | vs best | finished | cancelled | errors | TTFT p50 / p99 s | "
             "gap p50 / p99 / largest s | pauses | rotations | recoveries local/host/prefill/recompute | "
             "swapped in / out tokens/s | in per output token | counts after the drain |",
             "|---|---:|---:|---:|---:|---:|---|---|---:|---:|---|---|---:|---|"]  # fmt: skip
    for p, r in rows.items():
        rec = "/".join(f"{r['recoveries'][k]:.0f}" for k in ("local", "host", "prefill", "recompute"))
        lines.append(
            f"| {p} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / best:.3f} | {r['finished']:.0f} | "
            f"{r['cancelled']:.0f} | {r['errors']:.0f} | {r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | "
            f"{r['gap_p50'] * 1e3:.0f} ms / {r['gap_p99']:.3f} / {r['gap_max']:.2f} | {r['pauses']:.0f} | "
            f"{r['rotations']:.0f} | {rec} | "
            f"{r['swapped_in_per_s']:,.0f} / {r['swapped_out_per_s']:,.0f} | {r['swapped_in_per_token']:.2f} | "
            f"{'all 0' if not any(r['end_counts'].values()) else r['end_counts']} |"
        )  # fmt: skip
    lines += ["", *(f"- {'pass' if ok else 'FAIL'}: {name}" for name, ok in result["checks"].items())]
    lines += [f"- not run: {p} ({why})" for p, why in result["skipped"].items()]
    lines += [f"- error: {e}" for e in result["errors"]]
    return "\n".join(lines) + "\n"


def run_policy(policy: str, a, deadline: float) -> dict:
    server = Server("--model", a.model, *shlex.split(a.serve_args), *POLICY_ARGS[policy], name=f"soak-{policy}")
    load = Load(server, a)
    try:
        t0 = time.monotonic()
        load.measure_from = t0 + a.warmup
        load.start()
        time.sleep(max(0.0, min(a.warmup, deadline - time.monotonic())))
        c0, s0, m0 = server.read_metrics(COUNTERS), load.snapshot(), time.monotonic()
        time.sleep(max(0.0, min(a.duration - a.warmup, deadline - time.monotonic())))
        c1, s1, m1 = server.read_metrics(COUNTERS), load.snapshot(), time.monotonic()
        load.stop.set()
        for t in load.threads:
            t.join(timeout=max(0.0, min(a.drain_timeout - (time.monotonic() - m1), deadline - time.monotonic())))
        gauges = server.read_metrics(GAUGES)
        limit = time.monotonic() + 10
        while any(gauges.values()) and time.monotonic() < limit:
            time.sleep(0.2)
            gauges = server.read_metrics(GAUGES)
        with load.lock:
            ttft, gaps = list(load.ttft), list(load.gaps)
        row = summarize(m1 - m0, c0 | s0, c1 | s1, gauges, ttft, gaps)
        row["error_samples"] = load.error_samples
        return row
    finally:
        load.stop.set()
        server.stop()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", nargs="+", default=["rotate", "plain", "restart"], choices=list(POLICY_ARGS))
    ap.add_argument("--duration", type=float, default=100, help="seconds of load per policy (warm-up included)")
    ap.add_argument("--warmup", type=float, default=20, help="seconds of each policy's load not measured")
    ap.add_argument("--deadline", type=float, default=560,
                    help="seconds for the whole run: no policy starts that could not end before it")  # fmt: skip
    ap.add_argument("--start-allowance", type=float, default=60,
                    help="seconds a server's start is allowed for when --deadline is planned")  # fmt: skip
    ap.add_argument("--window", type=float, default=10, help="users start at random times within this many seconds")
    load_options(ap, users=64, long_tokens=1500, short_tokens=64)
    ap.add_argument("--model", default="random:llama3.1-8b")
    ap.add_argument("--serve-args", default="--device gpu --kv-tokens 16384 --max-batch 64",
                    help="`triton-pd serve` options every policy's server gets")  # fmt: skip
    ap.add_argument("--drain-timeout", type=float, default=20)
    ap.add_argument("--min-share", type=float, default=0.95)
    ap.add_argument("--max-p99-gap", type=float, default=2.0)
    ap.add_argument("--max-swap-ratio", type=float, default=10.0)
    ap.add_argument("--out", required=True)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if not 0 <= a.warmup < a.duration:
        raise SystemExit("soak policies: --warmup must be at least 0 and less than --duration")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python3 perf/soak.py policies " + shlex.join(sys.argv[1:] if argv is None else argv)
    deadline = time.monotonic() + a.deadline
    rows: dict[str, dict] = {}
    result = {"command": command, "rows": rows, "checks": {}, "skipped": {}, "errors": []}

    def write() -> None:
        result["checks"] = checks(rows, a)
        (out / "soak_policies.json").write_text(json.dumps(result, indent=1, default=str))
        (out / "soak_policies.md").write_text(report(rows, result, command))

    for p in a.policies:
        need = a.start_allowance + a.duration + a.drain_timeout
        if time.monotonic() + need > deadline:
            result["skipped"][p] = f"needs about {need:.0f} s, {deadline - time.monotonic():.0f} s left"
            write()
            continue
        print(f"[soak policies] {p}: {a.users} users, {a.duration:.0f} s", flush=True)
        try:
            rows[p] = run_policy(p, a, deadline)
        except Exception as e:  # the server did not start or the load failed: said in the report, the rest runs
            result["errors"].append(f"{p}: {type(e).__name__}: {e}")
        write()
    print((out / "soak_policies.md").read_text())
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
