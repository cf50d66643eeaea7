"""The gated delta rule (Gated DeltaNet, Yang et al. 2024, arXiv:2412.06464) and the short causal convolution in
front of it, in plain PyTorch: the reference for the Triton kernels and the CPU path of the hybrid model.

Per value head, with the recurrent state S (key dim x value dim), a log decay g_t <= 0 and a write strength
beta_t in (0, 1):

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T        o_t = S_t^T q_t

q and k arrive L2-normalised, q already scaled by key_dim^-1/2. Everything runs in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_step(q, k, v, g, beta, state):
    """One token for B sequences at once. q, k: [B, H, Dk]; v: [B, H, Dv]; g, beta: [B, H]; state [B, H, Dk, Dv]
    (float32, updated in place). Returns o [B, H, Dv]."""
    state.mul_(g.exp()[..., None, None])
    kv_mem = torch.einsum("bhkv,bhk->bhv", state, k)
    delta = (v - kv_mem) * beta[..., None]
    state.add_(k[..., :, None] * delta[..., None, :])
    return torch.einsum("bhkv,bhk->bhv", state, q)


def recurrent(q, k, v, g, beta, state):
    """n tokens of one sequence, token by token. q, k: [n, H, Dk]; v: [n, H, Dv]; g, beta: [n, H]; state
    [H, Dk, Dv] (updated in place). Returns o [n, H, Dv]."""
    out = torch.empty_like(v)
    s = state[None]
    for t in range(q.shape[0]):
        out[t] = recurrent_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], s)[0]
    return out


def chunk_prep(q, k, v, g, beta, chunk: int = 64):
    """The state-independent part of the chunked form for n tokens of one sequence (or of several, each padded to
    whole chunks): within each chunk the delta-rule updates are folded into one triangular solve (the WY/UT form).
    Returns [H, m, C, .] tensors (u, w, q_dec, k_dec, attn) and last [H, m], for `chunk_scan`. Positions past n are
    padded with k = v = beta = 0 and g = 0, which leave the state as it is."""
    n, H, _ = q.shape
    pad = (-n) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    m = q.shape[0] // chunk
    q, k, v = (x.view(m, chunk, H, -1).permute(2, 0, 1, 3) for x in (q, k, v))  # [H, m, C, .]
    g, beta = (x.view(m, chunk, H).permute(2, 0, 1) for x in (g, beta))
    cum = g.cumsum(-1)  # log of the decay from the chunk's start through position i
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [H, m, C, C]
    kb, vb = k * beta[..., None], v * beta[..., None]
    # T = I + strictly_lower((beta k) k^T * decay); u = T^-1 (beta v), w = T^-1 (beta k exp(cum))
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    t_mat = ((kb @ k.transpose(-1, -2)) * decay).tril(-1) + eye
    u = torch.linalg.solve_triangular(t_mat, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(t_mat, kb * cum.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay  # causal within the chunk, diagonal included
    q_dec = q * cum.exp()[..., None]
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]
    return u, w, q_dec, k_dec, attn, cum[..., -1].exp()


def chunk_scan(prep, state) -> torch.Tensor:
    """Carry the state [H, Dk, Dv] (updated in place) across the chunks of `chunk_prep`; returns o [H, m, C, Dv]."""
    u, w, q_dec, k_dec, attn, last = prep
    out = torch.empty_like(u)
    s = state
    for i in range(u.shape[1]):
        v_new = u[:, i] - w[:, i] @ s
        out[:, i] = q_dec[:, i] @ s + attn[:, i] @ v_new
        s = s * last[:, i, None, None] + k_dec[:, i].transpose(-1, -2) @ v_new
    state.copy_(s)
    return out


def chunked(q, k, v, g, beta, state, chunk: int = 64):
    """n tokens of one sequence in chunks: `chunk_prep`, then `chunk_scan` carrying the state. Same arguments as
    `recurrent`."""
    n, H, _ = q.shape
    out = chunk_scan(chunk_prep(q, k, v, g, beta, chunk), state)
    return out.permute(1, 2, 0, 3).reshape(-1, H, v.shape[-1])[:n]


def conv_prefill(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv over n new inputs of one sequence, then SiLU. x: [n, C]; conv_state: [C, K - 1] (the
    K - 1 inputs before x, oldest first; zeros at position 0), updated in place; weight: [C, K]."""
    km1 = conv_state.shape[-1]
    full = torch.cat((conv_state.to(x.dtype), x.t()), dim=-1)  # [C, K - 1 + n]
    out = F.conv1d(full[None], weight[:, None, :].to(x.dtype), groups=full.shape[0])[0]  # [C, n]
    conv_state.copy_(full[:, full.shape[-1] - km1 :])
    return F.silu(out.t())


def conv_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One input for B sequences. x: [B, C]; conv_state: [B, C, K - 1] (updated in place). Returns [B, C]."""
    full = torch.cat((conv_state.to(x.dtype), x[..., None]), dim=-1)  # [B, C, K]
    out = (full * weight.to(x.dtype)[None]).sum(-1)
    conv_state.copy_(full[..., 1:])
    return F.silu(out)
