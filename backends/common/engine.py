"""Offline engine: schedule, run, post-process. Used by `triton-pd generate --offline`, by the prefill role
and by the benchmarks."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from .kv_pool import KVPool
from .request import InferReq, ParamError, SamplingParams
from .runner import ModelRunner, Span
from .sampler import sample
from .scheduler import Scheduler


@dataclass(slots=True)
class Output:
    output_ids: list[int]
    text: str
    finish_reason: str
    num_prompt_tokens: int


class EngineError(RuntimeError):
    pass


def banned_ids(req: InferReq, eos_ids: list[int]) -> list[int]:
    """Tokens that may not be drawn yet: EOS and stop ids until min_tokens outputs exist."""
    p = req.params
    if len(req.output_ids) >= p.min_tokens:
        return []
    return list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_ids))


def finish_reason(req: InferReq, token: int, eos_ids: list[int], max_context: int) -> str | None:
    """vLLM semantics: with ignore_eos, EOS is an ordinary token; stop ids stop; max_tokens and context cap."""
    p = req.params
    if len(req.output_ids) >= p.min_tokens:
        if token in p.stop_token_ids or (not p.ignore_eos and token in eos_ids):
            return "stop"
    if len(req.output_ids) >= p.max_tokens or req.num_tokens >= max_context:
        return "length"
    return None


def sample_requests(logits: torch.Tensor, reqs: list[InferReq], eos_ids: list[int]) -> list[int]:
    return sample(
        logits,
        [r.params.temperature for r in reqs],
        [r.params.top_p for r in reqs],
        [r.params.top_k for r in reqs],
        [r.seed for r in reqs],
        [len(r.output_ids) for r in reqs],
        [banned_ids(r, eos_ids) for r in reqs],
    ).tolist()


def next_tokens(runner: ModelRunner, spans: list[Span], reqs: list[InferReq], eos_ids: list[int]) -> list[int]:
    """The next token after each span (each span ends its request's tokens). A greedy batch with nothing banned
    takes the decode graph's own argmax (`ModelRunner.greedy`); anything else samples from the logits."""
    if all(r.params.temperature == 0 for r in reqs) and not any(banned_ids(r, eos_ids) for r in reqs):
        tokens = runner.greedy(spans)
        if tokens is not None:
            return tokens
    return sample_requests(runner.forward(spans), reqs, eos_ids)


class Engine:
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
    ):
        self.runner = ModelRunner(
            model, dtype, device, kv_tokens, backend=backend, max_batch=max_batch, cuda_graphs=cuda_graphs
        )
        self.cfg, self.tokenizer = self.runner.cfg, self.runner.tokenizer
        self.max_context = self.cfg.max_position_embeddings
        self.scheduler = Scheduler(KVPool(kv_tokens), max_batch, chunk_size, max_batch_tokens)
        self._ids = itertools.count()
        self.num_steps = 0

    def check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ParamError("prompt", "is empty")
        if len(prompt_ids) >= self.max_context:
            raise ParamError("prompt", f"has {len(prompt_ids)} tokens; the model's context is {self.max_context}")
        bad = [t for t in prompt_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ParamError("input_ids", f"token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> InferReq:
        params.validate()
        self.check_prompt(prompt_ids, params)
        n = next(self._ids)
        req = InferReq(f"offline-{n}", prompt_ids, params, arrival=n)
        self.scheduler.add(req)
        return req

    def step(self) -> list[InferReq]:
        """One scheduler iteration; returns the requests that finished in it."""
        plan = self.scheduler.schedule()
        if not plan:
            if self.scheduler.has_work():
                raise EngineError("KV pool too small: no request can make progress (raise --kv-tokens)")
            return []
        spans = [Span(s.req.token_slice(s.start, s.start + s.num_new), s.start, s.req.slots, s.req.rid) for s in plan]
        rows = [i for i, s in enumerate(plan) if s.samples]
        reqs = [plan[i].req for i in rows]
        eos = self.cfg.eos_token_ids
        if len(rows) == len(plan):
            tokens = next_tokens(self.runner, spans, reqs, eos)
        else:  # some spans are prefill chunks that do not reach their request's end
            logits = self.runner.forward(spans)
            tokens = sample_requests(logits[torch.tensor(rows, device=logits.device)], reqs, eos) if rows else []
        self.num_steps += 1
        self.scheduler.after_forward(plan)
        return self._postprocess(reqs, tokens)

    def _postprocess(self, reqs: list[InferReq], tokens: list[int]) -> list[InferReq]:
        eos = self.cfg.eos_token_ids
        done = []
        for req, token in zip(reqs, tokens):
            req.output_ids.append(token)
            reason = finish_reason(req, token, eos, self.max_context)
            if reason:
                self.scheduler.finish(req, reason)
                self.runner.forget(req.rid)
                done.append(req)
        return done

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Output]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.scheduler.has_work():
            self.step()
        return [
            Output(r.output_ids, self.tokenizer.decode(r.output_ids), r.finish_reason, len(r.prompt_ids)) for r in reqs
        ]
