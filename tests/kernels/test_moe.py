"""The fused MoE kernels (kernels.moe) against the loop over experts (HybridModel.mlp's routed part), on a CUDA GPU
in bfloat16 and on the CPU through Triton's interpreter in float32: batches of 1 and more, experts that get no token,
every block of the grid used or not."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it without a GPU
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

from kernels import moe  # noqa: E402

DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
TOL = dict(atol=2e-2, rtol=2e-2) if DTYPE == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)


def loop_reference(x, top_i, top_w, gate_up, down, linear=lambda a, w: F.linear(a, w.float())):
    """HybridModel.mlp's routed part, in float32; linear(x, an expert's matrix) is each product."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in top_i.unique().tolist():
        tok, slot = torch.where(top_i == e)
        g, u = linear(x[tok].float(), gate_up[e]).chunk(2, dim=-1)
        out.index_add_(0, tok, linear(F.silu(g) * u, down[e]) * top_w[tok, slot, None].float())
    return out


def weights(E, H, I, seed):  # noqa: E741
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(DEVICE, DTYPE)
    down = (torch.randn(E, H, I, generator=g) * 0.1).to(DEVICE, DTYPE)
    return gate_up, down


@pytest.mark.parametrize(
    "settings",
    [dict(small_batch=0), dict(small_batch=8, small_preload=False), dict(small_batch=8, small_preload=True)],
    ids=["grouped", "matrix-vector", "matrix-vector, down preloaded"],
)
@pytest.mark.parametrize("T,E,K,H,I", [(1, 8, 2, 64, 32), (5, 8, 3, 64, 48), (37, 16, 4, 96, 32)])
def test_routed_equals_the_loop_over_experts(T, E, K, H, I, settings):  # noqa: E741
    """Both paths of `routed`: grouped GEMMs after the alignment, and (a few tokens) one matrix-vector product
    per pair and per token (the down projection's experts and weights read before the wait, or after)."""
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).to(DEVICE, DTYPE)
    probs = torch.softmax(torch.randn(T, E, generator=g), -1)
    probs[:, E - 1] = 0.0  # the last expert is never routed to: its blocks stay unused
    top_w, top_i = torch.topk(probs, K, dim=-1)
    top_w, top_i = top_w.to(DEVICE, DTYPE), top_i.to(DEVICE)
    gate_up, down = weights(E, H, I, seed=T + 1)
    got = moe.routed(x, top_i, top_w, gate_up, down, settings=settings)
    torch.testing.assert_close(got.float(), loop_reference(x, top_i, top_w, gate_up, down), **TOL)


def test_align_groups_pairs_by_expert_in_whole_blocks():
    top_i = torch.tensor([[3, 0], [3, 1], [0, 3]], device=DEVICE)
    pairs, block_expert = moe.align(top_i, num_experts=5, block_m=4)
    n = top_i.numel()
    assert pairs.numel() == 4 * block_expert.numel() and pairs.numel() >= n + 3 * 3
    used = [int(e) for e in block_expert.tolist() if e >= 0]
    assert used == [0, 1, 3]  # experts in order, one block each (at most 4 pairs per expert here)
    for b, e in enumerate(block_expert.tolist()):
        rows = [int(p) for p in pairs[4 * b : 4 * b + 4].tolist() if p < n]
        assert all(int(top_i.reshape(-1)[p]) == e for p in rows)
    real = sorted(int(p) for p in pairs.tolist() if p < n)
    assert real == list(range(n))  # every pair exactly once


@pytest.mark.parametrize("T,E,K", [(1, 256, 8), (7, 64, 4), (300, 16, 2), (128, 257, 9)])
def test_align_kernel_equals_the_pytorch_form(T, E, K):
    g = torch.Generator().manual_seed(E + T)
    top_i = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(DEVICE)
    top_i[: T // 2] = top_i[0]  # crowd one set of experts: runs longer than a block
    P = moe.align_bound(top_i.numel(), E, moe.BLOCK_M)
    got = moe.align(top_i, E)
    want = moe._align_torch(top_i, E, moe.BLOCK_M, P)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("norm", [True, False])
def test_route_equals_softmax_then_topk(norm):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 40, generator=g).to(DEVICE, DTYPE)
    top_w, top_i = moe.route(logits, 6, norm, DTYPE)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    want_w, want_i = torch.topk(probs, 6, dim=-1)
    if norm:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert torch.equal(top_i.long(), want_i)
    rtol = 1e-6 if DTYPE == torch.float32 else 1e-2  # softmax sums in another order: last-bit differences
    torch.testing.assert_close(top_w.float(), want_w.to(DTYPE).float(), atol=0, rtol=rtol)


def test_routed_adds_the_gated_shared_expert():
    T, E, K, H, I = 6, 8, 2, 64, 32  # noqa: E741
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, H, generator=g).to(DEVICE, DTYPE)
    top_w, top_i = torch.topk(torch.softmax(torch.randn(T, E, generator=g), -1), K, dim=-1)
    top_w, top_i = top_w.to(DEVICE, DTYPE), top_i.to(DEVICE)
    gate_up, down = weights(E, H, I, seed=5)
    shared = torch.randn(T, H, generator=g).to(DEVICE, DTYPE)
    gate = torch.randn(T, 1, generator=g).to(DEVICE, DTYPE)
    got = moe.routed(x, top_i, top_w, gate_up, down, shared=(gate, shared))
    want = loop_reference(x, top_i, top_w, gate_up, down) + torch.sigmoid(gate.float()) * shared.float()
    torch.testing.assert_close(got.float(), want, **TOL)


def test_route_appends_the_shared_expert_as_the_last_pair():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 17, generator=g).to(DEVICE, DTYPE)  # 16 experts, then the shared expert's gate
    top_w, top_i = moe.route(logits, 3, True, DTYPE, num_experts=16, shared=True)
    plain_w, plain_i = moe.route(logits[:, :16].contiguous(), 3, True, DTYPE)
    assert top_i.shape == (5, 4) and torch.equal(top_i[:, :3], plain_i) and (top_i[:, 3] == 16).all()
    assert torch.equal(top_w[:, :3], plain_w)
    torch.testing.assert_close(top_w[:, 3].float(), torch.sigmoid(logits[:, 16].float()).to(DTYPE).float())


@pytest.mark.parametrize("T,E,K,H,I,group", [(1, 4, 2, 256, 64, 128), (19, 6, 3, 96, 80, 32)])
def test_fp8_experts_equal_the_loop_over_the_w8a8_scheme(T, E, K, H, I, group):  # noqa: E741
    """Experts with fine-grained FP8 weights (e4m3 and a float32 scale per row and column block, as the checkpoints
    store them): `routed(fp8=...)` against the loop over experts with backends/common/model/fp8.py's W8A8 scheme
    (activations quantized per token and column block, each block's product times both scales), column blocks
    that do not divide the width included. A batch of one token takes the grouped path too."""
    from backends.common.model import fp8

    g = torch.Generator().manual_seed(T + group)
    # activations whose channel groups differ in magnitude, as a residual stream's do
    x = (torch.randn(T, H, generator=g) * torch.logspace(-1, 1, H)[None, :]).to(DEVICE, DTYPE)
    probs = torch.softmax(torch.randn(T, E, generator=g), -1)
    top_w, top_i = torch.topk(probs, K, dim=-1)
    top_w, top_i = top_w.to(DEVICE, DTYPE), top_i.to(DEVICE)
    gate_up = fp8.quantize((torch.randn(E, 2 * I, H, generator=g) * 0.1).to(DEVICE), (32, group))
    down = fp8.quantize((torch.randn(E, H, I, generator=g) * 0.1).to(DEVICE), (32, group))
    got = moe.routed(x, top_i, top_w, gate_up.q, down.q, fp8=(gate_up.scale, down.scale, group))
    want = loop_reference(x, top_i, top_w, gate_up, down, linear=lambda a, w: fp8.linear(a, w, kernel=False))
    acc = 2e-3 if DEVICE == "cuda" else 1e-5  # relative to the largest output (the FP8 tensor cores: test_fp8_kernel)
    err = (got.float() - want).abs().max() / want.abs().max()
    assert err <= acc, err
    if T == 1:  # the activations' rounding shows: dequantized weights alone are further off than that
        plain = moe.routed(x, top_i, top_w, gate_up.dequantize(DTYPE), down.dequantize(DTYPE))
        assert (plain.float() - want).abs().max() / want.abs().max() > 10 * err


def test_fp8_experts_refuse_a_column_block_the_kernel_cannot_take():
    from backends.common.model import fp8

    x = torch.randn(3, 48, device=DEVICE, dtype=DTYPE)
    top_w, top_i = torch.topk(torch.softmax(torch.randn(3, 4), -1), 2, dim=-1)
    w = fp8.quantize(torch.randn(4, 96, 48, device=DEVICE) * 0.1, (32, 24))
    d = fp8.quantize(torch.randn(4, 48, 48, device=DEVICE) * 0.1, (32, 24))
    with pytest.raises(ValueError, match="column block must be a multiple of 32"):
        moe.routed(x, top_i.to(DEVICE), top_w.to(DEVICE, DTYPE), w.q, d.q, fp8=(w.scale, d.scale, 24))
