"""perf/soak.py policies: one policy's row from its counters and clients' latencies, the issue's checks, the
report (the servers themselves: by hand and on the GPU, see the module's text)."""

from __future__ import annotations

import math

from perf.tools.soak_policies import checks, parser, report, summarize

ZERO = {"running": 0.0, "queued": 0.0, "paused": 0.0, "recovering": 0.0, "kv_used": 0.0, "host_used": 0.0}


def counters(tokens, swapped_in, pauses=0, finished=0, errors=0):
    return {"tokens": tokens, "finished": finished, "cancelled": 0, "errors": errors, "pauses": pauses,
            "rotations": pauses, "rec_local": 0, "rec_host": pauses, "rec_prefill": 0, "rec_recompute": 0,
            "swapped_in": swapped_in, "swapped_out": swapped_in // 2}  # fmt: skip


def row(tokens_per_s, swap_ratio, gaps, end=ZERO, errors=0):
    before = counters(1000, 500)
    after = counters(1000 + 10 * tokens_per_s, 500 + int(10 * tokens_per_s * swap_ratio), pauses=5, finished=7,
                     errors=errors)  # fmt: skip
    return summarize(10.0, before, after, end, [0.2, 0.4], gaps)


def test_a_row_is_the_span_between_its_two_snapshots():
    r = row(300, 4.0, [0.01] * 98 + [1.5, 3.0])
    assert r["tokens_per_s"] == 300 and r["finished"] == 7 and r["pauses"] == 5
    assert r["swapped_in_per_token"] == 4.0 and r["swapped_in_per_s"] == 1200 and r["swapped_out_per_s"] == 600
    assert r["gap_p50"] == 0.01 and r["gap_p99"] == 3.0 and r["gap_max"] == 3.0 and r["ttft_p50"] == 0.4
    assert math.isnan(summarize(10.0, counters(0, 0), counters(0, 0), {}, [], [])["gap_p99"])


def test_the_checks_compare_rotate_with_the_best_other_policy():
    a = parser().parse_args(["--out", "x"])
    good = {"rotate": row(960, 4.0, [0.01] * 200), "plain": row(1000, 3.0, [0.01] * 200),
            "restart": row(800, 0.0, [0.01] * 200)}  # fmt: skip
    assert all(checks(good, a).values()), checks(good, a)
    slow = dict(good, rotate=row(940, 4.0, [0.01] * 200))
    thrash = dict(good, rotate=row(960, 12.0, [0.01] * 200))
    stalls = dict(good, rotate=row(960, 4.0, [0.01] * 90 + [2.5] * 10))
    leaks = dict(good, plain=row(1000, 3.0, [0.01] * 200, end=dict(ZERO, kv_used=12.0)))
    for bad in (slow, thrash, stalls, leaks):
        assert [k for k, ok in checks(bad, a).items() if not ok] != []
    assert not checks({"rotate": good["rotate"]}, a)["every policy ran"]


def test_the_report_has_a_row_per_policy_and_says_what_did_not_run():
    a = parser().parse_args(["--out", "x"])
    rows = {"rotate": row(960, 4.0, [0.01] * 200)}
    result = {"checks": checks(rows, a), "skipped": {"plain": "needs about 240 s, 100 s left"}, "errors": []}
    text = report(rows, result, "python3 perf/soak.py policies --out x")
    assert "| rotate | 960.0 | 1.000 |" in text and "all 0" in text
    assert "- not run: plain (needs about 240 s, 100 s left)" in text and "- FAIL: every policy ran" in text
