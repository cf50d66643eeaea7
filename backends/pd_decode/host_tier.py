"""Decode's host-memory KV tier: the bytes behind the scheduler's host slots, and the copies between them and the
device pool. The scheduler decides what moves (`SwapOut`, swap-in `TransferJob`s); this module moves it.

Layout: host slot h holds one token's K/V for every layer, [num_slots, layers, 2, kv_heads, head_dim], so a run of
consecutive host slots is one contiguous block and one DMA. Hybrid models: host state page p holds one state page
(the device StateStore's row layout), copied whole with the K/V of the same swap.
On a GPU the buffers are pinned and every copy runs on one copy stream of its own, in order (FIFO), so:
- a swap-in that reads host slots runs after the swap-out that wrote them;
- host slots freed by a cancel and reused by a later swap-out are written after every earlier read;
- the compute stream waits for the swap-outs enqueued so far (`order_compute`) before its next decode step, and
  `wait_swap_outs` runs before prefill is handed slots, so a paused request's device slots can be reused in the same
  plan that copied them out.
On the CPU the copies are plain and synchronous.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from backends.common.core.config import ModelConfig
from backends.common.core.state_pages import ZERO
from backends.common.model.kv_store import KVStore, StateStore, gather_heads, scatter_heads

from .scheduler import RecoveryCosts, SwapOut, TransferJob

CHUNK = 2048  # tokens per gather/scatter staging tensor on the device (bounds its size: ~256 MB for Llama-8B)


def by_host_slot(device_slots, host_slots) -> tuple[np.ndarray, np.ndarray]:
    """The pairs sorted by host slot (int64 arrays), so that host slots form the longest runs (one DMA each): the
    host pool hands out slots in any order once it has been freed into. Vectorised: a swap-in of a long stream
    sorts thousands of pairs while the GPU may be waiting for it."""
    h = np.asarray(host_slots, dtype=np.int64)
    order = np.argsort(h, kind="stable")
    return np.asarray(device_slots, dtype=np.int64)[order], h[order]


def runs(slots) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive slots as (offset in the list, first slot, length)."""
    s = np.asarray(slots, dtype=np.int64)
    if s.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(s) != 1) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [s.size]))
    return [(int(a), int(s[a]), int(b - a)) for a, b in zip(starts, ends)]


def _resident(shape, dtype, pinned: bool) -> torch.Tensor:
    """Host memory whose pages are all resident: pinned (a GPU's copies need it, and pinning faults every page
    in), or written with zeros on the CPU (an untouched allocation is mapped lazily)."""
    if pinned:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    return torch.zeros(shape, dtype=dtype)


class HostKV:
    def __init__(self, store: KVStore, num_slots: int, state: StateStore | None = None, num_pages: int = 0,
                 shards: list[tuple[KVStore, int, int]] | None = None):  # fmt: skip
        """store: the decode pool, whose buffer is [layers, 2, slots, kv_heads, head_dim]; state (hybrid models):
        the device state pages, of which num_pages are mirrored in host memory. shards (a tensor-parallel
        instance on the CPU, `ModelRunner.kv_shards`): every rank's pool and its KV heads; a host slot then holds
        every head, each copied from and back to the rank that holds it."""
        self.dev = store.buffer
        layers, two, _, _, dim = self.dev.shape
        self.shards = [(s.buffer, lo, hi) for s, lo, hi in shards or [(store, 0, store.num_kv_heads)]]
        if len(self.shards) > 1 and (self.dev.is_cuda or state is not None):
            raise ValueError("the host tier of a tensor-parallel instance: the CPU path and dense models only")
        heads = self.shards[-1][2]
        self.cuda = self.dev.is_cuda
        # Resident from the start: pinned memory is, and on the CPU the buffer is written once here, so that the
        # process takes its host tier when it starts, not page by page as slots are first used (which read as a
        # leak over hours: +200 MB of RSS in a 30-minute CPU soak, perf/results/soak_cpu).
        self.buffer = _resident((num_slots, layers, two, heads, dim), self.dev.dtype, self.cuda)
        self.bytes_per_slot = store.bytes_per_slot * len(self.shards)
        self.dev_state = state.buffer if state is not None else None
        self.state = (
            _resident((num_pages, state.buffer.shape[1]), torch.float32, self.cuda) if state is not None else None
        )
        self.stream = torch.cuda.Stream(self.dev.device) if self.cuda else None
        self._last_out = None  # event after the latest swap-out
        self._pending: list[tuple[object, TransferJob, float]] = []  # (event, job, start) of swap-ins not answered
        self.durations: list[float] = []  # seconds from start to seen done of finished swap-ins, taken by decode

    @property
    def nbytes(self) -> int:
        extra = self.state.numel() * 4 if self.state is not None else 0
        return self.buffer.numel() * self.buffer.element_size() + extra

    # ---- copies --------------------------------------------------------------------------------------------
    def swap_out(self, jobs: list[SwapOut]) -> None:
        if not jobs:
            return
        if not self.cuda:
            for job in jobs:
                self._copy_out(job)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.dev.device))  # the last step's K/V is written
        with torch.cuda.stream(self.stream):
            for job in jobs:
                self._copy_out(job)
            self._last_out = torch.cuda.Event()
            self._last_out.record(self.stream)

    def _copy_out(self, job: SwapOut) -> None:
        if job.host_page != ZERO:  # the state at the end of the positions copied
            self.state[job.host_page].copy_(self.dev_state[job.state_page], non_blocking=self.cuda)
        device_slots, host_slots = by_host_slot(job.device_slots, job.host_slots)
        for c in range(0, len(device_slots), CHUNK):
            d, h = device_slots[c : c + CHUNK], host_slots[c : c + CHUNK]
            rows = gather_heads(self.shards, self._index(d)).permute(2, 0, 1, 3, 4)  # [n, layers, 2, heads, dim]
            rows = rows.contiguous()
            for off, first, n in runs(h):
                self.buffer[first : first + n].copy_(rows[off : off + n], non_blocking=self.cuda)

    def _index(self, slots: np.ndarray) -> torch.Tensor:
        """Device slot numbers for index_select / index_copy_, on a GPU through pinned memory, so that the copy is
        asynchronous: from pageable memory CUDA stages it through a bounce buffer, and whether the host then waits
        for the copy stream (behind earlier chunks' DMA and the step the copies were ordered after) is up to the
        driver. PyTorch's pinned-memory cache keeps the block until the copy has read it."""
        t = torch.from_numpy(slots)
        return t.pin_memory().to(self.dev.device, non_blocking=True) if self.cuda else t

    def swap_in(self, jobs: list[TransferJob]) -> list[TransferJob]:
        """Start the copies; returns the jobs already done (all of them on the CPU)."""
        if not self.cuda:
            for job in jobs:
                self._copy_in(job)
            return list(jobs)
        if not jobs:
            return []
        self.stream.wait_stream(torch.cuda.current_stream(self.dev.device))
        with torch.cuda.stream(self.stream):
            for job in jobs:
                t0 = time.monotonic()
                self._copy_in(job)
                ev = torch.cuda.Event()
                ev.record(self.stream)
                self._pending.append((ev, job, t0))
        return []

    def _copy_in(self, job: TransferJob) -> None:
        if job.host_page != ZERO:
            self.dev_state[job.state_page].copy_(self.state[job.host_page], non_blocking=self.cuda)
        device_slots, host_slots = by_host_slot(job.dst_slots, job.host_slots)
        for c in range(0, len(device_slots), CHUNK):
            d, h = device_slots[c : c + CHUNK], host_slots[c : c + CHUNK]
            rows = torch.empty(
                (len(h),) + tuple(self.buffer.shape[1:]), dtype=self.buffer.dtype, device=self.dev.device
            )
            for off, first, n in runs(h):
                rows[off : off + n].copy_(self.buffer[first : first + n], non_blocking=self.cuda)
            scatter_heads(self.shards, self._index(d), rows.permute(1, 2, 0, 3, 4))

    def done(self) -> list[TransferJob]:
        """Swap-ins whose copies have finished, in the order they were started."""
        out = []
        while self._pending and self._pending[0][0].query():
            _, job, t0 = self._pending.pop(0)
            out.append(job)
            self.durations.append(time.monotonic() - t0)
        return out

    def wait_first(self) -> None:
        """Block until the oldest swap-in in flight has finished copying (decode has nothing else to run)."""
        if self._pending:
            self._pending[0][0].synchronize()

    def in_flight(self) -> int:
        return len(self._pending)

    # ---- ordering ------------------------------------------------------------------------------------------
    def order_compute(self) -> None:
        """The compute stream's next work waits for every swap-out enqueued so far (not for swap-ins)."""
        if self._last_out is not None:
            torch.cuda.current_stream(self.dev.device).wait_event(self._last_out)

    def wait_swap_outs(self) -> None:
        """Block until every swap-out has read its slots: prefill writes through its own stream and process."""
        if self._last_out is not None:
            self._last_out.synchronize()
            self._last_out = None

    def close(self) -> None:
        if self.cuda:
            self.stream.synchronize()
        self._pending.clear()
        self.buffer = self.state = None


def default_costs(cfg: ModelConfig, bytes_per_slot: int, cuda: bool, state_bytes: int = 0) -> RecoveryCosts:
    """Rough seconds per recovered token by path: a host copy moves bytes_per_slot over PCIe (~25 GB/s sustained
    with pinned memory; ~5 GB/s for a CPU memcpy in the stub), plus one state page (state_bytes) for a hybrid model,
    a prefill recompute costs ~2 FLOPs per weight per token (~300 TFLOP/s achieved in bf16 on an H100/H200 class
    GPU; ~50 GFLOP/s on a few CPU cores) plus a BLS round trip. Only their ratio matters: the host path wins unless
    the link is far slower than the model is small."""
    h, layers = cfg.hidden_size, cfg.num_layers
    attn = h * cfg.num_heads * cfg.head_dim * 2 + h * cfg.num_kv_heads * cfg.head_dim * 2
    weights = layers * (attn + 3 * h * cfg.intermediate_size) + cfg.vocab_size * h
    if cuda:
        return RecoveryCosts(bytes_per_slot / 25e9, 5e-3, 2 * weights / 300e12, state_bytes / 25e9)
    return RecoveryCosts(bytes_per_slot / 5e9, 20e-3, 2 * weights / 50e9, state_bytes / 5e9)
