"""A tensor-parallel instance as processes (backends/common/engine/tp_ranks.py): the offline engine with tp=2 is
rank 0 of two, its worker a process of its own that runs every step rank 0 broadcasts; its greedy tokens equal
TP 1's (a dense and a hybrid MoE model, prefix hits that copy state pages included); a killed worker fails the next
step with an error naming it; a rank 0 that dies takes its worker with it; what cannot run split is refused
before any worker starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from backends.common.core.request import SamplingParams
from backends.common.engine.engine import Engine
from backends.common.engine.tp_ranks import RankError, decode_spans, encode_spans
from backends.common.model import loader
from backends.common.model.batch import Span
from backends.common.model.tensor_parallel import TPError

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9] * 4, list(range(30, 47)), [5, 6, 7, 8, 9] * 4 + [11, 12]]  # the third hits the first


def tokens(model: str, tp: int) -> list[list[int]]:
    e = Engine(model, kv_tokens=512, backend="torch", tp=tp)
    try:
        first = [o.output_ids for o in e.generate(PROMPTS[:2], GREEDY)]
        return first + [o.output_ids for o in e.generate(PROMPTS[2:], GREEDY)]  # after the first is cached
    finally:
        e.close()


@pytest.mark.slow  # `make test` only: a worker process per model
@pytest.mark.parametrize("model", ["random:tiny-test", "random:tiny-hybrid"])
def test_two_ranks_give_one_ranks_greedy_tokens(model):
    assert tokens(model, 2) == tokens(model, 1)


def test_the_step_plan_round_trips_without_pickling():
    spans = [Span([1, 2, 3], 0, [10, 11, 12], "a", state_page=4), Span([9], 7, list(range(8)), "b", -1, True, 5)]
    back = decode_spans(encode_spans(spans))
    assert [(s.token_ids, s.start, s.slots, s.state_page, s.logits_all, s.save_page) for s in back] == [
        (s.token_ids, s.start, s.slots, s.state_page, s.logits_all, s.save_page) for s in spans
    ]
    assert encode_spans(spans).dtype.is_floating_point is False


def test_a_killed_rank_fails_the_next_step_naming_it():
    e = Engine("random:tiny-test", kv_tokens=256, backend="torch", tp=2)
    try:
        e.generate([PROMPTS[1]], GREEDY)
        worker = e.runner.ranks.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)
        with pytest.raises(RankError, match=rf"rank 1 of 2 \(pid {worker.pid}\) exited with code -9"):
            e.generate([PROMPTS[0]], GREEDY)
    finally:
        e.close()
    assert worker.poll() is not None and e.runner.ranks is None


def test_a_dead_rank_0_takes_its_worker_with_it(tmp_path):
    script = (
        "import os, sys\n"
        "from backends.common.engine.engine import Engine\n"
        "e = Engine('random:tiny-test', kv_tokens=256, backend='torch', tp=2)\n"
        "print(e.runner.ranks.procs[0].pid, flush=True)\n"
        "os._exit(0)\n"  # no close(): the worker must notice by itself
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[0])
    t0 = time.monotonic()
    while time.monotonic() - t0 < 15:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # exited, not yet reaped by its new parent
                    return
        except OSError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    pytest.fail(f"the worker {pid} outlived its rank 0 by 15 s")


def test_what_cannot_run_split_is_refused_before_any_worker_starts():
    with pytest.raises(TPError, match=r"num_heads \(9\) is not divisible by the 2 ranks"):
        Engine("random:smollm2-135m", kv_tokens=256, backend="torch", tp=2)
    with pytest.raises(loader.ModelError, match="PyTorch path"):
        Engine("random:tiny-test", kv_tokens=256, backend="triton", tp=2)


def greedy_after_handoff(prefill_tp: int, decode_tp: int, name: str) -> tuple[list[int], list[str]]:
    """A prompt computed by a prefill runner split `prefill_tp` ways, its K/V handed to a decode runner split
    `decode_tp` ways through their shared-memory pools' handles (kv_handoff.export_shards), then 8 greedy decode
    steps there; returns the tokens and the /dev/shm files left after both close."""
    from backends.common.engine.runner import ModelRunner
    from backends.common.transfer.kv_handoff import HandoffCache, copy_rows_sharded, export_shards

    prompt = [(7 * j + 3) % 300 for j in range(23)]
    pre = ModelRunner("random:tiny-test", kv_tokens=64, backend="torch", tp=prefill_tp, kv_shm_name=f"{name}-p")
    dec = ModelRunner("random:tiny-test", kv_tokens=96, backend="torch", tp=decode_tp, kv_shm_name=f"{name}-d")
    peers = HandoffCache()
    try:
        src_slots = list(range(3, 3 + len(prompt)))
        first = int(pre.forward([Span(prompt, 0, src_slots, "p")]).argmax(-1)[0])
        dst = peers.open(export_shards(dec.kv_shards(), name))
        slots = list(range(40, 40 + len(prompt)))
        copy_rows_sharded([(s.buffer, lo, hi) for s, lo, hi in pre.kv_shards()], src_slots, dst.shards, slots)
        out = [first]
        for _ in range(8):
            slots.append(40 + len(slots))
            out.append(int(dec.forward([Span([out[-1]], len(slots) - 1, slots, "d")]).argmax(-1)[0]))
    finally:
        peers.close()
        for runner in (pre, dec):
            runner.close()  # the workers' pools
            runner.kv.close(unlink=True)  # rank 0's, which its owner removes (a role's finalize)
    return out, sorted(f for f in os.listdir("/dev/shm") if f.startswith(name))


@pytest.mark.slow  # `make test` only: three worker processes
def test_handoff_between_splits_gives_the_unsplit_tokens():
    """Prefill TP 1 into decode TP 2 and prefill TP 2 into decode TP 1: each KV head's rows go from the rank that
    computed them to the rank that reads them, and the greedy tokens equal TP 1 on both sides; no pool is left in
    /dev/shm."""
    tag = f"tpho{os.getpid()}"
    ref, _ = greedy_after_handoff(1, 1, f"{tag}a")
    for p, d in ((1, 2), (2, 1)):
        got, left = greedy_after_handoff(p, d, f"{tag}{p}{d}")
        assert got == ref, (p, d)
        assert left == [], left


def test_sharded_copy_moves_each_head_to_the_rank_that_holds_it():
    import torch

    from backends.common.transfer.kv_handoff import copy_rows_sharded

    whole = torch.arange(2 * 2 * 6 * 4 * 3, dtype=torch.float32).view(2, 2, 6, 4, 3)  # 4 KV heads
    halves = [torch.zeros(2, 2, 5, 2, 3), torch.zeros(2, 2, 5, 2, 3)]
    copy_rows_sharded([(whole, 0, 4)], [1, 4], [(halves[0], 0, 2), (halves[1], 2, 4)], [3, 0])
    for r, h in enumerate(halves):
        assert torch.equal(h[:, :, 3], whole[:, :, 1, 2 * r : 2 * r + 2])
        assert torch.equal(h[:, :, 0], whole[:, :, 4, 2 * r : 2 * r + 2])
        assert h[:, :, [1, 2, 4]].abs().sum() == 0
    back = torch.zeros_like(whole)
    copy_rows_sharded([(halves[0], 0, 2), (halves[1], 2, 4)], [3, 0], [(back, 0, 4)], [1, 4])
    assert torch.equal(back[:, :, [1, 4]], whole[:, :, [1, 4]])
    with pytest.raises(ValueError, match="other KV heads"):
        copy_rows_sharded([(whole, 0, 4)], [1], [(halves[0], 0, 2)], [0])
