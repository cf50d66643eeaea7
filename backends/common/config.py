"""Model configuration of the Llama family, read from a Hugging Face config.json or a named shape."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q, k and v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rope
    rope_scaling: dict | None = None  # {"rope_type": "llama3", "factor": .., ...}
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        model_type = cfg.get("model_type", "llama")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        if scaling is not None:
            scaling = dict(scaling)
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ("default", "llama3"):
                raise ValueError(f"rope_scaling type {kind!r} is not supported (default, llama3)")
            scaling = scaling if kind == "llama3" else None
        theta = cfg.get("rope_theta")
        if theta is None:
            theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=float(theta),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type in ("qwen3",),
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        return cls.from_hf(json.loads((Path(folder) / "config.json").read_text()))

    def to_hf(self) -> dict:
        """A config.json that transformers loads as the same model (used for the cached GGUF conversion)."""
        model_type = "qwen3" if self.qk_norm else ("qwen2" if self.attention_bias else "llama")
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
        out = {
            "architectures": [arch[model_type]],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if model_type == "llama":
            out["attention_bias"] = self.attention_bias
        if self.rope_scaling:
            out["rope_scaling"] = self.rope_scaling
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            out["eos_token_id"] = self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else self.eos_token_ids
        return out

    def as_dict(self) -> dict:
        return asdict(self)


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Shapes for random-weight benchmarks (`random:<name>`), copied from the public config.json of each model.
SHAPES: dict[str, ModelConfig] = {
    "llama3-8b": ModelConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rope_scaling=LLAMA3_ROPE,
        bos_token_id=128000,
        eos_token_ids=[128001, 128008, 128009],
    ),
    "qwen3-8b": ModelConfig(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        qk_norm=True,
        eos_token_ids=[151645],
    ),
    "qwen3-0.6b": ModelConfig(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        qk_norm=True,
        tie_word_embeddings=True,
        eos_token_ids=[151645],
    ),
    "smollm2-135m": ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=[2],
    ),
}
SHAPES["llama3.1-8b"] = SHAPES["llama3-8b"]
SHAPES["tiny-test"] = ModelConfig(
    vocab_size=320, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
    max_position_embeddings=4096, rope_theta=10000.0, eos_token_ids=[2],
)  # fmt: skip
