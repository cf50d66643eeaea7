"""Decode's scheduler loop, free of Triton: request arrivals and transfer completions come in as events, one
thread owns every request's state (the scheduler, the KV and state pools, the host tier), runs the decode steps and
hands tokens to the stream sender. What it needs from outside is injected: `send(stream, response)` delivers a
response on a request's stream, `prefill` asks a prefill model for K/V (`PrefillClient`: this server's over BLS or
prefill servers over gRPC, with failover), and `clock` reads the time. `DecodeModel` (model.py) is the Triton glue
around it; tests/inprocess runs it behind a fake Triton."""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from backends.common.core.request import InferReq, ParamError, ReqState
from backends.common.engine.postprocess import finish_reason
from backends.common.engine.tp_ranks import RankError
from backends.common.model.batch import Span
from backends.common.serving.metrics import Metrics
from backends.common.serving.streaming import Item, Stream, StreamSender
from backends.common.serving.wire import DecodeResponse, PrefillRequest, PrefillResponse
from backends.common.transfer.mailbox import prefill_notice
from backends.common.transfer.remote import Unreachable

from .events import Arrival, Event, PrefillClient, TransferDone, Wake
from .liveness import ProgressWatchdog
from .loop_metrics import LoopMetrics
from .scheduler import DecodeScheduler, TransferJob
from .steps import DecodeSteps, drop_after

LAND_TIMEOUT_S = 60.0  # after prefill's answer, how long its rows may take to arrive over the network transport


class DecodeLoop(LoopMetrics):
    """The scheduler loop and everything it owns. `start()` runs it on its own thread; `arrive()` is the only call
    other threads make (cancels come through the mailbox, transfer outcomes as events); `stop()` ends it."""

    def __init__(self, runner, sched: DecodeScheduler, sink, mailbox, host_kv, prefill: PrefillClient,
                 send: Callable[[Stream, DecodeResponse], None], metrics: Metrics, *,
                 send_flush: Callable[[], None] | None = None, overlap: bool = True, speculative: str = "off",
                 stall_seconds: float = 30.0, prefill_concurrency: int = 16, faults: frozenset[str] = frozenset(),
                 name: str = "pd_decode", clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.runner, self.sched, self.sink, self.mailbox, self.host_kv = runner, sched, sink, mailbox, host_kv
        self.prefill, self.clock, self.instance = prefill, clock, name
        self.eos = runner.cfg.eos_token_ids
        self.steps = DecodeSteps(runner, sched, self.eos, self._after_token, overlap=overlap, speculative=speculative)
        self.watchdog = ProgressWatchdog(stall_seconds, clock=clock)
        self._last_invariant_check = 0.0
        # test hooks: "stale" re-delivers every recovery completion under the previous epoch (it must be dropped)
        self.faults = faults
        self.events: queue.Queue = queue.Queue()
        self.streams: dict[str, Stream] = {}
        self.sender = StreamSender(send, send_flush)
        self.transfers = ThreadPoolExecutor(max_workers=prefill_concurrency, thread_name_prefix="pd-transfer")
        self._metrics(metrics)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="pd-decode-loop", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def arrive(self, req: InferReq, sender) -> None:
        """A new request and the sender of its stream (any thread)."""
        self.events.put(Arrival(req, sender))

    def stop(self, timeout: float = 10.0) -> None:
        """End the loop and its helpers (the streams still open get nothing more)."""
        self.stopping.set()
        self.events.put(Wake())
        if self.thread.is_alive():
            self.thread.join(timeout=timeout)
        self.transfers.shutdown(wait=False, cancel_futures=True)
        self.sender.close()

    # ---- the scheduler loop ------------------------------------------------------------------------------
    def _run(self) -> None:
        last_cancel_poll = 0.0
        while not self.stopping.is_set():
            try:
                lt, t0 = self.loop_time, self.clock()
                running = any(r.state is ReqState.RUNNING for r in self.sched.reqs.values())
                swapping = self.host_kv is not None and self.host_kv.in_flight() > 0
                if swapping and not running and self.host_kv.cuda:
                    # nothing to run until a copy lands: wait on the copy itself, not on a polling interval
                    self.host_kv.wait_first()
                    self.c_idle_swapping.increment(self.clock() - t0)
                self._drain(block=not running and not swapping, timeout=0.05)
                if not running:  # blocked for an event or a swap-in, or had nothing to run
                    ti = self.clock()
                    lt["idle"] += ti - t0
                    t0 = ti
                self._swaps_done()
                now = self.clock()
                poll = now - last_cancel_poll > 0.5
                self._take_cancels(poll_senders=poll)
                if poll:
                    last_cancel_poll = now
                tr = self.clock()
                lt["wait"] += tr - t0
                if self.steps.pending and (why := self.steps.read_first(busy=swapping)) is not None:
                    self.steps.flush()  # this schedule may look at token histories or hand slots out
                    self.read_first[why] += 1
                t1 = self.clock()
                lt["read"] += t1 - tr
                plan = self.sched.schedule(decode_only=self.steps.pending)  # pending: may_keep said so
                for req in plan.ended:
                    self._emit(req, [], "length")
                for req in plan.failed:
                    self.c_unfittable.increment(1)
                    self._emit(req, [], None, error=req.error)
                if plan.paused:
                    self.c_pauses.increment(len(plan.paused))
                if plan.rotated:
                    self.c_rotations.increment(len(plan.rotated))
                    resumed = [r.rid for r in plan.resumed_local] + [j.rid for j in plan.recomputes + plan.transfers]
                    resumed += [j.rid for j in plan.swap_ins if not j.prefetch]
                    self._handover.update(dict.fromkeys(resumed, t1))
                for req in plan.resumed_local:
                    self.c_recover["local"].increment(1)
                    self.h_recovery.observe(self.clock() - req.paused_at)
                for req in plan.restarted:
                    self.c_restarts.increment(1)
                    self._emit(req, [], "restart")
                t2 = self.clock()
                lt["schedule"] += t2 - t1
                self._swap_out(plan)  # read paused requests' slots and pages before this plan reuses any
                if self.sched.state is not None:  # state copies the plan queued, before prefill or a step writes
                    self.runner.apply_state_ops(self.sched.state.take_ops())
                self._recompute(plan)
                self._swap_in(plan)
                for job in plan.transfers:
                    self.transfers.submit(self._transfer, self._prefill_request(job))
                    self.watchdog.progress()
                t3 = self.clock()
                lt["copies"] += t3 - t2
                if plan.decode:
                    if self.host_kv is not None:
                        self.host_kv.order_compute()  # the step may write slots a swap-out is still reading
                    self.steps.step(plan.decode)
                else:
                    self.steps.flush()
                    self._check_invariants()
                t4 = self.clock()
                lt["step"] += t4 - t3
                if plan.rotated:
                    self.turn_host_seconds += t4 - t1
                    self.c_turn_host.increment(t4 - t1)
                self._check_progress()
                self._gauges()
            except RankError as e:  # a tensor-parallel rank is gone: this instance cannot step again
                self._log(f"decode instance failed: {e}")
                try:
                    self._fail_all(f"decode instance failed: {e}")
                finally:
                    os._exit(70)  # the stub dies, and the launcher stops the server naming it (as for a dead stub)
            except Exception as e:  # never let the loop die silently: fail what is running, keep serving
                try:
                    self._fail_all(f"decode loop error: {e!r}")
                except Exception as e2:  # the loop must outlive even a failure to fail
                    self._log(f"decode loop error {e!r}, then {e2!r} while failing its requests")

    def _recompute(self, plan) -> None:
        """Hybrid models: recompute the short trimmed tails of recovering histories here, from the state
        checkpoint the cache restored (one forward pass over all of them), and answer them like transfers."""
        if not plan.recomputes:
            return
        spans = []
        for job in plan.recomputes:
            req = self.sched.reqs[job.rid]
            spans.append(Span(job.ids[job.start :], job.start, req.slots, req.rid, req.state_page, mm=req.mm))
        self.runner.forward(spans)
        self.watchdog.progress()
        for job in plan.recomputes:
            self._handle(TransferDone(job.rid, job.epoch, True))

    def _swap_out(self, plan) -> None:
        """Start the plan's swap-outs (FIFO on the copy stream) before anything else of the plan: the compute
        stream's next work (the queued state copies, a recompute, the step) waits for them, so a slot or state page
        of a request paused in this plan can be handed to another in the same plan."""
        if self.host_kv is None or not plan.swap_outs:
            return
        self.watchdog.progress()
        self.host_kv.swap_out(plan.swap_outs)
        self.host_kv.order_compute()

    def _swap_in(self, plan) -> None:
        """Start the plan's swap-ins, after its swap-outs on the same copy stream. Prefill writes through its own
        process, so slots go to prefill only after the swap-outs that read them are done."""
        if self.host_kv is None:
            return
        if plan.swap_ins:
            self.watchdog.progress()
        for job in self.host_kv.swap_in(plan.swap_ins):
            self._handle(TransferDone(job.rid, job.epoch, True))
        if plan.transfers:
            self.host_kv.wait_swap_outs()

    def _swaps_done(self) -> None:
        if self.host_kv is None:
            return
        for job in self.host_kv.done():
            self._handle(TransferDone(job.rid, job.epoch, True))
        for seconds in self.host_kv.durations:
            self.h_swap_in.observe(seconds)
        self.host_kv.durations.clear()

    def _log(self, message: str) -> None:
        print(f"[triton-pd] {self.instance}: {message}", file=sys.stderr, flush=True)

    def _check_invariants(self) -> None:
        """Pool accounting, slot ownership and liveness, at most once a second while decode is not decoding."""
        now = self.clock()
        if now - self._last_invariant_check < 1.0:
            return
        self._last_invariant_check = now
        violations = self.sched.check_invariants()
        if violations:
            self.c_violations.increment(1)
            self._log("scheduler invariants violated: " + "; ".join(violations))

    def _check_progress(self) -> None:
        s = self.sched
        stalled = self.watchdog.check(waiting=bool(s.reqs))
        if stalled is None:
            return
        self.c_stalls.increment(1)
        free, used, cached = s.accounting()
        counts = ", ".join(f"{st.value} {n}" for st, n in s.counts().items())
        self._log(
            f"no progress for {stalled:.1f} s with work waiting: {counts}; {len(s.inflight)} transfers in flight; "
            f"KV free {free} / used {used} / cached {cached} of {s.pool.num_slots}"
        )

    def _drain(self, block: bool, timeout: float = 0.05) -> None:
        try:
            ev = self.events.get(timeout=timeout) if block else self.events.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(ev)
            try:
                ev = self.events.get_nowait()
            except queue.Empty:
                return

    def _handle(self, ev: Event) -> None:
        if isinstance(ev, Arrival):
            req = ev.req
            refusal = f"request_id {req.rid}: duplicate" if req.rid in self.sched.reqs else None
            if refusal is None:
                try:
                    self.sched.add(req)
                except ParamError as e:  # a prompt this instance can never hold
                    refusal = str(e)
            if refusal is not None:
                self.sender.push(
                    Item(Stream(req.rid, ev.sender), DecodeResponse(error=refusal, error_code="INVALID_ARG"))
                )
                return
            self.streams[req.rid] = Stream(req.rid, ev.sender)
        elif isinstance(ev, TransferDone):
            self.watchdog.progress()
            if (ev.rid, ev.epoch) in self.sched.orphans:  # cancelled meanwhile: prefill no longer needs the notice
                self.sink.discard_cancel(prefill_notice(ev.rid, ev.epoch))
            c = self.sched.on_transfer_done(ev.rid, ev.epoch, ev.ok, ev.first_token, ev.error)
            if c.stale:
                self.c_stale.increment(1)
            elif c.failed:
                self._emit(c.req, [], None, error=c.failed)
            elif c.first_token is not None:
                self._after_token(c.req, c.first_token)
            elif c.recovered:
                if "stale" in self.faults:
                    self.events.put(TransferDone(ev.rid, ev.epoch - 1, True, 0))
                self.c_recover[c.path].increment(1)
                self.h_recovery.observe(self.clock() - c.req.paused_at)

    def _take_cancels(self, poll_senders: bool) -> None:
        for rid, reason in self.mailbox.take(self.sched.reqs):
            self._cancel(rid, reason)
        if poll_senders:  # fallback: the caller's side of the BLS stream went away
            for rid, st in list(self.streams.items()):
                try:
                    gone = st.sender.is_cancelled()
                except Exception:
                    gone = False
                if gone:
                    self._cancel(rid, "cancelled")

    def _cancel(self, rid: str, reason: str) -> None:
        self.steps.flush()  # a cancelled running request's tokens go to the cache: none may be a placeholder
        req = self.sched.cancel(rid, reason)
        if req is None:
            return
        job = self.sched.inflight.get((rid, req.epoch))
        if (rid, req.epoch) in self.sched.orphans and job is not None and job.source == "prefill":
            # prefill is computing for it: drop the job (this host's mailbox, or the network transport's store)
            self.sink.post_cancel(prefill_notice(rid, req.epoch), reason)
        self._emit(req, [], reason)

    def _transfer(self, msg: PrefillRequest) -> None:
        """Runs on a transfer thread: asks prefill (this server's over BLS, or a live prefill server over gRPC,
        failing over to the next when one cannot be reached) and waits for the rows to land; the outcome goes back
        to the loop as an event, only after the transport has stopped writing for this attempt."""
        rid, epoch = msg.request_id, msg.epoch
        exp = self.sink.expect(rid, epoch, msg.dst_slots, msg.dst_state_page)
        done = TransferDone(rid, epoch, False, error="prefill: no server answered")
        try:
            for server in self.prefill.order():
                attempt = replace(msg, kv_handle=exp.kv_handle, state_handle=exp.state_handle)
                try:
                    get, err = self.prefill.ask(server, attempt)
                except Unreachable as e:
                    done.error = str(e)
                    self.failovers += 1
                    exp = self.sink.retry(exp)  # rows the lost server may still send are dropped
                    continue
                if err is not None:
                    done = TransferDone(rid, epoch, False, error=f"prefill: {err}")
                    break
                answer = PrefillResponse.decode(get)
                if answer.epoch != epoch or (msg.sample and answer.first_token is None):
                    raise ParamError("first_token", f"prefill answered epoch {answer.epoch} token {answer.first_token}")
                if not self.sink.landed(exp, LAND_TIMEOUT_S):
                    done = TransferDone(rid, epoch, False, error=f"prefill answered, but its KV did not arrive in "
                                        f"{LAND_TIMEOUT_S:g} s")  # fmt: skip
                    break
                done = TransferDone(rid, epoch, True, answer.first_token)
                break
        except Exception as e:
            done = TransferDone(rid, epoch, False, error=f"prefill call failed: {e}")
        finally:
            self.sink.forget(exp)  # nothing writes these slots for this attempt any more
        self.events.put(done)

    def _release_images(self, rid: str) -> None:
        """On a transfer thread: tells every prefill server that `rid` ended, so that the one keeping its images
        (any of them, after a failover) lets them go; a failure is logged, never raised."""
        msg = PrefillRequest.release_of(rid)
        for server in self.prefill.order():
            try:
                self.prefill.ask(server, msg)
            except Exception as e:  # noqa: BLE001 (Unreachable and the like: the notice is best effort)
                print(f"[pd_decode] release of {rid}'s images: {e}", file=sys.stderr, flush=True)

    def _prefill_request(self, job: TransferJob) -> PrefillRequest:
        req = self.sched.reqs[job.rid]
        params = replace(req.params, seed=req.seed)  # resolved once here: prefill samples with decode's seed
        # the transport's handles are filled in per attempt (_transfer)
        mm_info, images = req.mm_wire if req.mm is not None else ("", [])
        return PrefillRequest(
            job.rid, job.ids, job.start, job.dst_slots, job.epoch, job.sample, params, "",
            "", job.state_page, mm_info, images,
        )  # fmt: skip

    def _after_token(self, req: InferReq, token: int, num_out: int | None = None) -> None:
        """`token` is output number num_out (default: the last) of req."""
        # "length" at sched.max_len: the model's context or the pool's size, whichever is smaller (a request that
        # outgrew the pool could never be given its next slot)
        turn = self._handover.pop(req.rid, None)
        if turn is not None:
            took = self.clock() - turn
            self.handovers += 1
            self.handover_seconds += took
            self.h_handover.observe(took)
        reason = finish_reason(req, token, self.eos, self.sched.max_len, num_out=num_out)
        if reason:
            if num_out is not None:
                drop_after(req, num_out)  # a step launched after this token computed a row for nothing
            self.sched.finish(req, reason)
        self._emit(req, [token], reason)

    def _emit(self, req: InferReq, ids: list[int], reason: str | None, error: str | None = None) -> None:
        final = reason is not None or error is not None
        if final:
            self._handover.pop(req.rid, None)
        stream = self.streams.pop(req.rid, None) if final else self.streams.get(req.rid)
        if final and req.mm is not None:  # prefill keeps the request's images until it hears the request ended
            self.transfers.submit(self._release_images, req.rid)
        self.watchdog.progress()
        if stream is not None:
            self.sender.push(Item(stream, DecodeResponse(ids, reason, error, num_pauses=req.num_pauses)))

    def _fail_all(self, message: str) -> None:
        self.steps.drop()
        for rid in list(self.sched.reqs):
            req = self.sched.cancel(rid, "error")
            if req is not None:
                self._emit(req, [], None, error=message)
