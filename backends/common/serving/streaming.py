"""A sender thread for decoupled responses: whatever a stream has pending goes out as one response, so the
decode loop never blocks on inter-process messages and never pays one message per token per request."""

from __future__ import annotations

import queue
import sys
import threading
from dataclasses import dataclass, replace

from backends.common.serving.wire import DecodeResponse


@dataclass(eq=False)
class Stream:
    rid: str
    sender: object
    closed: bool = False


@dataclass(slots=True)
class Item:
    """Part of a stream's answer: tokens, and on the last part its finish reason or error."""

    stream: Stream
    response: DecodeResponse


class StreamSender:
    def __init__(self, send_fn, flush_fn=None):
        """send_fn(stream, response: DecodeResponse) does the actual send (final when response.final), or queues
        it; flush_fn(), when given, is called after each round of sends (one per stream with pending parts)."""
        self._send = send_fn
        self._flush_fn = flush_fn
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

    @staticmethod
    def merge(items: list[Item]) -> list[tuple[Stream, DecodeResponse]]:
        """One response per stream, in first-seen order: tokens concatenated up to the first final part (nothing
        after a final part is kept)."""
        merged: dict[int, DecodeResponse] = {}
        order: list[Stream] = []
        for it in items:
            cur = merged.get(id(it.stream))
            r = it.response
            if cur is None:
                merged[id(it.stream)] = replace(r, output_ids=list(r.output_ids))
                order.append(it.stream)
            elif not cur.final:
                cur.output_ids.extend(r.output_ids)
                cur.finish_reason, cur.error, cur.error_code = r.finish_reason, r.error, r.error_code
                cur.num_pauses = r.num_pauses
        return [(stream, merged[id(stream)]) for stream in order]

    def _flush(self, items: list[Item]) -> None:
        for stream, response in self.merge(items):
            if stream.closed:
                continue
            stream.closed = response.final
            try:
                self._send(stream, response)
                self.num_messages += 1
            except Exception as e:
                stream.closed = True  # the receiver is gone; decode learns it through cancellation
                print(f"[triton-pd] response to {stream.rid} not sent: {e!r}", file=sys.stderr, flush=True)
        if self._flush_fn is not None:
            try:
                self._flush_fn()
            except Exception as e:  # the flush answers its own streams' failures; this only keeps the thread alive
                print(f"[triton-pd] responses not flushed: {e!r}", file=sys.stderr, flush=True)
