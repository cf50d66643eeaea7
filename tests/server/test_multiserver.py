"""A deployment of four tritonservers started as separate processes: two prefill servers, one decode server and one
master, each reaching the next over Triton gRPC with the shared internal key, and prefill's KV reaching decode
over the network transport (torch.distributed, gloo on the CPU). Prefill server A is slow (it waits 3 s before each
batch), so its jobs are in flight long enough to cancel one and to kill A in the middle of a recovery."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from backends.common.core.request import SamplingParams
from backends.common.engine.engine import Engine
from tests.server.client import StreamClient, grpc_generate, grpc_generate_all
from tests.server.conftest import Server

pytestmark = [pytest.mark.server, pytest.mark.slow]

N_OUT = 400
# what is tested is the servers' traffic (transfers, failover, cancel notices), not the model: a model whose steps
# cost next to nothing leaves the time to the slow prefill server's waits
MODEL = "random:tiny-test"


@pytest.fixture(scope="module")
def engine():
    """The offline engine on the servers' model (random weights drawn from the same seed)."""
    return Engine(MODEL, dtype="float32", device="cpu", kv_tokens=4096)


def _start(servers: dict, name: str, *args: str) -> None:
    servers[name] = Server(*args, name=f"ms-{name}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    key = tmp_path_factory.mktemp("ms") / "internal_key"
    assert subprocess.run([sys.executable, "-m", "backends.cli", "key", str(key)]).returncode == 0
    common = ["--model", MODEL, "--internal-key-file", str(key), "--cpu-threads", "1"]
    up: dict = {}
    try:
        prefills = [threading.Thread(target=_start, args=(up, "pa", "--role", "prefill", *common, "--fault-injection",
                                                          "slow_prefill")),
                    threading.Thread(target=_start, args=(up, "pb", "--role", "prefill", *common))]  # fmt: skip
        for t in prefills:
            t.start()
        for t in prefills:
            t.join()
        _start(up, "decode", "--role", "decode", *common, "--prefill-urls", f"{up['pa'].grpc_url},{up['pb'].grpc_url}",
               "--kv-address", "127.0.0.1", "--kv-tokens", "600", "--host-kv-tokens", "0", "--rotation-quantum", "0",
               "--fault-injection", "stale,drop_paused_kv", "--exit-timeout", "3")  # fmt: skip
        _start(up, "master", "--role", "master", *common, "--decode-urls", up["decode"].grpc_url)
        yield up
    finally:  # front end first, as an operator stops them; decode's exit timeout is short because a decode server
        # that relayed paused streams from prefill servers often waits it out at its stop (noted on issue #30)
        for s in reversed(list(up.values())):
            s.stop()


def prompt_ids(i: int) -> list[int]:
    return [(37 * i + 11 * j) % 300 + 3 for j in range(180 + 7 * i)]


def test_cancel_while_a_network_transfer_is_in_flight(cluster, engine):
    pa, dec, master = cluster["pa"], cluster["decode"], cluster["master"]
    ids = prompt_ids(0)
    for _ in range(4):  # round robin: every other job goes to the slow server A
        before = pa.metric("pd_prefill_jobs_total", kind="prompt")
        c = StreamClient(master.grpc_url, ids=ids, params={"max_tokens": 50, "temperature": 0, "ignore_eos": True})
        t0 = time.monotonic()
        while pa.metric("pd_prefill_jobs_total", kind="prompt") == before and time.monotonic() - t0 < 2:
            time.sleep(0.02)
        on_a = pa.metric("pd_prefill_jobs_total", kind="prompt") > before
        if on_a:
            c.cancel()  # A is waiting 3 s with the job: decode cancels it while its transfer is in flight
        r = c.read(timeout=60)
        if on_a:
            break
        assert r.error is None and len(r.ids) == 50
    assert on_a, "no prompt job reached prefill server A"
    assert pa.wait_metric("pd_prefill_cancelled_total", lambda v: v >= 1, timeout=10) >= 1  # through the store
    dec.assert_released(timeout=10)
    ok = grpc_generate(master.grpc_url, ids=ids[:40], params={"max_tokens": 5, "temperature": 0})
    assert ok.error is None and ok.ids == engine.generate([ids[:40]], SamplingParams(max_tokens=5, temperature=0))[
        0].output_ids  # fmt: skip


def test_exact_through_pauses_and_a_prefill_server_killed_mid_recovery(cluster, engine):
    pa, pb, dec, master = cluster["pa"], cluster["pb"], cluster["decode"], cluster["master"]
    prompts = [prompt_ids(i) for i in range(3)]
    params = [{"max_tokens": N_OUT, "temperature": 0, "ignore_eos": True}] * 3
    expected = [o.output_ids for o in engine.generate(prompts, [SamplingParams(**p) for p in params])]
    landed0 = dec.metric("pd_kv_transfers_total", transport="dist")
    results: list = []
    runner = threading.Thread(target=lambda: results.extend(grpc_generate_all(master.grpc_url, prompts, params)))
    runner.start()
    t0 = time.monotonic()  # wait for a recovery job on A (it holds it 3 s), then kill A's whole server
    while pa.metric("pd_prefill_jobs_total", kind="recovery") < 1 and time.monotonic() - t0 < 60:
        time.sleep(0.02)
    print(
        "recoveries before the kill: A",
        pa.metric("pd_prefill_jobs_total", kind="recovery"),
        "B",
        pb.metric("pd_prefill_jobs_total", kind="recovery"),
    )
    assert pa.metric("pd_prefill_jobs_total", kind="recovery") >= 1, "no recovery reached prefill server A"
    subprocess.run(["pkill", "-KILL", "-f", f"{pa.workdir}/"], capture_output=True)
    pa.stop()
    runner.join(timeout=400)
    assert not runner.is_alive()
    assert [r.error for r in results] == [None] * 3
    assert [r.ids for r in results] == expected  # nothing lost, nothing duplicated, token for token
    assert dec.metric("pd_prefill_failovers_total") >= 1  # the job A held was retried on B
    assert pb.metric("pd_prefill_jobs_total", kind="recovery") >= 1
    assert dec.metric("pd_recoveries_total", path="prefill") >= 1
    assert dec.metric("pd_kv_transfers_total", transport="dist") > landed0
    assert dec.metric("pd_stale_messages_total") >= 1  # the "stale" fault's re-deliveries, dropped
    dec.assert_released(timeout=10)
    # with A gone, decode keeps serving from B alone
    again = grpc_generate(master.grpc_url, ids=prompts[0][:30], params={"max_tokens": 4, "temperature": 0})
    assert again.error is None and len(again.ids) == 4
