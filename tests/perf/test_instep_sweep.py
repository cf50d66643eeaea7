"""perf/instep_sweep.py on the CPU (the sweep itself needs a GPU): every skinny_linear setting it swaps into the
decode step runs and gives the product, and each stand-in it puts in a kernel's place takes that kernel's
arguments, so a GPU session does not find out at capture."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from perf.instep_sweep import ATTN_TILES, PROJECTION_VARIANTS, variants


def test_every_sweep_starts_and_ends_with_the_picks():
    for what in [*PROJECTION_VARIANTS, "attn", "attn_qk", "whatif"]:
        kinds = [kind for kind, _ in variants(what, [4, 8]).values()]
        assert kinds[0] == kinds[-1] == "pick" and "pick" not in kinds[1:-1], (what, kinds)
    attn = [arg for kind, arg in variants("attn", [4, 8]).values() if kind == "attn"]
    assert len(attn) == 2 * len(ATTN_TILES) and {s["num_splits"] for s in attn} == {4, 8}
    two = [arg for kind, arg in variants("attn", [4], ((32, 4, 2), (64, 8, 2))).values() if kind == "attn"]
    assert [(s["block_n"], s["num_warps"], s["num_stages"]) for s in two] == [(32, 4, 2), (64, 8, 2)]


def test_attention_variants_are_decode_attention_settings():
    """Every setting the attention sweep swaps in is a keyword of kernels.attention.decode_attention, as is each of
    decode_settings' (which the sweep replaces)."""
    from kernels import attention

    accepted = set(inspect.signature(attention.decode_attention).parameters)
    for kind, arg in variants("attn", [2, 8]).values():
        if kind == "attn":
            assert set(arg) <= accepted, set(arg) - accepted
    assert set(attention.decode_settings(32, 2, 256)) <= accepted


def test_each_stand_in_takes_the_arguments_of_the_kernel_it_replaces():
    left_out = [arg for kind, arg in variants("whatif", [4]).values() if kind == "leave out"]
    assert len(left_out) == 4
    for module, name, stand_in in left_out:
        real = list(inspect.signature(getattr(module, name)).parameters)
        mine = inspect.signature(stand_in).parameters.values()
        positional = [p.name for p in mine if p.kind is p.POSITIONAL_OR_KEYWORD]
        keyword = [p.name for p in mine if p.kind is p.KEYWORD_ONLY]
        assert real[: len(positional)] == positional and set(keyword) <= set(real), (name, real, positional, keyword)
        if not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in mine):
            assert positional == real, (name, real, positional)


@pytest.mark.parametrize("what", list(PROJECTION_VARIANTS))
def test_projection_variants_run_and_give_the_product(what):
    from kernels.act import silu_mul
    from kernels.linear import skinny_linear

    # float32 through Triton's interpreter (its tensor-core products have no bfloat16), bfloat16 on a GPU
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    M, K, C = 4, 256, 128  # K divides every variant's block_k x splits; C its column blocks
    x = torch.randn(M, K, generator=g).to(device, dtype)
    w = (torch.randn(2 * C, K, generator=g) * 0.05).to(device, dtype)
    for name, settings in PROJECTION_VARIANTS[what].items():
        got = skinny_linear(x, w, **settings).float()
        want = F.linear(x, w)
        if settings.get("glu"):
            want = silu_mul(want)
        want = want.float()
        err = (got - want).abs().max().item()
        assert got.shape == want.shape and err <= 0.02 * want.abs().max().item() + 1e-3, (what, name, err)
