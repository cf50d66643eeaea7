"""Incremental detokenisation (UTF-8 safe) and stop strings that never emit text they later take back."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Decodes a growing id list into text deltas. A delta is held back while it ends in an incomplete UTF-8
    sequence (the replacement character), and byte-level merges across token boundaries are respected by
    decoding a short window of earlier tokens with the new ones."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """Whatever is still held back at the end of the answer."""
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""


class StopStrings:
    """Feed text deltas; get back what is safe to emit. Text that could be the start of a stop string is held
    until it is known not to be one; a matched stop string and everything after it are dropped."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        if not self.stops:
            return delta
        self.pending += delta
        hit = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if hit >= 0:
            out, self.pending, self.stopped = self.pending[:hit], "", True
            return out
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
