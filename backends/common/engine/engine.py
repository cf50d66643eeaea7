"""Offline engine: schedule, run, post-process. Used by `triton-pd generate --offline`, by the prefill role
and by the benchmarks."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from backends.common.core.kv_pool import KVPool
from backends.common.core.request import InferReq, ParamError, ReqState, SamplingParams
from backends.common.core.scheduler import Scheduler
from backends.common.core.state_pages import StatePages
from backends.common.engine.postprocess import (
    PENDING,
    LaunchedStep,
    finish_reason,
    greedy_unbanned,
    next_tokens,
    sample_requests,
)
from backends.common.engine.runner import ModelRunner
from backends.common.model.batch import Span


@dataclass(slots=True)
class Output:
    output_ids: list[int]
    text: str
    finish_reason: str
    num_prompt_tokens: int


class EngineError(RuntimeError):
    pass


class Engine:
    """Continuous batching over one ModelRunner. With `overlap` (the default), a greedy decode step on the GPU's
    graphs is launched before the previous one's tokens are read: the host schedules and prepares step n+1 while
    the GPU runs step n, and the tokens of step n, known only on the device, feed step n+1 there. Each step's
    output is then a placeholder (PENDING) until the next call to `step` reads it; a request that stopped at step
    n (EOS, a stop id) has computed one row in step n+1 for nothing, which is dropped. Any step that is not such a
    batch (prefill chunks, sampling, a request that would need KV it cannot get) first reads the pending tokens."""

    def __init__(
        self,
        model: str = "smollm2",
        dtype: str = "float32",
        device: str | None = None,
        kv_tokens: int = 16384,
        max_batch: int = 64,
        chunk_size: int = 512,
        max_batch_tokens: int = 2048,
        backend: str = "auto",
        cuda_graphs: bool = True,
        overlap: bool = True,
        state_pages: int | None = None,
        deterministic: bool = False,
        quantization: str = "",
        tp: int = 1,
        kv_shm_name: str | None = None,
    ):
        """The engine of the offline path and of prefill: a multimodal checkpoint's vision tower is loaded too
        (`add_request`'s images). quantization: ModelRunner's ("fp8": a 16-bit checkpoint converted at load).
        tp: ModelRunner's (tensor parallelism over that many processes, the PyTorch path; `close()` stops them);
        kv_shm_name: its KV pool in shared memory (a tensor-parallel prefill's ranks' pools, read by its hand-off)."""
        self.overlap = overlap
        self._pending: LaunchedStep | None = None
        self.runner = ModelRunner(
            model, dtype, device, kv_tokens, backend=backend, max_batch=max_batch, cuda_graphs=cuda_graphs,
            state_pages=state_pages, deterministic=deterministic, vision=True, quantization=quantization, tp=tp,
            kv_shm_name=kv_shm_name,
        )  # fmt: skip
        self.cfg, self.tokenizer = self.runner.cfg, self.runner.tokenizer
        self.max_context = self.cfg.max_position_embeddings
        self.state_pages = StatePages(self.runner.num_state_pages) if self.runner.state is not None else None
        self.scheduler = Scheduler(KVPool(kv_tokens), max_batch, chunk_size, max_batch_tokens, self.state_pages)
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_overlapped = 0  # steps launched while the step before was still unread

    def check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ParamError("prompt", "is empty")
        if len(prompt_ids) >= self.max_context:
            raise ParamError("prompt", f"has {len(prompt_ids)} tokens; the model's context is {self.max_context}")
        bad = [t for t in prompt_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ParamError("input_ids", f"token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")

    def add_request(self, prompt_ids: list[int], params: SamplingParams, images: list | None = None,
                    mm=None) -> InferReq:  # fmt: skip
        """images: PNG or JPEG bytes (or base64 text, or PIL images), one per `<|image_pad|>` placeholder in the
        prompt, in order; preprocessed, expanded and encoded here, once (`prepare_images`). mm: instead, the
        multimodal part of an already expanded prompt (prefill keeps it per request), encoded here if it is not."""
        params.validate()
        if images:
            prompt_ids, mm = self.prepare_images(prompt_ids, images)
        elif mm is not None:
            self.encode_images(mm)
        self.check_prompt(prompt_ids, params)
        n = next(self._ids)
        req = InferReq(f"offline-{n}", prompt_ids, params, arrival=n)
        req.mm = mm
        self.scheduler.add(req)
        return req

    def prepare_images(self, prompt_ids: list[int], images: list, field_name: str = "image"):
        """(expanded prompt ids, Multimodal with the vision tower's rows) for a prompt and its images; a model
        without a vision tower, or images that do not fit the prompt or the limits, is a ParamError naming
        `field_name`."""
        from backends.common.model import multimodal

        if self.runner.vision is None:
            raise ParamError(
                field_name, f"the model {self.runner.source.spec} takes no images: {self.runner.vision_missing}"
            )
        imgs = self.runner.images(images, field_name)
        ids, mm = multimodal.build(list(prompt_ids), imgs, self.runner.vision.vc, field_name)
        self.encode_images(mm)
        return ids, mm

    def encode_images(self, mm) -> None:
        """The vision tower's rows of a request's images, all of them in one pass (skipped when kept)."""
        if mm.embeds is not None:
            return
        pixels = torch.cat([im.pixel_values for im in mm.images])
        grid = torch.tensor([im.grid_thw for im in mm.images], dtype=torch.int64)
        mm.embeds = self.runner.vision.encode(pixels, grid)
        mm.encodes += 1

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._pending is not None

    def step(self) -> list[InferReq]:
        """One scheduler iteration; returns the requests that finished in it (with overlap: whose last token was
        read in it)."""
        done = [] if self._pending is None or self._next_is_decode_batch() else self._resolve()
        plan = self.scheduler.schedule()
        if not plan:
            if self._pending is not None:
                return done + self._resolve()
            if self.scheduler.has_work():
                raise EngineError("KV pool too small: no request can make progress (raise --kv-tokens)")
            return done
        spans = [
            Span(
                s.req.token_slice(s.start, s.start + s.num_new),
                s.start,
                s.req.slots,
                s.req.rid,
                s.req.state_page,
                mm=s.req.mm,
            )
            for s in plan
        ]
        if self.state_pages is not None:
            self.runner.apply_state_ops(self.state_pages.take_ops())
        rows = [i for i, s in enumerate(plan) if s.samples]
        reqs = [plan[i].req for i in rows]
        eos = self.cfg.eos_token_ids
        handle = None
        if self.overlap and len(rows) == len(plan) and greedy_unbanned(reqs, eos):
            handle = self.runner.launch_greedy(spans)
        if handle is not None:
            self.num_steps += 1
            self.num_overlapped += self._pending is not None
            launched = LaunchedStep(handle, [(r, len(r.output_ids)) for r in reqs])
            for r in reqs:
                r.output_ids.append(PENDING)
            if self._pending is not None:  # read step n while step n+1 runs
                done += self._resolve()
            self._pending = launched
            return done
        if self._pending is not None:
            raise EngineError("internal: a step that is not a greedy graph batch was planned over unread tokens")
        if len(rows) == len(plan):
            tokens = next_tokens(self.runner, spans, reqs, eos)
        else:  # some spans are prefill chunks that do not reach their request's end
            logits = self.runner.forward(spans)
            tokens = sample_requests(logits[torch.tensor(rows, device=logits.device)], reqs, eos) if rows else []
        self.num_steps += 1
        self.scheduler.after_forward(plan)
        return done + self._postprocess(reqs, tokens)

    def _next_is_decode_batch(self) -> bool:
        """Whether the next plan is certain to be one decode token for every running request, with no admission,
        no preemption and no sampling: the only plan that may be launched over unread tokens."""
        sch = self.scheduler
        running = sch.running
        if sch.waiting and len(running) < sch.max_batch:
            return False
        if sch.pool.num_free < len(running) or not self.runner.graph_batch(len(running)):
            return False
        return all(
            r.num_tokens - len(r.slots) == 1 and r.num_tokens < self.max_context for r in running
        ) and greedy_unbanned(running, self.cfg.eos_token_ids)

    def _resolve(self) -> list[InferReq]:
        """Read the pending step's tokens into its requests' placeholders; finish those that stopped."""
        pending, self._pending = self._pending, None
        tokens = self.runner.collect(pending.handle)
        eos = self.cfg.eos_token_ids
        done = []
        for (req, i), token in zip(pending.rows, tokens):
            if req.state is ReqState.FINISHED:  # stopped at the step before: this row was computed for nothing
                continue
            req.output_ids[i] = token
            reason = finish_reason(req, token, eos, self.max_context, num_out=i + 1)
            if reason:
                # drop the placeholder of a step launched after this one; the KV of `token` that step writes
                # stays valid, so the request's slots go to the cache with its tokens as usual
                del req.output_ids[i + 1 :]
                self._finish(req, reason)
                done.append(req)
        return done

    def _postprocess(self, reqs: list[InferReq], tokens: list[int]) -> list[InferReq]:
        eos = self.cfg.eos_token_ids
        done = []
        for req, token in zip(reqs, tokens):
            req.output_ids.append(token)
            reason = finish_reason(req, token, eos, self.max_context)
            if reason:
                self._finish(req, reason)
                done.append(req)
        return done

    def _finish(self, req: InferReq, reason: str) -> None:
        self.scheduler.finish(req, reason)
        self.runner.forget(req.rid)

    def abort(self, req: InferReq, reason: str = "cancelled") -> None:
        """End a request between steps, wherever it is (waiting or running); what it computed stays cached."""
        if req.state is ReqState.FINISHED:
            return
        if req in self.scheduler.waiting:
            self.scheduler.waiting.remove(req)
            req.state, req.finish_reason = ReqState.FINISHED, reason
            return
        self._finish(req, reason)

    def close(self) -> None:
        """Stop a tensor-parallel engine's worker ranks (nothing otherwise)."""
        self.runner.close()

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], images: list | None = None
    ) -> list[Output]:
        """images: None, or per prompt a list of its images (`add_request`)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ilist = images if images is not None else [None] * len(prompts)
        reqs = [self.add_request(p, sp, im) for p, sp, im in zip(prompts, plist, ilist)]
        while self.has_work():
            self.step()
        return [
            Output(r.output_ids, self.tokenizer.decode(r.output_ids), r.finish_reason, len(r.prompt_ids)) for r in reqs
        ]
