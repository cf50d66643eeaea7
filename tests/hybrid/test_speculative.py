"""Decode's speculative steps on a real hybrid model (random:tiny-hybrid, CPU), with drafts that are right or wrong
by construction (the true next token, or not, taken from plain decoding): kept drafts carry K/V and state past
the draft, rejected ones roll both back, and the tokens are plain decoding's, greedy and seeded."""

from __future__ import annotations

import pytest
import torch

from backends.common.core.kv_pool import KVPool
from backends.common.core.request import InferReq, ReqState, SamplingParams
from backends.common.core.state_pages import StatePages
from backends.common.engine.engine import Engine
from backends.common.engine.postprocess import sample_requests
from backends.common.engine.runner import ModelRunner
from backends.common.model.batch import Span
from backends.pd_decode.scheduler import DecodeScheduler
from backends.pd_decode.steps import DecodeSteps

N_OUT = 40
PARAMS = [
    SamplingParams(max_tokens=N_OUT, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=N_OUT, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True),
]


def prompts(n=3):
    return [[(13 * i + 7 * j) % 250 + 3 for j in range(20 + 9 * i)] for i in range(n)]


# the PyTorch path with prompt-lookup drafts; the graph path (CUDA graphs, or on the CPU Triton's interpreter
# replaying the same bodies) with the MTP head's verification and drafting graphs
PATHS = {"eager": ("random:tiny-hybrid", "torch", "ngram"), "graphs": ("random:tiny-hybrid-dense", "triton", "mtp")}


# Triton's interpreter takes minutes for the graph path's 40 tokens: on the CPU it runs the case with kept and
# rejected drafts, greedy and seeded, over fewer tokens and two prompts; on a GPU every case, three prompts, all 40
CASES = [(r, p, "eager") for r in ("all", "even", "none") for p in range(len(PARAMS))] + [
    pytest.param(r, p, "graphs", marks=pytest.mark.slow)
    for r in (("all", "even", "none") if torch.cuda.is_available() else ("even",))
    for p in range(len(PARAMS))
]  # fmt: skip
N_OUT_INTERPRETED = 6


@pytest.mark.parametrize(("right", "p", "path"), CASES)
def test_kept_and_rejected_drafts_give_plain_decodings_tokens(right, p, path, monkeypatch):
    model, backend, mode = PATHS[path]
    interpreted = path != "eager" and not torch.cuda.is_available()
    n_out = N_OUT_INTERPRETED if interpreted else N_OUT
    n_prompts = 2 if interpreted else 3  # two rows keep a kept and a rejected draft in one verify step
    params = SamplingParams(**{**PARAMS[p].to_dict(), "max_tokens": n_out})
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    # plain decoding on the same device (random weights are drawn on it); on a GPU its decode graphs, with cuBLAS
    # for every projection in both runs (the timed choice may pick another kernel per row count)
    monkeypatch.setenv("TRITON_PD_LINEAR_TUNE", "0")
    ref = Engine(model, device=device, backend=backend if device == "cuda" else "torch")
    want = [o.output_ids for o in ref.generate(prompts(n_prompts), params)]
    del ref
    runner = ModelRunner(model, device=device, kv_tokens=2048, max_batch=4, backend=backend)
    runner.prepare_speculative(mode)
    sched = DecodeScheduler(KVPool(2048), state=StatePages(runner.num_state_pages), speculative=True)
    steps = DecodeSteps(runner, sched, runner.cfg.eos_token_ids, lambda r, t, n: None, speculative=mode)
    reqs = [InferReq(f"r{i}", ids, SamplingParams(**params.to_dict())) for i, ids in enumerate(prompts(n_prompts))]
    for r in reqs:
        sched.add(r)
    expected = {r.rid: w for r, w in zip(reqs, want)}
    kept = 0
    for _ in range(200):
        for r in reqs:  # the draft for the token the next step samples first: output number len(output_ids)
            if r.state is ReqState.RUNNING and len(r.output_ids) < n_out:
                k = len(r.output_ids)
                good = right == "all" or (right == "even" and k % 2 == 0)
                r.draft = expected[r.rid][k] if good else (expected[r.rid][k] + 1) % runner.cfg.vocab_size
        plan = sched.schedule()
        runner.apply_state_ops(sched.state.take_ops())
        for job in plan.transfers:  # stand-in for prefill: these prompts share nothing, so every job starts at 0
            req = sched.reqs[job.rid]
            assert job.start == 0
            runner.apply_state_ops([(job.state_page, -1)])
            logits = runner.forward([Span(job.ids, 0, job.dst_slots, job.rid, job.state_page)])
            sched.on_transfer_done(job.rid, job.epoch, True, first_token=sample_requests(logits, [req], [])[0])
        if plan.decode:
            before = steps.num_accepted
            steps.step(plan.decode)
            kept += steps.num_accepted - before
        for r in reqs:
            if r.state is ReqState.RUNNING and len(r.output_ids) >= n_out:
                del r.output_ids[n_out:]
                sched.finish(r, "length")
        assert sched.check_invariants(liveness=False) == []
        if all(r.state is ReqState.FINISHED for r in reqs):
            break
    assert [r.output_ids for r in reqs] == want
    assert (kept > 0) == (right != "none") and steps.num_drafts > 0
    if path == "graphs":  # every step after the first verified in a graph; the MTP head drafted in one
        stats = runner.model.stats
        assert stats["verify_steps"] > 0 and stats["mtp_steps"] > 0 and stats["eager_steps"] <= 3
    free, live, ckpts = sched.state_accounting()
    assert live == 0 and free + ckpts == runner.num_state_pages
