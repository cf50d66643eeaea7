"""Token sampling whose randomness depends only on (seed, output position): Gumbel-max over a counter-based
hash, so a token is the same whether it is drawn alone, in a batch of 64, before or after a pause, on any device."""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser on int64 tensors holding values in [0, 2^32) (low bits wrap correctly)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def row_key(seed: int, position: int) -> tuple[int, int]:
    """Two 32-bit keys for one (seed, output position)."""
    a = _mix32_int(_mix32_int(seed & _M32) ^ _mix32_int((seed >> 32) ^ 0x9E3779B9) ^ _mix32_int(position * 0x85EBCA6B))
    b = _mix32_int(a ^ 0xC2B2AE35 ^ position)
    return a, b


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys: [N, 2] int64 -> [N, vocab] float32 standard Gumbel noise, a pure function of (key, vocab index)."""
    idx = _mix32(torch.arange(vocab, device=keys.device, dtype=torch.int64) + 0x632BE5AB)
    h = _mix32(_mix32(idx[None, :] ^ keys[:, :1]) + keys[:, 1:2])
    # 23 bits so that u = (k + 0.5) / 2^23 is exact in float32 and strictly inside (0, 1): never 0 or 1
    u = ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))
    return -torch.log(-torch.log(u))


def sample(
    logits: torch.Tensor,
    temperatures: list[float],
    top_ps: list[float],
    top_ks: list[int],
    seeds: list[int],
    positions: list[int],
    banned: list[list[int]] | None = None,
) -> torch.Tensor:
    """logits: [N, V] float32. Returns [N] int64. Temperature 0 is greedy. `banned` ids get -inf (min_tokens)."""
    logits = logits.float()
    n, vocab = logits.shape
    if banned and any(banned):
        logits = logits.clone()
        for i, ids in enumerate(banned):
            if ids:
                logits[i, ids] = float("-inf")
    greedy = logits.argmax(dim=-1)
    if all(t == 0 for t in temperatures):
        return greedy
    dev = logits.device
    temp = torch.tensor([t if t > 0 else 1.0 for t in temperatures], device=dev, dtype=torch.float32)
    scaled = logits / temp[:, None]
    ks = [k if 0 < k < vocab else vocab for k in top_ks]
    if any(k < vocab for k in ks) or any(p < 1.0 for p in top_ps):
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=dev)[None, :]
        drop = rank >= torch.tensor(ks, device=dev)[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the top token always stays)
        drop |= (probs.cumsum(dim=-1) - probs) >= torch.tensor(top_ps, device=dev)[:, None]
        scaled = torch.full_like(scaled, float("-inf")).scatter(
            1, order, sorted_logits.masked_fill(drop, float("-inf"))
        )
    keys = torch.tensor([row_key(s, p) for s, p in zip(seeds, positions)], device=dev, dtype=torch.int64)
    noisy = scaled + gumbel_noise(keys, vocab)
    sampled = noisy.masked_fill(scaled == float("-inf"), float("-inf")).argmax(dim=-1)
    is_greedy = torch.tensor([t == 0 for t in temperatures], device=dev)
    return torch.where(is_greedy, greedy, sampled)
