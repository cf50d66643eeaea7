"""Decode's scheduler under a sustained overload on a fake clock: the soak's load (perf/soak.py) against the
rotation, plain and restart policies, before a GPU measures them (perf/soak.py on an H100 or H200).

    .venv/bin/python perf/scenario.py overload-sim                        # 64 users, rotate / plain / restart
    .venv/bin/python perf/scenario.py overload-sim --users 16 64 128      # a milder and a heavier load too
    .venv/bin/python perf/scenario.py overload-sim --policies rotate fixed-turns --duration 120

No model and no server: `DecodeScheduler` alone, as in rotation-sim. Closed-loop users, each sending one answer
after another: long (--long-tokens, drawn from half to one and a half times it) with probability --long-share,
else short (--short-tokens); cancelled at a random token with probability --cancel-share; starts staggered over
the first --stagger seconds. Costs: a decode step --step seconds plus --step-per-request per running request; a
swap-in --swap-per-token seconds per token on one FIFO copy queue; prefill (prompts, recomputes and restarted
segments) --prefill-fixed + --prefill-per-token per computed token on a queue of its own, and since prefill and
decode share the GPU in the soak, decode stands still for that long too. A restarted segment (`--on-decode-oom
restart`) comes back as a new request holding the prompt and what it had generated, as master re-submits it.

Per policy: output tokens/s after --warmup, answers finished and cancelled, inter-token gap percentiles (p50, p99,
largest; the first token's wait counts as TTFT, not as a gap), pauses, rotations, recoveries by path, tokens
swapped in (and per output token), and at the end (users stopped, every answer finished) the counts and pools
back to empty. The defaults are the soak of perf/results/soak_h200: random Llama-3.1-8B on an H200, a 16,384-token
pool, --max-batch 64, 64 users, 30% long answers of ~1,500 tokens, 20% cancelled."""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

if __package__ in (None, ""):  # python3 perf/scenario.py overload-sim: the project root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from backends.common.core.kv_pool import KVPool  # noqa: E402
from backends.common.core.request import InferReq, ReqState, SamplingParams  # noqa: E402
from backends.pd_decode.scheduler import DecodeScheduler  # noqa: E402
from perf.tools.rotation_sim import SHAPES, Clock  # noqa: E402

POLICIES = {  # name: DecodeScheduler keywords (the rest as `serve` sets them)
    "rotate": {},
    "fixed-turns": {"turns_per_wait": 0},  # rotation before the adaptive rule: a turn whenever the head waited
    "plain": {"quantum": 0.0},
    "restart": {"on_oom": "restart"},
}
DEFAULTS = {"quantum": 0.1, "turn_wait": 0.3}  # --rotation-quantum, --rotation-wait


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


class User:
    def __init__(self, u: int, a: argparse.Namespace):
        self.u, self.a, self.rng = u, a, random.Random(a.seed * 1000 + u)
        self.k = 0
        self.start_at = self.rng.uniform(0, a.stagger)

    def next_request(self) -> tuple[InferReq, int | None]:
        a, rng = self.a, self.rng
        self.k += 1
        n = rng.randint(a.long_tokens // 2, a.long_tokens * 3 // 2) if rng.random() < a.long_share else a.short_tokens
        cancel_at = rng.randint(1, n - 1) if n > 1 and rng.random() < a.cancel_share else None
        base = 100_000 * self.u + 1_000 * (self.k % 97)
        ids = [base + j for j in range(a.prompt)]
        return InferReq(f"u{self.u}-{self.k}", ids, SamplingParams(max_tokens=n, temperature=0)), cancel_at


def simulate(a: argparse.Namespace, users: int, policy: dict) -> dict:
    """One run of the load against one policy; returns its figures."""
    clock = Clock()
    kw = {**DEFAULTS, **policy}
    s = DecodeScheduler(KVPool(a.pool), max_running=a.max_batch, host_pool=KVPool(a.host), clock=clock, **kw)
    people = [User(u, a) for u in range(users)]
    idle_until = {u.u: u.start_at for u in people}  # a user sends its next request at this time (None: busy)
    owner: dict[str, tuple[User, int | None, int]] = {}  # rid -> (user, cancel at, tokens the answer had before)
    last: dict[str, float] = {}  # rid's user answer -> when its last token came
    gaps: list[float] = []
    ttft: list[float] = []
    sent_at: dict[str, float] = {}
    tokens_after_warmup = tokens = 0
    finished = cancelled = restarts = 0
    copy_free_at = prefill_free_at = 0.0
    pending: list[tuple[float, object]] = []
    stopping = False
    answer_of: dict[str, str] = {}  # rid of a restarted segment -> the answer it continues (for its gaps)
    gauge = {"running": 0, "paused": 0, "waiting": 0, "plans": 0}  # summed over the plans after the warm-up

    def deliver(rid: str) -> None:
        nonlocal tokens, tokens_after_warmup
        ans = answer_of.get(rid, rid)
        t = clock.t
        if ans in last:
            gaps.append(t - last[ans])
        else:
            ttft.append(t - sent_at[ans])
        last[ans] = t
        tokens += 1
        if t >= a.warmup and not stopping:
            tokens_after_warmup += 1

    def end(rid: str, was_cancel: bool) -> None:
        nonlocal finished, cancelled
        user, _, _ = owner.pop(rid)
        ans = answer_of.pop(rid, rid)
        last.pop(ans, None)
        sent_at.pop(ans, None)
        if was_cancel:
            cancelled += 1
        else:
            finished += 1
        idle_until[user.u] = clock.t

    while True:
        if clock.t >= a.duration and not stopping:
            stopping = True
        if stopping and s.idle() and not pending:
            break
        if clock.t > a.duration + a.drain_limit:
            raise RuntimeError(f"not drained {a.drain_limit} s after the load stopped: {s.counts()}")
        if stopping:  # the users have stopped: every open answer is cancelled, as the soak's end does
            for rid in list(owner):
                if s.cancel(rid) is not None:
                    end(rid, True)
        else:
            for user in people:
                t = idle_until[user.u]
                if t is not None and t <= clock.t:
                    req, cancel_at = user.next_request()
                    owner[req.rid] = (user, cancel_at, 0)
                    sent_at[req.rid] = clock.t
                    idle_until[user.u] = None
                    s.add(req)
        due = [p for p in pending if p[0] <= clock.t]
        pending = [p for p in pending if p[0] > clock.t]
        for _, job in due:
            c = s.on_transfer_done(job.rid, job.epoch, True, first_token=7 if job.sample else 0)
            if c.first_token is not None and job.rid in owner:
                deliver(job.rid)
                check_end(s, job.rid, owner, end)
        plan = s.schedule()
        if plan.rotated:
            clock.t += a.turn_cost
        if clock.t >= a.warmup and not stopping:
            c = s.counts()
            for k, st in (("running", ReqState.RUNNING), ("paused", ReqState.PAUSED), ("waiting", ReqState.WAITING)):
                gauge[k] += c[st]
            gauge["plans"] += 1
        for req in plan.restarted:  # master re-submits prompt + generated ids as a new segment
            user, cancel_at, before = owner.pop(req.rid)
            restarts += 1
            got = before + len(req.output_ids)
            rest = SamplingParams(max_tokens=req.params.max_tokens - len(req.output_ids), temperature=0)
            seg = InferReq(f"{req.rid}+", list(req.all_ids), rest)
            owner[seg.rid] = (user, cancel_at, got)
            answer_of[seg.rid] = answer_of.pop(req.rid, req.rid)
            s.add(seg)
        for req in plan.ended + plan.failed:
            if req.rid in owner:
                end(req.rid, False)
        for job in plan.transfers:  # prefill: its own queue, and decode stands still meanwhile (one GPU)
            cost = a.prefill_fixed + (len(job.ids) - job.start) * a.prefill_per_token
            prefill_free_at = max(prefill_free_at, clock.t) + cost
            pending.append((prefill_free_at, job))
            clock.t += cost
        for job in plan.swap_ins:
            copy_free_at = max(copy_free_at, clock.t) + len(job.host_slots) * a.swap_per_token
            pending.append((copy_free_at, job))
        pending += [(clock.t, job) for job in plan.recomputes]
        if plan.decode:
            clock.t += a.step + a.step_per_request * len(plan.decode)
            for req in list(plan.decode):
                s.after_decode(req, 7)
                deliver(req.rid)
                check_end(s, req.rid, owner, end)
        elif pending:
            clock.t = max(clock.t, min(t for t, _ in pending))
        else:
            clock.t += 0.001
    measured = a.duration - a.warmup
    free, used, cached = s.accounting()
    return {
        "tokens_per_s": tokens_after_warmup / measured, "finished": finished, "cancelled": cancelled,
        "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
        "gap_p50": percentile(gaps, 0.5), "gap_p99": percentile(gaps, 0.99), "gap_max": max(gaps, default=0.0),
        "pauses": s.num_pauses, "rotations": s.num_rotations, "restarts": restarts,
        "recoveries": dict(s.num_recoveries), "swapped_in": s.swapped_tokens["in"], "tokens": tokens,
        "swap_per_token": s.swapped_tokens["in"] / max(tokens, 1),
        "mean": {k: gauge[k] / max(gauge["plans"], 1) for k in ("running", "paused", "waiting")},
        "end": {"requests": len(s.reqs), "used": used, "host_copies": len(s.host), "free": free, "cached": cached,
                "pool": a.pool},
    }  # fmt: skip


def check_end(s: DecodeScheduler, rid: str, owner: dict, end) -> None:
    """After a token of rid: its answer finished (max_tokens) or its user cancels it here."""
    req = s.reqs.get(rid)
    if req is None or rid not in owner:
        return
    _, cancel_at, before = owner[rid]
    got = before + len(req.output_ids)
    if req.state is ReqState.RUNNING and len(req.output_ids) >= req.params.max_tokens:
        s.finish(req, "length")
        end(rid, False)
    elif cancel_at is not None and got >= cancel_at:
        s.cancel(rid)
        end(rid, True)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", nargs="+", default=["rotate", "plain", "restart"], choices=list(POLICIES))
    ap.add_argument("--users", type=int, nargs="+", default=[64], help="concurrent users (several: a run each)")
    ap.add_argument("--duration", type=float, default=60.0, help="simulated seconds of load")
    ap.add_argument("--warmup", type=float, default=15.0, help="simulated seconds not counted in tokens/s")
    ap.add_argument("--stagger", type=float, default=10.0, help="users start at random times within this")
    ap.add_argument("--drain-limit", type=float, default=600.0, help="simulated seconds the end may take")
    ap.add_argument("--pool", type=int, default=16384, help="decode's KV slots (--kv-tokens)")
    ap.add_argument("--host", type=int, default=65536, help="host tier slots (--host-kv-tokens)")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--long-tokens", type=int, default=1500)
    ap.add_argument("--short-tokens", type=int, default=64)
    ap.add_argument("--long-share", type=float, default=0.3)
    ap.add_argument("--cancel-share", type=float, default=0.2)
    ap.add_argument("--step", type=float, default=SHAPES["llama3.1-8b"]["step"], help="seconds per decode step")
    ap.add_argument("--step-per-request", type=float, default=4e-5, help="seconds per running request and step")
    ap.add_argument("--swap-per-token", type=float, default=SHAPES["llama3.1-8b"]["swap_per_token"])
    ap.add_argument("--prefill-fixed", type=float, default=5e-3, help="seconds per prefill job")
    ap.add_argument("--prefill-per-token", type=float, default=4e-5, help="seconds per token prefill computes")
    ap.add_argument("--turn-cost", type=float, default=0.0,
                    help="seconds decode stands still at each rotation turn (host work, pipeline restart)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    print("| users | policy | output tokens/s | vs best | finished | cancelled | TTFT p50 / p99 s | gap p50 / p99 / "
          "largest s | pauses | rotations | restarts | recoveries host/prefill/local | swapped in | per output "
          "token | running / paused / queued, mean | at the end |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---|---|---:|---:|---:|---|---:|---:|---|---|")
    for users in a.users:
        rows = {p: simulate(a, users, POLICIES[p]) for p in a.policies}
        best = max(r["tokens_per_s"] for r in rows.values())
        for p, r in rows.items():
            rec = r["recoveries"]
            e = r["end"]
            clean = e["requests"] == 0 and e["used"] == 0 and e["host_copies"] == 0
            print(f"| {users} | {p} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / best:.3f} | {r['finished']} | "
                  f"{r['cancelled']} | {r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | {r['gap_p50'] * 1e3:.0f} ms / "
                  f"{r['gap_p99']:.3f} / {r['gap_max']:.2f} | {r['pauses']} | {r['rotations']} | {r['restarts']} | "
                  f"{rec['host']}/{rec['prefill']}/{rec['local']} | {r['swapped_in']:,} | {r['swap_per_token']:.1f} | "
                  f"{r['mean']['running']:.1f} / {r['mean']['paused']:.1f} / {r['mean']['waiting']:.1f} | "
                  f"{'all 0' if clean else e} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
