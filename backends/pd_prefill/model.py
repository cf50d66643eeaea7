"""pd_prefill: computes K/V for the positions decode asks for (a prompt at epoch 0, the missing history of a
paused request at epoch > 0) with chunked prefill over its own radix cache, writes them into decode's slots through
the KV hand-off and answers with the first sampled token (recovery samples are discarded).

Triton hands each execute() call a list of requests; all of them run as one continuous batch, recovery jobs
first. Recovery jobs are never refused for queue limits: they carry work that is already streaming.

A job whose request decode cancelled (decode posts a notice in its mailbox, or in the network transport's store,
whichever its job's kv_handle names) ends at the next step
boundary, or at once if it has not started, with the error "cancelled": its slots on decode are released when
that answer arrives."""

from __future__ import annotations

import os
import threading
import time

from backends.common.core.request import ParamError, SamplingParams
from backends.common.core.role_config import PrefillConfig, read_key
from backends.common.engine.engine import Engine
from backends.common.engine.runner import set_cpu_threads
from backends.common.engine.sizing import resolve_prefill
from backends.common.model.loader import load_config, resolve
from backends.common.model.multimodal import MMInfo, Multimodal
from backends.common.serving import triton_io as tio
from backends.common.serving.metrics import Metrics
from backends.common.serving.wire import KEY_FIELD, PrefillRequest, PrefillResponse
from backends.common.transfer.kv_transport import KVSource
from backends.common.transfer.mailbox import prefill_notice

SLOW_PREFILL_SECONDS = 3.0  # the "slow_prefill" test hook's wait before each batch
# with "slow_recovery" too, a batch holding a recovery job waits this long instead: a test that cancels a
# recovering request must see the notice reach prefill while it holds the job, and on a loaded 2-core machine
# the notice's way through master, decode and the mailbox once took longer than 3 s
SLOW_RECOVERY_SECONDS = 10.0


class PrefillJob:
    """One PrefillRequest being computed: its answer (first token or error) and its cancel notice's name."""

    def __init__(self, msg: PrefillRequest):
        self.msg = msg
        self.rid, self.ids, self.start, self.epoch, self.sample = (
            msg.request_id, msg.input_ids, msg.start, msg.epoch, msg.sample
        )  # fmt: skip
        self.first_token: int | None = None
        self.error: str | None = None
        self.notice = prefill_notice(self.rid, self.epoch)


class PrefillModel:
    def __init__(self, args: dict):
        gpu = args.get("model_instance_kind") == "GPU"
        device = "cuda" if gpu else "cpu"
        if gpu:
            import torch

            torch.cuda.set_device(int(args.get("model_instance_device_id", 0)))
        cfg = PrefillConfig.from_params(tio.model_params(args))
        self.key = read_key(cfg)
        cfg = self.cfg = resolve_prefill(cfg, load_config(resolve(cfg.model)), gpu, tio.instance_count(args))
        set_cpu_threads(cfg.cpu_threads)
        instance = args.get("model_instance_name", "pd_prefill")
        # a tensor-parallel instance's ranks keep their pools in shared memory, where its hand-off reads them
        shm = f"tpd_{cfg.deployment}_{instance}" if cfg.prefill_tp > 1 else None
        self.engine = Engine(
            cfg.model,
            dtype=cfg.dtype,
            device=device,
            kv_tokens=cfg.prefill_kv_tokens,
            max_batch=cfg.prefill_max_batch,
            chunk_size=cfg.chunk_size,
            max_batch_tokens=cfg.max_prefill_tokens,
            overlap=False,  # each step's first tokens are handed off as soon as they exist
            # no decode graphs: a prefill batch carries prompts or recomputed positions, which run eagerly; capturing
            # would time the projections for every graph size up to prefill_max_batch at start (on an H100 a
            # hybrid model's server took 7 minutes to start with no tuning cache, prefill timing ten graph sizes
            # on the GPU where decode timed its own five)
            cuda_graphs=False,
            state_pages=cfg.state_pages or None,
            deterministic=cfg.deterministic == "on",
            quantization=cfg.quantization,
            tp=cfg.prefill_tp,
            kv_shm_name=shm,
        )
        if self.engine.runner.images is not None:  # the deployment's limits (master checked them first)
            self.engine.runner.images.max_images = cfg.max_images_per_request
            self.engine.runner.images.max_pixels = cfg.max_image_pixels
        # test hooks: "slow_prefill" waits SLOW_PREFILL_SECONDS before each batch (watching for cancellations),
        # SLOW_RECOVERY_SECONDS for a batch with a recovery job with "slow_recovery" too
        self.faults = set(filter(None, cfg.fault_injection.split(",")))
        self.source = KVSource(f"{cfg.deployment}:{instance}:{os.getpid()}", device)
        self.lock = threading.Lock()
        m = self.metrics = Metrics({"model": "pd_prefill", "instance": instance})
        self.m_jobs = {
            k: m.counter("pd_prefill_jobs_total", "Prefill jobs received, by kind", kind=k)
            for k in ("prompt", "recovery")
        }
        self.m_tokens = m.counter("pd_prefill_computed_tokens_total", "Positions computed by prefill")
        self.m_cached = m.counter("pd_prefill_cached_tokens_total", "Positions served by prefill's radix cache")
        self.m_queue = m.gauge("pd_prefill_queue_depth", "Prefill jobs in the current batch")
        self.m_cancelled = m.counter("pd_prefill_cancelled_total", "Prefill jobs ended because decode cancelled them")
        # requests with images: what their first job made of them (the preprocessed images, the tower's rows, the
        # positions), kept under the request's id until decode's release, so a recovery job re-encodes nothing
        self.kept: dict[str, Multimodal] = {}
        self.kept_bytes = 0  # sum of the kept requests' nbytes (final once kept: the tower's rows are in it)
        self.m_mm_held = m.gauge("pd_mm_requests_held", "Requests with images whose preprocessed images and vision "
                                 "tower outputs prefill keeps for their recoveries")  # fmt: skip
        self.m_mm_bytes = m.gauge("pd_mm_bytes_held", "Bytes of the images and tower outputs prefill keeps")
        self.m_mm_reused = m.counter(
            "pd_mm_recoveries_reused_total",
            "Recovery jobs of requests with images computed from what prefill kept (nothing decoded or encoded again)",
        )
        self.m_mm_encoded = m.counter("pd_mm_encodes_total", "Vision tower runs (a request's images, all at once)")

    def execute(self, requests):
        pb = tio.pb()
        jobs: list[PrefillJob | None] = []
        responses = [None] * len(requests)
        for i, request in enumerate(requests):
            try:
                msg = PrefillRequest.decode(tio.request_getter(request), self.key)
                if msg.release:  # the request ended: what prefill keeps for it goes
                    self._release(msg.request_id)
                    jobs.append(None)
                    responses[i] = pb.InferenceResponse(output_tensors=tio.to_tensors(PrefillResponse(0).encode()))
                    continue
                jobs.append(PrefillJob(msg))
            except ParamError as e:
                jobs.append(None)
                code = "UNAVAILABLE" if e.field == KEY_FIELD else "INVALID_ARG"
                responses[i] = pb.InferenceResponse(output_tensors=[], error=tio.error(str(e), code))
        valid = [j for j in jobs if j is not None]
        if valid:
            with self.lock:
                self._run(sorted(valid, key=lambda j: j.sample))  # recovery (sample=False) first
        for i, job in enumerate(jobs):
            if job is None:
                continue
            if job.error:
                code = "CANCELLED" if job.error.startswith("cancelled") else "INTERNAL"
                responses[i] = pb.InferenceResponse(output_tensors=[], error=tio.error(job.error, code))
            else:
                answer = PrefillResponse(job.epoch, job.first_token)
                responses[i] = pb.InferenceResponse(output_tensors=tio.to_tensors(answer.encode()))
        return responses

    def _take_cancelled(self, jobs: list[PrefillJob]) -> list[PrefillJob]:
        """Jobs with a cancel notice from decode, marked failed ("cancelled") and counted."""
        live = {j.notice: j for j in jobs if j.error is None}
        if not live:
            return []
        out = []
        # where each job's kv_handle says: decode's mailbox (ipc: this server's or another's on this host) or the
        # network transport's rendezvous store (dist)
        notices = list(self.source.cancelled({n: j.msg.kv_handle for n, j in live.items()}).items())
        for name, reason in notices:
            job = live.get(name)
            if job is None or job.error is not None:
                continue
            job.error = f"cancelled ({reason})"
            out.append(job)
        if out:
            self.m_cancelled.increment(len(out))
        return out

    def _slow_fault(self, jobs: list[PrefillJob]) -> None:
        recovery = "slow_recovery" in self.faults and any(not j.sample for j in jobs)
        end = time.monotonic() + (SLOW_RECOVERY_SECONDS if recovery else SLOW_PREFILL_SECONDS)
        while time.monotonic() < end and any(j.error is None for j in jobs):
            self._take_cancelled(jobs)
            time.sleep(0.05)

    def _run(self, jobs: list[PrefillJob]) -> None:
        self.m_queue.set(len(jobs))
        for job in jobs:  # counted as they arrive (before the slow_prefill hook's wait)
            (self.m_jobs["recovery" if not job.sample else "prompt"]).increment(1)
            try:
                self.source.prepare(job.msg.kv_handle)
            except Exception as e:
                job.error = f"KV transport: cannot reach decode ({e})"
        self._take_cancelled(jobs)  # cancelled while it waited in Triton's queue
        if "slow_prefill" in self.faults:
            self._slow_fault(jobs)
        by_req = {}
        sched = self.engine.scheduler
        for job in jobs:
            if job.error is not None:
                continue
            # one token (it obeys min_tokens: no EOS if the answer needs more); decode resolved the seed
            params = SamplingParams(
                **{
                    **job.msg.params.to_dict(),
                    "max_tokens": 1,
                    "min_tokens": min(1, job.msg.params.min_tokens),
                    "stop": [],
                }
            )
            try:
                mm = self._multimodal(job) if job.msg.mm_info else None
                req = self.engine.add_request(job.ids, params, mm=mm)
            except ParamError as e:
                job.error = str(e)
                continue
            by_req[id(req)] = (req, job)
        cached_before = sched.num_cached_tokens
        try:
            while sched.has_work():
                if self._take_cancelled([j for _, j in by_req.values()]):
                    for req, job in by_req.values():
                        if job.error is not None:
                            self.engine.abort(req)  # a no-op for one already finished
                for req in self.engine.step():
                    self._hand_off(*by_req[id(req)])
        except Exception as e:  # fail every unfinished job; free whatever they held
            for req, job in by_req.values():
                if not req.finished:
                    job.error = f"prefill failed: {e}"
                    if req in sched.running:
                        sched.finish(req, "error")
            sched.waiting.clear()
        self.m_cached.increment(sched.num_cached_tokens - cached_before)
        self.m_queue.set(0)

    def _hand_off(self, req, job: PrefillJob) -> None:
        """Copy positions [start, end) from this instance's cache into decode's slots; for a hybrid model also the
        state after all of input_ids (the checkpoint the finished job left at its end) into decode's page."""
        try:
            # the job's own positions: the cache may hold more after them (the same prompt's tokens that an earlier
            # recovery computed), and req's sampled token may be the next of those
            slots, node = self.engine.scheduler.radix.match_prefix(req.cache_ids[: len(job.ids)], kv_only=True)
            if len(slots) != len(job.ids):
                raise RuntimeError(f"prefill cache lost positions ({len(slots)} of {len(job.ids)})")
            msg = job.msg
            state_row = self._state_row(node, job) if msg.state_handle else None
            self.source.send(
                job.rid, job.epoch, msg.kv_handle, self._kv_source(), slots[job.start :], msg.dst_slots,
                msg.state_handle, state_row, msg.dst_state_page,
            )  # fmt: skip
            self.m_tokens.increment(len(job.ids) - job.start)
            job.first_token = req.output_ids[0] if job.sample else None
        except Exception as e:
            job.error = f"KV hand-off failed: {e}"

    def _multimodal(self, job: PrefillJob) -> Multimodal:
        """The request's images as prefill keeps them: from its first job, the images decoded and preprocessed and
        (in add_request) encoded, once; a later job (a recovery) takes them as they are."""
        kept = self.kept.get(job.rid)
        if kept is not None:
            if not job.sample:
                self.m_mm_reused.increment(1)
            return kept
        runner = self.engine.runner
        if runner.vision is None:
            raise ParamError("image", f"the model {self.cfg.model} takes no images: {runner.vision_missing}")
        info = MMInfo.from_json(job.msg.mm_info)
        mm = Multimodal.from_expanded(job.ids, info, runner.vision.vc, runner.images(job.msg.images))
        self.engine.encode_images(mm)
        self.m_mm_encoded.increment(1)
        self.kept[job.rid] = mm
        self.kept_bytes += mm.nbytes
        self._count_kept()
        return mm

    def _release(self, rid: str) -> None:
        mm = self.kept.pop(rid, None)
        if mm is not None:
            self.kept_bytes -= mm.nbytes
            self._count_kept()

    def _count_kept(self) -> None:
        self.m_mm_held.set(len(self.kept))
        self.m_mm_bytes.set(self.kept_bytes)

    def _state_row(self, node, job: PrefillJob):
        """The state after all of input_ids: the checkpoint the finished job left at its end."""
        engine = self.engine
        if engine.state_pages is None:
            raise RuntimeError("decode sent a state_handle, but this prefill's model has no linear-attention state")
        page = node.state if node is not engine.scheduler.radix.root else -1
        if page < 0:
            raise RuntimeError(f"prefill cache lost the state at position {len(job.ids)}")
        engine.runner.apply_state_ops(engine.state_pages.take_ops())  # the checkpoint may be a queued copy
        return engine.runner.state.buffer[page]

    def _kv_source(self):
        """This instance's pool, or a tensor-parallel instance's (buffer, lo, hi) per rank."""
        runner = self.engine.runner
        if runner.tp is None:
            return runner.kv.buffer
        return [(store.buffer, lo, hi) for store, lo, hi in runner.kv_shards()]

    def finalize(self):
        self.source.close()
        self.metrics.close()
        self.engine.close()  # a tensor-parallel instance's workers and their pools
        if self.engine.runner.tp is not None:
            self.engine.runner.kv.close(unlink=True)
