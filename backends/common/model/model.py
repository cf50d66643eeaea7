"""Llama-family forward pass in plain PyTorch over a ragged batch that mixes prefill chunks (with a cached prefix)
and decode tokens, reading and writing K/V through slot indices. It is also the reference the GPU kernels are
tested against, so it favours the obvious over the fast."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from backends.common.core.config import ModelConfig
from backends.common.model import fp8, tensor_parallel
from backends.common.model.batch import ForwardBatch
from backends.common.model.kv_store import KVStore


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    sc = cfg.rope_scaling
    if not sc:
        return inv_freq
    factor, low, high = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old_ctx = sc["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos, sin: [T, D] (the half-split layout: rotate_half pairs i with i + D/2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], tp=None):
        """tp: a tensor_parallel.TPGroup when cfg and weights are one rank's shard (tensor_parallel.shard_llama):
        the row-parallel projections' sums and the vocabulary slices are combined across the group's ranks."""
        self.cfg = cfg
        self.w = weights
        self.tp = tp
        any_w = weights["model.embed_tokens.weight"]
        self.dtype, self.device = any_w.dtype, any_w.device
        self.inv_freq = rope_inv_freq(cfg).to(self.device)
        self.lm_head = weights["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _linear(self, x, name):
        return fp8.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def attention(self, q: torch.Tensor, kv: KVStore, layer: int, batch: ForwardBatch) -> torch.Tensor:
        """q: [T, H, D] -> [T, H * D]. Causal over each sequence's context read from the pool by slot."""
        out = torch.empty_like(q)
        k_pool, v_pool = kv.k(layer), kv.v(layer)
        decode = batch.decode_rows()
        if decode is not None:
            rows, slots, valid = decode  # slots: [B, Lmax] (padded with slot 0), valid: [B, 1, 1, Lmax]
            ks, vs = k_pool[slots].transpose(1, 2), v_pool[slots].transpose(1, 2)  # [B, Hkv, Lmax, D]
            o = F.scaled_dot_product_attention(
                q[rows][:, :, None], ks, vs, attn_mask=valid, scale=self.scale, enable_gqa=True
            )  # [B, H, 1, D]
            out[rows] = o[:, :, 0]
        for start, n, slots in zip(batch.starts, batch.new_lens, batch.ctx_slots):
            if n == 1 and decode is not None:
                continue
            ctx = slots.numel()
            qs = q[start : start + n].transpose(0, 1)  # [H, n, D]
            ks = k_pool[slots].transpose(0, 1)  # [Hkv, ctx, D]
            vs = v_pool[slots].transpose(0, 1)
            # query j sits at position ctx - n + j and sees keys [0, ctx - n + j]
            mask = torch.arange(ctx, device=q.device)[None, :] <= (ctx - n + torch.arange(n, device=q.device))[:, None]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.scale, enable_gqa=True)
            out[start : start + n] = o.transpose(0, 1)
        return out.reshape(q.shape[0], -1)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVStore) -> torch.Tensor:
        """Returns float32 logits [len(batch.logits_rows), vocab]."""
        cfg, w = self.cfg, self.w
        T = batch.input_ids.numel()
        h = self._embed(batch.input_ids)
        cos, sin = self.rope(batch.positions)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            x = rms_norm(h, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            q = self._linear(x, p + "self_attn.q_proj").view(T, cfg.num_heads, cfg.head_dim)
            k = self._linear(x, p + "self_attn.k_proj").view(T, cfg.num_kv_heads, cfg.head_dim)
            v = self._linear(x, p + "self_attn.v_proj").view(T, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                q = rms_norm(q, w[p + "self_attn.q_norm.weight"], cfg.rms_norm_eps)
                k = rms_norm(k, w[p + "self_attn.k_norm.weight"], cfg.rms_norm_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            kv.k(i)[batch.out_slots] = k
            kv.v(i)[batch.out_slots] = v
            h = h + self._reduced(self._linear(self.attention(q, kv, i, batch), p + "self_attn.o_proj"))
            x = rms_norm(h, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
            gate = self._linear(x, p + "mlp.gate_proj")
            h = h + self._reduced(self._linear(F.silu(gate) * self._linear(x, p + "mlp.up_proj"), p + "mlp.down_proj"))
        h = rms_norm(h[batch.logits_rows], w["model.norm.weight"], cfg.rms_norm_eps)
        return tensor_parallel.lm_logits(self.tp, h, self.lm_head, cfg.vocab_size)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return tensor_parallel.embed(self.tp, self.w["model.embed_tokens.weight"], ids, self.cfg.vocab_size)

    def _reduced(self, y: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output: this rank's partial sum, added across the ranks."""
        return y if self.tp is None else self.tp.all_reduce(y)
