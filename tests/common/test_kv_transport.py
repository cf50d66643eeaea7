"""The KV transport interface on the CPU: the network implementation (torch.distributed over gloo, as a loopback
between this process and prefill-side processes) and the same-host one, through the same calls decode and
prefill make. Rows land only in the attempt they were sent for; stale, cancelled and superseded transfers are
dropped and counted; a lost peer is replaced by a new one."""

from __future__ import annotations

import json
import multiprocessing as mp
import time

import pytest
import torch

from backends.common.model.kv_store import KVStore
from backends.common.transfer.kv_transport import DistSink, IpcSink, KVSource, check_kind
from backends.common.transfer.mailbox import Mailbox

LAYERS, HEADS, DIM = 2, 2, 4


def _src_pool(seed: int = 0, dtype=torch.float32) -> KVStore:
    g = torch.Generator().manual_seed(seed)
    store = KVStore.allocate(LAYERS, 32, HEADS, DIM, dtype, "cpu")
    store.buffer.copy_(torch.randn(store.buffer.shape, generator=g).to(dtype))
    return store


def _prefill(jobs: list[dict], done, hold: float = 0.0, dtype: str = "float32") -> None:
    """A prefill-side process: sends each job's rows (src_slots of its seeded pool) with KVSource."""
    dt = getattr(torch, dtype)
    src = _src_pool(dtype=dt)
    source = KVSource("test-prefill")
    for job in jobs:
        state_row = torch.arange(job["state_floats"], dtype=torch.float32) + 0.5 if job["state_floats"] else None
        pool = src.buffer
        if job.get("split"):  # a tensor-parallel prefill: each rank's pool holds one KV head
            pool = [(src.buffer[:, :, :, h : h + 1].contiguous(), h, h + 1) for h in range(HEADS)]
        source.send(job["rid"], job["epoch"], job["handle"], pool, job["src"], job["dst"],
                    job["handle"] if state_row is not None else "", state_row, job.get("page", -1))  # fmt: skip
    done.set()
    time.sleep(hold)  # stays connected (a test kills it here)
    source.close()


def _spawn(jobs, hold=0.0, dtype="float32"):
    ctx = mp.get_context("spawn")
    done = ctx.Event()
    p = ctx.Process(target=_prefill, args=(jobs, done, hold, dtype), daemon=True)
    p.start()
    return p, done


def _wait_counts(sink, key, n, timeout=20.0):
    t0 = time.monotonic()
    while sink.counts[key] < n and time.monotonic() - t0 < timeout:
        time.sleep(0.01)
    return sink.counts[key]


def _poll(fn, want, timeout=10.0):
    """fn() once it returns `want`, or its last value after `timeout` seconds."""
    t0 = time.monotonic()
    while (got := fn()) != want and time.monotonic() - t0 < timeout:
        time.sleep(0.01)
    return got


@pytest.fixture
def sink():
    dst = KVStore.allocate(LAYERS, 16, HEADS, DIM, torch.float32, "cpu")
    s = DistSink(dst, None, "decode-test", "gloo", "127.0.0.1", log=lambda m: None)
    yield s
    s.close()


def _job(exp, src, epoch=None, rid=None):
    return {"rid": rid or exp.rid, "epoch": exp.epoch if epoch is None else epoch, "handle": exp.kv_handle,
            "src": src, "dst": exp.dst_slots, "state_floats": 0}  # fmt: skip


def test_rows_land_in_the_reserved_slots(sink):
    exp = sink.expect("r1", 0, [9, 3, 5], -1)
    p, _ = _spawn([_job(exp, [0, 1, 2])])
    assert sink.landed(exp, 30)
    src = _src_pool()
    for d, s in zip([9, 3, 5], [0, 1, 2]):
        assert torch.equal(sink.kv.buffer[:, :, d], src.buffer[:, :, s])
    assert sink.kv.buffer[:, :, [0, 1, 2, 4]].abs().sum() == 0  # nothing else was written
    sink.forget(exp)
    assert sink.counts["landed"] == 1 and sink.counts["bytes"] == 3 * LAYERS * 2 * HEADS * DIM * 4
    p.join(30)
    assert p.exitcode == 0
    # prefill closed its side on the way out: decode's receiver for it ended instead of waiting forever
    assert _poll(sink.live_peers, 0) == 0


def test_rows_from_a_split_source_land_in_each_rank_of_a_split_pool():
    """Tensor parallelism on both ends of the network transport: prefill's ranks' rows travel with every KV head
    and each head lands in the decode rank that holds it."""
    halves = [KVStore.allocate(LAYERS, 16, 1, DIM, torch.float32, "cpu") for _ in range(HEADS)]
    s = DistSink([(h, i, i + 1) for i, h in enumerate(halves)], None, "decode-split", "gloo", "127.0.0.1",
                 log=lambda m: None)  # fmt: skip
    try:
        exp = s.expect("r9", 0, [9, 3, 5], -1)
        p, _ = _spawn([{**_job(exp, [0, 1, 2]), "split": True}])
        assert s.landed(exp, 30)
        src = _src_pool()
        for i, half in enumerate(halves):
            assert torch.equal(half.buffer[:, :, [9, 3, 5]], src.buffer[:, :, [0, 1, 2], i : i + 1])
            assert half.buffer[:, :, [0, 1, 2, 4]].abs().sum() == 0
        s.forget(exp)
        p.join(30)
        assert p.exitcode == 0
    finally:
        s.close()


def test_stale_epoch_superseded_attempt_and_cancelled_transfer_are_dropped(sink):
    exp = sink.expect("r2", 3, [0, 1], -1)
    old = sink.retry(exp)  # the first attempt's ticket is no longer the transfer's
    assert old.ticket != exp.ticket
    cancelled = sink.expect("r3", 0, [4, 5], -1)
    sink.forget(cancelled)  # cancelled while in flight: decode gave the slots back
    jobs = [
        _job(old, [0, 1], epoch=2),  # a stale epoch of r2
        _job(exp, [0, 1]),  # the superseded attempt (exp's ticket, replaced by retry)
        _job(cancelled, [2, 3]),  # nobody expects r3 any more
        _job(old, [4, 5]),  # the current attempt
    ]
    p, done = _spawn(jobs)
    assert sink.landed(old, 30)
    assert _wait_counts(sink, "stale", 2) == 2 and sink.counts["unexpected"] == 1
    src = _src_pool()
    assert torch.equal(sink.kv.buffer[:, :, [0, 1]], src.buffer[:, :, [4, 5]])
    assert sink.kv.buffer[:, :, 2:].abs().sum() == 0  # the cancelled rows went nowhere
    p.join(30)


def test_state_page_travels_with_the_rows():
    dst = KVStore.allocate(LAYERS, 8, HEADS, DIM, torch.bfloat16, "cpu")

    class State:  # the one thing DistSink reads of a StateStore
        buffer = torch.zeros(3, 6)

    s = DistSink(dst, State(), "decode-state", "gloo", "127.0.0.1", log=lambda m: None)
    try:
        exp = s.expect("h1", 1, [2, 7], 1)
        assert exp.state_handle == exp.kv_handle and json.loads(exp.kv_handle)["state_floats"] == 6
        p, _ = _spawn([{**_job(exp, [5, 6]), "state_floats": 6, "page": 1}], dtype="bfloat16")
        assert s.landed(exp, 30)
        assert torch.equal(dst.buffer[:, :, [2, 7]], _src_pool(dtype=torch.bfloat16).buffer[:, :, [5, 6]])
        assert torch.equal(State.buffer[1], torch.arange(6, dtype=torch.float32) + 0.5)
        assert State.buffer[[0, 2]].abs().sum() == 0
        p.join(30)
    finally:
        s.close()


@pytest.mark.slow  # `make test` only: too long for `make test-fast`
def test_a_lost_peer_is_replaced_and_cancel_notices_reach_prefill(sink):
    first = sink.expect("a", 0, [0], -1)
    p1, done1 = _spawn([_job(first, [0])], hold=60)
    assert sink.landed(first, 30) and done1.wait(30)
    p1.kill()  # prefill dies while connected
    p1.join(10)
    second = sink.expect("b", 0, [1], -1)
    p2, _ = _spawn([_job(second, [1])])
    assert sink.landed(second, 30)  # a new peer joins; decode's receiver survived the old one's loss
    p2.join(30)
    # cancel notices travel through the rendezvous store to the prefill that holds the job
    source = KVSource("cancel-reader")
    try:
        handles = {"c:0": sink.expect("c", 0, [2], -1).kv_handle, "d:0": sink.expect("d", 0, [3], -1).kv_handle}
        assert source.cancelled(handles) == {}  # not connected yet: a poll never waits for a connection
        source.prepare(handles["c:0"])  # what prefill does as a job arrives
        assert source.cancelled(handles) == {}
        sink.post_cancel("c:0", "timeout")
        # a store set is not acknowledged, so another client sees it a moment later: prefill polls between steps
        assert _poll(lambda: source.cancelled(handles), {"c:0": "timeout"}) == {"c:0": "timeout"}
        sink.discard_cancel("c:0")
        assert _poll(lambda: source.cancelled(handles), {}) == {}
    finally:
        source.close()


def test_ipc_transport_through_the_same_interface(tmp_path):
    dst = KVStore.allocate(LAYERS, 8, HEADS, DIM, torch.float32, "cpu", shm_name=f"tpd_test_{time.time_ns()}")
    try:
        mailbox = Mailbox(tmp_path / "triton-pd-ipctest")
        s = IpcSink(dst, None, "ipc-test", mailbox)
        s.post_cancel("r:0", "timeout")  # on this host, cancel notices go through the mailbox prefill reads
        assert mailbox.take({"r:0"}) == [("r:0", "timeout")]
        s.post_cancel("r:1", "cancelled")
        s.discard_cancel("r:1")
        assert mailbox.take({"r:1"}) == []
        exp = s.expect("r", 0, [6, 1], -1)
        assert json.loads(exp.kv_handle)["kind"] == "shm" and exp.state_handle == ""
        src = _src_pool()
        source = KVSource("ipc-prefill")
        # a prefill server of another deployment reads decode's mailbox through the handle: once, then it is gone
        other = s.expect("o", 2, [0], -1).kv_handle
        s.post_cancel("o:2", "deadline")
        assert source.cancelled({"o:2": other, "r:0": exp.kv_handle}) == {"o:2": "deadline"}
        assert source.cancelled({"o:2": other}) == {}
        # a handle naming something that is not a mailbox is never read, listed or created
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "elsewhere" / "o:2").write_text("x")
        for path in (tmp_path / "elsewhere", tmp_path / "triton-pd-missing", "triton-pd-relative"):
            forged = json.dumps({**json.loads(other), "mailbox": str(path)})
            assert source.cancelled({"o:2": forged}) == {}
        assert (tmp_path / "elsewhere" / "o:2").exists() and not (tmp_path / "triton-pd-missing").exists()
        source.send("r", 0, exp.kv_handle, src.buffer, [3, 4], exp.dst_slots)
        assert s.landed(exp, 0)
        assert torch.equal(dst.buffer[:, :, [6, 1]], src.buffer[:, :, [3, 4]])
        with pytest.raises(ValueError, match="2 rows into 1 slots"):
            source.send("r", 0, exp.kv_handle, src.buffer, [3, 4], [0])
        source.close()
    finally:
        dst.close(unlink=True)


def test_transport_choice_is_checked():
    assert check_kind("dist") == "dist"
    with pytest.raises(ValueError, match="kv_transport"):
        check_kind("rdma")
