"""Model configuration, read from a Hugging Face config.json or a named shape: the Llama family (Llama, Qwen2,
Qwen3, SmolLM2) and the hybrid Qwen3-Next / Qwen3.5 family (gated DeltaNet linear-attention layers interleaved with
gated full-attention layers, dense or mixture-of-experts MLPs)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

# config.json model types this project loads: the Llama family, the hybrids (Qwen3-Next and Qwen3.5's language
# model, dense or MoE), and the multimodal Qwen3.5 checkpoints, whose language model (text_config) is what loads
HYBRID_TYPES = frozenset({"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"})
MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3"}) | HYBRID_TYPES
MULTIMODAL = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


class _Keys(dict):
    """config.json's keys: a missing required one is a ValueError that names the model type and the key."""

    def __init__(self, cfg: dict, model_type: str):
        super().__init__(cfg)
        self.model_type = model_type

    def __missing__(self, key):
        raise ValueError(f"config.json of model_type {self.model_type!r} has no {key!r}")


def _quantization_block(qc: dict | None) -> tuple[int, int] | None:
    """The weight block of a config.json's `quantization_config` (None: none): fine-grained FP8 with dynamic
    activations only; anything else is a ValueError naming the key (the schemes: backends/common/model/fp8.py)."""
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise ValueError("quantization_config: must be an object")
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported (supported: 'fp8')")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt {fmt!r} is not supported (supported: 'e4m3')")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"quantization_config.activation_scheme {scheme!r} is not supported (supported: 'dynamic')")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(
            f"quantization_config.weight_block_size {block!r}: fine-grained FP8 needs [rows, columns] (per-tensor "
            "FP8 is not supported)"
        )
    return block[0], block[1]


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
    # ---- hybrid (Qwen3-Next): absent for the Llama family ------------------------------------------------
    arch: str = "llama"  # "llama" (the Llama family) or "qwen3_next"
    layer_types: list[str] = field(default_factory=list)  # per layer "full_attention" or "linear_attention"
    partial_rotary_factor: float = 1.0  # rope on the first head_dim * factor dims of q and k
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    num_experts: int = 0  # 0: dense MLPs
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    mtp_layers: int = 0  # multi-token-prediction layers shipped with the weights (Qwen3-Next: 1)
    # Qwen3.5's interleaved multimodal rope: how many of the rotary frequencies follow each of an image token's
    # (t, row, column) positions; empty for text-only models (text positions are plain rope either way)
    mrope_section: list[int] = field(default_factory=list)
    # ---- weights ----------------------------------------------------------------------------------------------
    # "fp8": fine-grained FP8 projections (backends/common/model/fp8.py), from the checkpoint's
    # quantization_config or converted at load (`--quantization fp8`, the random `-fp8` shapes); "": as stored
    quantization: str = ""
    quant_block: list[int] = field(default_factory=lambda: [128, 128])  # weight_block_size: rows, columns

    @property
    def is_hybrid(self) -> bool:
        return self.arch == "qwen3_next"

    @property
    def full_layers(self) -> list[int]:
        """Indices of the layers that keep K/V per position (every layer of a Llama-family model)."""
        if not self.layer_types:
            return list(range(self.num_layers))
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_layers(self) -> list[int]:
        """Indices of the linear-attention layers, whose per-request state is fixed-size."""
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_value_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def state_floats_per_page(self) -> int:
        """float32 values of one request's linear-attention state: per linear layer, the conv inputs it keeps
        (conv_dim x (kernel - 1)) and the recurrent state (value heads x key dim x value dim)."""
        per_layer = self.conv_dim * (self.linear_conv_kernel_dim - 1) + (
            self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
        )
        return len(self.linear_layers) * per_layer

    def state_page_bytes(self) -> int:
        """Bytes of one state page (the pages are float32)."""
        return 4 * self.state_floats_per_page()

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        """A Hugging Face config.json. The Qwen3.5 checkpoints (`qwen3_5`, `qwen3_5_moe`: a vision tower beside the
        language model) give their `text_config`; an unknown model type or a missing key is a ValueError naming
        both."""
        model_type = cfg.get("model_type", "llama")
        if model_type in MULTIMODAL:
            text = cfg.get("text_config")
            if not isinstance(text, dict):
                raise ValueError(f"config.json of model_type {model_type!r} has no 'text_config'")
            text = {"tie_word_embeddings": cfg.get("tie_word_embeddings", False), **text}
            if cfg.get("quantization_config") and not text.get("quantization_config"):
                text["quantization_config"] = cfg["quantization_config"]
            return cls.from_hf({**text, "model_type": MULTIMODAL[model_type]})
        if model_type not in MODEL_TYPES:
            known = ", ".join(sorted(MODEL_TYPES | set(MULTIMODAL)))
            raise ValueError(f"model_type {model_type!r} is not supported (supported: {known})")
        cfg = _Keys(cfg, model_type)
        out = cls._from_qwen3_next(cfg) if model_type in HYBRID_TYPES else cls._from_llama(cfg)
        block = _quantization_block(cfg.get("quantization_config"))
        if block is not None:
            out.quantization, out.quant_block = "fp8", list(block)
        return out

    @classmethod
    def _from_llama(cls, cfg: dict) -> ModelConfig:
        model_type = cfg.model_type
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
    def _from_qwen3_next(cls, cfg: dict) -> ModelConfig:
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ValueError(f"rope type {kind!r} is not supported for {cfg.model_type} (default)")
        n = cfg["num_hidden_layers"]
        types = cfg.get("layer_types") or [
            "full_attention" if (i + 1) % cfg.get("full_attention_interval", 4) == 0 else "linear_attention"
            for i in range(n)
        ]
        if len(types) != n or set(types) - {"full_attention", "linear_attention"}:
            raise ValueError(f"layer_types must name {n} layers, each full_attention or linear_attention")
        eos = cfg.get("eos_token_id")
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            # an MoE text config (Qwen3.5-MoE) has no dense intermediate size: no layer uses one
            intermediate_size=cfg.get("intermediate_size")
            or (cfg["moe_intermediate_size"] if cfg.get("num_experts") else cfg["intermediate_size"]),
            num_layers=n,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", False),
            qk_norm=True,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            arch="qwen3_next",
            layer_types=list(types),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))),
            linear_num_key_heads=cfg["linear_num_key_heads"],
            linear_num_value_heads=cfg["linear_num_value_heads"],
            linear_key_head_dim=cfg["linear_key_head_dim"],
            linear_value_head_dim=cfg["linear_value_head_dim"],
            linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim", 4),
            num_experts=cfg.get("num_experts", 0),
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0),
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0),
            norm_topk_prob=cfg.get("norm_topk_prob", True),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
            mlp_only_layers=list(cfg.get("mlp_only_layers") or []),
            mtp_layers=cfg.get("num_nextn_predict_layers", cfg.get("mtp_num_hidden_layers", 0)),
            mrope_section=list(rope.get("mrope_section") or [11, 11, 10]) if cfg.model_type != "qwen3_next" else [],
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        return cls.from_hf(json.loads((Path(folder) / "config.json").read_text()))

    def to_hf(self) -> dict:
        """A config.json that transformers loads as the same model (used for the cached GGUF conversion)."""
        if self.is_hybrid:
            return self._to_hf_qwen3_next()
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

    def _to_hf_qwen3_next(self) -> dict:
        out = {
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": "qwen3_next",
            **{
                k: getattr(self, k)
                for k in (
                    "vocab_size",
                    "hidden_size",
                    "intermediate_size",
                    "head_dim",
                    "rms_norm_eps",
                    "max_position_embeddings",
                    "tie_word_embeddings",
                    "attention_bias",
                    "layer_types",
                    "linear_num_key_heads",
                    "linear_num_value_heads",
                    "linear_key_head_dim",
                    "linear_value_head_dim",
                    "linear_conv_kernel_dim",
                    "num_experts",
                    "num_experts_per_tok",
                    "moe_intermediate_size",
                    "shared_expert_intermediate_size",
                    "norm_topk_prob",
                    "decoder_sparse_step",
                    "mlp_only_layers",
                )
            },  # fmt: skip
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
                **({"mrope_section": self.mrope_section, "mrope_interleaved": True} if self.mrope_section else {}),
            },
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.mtp_layers:
            out["num_nextn_predict_layers"] = self.mtp_layers
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


def _every_fourth_full(n: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


# Qwen3-Next-80B-A3B's attention and linear-attention layer shapes and its 3:1 linear/full layer mix (public
# config.json), with a dense MLP of its intermediate size instead of the 512-expert MoE so that random weights fit
# one H200 (about 3.9 B parameters). For benchmarks of the hybrid path; not a real checkpoint.
SHAPES["qwen3-next-layout"] = ModelConfig(
    vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_layers=48, num_heads=16, num_kv_heads=2,
    head_dim=256, rope_theta=10000000.0, rms_norm_eps=1e-6, max_position_embeddings=262144, qk_norm=True,
    eos_token_ids=[151645], arch="qwen3_next", layer_types=_every_fourth_full(48), partial_rotary_factor=0.25,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    mtp_layers=1,
)  # fmt: skip
# A tiny hybrid for CPU tests: three linear layers and one full layer, an MoE MLP on every second layer.
SHAPES["tiny-hybrid"] = ModelConfig(
    vocab_size=320, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
    rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=4096, qk_norm=True, eos_token_ids=[2],
    arch="qwen3_next", layer_types=_every_fourth_full(4), partial_rotary_factor=0.25, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=48, decoder_sparse_step=2, mtp_layers=1,
)  # fmt: skip
# The same with dense MLPs: the CPU tests of the graph path (Triton's interpreter runs MoE layers slowly).
SHAPES["tiny-hybrid-dense"] = replace(SHAPES["tiny-hybrid"], num_experts=0)
# Qwen3.5-9B's language model: transformers' Qwen3_5TextConfig defaults (5.17) are that model's layout (32 layers,
# 3:1 linear/full, hidden 4,096, dense MLP of 12,288, gated attention 16 x 256 over 4 KV heads, 32 value heads of
# 128 over 16 key heads, vocabulary 248,320, rope on a quarter of each head) with its one MTP layer. The text
# positions of Qwen3.5's interleaved mRoPE are plain rope (all three sections see the same position), so the
# Qwen3-Next layers compute it. For benchmarks; weights random, about 9.7 B parameters.
SHAPES["qwen3.5-9b"] = ModelConfig(
    vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_layers=32, num_heads=16, num_kv_heads=4,
    head_dim=256, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=32768, qk_norm=True,
    arch="qwen3_next", layer_types=_every_fourth_full(32), partial_rotary_factor=0.25, linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, mtp_layers=1,
)  # fmt: skip
# Qwen3.5-35B-A3B's language model (transformers' Qwen3_5MoeTextConfig defaults): 40 layers, 256 experts of 512,
# 8 routed and one shared expert per token
SHAPES["qwen3.5-35b-a3b"] = ModelConfig(
    vocab_size=248320, hidden_size=2048, intermediate_size=512, num_layers=40, num_heads=16, num_kv_heads=2,
    head_dim=256, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=32768, qk_norm=True,
    arch="qwen3_next", layer_types=_every_fourth_full(40), partial_rotary_factor=0.25, linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, num_experts=256,
    num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512, mtp_layers=1,
)  # fmt: skip
# The same shapes with fine-grained FP8 projections (converted at load, as `--quantization fp8` converts a 16-bit
# checkpoint): the layout of Qwen's published FP8 checkpoints
for _name in ("llama3.1-8b", "qwen3.5-9b", "qwen3.5-35b-a3b", "tiny-test", "tiny-hybrid"):
    SHAPES[_name + "-fp8"] = replace(SHAPES[_name], quantization="fp8")
