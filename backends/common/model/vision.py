"""Qwen3.5's vision tower: what transformers' `Qwen3_5VisionModel` computes, on the prefill side only.

An image becomes patches of `temporal_patch_size x patch_size x patch_size` pixels per channel (the checkpoint's
own image processor cuts them: backends/common/model/multimodal.py); the tower embeds each patch (a Conv3d whose
kernel is its stride: one matmul), adds a learned position embedding resampled bilinearly to the image's grid,
runs `depth` pre-norm blocks (LayerNorm, attention within the image with a 2-D rotary embedding over the patch's
row and column, LayerNorm, a GELU MLP) and merges each 2 x 2 block of patches into one token of the language
model's width. Images attend only to themselves: every other step runs over all of a request's images at once,
attention per image through torch's SDPA.

The patch order, the resampling taps and the rotary positions come from transformers' `vision_utils` (the
helpers its own Qwen vision models call), so the tower and the processor agree on the layout by construction.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

PREFIXES = ("model.visual.", "visual.")  # the multimodal checkpoints' names of the tower's weights


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """The tower's shape (config.json's `vision_config`) and the token ids the language model sees around images."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    image_token_id: int = 248056
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054

    @classmethod
    def from_hf(cls, cfg: dict) -> VisionConfig | None:
        """The vision config of a multimodal config.json, None for a text-only one."""
        v = cfg.get("vision_config")
        if not isinstance(v, dict):
            return None
        ids = {k: cfg[k] for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id") if k in cfg}
        return cls(
            depth=v["depth"], hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
            num_heads=v["num_heads"], out_hidden_size=v["out_hidden_size"],
            num_position_embeddings=v.get("num_position_embeddings", 2304), patch_size=v.get("patch_size", 16),
            temporal_patch_size=v.get("temporal_patch_size", 2), spatial_merge_size=v.get("spatial_merge_size", 2),
            in_channels=v.get("in_channels", 3), hidden_act=v.get("hidden_act", "gelu_pytorch_tanh"),
            rope_theta=float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0)), **ids,
        )  # fmt: skip

    @classmethod
    def from_folder(cls, folder: Path | str | None) -> VisionConfig | None:
        if folder is None or not (Path(folder) / "config.json").is_file():
            return None
        return cls.from_hf(json.loads((Path(folder) / "config.json").read_text()))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch: channels x temporal patch x patch x patch (a row of the processor's pixel_values)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def tokens(self, grid_thw) -> int:
        """The language model's tokens for an image of this (t, h, w) patch grid: one per merged block."""
        t, h, w = (int(x) for x in grid_thw)
        return t * h * w // self.spatial_merge_size**2


# The towers of the `random:` shapes of Qwen3.5's published checkpoints: transformers' Qwen3_5VisionConfig defaults
# (5.17: 27 blocks of 1152 with 16 heads, MLP 4304, patches of 16 pixels merged 2 x 2, a 48 x 48 position table),
# which are the published checkpoints' towers, with out_hidden_size the language model's width
VISION_SHAPES = {
    "qwen3.5-9b": VisionConfig(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                               out_hidden_size=4096, num_position_embeddings=2304),
    "qwen3.5-35b-a3b": VisionConfig(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                                    out_hidden_size=2048, num_position_embeddings=2304),
}  # fmt: skip
# their image processor: Qwen3-VL's (transformers' Qwen2VL processor with patches of 16 and mean = std = 0.5)
RANDOM_PROCESSOR = dict(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)


def vision_config_of(src) -> VisionConfig | None:
    """The vision tower's config of a model source (loader.ModelSource): its folder's config.json, or a random
    shape's (VISION_SHAPES); None for a text-only model."""
    if src.folder is not None:
        return VisionConfig.from_folder(src.folder)
    return VISION_SHAPES.get(src.shape)


def load_vision_weights(folder: Path | str, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """The tower's weights of a checkpoint folder, named without their prefix (`blocks.0.attn.qkv.weight`)."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                prefix = next((p for p in PREFIXES if name.startswith(p)), None)
                if prefix is not None:
                    out[name[len(prefix) :]] = st.get_tensor(name).to(device=device, dtype=dtype)
    return out


def random_vision_weights(vc: VisionConfig, dtype: torch.dtype, device, seed: int = 0) -> dict[str, torch.Tensor]:
    """N(0, 0.02) weights, zero biases and unit norms for a `random:` shape's tower (drawn on the target device)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    d, f, m = vc.hidden_size, vc.intermediate_size, vc.hidden_size * vc.spatial_merge_size**2

    def w(*shape):
        return (torch.randn(*shape, generator=gen, device=device) * 0.02).to(dtype)

    def zeros(n):
        return torch.zeros(n, device=device, dtype=dtype)

    def ones(n):
        return torch.ones(n, device=device, dtype=dtype)

    out = {
        "patch_embed.proj.weight": w(d, vc.in_channels, vc.temporal_patch_size, vc.patch_size, vc.patch_size),
        "patch_embed.proj.bias": zeros(d), "pos_embed.weight": w(vc.num_position_embeddings, d),
        "merger.norm.weight": ones(d), "merger.norm.bias": zeros(d), "merger.linear_fc1.weight": w(m, m),
        "merger.linear_fc1.bias": zeros(m), "merger.linear_fc2.weight": w(vc.out_hidden_size, m),
        "merger.linear_fc2.bias": zeros(vc.out_hidden_size),
    }  # fmt: skip
    for i in range(vc.depth):
        p = f"blocks.{i}."
        out.update({
            p + "norm1.weight": ones(d), p + "norm1.bias": zeros(d), p + "norm2.weight": ones(d),
            p + "norm2.bias": zeros(d), p + "attn.qkv.weight": w(3 * d, d), p + "attn.qkv.bias": zeros(3 * d),
            p + "attn.proj.weight": w(d, d), p + "attn.proj.bias": zeros(d),
            p + "mlp.linear_fc1.weight": w(f, d), p + "mlp.linear_fc1.bias": zeros(f),
            p + "mlp.linear_fc2.weight": w(d, f), p + "mlp.linear_fc2.bias": zeros(d),
        })  # fmt: skip
    return out


def _act(name: str):
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name in ("silu", "swish"):
        return F.silu
    raise ValueError(f"vision_config.hidden_act {name!r} is not supported (gelu_pytorch_tanh, gelu, silu)")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class VisionTower:
    """The tower with its weights on one device; `encode` turns a request's preprocessed images into the rows the
    language model reads in place of the image tokens' embeddings."""

    def __init__(self, vc: VisionConfig, weights: dict[str, torch.Tensor]):
        self.vc, self.w = vc, weights
        proj = weights["patch_embed.proj.weight"]
        self.dtype, self.device = proj.dtype, proj.device
        self.patch_w = proj.reshape(proj.shape[0], -1)  # Conv3d with kernel = stride: a matmul over a patch's values
        self.side = int(math.isqrt(vc.num_position_embeddings))
        half = vc.head_dim // 2  # rows and columns each rotate half of a head
        self.inv_freq = 1.0 / (
            vc.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=self.device) / half)
        )
        self.act = _act(vc.hidden_act)
        self._layouts: dict[tuple, tuple] = {}  # grids -> their taps, weights and rotary cos/sin, on the device

    @classmethod
    def load(cls, folder, dtype: torch.dtype, device) -> VisionTower | None:
        """The tower of a checkpoint folder, None when it has none (a text-only model)."""
        vc = VisionConfig.from_folder(folder)
        if vc is None:
            return None
        weights = load_vision_weights(folder, dtype, device)
        if not weights:
            raise ValueError(f"model folder {folder}: config.json has a vision_config but no vision-tower weights")
        return cls(vc, weights)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.w.values())

    def _linear(self, x, name):
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def _norm(self, x, name):
        return F.layer_norm(x, x.shape[-1:], self.w[name + ".weight"], self.w[name + ".bias"], 1e-6)

    def _layout(self, grid_thw: torch.Tensor):
        """Per patch: the position embedding's resampling taps and weights and the (row, column) of its rotary
        embedding, in the processor's patch order (merge blocks of 2 x 2 together)."""
        from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

        m = self.vc.spatial_merge_size
        idx, wts = get_vision_interpolation_indices_and_weights(
            grid_thw, num_grid_per_side=self.side, mode="bilinear", align_corners=True, spatial_merge_size=m
        )
        return idx, wts, get_vision_position_ids(grid_thw, m)

    def _device_layout(self, grid_thw: torch.Tensor):
        """`_layout` on the device with the rotary cos/sin [N, 1, head_dim], kept per grids (the same image sizes
        come back: a request's recovery, a client's fixed resolution) so an encode computes them once; at most 64
        kept."""
        key = tuple(map(tuple, grid_thw.tolist()))
        hit = self._layouts.get(key)
        if hit is not None:
            return hit
        idx, wts, pos = self._layout(grid_thw)
        freqs = pos.to(self.device).float()[..., None] * self.inv_freq  # [N, 2, head_dim / 4]
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        cos, sin = torch.cat([freqs.cos()] * 2, -1)[:, None], torch.cat([freqs.sin()] * 2, -1)[:, None]
        if len(self._layouts) >= 64:
            self._layouts.pop(next(iter(self._layouts)))
        hit = self._layouts[key] = (idx.to(self.device), wts.to(self.device), cos, sin)
        return hit

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """Each image's merged tokens [tokens(grid), out_hidden_size] in the tower's dtype. pixel_values: the
        processor's [sum of t*h*w, patch_dim] rows, image after image; grid_thw: [images, 3]."""
        vc = self.vc
        grid_thw = grid_thw.to(device="cpu", dtype=torch.int64)
        x = pixel_values.to(device=self.device, dtype=self.dtype)
        if x.dim() != 2 or x.shape[1] != vc.patch_dim or x.shape[0] != int(grid_thw.prod(-1).sum()):
            raise ValueError(f"pixel_values {tuple(x.shape)} do not match image_grid_thw {grid_thw.tolist()}")
        h = F.linear(x, self.patch_w, self.w["patch_embed.proj.bias"])
        idx, wts, cos, sin = self._device_layout(grid_thw)
        table = self.w["pos_embed.weight"]
        h = h + (table[idx] * wts[:, :, None]).sum(1).to(h.dtype)  # float32 taps
        lens = grid_thw.prod(-1).tolist()
        for i in range(vc.depth):
            p = f"blocks.{i}."
            h = h + self._attention(self._norm(h, p + "norm1"), p + "attn", cos, sin, lens)
            h = h + self._linear(self.act(self._linear(self._norm(h, p + "norm2"), p + "mlp.linear_fc1")),
                                 p + "mlp.linear_fc2")  # fmt: skip
        merged = self._norm(h, "merger.norm").reshape(-1, vc.hidden_size * vc.spatial_merge_size**2)
        out = self._linear(F.gelu(self._linear(merged, "merger.linear_fc1")), "merger.linear_fc2")
        return list(out.split([n // vc.spatial_merge_size**2 for n in lens]))

    def _attention(self, x, name, cos, sin, lens: list[int]) -> torch.Tensor:
        """Attention of each image's patches among themselves (no mask within an image), rotary on q and k."""
        n, heads = x.shape[0], self.vc.num_heads
        q, k, v = self._linear(x, name + ".qkv").reshape(n, 3, heads, -1).unbind(1)
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        outs = []
        for qi, ki, vi in zip(q.split(lens), k.split(lens), v.split(lens)):
            # [1, heads, n, d]: torch's flash and memory-efficient kernels take 4-D inputs only; 3-D ones ran the
            # math path (the n x n scores in memory), 5.8x transformers' time on a 1,344-pixel image on an H100
            qi, ki, vi = (t.transpose(0, 1)[None] for t in (qi, ki, vi))
            o = F.scaled_dot_product_attention(qi, ki, vi)[0]
            outs.append(o.transpose(0, 1).reshape(o.shape[1], -1))
        return self._linear(torch.cat(outs), name + ".proj")
