"""What decode's scheduler hands its executor and gets back: the plan of one iteration (`Plan`: decode rows,
prefill transfers, host copies), a transfer job, a host copy, the recovery cost model and a transfer's completion.
Plain dataclasses over integers (`backends/pd_decode/scheduler.py` says what each means for a request)."""

from __future__ import annotations

from dataclasses import dataclass, field

from backends.common.core.request import InferReq
from backends.common.core.state_pages import ZERO

PAUSED_PRIORITY = 1  # radix eviction priority of a paused request's KV (finished requests' KV has 0)


@dataclass(slots=True)
class TransferJob:
    """Ask prefill to compute K/V for ids[start:end] (end = len(ids)) and write them into dst_slots."""

    rid: str
    epoch: int
    ids: list[int]
    start: int
    dst_slots: list[int]
    sample: bool  # epoch 0: also sample the first output token; recovery: discard the sample
    # "prefill": prefill computes the positions; "host": copied from host_slots; "recompute": decode computes them
    # itself from its own cache's last state checkpoint (hybrid models, a short trimmed tail)
    source: str = "prefill"
    host_slots: list[int] = field(default_factory=list)  # source "host": host slots of positions [start, end)
    state_page: int = ZERO  # hybrid models: the request's page, into which prefill writes the state at `end`
    host_page: int = ZERO  # hybrid models, source "host": the host state page holding the state at `end`
    # source "host": positions copied back ahead of a paused request's turn; it stays paused and the positions go
    # to the cache when the copy answers (see the module doc)
    prefetch: bool = False

    @property
    def num_positions(self) -> int:
        return len(self.ids) - self.start


@dataclass(slots=True)
class SwapOut:
    """Copy device_slots (positions [start, start + n) of request rid) into host_slots."""

    rid: str
    start: int
    device_slots: list[int]
    host_slots: list[int]
    state_page: int = ZERO  # hybrid models: the live page (the state at start + n) to copy into host_page
    host_page: int = ZERO


@dataclass(slots=True)
class HostCopy:
    """A request's KV in host memory: slots[i] is the host slot of position i; hybrid models: page, the host state
    page, holding the state at position page_at."""

    slots: list[int]
    used_at: float
    page: int = ZERO
    end: int = 0  # host slots [slots[0], end) are meant for its growth (other copies start past them)
    # hybrid models: the position whose state `page` holds (-1: none yet); behind len(slots) while the request's
    # own page waits on the device (`DecodeScheduler.park_state`), the page copied out only when it is taken
    page_at: int = -1


@dataclass(slots=True)
class RecoveryCosts:
    """Estimated seconds to bring back n missing positions by each path; recovery takes the cheapest. The decode
    model derives them from the KV bytes per token and the model size; tests set them directly."""

    host_per_token: float = 1e-6
    prefill_fixed: float = 5e-3
    prefill_per_token: float = 2e-5
    host_fixed: float = 0.0  # hybrid models: one state page's copy

    def host(self, n: int) -> float:
        return self.host_fixed + n * self.host_per_token

    def prefill(self, n: int) -> float:
        return self.prefill_fixed + n * self.prefill_per_token


@dataclass(slots=True)
class Plan:
    """What the executor does, in this order: swap_outs (reading device slots before anything else writes them:
    a decode step waits for them, prefill transfers start after they are done), swap_ins (on the same copy stream,
    after the swap-outs), transfers, then the decode step."""

    decode: list[InferReq] = field(default_factory=list)  # run one decode step; slots[-1] is reserved for it
    transfers: list[TransferJob] = field(default_factory=list)  # prefill computes K/V into decode's slots
    swap_outs: list[SwapOut] = field(default_factory=list)
    swap_ins: list[TransferJob] = field(default_factory=list)  # source "host"; answered by on_transfer_done
    recomputes: list[TransferJob] = field(default_factory=list)  # source "recompute": run by decode, then answered
    paused: list[InferReq] = field(default_factory=list)
    restarted: list[InferReq] = field(default_factory=list)  # on_oom="restart": segments ended
    resumed_local: list[InferReq] = field(default_factory=list)
    ended: list[InferReq] = field(default_factory=list)  # finished by the scheduler ("length": pool capacity)
    failed: list[InferReq] = field(default_factory=list)  # finished with req.error: it can never fit
    rotated: list[InferReq] = field(default_factory=list)  # of `paused`, those paused to give another its turn


@dataclass(slots=True)
class Completion:
    """What the caller must do after a transfer answered."""

    req: InferReq | None
    first_token: int | None = None  # epoch-0 transfer: the sampled first token (already appended)
    failed: str | None = None
    stale: bool = False
    recovered: bool = False
    path: str | None = None  # recovered: "prefill" or "host"
