"""The ranks of a tensor-parallel instance as processes (the split itself: backends/common/model/tensor_parallel.py).

The process that serves (the offline engine, a role's Triton stub) is rank 0: it starts ranks 1..N-1 as workers
of `python -m backends.common.engine.tp_worker`, each loading the same checkpoint and keeping its own
shard, K/V heads and state pages, and before each step it broadcasts the step's plan (`FORWARD` with the spans, or
`STATE_OPS` with the state-page copies): one broadcast of a header and one of the plan's integers, so that every
rank runs the same forward on the same batch and the model's all-reduces meet. Nothing in the plan is pickled: it
is a flat int64 tensor (`encode_spans`).

A worker that dies fails rank 0's next step with `RankError` naming the rank, its pid and exit code (before the
step when the death is already visible, else when the step's collective fails or times out); a rank 0 that dies
takes its workers with it (each watches its parent, and its next broadcast fails). `Ranks.close` stops them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch

from backends.common.model.batch import Span

FORWARD, STATE_OPS, STOP = 1, 2, 3
SPAN_HEADER = 6  # per span: tokens, start, slots, state page, logits_all, save page; then its ids and slots


class RankError(RuntimeError):
    """A tensor-parallel rank died or stopped answering; the message names it."""


def encode_spans(spans: list[Span]) -> torch.Tensor:
    """A step's spans as one int64 tensor: their count, then each span's header and its token ids and slots."""
    out = [len(spans)]
    for s in spans:
        if s.mm is not None:
            raise ValueError("tp: requests with images are not supported with tensor parallelism yet")
        out += [len(s.token_ids), s.start, len(s.slots), s.state_page, int(s.logits_all), s.save_page]
        out += list(s.token_ids) + list(s.slots)
    return torch.tensor(out, dtype=torch.int64)


def decode_spans(t: torch.Tensor) -> list[Span]:
    v = t.tolist()
    spans, i = [], 1
    for k in range(v[0]):
        n, start, m, page, every, save = v[i : i + SPAN_HEADER]
        i += SPAN_HEADER
        ids, slots = v[i : i + n], v[i + n : i + n + m]
        i += n + m
        spans.append(Span(ids, start, slots, key=k, state_page=page, logits_all=bool(every), save_page=save))
    return spans


def python_executable() -> str:
    """The Python to start workers with: this one's, or inside Triton's Python backend stub (whose executable is
    the stub) the first python3 on PATH, which is the environment the stub takes its packages from."""
    import shutil

    if os.path.basename(sys.executable or "").startswith("python"):
        return sys.executable
    found = shutil.which("python3")
    if found is None:
        raise RankError("tp: no python3 on PATH to start the worker ranks with")
    return found


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """Rank 0's side: the workers it started and the process group they share (torch.distributed's default one,
    gloo: one tensor-parallel instance per process)."""

    def __init__(self, size: int, worker_args: list[str], timeout_s: float = 300.0, shm_names: list[str] = ()):
        """Start ranks 1..size-1 (`worker_args`: the runner's options, see tp_worker) and join the group with them;
        a worker that exits before the group forms fails this with RankError. shm_names: rank 0's shared-memory
        pools, whose workers' counterparts (`kv_store.shard_name`) `kill` removes, whatever became of them."""
        import torch.distributed as dist

        self.size = size
        self.shm_names = list(shm_names)
        port = free_port()
        self.procs: list[subprocess.Popen] = []
        cmd = [python_executable(), "-m", "backends.common.engine.tp_worker", "--size", str(size), "--port", str(port),
               "--parent", str(os.getpid()), *worker_args]  # fmt: skip
        for rank in range(1, size):
            self.procs.append(subprocess.Popen([*cmd, "--rank", str(rank)]))
        failed: list[BaseException] = []

        def join() -> None:
            try:
                dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=size,
                                        timeout=timedelta(seconds=timeout_s))  # fmt: skip
            except BaseException as e:  # noqa: BLE001 (handed to the caller)
                failed.append(e)

        joiner = threading.Thread(target=join, daemon=True)
        joiner.start()
        while joiner.is_alive():  # the group forms once every worker joins: a worker that dies first ends the wait
            joiner.join(0.2)
            if joiner.is_alive() and self._dead() is not None:
                self.kill()
                raise RankError(self._dead())
        if failed:
            self.kill()
            raise RankError(f"tp: the {size} ranks did not form a group: {failed[0]}") from failed[0]

    def _dead(self) -> str | None:
        for rank, p in enumerate(self.procs, 1):
            rc = p.poll()
            if rc is not None:
                return f"tensor-parallel rank {rank} of {self.size} (pid {p.pid}) exited with code {rc}"
        return None

    def check(self) -> None:
        """RankError naming the first worker that has exited."""
        dead = self._dead()
        if dead is not None:
            raise RankError(dead)

    def send(self, op: int, plan: torch.Tensor | None = None) -> None:
        """Broadcast a step's op and plan to every worker."""
        import torch.distributed as dist

        self.check()
        plan = plan if plan is not None else torch.zeros(0, dtype=torch.int64)
        try:
            dist.broadcast(torch.tensor([op, plan.numel()], dtype=torch.int64), 0)
            if plan.numel():
                dist.broadcast(plan, 0)
        except RuntimeError as e:
            raise self.error(e) from e

    def error(self, e: BaseException) -> RankError:
        """A failed collective as RankError: naming the dead worker if there is one (it may take a moment to be
        reaped), else the collective's own message."""
        for _ in range(20):
            dead = self._dead()
            if dead is not None:
                return RankError(dead)
            time.sleep(0.05)
        return RankError(f"tensor-parallel step failed on rank 0 of {self.size}: {e}")

    def close(self) -> None:
        """Stop the workers (a STOP broadcast, then a kill for any still running after 10 s) and leave the group."""
        import torch.distributed as dist

        if not self.procs:
            return
        try:
            self.send(STOP)
        except RankError:  # one is gone already: the rest are killed below
            pass
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        if dist.is_initialized():
            dist.destroy_process_group()

    def kill(self) -> None:
        from backends.common.model.kv_store import SHM_DIR, shard_name

        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for name in self.shm_names:
            for rank in range(1, self.size):
                try:
                    os.unlink(os.path.join(SHM_DIR, shard_name(name, rank)))
                except FileNotFoundError:
                    pass
        self.procs = []
