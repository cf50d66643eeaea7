"""Decode's overlapped steps on the real CPU model: a loop shaped like decode's (transfers answered one iteration
after they start, cancels, arrivals mid-run, pauses with local and prefill recovery) gives the same tokens and
finish reasons whether step n+1 is launched before step n is read or not, leaves no placeholder and no leaked KV, and
never schedules over an unread step when the plan could look at token histories."""

from __future__ import annotations

import random
import types

import pytest
import torch

from backends.common.core.kv_pool import KVPool
from backends.common.core.request import InferReq, ReqState, SamplingParams
from backends.common.engine.postprocess import finish_reason
from backends.common.model.batch import Span
from backends.pd_decode.scheduler import DecodeScheduler
from backends.pd_decode.steps import PENDING, DecodeSteps, drop_after
from tests.common.test_engine import DeferredLaunch


class Loop:
    """decode's scheduler loop without Triton: prefill is the same runner, answering one iteration later."""

    def __init__(self, runner, pool: int, overlap: bool, max_batch: int = 4, tick: float = 0.0, delay: int = 1,
                 **sched_kw):  # fmt: skip
        """tick: the scheduler's clock advances this much per iteration (rotation's quantum and turns); delay:
        iterations a transfer is in flight (its rows land when it answers, as a real prefill's may land any time)."""
        self.runner = DeferredLaunch(runner) if overlap else runner
        self.eos = runner.cfg.eos_token_ids
        self.now, self.tick = 0.0, tick
        self.sched = DecodeScheduler(KVPool(pool), max_running=max_batch, max_len=runner.cfg.max_position_embeddings,
                                     clock=lambda: self.now, **sched_kw)  # fmt: skip
        self.steps = DecodeSteps(self.runner, self.sched, self.eos, self.on_token, overlap=overlap)
        self.transfers = []  # (job, iteration it answers at)
        self.delay, self.i = delay, 0
        self.done: dict[str, tuple[list[int], str]] = {}
        self.kept = 0  # schedules run over an unread step
        self.kept_beside_paused = 0  # of those, while requests were paused (the scheduler quiet)
        self.kept_in_flight = 0  # of those, while a transfer was in flight

    def on_token(self, req: InferReq, token: int, num_out: int) -> None:
        assert token != PENDING and req.output_ids[num_out - 1] == token
        reason = finish_reason(req, token, self.eos, self.sched.max_len, num_out=num_out)
        if reason:
            drop_after(req, num_out)
            self.sched.finish(req, reason)
            self.done[req.rid] = (list(req.output_ids), reason)

    def _prefill(self, job) -> int | None:
        """What prefill does for a job: K/V of positions [start, len(ids)) into the request's slots."""
        req = self.sched.reqs.get(job.rid)
        if req is None or req.epoch != job.epoch:
            return None  # cancelled meanwhile (the answer frees its slots)
        assert PENDING not in job.ids
        logits = self.runner.runner.forward if isinstance(self.runner, DeferredLaunch) else self.runner.forward
        out = logits([Span(job.ids[job.start :], job.start, req.slots, None)])
        return int(out[0].argmax())

    def cancel(self, rid: str) -> None:
        self.steps.flush()
        req = self.sched.cancel(rid)
        if req is not None:
            self.done[rid] = (list(req.output_ids), "cancelled")

    def iteration(self) -> None:
        self.i += 1
        answering = [job for job, at in self.transfers if at <= self.i]
        self.transfers = [(job, at) for job, at in self.transfers if at > self.i]
        for job in answering:
            token = self._prefill(job)
            c = self.sched.on_transfer_done(job.rid, job.epoch, True, token if job.sample else None)
            if c.first_token is not None:
                self.on_token(c.req, c.first_token, len(c.req.output_ids))
        self.now += self.tick
        if self.steps.pending:
            if self.steps.may_keep():
                self.kept += 1
                self.kept_beside_paused += any(r.state is ReqState.PAUSED for r in self.sched.reqs.values())
                self.kept_in_flight += bool(self.sched.inflight)
            else:
                self.steps.flush()
        plan = self.sched.schedule(decode_only=self.steps.pending)
        if self.steps.pending:  # scheduled over an unread step: it may only have been one more decode token
            assert not (plan.paused or plan.transfers or plan.swap_outs or plan.ended or plan.resumed_local)
        for req in plan.ended:
            self.done[req.rid] = (list(req.output_ids), req.finish_reason)
        self.transfers += [(job, self.i + self.delay) for job in plan.transfers]
        if plan.decode:
            self.steps.step(plan.decode)
        else:
            self.steps.flush()
        assert self.sched.check_invariants(liveness=False) == []

    def run(self, arrivals: dict[int, list[InferReq]], cancels: dict[int, str], limit: int = 2000) -> None:
        for i in range(limit):
            for req in arrivals.get(i, []):
                self.sched.add(req)
            if i in cancels:
                self.cancel(cancels[i])
            if i > max(arrivals) and not self.sched.reqs and not self.steps.pending and not self.transfers:
                return
            self.iteration()
        raise AssertionError("the loop did not finish")


@pytest.fixture
def runner(engine):
    """The session engine's runner. The loops here write its KV buffer directly, under the engine's radix cache,
    so that cache is emptied before and after (else it would serve other tests' prefixes from overwritten slots)."""
    engine.scheduler.radix.clear()
    yield engine.runner
    engine.scheduler.radix.clear()


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0, **kw)


@pytest.mark.slow  # `make test` only: too long for `make test-fast`
@pytest.mark.parametrize("pool", [4096, 40], ids=["roomy", "pausing"])
def test_overlapped_decode_equals_synchronous(engine, runner, pool):
    tok = engine.tokenizer
    prompts = [tok.encode(t) for t in ("The capital of France is", "1, 2, 3, 4,", "Once upon a time", "Hello")]
    prompts.append(prompts[0] + tok.encode(" Paris. The capital of Italy"))  # shares a prefix with the first
    probe = engine.generate([prompts[1]], greedy(20))[0].output_ids
    engine.scheduler.radix.clear()

    def requests():
        return {
            0: [
                InferReq("a", prompts[0], greedy(18)),
                InferReq("b", prompts[1], greedy(20, stop_token_ids=[probe[7]])),  # stops mid-batch
                InferReq("c", prompts[2], greedy(24, min_tokens=5)),  # banned EOS: its first steps run synchronously
            ],
            9: [InferReq("d", prompts[3], greedy(30))],  # arrives while steps are in flight
            14: [InferReq("e", prompts[4], greedy(16))],
        }

    results, loops = [], []
    for overlap in (False, True):
        loop = Loop(runner, pool, overlap)
        loop.run(requests(), cancels={16: "d"})
        assert not loop.sched.reqs and not loop.steps.pending
        free, used, cached = loop.sched.accounting()
        assert used == 0 and free + cached == pool
        assert all(PENDING not in ids for ids, _ in loop.done.values())
        results.append(loop.done)
        loops.append(loop)
    # the cancelled answer is cut where the cancel found it: an overlapped loop may have read one step more
    (sync_d, _), (over_d, _) = results[0].pop("d"), results[1]["d"]
    assert over_d[: len(sync_d)] == sync_d and len(over_d) - len(sync_d) in (0, 1)
    assert results[0] == {k: v for k, v in results[1].items() if k != "d"}
    assert results[1]["b"][1] == "stop" and results[1]["b"][0][-1] == probe[7]
    assert results[1]["d"][1] == "cancelled" and 0 < len(results[1]["d"][0]) < 30
    sync, over = loops
    assert sync.steps.num_overlapped == 0 and sync.kept == 0
    least = 10 if pool == 4096 else 0  # a tight pool mostly runs synchronously: the next plan may pause
    assert over.steps.num_overlapped > least and over.kept > least
    assert over.runner.launched >= over.steps.num_overlapped
    # the tight pool pauses (those iterations read the step first, and recovery resumes the same tokens); the two
    # loops need not pause equally often, as an overlapped step's tokens are read an iteration later, and every
    # pause but the cancelled request's is recovered
    for loop in loops:
        pauses, recovered = loop.sched.num_pauses, sum(loop.sched.num_recoveries.values())
        assert (pauses > 0) == (pool == 40) and pauses - recovered in (0, 1)
    # while the paused ones cannot fit, the steps beside them overlap too
    assert (over.kept_beside_paused > 0) == (pool == 40)


@pytest.mark.slow  # `make test` only: too long for `make test-fast` (16 s)
def test_overlap_beside_paused_requests_keeps_rotation_turns(engine, runner):
    """Rotation on a pool that holds about one answer: schedules over an unread step while others are paused
    (the scheduler quiet until a turn falls due) give the same tokens, pauses, turns and recoveries as reading
    every step first, and no turn comes later (the step before a due turn is read before it is planned)."""
    tok = engine.tokenizer
    prompts = [tok.encode(t) for t in ("The capital of France is", "1, 2, 3, 4,", "Once upon a time")]

    def requests():
        return {0: [InferReq(f"r{i}", p, greedy(26)) for i, p in enumerate(prompts)]}

    loops = []
    for overlap in (False, True):
        loop = Loop(runner, 48, overlap, tick=0.01, quantum=0.05, turn_wait=0.1)
        loop.run(requests(), cancels={})
        free, used, cached = loop.sched.accounting()
        assert not loop.sched.reqs and used == 0 and free + cached == 48
        loops.append(loop)
    sync, over = loops
    assert sync.done == over.done and all(len(ids) == 26 for ids, _ in over.done.values())
    assert sync.sched.num_rotations > 2 and over.sched.num_rotations == sync.sched.num_rotations
    assert over.sched.num_pauses == sync.sched.num_pauses
    assert over.sched.num_recoveries == sync.sched.num_recoveries
    assert over.kept_beside_paused > 5 and sync.kept == 0


def test_may_keep_refuses_every_unsafe_schedule(engine, runner):
    loop = Loop(runner, 4096, overlap=True)
    a = InferReq("a", engine.tokenizer.encode("The capital of France is"), greedy(30))
    loop.sched.add(a)
    for _ in range(4):  # admit, answer the prompt transfer, two decode steps
        loop.iteration()
    assert a.state is ReqState.RUNNING and loop.steps.pending and loop.steps.may_keep()
    assert a.output_ids[-1] == PENDING
    assert loop.steps.may_keep(busy=True)  # quiet: copies in flight write only requests that do not run
    assert loop.steps.read_first() is None
    waiting = InferReq("w", [1, 2, 3], greedy(2))
    loop.sched.add(waiting)
    assert not loop.steps.may_keep()  # an admission hands slots to prefill
    assert not loop.steps.may_keep(busy=True)
    assert loop.steps.read_first() == "not_quiet"
    loop.sched.cancel("w")
    assert loop.steps.may_keep()
    loop.sched.max_len = a.num_tokens + 1
    assert not loop.steps.may_keep()  # the plan would end it at capacity
    assert loop.steps.read_first() == "max_len"
    loop.sched.max_len = runner.cfg.max_position_embeddings
    taken = loop.sched.pool.alloc(loop.sched.pool.num_free)
    assert not loop.steps.may_keep()  # the reservation would evict or pause
    assert loop.steps.read_first() == "room"
    loop.sched.pool.free(taken)
    a.params.temperature = 0.5
    assert not loop.steps.may_keep()  # sampling reads logits: no graph argmax
    assert loop.steps.read_first() == "sampling"
    a.params.temperature = 0.0
    loop.steps.runner.graph_batch = lambda n: False  # an instance attribute over the launcher's method
    try:
        assert loop.steps.read_first() == "no_graph"  # no captured graph for the batch
    finally:
        del loop.steps.runner.graph_batch
    assert set(DecodeSteps.READ_FIRST) == {"not_quiet", "room", "no_graph", "max_len", "sampling"}
    loop.steps.flush()
    assert PENDING not in a.output_ids and not loop.steps.pending


class SlotModel:
    """A model whose next token is a hash of the K/V its slots hold (each position's slot holds its token): a slot
    written or reused out of turn changes every later token. Its greedy answers depend on the prompt alone, so a
    stream paused, rotated and recovered any number of times must still give `SlotModel.reference`'s tokens."""

    VOCAB, EOS = 61, 2

    def __init__(self, num_slots: int):
        self.kv = [-1] * num_slots
        self.cfg = types.SimpleNamespace(eos_token_ids=[self.EOS], max_position_embeddings=4096)

    @classmethod
    def next_of(cls, tokens: list[int]) -> int:
        h = sum(t * (p + 1) * 2654435761 for p, t in enumerate(tokens)) % (1 << 31)
        return cls.EOS if h % 53 == 0 else 3 + h % (cls.VOCAB - 3)

    @classmethod
    def reference(cls, prompt: list[int], n: int) -> list[int]:
        toks, out = list(prompt), []
        while len(out) < n:
            out.append(cls.next_of(toks))
            toks.append(out[-1])
            if out[-1] == cls.EOS:
                break
        return out

    def forward(self, spans):
        logits = torch.zeros(len(spans), self.VOCAB)
        for i, s in enumerate(spans):
            for j, t in enumerate(s.token_ids):
                assert t >= 0, "a placeholder reached the model"
                self.kv[s.slots[s.start + j]] = t
            end = s.start + len(s.token_ids)
            logits[i, self.next_of([self.kv[q] for q in s.slots[:end]])] = 1.0
        return logits

    def greedy(self, spans):
        return self.forward(spans).argmax(-1).tolist()


@pytest.mark.parametrize("delay", [1, 4], ids=["answered-next", "in-flight"])
@pytest.mark.parametrize("seed", range(6))
def test_overlap_beside_paused_requests_is_exact_under_random_load(seed, delay):
    """Random arrivals, a cancel, early stops and rotation on a tight pool, with a model whose tokens depend on every
    slot's content: in overlapped and synchronous loops every answer equals the model's unpaused one token for
    token (the cancelled one up to where it was cut), and nothing leaks. (The two loops need not pause at the same
    iterations: an overlapped step's stop is read one iteration later, which shifts the pool's timeline.) With
    transfers in flight for 4 iterations, steps also overlap while prompts and recoveries are being written."""
    rng = random.Random(seed)
    pool = 60
    prompts = [[rng.randrange(3, 61) for _ in range(rng.randrange(3, 12))] for _ in range(7)]
    lens = [rng.randrange(8, 40) for _ in prompts]
    at = sorted(rng.randrange(0, 30) for _ in prompts)
    cancel_at, victim = rng.randrange(10, 60), f"q{rng.randrange(7)}"

    def requests():
        out: dict[int, list[InferReq]] = {}
        for i, (p, n, t) in enumerate(zip(prompts, lens, at)):
            out.setdefault(t, []).append(InferReq(f"q{i}", list(p), greedy(n)))
        return out

    loops = []
    for overlap in (False, True):
        loop = Loop(SlotModel(pool), pool, overlap, max_batch=4, tick=0.01, delay=delay, quantum=0.05, turn_wait=0.1)
        loop.run(requests(), cancels={cancel_at: victim})
        free, used, cached = loop.sched.accounting()
        assert not loop.sched.reqs and used == 0 and free + cached == pool
        loops.append(loop)
    for loop in loops:
        assert len(loop.done) == len(prompts)
        for i, (p, n) in enumerate(zip(prompts, lens)):
            ids, reason = loop.done[f"q{i}"]
            ref = SlotModel.reference(p, n)
            assert ids == (ref[: len(ids)] if reason == "cancelled" else ref), (i, reason)
    sync, over = loops
    assert sync.sched.num_pauses > 0 and over.sched.num_pauses > 0 and over.kept_beside_paused > 0
    assert (over.kept_in_flight > 0) == (delay > 1) and sync.kept_in_flight == 0
