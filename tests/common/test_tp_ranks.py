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
