"""Decode's metrics (through the Python backend's custom-metrics API, on Triton's Prometheus endpoint): the gauges
of requests per state, KV slots, state pages and host copies, and the counters and histograms of pauses,
recoveries, swaps, transfers, speculative drafts and where the loop's time goes. `DecodeLoop` declares them at
start (`_metrics`), counts events as they happen, and sets the gauges and the counters kept as running totals at
most every 50 ms (`_gauges`)."""

from __future__ import annotations

from backends.common.core.request import ReqState
from backends.common.serving.metrics import Metrics

from .steps import DecodeSteps

# pd_decode_loop_seconds_total's parts, in the order of a loop turn (see LoopMetrics._metrics)
LOOP_PARTS = ("idle", "wait", "read", "schedule", "copies", "step")


class LoopMetrics:
    """The metrics part of `DecodeLoop` (the loop's and its scheduler's state is read from there)."""

    def _metrics(self, m: Metrics) -> None:
        self.metrics = m
        g = m.gauge
        self.g = {
            "running": g("pd_decode_running_requests", "Requests in the decode batch"),
            "queued": g("pd_decode_queued_requests", "Requests waiting for admission or for their prompt KV"),
            "paused": g("pd_decode_paused_requests", "Requests paused for lack of KV slots"),
            "recovering": g("pd_decode_recovering_requests", "Paused requests whose KV prefill is recomputing"),
            "used": g("pd_kv_slots_used", "KV slots held by requests"),
            "free": g("pd_kv_slots_free", "KV slots free in the decode pool"),
            "cached": g("pd_kv_slots_cached", "KV slots held by the radix prefix cache"),
            "total": g("pd_kv_slots_total", "KV slots in the decode pool"),
            "epoch": g("pd_recovery_epoch_max", "Highest recovery epoch reached by any request"),
        }
        self.c_pauses = m.counter("pd_pauses_total", "Requests paused for lack of KV slots")
        self.c_recover = {
            k: m.counter("pd_recoveries_total", "Recovered requests by path", path=k)
            for k in ("local", "host", "prefill", "recompute")
        }
        self.c_recovered = {
            k: m.counter(
                "pd_recovered_tokens_total",
                "KV positions of recovering requests, by where they came from (cached: already in this node's pool)",
                source=k,
            )  # fmt: skip
            for k in self.sched.recovered_tokens
        }
        self.c_rotations = m.counter("pd_rotations_total", "Running requests paused to give a paused one its turn")
        self.c_swapped = {
            d: m.counter("pd_host_swapped_tokens_total", "Tokens of KV copied to or from host memory", direction=d)
            for d in ("out", "in", "prefetch")
        }
        self.c_parked = {
            e: m.counter("pd_state_pages_parked_total", "Hybrid models: pauses that kept the state page on the device "
                         "(parked) and parked pages copied out for another request (unparked)", event=e)
            for e in self.sched.parked_pages
        }  # fmt: skip
        self.c_host_skips = {
            r: m.counter("pd_host_swap_skipped_total", "Pauses or recoveries that did not use host memory", reason=r)
            for r in self.sched.host_skips
        }
        self._reported = {
            "swapped": dict(self.sched.swapped_tokens),
            "skips": dict(self.sched.host_skips),
            "parked": dict(self.sched.parked_pages),
            "recovered": dict(self.sched.recovered_tokens),
        }
        self.g["host_used"] = g("pd_host_kv_slots_used", "Host-memory KV slots holding copies of requests' KV")
        self.g["host_total"] = g("pd_host_kv_slots_total", "Host-memory KV slots (0: no host tier)")
        self.g["host_total"].set(self.sched.host_pool.num_slots if self.sched.host_pool else 0)
        self.g["host_pages_used"] = g("pd_host_state_pages_used", "Host-memory state pages holding paused states")
        self.g["host_pages_total"] = g("pd_host_state_pages_total", "Host-memory state pages (hybrid models)")
        self.g["host_pages_total"].set(self.sched.host_pages.num_slots if self.sched.host_pages else 0)
        self.c_stale = m.counter("pd_stale_messages_total", "Transfer completions from a stale epoch, dropped")
        self.c_kv = {
            "landed": m.counter(
                "pd_kv_transfers_total", "KV transfers written into this pool", transport=self.sink.kind
            ),
            "bytes": m.counter("pd_kv_transfer_bytes_total", "Bytes of KV (and state) received over the network"),
            "stale": m.counter(
                "pd_kv_transfers_dropped_total", "KV transfers that arrived for no current attempt", reason="stale"
            ),
            "unexpected": m.counter(
                "pd_kv_transfers_dropped_total", "KV transfers that arrived for no current attempt", reason="unexpected"
            ),
            "failover": m.counter("pd_prefill_failovers_total", "Prefill jobs retried on another prefill server"),
        }
        self.failovers = 0
        self._reported["kv"] = {k: 0 for k in self.c_kv}
        self.c_restarts = m.counter("pd_decode_restarts_total", "Segments ended for lack of KV (on_oom=restart)")
        self.h_recovery = m.histogram("pd_recovery_seconds", "Time from pause to resumed decoding")
        self.h_swap_in = m.histogram(
            "pd_host_swap_in_seconds", "Time from a swap-in's start to decode seeing its copies done",
            buckets=[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0],
        )  # fmt: skip
        self.c_idle_swapping = m.counter(
            "pd_decode_idle_swapping_seconds_total", "Seconds decode had nothing to run while a swap-in was in flight"
        )
        # where the scheduler loop's wall time goes: idle (blocked with nothing to run: waiting for an event, or
        # for a swap-in while nothing runs), wait (taking events and cancels, seeing copies done), reading an
        # unread step's tokens before a plan that may not run over it, scheduling, starting copies and transfers,
        # launching steps and handing out their tokens
        self.loop_time = dict.fromkeys(LOOP_PARTS, 0.0)
        self.c_loop = {
            k: m.counter("pd_decode_loop_seconds_total", "Decode loop wall time by part", part=k)
            for k in self.loop_time
        }
        self._reported["loop"] = dict(self.loop_time)
        # steps read before the next plan (the GPU idles until that plan's step is launched), by the rule of
        # DecodeSteps.read_first that did not hold
        self.read_first = dict.fromkeys(DecodeSteps.READ_FIRST, 0)
        self.c_read_first = {
            k: m.counter("pd_decode_read_first_steps_total", "Decode steps read before the next plan, by why",
                         reason=k)
            for k in self.read_first
        }  # fmt: skip
        self._reported["read_first"] = dict(self.read_first)
        self.g["stalled"] = g("pd_decode_stalled_seconds", "Seconds without progress while requests wait")
        self.c_stalls = m.counter("pd_decode_stalls_total", "Times decode made no progress for stall_seconds with work")
        self.c_violations = m.counter("pd_decode_invariant_violations_total", "Scheduler invariant checks that failed")
        self.c_unfittable = m.counter("pd_decode_unfittable_total", "Requests ended because they could never fit")
        self.c_overlapped = {
            "steps": m.counter(
                "pd_decode_overlapped_steps_total", "Decode steps launched before the previous step's tokens were read"
            )
        }
        self._reported["overlapped"] = {"steps": 0}
        self.c_steps = {"steps": m.counter("pd_decode_steps_total", "Decode steps launched, speculative ones included")}
        self._reported["steps"] = {"steps": 0}
        # a rotation turn's handover: from the step read before the plan that paused the running requests to the
        # first token of each request that plan resumed (with one stream fitting, time no stream advances)
        self.h_handover = m.histogram(
            "pd_rotation_handover_seconds", "From the step read before a rotation turn to the resumed request's token",
            buckets=[0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0],
        )  # fmt: skip
        self._handover: dict[str, float] = {}  # rid -> when the step before its turn was read
        self.handovers = 0  # observed, with their seconds in all: the histogram's count and sum, for tests and tools
        self.handover_seconds = 0.0
        # the host's part of a turn, with the step before it read and the next not launched (the GPU idle): from
        # the turn's plan to its decode step launched (or its plan done, when nothing runs)
        self.c_turn_host = m.counter(
            "pd_rotation_turn_host_seconds_total",
            "Seconds from a rotation turn's plan to its decode step launched (the GPU waits on the host meanwhile)",
        )
        self.turn_host_seconds = 0.0
        self.c_spec = {
            "drafts": m.counter("pd_decode_spec_draft_tokens_total", "Speculative draft tokens verified"),
            "accepted": m.counter("pd_decode_spec_accepted_tokens_total", "Speculative draft tokens kept"),
        }
        self._reported["spec"] = {"drafts": 0, "accepted": 0}
        self.g["total"].set(self.sched.pool.num_slots)
        self.g["state_free"] = g("pd_state_pages_free", "Linear-attention state pages free (hybrid models)")
        self.g["state_used"] = g("pd_state_pages_used", "State pages held by requests (hybrid models)")
        self.g["state_cached"] = g("pd_state_pages_cached", "State pages held as prefix-cache checkpoints")
        self.g["state_total"] = g("pd_state_pages_total", "Linear-attention state pages (0: a dense model)")
        self.g["state_total"].set(self.runner.num_state_pages)
        self._last_gauges = 0.0

    def _gauges(self) -> None:
        now = self.clock()
        if now - self._last_gauges < 0.05:
            return
        self._last_gauges = now
        s = self.sched
        # each set() is its own message to the server, and a scrape may fall between two: the pool's free and
        # cached gauges go first, then the request counts and used slots that a reader waits on to reach 0, so a
        # scrape that sees those at 0 also sees the free and cached counts of that moment or a later one
        free, used, cached = s.accounting()
        self.g["free"].set(free)
        self.g["cached"].set(cached)
        n = s.counts()
        self.g["running"].set(n[ReqState.RUNNING])
        self.g["queued"].set(n[ReqState.WAITING] + n[ReqState.WAITING_KV])
        self.g["paused"].set(n[ReqState.PAUSED])
        self.g["recovering"].set(n[ReqState.RECOVERING])
        self.g["used"].set(used)
        self.g["epoch"].set(s.max_epoch)
        self.g["host_used"].set(s.host_accounting()[1])
        if s.host_pages is not None:
            self.g["host_pages_used"].set(s.host_pages.num_slots - s.host_pages.num_free)
        if s.state is not None:
            sfree, live, ckpts = s.state_accounting()
            self.g["state_free"].set(sfree)
            self.g["state_used"].set(live)
            self.g["state_cached"].set(ckpts)
        self._count_deltas("swapped", s.swapped_tokens, self.c_swapped)
        self._count_deltas("skips", s.host_skips, self.c_host_skips)
        self._count_deltas("parked", s.parked_pages, self.c_parked)
        self._count_deltas("recovered", s.recovered_tokens, self.c_recovered)
        self._count_deltas("loop", self.loop_time, self.c_loop)
        self._count_deltas("read_first", self.read_first, self.c_read_first)
        self._count_deltas("overlapped", {"steps": self.steps.num_overlapped}, self.c_overlapped)
        self._count_deltas("steps", {"steps": self.steps.num_steps}, self.c_steps)
        spec = {"drafts": self.steps.num_drafts, "accepted": self.steps.num_accepted}
        self._count_deltas("spec", spec, self.c_spec)
        self._count_deltas("kv", {**self.sink.counts, "failover": self.failovers}, self.c_kv)
        self.g["stalled"].set(round(self.watchdog.stalled_for(bool(s.reqs)), 1))

    def _count_deltas(self, name: str, totals: dict, counters: dict) -> None:
        """Prometheus counters from the scheduler's running totals."""
        last = self._reported[name]
        for k, v in totals.items():
            if v != last[k]:
                counters[k].increment(v - last[k])
                last[k] = v
