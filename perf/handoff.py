"""The KV hand-off from prefill to decode: bandwidth between processes on one GPU (CUDA IPC) against a plain
device copy, and over the network transport (torch.distributed) against bare gloo/NCCL, in one run each."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.tools import dispatch  # noqa: E402

TABLE = {
    "ipc": ("handoff_bw", "KV rows written into another process's pool through CUDA IPC vs a device copy"),
    "net": ("handoff_net", "the dist transport's transfers vs bare torch.distributed send/recv"),
}

if __name__ == "__main__":
    sys.exit(dispatch("perf/handoff.py", __doc__, TABLE))
