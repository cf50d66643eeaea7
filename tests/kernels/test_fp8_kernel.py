"""kernels.fp8 (the W8A8 launch of fine-grained FP8 weights) against backends/common/model/fp8.py's float32
scheme, and the dense GPU model (`GpuLlama`, eager and decode graphs) with FP8 weights against the PyTorch model
with the same weights. On a CUDA GPU, or in Triton's CPU interpreter where there is none."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from backends.common.core.config import ModelConfig  # noqa: E402
from backends.common.model import fp8, loader  # noqa: E402
from backends.common.model.batch import Span, build_batch  # noqa: E402
from backends.common.model.kv_store import KVStore  # noqa: E402
from backends.common.model.model import LlamaModel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ACC = 1e-3 if DEVICE == "cuda" else 1e-5  # relative to the largest output


# rows up to kernels.fp8.FUSE_ROWS quantize x inside the GEMM; more rows go through _quant_kernel first
@pytest.mark.parametrize("M,N,K,group", [(1, 96, 256, 128), (5, 150, 200, 32), (40, 64, 128, 64), (130, 48, 96, 32)])
def test_w8a8_kernel_equals_the_scheme(M, N, K, group):
    from kernels import fp8 as k

    g = torch.Generator().manual_seed(M)
    # activations whose channel groups differ in magnitude by 1,000x, as a residual stream's do
    x = (torch.randn(M, K, generator=g) * torch.logspace(-2, 1, K)[None, :]).to(DEVICE)
    w = fp8.quantize(torch.randn(N, K, generator=g).to(DEVICE) * 0.05, (32, group))
    ref = fp8.w8a8(x, w)
    out = k.w8a8(x, w.q, w.scale, w.group)
    # float32 in, float32 out: the same quantized values, summed in another order (on the GPU the FP8 tensor
    # cores' own accumulation inside a column block keeps about 14 bits: DeepSeek-V3's report, 3.3.2)
    assert (out - ref).abs().max().item() <= ACC * ref.abs().max().item()
    # K in parts (added in part order) and the other activation path (quantized in the GEMM or before it)
    assert (k.w8a8(x, w.q, w.scale, w.group, splits=3) - ref).abs().max().item() <= ACC * ref.abs().max().item()
    bf = k.w8a8(x.bfloat16(), w.q, w.scale, w.group)
    assert bf.dtype == torch.bfloat16
    assert (bf.float() - fp8.w8a8(x.bfloat16(), w)).abs().max().item() <= 2**-7 * ref.abs().max().item()


def test_w8a8_kernel_refuses_a_block_the_tensor_cores_cannot_take():
    from kernels import fp8 as k

    w = fp8.quantize(torch.randn(16, 48), (16, 48))
    with pytest.raises(ValueError, match="column block .* 48"):
        k.w8a8(torch.randn(2, 48), w.q, w.scale, w.group)
    # the model's product falls back to the float32 scheme for such a checkpoint
    assert fp8.linear(torch.randn(2, 48), w).shape == (2, 16)


@pytest.mark.slow  # `make test` only: too long for `make test-fast`
def test_gpu_llama_with_fp8_weights_matches_the_pytorch_model():
    """Prefill, then decode steps replayed in the graphs (off CUDA the same replay path runs eagerly): logits of
    the GPU model with kernels.fp8's products equal the PyTorch model's float32 scheme on the same FP8 weights."""
    from backends.common.model.gpu_model import GpuLlama

    cfg = ModelConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=32, max_position_embeddings=512)  # fmt: skip
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    w = loader.random_weights(cfg, dtype, DEVICE, seed=3)
    fp8.quantize_weights(w, (32, 32))
    slots = 400
    kv_ref, kv_gpu = (KVStore.allocate(1, slots + 1, 2, 32, dtype, DEVICE) for _ in range(2))
    ref = LlamaModel(cfg, dict(w))
    gpu = GpuLlama(cfg, dict(w), kv_gpu, scratch_slot=slots, max_batch=4, graph_sizes=(1, 2, 4))
    assert gpu.quantized and gpu.linear_choice == {}
    tol = 5e-2 if dtype == torch.bfloat16 else 2e-3
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 128, (20 + 9 * i,), generator=gen).tolist() for i in range(3)]
    spans = [Span(s[:-3], 0, list(range(100 * i, 100 * i + len(s))), f"s{i}") for i, s in enumerate(seqs)]
    a = ref.forward(build_batch(spans, DEVICE), kv_ref)
    torch.testing.assert_close(gpu.forward(spans), a, atol=tol, rtol=tol)
    for t in range(3, 0, -1):
        step = [Span([s[-t]], len(s) - t, sp.slots, sp.key) for s, sp in zip(seqs, spans)]
        want = ref.forward(build_batch(step, DEVICE), kv_ref)
        tokens = gpu.greedy(step)
        torch.testing.assert_close(gpu.graph_logits[:3], want, atol=tol, rtol=tol)
        assert tokens == gpu.graph_logits[:3].argmax(-1).tolist()


def test_deterministic_mode_refuses_fp8_weights():
    from backends.common.engine.runner import ModelRunner

    with pytest.raises(loader.ModelError, match="FP8 weights are not covered"):
        ModelRunner("random:tiny-test-fp8", device=DEVICE, kv_tokens=64, backend="triton", deterministic=True)
