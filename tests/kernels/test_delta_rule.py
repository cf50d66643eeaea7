"""The gated delta rule kernels against the PyTorch reference (backends.common.model.delta_rule), in float32 as the
state is kept. Runs on a CUDA GPU, else on the CPU through Triton's interpreter (small shapes); needs triton."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from backends.common.model import delta_rule as dr  # noqa: E402
from kernels import delta_rule as kd  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it without a GPU
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)
# interpreter: the tiny model's shapes; GPU: Qwen3-Next's (32 value heads of 128 x 128)
SHAPES = [(2, 16, 32)] if DEVICE == "cpu" else [(2, 16, 32), (32, 128, 128)]


def inputs(T, H, DK, DV, gen):
    def r(*s):
        return torch.randn(*s, generator=gen)

    q = dr.l2norm(r(T, H, DK)) * DK**-0.5
    k = dr.l2norm(r(T, H, DK))
    g = -torch.rand(T, H, generator=gen) * 0.5
    beta = torch.rand(T, H, generator=gen)
    return [t.to(DEVICE) for t in (q, k, r(T, H, DV), g, beta)]


def state_pages(P, H, DK, DV, gen):
    """State views laid out as StateStore's: each page a row with other floats around the [H, DK, DV] block."""
    buf = (torch.randn(P, 7 + H * DK * DV + 5, generator=gen) * 0.1).to(DEVICE)
    return buf, buf[:, 7 : 7 + H * DK * DV].view(P, H, DK, DV)


@pytest.mark.parametrize("H,DK,DV", SHAPES)
def test_recurrent_step_updates_pages_in_place(H, DK, DV):
    gen = torch.Generator().manual_seed(H + DK)
    buf, state = state_pages(6, H, DK, DV, gen)
    pages = torch.tensor([4, 0, 2], device=DEVICE)
    q, k, v, g, beta = inputs(3, H, DK, DV, gen)
    ref_buf = buf.clone()
    ref = ref_buf[:, 7 : 7 + H * DK * DV].view(6, H, DK, DV)
    s = ref[pages]
    ref_o = dr.recurrent_step(q, k, v, g, beta, s)
    ref[pages] = s
    o = kd.recurrent_step(q, k, v, g, beta, state, pages)
    torch.testing.assert_close(o, ref_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(buf, ref_buf, atol=1e-5, rtol=1e-5)  # other pages and floats untouched


@pytest.mark.parametrize("low_precision", [False, True] if DEVICE == "cuda" else [False])
@pytest.mark.parametrize("H,DK,DV", SHAPES)
def test_chunked_varlen_equals_reference_and_recurrent(H, DK, DV, low_precision):
    """On the GPU also with the one-pass TF32 matmuls of 16-bit models (low_precision), at a tolerance 5x wider."""
    gen = torch.Generator().manual_seed(7 * H + DV)
    buf, state = state_pages(5, H, DK, DV, gen)
    lens = [1, 64, 70, 130]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    pages = [1, 3, 0, 4]
    q, k, v, g, beta = inputs(sum(lens), H, DK, DV, gen)
    ref_buf = buf.clone()
    ref = ref_buf[:, 7 : 7 + H * DK * DV].view(5, H, DK, DV)
    ref_o = torch.empty_like(v)
    for s0, n, pg in zip(starts, lens, pages):
        sl = slice(s0, s0 + n)
        ref_o[sl] = dr.recurrent(q[sl], k[sl], v[sl], g[sl], beta[sl], ref[pg])
    ints = lambda xs: torch.tensor(xs, device=DEVICE)  # noqa: E731
    o = kd.chunked(q, k, v, g, beta, state, ints(pages), ints(starts), ints(lens), low_precision=low_precision)
    tol = 1e-3 if low_precision else 2e-4
    torch.testing.assert_close(o, ref_o, atol=tol, rtol=tol)
    torch.testing.assert_close(buf, ref_buf, atol=tol, rtol=tol)
    # and the PyTorch chunked form agrees with the token-by-token one it is checked against
    s = torch.zeros(H, DK, DV, device=DEVICE)
    s2 = s.clone()
    torch.testing.assert_close(
        dr.chunked(q[:130], k[:130], v[:130], g[:130], beta[:130], s),
        dr.recurrent(q[:130], k[:130], v[:130], g[:130], beta[:130], s2),
        atol=1e-4,
        rtol=1e-4,
    )
    torch.testing.assert_close(s, s2, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("HK,H,DK,DV", [(1, 2, 16, 32)] + ([(16, 32, 128, 128)] if DEVICE == "cuda" else []))
def test_chunked_from_the_conv_output_equals_chunked_from_its_gates(HK, H, DK, DV):
    """chunked(raw=...) reads q, k, v from the conv output's rows (key heads shared by H / HK value heads) and b, a
    from the projection's columns, and computes the L2 norms and gates itself: the outputs and state pages of
    chunked on what HybridModel._qkv_gates computes from the same rows."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(HK + DV)
    lens = [3, 64, 70]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    T, kdim = sum(lens), HK * DK
    mixed = torch.randn(T, 2 * kdim + H * DV, generator=gen).to(DEVICE)
    proj = torch.randn(T, 5 + 2 * H, generator=gen).to(DEVICE)  # [.. | b | a]: strided column views
    b, a = proj[:, 5 : 5 + H], proj[:, 5 + H :]
    a_log, dt_bias = torch.rand(H, generator=gen).log().to(DEVICE), torch.randn(H, generator=gen).to(DEVICE)
    q = mixed[:, :kdim].reshape(T, HK, DK).repeat_interleave(H // HK, dim=1)
    k = mixed[:, kdim : 2 * kdim].reshape(T, HK, DK).repeat_interleave(H // HK, dim=1)
    v = mixed[:, 2 * kdim :].reshape(T, H, DV)
    q, k = dr.l2norm(q) * DK**-0.5, dr.l2norm(k)
    beta = torch.sigmoid(b)
    g = -a_log.exp() * F.softplus(a + dt_bias)
    buf, state = state_pages(4, H, DK, DV, gen)
    buf2 = buf.clone()
    state2 = buf2[:, 7 : 7 + H * DK * DV].view(4, H, DK, DV)
    ints = lambda xs: torch.tensor(xs, device=DEVICE)  # noqa: E731
    want = kd.chunked(q, k, v, g, beta, state, ints([2, 0, 3]), starts, lens)
    got = kd.chunked(None, None, None, None, None, state2, ints([2, 0, 3]), starts, lens,
                     raw=(mixed, b, a, a_log, dt_bias, HK))  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(buf2, buf, atol=1e-5, rtol=1e-5)
