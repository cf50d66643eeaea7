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
- norms (and q/k norms, per head_dim) on every rank whole;
- hybrid models (`shard_hybrid`): gated attention as above with each head's gate; linear attention by key heads
  and the value heads that belong to them (its state pages hold the rank's heads); MoE experts by matrix (gate
  and up rows, down columns of every expert; the router whole, so every rank routes every token as one process).

So a layer costs two all-reduces of [tokens, hidden] and the LM head one all-gather of [rows, V'] per rank. The
sums across ranks add the same terms in another order than one process does: logits agree within float
tolerance, not bit for bit (deterministic mode is not covered). The head counts and the MLP's width must divide
by n (a rank holds whole heads; KV heads are not replicated across ranks yet, so Hkv >= n); the vocabulary is
padded. `LlamaModel(..., tp=group)` and `HybridModel(..., tp=group)` run a rank's shard."""

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


SPLIT = ("num_heads", "num_kv_heads", "intermediate_size")
SPLIT_HYBRID = ("linear_num_key_heads", "linear_num_value_heads", "moe_intermediate_size",
                "shared_expert_intermediate_size")  # fmt: skip


def check(cfg: ModelConfig, size: int) -> None:
    """Refuse, naming the field, a model that `size` ranks cannot split."""
    if size < 1:
        raise TPError(f"tp: the ranks of a tensor-parallel group must be 1 or more, got {size}")
    for field in SPLIT + (SPLIT_HYBRID if cfg.is_hybrid else ()):
        if getattr(cfg, field) % size:
            raise TPError(f"tp: {field} ({getattr(cfg, field)}) is not divisible by the {size} ranks")


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """A rank's config: every split count and width divided by the ranks (the vocabulary stays whole)."""
    return replace(cfg, **{f: getattr(cfg, f) // size for f in SPLIT + (SPLIT_HYBRID if cfg.is_hybrid else ())})


def embed(tp: TPGroup | None, emb: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """The embeddings of ids from this rank's vocabulary rows, summed across the ranks (tp None: emb[ids])."""
    if tp is None:
        return emb[ids]
    lo, hi = tp.vocab_slice(vocab)
    mine = (ids >= lo) & (ids < hi)
    return tp.all_reduce(emb[torch.where(mine, ids - lo, 0)] * mine[:, None].to(emb.dtype))


def lm_logits(tp: TPGroup | None, h: torch.Tensor, lm_head: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 logits [rows, vocab]: this rank's vocabulary slice of them gathered from every rank."""
    logits = torch.nn.functional.linear(h, lm_head).float()
    return logits if tp is None else tp.all_gather_last(logits)[:, :vocab]


def shard_llama(cfg: ModelConfig, weights: dict, tp: TPGroup) -> tuple[ModelConfig, dict]:
    """(this rank's config, this rank's weights) of a dense model's whole weights: the config's head counts and
    MLP width are the rank's own; `weights` is left as it is (the shards are copies: the whole can be freed)."""
    _refuse(cfg, weights, tp)
    if cfg.is_hybrid:
        raise TPError("tp: shard_llama takes dense models; hybrid ones: shard_hybrid")
    D, H, Hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads

    def attention(name: str, w: torch.Tensor) -> torch.Tensor | None:
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return w[_part(H, tp, 0, D)]
        if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            return w[_part(Hkv, tp, 0, D)]
        if name.endswith("o_proj.weight"):
            return w[:, _part(H, tp, 0, D)]
        return None

    return local_config(cfg, tp.size), _shard(cfg, weights, tp, attention)


def shard_hybrid(cfg: ModelConfig, weights: dict, tp: TPGroup) -> tuple[ModelConfig, dict]:
    """As shard_llama, for the hybrid family (Qwen3-Next, Qwen3.5, their MoE and MTP head), from the projections
    as `hybrid_model.fuse_weights` leaves them (call it first: a checkpoint's own names are refused):
    - full attention: qkv_proj's rows of the rank's query heads, their gates, its KV heads; o_proj's columns;
    - linear attention: in_proj's rows of the rank's key heads (q, k) and of their value heads (v, z, b, a), the
      conv's channels of those q, k and v, A_log and dt_bias of the value heads, out_proj's columns; the state
      pages hold the rank's heads only (the local config sizes them);
    - MLPs, shared experts and every routed expert: gate and up rows, down columns (experts split by matrix, not
      by expert: every rank holds every expert's slice, so routing stays whole on each rank);
    - routers, gates of the shared expert, norms and the MTP head's fc: whole."""
    _refuse(cfg, weights, tp)
    unfused = ("in_proj_qkvz.weight", "in_proj_qkv.weight", "self_attn.q_proj.weight", "mlp.gate_proj.weight")
    name = next((n for n in weights if n.endswith(unfused) and ".experts." not in n), None)
    if name is not None:
        raise TPError(f"tp: {name}: shard_hybrid takes the fused projections (hybrid_model.fuse_weights first)")
    D, H, Hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    hk, dk, hv, dv = (cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_num_value_heads,
                      cfg.linear_value_head_dim)  # fmt: skip
    qkv = torch.cat([_part(H, tp, 0, D), _part(H, tp, H * D, D), _part(Hkv, tp, 2 * H * D, D),
                     _part(Hkv, tp, 2 * H * D + Hkv * D, D)])  # fmt: skip
    kd, vd = hk * dk, hv * dv
    conv = torch.cat([_part(hk, tp, 0, dk), _part(hk, tp, kd, dk), _part(hv, tp, 2 * kd, dv)])
    in_proj = torch.cat([conv, _part(hv, tp, 2 * kd + vd, dv), _part(hv, tp, 2 * kd + 2 * vd),
                         _part(hv, tp, 2 * kd + 2 * vd + hv)])  # fmt: skip

    def attention(name: str, w: torch.Tensor) -> torch.Tensor | None:
        if name.endswith(("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias")):
            return w[qkv]
        if name.endswith("self_attn.o_proj.weight"):
            return w[:, _part(H, tp, 0, D)]
        if name.endswith("linear_attn.in_proj.weight"):
            return w[in_proj]
        if name.endswith("linear_attn.conv1d.weight"):
            return w[conv]
        if name.endswith(("linear_attn.A_log", "linear_attn.dt_bias")):
            return w[_part(hv, tp)]
        if name.endswith("linear_attn.out_proj.weight"):
            return w[:, _part(hv, tp, 0, dv)]
        return None

    return local_config(cfg, tp.size), _shard(cfg, weights, tp, attention)


def _shard(cfg: ModelConfig, weights: dict, tp: TPGroup, attention) -> dict:
    """Every weight's shard for this rank (copies): `attention(name, w)` for a family's attention layers (None: not
    one of them); then what both families split alike (MLPs, shared and routed experts: gate and up rows, down
    columns; embeddings and LM head: vocabulary rows); everything else (norms, routers, gates) whole."""
    lo, hi = tp.vocab_slice(cfg.vocab_size)
    out = {}
    for name, w in weights.items():
        part = attention(name, w)
        if part is not None:
            out[name] = part.clone()
        elif name.endswith(("gate_up_proj.weight", "experts.gate_up_proj")):  # [gate | up] rows ([E, 2I, H] too)
            width = w.shape[-2] // 2
            out[name] = w[..., torch.cat([_part(width, tp), _part(width, tp, width)]), :].clone()
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):  # unfused, or a routed expert's own names
            out[name] = w[..., _part(w.shape[-2], tp), :].clone()
        elif name.endswith(("down_proj.weight", "experts.down_proj")):
            out[name] = w[..., _part(w.shape[-1], tp)].clone()
        elif name.endswith(("o_proj.bias", "down_proj.bias", "out_proj.bias")):
            raise TPError(f"tp: {name}: a bias after a row-parallel projection is not supported")
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = _vocab_rows(w, lo, hi)
        else:  # norms, routers, the shared expert's gate, the MTP head's fc: whole on every rank
            out[name] = w.clone()
    return out


def _refuse(cfg: ModelConfig, weights: dict, tp: TPGroup) -> None:
    """What no family's shard takes: widths the ranks cannot split, FP8 weights."""
    from backends.common.model import fp8

    check(cfg, tp.size)
    if any(fp8.is_quantized(v) for v in weights.values()):
        raise TPError("tp: tensor parallelism does not cover FP8 weights yet")


def _vocab_rows(w: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    part = torch.zeros(hi - lo, w.shape[1], dtype=w.dtype, device=w.device)
    part[: max(0, min(hi, w.shape[0]) - lo)] = w[lo:hi]
    return part


def _part(total: int, tp: TPGroup, offset: int = 0, unit: int = 1) -> torch.Tensor:
    """Indices of this rank's share of `total` items of `unit` rows each, starting at row `offset`."""
    per = total // tp.size
    return offset + torch.arange(tp.rank * per * unit, (tp.rank + 1) * per * unit)
