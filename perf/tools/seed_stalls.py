"""The seed scenario: a decode pool of 8192 tokens; 4 streams of 200 + 3800 tokens, then 3 streams of 200 + 5300
(greedy, EOS ignored), then 4 streams closed while some are paused, then one new request. One server per policy:

    plain   --rotation-quantum 0 --host-kv-tokens 0   a paused stream waits until the running ones finish
    host    --rotation-quantum 0                      same, recovering from host memory instead of prefill
    rotate  (defaults: --rotation-quantum 0.1 --rotation-wait 0.3, --rotation-victims smallest,
            --rotation-prefetch on, host tier on)   paused and running streams take turns; a paused one takes its
            turn once it has waited 0.3 s, its KV copied back ahead of it where free slots allow
    rotate-quantum   rotate with --rotation-wait 0: a turn every quantum (the behaviour before --rotation-wait)
    rotate-late  rotate with --rotation-prefetch off: a turn's KV is copied back only at the turn
    rotate-fair  rotate with --rotation-victims longest-running: round robin, every stream at the same pace
    roomy   plain on a pool that holds all of a phase's streams: nothing pauses (the throughput reference)

    python perf/scenario.py seed --out DIR [--policies plain rotate] [--model random:llama3.1-8b]
        [--kv-tokens 8192] [--host-kv-tokens N] [--scale 1.0] [--serve-args "--prefill-gpus 1 --decode-gpus 0"]
        [--phase-limit 300] [--time-limit 3600] [--phases 4x4000 3x5500] [--warmup-tokens 4200]
    python perf/scenario.py seed --out DIR --merge RUN_DIR [RUN_DIR ...]

Each server first answers an unmeasured warm-up phase (2 streams that overfill the pool: `--warmup-tokens`), so
that the first server of a run does not pay for what later servers find compiled (the same settings measured 5%
slower as the first server of a run than as the third, perf/results/stalls_h200/rotation_victims/; whether the
warm-up removes that is not yet measured).

Per phase and policy it reports answers completed with the right length, the largest gap between two tokens of one
answer (and the first bar: from the first token on), time to first token, wall time and output tokens/s (the
throughput loss of a policy is against `plain` and, when run, `roomy`, measured in the same run), pauses, rotations,
recoveries by path, the highest epoch and stale messages; after close-all, decode's counts and whether a new request
works. Every answer is kept (answers.json) and compared token for token with the `--reference` policy's (default
roomy, where nothing pauses): with `--deterministic` on a GPU (issue #29) or on the CPU they must be identical,
whichever path recovered them; `--sampling seeded` repeats it with seeded sampling (`--sampling greedy seeded`:
both, one after the other on each policy's server, phases named 'NAME SAMPLING'), `--require-identical` makes any
difference exit 1. Every phase has a wall-clock limit: streams still open then are cancelled and counted as
unfinished, and the results written so far stay on disk (summary.json, report.md; rewritten after every phase).
The whole run has one too (--time-limit; each phase's limit is cut to what is left of it): past it, what was
measured so far is written with a TIME LIMIT note, the server stopped and the run exits 124. Progress lines carry
the seconds since the start. Plain's throughput moves by about 10% between runs (how its paused streams come back
through prefill depends on timing), so a rotation cost of a few percent needs several runs: `--merge` reports
them together (mean and range per policy, the loss of the means and per run).
`--scale 0.1 --model smollm2` (the default model, random:llama3.1-8b, does not fit a small CPU machine) runs the
same shape in a few minutes on a laptop-class CPU.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from backends.replay import scrape  # noqa: E402
from perf.tools.limits import wall_clock_limit  # noqa: E402

POLICIES = {
    "plain": ["--rotation-quantum", "0", "--host-kv-tokens", "0"],
    "host": ["--rotation-quantum", "0"],
    "rotate": [],
    "rotate-quantum": ["--rotation-wait", "0"],  # a turn every quantum
    "rotate-late": ["--rotation-prefetch", "off"],  # a turn's KV copied back only at the turn
    "rotate-fair": ["--rotation-victims", "longest-running"],  # round robin
}
POLICIES["roomy"] = POLICIES["plain"]  # on a pool that holds every stream of a phase
LOOP_PARTS = ("idle", "wait", "read", "schedule", "copies", "step")  # pd_decode_loop_seconds_total's parts
READ_FIRST = ("not_quiet", "room", "no_graph", "max_len", "sampling")  # pd_decode_read_first_steps_total's reasons
PHASES = (("4x4000", 4, 3800), ("3x5500", 3, 5300))  # name, streams, output tokens (of unscaled length)
COUNTERS = {
    "pauses": "pd_pauses_total",
    "rotations": "pd_rotations_total",
    "rec_local": 'pd_recoveries_total{path="local"',
    "rec_host": 'pd_recoveries_total{path="host"',
    "rec_prefill": 'pd_recoveries_total{path="prefill"',
    "stale": "pd_stale_messages_total",
    **{f"pos_{k}": f'pd_recovered_tokens_total{{source="{k}"' for k in ("cached", "host", "prefill")},
    "epoch_max": "pd_recovery_epoch_max",
    "swapped_in": 'pd_host_swapped_tokens_total{direction="in"',
    "prefetched": 'pd_host_swapped_tokens_total{direction="prefetch"',
    "host_full": 'pd_host_swap_skipped_total{reason="host_full"',
    "swap_in_s": "pd_host_swap_in_seconds_sum",
    "swap_in_n": "pd_host_swap_in_seconds_count",
    "idle_swapping_s": "pd_decode_idle_swapping_seconds_total",
    "overlapped": "pd_decode_overlapped_steps_total",
    "steps": "pd_decode_steps_total",
    "handover_s": "pd_rotation_handover_seconds_sum",
    "handover_n": "pd_rotation_handover_seconds_count",
    "turn_host_s": "pd_rotation_turn_host_seconds_total",
    **{f"loop_{k}": f'pd_decode_loop_seconds_total{{part="{k}"' for k in LOOP_PARTS},
    **{f"read_{k}": f'pd_decode_read_first_steps_total{{reason="{k}"' for k in READ_FIRST},
}
CLOSE_ALL = {
    "running": "pd_decode_running_requests",
    "queued": "pd_decode_queued_requests",
    "paused": "pd_decode_paused_requests",
    "recovering": "pd_decode_recovering_requests",
    "kv_slots_used": "pd_kv_slots_used",
    "host_kv_slots_used": "pd_host_kv_slots_used",
    "state_pages_used": "pd_state_pages_used",
    "host_state_pages_used": "pd_host_state_pages_used",
}


class Stream:
    """One gRPC stream, one request; token arrival times recorded by the callback."""

    def __init__(self, url: str, ids: list[int], max_tokens: int, seed: int | None = None):
        import tritonclient.grpc as grpcclient

        from tests.server.client import build_inputs

        self.times: list[float] = []
        self.n_ids = 0
        self.finish: str | None = None
        self.error: str | None = None
        self.ids: list[int] = []
        self.done = threading.Event()
        self.sent = time.monotonic()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=self._on)
        params = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        if seed is not None:  # seeded sampling: the answer is a function of (seed, position) and the logits
            params.update(temperature=1.0, seed=seed)
        self.client.async_stream_infer(
            "pd_master", build_inputs(ids=ids, params=params), enable_empty_final_response=True
        )

    def _on(self, result, error) -> None:
        now = time.monotonic()
        if error is not None:
            self.error = f"{error.status()}: {error.message()}"
            self.done.set()
            return
        out = result.as_numpy("output_ids")
        if out is not None and len(out):
            self.ids += out.tolist()
            self.times += [now] * len(out)
        fr = result.as_numpy("finish_reason")
        if fr is not None and fr[0]:
            self.finish = fr[0].decode()
        final = result.get_response().parameters.get("triton_final_response")
        if final is not None and final.bool_param:
            self.done.set()

    def end(self, cancel: bool) -> None:
        try:
            self.client.stop_stream(cancel_requests=cancel)  # a plain stop waits for the server to end it
            self.client.close()
        except Exception:
            pass


def _transport(decode_args: str) -> str:
    """The KV transport a split decode server runs with (its role's default is dist)."""
    words = shlex.split(decode_args)
    for i, w in enumerate(words):
        if w == "--kv-transport" and i + 1 < len(words):
            return words[i + 1]
        if w.startswith("--kv-transport="):
            return w.split("=", 1)[1]
    return "dist"


VOCAB = [32000]  # the served model's vocabulary size (main sets it): prompt ids are drawn below it


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """Random ids in [1000, 30000), within the model's vocabulary (a smaller one: its upper three quarters)."""
    rng = np.random.default_rng(seed)
    hi = min(30000, VOCAB[0])
    return [rng.integers(min(1000, hi // 4), hi, size=length).tolist() for _ in range(n)]


def run_phase(url: str, metrics: str, n: int, prompt: int, out_len: int, limit: float, seed: int,
              sampled: bool = False) -> dict:  # fmt: skip
    """sampled: each stream samples with seed 1000 + its index (else greedy)."""
    before = scrape(metrics, COUNTERS)
    t0 = time.monotonic()
    streams = [Stream(url, p, out_len, 1000 + i if sampled else None) for i, p in enumerate(prompts(n, prompt, seed))]
    for s in streams:
        s.done.wait(max(0.0, limit - (time.monotonic() - t0)))
    wall = time.monotonic() - t0
    unfinished = sum(1 for s in streams if not s.done.is_set())
    for s in streams:
        s.end(cancel=not s.done.is_set())
    after = scrape(metrics, COUNTERS)
    gaps = [max((b - a for a, b in zip(s.times, s.times[1:])), default=0.0) for s in streams]
    firsts = [s.times[0] - s.sent for s in streams if s.times]
    tokens = sum(len(s.ids) for s in streams)
    return {
        "streams": n,
        "completed": sum(1 for s in streams if s.finish == "length" and len(s.ids) == out_len and not s.error),
        "unfinished": unfinished,
        "errors": [s.error for s in streams if s.error],
        "lengths": [len(s.ids) for s in streams],
        "largest_gap_s": max(gaps, default=0.0),
        "largest_gap_per_stream_s": [round(g, 3) for g in gaps],
        "ttft_max_s": max(firsts, default=float("nan")),
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        "ids_sha": [hash(tuple(s.ids)) & 0xFFFFFFFF for s in streams],
        "ids": [s.ids for s in streams],  # moved to answers.json by main
        **{k: after[k] - before[k] for k in COUNTERS if k != "epoch_max"},
        "epoch_max": after["epoch_max"],
    }


def close_all(url: str, metrics: str, prompt: int, out_len: int, limit: float) -> dict:
    streams = [Stream(url, p, out_len) for p in prompts(4, prompt, 7)]
    t0, paused = time.monotonic(), False
    while time.monotonic() - t0 < limit:
        m = scrape(metrics, CLOSE_ALL)
        if m["paused"] + m["recovering"] > 0:
            paused = True
            break
        time.sleep(0.05)
    for s in streams:
        s.end(cancel=True)
    t1 = time.monotonic()
    while True:
        counts = scrape(metrics, CLOSE_ALL)
        if not any(counts.values()) or time.monotonic() - t1 > 10:
            break
        time.sleep(0.1)
    released_s = time.monotonic() - t1
    probe = Stream(url, prompts(1, 16, 99)[0], 8)
    probe.done.wait(60)
    probe.end(cancel=not probe.done.is_set())
    return {
        "paused_when_closed": paused,
        "counts_after": counts,
        "released_in_s": released_s,
        "new_request_ok": probe.finish == "length" and len(probe.ids) == 8,
    }


def _phase_rows(phase: str, pols: list[str], runs: dict) -> list[str]:
    def loss_vs(ref: str):
        base = runs.get(ref, {}).get(phase)  # none, or nothing served (a phase cut short by --time-limit): "-"
        return lambda r: (
            f"{1 - r['output_tok_s'] / base['output_tok_s']:+.1%}" if base and base["output_tok_s"] else "-"
        )

    rows = [
        ("completed with the right length", lambda r: f"{r['completed']} of {r['streams']}"),
        ("unfinished at the limit / errors", lambda r: f"{r['unfinished']} / {len(r['errors'])}"),
        ("largest gap between two tokens (s)", lambda r: f"{r['largest_gap_s']:.2f}"),
        ("largest time to first token (s)", lambda r: f"{r['ttft_max_s']:.2f}"),
        ("wall (s)", lambda r: f"{r['wall_s']:.1f}"),
        ("output tokens/s", lambda r: f"{r['output_tok_s']:.1f}"),
        ("throughput loss vs plain", loss_vs("plain")),
        ("throughput loss vs roomy", loss_vs("roomy")),
        ("pauses / rotations", lambda r: f"{r['pauses']:.0f} / {r['rotations']:.0f}"),
        (
            "recoveries local / host / prefill",
            lambda r: f"{r['rec_local']:.0f} / {r['rec_host']:.0f} / {r['rec_prefill']:.0f}",
        ),
        (
            "recovered positions: own prefix cache / host / prefill",
            lambda r: " / ".join(f"{r.get('pos_' + k, 0):,.0f}" for k in ("cached", "host", "prefill")),
        ),
        ("highest epoch / stale messages", lambda r: f"{r['epoch_max']:.0f} / {r['stale']:.0f}"),
        ("host-full skips", lambda r: f"{r['host_full']:.0f}"),
        (
            "tokens swapped in / of them ahead of a turn",
            lambda r: f"{r.get('swapped_in', 0):,.0f} / {r.get('prefetched', 0):,.0f}",
        ),
        (
            "swap-in mean (ms) / decode idle while swapping (s)",
            lambda r: (
                f"{1e3 * r.get('swap_in_s', 0) / max(1, r.get('swap_in_n', 0)):.1f} / {r.get('idle_swapping_s', 0):.2f}"
            ),
        ),
        (
            "decode steps / of them launched over an unread step / mean batch",
            lambda r: (
                f"{r.get('steps', 0):,.0f} / {r.get('overlapped', 0):,.0f} / "
                f"{r['output_tok_s'] * r['wall_s'] / max(1, r.get('steps', 0)):.2f}"
            ),
        ),
        (
            "rotation handover mean (ms) / in all (s)",
            lambda r: (
                f"{1e3 * r.get('handover_s', 0) / max(1, r.get('handover_n', 0)):.1f} / {r.get('handover_s', 0):.2f}"
            ),
        ),
        (
            "a turn's host part, plan to step launched: per rotation (ms) / in all (s)",
            lambda r: (
                f"{1e3 * r.get('turn_host_s', 0) / max(1, r.get('rotations', 0)):.2f} / {r.get('turn_host_s', 0):.2f}"
            ),
        ),
        (
            "decode loop s: " + " / ".join(LOOP_PARTS),
            lambda r: " / ".join(f"{r.get('loop_' + k, 0):.1f}" for k in LOOP_PARTS),
        ),
        (
            "steps read before the next plan: not quiet / room / no graph / max_len / sampling",
            lambda r: " / ".join(f"{r.get('read_' + k, 0):,.0f}" for k in READ_FIRST),
        ),
    ]
    lines = [f"## {phase}", "", "| | " + " | ".join(pols) + " |", "|---|" + "---|" * len(pols)]
    for label, fn in rows:
        cells = [fn(runs[p][phase]) if phase in runs[p] else "-" for p in pols]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines + [""]


def same_answers(mine: list[list[int]], ref: list[list[int]]) -> str:
    """'k of n' streams whose tokens equal the reference's, and where the others first differ."""
    firsts = []
    for a, b in zip(mine, ref):
        if a != b:
            firsts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    text = f"{len(ref) - len(firsts)} of {len(ref)}"
    return text + (f" (first differences at tokens {', '.join(map(str, firsts))})" if firsts else "")


def compare_answers(answers: dict, reference: str | None) -> dict:
    """{phase: {policy: same_answers text}} against `reference`'s answers (None: nothing compared)."""
    out: dict = {}
    if reference not in answers:
        return out
    for phase, ref in answers[reference].items():
        for pol, runs in answers.items():
            if pol != reference and phase in runs:
                out.setdefault(phase, {})[pol] = same_answers(runs[phase], ref)
    return out


def report(summary: dict) -> str:
    lines = [f"# Seed scenario: {summary['setup']}", "", f"Command: `{summary['command']}`", ""]
    runs = summary["policies"]
    pols = list(runs)
    phases = list(dict.fromkeys(k for p in pols for k in runs[p] if k not in ("close_all", "error", "warmup")))
    warm = [f"{p} {w['completed']} of 2 in {w['wall_s']:.1f} s" for p in pols if (w := runs[p].get("warmup"))]
    if warm:
        lines += ["Warm-up on each server before the measured phases (not measured): " + ", ".join(warm) + ".", ""]
    for phase in phases:
        lines += _phase_rows(phase, pols, runs)
        same = summary.get("same_answers", {}).get(phase)
        if same:
            ref = summary["reference"]
            lines += [f"Answers token for token equal to {ref}'s:", ""]
            lines += [f"- {pol}: {text}" for pol, text in same.items()] + [""]
    lines += ["## close all streams while some are paused", "", "| | " + " | ".join(pols) + " |"]
    lines.append("|---|" + "---|" * len(pols))
    for label, fn in (
        ("some paused when closed", lambda c: str(c["paused_when_closed"])),
        ("counts after", lambda c: ", ".join(f"{k} {v:.0f}" for k, v in c["counts_after"].items())),
        ("released in (s)", lambda c: f"{c['released_in_s']:.2f}"),
        ("a new request works", lambda c: str(c["new_request_ok"])),
    ):
        cells = [fn(runs[p]["close_all"]) if "close_all" in runs[p] else "-" for p in pols]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    errors = [f"- {p}: {runs[p]['error']}" for p in pols if "error" in runs[p]]
    note = [f"**{summary['note']}**"] if summary.get("note") else []
    return "\n".join(lines + ([""] + errors if errors else []) + ([""] + note if note else [])) + "\n"


def merge(summaries: list[tuple[str, dict]], baseline: str = "plain") -> str:
    """One report of several runs' summary.json of the same setup (e.g. one policy per device call, or the same
    pair run again): per phase and policy the runs, output tokens/s as mean (min - max), the worst gap, and the
    throughput loss against `baseline`, of the means and in each run that measured both (a single run's loss moves
    with the baseline's own run-to-run spread)."""
    setups = sorted({s["setup"] for _, s in summaries})
    if len(setups) != 1:
        raise ValueError("runs of different setups: " + " | ".join(setups))
    by: dict[str, dict[str, list]] = {}  # phase -> policy -> [(source, result)]
    for src, summary in summaries:
        for pol, res in summary["policies"].items():
            for phase, r in res.items():
                if isinstance(r, dict) and "output_tok_s" in r:
                    by.setdefault(phase, {}).setdefault(pol, []).append((src, r))
    lines = [f"# Seed scenario over {len(summaries)} runs: {setups[0]}", "", "Runs:", ""]
    lines += [f"- `{src}`: `{s['command']}`" for src, s in summaries] + [""]
    for phase, pols in by.items():
        base = pols.get(baseline, [])
        base_mean = float(np.mean([r["output_tok_s"] for _, r in base])) if base else None
        lines += [
            f"## {phase}",
            "",
            f"| policy | runs | completed | output tokens/s: mean (min - max) | worst gap (s) | loss vs {baseline}: "
            "of the means | in each run with both |",
            "|---|---:|---|---|---:|---:|---|",
        ]
        for pol, rs in pols.items():
            tok = [r["output_tok_s"] for _, r in rs]
            done = ", ".join(f"{r['completed']}/{r['streams']}" for _, r in rs)
            mean = float(np.mean(tok))
            loss = f"{1 - mean / base_mean:+.1%}" if base_mean and pol != baseline else "-"
            paired = [1 - r["output_tok_s"] / b["output_tok_s"] for src, r in rs for bsrc, b in base if bsrc == src]
            each = ", ".join(f"{x:+.1%}" for x in paired) if paired and pol != baseline else "-"
            lines.append(
                f"| {pol} | {len(rs)} | {done} | {mean:.1f} ({min(tok):.1f} - {max(tok):.1f}) | "
                f"{max(r['largest_gap_s'] for _, r in rs):.2f} | {loss} | {each} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--policies",
        nargs="+",
        default=["plain", "rotate"],
        help=f"which policies to run, in order: {', '.join(POLICIES)} or one named by --define",
    )
    ap.add_argument("--define", action="append", default=[], metavar="NAME=ARGS",
                    help="a policy of your own: `triton-pd serve` options, e.g. 'wait04=--rotation-wait 0.4' "
                    "(a name starting with host or rotate also gets --host-kv-tokens)")  # fmt: skip
    ap.add_argument("--model", default="random:llama3.1-8b")
    ap.add_argument("--kv-tokens", type=int, default=8192)
    ap.add_argument("--host-kv-tokens", type=int, default=None,
                    help="the host tier of the host and rotate policies (default: the server's; hybrid models have "
                    "none unless this is set)")  # fmt: skip
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies the pool and every length")
    ap.add_argument("--serve-args", default="", help="more `triton-pd serve` options, e.g. GPU placement")
    ap.add_argument("--layout", choices=["one", "split"], default="one",
                    help="one tritonserver, or prefill, decode and master in servers of their own (KV over the network "
                    "transport, or ipc with --decode-serve-args '--kv-transport ipc')")  # fmt: skip
    ap.add_argument("--prefill-serve-args", default="", help="split: options of the prefill server only")
    ap.add_argument("--decode-serve-args", default="", help="split: options of the decode server only")
    ap.add_argument("--phase-limit", type=float, default=300.0, help="seconds per phase before streams are cancelled")
    ap.add_argument(
        "--time-limit",
        type=float,
        default=3600.0,
        help="seconds for the whole run: each phase's limit is cut to what is left, and past it what was measured "
        "so far is written (summary.json, report.md with a TIME LIMIT note), the server stopped and the run exits 124",
    )
    ap.add_argument("--phases", nargs="+", default=[p[0] for p in PHASES], choices=[p[0] for p in PHASES],
                    help="which phases to run (close-all always runs)")  # fmt: skip
    ap.add_argument("--sampling", choices=["greedy", "seeded"], nargs="+", default=["greedy"],
                    help="seeded: temperature 1 with seed 1000 + the stream's index; both: each phase runs once per "
                    "sampling on the same server, as phase 'NAME SAMPLING'")  # fmt: skip
    ap.add_argument("--reference", default="roomy",
                    help="the policy whose answers the others are compared with, token for token (answers.json "
                    "holds them all)")  # fmt: skip
    ap.add_argument(
        "--warmup-tokens",
        type=int,
        default=4200,
        help="before the measured phases, each server answers 2 streams of 200 + this many tokens (scaled), which "
        "overfill the pool: kernels compiled on first use and the pause, swap and recovery paths run once before "
        "anything is timed, on every server alike; 0: none",
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        metavar="DIR",
        help="run nothing: merge these earlier runs' summary.json (same setup) into OUT/merged.md, each policy's "
        "tokens/s as mean and range and its loss against plain of the means and per run",
    )
    ap.add_argument(
        "--require-identical",
        action="store_true",
        help="exit 1 unless every policy's answers equal the reference's (e.g. with --deterministic)",
    )
    a = ap.parse_args(argv)
    if a.merge:
        try:
            summaries = [(d, json.loads((Path(d) / "summary.json").read_text())) for d in a.merge]
            text = merge(summaries)
        except (OSError, ValueError, KeyError) as e:
            ap.error(f"--merge: {e}")
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "merged.md").write_text(text)
        print(text)
        return 0
    policies = dict(POLICIES)
    for d in a.define:
        name, sep, args = d.partition("=")
        if not sep or not name:
            ap.error(f"--define: expected NAME=ARGS, got {d!r}")
        policies[name] = shlex.split(args)
    for pol in a.policies:
        if pol not in policies:
            ap.error(f"--policies: unknown policy {pol!r} (choose from {', '.join(policies)})")
    if not a.time_limit > 0 or not a.phase_limit > 0:
        ap.error(f"--time-limit and --phase-limit: seconds above 0, got {a.time_limit:g} and {a.phase_limit:g}")
    from backends.common.model import loader

    VOCAB[0] = loader.load_config(loader.resolve(a.model)).vocab_size
    from backends.server_process import ServerError, start_deployment

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    sc = lambda n: max(1, int(round(n * a.scale)))  # noqa: E731
    pool, prompt = sc(a.kv_tokens), sc(200)
    summary = {
        "setup": f"{a.model}, decode pool {pool} tokens, prompts {prompt}, {a.serve_args or 'default placement'}"
        + (
            f"; split servers: prefill `{a.prefill_serve_args}`, decode `{a.decode_serve_args}`, KV over "
            f"{_transport(a.decode_serve_args)}"
            if a.layout == "split"
            else ""
        ),  # fmt: skip
        "command": "python perf/scenario.py seed " + shlex.join(sys.argv[1:] if argv is None else argv),
        "sampling": " + ".join(a.sampling),
        "reference": a.reference,
        "policies": {},
    }
    answers: dict = {}  # policy -> phase -> every stream's output ids
    t_start = time.monotonic()
    servers: list = []  # the server now running, for the time limit to stop

    def say(text: str) -> None:
        print(f"[seed +{time.monotonic() - t_start:.0f} s] {text}", flush=True)

    def write(note: str = "") -> None:
        if note:
            summary["note"] = f"{note}; {summary['note']}" if summary.get("note") else note
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        (out / "report.md").write_text(report(summary))

    def note(text: str) -> None:  # said in the report
        summary["note"] = f"{summary['note']}; {text}" if summary.get("note") else text

    def time_left() -> float:  # of --time-limit, less time to stop
        return a.time_limit - (time.monotonic() - t_start) - 20.0

    def limit(what: str) -> float | None:
        """A phase's limit: --phase-limit, or `time_left()`; None where less than a second is left (the phase is not
        run: its figures would be a second's, and its server may be stopping)."""
        left = time_left()
        if left < 1.0:
            note(f"{what} not run: --time-limit reached")
            return None
        if left < a.phase_limit:  # its streams may be cut short
            note(f"{what} limited to {left:.0f} s by --time-limit")
        return min(a.phase_limit, left)

    timer = wall_clock_limit(a.time_limit, write, servers)
    for pol in a.policies:
        res = summary["policies"][pol] = {}
        if time_left() < 1.0:
            note(f"{pol} not run: --time-limit reached")
            continue
        say(f"{pol}: starting a server")
        host = (
            ["--host-kv-tokens", str(a.host_kv_tokens)]
            if a.host_kv_tokens is not None and pol.startswith(("host", "rotate"))
            else []
        )
        # roomy: twice the largest phase's tokens (close-all sends the first phase's streams again)
        kv = max(pool, 2 * max(n * (prompt + sc(n_out)) for _, n, n_out in PHASES)) if pol == "roomy" else pool
        args = ["--model", a.model, "--kv-tokens", str(kv), *policies[pol], *host, *shlex.split(a.serve_args)]
        try:
            log = out / (f"server-{pol}.log" if a.layout == "one" else f"servers-{pol}")
            server = start_deployment(a.layout, args, log, a.prefill_serve_args, a.decode_serve_args)
        except ServerError as e:
            res["error"] = str(e)
            continue
        servers.append(server)
        url, metrics = server.grpc_url, server.metrics_url
        try:
            if a.warmup_tokens > 0 and (lim := limit(f"{pol} warm-up")) is not None:
                say(f"{pol}: warm-up (2 x {prompt}+{sc(a.warmup_tokens)}, not measured)")
                w = run_phase(url, metrics, 2, prompt, sc(a.warmup_tokens), lim, seed=99)
                res["warmup"] = {k: w[k] for k in ("completed", "wall_s", "pauses", "rec_host", "rec_prefill")}
                say(f"{pol}: warm-up: {json.dumps(res['warmup'])}")
            runs = [(name, n, sc(n_out), how) for name, n, n_out in PHASES if name in a.phases for how in a.sampling]
            for name, n, n_out, how in runs:
                phase = name if len(a.sampling) == 1 else f"{name} {how}"
                if (lim := limit(f"{pol} {phase}")) is None:
                    break
                say(f"{pol}: {phase} ({n} x {prompt}+{n_out})")
                res[phase] = run_phase(url, metrics, n, prompt, n_out, lim, seed=len(name),
                                       sampled=how == "seeded")  # fmt: skip
                answers.setdefault(pol, {})[phase] = res[phase].pop("ids")
                summary["same_answers"] = compare_answers(answers, a.reference)
                (out / "answers.json").write_text(json.dumps(answers))
                brief = {
                    k: res[phase][k] for k in ("completed", "largest_gap_s", "wall_s", "output_tok_s", "epoch_max")
                }
                say(f"{pol}: {phase}: {json.dumps(brief)}")
                (out / "summary.json").write_text(json.dumps(summary, indent=1))
            # roomy never pauses: a short wait for a pause that cannot come
            wait = 5.0 if pol == "roomy" else limit(f"{pol} close-all")
            if wait is not None:
                say(f"{pol}: close all while paused")
                res["close_all"] = close_all(url, metrics, prompt, sc(3800), min(wait, 120))
        except Exception as e:
            res["error"] = repr(e)
        finally:
            server.stop()
            servers.remove(server)
            write()
    timer.cancel()
    text = report(summary)
    print(text)
    (out / "report.md").write_text(text)
    if "TIME LIMIT" in summary.get("note", ""):  # the limit came as the last policy ended
        return 124
    if a.require_identical:
        compared = [t for by_pol in summary.get("same_answers", {}).values() for t in by_pol.values()]
        if not compared or any("differences" in t for t in compared):
            print(f"[seed] answers not all identical to {a.reference}'s (or nothing compared)", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
