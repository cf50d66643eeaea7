"""Decode's speculative steps on a real hybrid model (random:tiny-hybrid, CPU), with drafts that are right or wrong
by construction (the true next token, or not, taken from plain decoding): kept drafts carry K/V and state past
the draft, rejected ones roll both back, and the tokens are plain decoding's, greedy and seeded."""

from __future__ import annotations

import pytest

from backends.common.batch import Span
from backends.common.engine import Engine
from backends.common.kv_pool import KVPool
from backends.common.postprocess import sample_requests
from backends.common.request import InferReq, ReqState, SamplingParams
from backends.common.runner import ModelRunner
from backends.common.state_pages import StatePages
from backends.pd_decode.scheduler import DecodeScheduler
from backends.pd_decode.steps import DecodeSteps

N_OUT = 40
PARAMS = [
    SamplingParams(max_tokens=N_OUT, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=N_OUT, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True),
]


def prompts():
    return [[(13 * i + 7 * j) % 250 + 3 for j in range(20 + 9 * i)] for i in range(3)]


@pytest.mark.parametrize("right", ["all", "even", "none"])
@pytest.mark.parametrize("p", range(len(PARAMS)))
def test_kept_and_rejected_drafts_give_plain_decodings_tokens(right, p):
    params = PARAMS[p]
    want = [o.output_ids for o in Engine("random:tiny-hybrid", device="cpu").generate(prompts(), params)]
    runner = ModelRunner("random:tiny-hybrid", device="cpu", kv_tokens=2048, max_batch=8)
    sched = DecodeScheduler(KVPool(2048), state=StatePages(runner.num_state_pages), speculative=True)
    steps = DecodeSteps(runner, sched, runner.cfg.eos_token_ids, lambda r, t, n: None, speculative="ngram")
    reqs = [InferReq(f"r{i}", ids, SamplingParams(**params.to_dict())) for i, ids in enumerate(prompts())]
    for r in reqs:
        sched.add(r)
    expected = {r.rid: w for r, w in zip(reqs, want)}
    kept = 0
    for _ in range(200):
        for r in reqs:  # the draft for the token the next step samples first: output number len(output_ids)
            if r.state is ReqState.RUNNING and len(r.output_ids) < N_OUT:
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
            if r.state is ReqState.RUNNING and len(r.output_ids) >= N_OUT:
                del r.output_ids[N_OUT:]
                sched.finish(r, "length")
        assert sched.check_invariants(liveness=False) == []
        if all(r.state is ReqState.FINISHED for r in reqs):
            break
    assert [r.output_ids for r in reqs] == want
    assert (kept > 0) == (right != "none") and steps.num_drafts > 0
    free, live, ckpts = sched.state_accounting()
    assert live == 0 and free + ckpts == runner.num_state_pages
