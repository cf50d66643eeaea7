"""The 1024-token decode-pool scenario under `--on-decode-oom pause` and `--on-decode-oom restart`, one run each:
4 concurrent greedy streams, prompts of about 200 tokens, 400 output tokens each (EOS ignored), on CPU SmolLM2.

    python perf/scenario.py pause-vs-restart [--kv-tokens 1024] [--streams 4] [--out FILE.md]

For each mode it reports how many answers differ from the offline engine's token ids, time to last token per
stream, the largest gap between two tokens of one answer, and decode's pause/recovery counters."""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

from backends.common.core.request import SamplingParams
from backends.common.engine.engine import Engine
from tests.server.client import StreamClient
from tests.server.conftest import Server

TOPICS = [
    "the history of astronomy",
    "how bridges are built",
    "the life cycle of stars",
    "ocean currents",
    "medieval trade routes",
    "the chemistry of baking",
]


def prompts(engine, n):
    out = []
    for i in range(n):
        text = (
            f"Write a long, detailed essay about {TOPICS[i % len(TOPICS)]}. Cover its origins, the key people "
            "involved, the important discoveries, the controversies, and what remains unknown today. "
        ) * 6
        out.append(engine.tokenizer.encode(text)[: 190 + 5 * i])
    return out


def run(server, ps, n_out):
    res = [None] * len(ps)

    def go(i):
        c = StreamClient(server.grpc_url, ids=ps[i], params={"max_tokens": n_out, "temperature": 0, "ignore_eos": True})
        t0 = time.monotonic()
        times, last = [], t0
        r = c.result
        while r.finish_reason is None and r.error is None:
            n = len(r.ids)
            c.read(until_tokens=n + 1)
            now = time.monotonic()
            if len(r.ids) > n:
                times.append(now - last)
                last = now
        c.close()
        res[i] = (r, last - t0, max(times[1:], default=0.0))

    ts = [threading.Thread(target=go, args=(i,)) for i in range(len(ps))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-tokens", type=int, default=1024)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--out", default="perf/results/pause_vs_restart_cpu.md")
    a = ap.parse_args()
    engine = Engine("smollm2", kv_tokens=16384)
    ps = prompts(engine, a.streams)
    print("[bench] offline reference ...", flush=True)
    want = [
        o.output_ids
        for o in engine.generate(ps, SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True))
    ]
    rows = []
    for mode in ("pause", "restart"):
        print(f"[bench] serving with --on-decode-oom {mode} ...", flush=True)
        s = Server("--kv-tokens", str(a.kv_tokens), "--on-decode-oom", mode, name=f"bench-{mode}")
        try:
            t0 = time.monotonic()
            res = run(s, ps, a.max_tokens)
            wall = time.monotonic() - t0
            differ = sum(1 for (r, _, _), w in zip(res, want) if r.ids != w)
            errors = sum(1 for r, _, _ in res if r.error)
            ttlt = [t for _, t, _ in res]
            gap = max(g for _, _, g in res)
            m = {k: s.metric(k) for k in ("pd_pauses_total", "pd_decode_restarts_total", "pd_stale_messages_total")}
            rec = {p: s.metric("pd_recoveries_total", path=p) for p in ("local", "prefill")}
            rows.append(
                (mode, differ, errors, min(ttlt), max(ttlt), gap, wall, m, rec, [len(r.ids) for r, _, _ in res])
            )
        finally:
            s.stop()
    lines = [
        f"# pause vs restart, CPU SmolLM2 fp32, decode pool {a.kv_tokens} tokens, {a.streams} streams x "
        f"{a.max_tokens} tokens (greedy, ignore_eos)",
        "",
        "| mode | answers differing from offline | errors | time to last token min / max (s) | largest "
        "token gap (s) | pauses | restarts | recoveries local / prefill | output lengths |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, differ, errors, tmin, tmax, gap, _wall, m, rec, lens in rows:
        lines.append(
            f"| {mode} | {differ} of {a.streams} | {errors} | {tmin:.1f} / {tmax:.1f} | {gap:.2f} | "
            f"{m['pd_pauses_total']:.0f} | {m['pd_decode_restarts_total']:.0f} | "
            f"{rec['local']:.0f} / {rec['prefill']:.0f} | {lens} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text + "\nCommand: `python perf/scenario.py pause-vs-restart`\n")


if __name__ == "__main__":
    main()
