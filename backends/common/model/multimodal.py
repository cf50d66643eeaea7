"""A request's images, from the bytes a client sends to what the language model reads.

- `ImageProcessor`: decodes PNG or JPEG bytes (Pillow) and preprocesses them with the checkpoint's own image
  processor from transformers (`preprocessor_config.json`: resizing, normalising, cutting into patches, the
  `image_grid_thw`), within the deployment's limits.
- `build`: the prompt with each image's one `<|image_pad|>` expanded to one per merged patch, and Qwen3.5's
  multimodal rotary positions (`mrope_positions`): text tokens count up as usual, an image's tokens take
  (t, row, column) positions from where the text stopped, and the text after an image goes on from the largest of
  them. What decode needs of it is one integer per request, `delta`: a generated token at index i of the sequence
  sits at position i + delta in all three sections.
- `Multimodal`: what a request carries from then on (the expanded ids, the positions, the preprocessed images and,
  once encoded, the vision tower's rows), sliced per span by the model (`positions`, `embeds`).

Nothing here unpickles or evaluates what a client sent: images are decoded by Pillow from their bytes only.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from backends.common.core.request import IMAGE_PLACEHOLDER as PLACEHOLDER
from backends.common.core.request import ParamError
from backends.common.model.vision import VisionConfig

MAX_IMAGES_PER_REQUEST = 8
MAX_IMAGE_PIXELS = 4096 * 4096
IMAGE_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff")  # how a PNG and a JPEG file start


class ImageError(ParamError):
    """An image input that cannot be served: INVALID_ARG (400 on the OpenAI endpoint) naming the input (`image`,
    `image_url`, ...)."""


@dataclass(slots=True)
class Image:
    """One preprocessed image: the processor's patch rows [t*h*w, patch_dim] (float32), its patch grid, and the
    SHA-256 of the decoded pixels (what the prefix caches key its tokens by: the same picture sent as PNG or as
    JPEG of the same pixels is the same image, two pictures never are)."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    digest: bytes

    @property
    def nbytes(self) -> int:
        return self.pixel_values.numel() * self.pixel_values.element_size()


def decode_image(data: bytes | str, field_name: str = "image", max_pixels: int = MAX_IMAGE_PIXELS):
    """A PIL image (RGB) from PNG or JPEG bytes, or from their base64 text (str, or bytes that do not start as a PNG
    or JPEG file does: base64's alphabet is ASCII, so the two never mix up); anything else is an ImageError naming
    `field_name`."""
    from PIL import Image as PILImage

    if isinstance(data, str) or not data.startswith(IMAGE_MAGIC):
        try:
            data = base64.b64decode(data.strip(), validate=True)
        except (binascii.Error, ValueError):
            raise ImageError(field_name, "not valid base64") from None
    if not data:
        raise ImageError(field_name, "empty image")
    try:
        with PILImage.open(io.BytesIO(data)) as im:
            if im.format not in ("PNG", "JPEG"):
                raise ImageError(field_name, f"{im.format or 'unknown'} image; PNG or JPEG only")
            w, h = im.size
            if w * h > max_pixels:
                raise ImageError(field_name, f"{w} x {h} pixels is more than the limit of {max_pixels:,}")
            return im.convert("RGB")
    except ImageError:
        raise
    except Exception as e:  # Pillow's errors for truncated or unknown data
        raise ImageError(field_name, f"not a decodable PNG or JPEG image ({type(e).__name__})") from None


class ImageProcessor:
    """The checkpoint's image processor (transformers' AutoImageProcessor from the model folder, its PIL backend)
    with the deployment's limits."""

    def __init__(self, hf, vc: VisionConfig, max_images: int = MAX_IMAGES_PER_REQUEST,
                 max_pixels: int = MAX_IMAGE_PIXELS):  # fmt: skip
        self.hf, self.vc, self.max_images, self.max_pixels = hf, vc, max_images, max_pixels
        # the processor's own resize rule (Qwen2-VL's smart_resize, which its get_number_of_image_patches follows and
        # vLLM counts placeholders with), found once: grids without pixels; None for a processor without it
        self._resize = None
        if hasattr(hf, "get_number_of_image_patches") and hasattr(hf, "merge_size"):
            import importlib

            self._resize = getattr(importlib.import_module(type(hf).__module__), "smart_resize", None)

    @classmethod
    def from_folder(cls, folder: Path | str, vc: VisionConfig, **limits) -> ImageProcessor:
        # (the module itself: the package-level name stands for the torchvision backend, not installed here)
        from transformers.models.auto.image_processing_auto import AutoImageProcessor

        # the PIL backend: the same pixels on every host (torchvision's may differ, and is not installed here)
        return cls(AutoImageProcessor.from_pretrained(str(folder), backend="pil"), vc, **limits)

    def __call__(self, images: list, field_name: str = "image", pixels: bool = True) -> list[Image]:
        """Each image (bytes, base64 text or a PIL image) preprocessed; too many is an ImageError. pixels=False:
        only each image's grid and digest (what expanding a prompt needs; the pixel rows empty), from the
        processor's own resize rule where it has one (Qwen2-VL's smart_resize), else from preprocessing it."""
        if len(images) > self.max_images:
            raise ImageError(field_name, f"{len(images)} images; at most {self.max_images} per request")
        out = []
        for i, data in enumerate(images):
            name = f"{field_name}[{i}]"
            im = data if hasattr(data, "convert") else decode_image(data, name, self.max_pixels)
            im = im if im.mode == "RGB" else im.convert("RGB")
            digest = hashlib.sha256(im.tobytes() + repr(im.size).encode()).digest()
            grid = None if pixels else self._grid(im.size, name)
            if grid is not None:
                out.append(Image(torch.empty(0, self.vc.patch_dim), grid, digest))
                continue
            res = self.hf(images=[im], return_tensors="pt")
            grid = tuple(int(x) for x in res["image_grid_thw"][0].tolist())
            values = res["pixel_values"].float()
            if values.shape[-1] != self.vc.patch_dim:
                raise ImageError(name, f"the image processor gives {values.shape[-1]} values per patch, the "
                                 f"vision tower takes {self.vc.patch_dim}")  # fmt: skip
            out.append(Image(values, grid, digest))
        return out

    def _grid(self, size: tuple[int, int], name: str) -> tuple[int, int, int] | None:
        """The patch grid the processor gives an image of `size` (width, height), without its pixels; None for a
        processor without its own resize rule."""
        if self._resize is None:
            return None
        hf, (w, h) = self.hf, size
        try:
            rh, rw = self._resize(h, w, hf.patch_size * hf.merge_size, min_pixels=hf.size["shortest_edge"],
                                  max_pixels=hf.size["longest_edge"])  # fmt: skip
        except ValueError as e:  # an aspect ratio beyond 200
            raise ImageError(name, str(e)) from None
        return 1, rh // hf.patch_size, rw // hf.patch_size


def image_processor_for(src, **limits) -> tuple[ImageProcessor | None, str]:
    """(the model's image processor, "") for a model source (loader.ModelSource) that takes images: a folder's own
    (preprocessor_config.json), or a random Qwen3.5 shape's (vision.RANDOM_PROCESSOR); else (None, why not)."""
    from backends.common.model.vision import RANDOM_PROCESSOR, vision_config_of

    vc = vision_config_of(src)
    if vc is None:
        return None, "it has no vision tower: text only"
    if src.folder is not None and not (Path(src.folder) / "preprocessor_config.json").is_file():
        return None, "its folder has a vision tower but no preprocessor_config.json (image processor)"
    try:
        if src.folder is None:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

            return ImageProcessor(Qwen2VLImageProcessorPil(**RANDOM_PROCESSOR), vc, **limits), ""
        return ImageProcessor.from_folder(src.folder, vc, **limits), ""
    except ImportError as e:  # transformers or Pillow missing or too old where this runs: text is still served
        return None, f"its image processor cannot be imported here ({type(e).__name__}: {e})"


def mrope_positions(ids: list[int], grids: list[tuple[int, int, int]], vc: VisionConfig) -> tuple[torch.Tensor, int]:
    """([3, len(ids)] int64 positions, delta) for an expanded prompt: Qwen3.5's get_rope_index for images. Text
    counts up in all three sections; an image's merged patches take (start, start + row, start + column) with
    start where the text stopped, and the text after it goes on from start + max(rows, columns)."""
    m = vc.spatial_merge_size
    pos = torch.empty(3, len(ids), dtype=torch.int64)
    i, cur, k = 0, 0, 0
    while i < len(ids):
        if ids[i] != vc.image_token_id:
            j = i
            while j < len(ids) and ids[j] != vc.image_token_id:
                j += 1
            pos[:, i:j] = torch.arange(cur, cur + j - i)
            cur += j - i
            i = j
            continue
        t, h, w = grids[k]
        gh, gw = h // m, w // m
        n = t * gh * gw
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        pos[0, i : i + n] = tt.flatten() + cur
        pos[1, i : i + n] = hh.flatten() + cur
        pos[2, i : i + n] = ww.flatten() + cur
        cur += max(h, w) // m
        i += n
        k += 1
    delta = (int(pos.max()) + 1 - len(ids)) if len(ids) else 0
    return pos, delta


@dataclass(slots=True)
class MMInfo:
    """What a request's images are to the language model, without their pixels: each image's patch grid and content
    digest, and the expanded prompt's length. It travels with the request (master -> decode -> prefill) as JSON:
    decode derives its positions and cache keys from it, prefill checks its own preprocessing against it."""

    grids: list[tuple[int, int, int]]
    digests: list[bytes]
    prompt_len: int

    def to_json(self) -> str:
        return json.dumps({"grids": [list(g) for g in self.grids], "digests": [d.hex() for d in self.digests],
                           "prompt_len": self.prompt_len})  # fmt: skip

    @classmethod
    def from_json(cls, text: str, field_name: str = "mm_info") -> MMInfo:
        try:
            d = json.loads(text)
            grids = [tuple(int(x) for x in g) for g in d["grids"]]
            digests = [bytes.fromhex(h) for h in d["digests"]]
            prompt_len = int(d["prompt_len"])
        except (ValueError, KeyError, TypeError) as e:
            raise ParamError(field_name, f"malformed ({type(e).__name__}: {e})") from None
        if len(grids) != len(digests) or not grids or any(len(g) != 3 or min(g) < 1 for g in grids):
            raise ParamError(field_name, "needs one (t, h, w) grid and one digest per image")
        return cls(grids, digests, prompt_len)


@dataclass(slots=True)
class Multimodal:
    """A request's multimodal part from preprocessing to its end: the spans of its images' tokens in the expanded
    prompt, their grids and digests, the prompt's positions, and where the tower runs (prefill, the offline
    engine) the preprocessed images and, once encoded, the tower's rows (kept while the request lives, so a
    recovery re-encodes nothing). Decode's has no images: it computes no prompt token of such a request."""

    images: list[Image]
    spans: list[tuple[int, int]]  # (first token, count) of each image in the expanded prompt
    positions_3d: torch.Tensor  # [3, prompt length] int64
    delta: int
    grids: list[tuple[int, int, int]] = field(default_factory=list)
    digests: list[bytes] = field(default_factory=list)
    embeds: list[torch.Tensor] | None = None  # one [count, hidden] per image, from the vision tower
    encodes: int = field(default=0)  # how many times the tower ran for this request (1 once encoded)

    @property
    def info(self) -> MMInfo:
        return MMInfo(list(self.grids), list(self.digests), self.prompt_len)

    @classmethod
    def from_expanded(cls, ids: list[int], info: MMInfo, vc: VisionConfig, images: list[Image] | None = None,
                      field_name: str = "mm_info") -> Multimodal:  # fmt: skip
        """The multimodal part of an already expanded request (ids: its prompt, maybe followed by output): image
        token runs where `info`'s grids say, else a ParamError; `images`, when given, must be the same images
        (grids and digests)."""
        m = vc.spatial_merge_size**2
        prompt = ids[: info.prompt_len]
        if len(prompt) != info.prompt_len:
            raise ParamError(field_name, f"prompt_len {info.prompt_len} is beyond the {len(ids)} ids")
        spans, i = [], 0
        for g in info.grids:
            n = g[0] * g[1] * g[2] // m
            while i < len(prompt) and prompt[i] != vc.image_token_id:
                i += 1
            if prompt[i : i + n] != [vc.image_token_id] * n or (
                i + n < len(prompt) and prompt[i + n] == vc.image_token_id
            ):
                raise ParamError(field_name, f"the prompt has no run of {n} image tokens for image {len(spans)}")
            spans.append((i, n))
            i += n
        if vc.image_token_id in prompt[i:]:
            raise ParamError(field_name, "the prompt has more image tokens than its images")
        if images is not None and (
            [im.grid_thw for im in images] != info.grids or [im.digest for im in images] != info.digests
        ):
            raise ParamError(field_name, "the images differ from the ones the request was expanded for")
        pos, delta = mrope_positions(prompt, info.grids, vc)
        return cls(images or [], spans, pos, delta, list(info.grids), list(info.digests))

    @property
    def prompt_len(self) -> int:
        return self.positions_3d.shape[1]

    @property
    def nbytes(self) -> int:
        kept = sum(im.nbytes for im in self.images) + self.positions_3d.numel() * 8
        return kept + sum(e.numel() * e.element_size() for e in self.embeds or [])

    def positions(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] positions of the sequence's tokens [start, end): the prompt's own, then i + delta."""
        out = (torch.arange(start, end) + self.delta).expand(3, -1).clone()
        a = min(end, self.prompt_len)
        if a > start:
            out[:, : a - start] = self.positions_3d[:, start:a]
        return out

    def embeds_in(self, start: int, end: int) -> list[tuple[int, torch.Tensor]]:
        """(offset from start, rows) of the image tokens among the sequence's tokens [start, end)."""
        if self.embeds is None:
            raise RuntimeError("the request's images were not encoded before its prefill")
        out = []
        for (s, n), e in zip(self.spans, self.embeds):
            a, b = max(s, start), min(s + n, end)
            if a < b:
                out.append((a - start, e[a - s : b - s]))
        return out

    def cache_keys(self, ids: list[int]) -> list[int]:
        """The prompt's ids with each image's tokens replaced by keys derived from the image's digest (negative,
        so no text token can equal them): what the prefix caches compare, so that two requests share K/V and
        state over an image only when it is the same image."""
        keys = list(ids)
        for (s, n), digest in zip(self.spans, self.digests):
            base = int.from_bytes(digest[:7], "little")
            for j in range(n):
                keys[s + j] = -1 - ((base + j) & ((1 << 62) - 1))
        return keys


def build(ids: list[int], images: list[Image], vc: VisionConfig, field_name: str = "image"):
    """(expanded ids, Multimodal): each image placeholder `<|image_pad|>` in `ids` (one per image, in order)
    becomes one per merged patch of its image. A count that differs from the images' is an ImageError."""
    at = [i for i, t in enumerate(ids) if t == vc.image_token_id]
    if len(at) != len(images):
        raise ImageError(field_name, f"{len(images)} image(s) but {len(at)} image placeholder(s) ({PLACEHOLDER}) "
                         "in the prompt")  # fmt: skip
    out, spans, prev = [], [], 0
    for i, im in zip(at, images):
        out.extend(ids[prev:i])
        n = vc.tokens(im.grid_thw)
        spans.append((len(out), n))
        out.extend([vc.image_token_id] * n)
        prev = i + 1
    out.extend(ids[prev:])
    grids = [im.grid_thw for im in images]
    pos, delta = mrope_positions(out, grids, vc)
    return out, Multimodal(images, spans, pos, delta, grids, [im.digest for im in images])


def prompt_ids(tokenizer, vc: VisionConfig, text: str, images: int, chat: bool) -> list[int]:
    """A prompt's ids with room for `images` images: the text's own placeholders (PLACEHOLDER, one per image, in
    order), or, in a chat prompt without any, one per image before the text of the user turn."""
    if chat and images and "<|image_pad|>" not in text:
        text = PLACEHOLDER * images + text
    ids = tokenizer.encode_chat(text) if chat else tokenizer.encode(text)
    if images and vc.image_token_id not in ids:
        raise ImageError("image", f"{images} image(s), but the prompt has no {PLACEHOLDER} and no chat template "
                         "puts them (--chat)")  # fmt: skip
    return ids
