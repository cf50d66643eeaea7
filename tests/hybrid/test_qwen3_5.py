"""Qwen3.5 checkpoints as transformers saves them (the multimodal `Qwen3_5ForConditionalGeneration` and
`Qwen3_5MoeForConditionalGeneration` layouts: a nested text_config, the language model under
`model.language_model.`, a vision tower beside it), tiny and random, in fp32: our engine against transformers' own
classes, logits and greedy tokens; and the errors for what does not load."""

from __future__ import annotations

import json

import pytest
import torch

from backends.common.core.config import ModelConfig
from backends.common.core.request import SamplingParams
from backends.common.model.loader import ModelError, load_config, resolve
from tests.hybrid.conftest import TEXT_3_5, chunked_logits, make_engine, prompt


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def saved(request):
    folder, hf = request.getfixturevalue("qwen3_5_moe_saved" if request.param else "qwen3_5_saved")
    return request.param, folder, hf, make_engine(folder)


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0].float()


def test_config_is_the_language_model_of_the_checkpoint(saved):
    moe, folder, _, engine = saved
    cfg = engine.cfg
    assert json.loads((folder / "config.json").read_text())["model_type"] == ("qwen3_5_moe" if moe else "qwen3_5")
    assert cfg.is_hybrid and cfg.linear_layers == [0, 1, 2] and cfg.full_layers == [3]
    assert cfg.partial_rotary_factor == 0.25 and cfg.vocab_size == 320
    assert [cfg.is_moe_layer(i) for i in range(4)] == [moe] * 4


def test_the_language_model_loads_without_the_vision_tower(saved):
    """The language model's weights leave the tower out; a checkpoint with a tower but no image processor
    (preprocessor_config.json) serves text, and refuses images naming the field and the reason (test_vision.py
    serves them)."""
    _, folder, _, engine = saved
    from backends.common.core.request import ParamError, SamplingParams
    from backends.common.model.loader import load_weights

    w = load_weights(resolve(str(folder)), torch.float32, "cpu")
    assert not any("visual" in k or "language_model" in k for k in w)
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in w and "lm_head.weight" in w
    assert engine.runner.vision is None and "preprocessor_config.json" in engine.runner.vision_missing
    with pytest.raises(ParamError, match="image: .* takes no images: .*preprocessor_config.json"):
        engine.add_request([5, 6], SamplingParams(max_tokens=2), [b"png"])


def test_prefill_logits_match_transformers_whole_and_in_uneven_chunks(saved):
    _, _, hf, engine = saved
    ids = prompt(3, 150)
    ref = hf_logits(hf, ids)
    for cuts in ([0, 150], [0, 13, 70, 101, 150]):
        assert (chunked_logits(engine, ids, cuts) - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("n", [5, 90])
def test_greedy_equals_transformers(saved, n):
    _, _, hf, engine = saved
    ids = prompt(n + 7, n)
    want, seq = [], list(ids)
    for _ in range(20):  # transformers without its cache: every step recomputed from the whole sequence
        tok = int(hf_logits(hf, seq)[-1].argmax())
        want.append(tok)
        seq.append(tok)
    out = engine.generate([ids], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    assert out.output_ids == want


def test_unsupported_model_type_and_missing_keys_name_both(tmp_path):
    with pytest.raises(ValueError, match=r"model_type 'gpt_bigcode' is not supported \(supported: .*qwen3_5"):
        ModelConfig.from_hf({"model_type": "gpt_bigcode", "hidden_size": 8})
    with pytest.raises(ValueError, match=r"model_type 'qwen3_5' has no 'text_config'"):
        ModelConfig.from_hf({"model_type": "qwen3_5"})
    text = {k: v for k, v in TEXT_3_5.items() if k != "linear_num_key_heads"}
    with pytest.raises(ValueError, match=r"model_type 'qwen3_5_text' has no 'linear_num_key_heads'"):
        ModelConfig.from_hf({"model_type": "qwen3_5", "text_config": text})
    with pytest.raises(ValueError, match=r"model_type 'llama' has no 'vocab_size'"):
        ModelConfig.from_hf({"model_type": "llama", "num_attention_heads": 4})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelError, match=r"model folder .* has no 'text_config'"):
        load_config(resolve(str(tmp_path)))


@pytest.mark.parametrize(
    "shape,cls", [("qwen3.5-9b", "Qwen3_5TextConfig"), ("qwen3.5-35b-a3b", "Qwen3_5MoeTextConfig")]
)
def test_random_shapes_are_transformers_default_layouts(shape, cls):
    """`random:qwen3.5-9b` and `random:qwen3.5-35b-a3b` are the layouts transformers' Qwen3.5 text configs default
    to (the 9B and the 35B-A3B), read through the same from_hf a checkpoint's config.json goes through."""
    import transformers as tf

    from backends.common.core.config import SHAPES

    hf = ModelConfig.from_hf(getattr(tf, cls)().to_dict())
    ours = SHAPES[shape]
    keys = (
        "vocab_size hidden_size num_layers num_heads num_kv_heads head_dim layer_types partial_rotary_factor "
        "linear_num_key_heads linear_num_value_heads linear_key_head_dim linear_value_head_dim num_experts "
        "num_experts_per_tok moe_intermediate_size shared_expert_intermediate_size rms_norm_eps rope_theta"
    ).split()
    assert {k: getattr(hf, k) for k in keys} == {k: getattr(ours, k) for k in keys}
    if not ours.num_experts:
        assert hf.intermediate_size == ours.intermediate_size
