"""A tiny random Qwen3-Next (transformers' own classes, fp32): the exactness reference for the hybrid path."""

from __future__ import annotations

import pytest
import torch

TINY_QWEN3_NEXT = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, decoder_sparse_step=2, max_position_embeddings=4096, eos_token_id=2,
)  # fmt: skip


def long_memory(hf) -> None:
    """Norms randomised and the DeltaNet layers given a long memory (see `hybrid_folder`); a vision tower untouched."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "visual" in name:
                continue
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if "linear_attn.in_proj" in name or "linear_attn.out_proj" in name:
                p.mul_(5.0)
            if "A_log" in name:
                p.copy_(torch.empty_like(p).uniform_(0.005, 0.05).log())
            if "dt_bias" in name:
                p.fill_(-2.0)


@pytest.fixture(scope="session")
def hybrid_folder(tmp_path_factory):
    """A saved Hugging Face folder of a tiny random Qwen3NextForCausalLM: three DeltaNet layers and one gated
    attention layer, an MoE MLP on every second layer; norms randomised so none is a no-op. The DeltaNet layers
    get a long memory (decay rates A in [0.005, 0.05), dt bias -2) and 5x larger projections: at transformers'
    init the state fades within a few tokens and moves the logits little, so zeroing it 13 tokens before a sample
    changed no greedy token and a test could not tell a lost state from a kept one. Now it flips nearly all."""
    import transformers as tf

    torch.manual_seed(0)
    hf = tf.AutoModelForCausalLM.from_config(tf.Qwen3NextConfig(**TINY_QWEN3_NEXT), dtype=torch.float32).eval()
    long_memory(hf)
    folder = tmp_path_factory.mktemp("tiny-qwen3-next")
    hf.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def hybrid_hf(hybrid_folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(hybrid_folder), dtype=torch.float32).eval()


# Qwen3.5 as transformers saves it: the multimodal layout (text_config, model.language_model.*, a vision tower)
TEXT_3_5 = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, max_position_embeddings=4096, eos_token_id=2,
)  # fmt: skip
MOE_3_5 = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
VISION_3_5 = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14)


def _save_qwen3_5(tmp_path_factory, moe: bool):
    """Norms randomised and the DeltaNet layers given a long memory, as for `hybrid_folder`, so that a lost or
    misplaced state changes the tokens."""
    import transformers as tf

    torch.manual_seed(1 if moe else 0)
    if moe:
        text = {k: v for k, v in TEXT_3_5.items() if k != "intermediate_size"}  # as an MoE config.json has none
        cfg = tf.Qwen3_5MoeConfig(text_config={**text, **MOE_3_5}, vision_config=VISION_3_5)
        hf = tf.Qwen3_5MoeForConditionalGeneration(cfg)
    else:
        hf = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=TEXT_3_5, vision_config=VISION_3_5))
    hf = hf.float().eval()
    long_memory(hf)
    folder = tmp_path_factory.mktemp("tiny-qwen3.5-moe" if moe else "tiny-qwen3.5")
    hf.save_pretrained(folder)
    return folder, hf


@pytest.fixture(scope="session")
def qwen3_5_saved(tmp_path_factory):
    """(folder, transformers model) of a tiny random Qwen3_5ForConditionalGeneration."""
    return _save_qwen3_5(tmp_path_factory, moe=False)


@pytest.fixture(scope="session")
def qwen3_5_moe_saved(tmp_path_factory):
    """(folder, transformers model) of a tiny random Qwen3_5MoeForConditionalGeneration."""
    return _save_qwen3_5(tmp_path_factory, moe=True)


def chunked_logits(engine, ids: list[int], cuts: list[int]):
    """Every row's logits of one prompt prefilled in the spans [cuts[i], cuts[i + 1]), from a zero state."""
    from backends.common.model.batch import Span, build_batch

    runner = engine.runner
    slots = list(range(len(ids)))
    page = engine.state_pages.alloc()
    try:
        runner.state.apply([(page, -1)])
        rows = []
        for a, b in zip(cuts, cuts[1:]):
            batch = build_batch([Span(ids[a:b], a, slots, state_page=page)], "cpu")
            batch.logits_rows = torch.arange(b - a)  # every row's logits
            rows.append(runner.model.forward(batch, runner.kv, runner.state))
        return torch.cat(rows)
    finally:
        engine.state_pages.free(page)


def make_engine(folder, **kw):
    from backends.common.engine.engine import Engine

    return Engine(str(folder), dtype="float32", **{"device": "cpu", "kv_tokens": 4096, "chunk_size": 64, **kw})


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
