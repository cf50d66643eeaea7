"""Tensor parallelism, Megatron-style, over torch.distributed (gloo on CPUs, NCCL on GPUs): one model instance
split across the ranks of a process group, every rank running the same forward on the same batch.

What is split how (rank r of n):
- attention: the query heads [r H/n, (r+1) H/n) and the KV heads [r Hkv/n, (r+1) Hkv/n) (column-parallel
  q/k/v rows, biases with them; each rank's KV pool holds only its KV heads); the output projection's columns of
  those heads (row-parallel), its partial sums added across the ranks (one all-reduce);
- MLP: the gate and up rows [r I/n, (r+1) I/n) (column-parallel), the down projection's columns of them
  (row-parallel, one all-reduce);
- embeddings and LM head: vocabulary-parallel, each rank the rows [r V', (r+1) V') with V' = ceil(V / n) (the last
  slice padded with zero rows): a token outside a rank's slice embeds to zero there and the embeddings are summed
  across the ranks; the LM head's logits of each slice gathered and the padding dropped;
- norms (and q/k norms, per head_dim) on every rank whole.

So a layer costs two all-reduces of [tokens, hidden] and the LM head one all-gather of [rows, V'] per rank. The
sums across ranks add the same terms in another order than one process does: logits agree within float
tolerance, not bit for bit (deterministic mode is not covered). The head counts and the MLP's width must divide
by n (a rank holds whole heads; KV heads are not replicated across ranks yet, so Hkv >= n); the vocabulary is
padded. `LlamaModel(..., tp=group)` runs a rank's shard (`shard_llama`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from backends.common.core.config import ModelConfig


class TPError(ValueError):
    """A model or setting tensor parallelism cannot split; the message names the field."""


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group: rank of size, and the torch.distributed group (None: the
    default one)."""

    rank: int
    size: int
    group: object = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed across the ranks, in place."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x side by side along the last dimension, in rank order (x of one shape on every rank)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def vocab_slice(self, vocab: int) -> tuple[int, int]:
        """The rows [lo, hi) of the vocabulary this rank holds (hi - lo = ceil(vocab / size), past vocab: padding)."""
        per = -(-vocab // self.size)
        return self.rank * per, (self.rank + 1) * per


def check(cfg: ModelConfig, size: int) -> None:
    """Refuse, naming the field, a model that `size` ranks cannot split."""
    if size < 1:
        raise TPError(f"tp: the ranks of a tensor-parallel group must be 1 or more, got {size}")
    if cfg.is_hybrid:
        raise TPError("tp: tensor parallelism covers dense (Llama-family) models so far, not hybrid ones")
    for field in ("num_heads", "num_kv_heads", "intermediate_size"):
        if getattr(cfg, field) % size:
            raise TPError(f"tp: {field} ({getattr(cfg, field)}) is not divisible by the {size} ranks")


def shard_llama(cfg: ModelConfig, weights: dict, tp: TPGroup) -> tuple[ModelConfig, dict]:
    """(this rank's config, this rank's weights) of a dense model's whole weights: the config's head counts and
    MLP width are the rank's own; `weights` is left as it is (the shards are copies: the whole can be freed)."""
    from backends.common.model import fp8

    check(cfg, tp.size)
    if any(fp8.is_quantized(v) for v in weights.values()):
        raise TPError("tp: tensor parallelism does not cover FP8 weights yet")
    n, r = tp.size, tp.rank
    D = cfg.head_dim
    q_rows = slice(r * cfg.num_heads // n * D, (r + 1) * cfg.num_heads // n * D)
    kv_rows = slice(r * cfg.num_kv_heads // n * D, (r + 1) * cfg.num_kv_heads // n * D)
    mlp_rows = slice(r * cfg.intermediate_size // n, (r + 1) * cfg.intermediate_size // n)
    lo, hi = tp.vocab_slice(cfg.vocab_size)
    out = {}
    for name, w in weights.items():
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            out[name] = w[q_rows].clone()
        elif name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            out[name] = w[kv_rows].clone()
        elif name.endswith("o_proj.weight"):
            out[name] = w[:, q_rows].clone()
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            out[name] = w[mlp_rows].clone()
        elif name.endswith("down_proj.weight"):
            out[name] = w[:, mlp_rows].clone()
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            part = torch.zeros(hi - lo, w.shape[1], dtype=w.dtype, device=w.device)
            part[: max(0, min(hi, w.shape[0]) - lo)] = w[lo:hi]
            out[name] = part
        elif name.endswith(("o_proj.bias", "down_proj.bias")):
            raise TPError(f"tp: {name}: a bias after a row-parallel projection is not supported")
        else:  # norms: whole on every rank
            out[name] = w.clone()
    local = replace(cfg, num_heads=cfg.num_heads // n, num_kv_heads=cfg.num_kv_heads // n,
                    intermediate_size=cfg.intermediate_size // n)  # fmt: skip
    return local, out
