"""Convert a Llama-architecture GGUF file into a Hugging Face style folder (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json), dequantising every tensor to fp32 with the `gguf` library."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from backends.common.core.config import ModelConfig

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# llama.cpp's "smollm" pre-tokenizer splits digits one by one, then applies GPT-2's byte-level regex.
_PRE_TOKENIZERS = {
    "smollm": [{"type": "Digits", "individual_digits": True}],
    "default": [],
}


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """GGUF stores Q and K rows interleaved for llama.cpp's rope; undo that to get the half-split layout."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def read_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (llama)")
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, "llama.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_layers=int(_field(reader, "llama.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_field(reader, "llama.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[int(_field(reader, "tokenizer.ggml.eos_token_id"))],
    )


def _tokenizer_files(reader) -> tuple[dict, dict]:
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (gpt2 byte-level BPE)")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    merges = _field(reader, "tokenizer.ggml.merges")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    # token_type 3 = control, 4 = user-defined: both are added tokens that the BPE model must not split
    added = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": types[i] == 3,
        }
        for i, t in enumerate(tokens)
        if types[i] in (3, 4)
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": _PRE_TOKENIZERS.get(pre, []) + [byte_level]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": [m.split(" ", 1) for m in merges],
        },
    }

    def name(key):
        i = _field(reader, key)
        return None if i is None else tokens[int(i)]

    tokenizer_config = {
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": int(_field(reader, "llama.context_length", 4096)),
    }
    return tokenizer_json, tokenizer_config


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write the HF folder atomically (a temporary folder renamed into place), so a crash leaves no half cache."""
    import gguf
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    reader = gguf.GGUFReader(str(gguf_path))
    cfg = read_config(reader)
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims innermost first
        prefix, _, rest = t.name.partition(".")
        if prefix == "blk":
            layer, _, rest = rest.partition(".")
            base, _, kind = rest.rpartition(".")
            if base not in _LAYER_NAMES:
                raise ValueError(f"unexpected GGUF tensor {t.name}")
            if base == "attn_q":
                w = _unpermute(w, cfg.num_heads)
            elif base == "attn_k":
                w = _unpermute(w, cfg.num_kv_heads)
            name = f"model.layers.{layer}.{_LAYER_NAMES[base]}.{kind}"
        else:
            base, _, kind = t.name.rpartition(".")
            if base == "rope_freqs":
                continue  # llama3 rope factors; the config's rope_scaling recomputes them
            name = f"{_GLOBAL_NAMES[base]}.{kind}"
        tensors[name] = np.ascontiguousarray(w)
    tok_json, tok_cfg = _tokenizer_files(reader)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
        (tmp / "tokenizer.json").write_text(json.dumps(tok_json, ensure_ascii=False))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False))
        (tmp / "generation_config.json").write_text(
            json.dumps({"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids[0]})
        )
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
