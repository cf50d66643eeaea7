"""The GPU forward pass: the same Llama-family model as `model.LlamaModel`, built from the Triton kernels in
kernels/ and cuBLAS matmuls over fused weights (q|k|v and gate|up), with CUDA graphs for decode batches.

K/V are read through a slot table on the device (`SlotTable`): one row per sequence, filled incrementally, so a
decode step uploads one new slot per sequence instead of its whole context. A pure decode batch of B sequences
replays the graph captured for the smallest captured size >= B, padded with rows that read and write a scratch
slot. The only host-device synchronisation in a decode step is the caller reading the sampled tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from backends.common.core.config import ModelConfig
from backends.common.model import fp8
from backends.common.model.batch import Span
from backends.common.model.decode_graphs import DecodeGraphs
from backends.common.model.kv_store import KVStore
from backends.common.model.model import rms_norm, rope_inv_freq


class GpuLlama(DecodeGraphs):
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
        deterministic: bool = False,
    ):
        """linear_choice: {(projection, graph batch size): skinny_linear settings} to use as given instead of timing
        cuBLAS against skinny_linear at capture (tests; reproducing a run). deterministic: every matmul and
        attention in kernels.invariant's batch-invariant kernels (a row's logits and K/V do not depend on the batch,
        the chunking or the graph: issue #29), the rotary embedding in its own launch."""
        from kernels import act, attention, invariant, linear, norm, rope

        self.k_attn, self.k_norm, self.k_rope, self.k_act, self.k_lin = attention, norm, rope, act, linear
        self.k_inv = invariant
        self.deterministic = deterministic
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
            qkv = fp8.cat_rows([weights.pop(n + ".weight") for n in names])
            bias = torch.cat([weights.pop(n + ".bias") for n in names]) if cfg.attention_bias else None
            gate_up = fp8.cat_rows([weights.pop(p + "mlp.gate_proj.weight"), weights.pop(p + "mlp.up_proj.weight")])
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
        # fine-grained FP8 projections (backends/common/model/fp8.py): one W8A8 kernel for every batch, not tuned
        self.quantized = fp8.is_quantized(self.layers[0]["qkv"]) if self.layers else False
        if self.quantized and deterministic:
            raise ValueError("deterministic mode covers 16-bit and float32 weights; FP8 weights are not covered")
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self._init_graphs(max_batch, max_ctx or min(cfg.max_position_embeddings, kv.num_slots), scratch_slot,
                          linear_choice)  # fmt: skip
        self.cos, self.sin = rope.rope_cache(rope_inv_freq(cfg), self.max_ctx, self.device)
        # decode attention's per-(sequence, kv head) split counters; the kernel leaves them zeroed
        # (graphs are captured for batches up to max_batch; a larger eager batch gets fresh counters)
        self.attn_counters = torch.zeros(max_batch * cfg.num_kv_heads, dtype=torch.int32, device=self.device)
        if graph_sizes:
            self.capture([b for b in graph_sizes if b <= max_batch] or [max_batch])

    # ----- the layer stack, shared by the eager and the captured path -----
    def _layers(self, ids, attend, bs: int = 0) -> torch.Tensor:
        """attend(q, k, v, k_pool, v_pool, attn) rotates q and k, stores k and v into the pool and writes the
        attention output into attn. bs: the decode graph's batch size, whose projections may run skinny_linear."""
        cfg = self.cfg
        choice = {n: self.linear_choice.get((n, bs)) for n in ("qkv", "o", "gate_up", "down")}
        lin, gated = self.k_lin.linear, self.k_lin.gated_linear
        if self.quantized:  # FP8 projections: kernels.fp8's W8A8 launch (activations quantized in it)

            def lin(x, w, choice=None, bias=None):
                return fp8.linear(x, w, bias, kernel=True)

            def gated(gate_up, w, choice=None):
                return lin(self.k_act.silu_mul(gate_up), w)

        elif self.deterministic:

            def lin(x, w, choice=None, bias=None):  # choice: tile settings (`_tune_linear`); bits are the same
                return self.k_inv.linear(x, w, bias, settings=choice)

            def gated(gate_up, w, choice=None):
                return lin(self.k_act.silu_mul(gate_up), w, choice)

        T = ids.shape[0]
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = F.embedding(ids, self.embed)
        x = self.k_norm.add_rms_norm(h, None, self.layers[0]["ln1"], cfg.rms_norm_eps)
        attn = torch.empty(T, H, D, dtype=self.dtype, device=self.device)
        for i, L in enumerate(self.layers):
            if L["qkv_bias"] is None:
                qkv = lin(x, L["qkv"], choice["qkv"]).view(T, H + 2 * Hkv, D)
            elif self.deterministic or self.quantized:
                qkv = lin(x, L["qkv"], bias=L["qkv_bias"]).view(T, H + 2 * Hkv, D)
            else:
                qkv = F.linear(x, L["qkv"], L["qkv_bias"]).view(T, H + 2 * Hkv, D)
            q, k, v = qkv[:, :H], qkv[:, H : H + Hkv], qkv[:, H + Hkv :]
            if L["q_norm"] is not None and self.deterministic:  # one program per head row: batch-invariant
                q = self.k_norm.add_rms_norm(q.reshape(-1, D), None, L["q_norm"], cfg.rms_norm_eps).view(T, H, D)
                k = self.k_norm.add_rms_norm(k.reshape(-1, D), None, L["k_norm"], cfg.rms_norm_eps).view(T, Hkv, D)
            elif L["q_norm"] is not None:
                q = rms_norm(q, L["q_norm"], cfg.rms_norm_eps).contiguous()
                k = rms_norm(k, L["k_norm"], cfg.rms_norm_eps).contiguous()
            attend(q, k, v, self.kv.k(i), self.kv.v(i), attn)
            o = lin(attn.view(T, H * D), L["o"], choice["o"])
            x = self.k_norm.add_rms_norm(o, h, L["ln2"], cfg.rms_norm_eps)
            m = gated(lin(x, L["gate_up"], choice["gate_up"]), L["down"], choice["down"])
            nxt = self.layers[i + 1]["ln1"] if i + 1 < len(self.layers) else self.final_norm
            x = self.k_norm.add_rms_norm(m, h, nxt, cfg.rms_norm_eps)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.deterministic:
            return self.k_inv.linear(x, self.lm_head).float()
        return F.linear(x, self.lm_head).float()

    # ----- eager: any mix of prefill chunks and decode tokens -----
    def _eager(self, spans) -> torch.Tensor:
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

        # decode attention's split counters (a batch larger than the graphs' gets fresh ones)
        ctr = self.attn_counters if len(dec) * self.cfg.num_kv_heads <= self.attn_counters.numel() else None

        def attend(q, k, v, k_pool, v_pool, attn):
            self.k_rope.rope_store_kv_(q, k, v, pos_t, self.cos, self.sin, k_pool, v_pool, out_t)
            if self.deterministic:
                if dec:
                    self.k_inv.decode_attention(
                        q, k_pool, v_pool, table, d[7], d[8], self.scale, self.max_ctx, out=attn, q_idx=d[9],
                        counters=ctr,
                    )  # fmt: skip
                if pre:
                    self.k_inv.prefill_attention(
                        q, k_pool, v_pool, table, d[10], d[11], d[12], d[13], max_q, self.scale, out=attn
                    )
                return
            if dec:
                self.k_attn.decode_attention(
                    q, k_pool, v_pool, table, d[7], d[8], self.scale, out=attn, q_idx=d[9], counters=ctr
                )
            if pre:
                self.k_attn.prefill_attention(
                    q, k_pool, v_pool, table, d[10], d[11], d[12], d[13], max_q, self.scale, out=attn
                )

        x = self._layers(ids_t, attend)
        return self._logits(x.index_select(0, last_t))

    # ----- CUDA graphs for decode -----
    def _decode_body(self, bs: int):
        inp = self.graph_inputs[bs]  # [5, bs] int32: ids, positions, out slots, table rows, sequence lengths
        ids = self._graph_ids(inp)
        launch = self.k_attn.decode_settings(bs, self.cfg.num_kv_heads)
        table, qidx = self.table.table, self.qidx[:bs]
        table.index_put_((inp[3], inp[1]), inp[2])  # each sequence's new slot (padding rewrites the scratch entry)

        def attend(q, k, v, k_pool, v_pool, attn):  # rotary embedding and KV store inside the attention kernel
            if self.deterministic:  # the eager path's launches: the same bits as a prefill of these positions
                self.k_rope.rope_store_kv_(q, k, v, inp[1], self.cos, self.sin, k_pool, v_pool, inp[2])
                self.k_inv.decode_attention(
                    q, k_pool, v_pool, table, inp[3], inp[4], self.scale, self.max_ctx, out=attn, q_idx=qidx,
                    counters=self.attn_counters,
                )  # fmt: skip
                return
            self.k_attn.decode_attention(
                q, k_pool, v_pool, table, inp[3], inp[4], self.scale, out=attn, q_idx=qidx,
                counters=self.attn_counters, rope=(k, v, self.cos, self.sin, inp[2]), **launch,
            )  # fmt: skip

        x = self._layers(ids, attend, bs)
        self.graph_logits[:bs].copy_(self._logits(x))
        self._store_tokens(bs, inp)

    def _after_capture(self) -> None:
        self._warm_eager_prefill()

    def _tune_groups(self) -> dict[str, list[torch.Tensor]]:
        """Every projection but q|k|v with a bias (that one keeps cuBLAS; in deterministic mode, the default
        tile)."""
        if self.quantized:  # kernels.fp8's launch: nothing to choose
            return {}
        mats = ["o", "gate_up", "down"] + (["qkv"] if self.layers[0]["qkv_bias"] is None else [])
        return {name: [L[name] for L in self.layers] for name in mats}

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

    def _warm(self, bs: int) -> None:
        """Compile the attention variant that eager steps use for decode rows (no fused rotary embedding) at this
        size's split count, so that the first mixed prefill + decode step does not stall on Triton's compiler."""
        cfg = self.cfg
        inp = self.graph_inputs[bs]
        q = torch.zeros(bs, cfg.num_heads, cfg.head_dim, dtype=self.dtype, device=self.device)
        if self.deterministic:  # the graph runs the eager path's kernels: compiled by the body already
            return
        split = self.k_attn.default_splits(bs, cfg.num_kv_heads)
        self.k_attn.decode_attention(
            q, self.kv.k(0), self.kv.v(0), self.table.table, inp[3], inp[4], self.scale, q_idx=self.qidx[:bs],
            num_splits=split, counters=self.attn_counters,
        )  # fmt: skip
