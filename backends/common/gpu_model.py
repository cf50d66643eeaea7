"""The GPU forward pass: the same Llama-family model as `model.LlamaModel`, built from the Triton kernels in
kernels/ and cuBLAS matmuls over fused weights (q|k|v and gate|up), with CUDA graphs for decode batches.

K/V are read through a slot table on the device (`SlotTable`): one row per sequence, filled incrementally, so a
decode step uploads one new slot per sequence instead of its whole context. A pure decode batch of B sequences
replays the graph captured for the smallest captured size >= B, padded with rows that read and write a scratch
slot. The only host-device synchronisation in a decode step is the caller reading the sampled tokens.
"""

from __future__ import annotations

import bisect
import math

import numpy as np
import torch
import torch.nn.functional as F

from .batch import Span
from .config import ModelConfig
from .kv_store import KVStore
from .model import rms_norm, rope_inv_freq
from .slot_table import SlotTable, Uploader

RING = 3  # pinned host buffers of each kind for graph steps: one is written again three steps later


class _EagerGraph:
    def __init__(self, body, bs: int):
        self.body, self.bs = body, bs

    def replay(self) -> None:
        self.body(self.bs)


class GpuLlama:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        kv: KVStore,
        scratch_slot: int,
        max_batch: int = 256,
        max_ctx: int | None = None,
        graph_sizes: tuple[int, ...] | None = (1, 2, 4, 8, 16, 32, 64, 128, 256),
        linear_choice: dict[tuple[str, int], dict] | None = None,
    ):
        """linear_choice: {(projection, graph batch size): skinny_linear settings} to use as given instead of timing
        cuBLAS against skinny_linear at capture (tests; reproducing a run)."""
        from kernels import act, attention, linear, norm, rope

        self.k_attn, self.k_norm, self.k_rope, self.k_act, self.k_lin = attention, norm, rope, act, linear
        self.cfg, self.kv = cfg, kv
        emb = weights["model.embed_tokens.weight"]
        self.device, self.dtype = emb.device, emb.dtype
        self.embed = emb
        self.lm_head = emb if cfg.tie_word_embeddings else weights["lm_head.weight"]
        self.final_norm = weights["model.norm.weight"]
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            names = [p + f"self_attn.{n}_proj" for n in "qkv"]
            qkv = torch.cat([weights.pop(n + ".weight") for n in names])
            bias = torch.cat([weights.pop(n + ".bias") for n in names]) if cfg.attention_bias else None
            gate_up = torch.cat([weights.pop(p + "mlp.gate_proj.weight"), weights.pop(p + "mlp.up_proj.weight")])
            self.layers.append(
                dict(
                    qkv=qkv,
                    qkv_bias=bias,
                    o=weights[p + "self_attn.o_proj.weight"],
                    gate_up=gate_up,
                    down=weights[p + "mlp.down_proj.weight"],
                    ln1=weights[p + "input_layernorm.weight"],
                    ln2=weights[p + "post_attention_layernorm.weight"],
                    q_norm=weights.get(p + "self_attn.q_norm.weight"),
                    k_norm=weights.get(p + "self_attn.k_norm.weight"),
                )
            )
        self.weights = weights
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.max_ctx = max_ctx or min(cfg.max_position_embeddings, kv.num_slots)
        self.cos, self.sin = rope.rope_cache(rope_inv_freq(cfg), self.max_ctx, self.device)
        self.table = SlotTable(2 * max_batch + 1, self.max_ctx, scratch_slot, self.device)
        self.scratch_slot = scratch_slot
        self.max_batch = max_batch
        # decode attention's per-(sequence, kv head) split counters; the kernel leaves them zeroed
        # (graphs are captured for batches up to max_batch; a larger eager batch gets fresh counters)
        self.attn_counters = torch.zeros(max_batch * cfg.num_kv_heads, dtype=torch.int32, device=self.device)
        self.uploader = Uploader()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pad_column = np.array([0, 0, scratch_slot, 0, 1], dtype=np.int32)  # ids, pos, out slot, row, length
        self.stats = {"graph_steps": 0, "eager_steps": 0}
        self.graph_sizes: list[int] = []
        # (projection, graph batch size) -> skinny_linear settings where they beat cuBLAS (`_tune_linear`)
        self.linear_fixed = linear_choice is not None
        self.linear_choice: dict[tuple[str, int], dict] = dict(linear_choice or {})
        self.linear_times: dict[tuple[str, int], dict] = {}
        if graph_sizes:
            self.capture([b for b in graph_sizes if b <= max_batch] or [max_batch])

    # ----- the layer stack, shared by the eager and the captured path -----
    def _layers(self, ids, attend, bs: int = 0) -> torch.Tensor:
        """attend(q, k, v, k_pool, v_pool, attn) rotates q and k, stores k and v into the pool and writes the
        attention output into attn. bs: the decode graph's batch size, whose projections may run skinny_linear."""
        cfg = self.cfg
        choice = {n: self.linear_choice.get((n, bs)) for n in ("qkv", "o", "gate_up", "down")}
        lin = self.k_lin.linear
        T = ids.shape[0]
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = F.embedding(ids, self.embed)
        x = self.k_norm.add_rms_norm(h, None, self.layers[0]["ln1"], cfg.rms_norm_eps)
        attn = torch.empty(T, H, D, dtype=self.dtype, device=self.device)
        for i, L in enumerate(self.layers):
            if L["qkv_bias"] is None:
                qkv = lin(x, L["qkv"], choice["qkv"]).view(T, H + 2 * Hkv, D)
            else:
                qkv = F.linear(x, L["qkv"], L["qkv_bias"]).view(T, H + 2 * Hkv, D)
            q, k, v = qkv[:, :H], qkv[:, H : H + Hkv], qkv[:, H + Hkv :]
            if L["q_norm"] is not None:
                q = rms_norm(q, L["q_norm"], cfg.rms_norm_eps).contiguous()
                k = rms_norm(k, L["k_norm"], cfg.rms_norm_eps).contiguous()
            attend(q, k, v, self.kv.k(i), self.kv.v(i), attn)
            o = lin(attn.view(T, H * D), L["o"], choice["o"])
            x = self.k_norm.add_rms_norm(o, h, L["ln2"], cfg.rms_norm_eps)
            m = lin(self.k_act.silu_mul(lin(x, L["gate_up"], choice["gate_up"])), L["down"], choice["down"])
            nxt = self.layers[i + 1]["ln1"] if i + 1 < len(self.layers) else self.final_norm
            x = self.k_norm.add_rms_norm(m, h, nxt, cfg.rms_norm_eps)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.lm_head).float()

    # ----- eager: any mix of prefill chunks and decode tokens -----
    def fits_graph(self, batch: int) -> bool:
        """Whether a decode batch of `batch` sequences replays a captured graph."""
        return bool(self.graphs) and batch <= self.graph_sizes[-1]

    def _graphable(self, spans) -> bool:
        return self.fits_graph(len(spans)) and all(len(s.token_ids) == 1 for s in spans)

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

    @torch.inference_mode()
    def forward(self, spans) -> torch.Tensor:
        if self._graphable(spans):
            self._decode_graph(spans)
            return self.graph_logits[: len(spans)]
        rows, wr, wc, ws = self.table.prepare(spans)
        ids, pos, out, q_start, q_len, ctx = [], [], [], [], [], []
        for s in spans:
            n, end = len(s.token_ids), s.start + len(s.token_ids)
            q_start.append(len(ids))
            q_len.append(n)
            ctx.append(end)
            ids.extend(s.token_ids)
            pos.extend(range(s.start, end))
            out.extend(s.slots[s.start : end])
        dec = [i for i, n in enumerate(q_len) if n == 1]
        pre = [i for i, n in enumerate(q_len) if n > 1]
        last = [st + n - 1 for st, n in zip(q_start, q_len)]
        parts = [ids, pos, out, wr, wc, ws, last]
        parts += [[rows[i] for i in dec], [ctx[i] for i in dec], [q_start[i] for i in dec]]
        parts += [[rows[i] for i in pre], [q_start[i] for i in pre], [q_len[i] for i in pre], [ctx[i] for i in pre]]
        d = self.uploader.upload(parts, self.device)
        ids_t, pos_t, out_t, wr_t, wc_t, ws_t, last_t = d[:7]
        self._apply_writes(wr_t, wc_t, ws_t)
        max_q = max((q_len[i] for i in pre), default=0)
        table = self.table.table

        def attend(q, k, v, k_pool, v_pool, attn):
            self.k_rope.rope_store_kv_(q, k, v, pos_t, self.cos, self.sin, k_pool, v_pool, out_t)
            if dec:
                ctr = self.attn_counters if len(dec) * self.cfg.num_kv_heads <= self.attn_counters.numel() else None
                self.k_attn.decode_attention(
                    q, k_pool, v_pool, table, d[7], d[8], self.scale, out=attn, q_idx=d[9], counters=ctr
                )
            if pre:
                self.k_attn.prefill_attention(
                    q, k_pool, v_pool, table, d[10], d[11], d[12], d[13], max_q, self.scale, out=attn
                )

        x = self._layers(ids_t, attend)
        self.stats["eager_steps"] += 1
        return self._logits(x.index_select(0, last_t))

    def _apply_writes(self, wr, wc, ws) -> None:
        if wr.numel():
            self.table.table.index_put_((wr, wc), ws)

    # ----- CUDA graphs for decode -----
    def _decode_body(self, bs: int):
        inp = self.graph_inputs[bs]  # [5, bs] int32: ids, positions, out slots, table rows, sequence lengths
        # an id of -1: the token this row's sequence sampled in its previous graph step (`launch_greedy`)
        ids = torch.where(inp[0] >= 0, inp[0], self.next_tok.index_select(0, inp[3]))
        launch = self.k_attn.decode_settings(bs, self.cfg.num_kv_heads)
        table, qidx = self.table.table, self.qidx[:bs]
        table.index_put_((inp[3], inp[1]), inp[2])  # each sequence's new slot (padding rewrites the scratch entry)

        def attend(q, k, v, k_pool, v_pool, attn):  # rotary embedding and KV store inside the attention kernel
            self.k_attn.decode_attention(
                q, k_pool, v_pool, table, inp[3], inp[4], self.scale, out=attn, q_idx=qidx,
                counters=self.attn_counters, rope=(k, v, self.cos, self.sin, inp[2]), **launch,
            )  # fmt: skip

        x = self._layers(ids, attend, bs)
        self.graph_logits[:bs].copy_(self._logits(x))
        tokens = self._argmax(bs)
        self.dev_tokens[:bs].copy_(tokens)
        self.next_tok.index_put_((inp[3],), tokens)  # padding rows all write row 0, which no sequence owns

    def _argmax(self, bs: int) -> torch.Tensor:
        """int32 argmax of each of the first bs logits rows, the first index among equal maxima (as torch.argmax)."""
        vals, idx = self._logits_padded[:bs].view(bs, 128, self.argmax_chunk).max(-1)
        best = vals.argmax(-1, keepdim=True)  # the first chunk holding the maximum
        return (best * self.argmax_chunk + idx.gather(1, best)).view(bs).to(torch.int32)

    @torch.inference_mode()
    def capture(self, sizes: list[int]) -> None:
        """One CUDA graph per batch size. Off CUDA (Triton's interpreter in tests) each "graph" runs the same body
        eagerly on the same input buffers, so the replay path is testable without a GPU."""
        n = max(sizes)
        dev = self.device
        self.qidx = torch.arange(n, dtype=torch.int32, device=dev)
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
            host = torch.zeros(5, bs, dtype=torch.int32)
            host[2] = self.scratch_slot
            host[4] = 1
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
        if not self.linear_fixed:
            self._tune_linear([b for b in sizes if b <= self.k_lin.TUNE_ROWS])
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in sorted(sizes, reverse=True):
                self._decode_body(bs)  # compiles the kernels for this size outside the capture
                self._warm_eager_decode(bs)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream):
                    self._decode_body(bs)
                self.graphs[bs] = g
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.graph_sizes = sorted(self.graphs)
        self._warm_eager_prefill()

    def _tune_linear(self, sizes: list[int]) -> None:
        """For each small graph batch size and projection, cuBLAS or skinny_linear, whichever runs the layers'
        weights faster here (kernels.linear.tune); a bias on q|k|v keeps cuBLAS for it."""
        mats = ["o", "gate_up", "down"] + (["qkv"] if self.layers[0]["qkv_bias"] is None else [])
        for bs in sizes:
            for name in mats:
                ws = [L[name] for L in self.layers]
                self.linear_choice[(name, bs)], self.linear_times[(name, bs)] = self.k_lin.tune(ws, bs)
        self.linear_choice = {k: v for k, v in self.linear_choice.items() if v is not None}

    def _warm_eager_prefill(self) -> None:
        """Run the eager path on the kinds of batch serving meets (prefill chunks from position 0 and over a cached
        prefix, mixed with decode rows, at token counts that are and are not multiples of 16), so that Triton
        compiles their kernels here and not during the first requests. Nothing is cached yet: the slots written are
        free, and a request writes each of its slots before reading it."""
        if self.kv.num_slots < 256:
            return
        V = self.cfg.vocab_size
        ids = [i % V for i in range(64)]
        batches = [
            [Span(ids[:40], 0, list(range(40)), None), Span(ids[16:40], 16, list(range(40, 80)), None),
             Span(ids[:1], 9, list(range(100, 110)), None)],
            [Span(ids[:47], 0, list(range(120, 167)), None), Span(ids[:1], 5, list(range(200, 206)), None)],
        ]  # fmt: skip
        for spans in batches:
            self.forward(spans)
        torch.cuda.synchronize()
        self.stats["eager_steps"] = 0

    def _warm_eager_decode(self, bs: int) -> None:
        """Compile the attention variant that eager steps use for decode rows (no fused rotary embedding) at this
        size's split count, so that the first mixed prefill + decode step does not stall on Triton's compiler."""
        cfg = self.cfg
        inp = self.graph_inputs[bs]
        q = torch.zeros(bs, cfg.num_heads, cfg.head_dim, dtype=self.dtype, device=self.device)
        split = self.k_attn.default_splits(bs, cfg.num_kv_heads)
        self.k_attn.decode_attention(
            q, self.kv.k(0), self.kv.v(0), self.table.table, inp[3], inp[4], self.scale, q_idx=self.qidx[:bs],
            num_splits=split, counters=self.attn_counters,
        )  # fmt: skip

    def graph_size(self, batch: int) -> int:
        """The captured batch size a decode batch of `batch` sequences replays: the smallest one >= batch."""
        return self.graph_sizes[bisect.bisect_left(self.graph_sizes, batch)]

    def _decode_graph(self, spans) -> int:
        """Replays the graph of `graph_size(len(spans))`; returns that size. The inputs go into the next pinned buffer
        of that size's ring, then up to the graph's input buffer (a copy on the stream: it waits for the graph
        launched before); padding rows read and write the scratch slot through table row 0."""
        B = len(spans)
        bs = self.graph_size(B)
        rows, wr, wc, ws = self.table.prepare(spans, skip_last=True)
        i = self._in_i = (self._in_i + 1) % RING
        ev = self.input_events[bs][i]
        if ev is not None:
            ev.synchronize()  # the copy that last read this buffer has run (it normally has, RING steps ago)
        h = self.host_view[bs][i]
        h[0, :B] = [s.token_ids[0] for s in spans]
        h[1, :B] = [s.start for s in spans]
        h[2, :B] = [s.slots[s.start] for s in spans]
        h[3, :B] = rows
        h[4, :B] = [s.start + 1 for s in spans]
        if B < bs:
            h[:, B:] = self._pad_column[:, None]
        self.graph_inputs[bs].copy_(self.host_inputs[bs][i], non_blocking=True)
        if ev is not None:
            ev.record()
        if wr:  # rows new to the table, or whose slot lists changed
            self._apply_writes(*self.uploader.upload([wr, wc, ws], self.device))
        self.graphs[bs].replay()
        self.stats["graph_steps"] += 1
        return bs

    def forget(self, key) -> None:
        self.table.forget(key)
