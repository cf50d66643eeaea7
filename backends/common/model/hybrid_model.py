"""The hybrid Qwen3-Next family in plain PyTorch over the same ragged batches as the Llama model: gated DeltaNet
linear-attention layers (short causal conv, gated delta rule, gated RMSNorm) interleaved with gated full-attention
layers (q/k RMSNorm, partial rope, a sigmoid gate on the output), dense or mixture-of-experts MLPs.

Full-attention layers read and write K/V by slot exactly as the Llama model does. Linear-attention layers keep a
fixed-size state per request in a state page (`StateStore`): each span names its page, whose state is that of the
span's first position on entry and of its end on exit. Single-token spans step together through the recurrent
form; longer spans go through the chunked form, one sequence at a time.

The optional MTP head (`mtp_forward`) predicts the token after next from the main model's last hidden state and
the next token's embedding; it has one full-attention layer of its own, whose K/V live in an extra KV layer."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from backends.common.core.config import ModelConfig
from backends.common.model import delta_rule as dr
from backends.common.model import fp8, tensor_parallel
from backends.common.model.batch import ForwardBatch
from backends.common.model.kv_store import KVStore, StateStore


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3-Next's RMSNorm: weights are stored centred on 0 and applied as (1 + w), in float32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (y * F.silu(gate.float())).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rows_of(w: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return w.pop(name + ".weight")


def fuse_weights(cfg: ModelConfig, w: dict[str, torch.Tensor]) -> None:
    """Rewrite the checkpoint's projections, in place, into one matrix per layer input, in the order the kernels
    read their outputs (the eager path and the CUDA-graph decode path use the same tensors, so nothing is held
    twice):

    - linear attention: `in_proj` = [q | k | v | z | b | a] with q, k, v in the conv's channel order (every head's
      q, then k, then v: Qwen3.5's `in_proj_qkv`), z [value heads x value dim], b and a [value heads]; from
      Qwen3-Next's per-key-head groups (`in_proj_qkvz`, `in_proj_ba`) or Qwen3.5's four projections;
    - full attention: `qkv_proj` = [q | gate | k | v] (Qwen3-Next's q_proj interleaves q and gate per head);
    - dense MLPs and shared experts: `gate_up_proj` = [gate | up]."""
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    hv, D = cfg.linear_num_value_heads, cfg.head_dim
    prefixes = [f"model.layers.{i}." for i in range(cfg.num_layers)]
    if "mtp.fc.weight" in w:
        prefixes.append("mtp.layers.0.")
    for p in prefixes:
        a = p + "linear_attn."
        if a + "in_proj_qkvz.weight" in w:
            r = hv // hk
            qkvz, ba = _rows_of(w, a + "in_proj_qkvz"), _rows_of(w, a + "in_proj_ba")
            q, k, v, z = torch.split(torch.arange(qkvz.shape[0]).view(hk, -1), [dk, dk, r * dv, r * dv], dim=1)
            b, a_ = torch.split(torch.arange(ba.shape[0]).view(hk, -1), [r, r], dim=1)
            w[a + "in_proj.weight"] = fp8.cat_rows([
                fp8.take_rows(qkvz, torch.cat([x.reshape(-1) for x in (q, k, v, z)])),
                fp8.take_rows(ba, torch.cat([x.reshape(-1) for x in (b, a_)])),
            ])  # fmt: skip
            del qkvz, ba
        if a + "in_proj_qkv.weight" in w:  # Qwen3.5: q, k, v already in the conv's order, z, b, a apart
            names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
            w[a + "in_proj.weight"] = fp8.cat_rows([_rows_of(w, a + n) for n in names])
        t = p + "self_attn."
        if t + "q_proj.weight" in w:
            qg = torch.arange(2 * cfg.num_heads * D).view(cfg.num_heads, 2, D)  # q and gate rows, per head
            order = torch.cat((qg[:, 0].reshape(-1), qg[:, 1].reshape(-1)))
            q = fp8.take_rows(_rows_of(w, t + "q_proj"), order)
            w[t + "qkv_proj.weight"] = fp8.cat_rows([q, _rows_of(w, t + "k_proj"), _rows_of(w, t + "v_proj")])
            if t + "q_proj.bias" in w:
                qb = w.pop(t + "q_proj.bias")[order]
                w[t + "qkv_proj.bias"] = torch.cat((qb, w.pop(t + "k_proj.bias"), w.pop(t + "v_proj.bias")))
            del q
        for m in (p + "mlp.", p + "mlp.shared_expert."):
            if m + "gate_proj.weight" in w:
                w[m + "gate_up_proj.weight"] = fp8.cat_rows([_rows_of(w, m + "gate_proj"), _rows_of(w, m + "up_proj")])


def stack_experts(
    w: dict[str, torch.Tensor], prefix: str, num_experts: int, with_shared: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H], down [E, H, I]) from either the per-expert checkpoint names or the fused ones; the
    checkpoint's own tensors leave `w` (nothing is held twice). with_shared: one more expert, index E, holding the
    shared expert (of the same intermediate size), whose names in `w` become views of it, so that the fused MoE
    kernels treat it as a pair of every token."""
    fused = w.pop(prefix + "experts.gate_up_proj", None)
    if fused is not None:
        gate_up, down = fused, w.pop(prefix + "experts.down_proj")
        if not with_shared:
            return gate_up, down
        experts = [(gate_up[e], down[e]) for e in range(num_experts)]
    else:
        experts = []
        for e in range(num_experts):
            x = f"{prefix}experts.{e}."
            gu = fp8.cat_rows([w.pop(x + "gate_proj.weight"), w.pop(x + "up_proj.weight")])
            experts.append((gu, w.pop(x + "down_proj.weight")))
    if with_shared:
        s = prefix + "shared_expert."
        experts.append((w[s + "gate_up_proj.weight"], w[s + "down_proj.weight"]))
    gate_up, down = fp8.stack([g for g, _ in experts]), fp8.stack([d for _, d in experts])
    del experts, fused
    if with_shared:
        w[s + "gate_up_proj.weight"], w[s + "down_proj.weight"] = gate_up[num_experts], down[num_experts]
    return gate_up, down


def _fused_moe_takes(gate_up, down) -> bool:
    """Whether kernels.moe.routed takes these stacked experts: 16-bit, or FP8 with one column block it supports."""
    if not isinstance(gate_up, fp8.Fp8Weight):
        return not isinstance(down, fp8.Fp8Weight)
    from kernels.fp8 import supported

    return isinstance(down, fp8.Fp8Weight) and down.group == gate_up.group and supported(gate_up.group)


def stack_router(w: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """The router's rows with the shared expert's gate row after them ([E + 1, H]); the names in `w` become views."""
    gate, shared_gate = w[prefix + "gate.weight"], w[prefix + "shared_expert_gate.weight"]
    router = torch.cat((gate, shared_gate))
    n = gate.shape[0]
    w[prefix + "gate.weight"], w[prefix + "shared_expert_gate.weight"] = router[:n], router[n:]
    return router


class HybridModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], kernels: bool = False,
                 low_precision_scan: bool | None = None, tp=None):  # fmt: skip
        """kernels: run the gated delta rule with the Triton kernels (kernels.delta_rule), in place in the state
        pages; otherwise with the PyTorch reference, gathering and scattering the pages.
        low_precision_scan: the chunked delta rule's matmuls in one TF32 pass (kernels.delta_rule.chunked's
        low_precision); None (the default) for 16-bit weights, where its 2.4e-4 is below the activations'
        rounding. False keeps TF32x3 (the tests that compare the kernels with the PyTorch model element by
        element).
        tp: a tensor_parallel.TPGroup when cfg and weights are one rank's shard (tensor_parallel.shard_hybrid):
        the row-parallel projections' sums and the vocabulary slices are combined across the group's ranks."""
        self.tp = tp
        # fine-grained FP8 projections (fp8.py): products through fp8.linear; MoE experts in the fused kernels'
        # W8A8 form with the kernels (kernels.moe's fp8), else in the per-expert loop
        self.quantized = any(fp8.is_quantized(v) for v in weights.values())
        fuse_weights(cfg, weights)
        self.cfg, self.w = cfg, weights
        self.kd = self.k_attn = self.k_norm = self.k_rope = self.k_act = None
        if kernels:
            from kernels import act, attention, delta_rule, norm, rope

            # prefill attention in the paged flash kernel: SDPA with an explicit causal mask would not run
            # flash and materialises the T x T scores; the full-attention layers' q/k norms, rotary embedding and
            # K/V store in one launch, the MLP's silu(gate) * up in one, each residual add in its norm's launch
            self.kd, self.k_attn, self.k_norm, self.k_rope, self.k_act = delta_rule, attention, norm, rope, act
        emb = weights["model.embed_tokens.weight"]
        self.dtype, self.device = emb.dtype, emb.device
        if low_precision_scan is None:
            low_precision_scan = self.dtype in (torch.bfloat16, torch.float16)
        self.low_precision_scan = low_precision_scan
        self.lm_head = emb if cfg.tie_word_embeddings else weights["lm_head.weight"]
        self.kv_index = {layer: j for j, layer in enumerate(cfg.full_layers)}  # layer -> KV store layer
        self.state_index = {layer: j for j, layer in enumerate(cfg.linear_layers)}
        self.rot_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        self.inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, self.rot_dim, 2, dtype=torch.float32, device=self.device) / self.rot_dim)
        )
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        # MoE layers: the experts stacked; with the kernels, the router and shared gate rows in one matrix, and the
        # shared expert as expert E when its size is the experts' (one pair more per token, no launches of its own)
        self.k_moe = None
        self.fold_shared = False
        if kernels and cfg.num_experts:
            from kernels import moe

            self.k_moe = moe
            self.fold_shared = cfg.shared_expert_intermediate_size == cfg.moe_intermediate_size
        self.experts, self.router = {}, {}
        moe_prefixes = {i: f"model.layers.{i}.mlp." for i in range(cfg.num_layers) if cfg.is_moe_layer(i)}
        self.has_mtp = "mtp.fc.weight" in weights  # whatever the config says: the weights decide
        if self.has_mtp:
            self.mtp_kv_layer = len(cfg.full_layers)  # the KV store has one more layer for the MTP head
            if cfg.is_moe_layer(0) or "mtp.layers.0.mlp.gate.weight" in weights:
                moe_prefixes["mtp"] = "mtp.layers.0.mlp."
        for key, prefix in moe_prefixes.items():
            self.experts[key] = stack_experts(weights, prefix, cfg.num_experts, with_shared=self.fold_shared)
            if self.k_moe is not None:
                self.router[key] = stack_router(weights, prefix)
        if self.k_moe is not None and not all(_fused_moe_takes(*ex) for ex in self.experts.values()):
            self.k_moe = None  # FP8 experts of a column block the kernels cannot take: the loop (a folded shared
            # expert stays in the stack, never routed to, its names views of it)

    @property
    def num_kv_layers(self) -> int:
        return len(self.cfg.full_layers) + (1 if self.has_mtp else 0)

    def _linear(self, x, name):
        return fp8.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def mrope_freqs(self, positions: torch.Tensor) -> torch.Tensor:
        """[T, rot_dim / 2] angles of Qwen3.5's interleaved multimodal rope: frequency j follows the row position
        where j % 3 == 1 and the column position where j % 3 == 2 (within the config's mrope_section), the t
        position otherwise (transformers' Qwen3_5TextRotaryEmbedding)."""
        f = positions.float()[:, :, None] * self.inv_freq[None, None, :]  # [3, T, rot_dim / 2]
        out = f[0].clone()
        sec = self.cfg.mrope_section or [0, 0, 0]
        for dim in (1, 2):
            idx = slice(dim, sec[dim] * 3, 3)
            out[:, idx] = f[dim][:, idx]
        return out

    def rope(self, positions: torch.Tensor):
        """(cos, sin) of every row's position: [T, rot_dim] in the model's dtype, as the PyTorch path rotates; with
        the kernels, float32 [T, rot_dim / 2] (kernels.rope's table layout, indexed by row) and the row index."""
        if positions.dim() == 2:  # [3, T]: (t, row, column) positions of a batch with images
            freqs = self.mrope_freqs(positions)
        else:
            freqs = positions.float()[:, None] * self.inv_freq[None, :]
        if self.k_rope is not None:
            return freqs.cos(), freqs.sin(), torch.arange(positions.shape[-1], device=positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    # ---- token mixers ----------------------------------------------------------------------------------------
    def full_attention(self, x, p, kv: KVStore, kv_layer: int, batch: ForwardBatch, rope):
        """rope: what `rope` returns for the batch's positions."""
        cfg, T, D = self.cfg, x.shape[0], self.cfg.head_dim
        qd, kd = cfg.num_heads * D, cfg.num_kv_heads * D
        k_pool, v_pool = kv.k(kv_layer), kv.v(kv_layer)
        qkv = self._linear(x, p + "qkv_proj")
        gate = qkv[:, qd : 2 * qd]
        if self.k_rope is not None:  # norms, rotary embedding and the K/V store in one launch
            cos, sin, rows = rope
            q = self.k_rope.qk_norm_rope_store_kv_(
                qkv, cfg.num_heads, cfg.num_kv_heads, self.w[p + "q_norm.weight"], self.w[p + "k_norm.weight"],
                cfg.rms_norm_eps, rows, cos, sin, k_pool, v_pool, batch.out_slots,
            )  # fmt: skip
        else:
            q, _, k, v = torch.split(qkv, [qd, qd, kd, kd], dim=-1)
            q, k, v = q.view(T, cfg.num_heads, D), k.view(T, cfg.num_kv_heads, D), v.view(T, cfg.num_kv_heads, D)
            q = offset_rms_norm(q, self.w[p + "q_norm.weight"], cfg.rms_norm_eps)
            k = offset_rms_norm(k, self.w[p + "k_norm.weight"], cfg.rms_norm_eps)
            r = self.rot_dim
            c, s = rope[0][:, None, :], rope[1][:, None, :]
            q = torch.cat((q[..., :r] * c + rotate_half(q[..., :r]) * s, q[..., r:]), dim=-1)
            k = torch.cat((k[..., :r] * c + rotate_half(k[..., :r]) * s, k[..., r:]), dim=-1)
            k_pool[batch.out_slots] = k
            v_pool[batch.out_slots] = v
        out = torch.empty_like(q)
        decode = batch.decode_rows()
        if decode is not None:  # every single-token sequence in one padded attention call
            rows, slots, valid = decode
            ks, vs = k_pool[slots].transpose(1, 2), v_pool[slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q[rows][:, :, None], ks, vs, attn_mask=valid, scale=self.scale, enable_gqa=True
            )
            out[rows] = o[:, :, 0]
        if self.kd is not None:  # every other sequence in one launch of the paged flash kernel
            pre = batch.prefill_rows()
            if pre is not None:
                self.k_attn.prefill_attention(q, k_pool, v_pool, *pre, self.scale, out=out)
            return self._linear(out.reshape(T, -1) * torch.sigmoid(gate), p + "o_proj")
        for start, n, slots in zip(batch.starts, batch.new_lens, batch.ctx_slots):
            if n == 1 and decode is not None:
                continue
            ctx = slots.numel()
            qs = q[start : start + n].transpose(0, 1)
            ks, vs = k_pool[slots].transpose(0, 1), v_pool[slots].transpose(0, 1)
            mask = torch.arange(ctx, device=x.device)[None, :] <= (ctx - n + torch.arange(n, device=x.device))[:, None]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.scale, enable_gqa=True)
            out[start : start + n] = o.transpose(0, 1)
        out = out.reshape(T, -1) * torch.sigmoid(gate)
        return self._linear(out, p + "o_proj")

    def _split_proj(self, x, p):
        """The fused in_proj's outputs (`fuse_weights`) as (mixed_qkv [T, conv_dim], z [T, Hv, Dv], b [T, Hv],
        a [T, Hv])."""
        cfg, T = self.cfg, x.shape[0]
        hv, vd = cfg.linear_num_value_heads, cfg.linear_value_dim
        mixed, z, b, a = torch.split(self._linear(x, p + "in_proj"), [cfg.conv_dim, vd, hv, hv], dim=-1)
        return mixed, z.reshape(T, hv, -1), b, a

    def _qkv_gates(self, mixed, b, a, p):
        cfg, T = self.cfg, mixed.shape[0]
        hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        kd = hk * dk
        q = mixed[:, :kd].reshape(T, hk, dk).float()
        k = mixed[:, kd : 2 * kd].reshape(T, hk, dk).float()
        v = mixed[:, 2 * kd :].reshape(T, -1, dv).float()
        r = cfg.linear_num_value_heads // hk
        if r > 1:
            q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
        q = dr.l2norm(q) * dk**-0.5
        k = dr.l2norm(k)
        beta = torch.sigmoid(b.float())
        g = -self.w[p + "A_log"].float().exp() * F.softplus(a.float() + self.w[p + "dt_bias"].float())
        return q, k, v, g, beta

    def linear_attention(self, x, p, state: StateStore, j: int, batch: ForwardBatch):
        cfg = self.cfg
        mixed, z, b, a = self._split_proj(x, p)
        conv_w = self.w[p + "conv1d.weight"].view(cfg.conv_dim, -1)
        conv, ssm = state.conv(j), state.ssm(j)
        core = torch.empty(x.shape[0], cfg.linear_num_value_heads, cfg.linear_value_head_dim, device=x.device)
        pages = batch.state_pages
        lr = batch.linear_rows()  # the batch's split and index tensors, built once for every layer

        def step(rows, pg):  # one token for each of rows, in the recurrent form
            cs = conv[pg]
            m = dr.conv_step(mixed[rows].float(), cs, conv_w.float())
            conv[pg] = cs
            q, k, v, g, beta = self._qkv_gates(m, b[rows], a[rows], p)
            if self.kd is not None:
                core[rows] = self.kd.recurrent_step(*(t.contiguous() for t in (q, k, v, g, beta)), ssm, pg)
            else:
                ss = ssm[pg]
                core[rows] = dr.recurrent_step(q, k, v, g, beta, ss)
                ssm[pg] = ss

        if lr.single is not None:
            step(*lr.single)
        if lr.spec is not None:  # input token, snapshot of the state after it (the rollback point), then the draft
            first, pg, sv = lr.spec
            step(first, pg)
            conv[sv], ssm[sv] = conv[pg], ssm[pg]
            step(first + 1, pg)
        if self.kd is None:
            for i, sl in zip(lr.multi, lr.spans):
                page = pages[i]
                m = dr.conv_prefill(mixed[sl].float(), conv[page], conv_w.float())
                core[sl] = dr.chunked(*self._qkv_gates(m, b[sl], a[sl], p), ssm[page])
        elif lr.multi:  # every prefill span of the batch in one varlen launch, gates and L2 norms computed in it
            m = torch.empty(sum(lr.lens), cfg.conv_dim, dtype=torch.float32, device=x.device)
            for i, sl, s0, n in zip(lr.multi, lr.spans, lr.packed_starts, lr.lens):
                self.kd.conv_prefill(mixed[sl], conv[pages[i]], conv_w, out=m[s0 : s0 + n])
            if lr.packed_rows is None:
                bb, aa = b[lr.spans[0]], a[lr.spans[0]]
            else:
                bb, aa = b[lr.packed_rows], a[lr.packed_rows]
            raw = (m, bb, aa, self.w[p + "A_log"], self.w[p + "dt_bias"], cfg.linear_num_key_heads)
            whole = sum(lr.lens) == x.shape[0]  # the spans are every row of the batch, in order: core is o
            o = self.kd.chunked(None, None, None, None, None, ssm, lr.multi_pages, lr.packed_starts, lr.lens,
                                raw=raw, out=core if whole else None,
                                low_precision=self.low_precision_scan)  # fmt: skip
            if not whole:
                for sl, s0, n in zip(lr.spans, lr.packed_starts, lr.lens):
                    core[sl] = o[s0 : s0 + n]
        if self.kd is not None:
            out = self.kd.gated_norm_rows(core, z, self.w[p + "norm.weight"], cfg.rms_norm_eps, x.dtype)
        else:
            out = gated_rms_norm(core.to(x.dtype), z, self.w[p + "norm.weight"], cfg.rms_norm_eps)
        return self._linear(out.reshape(x.shape[0], -1), p + "out_proj")

    # ---- MLPs --------------------------------------------------------------------------------------------------
    def _gated_mlp(self, x, p):
        gate_up = self._linear(x, p + "gate_up_proj")
        if self.k_act is not None:  # silu(gate) * up in one launch, rounded as below
            return self._linear(self.k_act.silu_mul(gate_up), p + "down_proj")
        g, u = gate_up.chunk(2, dim=-1)
        return self._linear(F.silu(g) * u, p + "down_proj")

    def mlp(self, x, p, key, router=None):
        """router: with the kernels, the router's projection (x, weight) -> logits (default F.linear)."""
        if key not in self.experts:
            return self._gated_mlp(x, p)
        if self.k_moe is not None:
            return self._fused_moe(x, p, key, router or F.linear)
        cfg = self.cfg
        gate_up, down = self.experts[key]
        logits = F.linear(x, self.w[p + "gate.weight"])
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)
        if cfg.norm_topk_prob:
            top_w = top_w / top_w.sum(-1, keepdim=True)
        top_w = top_w.to(x.dtype)
        out = torch.zeros_like(x)
        for e in top_i.unique().tolist():
            tok, slot = torch.where(top_i == e)
            g, u = fp8.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
            out.index_add_(0, tok, fp8.linear(F.silu(g) * u, down[e]) * top_w[tok, slot, None])
        shared = self._gated_mlp(x, p + "shared_expert.")
        return out + torch.sigmoid(self._linear(x, p + "shared_expert_gate")) * shared

    def _fused_moe(self, x, p, key, router):
        """The MoE layer in kernels.moe's launches (no host synchronisation: CUDA-graph safe): router and shared
        gate in one GEMM (router(x, weight)), softmax + top-k (+ the shared expert as pair K), grouped GEMMs, a
        fixed-order combine."""
        cfg, moe = self.cfg, self.k_moe
        gate_up, down = self.experts[key]
        kw = {}
        if isinstance(gate_up, fp8.Fp8Weight):  # e4m3 experts: the W8A8 scheme inside the grouped GEMMs
            kw["fp8"] = (gate_up.scale, down.scale, gate_up.group)
            gate_up, down = gate_up.q, down.q
        E = cfg.num_experts
        logits = router(x, self.router[key])  # [T, E + 1]: the last column is the shared expert's gate
        top_w, top_i = moe.route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob, x.dtype, E, self.fold_shared)
        if self.fold_shared:
            return moe.routed(x, top_i, top_w, gate_up, down, **kw)
        shared = self._gated_mlp(x, p + "shared_expert.")
        return moe.routed(x, top_i, top_w, gate_up, down, shared=(logits[:, E:], shared), **kw)

    # ---- forward -----------------------------------------------------------------------------------------------
    def _norm(self, h, weight):
        """offset_rms_norm, in one launch with the kernels (kernels.norm, offset weights)."""
        if self.k_norm is not None:
            return self.k_norm.add_rms_norm(h, None, weight, self.cfg.rms_norm_eps, offset=True)
        return offset_rms_norm(h, weight, self.cfg.rms_norm_eps)

    def layer(self, h, i, prefix, kv, state, batch, rope, kv_layer=None, mlp_key=None):
        """h: the residual stream (with the kernels updated in place: callers pass a tensor of their own)."""
        w = self.w
        x = self._norm(h, w[prefix + "input_layernorm.weight"])
        if kv_layer is not None:
            a = self.full_attention(x, prefix + "self_attn.", kv, kv_layer, batch, rope)
        else:
            a = self.linear_attention(x, prefix + "linear_attn.", state, self.state_index[i], batch)
        a = self._reduced(a)
        ln2 = w[prefix + "post_attention_layernorm.weight"]
        if self.k_norm is not None:  # h += a and its norm in one launch
            x = self.k_norm.add_rms_norm(a, h, ln2, self.cfg.rms_norm_eps, offset=True)
            h += self._reduced(self.mlp(x, prefix + "mlp.", i if mlp_key is None else mlp_key))
            return h
        h = h + a
        x = self._norm(h, ln2)
        return h + self._reduced(self.mlp(x, prefix + "mlp.", i if mlp_key is None else mlp_key))

    def _reduced(self, y: torch.Tensor) -> torch.Tensor:
        """A row-parallel output (attention, linear attention, MLP or MoE with its shared expert): this rank's
        partial sum, added across the ranks."""
        return y if self.tp is None else self.tp.all_reduce(y)

    @torch.inference_mode()
    def hidden(self, batch: ForwardBatch, kv: KVStore, state: StateStore) -> torch.Tensor:
        """Final-norm hidden states of every row [T, hidden] (before the LM head)."""
        cfg = self.cfg
        h = tensor_parallel.embed(self.tp, self.w["model.embed_tokens.weight"], batch.input_ids, cfg.vocab_size)
        for row, rows in batch.embeds or ():  # a prompt's image tokens: the vision tower's rows
            h[row : row + rows.shape[0]] = rows.to(h.dtype)
        rope = self.rope(batch.positions)
        for i in range(cfg.num_layers):
            h = self.layer(h, i, f"model.layers.{i}.", kv, state, batch, rope, kv_layer=self.kv_index.get(i))
        return self._norm(h, self.w["model.norm.weight"])

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVStore, state: StateStore) -> torch.Tensor:
        """float32 logits [len(batch.logits_rows), vocab]."""
        return self.forward_hidden(batch, kv, state)[0]

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch, kv: KVStore, state: StateStore):
        """(float32 logits of batch.logits_rows, final-norm hidden states of those rows): what the MTP head reads."""
        h = self.hidden(batch, kv, state)[batch.logits_rows]
        return tensor_parallel.lm_logits(self.tp, h, self.lm_head, self.cfg.vocab_size), h

    @torch.inference_mode()
    def mtp_logits(self, batch: ForwardBatch, hidden: torch.Tensor, kv: KVStore) -> torch.Tensor:
        """The MTP head (Qwen3-Next's `mtp.*`): row t takes the main model's hidden state at position t and the
        embedding of the token at t + 1 (batch.input_ids, at batch.positions = t) and predicts the token at t + 2.
        Its one full-attention layer keeps K/V in the extra KV layer, at the slots of the main model's positions.
        float32 logits [len(batch.logits_rows), vocab]."""
        cfg, w = self.cfg, self.w
        e = tensor_parallel.embed(self.tp, w["model.embed_tokens.weight"], batch.input_ids, cfg.vocab_size)
        e = offset_rms_norm(e, w["mtp.pre_fc_norm_embedding.weight"], cfg.rms_norm_eps)
        h = offset_rms_norm(hidden.to(e.dtype), w["mtp.pre_fc_norm_hidden.weight"], cfg.rms_norm_eps)
        h = fp8.linear(torch.cat((e, h), dim=-1), w["mtp.fc.weight"])
        rope = self.rope(batch.positions)
        h = self.layer(h, None, "mtp.layers.0.", kv, None, batch, rope, kv_layer=self.mtp_kv_layer, mlp_key="mtp")
        h = offset_rms_norm(h[batch.logits_rows], w["mtp.norm.weight"], cfg.rms_norm_eps)
        return tensor_parallel.lm_logits(self.tp, h, self.lm_head, cfg.vocab_size)
