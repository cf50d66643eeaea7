"""A worker rank of a tensor-parallel instance (backends/common/engine/tp_ranks.py): started by rank 0, not by hand.
It joins rank 0's process group, loads its shard (`ModelRunner` with `tp_rank`) and runs every step rank 0
broadcasts until STOP; it exits when rank 0's process is gone."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from datetime import timedelta

import torch

from backends.common.engine.runner import ModelRunner
from backends.common.engine.tp_ranks import FORWARD, STATE_OPS, STOP, decode_spans


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def main(argv: list[str] | None = None) -> int:
    """Join the group, load this rank's shard, then run every step rank 0 broadcasts until STOP."""
    ap = argparse.ArgumentParser(description="a tensor-parallel worker rank (started by rank 0, not by hand)")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--parent", type=int, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-tokens", type=int, required=True)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--state-pages", type=int, default=0)
    ap.add_argument("--quantization", default="")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--kv-shm-name", default=None, help="rank 0's KV pool in shared memory (this rank's: .r<rank>)")
    ap.add_argument("--state-shm-name", default=None, help="the same for the state pages")
    a = ap.parse_args(argv)
    threading.Thread(target=_watch_parent, args=(a.parent,), daemon=True).start()
    import torch.distributed as dist

    if a.threads:
        torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.size,
                            timeout=timedelta(seconds=300))  # fmt: skip
    runner = ModelRunner(a.model, a.dtype, "cpu", a.kv_tokens, backend="torch", max_batch=a.max_batch,
                         state_pages=a.state_pages or None, quantization=a.quantization, tp=a.size,
                         tp_rank=a.rank, kv_shm_name=a.kv_shm_name, state_shm_name=a.state_shm_name)  # fmt: skip
    header = torch.zeros(2, dtype=torch.int64)
    while True:
        dist.broadcast(header, 0)
        op, n = header.tolist()
        plan = torch.zeros(n, dtype=torch.int64)
        if n:
            dist.broadcast(plan, 0)
        if op == FORWARD:
            runner.forward_local(decode_spans(plan))
        elif op == STATE_OPS:
            runner.state.apply([tuple(p) for p in plan.view(-1, 2).tolist()])
        elif op == STOP:
            break
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
