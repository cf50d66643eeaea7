"""The offline engine against transformers, and against itself under batching, chunking, caching, preemption."""

from __future__ import annotations

import contextlib

import pytest

from backends.common.core.request import SamplingParams
from backends.common.engine.engine import Engine
from tests.conftest import hf_greedy

PROMPTS = [
    ("chat", "What is the capital of France?"),
    # one chat prompt in `make test-fast`; these three in `make test`
    pytest.param("plain", "The history of the Roman Empire", marks=pytest.mark.slow),
    pytest.param("plain", "def fibonacci(n):", marks=pytest.mark.slow),
    pytest.param("chat", "Write a haiku about the sea.", marks=pytest.mark.slow),
]


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def encode(engine, kind, text):
    return engine.tokenizer.encode_chat(text) if kind == "chat" else engine.tokenizer.encode(text)


def assert_idle(engine: Engine):
    free, used, cached = engine.scheduler.accounting()
    assert used == 0 and free + cached == engine.scheduler.pool.num_slots
    assert engine.scheduler.radix.protected_size == 0


@contextlib.contextmanager
def borrowed(engine: Engine, scheduler, overlap: bool = False):
    """The session engine's runner, and so its KV buffer, under another scheduler (overlap: launches deferred as
    the GPU path's CUDA graphs do, DeferredLaunch). That scheduler hands out slots that the engine's radix cache
    may hold, so the cache is emptied before and after, whatever the test does: a cached prompt left in an
    overwritten slot changed a later test's greedy answer in the same worker (test_min_tokens_and_stop_ids after
    test_preemption_under_tiny_pool_keeps_tokens)."""
    engine.scheduler.radix.clear()
    e = Engine.__new__(Engine)
    e.__dict__.update(engine.__dict__)
    e.scheduler, e.overlap, e._pending, e.num_overlapped = scheduler, overlap, None, 0
    if overlap:
        e.runner = DeferredLaunch(engine.runner)
    try:
        yield e
    finally:
        scheduler.radix.clear()
        engine.scheduler.radix.clear()


@pytest.mark.parametrize("kind,text", PROMPTS)
def test_greedy_48_tokens_equal_transformers(engine, hf_model, kind, text):
    ids = encode(engine, kind, text)
    out = engine.generate([ids], greedy(48))[0]
    assert out.output_ids == hf_greedy(hf_model, ids, 48)
    assert out.finish_reason == "length"
    assert_idle(engine)


def test_chat_answer_is_paris(engine):
    out = engine.generate(
        [engine.tokenizer.encode_chat("What is the capital of France?")], SamplingParams(max_tokens=30, temperature=0)
    )[0]
    assert out.text == "The capital of France is Paris." and out.finish_reason == "stop"
    assert out.output_ids[-1] in engine.cfg.eos_token_ids


def _batch_prompts(engine):
    shared = engine.tokenizer.encode("You are a careful assistant. Answer briefly and precisely. " * 3)
    tails = [
        "Name a prime.",
        "What is 2+2?",
        "Define entropy.",
        "Who wrote Hamlet?",
        "Say hi.",
        "List three colours of the rainbow, please, in order.",
        "Why is the sky blue?",
        "Count to five.",
    ]
    prompts = [shared + engine.tokenizer.encode(t) for t in tails[:5]]
    prompts += [engine.tokenizer.encode(t) for t in tails[5:]]  # no shared prefix
    return prompts


@pytest.mark.slow  # `make test` only: too long for `make test-fast`
def test_batched_ragged_shared_prefix_equals_alone(engine):
    prompts = _batch_prompts(engine)
    lens = [5 + 3 * i for i in range(8)]  # ragged output lengths too
    alone = [engine.generate([p], greedy(n))[0].output_ids for p, n in zip(prompts, lens)]
    from backends.common.core.scheduler import Scheduler

    # same runner, a scheduler that admits a few prompt tokens per step
    with borrowed(engine, Scheduler(engine.scheduler.pool, max_batch=8, chunk_size=64, max_batch_tokens=64)) as small:
        batched = small.generate(prompts, [greedy(n) for n in lens])
        assert [o.output_ids for o in batched] == alone
        assert small.scheduler.num_cached_tokens > 0  # later prompts were served through the radix cache
        assert_idle(small)


@pytest.mark.slow  # `make test` only: too long for `make test-fast`
def test_chunked_prefill_and_prefix_hit_equal_whole_prefill(engine):
    ids = engine.tokenizer.encode(
        "In the beginning the universe was created. This has made a lot of people "
        "very angry and been widely regarded as a bad move. " * 2
    )
    engine.scheduler.radix.clear()
    whole = engine.generate([ids], greedy(24))[0].output_ids
    engine.scheduler.radix.clear()
    chunk, budget = engine.scheduler.chunk_size, engine.scheduler.max_batch_tokens
    engine.scheduler.chunk_size = engine.scheduler.max_batch_tokens = 16
    try:
        chunked = engine.generate([ids], greedy(24))[0].output_ids
        before = engine.scheduler.num_cached_tokens
        hit = engine.generate([ids[:-3] + ids[-3:]], greedy(24))[0].output_ids  # whole prompt now cached
        assert engine.scheduler.num_cached_tokens - before == len(ids) - 1
    finally:
        engine.scheduler.chunk_size, engine.scheduler.max_batch_tokens = chunk, budget
    assert chunked == whole and hit == whole
    assert_idle(engine)


@pytest.mark.slow  # `make test` only: too long for `make test-fast`
def test_preemption_under_tiny_pool_keeps_tokens(engine):
    """A pool too small for all requests at once: preempted requests recompute and still match the same batch run
    with room for all (which equals each prompt alone: test_batched_ragged_shared_prefix_equals_alone)."""
    prompts = _batch_prompts(engine)[:4]
    expected = [o.output_ids for o in engine.generate(prompts, greedy(32))]
    from backends.common.core.kv_pool import KVPool
    from backends.common.core.scheduler import Scheduler

    with borrowed(engine, Scheduler(KVPool(160), max_batch=4, chunk_size=64, max_batch_tokens=256)) as tiny:
        got = tiny.generate(prompts, greedy(32))
        assert [o.output_ids for o in got] == expected
        assert tiny.scheduler.num_preemptions > 0
        assert_idle(tiny)


@pytest.mark.slow  # `make test` only: too long for `make test-fast`
def test_seeded_sampling_batch_invariant_and_reproducible(engine):
    ids = engine.tokenizer.encode_chat("Tell me a short story about a cat.")
    p = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)
    alone = engine.generate([ids], p)[0].output_ids
    others = [engine.tokenizer.encode(t) for t in ("Hello there", "Once upon a time", "Numbers: 1 2 3")]
    mixed = engine.generate(
        others + [ids], [SamplingParams(max_tokens=10, temperature=1.0, seed=s) for s in (1, 2, 3)] + [p]
    )[-1].output_ids
    assert mixed == alone
    other_seed = engine.generate(
        [ids], SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=99, ignore_eos=True)
    )[0].output_ids
    assert other_seed != alone
    g = engine.generate([ids], greedy(24))[0].output_ids
    k1 = engine.generate([ids], SamplingParams(max_tokens=24, temperature=0.7, top_k=1, seed=5, ignore_eos=True))[
        0
    ].output_ids
    assert k1 == g
    assert_idle(engine)


def test_min_tokens_and_stop_ids(engine):
    ids = engine.tokenizer.encode_chat("What is the capital of France?")
    free = engine.generate([ids], SamplingParams(max_tokens=30, temperature=0))[0]
    eos = free.output_ids[-1]
    longer = engine.generate([ids], SamplingParams(max_tokens=30, temperature=0, min_tokens=len(free.output_ids) + 2))[
        0
    ]
    assert len(longer.output_ids) >= len(free.output_ids) + 2
    assert eos not in longer.output_ids[: len(free.output_ids) + 1]
    stop_at = free.output_ids[2]
    stopped = engine.generate([ids], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_at]))[0]
    assert stopped.output_ids == free.output_ids[:3] and stopped.finish_reason == "stop"
    ignored = engine.generate(
        [ids], SamplingParams(max_tokens=len(free.output_ids) + 3, temperature=0, ignore_eos=True)
    )[0]
    assert ignored.output_ids[: len(free.output_ids)] == free.output_ids and ignored.finish_reason == "length"


def test_random_weights_named_shape_generates():
    """random:<shape>: the named shape's config, N(0, 0.02) weights, byte-level tokenizer; deterministic."""
    from backends.common.core.config import SHAPES
    from backends.common.model import loader

    src = loader.resolve("random:smollm2-135m")
    assert loader.load_config(src) is SHAPES["smollm2-135m"]
    e = Engine("random:smollm2-135m", kv_tokens=512)
    ids = e.tokenizer.encode("héllo")
    assert ids == list("héllo".encode())
    a = e.generate([ids], greedy(6))[0]
    b = e.generate([ids], greedy(6))[0]
    assert len(a.output_ids) == 6 and a.output_ids == b.output_ids
    assert all(0 <= t < SHAPES["smollm2-135m"].vocab_size for t in a.output_ids)


class DeferredLaunch:
    """ModelRunner's launch/collect contract (what the GPU path does with CUDA graphs) on the CPU model: a launched
    step's tokens come back only from `collect`, and a span id of -1 stands for the token this sequence's previous
    launched step produced, as the device keeps it. Everything else is the real runner; an id of -1 reaching its
    forward fails (the embedding has no row -1)."""

    def __init__(self, runner, max_rows: int = 8):
        self.runner, self.max_rows, self.last, self.launched = runner, max_rows, {}, 0

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def graph_batch(self, n: int) -> bool:
        return n <= self.max_rows

    def launch_greedy(self, spans):
        from backends.common.model.batch import Span

        if len(spans) > self.max_rows or any(len(s.token_ids) != 1 for s in spans):
            return None
        ids = [self.last[s.key] if s.token_ids[0] == -1 else s.token_ids[0] for s in spans]
        tokens = self.runner.forward([Span([t], s.start, s.slots, s.key) for t, s in zip(ids, spans)]).argmax(-1)
        self.last.update((s.key, int(t)) for s, t in zip(spans, tokens))
        self.launched += 1
        return tokens.tolist()

    def collect(self, handle):
        return handle


@pytest.mark.slow  # `make test` only: too long for `make test-fast`
@pytest.mark.parametrize("pool", [8192, 100], ids=["roomy", "preempting"])
def test_overlapped_steps_equal_synchronous(engine, pool):
    """Launching step n+1 before reading step n's tokens changes nothing: same tokens and finish reasons with stop
    ids hit mid-batch, min_tokens (whose steps run synchronously), a request arriving mid-run and, with a small pool,
    preemption; no placeholder is left and no KV leaks."""
    from backends.common.core.kv_pool import KVPool
    from backends.common.core.scheduler import Scheduler
    from backends.common.engine.engine import PENDING

    prompts = _batch_prompts(engine)[:5]
    probe = engine.generate([prompts[1]], greedy(20))[0].output_ids
    params = [
        greedy(14),
        SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[probe[6]]),
        greedy(25),
        SamplingParams(max_tokens=18, temperature=0, min_tokens=6),
        greedy(9),
    ]
    results = []
    for overlap in (False, True):
        with borrowed(engine, Scheduler(KVPool(pool), max_batch=4, chunk_size=64, max_batch_tokens=96), overlap) as e:
            reqs = [e.add_request(p, sp) for p, sp in zip(prompts[:4], params[:4])]
            for _ in range(8):
                e.step()
            reqs.append(e.add_request(prompts[4], params[4]))  # arrives while steps are in flight
            while e.has_work():
                e.step()
            assert all(r.finished and PENDING not in r.output_ids for r in reqs)
            results.append([(r.output_ids, r.finish_reason) for r in reqs])
            assert_idle(e)
        if overlap:  # a tight pool mostly runs synchronously: the next step might need to preempt
            assert e.num_overlapped > (10 if pool == 8192 else 0) and e.runner.launched > e.num_overlapped
            assert (e.scheduler.num_preemptions > 0) == (pool == 100)
    assert results[0] == results[1]
    assert results[1][1][1] == "stop" and len(results[1][1][0]) <= 7
