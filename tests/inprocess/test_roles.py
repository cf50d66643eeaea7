"""The three roles' loops in one process (tests/inprocess/fake_triton.py stands in for Triton's Python backend):
pause and recovery, recovery epochs, rotation, cancellation and deadlines on `random:tiny-test`, each answer checked
against the offline engine token for token, and every count back to 0 at the end. No tritonserver: the real-server
tests keep what only a server shows (streaming over gRPC/HTTP, BLS between stubs, process death, several servers)."""

from __future__ import annotations

import time

import pytest

from backends.common.core.request import ReqState, SamplingParams
from backends.common.engine.engine import Engine
from tests.inprocess.fake_triton import Server, generate

MODEL = "random:tiny-test"
PROMPT = 24  # tokens per prompt
N_OUT = 60  # output tokens per answer: four answers need more than the small pools below
SEEDED = {"temperature": 0.8, "top_p": 0.9, "seed": 77}


def prompt(i: int) -> list[int]:
    return [(7 * i + 3 * k) % 250 + 1 for k in range(PROMPT + i)]


def params(i: int, n_out: int = N_OUT) -> dict:
    base = {"max_tokens": n_out, "ignore_eos": True}
    return {**base, **SEEDED} if i == 3 else {**base, "temperature": 0}


@pytest.fixture(scope="module")
def expected():
    engine = Engine(MODEL, dtype="float32", device="cpu", kv_tokens=4096)
    outs = engine.generate([prompt(i) for i in range(4)], [SamplingParams(**params(i)) for i in range(4)])
    return [o.output_ids for o in outs]


@pytest.fixture
def serve(tmp_path):
    servers = []

    def start(**roles) -> Server:
        servers.append(Server(tmp_path, MODEL, **roles))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def released(s: Server, timeout: float = 5.0) -> None:
    """Every request gone from master and decode, every decode KV slot free or cached, no state held."""
    sched, t0 = s.decode.sched, time.monotonic()
    # the loop thread may be mid-way through an answer (inflight popped, an orphan's slots not yet freed): wait for
    # the whole state, read from this thread while it may change (a dict resized mid-read: read again)
    while time.monotonic() - t0 < timeout:
        try:
            free, _, cached = sched.accounting()
            settled = not (sched.reqs or s.master.active or sched.inflight or sched.orphans)
        except RuntimeError:
            settled = False
        if settled and free + cached == sched.pool.num_slots:
            break
        time.sleep(0.02)
    assert not sched.reqs and not s.master.active, (dict(sched.counts()), list(s.master.active))
    free, used, cached = sched.accounting()
    assert used == 0 and free + cached == sched.pool.num_slots
    assert sched.host_accounting()[1] == 0 or sched.host_pool is not None  # host copies end with their request
    assert not sched.check_invariants(liveness=True)


def run_all(s: Server, n: int = 4, n_out: int = N_OUT) -> list:
    answers = [generate(s, prompt(i), **params(i, n_out)) for i in range(n)]
    return [a.wait() for a in answers]


def test_paused_answers_equal_unpaused_ones_through_host_swaps_and_rotation(serve, expected):
    """A 96-slot pool for four answers of ~85 tokens: decode pauses, rotates turns and swaps paused KV through host
    memory (turns of a few milliseconds: a step of this model takes well under one); stale completions (an old
    epoch re-delivered after every recovery) are dropped."""
    s = serve(decode={"kv_tokens": 96, "max_batch": 4, "rotation_quantum": 0.003, "rotation_wait": 0.006,
                      "fault_injection": "stale"})  # fmt: skip
    answers = run_all(s)
    for i, a in enumerate(answers):
        assert a.error is None and a.finish_reason == "length", (i, a.error, a.finish_reason)
        assert a.ids == expected[i], f"answer {i} differs from the unpaused run"
    sched = s.decode.sched
    assert sched.num_pauses > 0 and sched.num_rotations > 0 and sched.num_recoveries["host"] > 0
    assert sched.swapped_tokens["in"] > 0
    # each turn's handover timed once, from the read before the turn to the resumed request's next token
    loop = s.decode.loop
    assert 0 < loop.handovers <= sum(sched.num_recoveries.values()) and loop.handover_seconds > 0
    assert not loop._handover and loop.steps.num_steps >= max(len(x) for x in expected)
    # and each turn's host part, from its plan to its step launched: part of the loop's wall time
    assert 0 < loop.turn_host_seconds <= sum(loop.loop_time.values())
    # decode waited with nothing to run (before the first request and between answers): idle, not wait
    assert loop.loop_time["idle"] > 0
    # every recovery's completion was re-delivered under its old epoch: dropped and counted
    assert sched.num_stale >= sched.num_recoveries["host"] + sched.num_recoveries["prefill"]
    released(s)
    assert sched.host_accounting()[1] == 0  # every host copy freed


def test_recovery_by_prefill_under_a_new_epoch_is_exact(serve, expected):
    """Decode keeps no paused KV and does not rotate: every recovery is a prefill recompute under epoch + 1; some
    request reaches epoch 3 and every token is still exact."""
    s = serve(decode={"kv_tokens": 96, "max_batch": 4, "rotation_quantum": 0, "host_kv_tokens": 0,
                      "fault_injection": "stale,drop_paused_kv"})  # fmt: skip
    answers = run_all(s)
    assert [a.ids for a in answers] == expected
    sched = s.decode.sched
    assert sched.num_recoveries["prefill"] >= 3 and sched.max_epoch >= 3
    assert sched.num_recoveries["local"] == sched.num_recoveries["host"] == 0
    assert sched.num_stale >= sched.num_recoveries["prefill"]
    released(s)
    # a prompt again: prefill's cache holds it followed by the tokens its recoveries computed, so a match of the
    # finished job's ids and its sampled token ran one past the job (the hand-off failed: "prefill cache lost
    # positions (26 of 25)")
    again = [generate(s, prompt(i), **params(i)).wait() for i in range(4)]  # one at a time: no pauses now
    assert [(a.error, a.ids) for a in again] == [(None, x) for x in expected]
    released(s)


@pytest.mark.slow  # `make test` only: a worker process for decode's second rank
def test_decode_split_two_ways_pauses_and_swaps_through_host_memory_exactly(serve, expected):
    """decode_tp 2 (rank 1 a worker process): rotation's host swaps copy each KV head from and back to the rank
    that holds it; the answers equal the unpaused ones and everything is released."""
    s = serve(decode={"kv_tokens": 96, "max_batch": 4, "rotation_quantum": 0.003, "rotation_wait": 0.006,
                      "decode_tp": 2})  # fmt: skip
    answers = run_all(s)
    assert [(a.error, a.ids) for a in answers] == [(None, x) for x in expected]
    sched = s.decode.sched
    assert sched.num_recoveries["host"] > 0 and sched.swapped_tokens["in"] > 0
    assert s.decode.host_kv.shards is not None and len(s.decode.runner.kv_shards()) == 2
    released(s)


@pytest.mark.slow  # `make test` only: too long for `make test-fast`
def test_fp8_weights_pause_and_recover_exactly(tmp_path):
    """The same model with fine-grained FP8 projections (converted at load): answers paused and recovered through
    host memory and through prefill under new epochs equal the offline engine's token for token."""
    model = MODEL + "-fp8"
    engine = Engine(model, dtype="float32", device="cpu", kv_tokens=4096)
    want = [
        o.output_ids
        for o in engine.generate([prompt(i) for i in range(4)], [SamplingParams(**params(i)) for i in range(4)])
    ]
    host = {"host_kv_tokens": 2048, "fault_injection": "stale"}
    prefill = {"rotation_quantum": 0, "host_kv_tokens": 0, "fault_injection": "stale,drop_paused_kv"}
    for decode in (host, prefill):
        s = Server(tmp_path, model, decode={"kv_tokens": 96, "max_batch": 4, **decode})
        try:
            assert s.decode.runner.quantization == "fp8"
            answers = run_all(s)
            assert [a.ids for a in answers] == want
            path = "host" if decode["host_kv_tokens"] else "prefill"
            assert s.decode.sched.num_recoveries[path] > 0
            released(s)
        finally:
            s.close()


def test_cancel_while_paused_frees_everything_and_the_rest_complete(serve, expected):
    s = serve(decode={"kv_tokens": 96, "max_batch": 4, "rotation_quantum": 0, "host_kv_tokens": 0})
    answers = [generate(s, prompt(i), **params(i)) for i in range(3)]
    sched, t0 = s.decode.sched, time.monotonic()
    while not sched.by_state(ReqState.PAUSED) and time.monotonic() - t0 < 60:
        time.sleep(0.005)
    paused = {r.rid for r in sched.by_state(ReqState.PAUSED)}
    assert paused, "nothing paused"
    victim = next(i for i, a in enumerate(answers) if any(r.startswith(rid) for rid in paused
                                                           for r in [master_rid(s, a)]))  # fmt: skip
    answers[victim].cancel()
    for a in answers:
        a.wait()
    v = answers[victim]  # a cancelled client's stream ends with the final flag alone, as Triton's do
    assert v.finish_reason is None and v.error is None and len(v.ids) < N_OUT
    for i, a in enumerate(answers):
        if i != victim:
            assert a.finish_reason == "length" and a.ids == expected[i], (i, a.finish_reason, a.error)
    released(s)


def test_closing_every_stream_while_some_are_paused_frees_everything(serve):
    s = serve(decode={"kv_tokens": 96, "max_batch": 4, "rotation_quantum": 0.003, "rotation_wait": 0.006})
    answers = [generate(s, prompt(i), **params(i, 5000)) for i in range(4)]
    sched, t0 = s.decode.sched, time.monotonic()
    while not sched.by_state(ReqState.PAUSED) and time.monotonic() - t0 < 60:
        time.sleep(0.002)
    assert sched.by_state(ReqState.PAUSED)
    for a in answers:
        a.cancel()
    for a in answers:
        a.wait()
    released(s, timeout=2.0)
    assert sched.host_accounting()[1] == 0  # cancelled requests' host copies freed too
    ok = generate(s, prompt(0), max_tokens=4, temperature=0).wait()
    assert ok.error is None and len(ok.ids) == 4


def test_restart_baseline_resubmits_ids_and_loses_nothing(serve, expected):
    """on_decode_oom restart (the comparison baseline): a segment that runs out of KV ends, and master re-submits
    prompt + generated ids. Answers stay whole; greedy ones equal the offline engine's (ids are never re-tokenised,
    so the recomputed context is exactly the one decode lost)."""
    s = serve(decode={"kv_tokens": 128, "max_batch": 4, "on_decode_oom": "restart"})
    answers = run_all(s)
    for i, a in enumerate(answers):
        assert a.error is None and a.finish_reason == "length" and len(a.ids) == N_OUT, (i, a.error)
        if params(i)["temperature"] == 0:
            assert a.ids == expected[i], f"greedy answer {i} differs after restarts"
    assert s.metric("pd_restarts_total") > 0 and s.metric("pd_decode_restarts_total") > 0
    assert s.metric("pd_pauses_total") == 0
    released(s)


def master_rid(s: Server, answer) -> str:
    """The decode request id master opened for this client's answer."""
    for req in list(s.master.active.values()):
        if req.sender is answer.stream.sender:
            return req.current_rid
    return "-"


def test_deadline_while_recovering_ends_that_answer_and_frees_it(serve):
    """Both prompts start; one is paused and, with no paused KV kept, recovers through prefill, whose answer is
    held back (the fake server's gate) until that request's 4 s deadline has passed. The deadline ends that answer
    and frees everything it held; prefill's late answer for it is then dropped. The other answer ends at the pool's
    size well before."""
    s = serve(decode={"kv_tokens": 96, "max_batch": 4, "rotation_quantum": 0, "host_kv_tokens": 0,
                      "fault_injection": "drop_paused_kv"}, master={"request_timeout": 4.0})  # fmt: skip
    gate = s.hold("pd_prefill", lambda inputs: not bool(inputs["sample"].as_numpy().reshape(-1)[0]))  # recoveries
    answers = [generate(s, prompt(i), **params(i, 5000)) for i in range(2)]
    sched, t0, saw = s.decode.sched, time.monotonic(), False
    while any(not a.stream.sender.closed for a in answers) and time.monotonic() - t0 < 60:
        saw |= bool(sched.by_state(ReqState.RECOVERING))
        time.sleep(0.005)
    for a in answers:
        a.wait()
    assert saw
    late = [a for a in answers if a.error is not None]
    assert len(late) == 1 and "timed out after 4 s" in late[0].error, [(a.finish_reason, a.error) for a in answers]
    assert [a.finish_reason for a in answers if a.error is None] == ["length"]
    gate.set()  # prefill now answers for a request that is gone
    released(s)


def test_cancel_during_recovery_keeps_its_slots_until_prefill_has_answered(serve, expected):
    """A recovering request is cancelled while prefill (held at the gate) has yet to write its KV. Its slots must
    stay reserved until prefill answers: handed to the others at once, prefill's late writes would corrupt their
    K/V, and their answers would differ from the offline engine's."""
    s = serve(decode={"kv_tokens": 96, "max_batch": 4, "rotation_quantum": 0, "host_kv_tokens": 0,
                      "fault_injection": "drop_paused_kv"})  # fmt: skip
    gate = s.hold("pd_prefill", lambda inputs: not bool(inputs["sample"].as_numpy().reshape(-1)[0]))  # recoveries
    answers = [generate(s, prompt(i), **params(i)) for i in range(3)]
    sched, t0 = s.decode.sched, time.monotonic()
    while not sched.by_state(ReqState.RECOVERING) and time.monotonic() - t0 < 60:
        time.sleep(0.002)
    recovering = {r.rid for r in sched.by_state(ReqState.RECOVERING)}
    victim = next(i for i, a in enumerate(answers) if master_rid(s, a) in recovering)
    answers[victim].cancel()
    t0 = time.monotonic()
    while recovering & set(sched.reqs) and time.monotonic() - t0 < 10:
        time.sleep(0.002)
    time.sleep(0.3)  # the others run on: with the slots given back, they would be using them by now
    gate.set()
    for a in answers:
        a.wait()
    assert answers[victim].finish_reason is None and len(answers[victim].ids) < N_OUT
    for i, a in enumerate(answers):
        if i != victim:
            assert a.finish_reason == "length" and a.ids == expected[i], (i, a.finish_reason, a.error)
    released(s)


class FailingOver:
    """Decode's prefill client with a first server that cannot be reached: every job tries it, then this server's
    prefill (the client decode uses for prefill servers over gRPC behaves the same way: `RemotePrefill`)."""

    def __init__(self, live):
        self.live, self.asked = live, []

    def order(self) -> list:
        return ["dead:1", None]

    def ask(self, server, msg):
        from backends.common.transfer.remote import Unreachable

        self.asked.append(server)
        if server == "dead:1":
            raise Unreachable("dead:1: connection refused")
        return self.live.ask(server, msg)

    def close(self) -> None:
        pass


def test_prefill_jobs_fail_over_to_the_next_server_and_stay_exact(serve, expected):
    """Every prompt and every recovery first goes to a prefill server that is not there: the job is retried on the
    next (the first attempt's rows, were any to come, dropped), counted, and every answer is still exact."""
    s = serve(decode={"kv_tokens": 96, "max_batch": 4, "rotation_quantum": 0, "host_kv_tokens": 0,
                      "fault_injection": "drop_paused_kv"})  # fmt: skip
    client = s.decode.loop.prefill = FailingOver(s.decode.prefill)
    answers = run_all(s)
    assert [a.ids for a in answers] == expected
    assert client.asked.count("dead:1") == client.asked.count(None) >= 4 + 1  # four prompts and a recovery
    # decode publishes its counters every loop pass: the last one may follow the last answer
    failed_over = client.asked.count("dead:1")
    assert s.wait_metric("pd_prefill_failovers_total", lambda v: v == failed_over, timeout=5.0) == failed_over
    assert s.metric("pd_recoveries_total", path="prefill") >= 1
    released(s)


def test_a_broken_reply_channel_ends_its_answers_with_an_error_and_the_next_connects_again(serve):
    """Decode's socket to master fails: the answer that was to go through it ends with an error naming the reply
    channel (never a hang), decode drops its request and frees its slots, and the next request connects again and
    is answered whole. (One request at a time: a request that arrives after decode saw the socket fail already
    gets a new connection.)"""
    import socket

    s = serve(decode={"kv_tokens": 1024, "max_batch": 4})
    first = generate(s, prompt(0), max_tokens=4, temperature=0, ignore_eos=True).wait()
    assert first.error is None and len(first.ids) == 4
    (channel,) = s.decode.replies.channels.values()
    channel.sock.shutdown(socket.SHUT_RDWR)  # as a connection that broke: decode's next send fails
    broken = generate(s, prompt(1), max_tokens=40, temperature=0, ignore_eos=True).wait()
    assert broken.error is not None and "reply channel" in broken.error, (broken.error, broken.finish_reason)
    released(s)
    again = generate(s, prompt(3), max_tokens=12, temperature=0, ignore_eos=True).wait()
    assert again.error is None and again.finish_reason == "length" and len(again.ids) == 12
    assert s.decode.replies.channels[s.master.inbox.path] is not channel
    released(s)


def test_prefill_captures_no_decode_graphs_and_decode_does(serve, monkeypatch, expected):
    """Prefill's engine is made without decode graphs (its batches carry prompts and recomputed positions, which run
    eagerly, so capturing would only time projections at start on the GPU decode shares), decode's runner with
    them; and prefill still answers exactly."""
    from backends.common.engine import runner as runner_module

    made = []
    real = runner_module.ModelRunner.__init__

    def record(self, *a, **kw):
        made.append(kw.get("cuda_graphs", True))
        real(self, *a, **kw)

    monkeypatch.setattr(runner_module.ModelRunner, "__init__", record)
    s = serve()
    assert made == [False, True]  # loaded in order: prefill, decode (fake_triton.Server._load)
    assert [a.ids for a in run_all(s)] == expected
    released(s)
