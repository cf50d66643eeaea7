"""Cancellation notices from master to every decode instance: one empty file per request id in a per-deployment
directory under /dev/shm. BLS response streams cannot be cancelled from the caller's side in Triton 2.51, and a
cancel sent as a BLS request could land on another decode instance; a shared directory reaches all of them."""

from __future__ import annotations

import os
import re
from pathlib import Path

_SAFE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_DIR = re.compile(r"^triton-pd-[A-Za-z0-9_.-]{1,64}$")  # a deployment's mailbox: /dev/shm/triton-pd-<id>


def prefill_notice(rid: str, epoch: int) -> str:
    """The notice name that tells prefill to drop its job for (rid, epoch); decode posts it when it cancels a
    request whose transfer is in flight, and removes it when that transfer answers."""
    return f"{rid}:{epoch}"


class Mailbox:
    def __init__(self, root: str | Path, create: bool = True):
        self.root = Path(root)
        if create:
            self.root.mkdir(parents=True, exist_ok=True)

    @classmethod
    def named(cls, path: str) -> Mailbox:
        """Another deployment's mailbox on this host, named in a request: only an existing directory called like
        one (triton-pd-<id>) is opened, and never created."""
        root = Path(path)
        if not (root.is_absolute() and _DIR.match(root.name) and root.is_dir()):
            raise ValueError(f"not a triton-pd mailbox: {path!r}")
        return cls(root, create=False)

    def post(self, rid: str, reason: str = "cancelled") -> None:
        if not _SAFE.match(rid):
            raise ValueError(f"unsafe request id {rid!r}")
        tmp = self.root / f".{rid}.tmp"
        tmp.write_text(reason)
        os.replace(tmp, self.root / rid)

    def take(self, known: set[str] | dict) -> list[tuple[str, str]]:
        """Notices for request ids in `known`: read and removed. Others are left for their owner."""
        out = []
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return out
        for name in names:
            if name in known:
                path = self.root / name
                try:
                    reason = path.read_text() or "cancelled"
                    path.unlink()
                except FileNotFoundError:
                    continue
                out.append((name, reason))
        return out

    def discard(self, rid: str) -> None:
        try:
            (self.root / rid).unlink()
        except FileNotFoundError:
            pass
