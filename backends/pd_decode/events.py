"""What reaches decode's scheduler loop from other threads (its only inputs: `Event`), and where its prefill jobs
go (`PrefillClient`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from backends.common.core.request import InferReq
from backends.common.serving.wire import PrefillRequest


class PrefillClient(Protocol):
    """Where decode's prefill jobs go."""

    def order(self) -> list:
        """The servers to try for the next job, first choice first ([None]: this server's prefill model)."""

    def ask(self, server, msg: PrefillRequest) -> tuple[Callable | None, str | None]:
        """(output getter, None) or (None, error message); raises remote.Unreachable for a server not there."""

    def close(self) -> None: ...


# ---- events for the scheduler loop (its only inputs from other threads) ------------------------------------------
@dataclass(slots=True)
class Arrival:
    """A new request from master, with the sender of its decoupled stream."""

    req: InferReq
    sender: object


@dataclass(slots=True)
class TransferDone:
    """A transfer job answered: a prefill BLS call or a host swap-in, for (rid, epoch)."""

    rid: str
    epoch: int
    ok: bool
    first_token: int | None = None
    error: str | None = None


class Wake:
    """Nothing to handle: wakes the loop (at shutdown)."""


Event = Arrival | TransferDone | Wake
