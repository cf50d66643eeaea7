"""Fine-grained FP8 weights (the layout of Qwen's and DeepSeek's FP8 checkpoints) and the W8A8 arithmetic they
are served with.

A checkpoint stores each converted projection as `<name>.weight` in float8 e4m3 and `<name>.weight_scale_inv`,
one float per block of `weight_block_size` (rows x columns, [128, 128] as published): the weight is
`q * scale_inv` block by block. Activations are quantized on the fly (`activation_scheme: dynamic`): per token and
per group of as many channels as a weight block has columns, to e4m3 with scale amax / 448. A product is then

    y[t, n] = sum over column blocks b of  scale_x[t, b] * scale_w[n, b] * (q_x[t, b-block] . q_w[n, b-block])

`Fp8Weight` keeps the e4m3 values and the scales expanded along the rows ([..., N, column blocks]), so that
fusing projections (concatenating rows, permuting them, stacking experts) is exact for any row count: the cost
is one float32 per row and column block, 1/32 of the weight's bytes at 128 columns. Modules a checkpoint leaves
unconverted (norms, the LM head and embeddings, routers, Qwen3.5's in_proj_a/b and conv) stay plain tensors;
a fused projection of converted and unconverted parts is a `RowParts`.

`linear(x, w)` is the one product every model calls: `F.linear` for a tensor, the scheme above for an
`Fp8Weight` (here in float32 from the dequantized blocks and the quantized activations: the CPU path, and the
reference the GPU kernels are tested against)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
BLOCK = (128, 128)  # the published weight_block_size: rows, columns
EPS = 1e-10  # the smallest amax a group or block is scaled by (an all-zero group quantizes to zeros)


class QuantError(ValueError):
    """A quantized checkpoint that cannot be loaded; the message names the tensor or the config key."""


@dataclass(slots=True)
class Fp8Weight:
    q: torch.Tensor  # [..., N, K] float8 e4m3
    scale: torch.Tensor  # [..., N, ceil(K / group)] float32: each row's scale per column block
    group: int  # columns per block: also the activations' group size

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    def __getitem__(self, index) -> Fp8Weight:  # an expert of a stack, or rows
        return Fp8Weight(self.q[index], self.scale[index], self.group)

    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        K = self.q.shape[-1]
        s = self.scale.repeat_interleave(self.group, dim=-1)[..., :K]
        return (self.q.float() * s).to(dtype)


@dataclass(slots=True)
class RowParts:
    """A fused projection whose row ranges differ in kind (FP8 rows, then 16-bit rows): the outputs of its parts,
    side by side."""

    parts: list

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]))

    @property
    def device(self) -> torch.device:
        return self.parts[0].device


def is_quantized(w) -> bool:
    return isinstance(w, (Fp8Weight, RowParts))


# ---- the published block scheme ----------------------------------------------------------------------------------
def quantize_blocks(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scale_inv [ceil(N / rows), ceil(K / columns)] float32) of a 16- or 32-bit [N, K] matrix, as
    the published checkpoints hold it: each block scaled so that its largest magnitude is 448."""
    N, K = w.shape
    bn, bk = block
    nb, kb = math.ceil(N / bn), math.ceil(K / bk)
    padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    padded[:N, :K] = w.float()
    blocks = padded.view(nb, bn, kb, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=EPS) / FP8_MAX  # [nb, kb]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(nb * bn, kb * bk)[:N, :K].contiguous(), scale


def from_blocks(name: str, q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> Fp8Weight:
    """A checkpoint's `name` (e4m3, [N, K] or stacked experts [E, N, K]) and its `name`_scale_inv, checked: a
    wrong dtype or a scale of the wrong shape is a QuantError naming the tensor."""
    if q.dtype != FP8:
        raise QuantError(f"{name}: a weight with a scale_inv must be float8_e4m3fn, got {q.dtype}")
    if not scale_inv.is_floating_point() or scale_inv.dtype == FP8:
        raise QuantError(f"{name}_scale_inv: must be float32 or 16-bit, got {scale_inv.dtype}")
    bn, bk = block
    *lead, N, K = q.shape
    want = (*lead, math.ceil(N / bn), math.ceil(K / bk))
    if tuple(scale_inv.shape) != want:
        raise QuantError(
            f"{name}_scale_inv: shape {tuple(scale_inv.shape)} does not match the weight {tuple(q.shape)} in "
            f"blocks of {bn} x {bk} (expected {want})"
        )
    s = scale_inv.float()
    if not torch.isfinite(s).all() or (s < 0).any():
        raise QuantError(f"{name}_scale_inv: scales must be finite and not negative")
    rows = s.repeat_interleave(bn, dim=-2)[..., :N, :].contiguous()
    return Fp8Weight(q.contiguous(), rows, bk)


def quantize(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> Fp8Weight:
    """A 16- or 32-bit matrix (or a stack of experts) as the published scheme would store it (`--quantization fp8`)."""
    if w.dim() == 3:
        parts = [quantize(e, block) for e in w]
        return Fp8Weight(torch.stack([p.q for p in parts]), torch.stack([p.scale for p in parts]), block[1])
    q, scale = quantize_blocks(w, block)
    return from_blocks("quantize", q, scale, block)


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [T, K], float32 scales [T, ceil(K / group)]) of activations x [T, K]: per token and channel group,
    scaled so that the group's largest magnitude is 448."""
    T, K = x.shape
    kb = math.ceil(K / group)
    padded = torch.zeros(T, kb * group, dtype=torch.float32, device=x.device)
    padded[:, :K] = x.float()
    g = padded.view(T, kb, group)
    scale = g.abs().amax(dim=-1).clamp(min=EPS) / FP8_MAX
    q = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(T, kb * group)[:, :K], scale


def w8a8(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """x [T, K] times an FP8 weight [N, K] in the W8A8 scheme, float32 [T, N]. Each column block's dot product of
    e4m3 values is computed in float64, where it is exact (a product of two e4m3 values has 8 significant bits,
    and 128 of them sum within 53), then scaled and summed over the blocks in order: a row's result does not
    depend on the other rows of the batch or on the BLAS build. The quantization would turn the last-bit
    differences of a batch-dependent sum into whole e4m3 steps, and served answers paused and recomputed in
    other batches would then differ from the unpaused ones."""
    qx, sx = quantize_activations(x.reshape(-1, x.shape[-1]), w.group)
    K, g = x.shape[-1], w.group
    y = torch.zeros(qx.shape[0], w.q.shape[0], dtype=torch.float64, device=x.device)
    for b in range(w.scale.shape[-1]):
        cols = slice(b * g, min(K, (b + 1) * g))
        dots = qx[:, cols].double() @ w.q[:, cols].double().t()
        y += dots * sx[:, b, None].double() * w.scale[None, :, b].double()
    return y.float()


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None, kernel: bool | None = None) -> torch.Tensor:
    """F.linear for a plain weight; the W8A8 product for an Fp8Weight (in x's dtype); each part's for RowParts.
    kernel: the product in kernels.fp8 (FP8 tensor cores; Triton's interpreter on the CPU); None: on a CUDA
    device, where its column block allows (kernels.fp8.supported), else here in float32."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    if isinstance(w, RowParts):
        y = torch.cat([linear(x, p, kernel=kernel) for p in w.parts], dim=-1)
        return y if bias is None else y + bias
    rows = x.reshape(-1, x.shape[-1])
    if kernel is None:
        kernel = w.q.is_cuda and _kernels().supported(w.group)
    if kernel:
        y = _kernels().w8a8(rows, w.q, w.scale, w.group).view(*x.shape[:-1], -1)
        return y if bias is None else y + bias
    y = w8a8(rows, w).view(*x.shape[:-1], -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _kernels():
    from kernels import fp8 as k

    return k


# ---- fusing projections ------------------------------------------------------------------------------------------
def cat_rows(parts: list):
    """One matrix of the parts' rows, in order: a tensor, an Fp8Weight (every part FP8 with one block width) or a
    RowParts (kinds mixed)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    flat = []
    for p in parts:
        flat.extend(p.parts if isinstance(p, RowParts) else [p])
    runs: list = []  # neighbouring parts of one kind merged
    for p in flat:
        last = runs[-1] if runs else None
        if isinstance(p, torch.Tensor) and isinstance(last, torch.Tensor):
            runs[-1] = torch.cat((last, p))
        elif isinstance(p, Fp8Weight) and isinstance(last, Fp8Weight) and last.group == p.group:
            runs[-1] = Fp8Weight(torch.cat((last.q, p.q)), torch.cat((last.scale, p.scale)), p.group)
        else:
            runs.append(p)
    return runs[0] if len(runs) == 1 else RowParts(runs)


def take_rows(w, index: torch.Tensor):
    """w's rows in the order of `index` (a permutation of row numbers)."""
    if isinstance(w, torch.Tensor):
        return w[index].contiguous()
    if isinstance(w, Fp8Weight):
        return Fp8Weight(w.q[index].contiguous(), w.scale[index].contiguous(), w.group)
    raise QuantError("a projection fused from FP8 and 16-bit rows cannot be reordered")


def stack(weights: list):
    """Experts' matrices as one [E, N, K] stack (tensors or Fp8Weights, all of one kind)."""
    if all(isinstance(w, torch.Tensor) for w in weights):
        out = torch.empty((len(weights),) + tuple(weights[0].shape), dtype=weights[0].dtype, device=weights[0].device)
        for e, w in enumerate(weights):
            out[e].copy_(w)
        return out
    if all(isinstance(w, Fp8Weight) for w in weights):
        return Fp8Weight(torch.stack([w.q for w in weights]), torch.stack([w.scale for w in weights]),
                         weights[0].group)  # fmt: skip
    raise QuantError("experts of one layer must all be FP8 or all 16-bit")


# ---- which projections a 16-bit checkpoint converts (`--quantization fp8`) --------------------------------------
# The projections Qwen's FP8 checkpoints convert: attention, linear attention's qkv, z and out, the MLPs, the
# shared expert and every routed expert. Everything else (embeddings, LM head, norms, routers and the shared
# expert's gate, in_proj_a/b/ba, the conv, the MTP head's fc) stays as loaded.
CONVERTED = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
    "linear_attn.out_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight",
    "experts.gate_up_proj", "experts.down_proj",
)  # fmt: skip


def quantize_weights(weights: dict, block: tuple[int, int] = BLOCK) -> int:
    """Convert, in place, the projections the published checkpoints convert (`CONVERTED`) that are still 16- or
    32-bit; returns how many."""
    n = 0
    for name in list(weights):
        w = weights[name]
        if isinstance(w, torch.Tensor) and name.endswith(CONVERTED) and w.dim() in (2, 3):
            weights[name] = quantize(w, block)
            n += 1
    return n
