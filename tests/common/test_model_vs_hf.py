"""Our forward pass against Hugging Face transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from backends.common.model import loader
from backends.common.model.batch import ForwardBatch
from backends.common.model.kv_store import KVStore
from backends.common.model.model import LlamaModel


def full_logits(model: LlamaModel, ids: list[int], dtype=torch.float32) -> torch.Tensor:
    cfg = model.cfg
    kv = KVStore.allocate(cfg.num_layers, len(ids) + 8, cfg.num_kv_heads, cfg.head_dim, dtype, "cpu")
    n = len(ids)
    ar = torch.arange(n)
    return model.forward(ForwardBatch(torch.tensor(ids), ar, ar + 3, [0], [n], [ar + 3], ar), kv)


def load_ours(folder, dtype=torch.float32) -> LlamaModel:
    src = loader.resolve(str(folder))
    return LlamaModel(loader.load_config(src), loader.load_weights(src, dtype, "cpu"))


def test_smollm2_fp32_logits_match_transformers(smollm2_source, hf_model):
    tok = loader.load_tokenizer(smollm2_source)
    ids = tok.encode("Paris is the capital and largest city of France. " * 8)[:64]
    assert len(ids) == 64
    ours = full_logits(load_ours(smollm2_source.folder), ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max().item() <= 1e-3


def test_smollm2_bf16_close_to_fp32(smollm2_source):
    tok = loader.load_tokenizer(smollm2_source)
    ids = tok.encode("Paris is the capital and largest city of France. " * 8)[:64]
    ref = full_logits(load_ours(smollm2_source.folder), ids)
    bf = full_logits(load_ours(smollm2_source.folder, torch.bfloat16), ids, torch.bfloat16)
    # bf16 keeps ~3 significant digits: the logit vectors point the same way (measured min cosine 0.9965)
    assert torch.nn.functional.cosine_similarity(bf, ref, dim=-1).min().item() > 0.99
    assert (bf.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.95


TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def _tiny(kind: str):
    import transformers as tf

    if kind == "qwen2-qkv-bias":
        return tf.Qwen2Config(**TINY, tie_word_embeddings=False)
    if kind == "qwen3-qk-norm":
        return tf.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True)
    if kind == "llama-untied":
        return tf.LlamaConfig(**TINY, tie_word_embeddings=False)
    if kind == "llama3-rope-scaling":
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        }
        return tf.LlamaConfig(**TINY, rope_parameters=scaling, tie_word_embeddings=True)
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["qwen2-qkv-bias", "qwen3-qk-norm", "llama-untied", "llama3-rope-scaling"])
def test_tiny_random_configs_match_transformers(kind, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_tiny(kind), dtype=torch.float32).eval()
    with torch.no_grad():  # transformers initialises biases and norms to constants: randomise them too
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = load_ours(tmp_path)
    assert ours.cfg.attention_bias == (kind == "qwen2-qkv-bias")
    assert ours.cfg.qk_norm == (kind == "qwen3-qk-norm")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert (full_logits(ours, ids) - ref).abs().max().item() <= 1e-4
