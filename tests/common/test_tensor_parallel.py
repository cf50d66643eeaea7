"""Tensor parallelism on the CPU (backends/common/model/tensor_parallel.py): a tiny Llama, a tiny hybrid (gated
attention and linear attention, Qwen3-Next/Qwen3.5) and the same hybrid with MoE layers, each split across 2 and
4 gloo ranks, one process each, give TP 1's logits within float tolerance and its greedy tokens, through a ragged
prefill of two prompts and batched decode steps; what cannot be split is refused naming the field."""

from __future__ import annotations

import socket
from dataclasses import replace

import pytest
import torch
import torch.multiprocessing as mp

from backends.common.core.config import SHAPES, ModelConfig
from backends.common.model import loader
from backends.common.model.batch import Span, build_batch
from backends.common.model.hybrid_model import HybridModel, fuse_weights
from backends.common.model.kv_store import KVStore, StateStore
from backends.common.model.model import LlamaModel
from backends.common.model.tensor_parallel import TPError, TPGroup, check, shard_hybrid, shard_llama

# 8 query heads over 4 KV heads (4 ranks hold one KV head each), a vocabulary 4 ranks do not divide (padded)
CFG = ModelConfig(
    vocab_size=333, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=16,
    max_position_embeddings=1024, rope_theta=10000.0, eos_token_ids=[2],
)  # fmt: skip
# the hybrid's heads, key and value heads and widths split 4 ways too (linear attention: 4 key heads of 8 value)
HYBRID = replace(SHAPES["tiny-hybrid-dense"], vocab_size=333, num_kv_heads=4, linear_num_key_heads=4,
                 linear_num_value_heads=8, mtp_layers=0)  # fmt: skip
MODELS = {"llama": CFG, "hybrid": HYBRID, "hybrid-moe": replace(HYBRID, num_experts=6, num_experts_per_tok=2)}
PROMPTS = [[(7 * j + 3) % 333 for j in range(19)], [(11 * j + 5) % 333 for j in range(6)]]
STEPS = 8


def run(kind: str, tp: TPGroup | None) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Each step's logits and the greedy tokens of both prompts: one ragged prefill, then STEPS decode steps."""
    cfg = MODELS[kind]
    w = loader.random_weights(cfg, torch.float32, "cpu", seed=7)
    state = None
    if cfg.is_hybrid:
        if tp is not None:
            fuse_weights(cfg, w)
            cfg, w = shard_hybrid(cfg, w, tp)
        model = HybridModel(cfg, w, tp=tp)
        layers = model.num_kv_layers
        state = StateStore.allocate(cfg, 2, "cpu")
    else:
        if tp is not None:
            cfg, w = shard_llama(cfg, w, tp)
        model, layers = LlamaModel(cfg, w, tp=tp), cfg.num_layers
    kv = KVStore.allocate(layers, 256, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")

    def forward(spans):
        batch = build_batch(spans, "cpu")
        return model.forward(batch, kv) if state is None else model.forward(batch, kv, state)

    slots = [list(range(0, 100)), list(range(100, 200))]
    ids = [list(p) for p in PROMPTS]
    logits = forward([Span(p, 0, s, f"r{i}", state_page=i) for i, (p, s) in enumerate(zip(ids, slots))])
    seen = [logits.clone()]
    for _ in range(STEPS):
        for i, t in enumerate(logits.argmax(-1).tolist()):
            ids[i].append(t)
        logits = forward(
            [Span(p[-1:], len(p) - 1, s, f"r{i}", state_page=i) for i, (p, s) in enumerate(zip(ids, slots))]
        )
        seen.append(logits.clone())
    return seen, [p[len(q) :] for p, q in zip(ids, PROMPTS)]


def rank_main(rank: int, size: int, port: int, out: str) -> None:
    """One rank: every model of MODELS in turn (one process group for all: a spawn costs seconds)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        for kind in MODELS:
            seen, tokens = run(kind, TPGroup(rank, size))
            torch.save({"logits": seen, "tokens": tokens}, f"{out}/{kind}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("size", [2, 4])
def test_tp_ranks_give_tp1_logits_and_greedy_tokens(size, tmp_path):
    mp.start_processes(rank_main, args=(size, free_port(), str(tmp_path)), nprocs=size, join=True,
                       start_method="spawn")  # fmt: skip
    for kind in MODELS:
        want_logits, want_tokens = run(kind, None)
        for rank in range(size):  # every rank computed the whole logits (the LM head's slices gathered)
            got = torch.load(tmp_path / f"{kind}-rank{rank}.pt")
            assert got["tokens"] == want_tokens, (kind, rank)
            for step, (a, b) in enumerate(zip(got["logits"], want_logits)):
                assert a.shape == b.shape == (2, MODELS[kind].vocab_size)
                err = (a - b).abs().max().item()
                assert err <= 1e-5 * b.abs().max().item(), (kind, rank, step, err)


def test_shards_hold_their_heads_and_vocabulary_rows():
    w = loader.random_weights(CFG, torch.float32, "cpu", seed=7)
    local, parts = shard_llama(CFG, w, TPGroup(3, 4))
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 64)
    p = "model.layers.0."
    D = CFG.head_dim
    assert torch.equal(parts[p + "self_attn.q_proj.weight"], w[p + "self_attn.q_proj.weight"][6 * D : 8 * D])
    assert torch.equal(parts[p + "self_attn.k_proj.weight"], w[p + "self_attn.k_proj.weight"][3 * D : 4 * D])
    assert torch.equal(parts[p + "self_attn.o_proj.weight"], w[p + "self_attn.o_proj.weight"][:, 6 * D : 8 * D])
    assert torch.equal(parts[p + "mlp.down_proj.weight"], w[p + "mlp.down_proj.weight"][:, 192:256])
    emb = parts["model.embed_tokens.weight"]  # rows [252, 336): 81 real, 3 of padding
    assert emb.shape == (84, CFG.hidden_size) and torch.equal(emb[:81], w["model.embed_tokens.weight"][252:])
    assert not emb[81:].any()


@pytest.mark.parametrize(
    ("cfg", "size", "field"),
    [(CFG, 8, "num_kv_heads"), (replace(CFG, num_heads=12, num_kv_heads=4), 8, "num_heads"),
     (replace(CFG, intermediate_size=250), 4, "intermediate_size"),
     (replace(HYBRID, linear_num_key_heads=2, linear_num_value_heads=4), 4, "linear_num_key_heads"),
     (replace(HYBRID, num_experts=6, moe_intermediate_size=30), 4, "moe_intermediate_size")],
)  # fmt: skip
def test_what_the_ranks_cannot_split_is_refused_naming_it(cfg, size, field):
    with pytest.raises(TPError, match=field):
        check(cfg, size)


def test_a_hybrid_checkpoints_own_names_are_refused():
    w = loader.random_weights(HYBRID, torch.float32, "cpu", seed=7)
    with pytest.raises(TPError, match="in_proj_qkvz.weight: shard_hybrid takes the fused projections"):
        shard_hybrid(HYBRID, w, TPGroup(0, 2))
