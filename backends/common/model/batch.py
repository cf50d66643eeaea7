"""The batch types every forward pass takes: `Span` (what the scheduler asks for: new tokens of one sequence over
its slots) and `ForwardBatch` (spans flattened for the PyTorch model). Depends on nothing in the engine, so the
runner, the CPU model and the GPU model all import it and none imports another."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Span:
    """Compute K/V and logits for tokens at positions [start, start + len(token_ids)); slots covers [0, end)."""

    token_ids: list[int]
    start: int
    slots: list[int]
    key: object = None  # the request's id: lets the GPU path keep its slot-table row between steps
    state_page: int = -1  # hybrid models: the request's linear-attention state page (state at `start` on entry)
    # speculative verification (two tokens: the input and a draft): logits for every row, and for hybrid models
    # a scratch page that receives the state after the first token, to roll back to when the draft is rejected
    logits_all: bool = False
    save_page: int = -1
    # a request with images (backends/common/model/multimodal.Multimodal): its tokens' 3-D rotary positions and,
    # in the prompt, the vision tower's rows in place of the image tokens' embeddings
    mm: object = None


def rope_offset(span: Span) -> int:
    """What a span's generated tokens add to their index for their rotary position: a request's images shift the
    text after them (multimodal.Multimodal.delta); 0 without images."""
    return span.mm.delta if span.mm is not None else 0


def past_images(span: Span) -> bool:
    """Whether every token of the span lies past its request's prompt (or it has no images): then its positions
    are plain rope at index + `rope_offset`, as the decode graphs compute them."""
    return span.mm is None or span.start >= span.mm.prompt_len


@dataclass(slots=True)
class ForwardBatch:
    """Flattened new tokens of every sequence; sequence i owns rows [starts[i], starts[i] + new_lens[i]).

    ctx_slots[i] lists the slots of all of sequence i's context, prefix and new tokens: [0, ctx_len), of which
    the new tokens are the last new_lens[i]. out_slots are the slots the new tokens' K/V are written to.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64
    starts: list[int]
    new_lens: list[int]
    ctx_slots: list[torch.Tensor]  # each [ctx_len] int64
    logits_rows: torch.Tensor  # [N] int64: rows of T to compute logits for (usually each sequence's last)
    state_pages: list[int] | None = None  # hybrid models: each sequence's state page
    save_pages: list[int] | None = None  # hybrid models: a scratch page per sequence for speculative steps, or -1
    # requests with images: positions is [3, T] (t, row, column; text rows all equal), and these rows of the
    # input take the vision tower's outputs instead of the embedding table's: (row offset in T, rows)
    embeds: list[tuple[int, torch.Tensor]] | None = None
    _decode: tuple | None = None
    _prefill: tuple | None = None
    _linear: LinearRows | None = None

    def _slot_table(self, idx: list[int], lens: list[int], dtype) -> torch.Tensor:
        """The context slots of sequences idx as rows of a zero-padded [len(idx), max(lens)] table."""
        table = torch.zeros(len(idx), max(lens), dtype=dtype, device=self.input_ids.device)
        for r, i in enumerate(idx):
            table[r, : lens[r]] = self.ctx_slots[i]
        return table

    def decode_rows(self):
        """Single-token sequences gathered for one padded attention call: (rows, slots [B, Lmax], mask), or None
        when fewer than two sequences decode. Computed once per batch and shared by every layer."""
        if self._decode is None:
            idx = [i for i, n in enumerate(self.new_lens) if n == 1]
            if len(idx) < 2:
                self._decode = ()
            else:
                lens = [self.ctx_slots[i].numel() for i in idx]
                dev = self.input_ids.device
                slots = self._slot_table(idx, lens, torch.int64)
                valid = torch.arange(max(lens), device=dev)[None, :] < torch.tensor(lens, device=dev)[:, None]
                rows = torch.tensor([self.starts[i] for i in idx], dtype=torch.int64, device=dev)
                self._decode = (rows, slots, valid[:, None, None, :])
        return self._decode or None

    def prefill_rows(self):
        """The sequences `decode_rows` leaves out (several new tokens, or a lone decode) as the inputs of one
        kernels.attention.prefill_attention launch: (table [N, Lmax] int32 of their context slots, rows, q_start,
        q_len, ctx_len [N] int32, max q_len), or None when there are none. Computed once per batch and shared by
        every layer."""
        if self._prefill is None:
            lone = self.decode_rows() is None
            idx = [i for i, n in enumerate(self.new_lens) if n > 1 or lone]
            if not idx:
                self._prefill = ()
            else:
                dev = self.input_ids.device
                ctx = [self.ctx_slots[i].numel() for i in idx]
                table = self._slot_table(idx, ctx, torch.int32)
                meta = [[r, self.starts[i], self.new_lens[i], c] for r, (i, c) in enumerate(zip(idx, ctx))]
                rows, q_start, q_len, ctx_len = torch.tensor(meta, dtype=torch.int32).to(dev).t().contiguous()
                self._prefill = (table, rows, q_start, q_len, ctx_len, max(self.new_lens[i] for i in idx))
        return self._prefill or None

    def linear_rows(self) -> LinearRows:
        """How a hybrid model's linear-attention layers split this batch (`LinearRows`), on the device. Computed
        once per batch and shared by every layer."""
        if self._linear is None:
            dev = self.input_ids.device
            pages = self.state_pages
            saves = self.save_pages or [-1] * len(pages)

            def ints(v):
                return torch.tensor(v, dtype=torch.int64, device=dev)

            single = [i for i, n in enumerate(self.new_lens) if n == 1]
            spec = [i for i, n in enumerate(self.new_lens) if n == 2 and saves[i] >= 0]
            multi = [i for i, n in enumerate(self.new_lens) if n > 1 and i not in spec]
            lens = [self.new_lens[i] for i in multi]
            spans = [slice(self.starts[i], self.starts[i] + n) for i, n in zip(multi, lens)]
            one = (ints([self.starts[i] for i in single]), ints([pages[i] for i in single])) if single else None
            two = None
            if spec:
                two = tuple(ints(v) for v in ([self.starts[i] for i in spec], [pages[i] for i in spec],
                                              [saves[i] for i in spec]))  # fmt: skip
            packed = None
            if len(spans) > 1:
                packed = torch.cat([torch.arange(sl.start, sl.stop, device=dev) for sl in spans])
            self._linear = LinearRows(
                one, two, multi, spans, [sum(lens[:j]) for j in range(len(lens))], lens,
                ints([pages[i] for i in multi]) if multi else None, packed,
            )  # fmt: skip
        return self._linear


@dataclass(slots=True)
class LinearRows:
    """A batch as a hybrid model's linear-attention layers take it. single: (rows, state pages) of the one-token
    sequences, stepped in the recurrent form together; spec: (first rows, pages, save pages) of the speculative
    two-token sequences (the state after the first token copied to the save page); multi: the other sequences'
    indices, spans their rows, packed_starts and lens where each starts and how long it is once the spans are
    packed one after another, multi_pages their state pages, packed_rows their rows as one index (None for a
    single span, which a slice takes)."""

    single: tuple | None
    spec: tuple | None
    multi: list[int]
    spans: list[slice]
    packed_starts: list[int]
    lens: list[int]
    multi_pages: torch.Tensor | None
    packed_rows: torch.Tensor | None


def build_batch(spans: list[Span], device) -> ForwardBatch:
    """The spans as one ragged ForwardBatch on `device`; with a request with images among them, 3-D positions and
    the image rows' embeddings (`ForwardBatch.embeds`)."""
    ids, pos, out, starts, new_lens, ctx = [], [], [], [], [], []
    for s in spans:
        n, end = len(s.token_ids), s.start + len(s.token_ids)
        starts.append(len(ids))
        new_lens.append(n)
        ids.extend(s.token_ids)
        pos.extend(range(s.start, end))
        out.extend(s.slots[s.start : end])
        ctx.append(torch.tensor(s.slots[:end], dtype=torch.int64, device=device))
    rows = []
    for s, st, n in zip(spans, starts, new_lens):
        rows.extend(range(st, st + n) if s.logits_all else [st + n - 1])

    def t(x):
        return torch.tensor(x, dtype=torch.int64, device=device)

    batch = ForwardBatch(
        t(ids), t(pos), t(out), starts, new_lens, ctx, t(rows), [s.state_page for s in spans],
        [s.save_page for s in spans],
    )  # fmt: skip
    if any(s.mm is not None for s in spans):
        batch.positions, batch.embeds = _multimodal(spans, starts, batch.positions)
    return batch


def _multimodal(spans: list[Span], starts: list[int], positions: torch.Tensor):
    """[3, T] positions (a text-only span's rows repeat its 1-D positions) and the image rows' embeddings."""
    pos3 = positions.expand(3, -1).clone()
    embeds = []
    for s, st in zip(spans, starts):
        if s.mm is None:
            continue
        end = s.start + len(s.token_ids)
        pos3[:, st : st + len(s.token_ids)] = s.mm.positions(s.start, end).to(pos3.device)
        if s.start < s.mm.prompt_len:
            embeds += [(st + off, rows) for off, rows in s.mm.embeds_in(s.start, end)]
    return pos3, embeds or None
