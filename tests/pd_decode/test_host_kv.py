"""Decode's host KV tier (backends.pd_decode.host_tier.HostKV) on the device it serves: on a GPU its copies run on a
copy stream of their own from pinned host memory (the slot indices too), answered by events; without one they are
plain synchronous copies. A round trip through several staging chunks and two jobs in one swap-in is bit exact,
the state page included, and writes nothing else."""

from __future__ import annotations

import torch

from backends.common.model.kv_store import KVStore, StateStore
from backends.pd_decode import host_tier
from backends.pd_decode.scheduler import SwapOut, TransferJob
from tests.pd_decode.test_host_tier import StateCfg as Cfg

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_round_trip_through_chunks_and_jobs_is_exact(monkeypatch):
    monkeypatch.setattr(host_tier, "CHUNK", 7)
    g = torch.Generator().manual_seed(3)
    dev = torch.randn(3, 2, 90, 2, 8, generator=g).to(DEVICE, torch.bfloat16)
    state = StateStore(Cfg(), torch.randn(6, Cfg().state_floats_per_page(), generator=g).to(DEVICE))
    host = host_tier.HostKV(KVStore(dev), 64, state, num_pages=2)
    assert host.cuda == (DEVICE == "cuda")
    src_a, src_b = list(range(40, 63)), [5, 3, 88, 87, 86, 20]
    hs_a, hs_b = [3 + (7 * i) % 53 for i in range(23)], [62, 63, 61, 1, 0, 2]  # wrapped and out-of-order runs
    want_a, want_b, want_page = dev[:, :, src_a].clone(), dev[:, :, src_b].clone(), state.buffer[4].clone()
    host.swap_out([SwapOut("a", 0, src_a, hs_a, state_page=4, host_page=1), SwapOut("b", 0, src_b, hs_b)])
    host.order_compute()  # the compute stream's writes below wait for the swap-outs' reads
    dev.zero_()
    state.buffer.zero_()
    dst_a, dst_b = list(range(89, 66, -1)), [10, 11, 12, 30, 31, 32]
    jobs = [TransferJob("a", 1, [], 0, dst_a, False, "host", hs_a, state_page=0, host_page=1),
            TransferJob("b", 1, [], 0, dst_b, False, "host", hs_b)]  # fmt: skip
    done = host.swap_in(jobs)
    while len(done) < 2:  # on a GPU answered by events, oldest first
        host.wait_first()
        done += host.done()
    assert [j.rid for j in done] == ["a", "b"] and host.in_flight() == 0
    assert torch.equal(dev[:, :, dst_a], want_a) and torch.equal(dev[:, :, dst_b], want_b)
    assert torch.equal(state.buffer[0], want_page) and not state.buffer[1:].any()
    assert not dev[:, :, [s for s in range(90) if s not in dst_a + dst_b]].any()
    host.close()
