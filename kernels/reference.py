"""PyTorch references for every kernel in this package: the obvious computation, used by the GPU tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def decode_attention(q, k_pool, v_pool, table, rows, seq_lens, scale):
    out = torch.empty_like(q)
    for b in range(rows.shape[0]):
        n = int(seq_lens[b])
        slots = table[int(rows[b]), :n].long()
        k = k_pool[slots].transpose(0, 1).float()  # [Hkv, n, D]
        v = v_pool[slots].transpose(0, 1).float()
        o = F.scaled_dot_product_attention(q[b][:, None].float(), k, v, scale=scale, enable_gqa=True)
        out[b] = o[:, 0].to(q.dtype)
    return out


def prefill_attention(q, k_pool, v_pool, table, rows, q_start, q_len, ctx_len, scale):
    out = torch.zeros_like(q)
    for i in range(rows.shape[0]):
        s, n, ctx = int(q_start[i]), int(q_len[i]), int(ctx_len[i])
        slots = table[int(rows[i]), :ctx].long()
        k = k_pool[slots].transpose(0, 1).float()
        v = v_pool[slots].transpose(0, 1).float()
        qs = q[s : s + n].transpose(0, 1).float()
        mask = torch.arange(ctx, device=q.device)[None, :] <= (ctx - n + torch.arange(n, device=q.device))[:, None]
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[s : s + n] = o.transpose(0, 1).to(q.dtype)
    return out


def add_rms_norm(x, residual, weight, eps):
    if residual is not None:
        residual.add_(x)
        x = residual
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * y


def apply_rope_(q, k, positions, cos, sin):
    c, s = cos[positions.long()][:, None, :], sin[positions.long()][:, None, :]
    for x in (q, k):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half].float(), x[..., half:].float()  # may be views when x is float32
        x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))


def store_kv(k, v, k_pool, v_pool, slots):
    k_pool[slots.long()] = k
    v_pool[slots.long()] = v


def copy_kv(src, src_slots, dst, dst_slots):
    dst[:, :, dst_slots.long()] = src[:, :, src_slots.long()].to(dst.device)


def silu_mul(gate_up):
    f = gate_up.shape[1] // 2
    return F.silu(gate_up[:, :f]) * gate_up[:, f:]
