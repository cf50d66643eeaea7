"""CUDA graphs for decode batches, shared by the GPU models (`gpu_model.GpuLlama`, `gpu_hybrid.GpuHybrid`).

A pure decode batch of B sequences replays the graph captured for the smallest captured size >= B, padded with
rows that read and write scratch places (a scratch KV slot, for hybrid models a scratch state page). A graph reads
its per-row inputs from one int32 buffer [num_inputs, bs] on the device, copied up before each replay from a ring
of pinned host buffers, so step n+1 can be prepared while step n runs. The argmax of every row is computed inside
the graph; `launch_greedy` returns without waiting for it, and a row's input id of -1 stands for the token its
sequence sampled in its previous graph step, still on the device.

A subclass provides `_decode_body(bs)` (the captured computation: it reads `graph_inputs[bs]`, writes
`graph_logits[:bs]` and calls `_store_tokens`), `_fill_inputs(host, spans)`, `PAD_COLUMN` and `_eager(spans)`."""

from __future__ import annotations

import bisect
import os
import sys
import time

import numpy as np
import torch

from backends.common.model.batch import past_images, rope_offset
from backends.common.model.slot_table import SlotTable, Uploader

RING = 3  # pinned host buffers of each kind for graph steps: one is written again three steps later


class _EagerGraph:
    def __init__(self, body, bs: int):
        self.body, self.bs = body, bs

    def replay(self) -> None:
        self.body(self.bs)


class DecodeGraphs:
    """Input rows of a graph (`pad_column` gives them): ids, positions, out slots, table rows, sequence lengths;
    subclasses may add rows."""

    deterministic = False  # kernels.invariant's batch-invariant kernels (GpuLlama sets it; see issue #29)
    # projection -> what its input is computed from, which a skinny_linear launch can compute as it reads
    # (kernels.linear.tune's prologues): the down projection's silu(gate) * up
    PROLOGUES = {"down": "silu"}
    CONV_CHANNELS: dict[str, int] = {}  # projection -> its outputs that a conv step reads after (hybrid in_proj)
    # projection -> what a skinny_linear launch can compute after it, or leave to the launch after it
    # (kernels.linear.tune's epilogues): "glu", an MLP's silu(gate) * up after gate_up, where the down projection
    # then reads a plain input (tuned after gate_up); "norm", a product that an add + RMSNorm launch reads next, which
    # may add a K split's partial sums itself (the pick's flag defer: the projection gives kernels.linear.Partials)
    EPILOGUES: dict[str, str] = {"o": "norm", "down": "norm"}

    def _init_graphs(self, max_batch: int, max_ctx: int, scratch_slot: int, linear_choice) -> None:
        self.table = SlotTable(2 * max_batch + 1, max_ctx, scratch_slot, self.device)
        self.scratch_slot, self.max_batch, self.max_ctx = scratch_slot, max_batch, max_ctx
        self.uploader = Uploader()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_sizes: list[int] = []
        self.stats = {"graph_steps": 0, "eager_steps": 0}
        # (projection, graph batch size) -> skinny_linear settings where they beat cuBLAS (`_tune_linear`)
        self.linear_fixed = linear_choice is not None
        self.linear_choice: dict[tuple[str, int], dict] = dict(linear_choice or {})
        self.linear_times: dict[tuple[str, int], dict] = {}

    # ----- what a subclass provides -----
    def pad_column(self) -> np.ndarray:
        """The inputs of a padding row: id 0 at position 0 into the scratch slot through table row 0, length 1."""
        return np.array([0, 0, self.scratch_slot, 0, 1], dtype=np.int32)

    def _fill_inputs(self, h: np.ndarray, spans) -> None:
        B = len(spans)
        h[0, :B] = [s.token_ids[0] for s in spans]
        h[1, :B] = [s.start + rope_offset(s) for s in spans]
        h[2, :B] = [s.slots[s.start] for s in spans]
        h[4, :B] = [s.start + 1 for s in spans]

    def _graphable(self, spans) -> bool:
        return self.fits_graph(len(spans)) and all(len(s.token_ids) == 1 and past_images(s) for s in spans)

    # ----- decode steps -----
    def fits_graph(self, batch: int) -> bool:
        """Whether a decode batch of `batch` sequences replays a captured graph."""
        return bool(self.graphs) and batch <= self.graph_sizes[-1]

    def graph_size(self, batch: int) -> int:
        """The captured batch size a decode batch of `batch` sequences replays: the smallest one >= batch."""
        return self.graph_sizes[bisect.bisect_left(self.graph_sizes, batch)]

    @torch.inference_mode()
    def forward(self, spans) -> torch.Tensor:
        """float32 logits of each span's last token: the decode graph's for a graph batch, else the eager path's."""
        if self._graphable(spans):
            self._decode_graph(spans)
            return self.graph_logits[: len(spans)]
        out = self._eager(spans)
        self.stats["eager_steps"] += 1
        return out

    @torch.inference_mode()
    def greedy(self, spans) -> list[int] | None:
        """The argmax token after each span, computed inside the decode graph (no separate argmax launch); None when
        the batch is not a graph batch (the caller then uses `forward`)."""
        handle = self.launch_greedy(spans)
        return None if handle is None else self.collect(handle)

    @torch.inference_mode()
    def launch_greedy(self, spans) -> tuple[int, int] | None:
        """Replay the decode graph for a graph batch without waiting for it; `collect` returns its argmax tokens.
        A token id of -1 stands for the token this sequence's previous graph step sampled, still on the device, so
        the caller may schedule and launch step n+1 before it has read step n's tokens. None when the batch is not
        a graph batch."""
        if not self._graphable(spans):
            return None
        bs = self._decode_graph(spans)
        i = self._tok_i = (self._tok_i + 1) % RING
        ev = self.tok_events[i]
        if ev is not None:
            ev.synchronize()  # this buffer's tokens were read RING steps ago: returns at once
        self.host_tok[i][:bs].copy_(self.dev_tokens[:bs], non_blocking=True)
        if ev is not None:
            ev.record()
        return i, len(spans)

    def collect(self, handle: tuple[int, int]) -> list[int]:
        """The tokens of a `launch_greedy`: waits for that step only (a step launched after it may still run)."""
        i, n = handle
        if self.tok_events[i] is not None:
            self.tok_events[i].synchronize()
        return self.host_tok[i][:n].tolist()

    def forget(self, key) -> None:
        self.table.forget(key)

    def _apply_writes(self, wr, wc, ws) -> None:
        if wr.numel():
            self.table.table.index_put_((wr, wc), ws)

    def _decode_graph(self, spans) -> int:
        """Replays the graph of `graph_size(len(spans))`; returns that size. The inputs go into the next pinned buffer
        of that size's ring, then up to the graph's input buffer (a copy on the stream: it waits for the graph
        launched before); padding rows read and write scratch places through table row 0."""
        B = len(spans)
        bs = self.graph_size(B)
        rows, wr, wc, ws = self.table.prepare(spans, skip_last=True)
        i = self._in_i = (self._in_i + 1) % RING
        ev = self.input_events[bs][i]
        if ev is not None:
            ev.synchronize()  # the copy that last read this buffer has run (it normally has, RING steps ago)
        h = self.host_view[bs][i]
        self._fill_inputs(h, spans)
        h[3, :B] = rows
        if B < bs:
            h[:, B:] = self._pad[:, None]
        self.graph_inputs[bs].copy_(self.host_inputs[bs][i], non_blocking=True)
        if ev is not None:
            ev.record()
        if wr:  # rows new to the table, or whose slot lists changed
            self._apply_writes(*self.uploader.upload([wr, wc, ws], self.device))
        self.graphs[bs].replay()
        self.stats["graph_steps"] += 1
        return bs

    # ----- inside the graph -----
    def _graph_ids(self, inp: torch.Tensor) -> torch.Tensor:
        """The graph's input ids: an id of -1 is the token this row's sequence sampled in its previous graph step."""
        return torch.where(inp[0] >= 0, inp[0], self.next_tok.index_select(0, inp[3]))

    def _store_tokens(self, bs: int, inp: torch.Tensor) -> None:
        tokens = self._argmax(bs)
        self.dev_tokens[:bs].copy_(tokens)
        self.next_tok.index_put_((inp[3],), tokens)  # padding rows all write row 0, which no sequence owns

    def _argmax(self, bs: int, padded: torch.Tensor | None = None) -> torch.Tensor:
        """int32 argmax of each of the first bs logits rows (of `padded`, default the decode graphs' logits), the
        first index among equal maxima (as torch.argmax)."""
        padded = self._logits_padded if padded is None else padded
        vals, idx = padded[:bs].view(bs, 128, self.argmax_chunk).max(-1)
        best = vals.argmax(-1, keepdim=True)  # the first chunk holding the maximum
        return (best * self.argmax_chunk + idx.gather(1, best)).view(bs).to(torch.int32)

    # ----- capture -----
    def _warm(self, bs: int) -> None:
        """Before capturing size bs: compile what eager steps of that size will use (subclasses)."""

    def _after_capture(self) -> None:
        """After every capture: warm the eager path (subclasses)."""

    def _tune_groups(self) -> dict[str, list[torch.Tensor]]:
        """{projection name: its weight in every layer} for `_tune_linear` (subclasses), in the order they are
        tuned: a projection whose pick depends on another's after it (`_norm_fused`, gate_up's glu for down)."""
        return {}

    def _norm_fused(self, rows: int) -> bool:
        """Whether a projection of the graph of `rows` rows computes the add + RMSNorm of its input as it reads it
        (its choice says norm): then the products that norm reads are added up in their own launches, none leaving
        its partial sums to a norm launch (defer)."""
        readers = [n for n, p in self.PROLOGUES.items() if p == "norm"]
        return any((self.linear_choice.get((n, rows)) or {}).get("norm") for n in readers)

    def _tune_kernels(self, sizes: list[int]) -> None:
        """After `_tune_linear`, where it runs: the choices of a subclass's other kernels for each graph size."""

    @torch.inference_mode()
    def capture(self, sizes: list[int]) -> None:
        """One CUDA graph per batch size. Off CUDA (Triton's interpreter in tests) each "graph" runs the same body
        eagerly on the same input buffers, so the replay path is testable without a GPU."""
        n = max(sizes)
        dev = self.device
        self._pad = self.pad_column()
        # query row indices; twice the largest batch for speculative verification (two rows per sequence), sized
        # here once: a graph keeps the address it was captured with
        self.qidx = torch.arange(2 * n, dtype=torch.int32, device=dev)
        # logits rows padded with -inf to whole chunks for a two-stage argmax: torch's one-row argmax over the
        # vocabulary runs in a single block (27 µs at batch 1 on an H200)
        V = self.cfg.vocab_size
        self.argmax_chunk = -(-V // 128)
        padded = torch.full((n, 128 * self.argmax_chunk), float("-inf"), dtype=torch.float32, device=dev)
        self.graph_logits = padded[:, :V]
        self._logits_padded = padded
        pin = dev.type == "cuda"
        # per size, a ring of pinned input buffers (`_decode_graph` copies one up before each replay; an event per
        # buffer says when that copy has run), so that step n+1 can be prepared while step n still runs
        self.graph_inputs, self.host_inputs, self.host_view, self.input_events = {}, {}, {}, {}
        for bs in sizes:
            host = torch.from_numpy(np.repeat(self._pad[:, None], bs, axis=1).copy())
            self.graph_inputs[bs] = host.to(dev)
            self.host_inputs[bs] = [host.clone().pin_memory() if pin else host.clone() for _ in range(RING)]
            self.host_view[bs] = [h.numpy() for h in self.host_inputs[bs]]  # written in place before a replay
            self.input_events[bs] = [torch.cuda.Event() if pin else None for _ in range(RING)]
        self._in_i = 0
        self.dev_tokens = torch.zeros(n, dtype=torch.int32, device=dev)  # the last graph's argmax, per batch row
        self.next_tok = torch.zeros(self.table.table.shape[0], dtype=torch.int32, device=dev)  # per table row
        self.host_tok = [torch.zeros(n, dtype=torch.int32, pin_memory=pin) for _ in range(RING)]
        self.tok_events = [torch.cuda.Event() if pin else None for _ in range(RING)]
        self._tok_i = 0
        if dev.type != "cuda":
            self.graphs = {bs: _EagerGraph(self._decode_body, bs) for bs in sizes}
            self.graph_sizes = sorted(self.graphs)
            return
        if not self.linear_fixed and os.environ.get("TRITON_PD_LINEAR_TUNE", "1") != "0":
            # deterministic mode times its tiles for every size (no choice changes the bits)
            small = [b for b in sizes if b <= self.k_lin.TUNE_ROWS]
            self._tune_linear(sizes if self.deterministic else small)
            self._tune_kernels(small)
        pool = self._graph_pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in sorted(sizes, reverse=True):
                self._decode_body(bs)  # compiles the kernels for this size outside the capture
                self._warm(bs)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream):
                    self._decode_body(bs)
                self.graphs[bs] = g
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.graph_sizes = sorted(self.graphs)
        self._after_capture()

    def _tune_linear(self, sizes: list[int]) -> None:
        """For each small graph batch size and projection, cuBLAS or skinny_linear, whichever runs the layers'
        weights faster here (kernels.linear.tune). The choice is timed in each process, so two processes can round
        a projection differently where the two run about as fast (unless they share kernels.linear's tuning
        cache, which keeps each pick for the next process); TRITON_PD_LINEAR_TUNE=0 skips the timing (cuBLAS
        everywhere), for processes that must agree bit for bit. One progress line per size on stderr."""
        groups = self._tune_groups()
        cache = None if self.deterministic else self.k_lin.tune_cache()
        t0 = time.perf_counter()
        for i, bs in enumerate(sizes):
            hits = cache.hits if cache is not None else 0
            for name, ws in groups.items():
                prologue = self.PROLOGUES.get(name)
                if name == "down" and (self.linear_choice.get(("gate_up", bs)) or {}).get("glu"):
                    prologue = None  # gate_up's launch gives silu(gate) * up (`EPILOGUES`): down reads it plain
                epilogue = self.EPILOGUES.get(name)
                if epilogue == "norm" and self._norm_fused(bs):
                    epilogue = None  # the norm is computed in the next projection's launch, from the product
                if self.deterministic:  # tiles of kernels.invariant: any choice, the same bits
                    choice, self.linear_times[(name, bs)] = self.k_inv.tune(ws, bs)
                else:  # an input computed as a skinny launch reads it (`PROLOGUES`) is timed that way
                    choice, self.linear_times[(name, bs)] = self.k_lin.tune(
                        ws, bs, prologue, self.CONV_CHANNELS.get(name, 0), epilogue
                    )
                self.linear_choice[(name, bs)] = choice
            cached = f", {cache.hits - hits} of them from {cache.path}" if cache is not None and cache.path else ""
            took = time.perf_counter() - t0
            print(f"[triton-pd] decode graphs: {len(groups)} projections tuned for {bs} rows ({i + 1} of "
                  f"{len(sizes)} sizes, {took:.0f} s{cached})", file=sys.stderr, flush=True)  # fmt: skip
        self.linear_choice = {k: v for k, v in self.linear_choice.items() if v is not None}
