"""The hybrid (Qwen3-Next / Qwen3.5) model's decode step in CUDA graphs, from the Triton kernels in kernels/ and
cuBLAS (or skinny_linear) matmuls over the fused projections of `hybrid_model.fuse_weights`. Everything else
(prefill chunks, mixed batches, speculative verification, the MTP head) runs through the eager `HybridModel` on the
same weights, KV pool and state pages; MoE layers run the eager model's fused MoE launches in the graph too.

One graph step, per layer (a graph node each, no host work):

    linear attention   add+RMSNorm | in_proj | conv step (state in place) | gated delta step (gates, L2 norms,
                       delta rule on the state page in place, gated RMSNorm) | out_proj
    full attention     add+RMSNorm | q|gate|k|v proj | q/k RMSNorm + partial rope + K/V store | split-KV decode
                       attention over the slot table | sigmoid gate | o_proj
    MLP                add+RMSNorm | gate|up | SiLU*up | down
    MoE MLP            add+RMSNorm | router|shared gate | softmax+top-k | align | grouped gate|up+SiLU*up |
                       grouped down | fixed-order combine (kernels.moe; the shared expert is one more pair)

Each row's inputs add its state page to the dense path's (ids, positions, out slots, table rows, lengths);
padding rows use a scratch KV slot and a scratch state page that no request owns."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .batch import Span, build_batch
from .decode_graphs import DecodeGraphs
from .hybrid_model import HybridModel
from .kv_store import KVStore, StateStore


def supports(cfg) -> bool:
    """Whether the graph step covers this model: power-of-two head dims (the kernels' tiles), no attention biases.
    MoE layers run kernels.moe's launches (HybridModel._fused_moe), which never wait for the host."""

    def pow2(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0

    return pow2(cfg.head_dim) and pow2(int(cfg.head_dim * cfg.partial_rotary_factor)) and not cfg.attention_bias


class GpuHybrid(DecodeGraphs):
    def __init__(
        self,
        eager: HybridModel,
        kv: KVStore,
        state: StateStore,
        scratch_slot: int,
        pad_page: int,
        max_batch: int = 256,
        max_ctx: int | None = None,
        graph_sizes: tuple[int, ...] | None = (1, 2, 4, 8, 16, 32, 64, 128, 256),
        linear_choice: dict[tuple[str, int], dict] | None = None,
    ):
        """eager: the model whose weights (fused) this shares; scratch_slot: a KV slot and pad_page: a state page
        outside the scheduler's, for padding rows. linear_choice: as for GpuLlama."""
        from kernels import act, attention, delta_rule, linear, norm, rope

        self.k_attn, self.k_norm, self.k_rope, self.k_act, self.k_lin, self.k_dr = (
            attention, norm, rope, act, linear, delta_rule,
        )  # fmt: skip
        cfg = eager.cfg
        if not supports(cfg):
            raise ValueError("GpuHybrid: attention biases and non-power-of-two head dims run eagerly")
        if eager.experts and eager.k_moe is None:
            raise ValueError("GpuHybrid: an MoE model needs the eager model built with kernels=True")
        self.eager, self.cfg, self.kv, self.state = eager, cfg, kv, state
        self.device, self.dtype = eager.device, eager.dtype
        self.has_mtp, self.num_kv_layers = eager.has_mtp, eager.num_kv_layers
        self.pad_page = pad_page
        w = eager.w
        self.embed, self.lm_head = w["model.embed_tokens.weight"], eager.lm_head
        self.final_norm = w["model.norm.weight"]
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            L = dict(ln1=w[p + "input_layernorm.weight"], ln2=w[p + "post_attention_layernorm.weight"],
                     moe=i in eager.experts, mlp=p + "mlp.")  # fmt: skip
            if not L["moe"]:
                L.update(gate_up=w[p + "mlp.gate_up_proj.weight"], down=w[p + "mlp.down_proj.weight"])
            if i in eager.kv_index:
                a = p + "self_attn."
                L.update(full=True, kv_layer=eager.kv_index[i], qkv=w[a + "qkv_proj.weight"], o=w[a + "o_proj.weight"],
                         q_norm=w[a + "q_norm.weight"], k_norm=w[a + "k_norm.weight"])  # fmt: skip
            else:
                a = p + "linear_attn."
                L.update(
                    full=False, j=eager.state_index[i], in_proj=w[a + "in_proj.weight"],
                    conv=w[a + "conv1d.weight"].view(cfg.conv_dim, -1), a_log=w[a + "A_log"].float().contiguous(),
                    dt_bias=w[a + "dt_bias"].float().contiguous(), norm=w[a + "norm.weight"],
                    out=w[a + "out_proj.weight"],
                )  # fmt: skip
            self.layers.append(L)
        self._init_graphs(max_batch, max_ctx or min(cfg.max_position_embeddings, kv.num_slots), scratch_slot,
                          linear_choice)  # fmt: skip
        self.cos, self.sin = rope.rope_cache(eager.inv_freq, self.max_ctx, self.device)
        self.attn_counters = torch.zeros(max_batch * cfg.num_kv_heads, dtype=torch.int32, device=self.device)
        if graph_sizes:
            self.capture([b for b in graph_sizes if b <= max_batch] or [max_batch])

    # ----- the graph inputs -----
    def pad_column(self) -> np.ndarray:
        """The dense path's five input rows, then each row's state page (padding: the scratch page)."""
        return np.append(super().pad_column(), np.int32(self.pad_page))

    def _fill_inputs(self, h: np.ndarray, spans) -> None:
        super()._fill_inputs(h, spans)
        h[5, : len(spans)] = [s.state_page for s in spans]

    def _graphable(self, spans) -> bool:
        return super()._graphable(spans) and all(
            s.state_page >= 0 and s.save_page < 0 and not s.logits_all for s in spans
        )

    # ----- eager: everything that is not a plain decode batch -----
    def _eager(self, spans) -> torch.Tensor:
        return self.eager.forward(build_batch(spans, self.device), self.kv, self.state)

    # ----- the decode step -----
    def _decode_body(self, bs: int) -> None:
        inp = self.graph_inputs[bs]  # [6, bs] int32: ids, positions, out slots, table rows, lengths, state pages
        ids = self._graph_ids(inp)
        self.table.table.index_put_((inp[3], inp[1]), inp[2])  # each sequence's new slot
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        norm = self.k_norm.add_rms_norm
        choice = {n: self.linear_choice.get((n, bs)) for n in ("in_proj", "out", "qkv", "o", "gate_up", "down")}

        def lin(x, L, name):
            return self.k_lin.linear(x, L[name], choice[name])

        h = F.embedding(ids, self.embed)
        x = norm(h, None, self.layers[0]["ln1"], eps, offset=True)
        for i, L in enumerate(self.layers):
            if L["full"]:
                a = self._full_attention(x, L, inp, bs, lin)
            else:
                a = self._linear_attention(x, L, inp, lin)
            x = norm(a, h, L["ln2"], eps, offset=True)
            if L["moe"]:
                m = self.eager.mlp(x, L["mlp"], i)
            else:
                m = lin(self.k_act.silu_mul(lin(x, L, "gate_up")), L, "down")
            nxt = self.layers[i + 1]["ln1"] if i + 1 < len(self.layers) else self.final_norm
            x = norm(m, h, nxt, eps, offset=True)
        self.graph_logits[:bs].copy_(F.linear(x, self.lm_head).float())
        self._store_tokens(bs, inp)

    def _linear_attention(self, x, L, inp, lin):
        cfg, j, pages = self.cfg, L["j"], inp[5]
        proj = lin(x, L, "in_proj")  # [B, conv_dim | z | b | a]
        mixed = self.k_dr.conv_step(proj, L["conv"], self.state.conv(j), pages)
        core = self.k_dr.gated_delta_step(
            mixed, proj, L["a_log"], L["dt_bias"], L["norm"], self.state.ssm(j), pages, cfg.linear_num_key_heads,
            cfg.rms_norm_eps, block_v=self.k_dr.step_block_v(x.shape[0]),
        )  # fmt: skip
        return lin(core, L, "out")

    def _full_attention(self, x, L, inp, bs, lin):
        cfg = self.cfg
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kl = L["kv_layer"]
        k_pool, v_pool = self.kv.k(kl), self.kv.v(kl)
        qkv = lin(x, L, "qkv")  # [B, q | gate | k | v]
        q = self.k_rope.qk_norm_rope_store_kv_(
            qkv, H, Hkv, L["q_norm"], L["k_norm"], cfg.rms_norm_eps, inp[1], self.cos, self.sin, k_pool, v_pool,
            inp[2],
        )  # fmt: skip
        attn = self.k_attn.decode_attention(
            q, k_pool, v_pool, self.table.table, inp[3], inp[4], self.eager.scale, q_idx=self.qidx[:bs],
            counters=self.attn_counters, **self.k_attn.decode_settings(bs, Hkv, D),
        )  # fmt: skip
        gated = attn.view(-1, H * D) * torch.sigmoid(qkv[:, H * D : 2 * H * D])
        return lin(gated, L, "o")

    # ----- capture -----
    def _tune_groups(self) -> dict[str, list[torch.Tensor]]:
        full = [L for L in self.layers if L["full"]]
        lin = [L for L in self.layers if not L["full"]]
        dense = [L for L in self.layers if not L["moe"]]
        groups = {"in_proj": lin, "out": lin, "qkv": full, "o": full, "gate_up": dense, "down": dense}
        return {name: [L[name] for L in ls] for name, ls in groups.items() if ls}

    def _after_capture(self) -> None:
        """Compile the eager path's kernels (a prefill chunk, decode rows) before the first request needs them. The
        slots written are free (nothing is cached yet) and the state page is the padding rows' scratch page."""
        if self.kv.num_slots < 256:
            return
        V, pg = self.cfg.vocab_size, self.pad_page
        ids = [i % V for i in range(64)]
        for spans in (
            [Span(ids[:40], 0, list(range(40)), None, pg)],
            [Span(ids[:1], 5, list(range(100, 106)), None, pg), Span(ids[:1], 9, list(range(110, 120)), None, pg)],
        ):
            self._eager(spans)
        torch.cuda.synchronize()
