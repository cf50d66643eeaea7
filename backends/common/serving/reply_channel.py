"""Decode's answers to master over a Unix socket, beside the BLS stream that carries the request.

Why not on the BLS stream itself: Triton 2.51's Python stub deadlocks when a decoupled BLS response iterator gets a
second response while master opens another stream. Three threads of master's stub close a cycle:
- a relay opening a stream holds the GIL in `exec(decoupled=True)` and waits for the stub's iterator-map mutex;
- the stub's parent-message thread holds that mutex while queueing a response into an iterator, and waits for the
  iterator's own mutex;
- the reader of that iterator, woken by the previous response, holds the iterator's mutex in `Next()` and waits for
  the GIL (`ResponseIterator::Next` re-takes the GIL before it lets go of the mutex).
Seen as a hung `tests/server/test_churn.py` (16 clients opening 3-7-token streams back to back): master's relays
stuck in `exec` and `Next`, decode's sender stuck in `send()`, nothing moving. An iterator that is queued at most one
response after its first cannot close the cycle: its reader wakes once, at the stream's end, and nothing is queued
into that iterator again. So with a reply channel decode answers the BLS stream twice only: an empty response when
it accepts the request (the one `exec` itself returns) and the final flag at the end. Tokens, finish reasons and
errors go through the socket, several streams' parts in one frame when they are pending at once.

Frames are a 4-byte little-endian length and a JSON object (nothing is pickled). The first frame of a connection
is `{"key": <the deployment's internal key>}`; master closes a connection whose key does not match. Then each frame
is `{"r": [[request_id, output_ids, finish_reason, error, error_code, num_pauses], ...]}`. The socket lives in the
deployment's mailbox directory (mode 0600), and decode connects only to a socket there."""

from __future__ import annotations

import hmac
import json
import os
import queue
import re
import socket
import struct
import sys
import threading
from pathlib import Path

from backends.common.serving.wire import DecodeResponse

_LEN = struct.Struct("<I")
MAX_FRAME = 64 << 20
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}\.sock$")


def _frame(obj) -> bytes:
    data = json.dumps(obj, separators=(",", ":")).encode()
    return _LEN.pack(len(data)) + data


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _read_frame(conn: socket.socket):
    head = _recv_exact(conn, _LEN.size)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes")
    body = _recv_exact(conn, n)
    if body is None:
        return None
    return json.loads(body)


def record(rid: str, r: DecodeResponse) -> list:
    return [rid, list(r.output_ids), r.finish_reason, r.error, r.error_code, r.num_pauses]


def parse_record(rec) -> tuple[str, DecodeResponse]:
    """A frame's record back to (request id, DecodeResponse); ValueError when it is malformed."""
    if not (isinstance(rec, list) and len(rec) == 6):
        raise ValueError("a record is a list of 6 fields")
    rid, ids, reason, error, code, pauses = rec
    if not isinstance(rid, str) or not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise ValueError("bad request_id or output_ids")
    if not all(v is None or isinstance(v, str) for v in (reason, error)) or not isinstance(code, str):
        raise ValueError("bad finish_reason, error or error_code")
    if type(pauses) is not int:
        raise ValueError("bad num_pauses")
    return rid, DecodeResponse(ids, reason, error, code or "INTERNAL", pauses)


def socket_path(directory: str, instance: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", instance)[:58] + ".sock"
    return str(Path(directory) / name)


class ReplyInbox:
    """Master's end: a listening socket; each connection's records go to the queue of the request they name
    (`open`), and records for a request no longer open are dropped."""

    def __init__(self, path: str, key: str):
        self.path, self.key = path, key
        self.queues: dict[str, queue.SimpleQueue] = {}
        self.lock = threading.Lock()
        self.closed = False
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        os.chmod(path, 0o600)
        self.sock.listen(64)
        threading.Thread(target=self._accept, name="pd-reply-accept", daemon=True).start()

    def open(self, rid: str) -> queue.SimpleQueue:
        q: queue.SimpleQueue = queue.SimpleQueue()
        with self.lock:
            self.queues[rid] = q
        return q

    def discard(self, rid: str) -> None:
        with self.lock:
            self.queues.pop(rid, None)

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(conn,), name="pd-reply-read", daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with conn:
            try:
                hello = _read_frame(conn)
                if not (isinstance(hello, dict) and hmac.compare_digest(str(hello.get("key", "")), self.key)):
                    print(
                        "[triton-pd] reply channel: a connection without the internal key, closed",
                        file=sys.stderr,
                        flush=True,
                    )
                    return
                while (frame := _read_frame(conn)) is not None:
                    for rec in frame["r"]:
                        rid, resp = parse_record(rec)
                        with self.lock:
                            q = self.queues.get(rid)
                        if q is not None:
                            q.put(resp)
            except (OSError, ValueError, KeyError, TypeError) as e:
                if not self.closed:
                    print(f"[triton-pd] reply channel: connection dropped ({e!r})", file=sys.stderr, flush=True)


class ReplyChannel:
    """Decode's end of one master's inbox: one connection, frames written whole under a lock."""

    def __init__(self, path: str, key: str):
        self.path = path
        self.lock = threading.Lock()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect(path)
            self.sock.sendall(_frame({"key": key}), socket.MSG_NOSIGNAL)
        except OSError:
            self.sock.close()
            raise
        self.broken = False

    def send(self, parts: list[tuple[str, DecodeResponse]]) -> None:
        data = _frame({"r": [record(rid, r) for rid, r in parts]})
        with self.lock:
            try:
                self.sock.sendall(data, socket.MSG_NOSIGNAL)
            except OSError:
                self.broken = True
                raise

    def close(self) -> None:
        self.sock.close()


class ReplyChannels:
    """Decode's connections, one per master inbox named in a request, opened on first use and again after a
    failure. Only sockets in this deployment's mailbox directory are accepted."""

    def __init__(self, directory: str, key: str):
        self.directory = Path(directory).resolve()
        self.key = key
        self.channels: dict[str, ReplyChannel] = {}
        self.lock = threading.Lock()

    def check(self, path: str) -> str:
        p = Path(path)
        if not (p.is_absolute() and _NAME.match(p.name) and p.parent.resolve() == self.directory):
            raise ValueError(f"reply_to {path!r} is not a reply socket of this deployment")
        return str(p)

    def get(self, path: str) -> ReplyChannel:
        with self.lock:
            ch = self.channels.get(path)
            if ch is None or ch.broken:
                if ch is not None:
                    ch.close()
                ch = self.channels[path] = ReplyChannel(path, self.key)
            return ch

    def close(self) -> None:
        with self.lock:
            for ch in self.channels.values():
                ch.close()
            self.channels.clear()
