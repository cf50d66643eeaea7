"""A sender thread for decoupled responses: whatever a stream has pending goes out as one response, so the
decode loop never blocks on inter-process messages and never pays one message per token per request."""

from __future__ import annotations

import queue
import sys
import threading
from dataclasses import dataclass, field


@dataclass(eq=False)
class Stream:
    rid: str
    sender: object
    closed: bool = False


@dataclass(slots=True)
class Item:
    stream: Stream
    ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    error_code: str = "INTERNAL"
    num_pauses: int = 0


class StreamSender:
    def __init__(self, send_fn):
        """send_fn(stream, ids, finish_reason, error, error_code, num_pauses, final) does the actual send."""
        self._send = send_fn
        self._q: queue.SimpleQueue[Item | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="pd-stream-sender", daemon=True)
        self._thread.start()
        self.num_messages = 0

    def push(self, item: Item) -> None:
        self._q.put(item)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while True:
            first = self._q.get()
            if first is None:
                return
            items = [first]
            while True:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._flush(items)
                    return
                items.append(nxt)
            self._flush(items)

    def _flush(self, items: list[Item]) -> None:
        merged: dict[int, Item] = {}
        order: list[Stream] = []
        for it in items:
            cur = merged.get(id(it.stream))
            if cur is None:
                merged[id(it.stream)] = Item(
                    it.stream, list(it.ids), it.finish_reason, it.error, it.error_code, it.num_pauses
                )
                order.append(it.stream)
            elif cur.finish_reason is None and cur.error is None:
                cur.ids.extend(it.ids)
                cur.finish_reason, cur.error, cur.error_code = it.finish_reason, it.error, it.error_code
                cur.num_pauses = it.num_pauses
        for stream in order:
            it = merged[id(stream)]
            if stream.closed:
                continue
            final = it.finish_reason is not None or it.error is not None
            stream.closed = final
            try:
                self._send(stream, it.ids, it.finish_reason, it.error, it.error_code, it.num_pauses, final)
                self.num_messages += 1
            except Exception as e:
                stream.closed = True  # the receiver is gone; decode learns it through cancellation
                print(f"[triton-pd] response to {stream.rid} not sent: {e!r}", file=sys.stderr, flush=True)
