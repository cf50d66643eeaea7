"""From logits to tokens and finish reasons, shared by the offline engine, prefill and decode: which tokens are
banned (min_tokens), how a batch is sampled or takes the decode graph's argmax, and when a request ends (vLLM's
rules)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.common.core.request import InferReq
from backends.common.engine.runner import ModelRunner
from backends.common.engine.sampler import sample
from backends.common.model.batch import Span

PENDING = -1  # an output token sampled on the device and not read back yet (a step launched over an unread one)


@dataclass(slots=True)
class LaunchedStep:
    """A greedy graph step launched without waiting for its tokens (`ModelRunner.launch_greedy`), which are still on
    the device: (request, index of its PENDING placeholder in output_ids) per row."""

    handle: object
    rows: list[tuple[InferReq, int]]


def banned_ids(req: InferReq, eos_ids: list[int], num_out: int | None = None) -> list[int]:
    """Tokens that may not be drawn yet: EOS and stop ids until min_tokens outputs exist (num_out: as if the request
    had that many outputs, default its own count)."""
    p = req.params
    if (len(req.output_ids) if num_out is None else num_out) >= p.min_tokens:
        return []
    return list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_ids))


def finish_reason(
    req: InferReq, token: int, eos_ids: list[int], max_context: int, num_out: int | None = None
) -> str | None:
    """vLLM semantics: with ignore_eos, EOS is an ordinary token; stop ids stop; max_tokens and context cap.
    `token` is output number `num_out` (default: the last of output_ids)."""
    p = req.params
    n = len(req.output_ids) if num_out is None else num_out
    if n >= p.min_tokens:
        if token in p.stop_token_ids or (not p.ignore_eos and token in eos_ids):
            return "stop"
    if n >= p.max_tokens or len(req.prompt_ids) + n >= max_context:
        return "length"
    return None


def sample_requests(
    logits: torch.Tensor, reqs: list[InferReq], eos_ids: list[int], ahead: list[int] | None = None
) -> list[int]:
    """Row i's token for reqs[i]'s next output, or (ahead[i] = 1) for the output after it (speculation)."""
    outs = [len(r.output_ids) + (ahead[i] if ahead else 0) for i, r in enumerate(reqs)]
    return sample(
        logits,
        [r.params.temperature for r in reqs],
        [r.params.top_p for r in reqs],
        [r.params.top_k for r in reqs],
        [r.seed for r in reqs],
        outs,
        [banned_ids(r, eos_ids, n) for r, n in zip(reqs, outs)],
    ).tolist()


def greedy_unbanned(reqs: list[InferReq], eos_ids: list[int]) -> bool:
    """Every request greedy with no token banned: the batch's tokens are the argmax, which a decode graph computes."""
    return all(r.params.temperature == 0 for r in reqs) and not any(banned_ids(r, eos_ids) for r in reqs)


def next_tokens(runner: ModelRunner, spans: list[Span], reqs: list[InferReq], eos_ids: list[int]) -> list[int]:
    """The next token after each span (each span ends its request's tokens). A greedy batch with nothing banned
    takes the decode graph's own argmax (`ModelRunner.greedy`); anything else samples from the logits."""
    if greedy_unbanned(reqs, eos_ids):
        tokens = runner.greedy(spans)
        if tokens is not None:
            return tokens
    return sample_requests(runner.forward(spans), reqs, eos_ids)
