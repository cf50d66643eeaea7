"""Decode's scheduler in the seed scenario on a fake clock: what a rotation policy costs in steps, swap-ins and
throughput before an H200 measures it (perf/scenario.py seed). No model and no server: `DecodeScheduler` alone, a
decode step costs --step seconds whatever the batch, a swap-in --swap-per-token seconds per token on one copy
queue, a prompt's prefill 20 ms, and decode waits for a copy only when nothing else can run.

    .venv/bin/python perf/scenario.py rotation-sim              # plain, round robin, smallest, smallest + prefetch
    .venv/bin/python perf/scenario.py rotation-sim --random 20  # and 20 seeded loads of varied lengths each
    .venv/bin/python perf/scenario.py rotation-sim --wait 0.3 0.4 --turn-cost 0.015  # turns that also cost 15 ms each

(The project's environment, or any Python with torch: decode's step rule and the host tier's run count are
imported from backends/pd_decode.)

Per policy and scenario: simulated seconds, output tokens/s (and the loss against plain), decode steps, steps at
batch 1, the largest gap between two tokens of one answer, rotations and tokens swapped in; the steps decode
reads before planning the next (`DecodeSteps.may_keep` does not hold: the GPU waits for the host's plan); and the
host side, in this machine's wall time: schedule()'s milliseconds in a rotation turn and in any other plan, and
the runs of consecutive host slots per swap (the host tier launches one copy per run). The defaults are the dense
Llama-3.1-8B shape on an H200: a 4.5 ms step, a 5,000-token swap-in in 11.5 ms. `--shape qwen3.5-9b`: the hybrid
shape instead (state pages, host state pages, a 4.6 ms step, K/V a quarter of the dense shape's per token, and
each state page copied in or out 2 ms: 50 MiB at 25 GB/s); swap-outs then take their place on the copy queue too
(the victim's page goes out before the next request's comes in), and waited swap-in tokens count only what decode
waits for at a turn, not what a prefetch brought ahead of it.

    .venv/bin/python perf/scenario.py rotation-sim --shape qwen3.5-9b --policies plain smallest smallest+prefetch

For a hybrid shape every policy keeps a paused request's state page on the device, as the server does."""

from __future__ import annotations

import argparse
import random
import sys
import time
import types
from pathlib import Path

if __package__ in (None, ""):  # python3 perf/scenario.py rotation-sim: the project root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from backends.common.core.kv_pool import KVPool  # noqa: E402
from backends.common.core.request import InferReq, SamplingParams  # noqa: E402
from backends.common.core.state_pages import ZERO, StatePages  # noqa: E402
from backends.pd_decode.host_tier import by_host_slot, runs  # noqa: E402
from backends.pd_decode.scheduler import DecodeScheduler  # noqa: E402
from backends.pd_decode.steps import DecodeSteps  # noqa: E402

PREFILL_S = 0.02
SHAPES = {  # step s, swap s per token, s per state page copied (0: a dense model)
    "llama3.1-8b": {"step": 0.0045, "swap_per_token": 11.5e-3 / 5000, "page_s": 0.0},
    "qwen3.5-9b": {"step": 0.0046, "swap_per_token": 11.5e-3 / 5000 / 4, "page_s": 0.002},
}
POLICIES = {  # name: DecodeScheduler keywords
    "plain": {"quantum": 0.0},
    "round-robin": {"rotation_victims": "longest-running", "prefetch_margin": None},
    "smallest": {"rotation_victims": "smallest", "prefetch_margin": None},
    "smallest+prefetch": {"rotation_victims": "smallest", "prefetch_margin": 64},
}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def simulate(outs: list[int], prompt: int = 200, pool: int = 8192, host: int = 65536, quantum: float = 0.1,
             wait: float = 0.3, step: float = SHAPES["llama3.1-8b"]["step"],
             swap_per_token: float = SHAPES["llama3.1-8b"]["swap_per_token"],
             limit_s: float = 3600.0, turn_cost: float = 0.0, page_s: float = 0.0, **kw) -> dict:  # fmt: skip
    """One stream per entry of `outs` (its output tokens), all arriving at once; returns the run's figures.
    turn_cost: seconds decode stands still at each rotation turn, beyond waiting for its copies (the handover's
    host work and pipeline restart, which the fake clock does not otherwise see). page_s > 0: a hybrid model
    (state pages on the device and in the host tier), each page copy taking that long on the copy queue."""
    clock = Clock()
    hybrid = {}
    if page_s > 0:
        hybrid = {"state": StatePages(4 * len(outs) + 16), "host_pages": KVPool(2 * len(outs))}
    s = DecodeScheduler(KVPool(pool), host_pool=KVPool(host), quantum=quantum, turn_wait=wait, clock=clock, **hybrid,
                        **kw)  # fmt: skip
    for i, n in enumerate(outs):
        s.add(InferReq(f"r{i}", [1000 * i + j for j in range(prompt)], SamplingParams(max_tokens=n, temperature=0)))
    # decode's rule for planning over an unread step (a step is "read first" when it does not hold)
    rule = DecodeSteps(types.SimpleNamespace(graph_batch=lambda n: True), s, [], None)
    stepped = False
    pending: list[tuple[float, object]] = []  # (done at, job)
    times: dict[str, list[float]] = {f"r{i}": [] for i in range(len(outs))}
    tokens = steps = batch1 = waited = 0
    copy_free_at = 0.0
    host = {"turn_s": 0.0, "other_s": 0.0, "others": 0, "copies": 0, "runs": 0}
    reasons: dict[str, int] = {}  # steps read first, by DecodeSteps.read_first's reason
    while not s.idle():
        if clock.t > limit_s:
            raise RuntimeError(f"not done after {limit_s} simulated seconds: {s.counts()}")
        due = [p for p in pending if p[0] <= clock.t]
        pending = [p for p in pending if p[0] > clock.t]
        for _, job in due:
            c = s.on_transfer_done(job.rid, job.epoch, True, first_token=7 if job.sample else 0)
            if c.first_token is not None:
                times[job.rid].append(clock.t)
        why = rule.read_first() if stepped else "after an idle plan"
        keep = why is None
        t0 = time.perf_counter()
        plan = s.schedule(decode_only=keep)
        dt = time.perf_counter() - t0
        if plan.rotated:
            clock.t += turn_cost
            host["turn_s"] += dt
        else:
            host["other_s"] += dt
            host["others"] += 1
        for job in plan.swap_outs + plan.swap_ins:  # HostKV copies one run of host slots per copy launch
            host["copies"] += 1
            host["runs"] += len(runs(by_host_slot(job.device_slots if hasattr(job, "device_slots")
                                                  else job.dst_slots, job.host_slots)[1]))  # fmt: skip
        pending += [(clock.t + PREFILL_S, job) for job in plan.transfers]
        if page_s > 0:  # a hybrid pause's page (and its new K/V) goes out first, on the same FIFO queue
            for out in plan.swap_outs:
                cost = len(out.host_slots) * swap_per_token + (page_s if out.host_page != ZERO else 0.0)
                copy_free_at = max(copy_free_at, clock.t) + cost
        for job in plan.swap_ins:  # one FIFO copy queue
            cost = len(job.host_slots) * swap_per_token + (page_s if job.host_page != ZERO else 0.0)
            copy_free_at = max(copy_free_at, clock.t) + cost
            pending.append((copy_free_at, job))
            waited += 0 if job.prefetch else len(job.host_slots)
        pending += [(clock.t, job) for job in plan.recomputes]
        stepped = bool(plan.decode)
        if plan.decode:
            clock.t += step
            steps += 1
            if not keep:
                reasons[why] = reasons.get(why, 0) + 1
            batch1 += len(plan.decode) == 1
            for req in list(plan.decode):
                s.after_decode(req, 7)
                tokens += 1
                times[req.rid].append(clock.t)
                if len(req.output_ids) >= req.params.max_tokens:
                    s.finish(req, "length")
        elif pending:
            clock.t = max(clock.t, min(t for t, _ in pending))
        else:
            clock.t += 0.001
    gap = max((b - a for v in times.values() for a, b in zip(v, v[1:])), default=0.0)
    return {"seconds": clock.t, "tokens_per_s": tokens / clock.t, "steps": steps, "batch1_steps": batch1,
            "largest_gap": gap, "rotations": s.num_rotations, "swapped_in": s.swapped_tokens["in"], "waited": waited,
            "turn_ms": 1e3 * host["turn_s"] / max(s.num_rotations, 1),
            "plan_ms": 1e3 * host["other_s"] / max(host["others"], 1),
            "runs_per_copy": host["runs"] / max(host["copies"], 1), "read_first": sum(reasons.values()),
            "read_first_by": reasons}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--shape", choices=list(SHAPES), default="llama3.1-8b",
                    help="the model's costs (qwen3.5-9b: a hybrid model, with state pages)")  # fmt: skip
    ap.add_argument("--step", type=float, default=None, help="seconds per decode step (default: the shape's)")
    ap.add_argument("--swap-per-token", type=float, default=None,
                    help="seconds per token swapped in (default: the shape's)")  # fmt: skip
    ap.add_argument("--wait", type=float, nargs="+", default=[0.3], help="--rotation-wait (several: each is run)")
    ap.add_argument("--turn-cost", type=float, default=0.0,
                    help="seconds decode stands still at each turn beyond its copies (host work, restart)")  # fmt: skip
    ap.add_argument("--random", type=int, default=0, help="also N seeded loads: 8 x ~2,000 and 16 x ~1,000 tokens, "
                    "each answer's length drawn 0.3-1.7x")  # fmt: skip
    a = ap.parse_args(argv)
    scenarios = {"4 x (200 + 3800)": [3800] * 4, "3 x (200 + 5300)": [5300] * 3}
    for seed in range(a.random):
        rng = random.Random(seed)
        for n, o in ((8, 2000), (16, 1000)):
            scenarios[f"random {seed}: {n} x ~{o}"] = [int(o * rng.uniform(0.3, 1.7)) for _ in range(n)]
    kw = dict(SHAPES[a.shape], turn_cost=a.turn_cost)
    kw.update({k: v for k, v in (("step", a.step), ("swap_per_token", a.swap_per_token)) if v is not None})
    means = {(p, w): [] for p in a.policies for w in (a.wait if p != "plain" else a.wait[:1])}
    print("| scenario | policy | wait | s | tokens/s | vs plain | steps | at batch 1 | largest gap | rotations | "
          "swapped in | waited for at a turn | steps read first | turn's plan ms | other plans ms | "
          "runs per copy | read first by |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, outs in scenarios.items():
        base = None
        for p, w in means:
            r = simulate(outs, wait=w, **kw, **POLICIES[p])
            means[(p, w)].append(r["tokens_per_s"])
            base = r["tokens_per_s"] if p == "plain" else base
            loss = f"{1 - r['tokens_per_s'] / base:+.1%}" if base else "-"
            print(f"| {name} | {p} | {'-' if p == 'plain' else w} | {r['seconds']:.2f} | {r['tokens_per_s']:.1f} | "
                  f"{loss} | {r['steps']} | {r['batch1_steps']} | {r['largest_gap']:.3f} | {r['rotations']} | "
                  f"{r['swapped_in']:,} | {r['waited']:,} | {r['read_first']} | {r['turn_ms']:.2f} | "
                  f"{r['plan_ms']:.3f} | {r['runs_per_copy']:.1f} | "
                  f"{', '.join(f'{k} {n}' for k, n in sorted(r['read_first_by'].items())) or '-'} |",
                  flush=True)  # fmt: skip
    if a.random:
        for (p, w), v in means.items():
            rnd = v[2:]
            print(f"mean tokens/s over the {len(rnd)} random loads, {p} (wait {w}): {sum(rnd) / len(rnd):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
