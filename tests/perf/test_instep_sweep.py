"""perf/instep_sweep.py on the CPU (the sweep itself needs a GPU): every skinny_linear setting it swaps into the
decode step runs and gives the product, and each stand-in it puts in a kernel's place takes that kernel's
arguments, so a GPU session does not find out at capture."""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch
import torch.nn.functional as F

from perf.instep_sweep import ATTN_TILES, NORM_READERS, NORM_WRITERS, PROJECTION_VARIANTS, norm_late_choice, variants


def test_every_sweep_starts_and_ends_with_the_picks():
    for what in [*PROJECTION_VARIANTS, "attn", "attn_qk", "norm_late", "whatif"]:
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


# tuned picks and times at 32 rows as the tuning cache holds them (times: str(settings) -> seconds)
SWAP_DEFER = dict(block_n=64, block_k=128, num_warps=4, num_stages=4, dot=True, splits=4, swap=True, defer=True)
SPLIT2 = dict(block_n=32, block_k=128, num_warps=4, num_stages=5, dot=True, splits=2)
PICKS = {
    ("in_proj", 32): dict(block_n=32, block_k=128, num_warps=4, num_stages=5, dot=True, conv=True, conv_early=True),
    ("gate_up", 32): dict(block_n=64, block_k=128, num_warps=4, num_stages=4, dot=True, glu=True, splits=2),
    ("out", 32): SWAP_DEFER, ("o", 32): SWAP_DEFER, ("down", 32): SWAP_DEFER,
}  # fmt: skip
TIMES = {
    ("out", 32): {"cublas": 11.7e-6, str(SWAP_DEFER): 9.1e-6, str(SPLIT2): 9.9e-6, "{'bad': 1}": "wrong result"},
    ("o", 32): {"cublas": 9.0e-6, str(SWAP_DEFER): 8.0e-6, str(SPLIT2): 9.5e-6},
}  # fmt: skip


def test_norm_late_choice_fuses_the_readers_norm_in_one_pass_and_drops_the_writers_defer():
    control = norm_late_choice(PICKS, TIMES, 32, None)
    assert set(control) == {(n, 32) for n in NORM_WRITERS}
    assert control[("out", 32)] == SPLIT2  # the fastest timed without defer
    assert control[("o", 32)] is None  # cuBLAS beat every setting without defer
    assert control[("down", 32)] == {k: v for k, v in SWAP_DEFER.items() if k != "defer"}  # no times: pick less defer
    for prefetch in (False, True):
        got = norm_late_choice(PICKS, TIMES, 32, prefetch)
        assert {k: got[k] for k in control} == control
        for n in NORM_READERS:
            s = got[(n, 32)]
            assert s["norm"] and s["norm_late"] and s["dot"] and s.get("prefetch", False) == prefetch
            assert not {"splits", "swap", "defer"} & set(s), s
        assert got[("in_proj", 32)]["conv_early"] and got[("gate_up", 32)]["glu"]
        assert got[("qkv", 32)]["block_n"] == 32  # on cuBLAS: NORM_LATE_TILES
    kinds = {name: kind for name, (kind, _) in variants("norm_late", [4], picks=PICKS, times=TIMES, batch=32).items()}
    assert list(kinds.values()) == ["pick", "linears", "linears", "linears", "linears", "pick"], kinds
    assert norm_late_choice({}, {}, 128, False)[("qkv", 128)]["num_warps"] == 8  # 128 rows: a tile that fits
    wide = norm_late_choice(PICKS, TIMES, 32, False, warps=8)
    assert all(wide[(n, 32)]["num_warps"] == 8 for n in NORM_READERS) and PICKS[("gate_up", 32)]["num_warps"] == 4
    both = variants(["attn_qk", "norm_late"], [4], picks=PICKS, times=TIMES, batch=32)  # one sweep, picks around
    assert [kind for kind, _ in both.values()] == ["pick", "attr", "linears", "linears", "linears", "linears", "pick"]
    assert [kind for kind, _ in variants(["norm_late"], [4], picks=PICKS, times=TIMES, batch=1).values()] == [
        "pick",
        "pick",
    ]  # one row: no tensor-core tiles to fuse the norm in


def test_norm_late_settings_run_through_normed_linear():
    """Each reader setting the norm_late sweep swaps in runs (Triton's interpreter on the CPU, in float32) and gives
    the two-launch result within bf16 rounding, glu included."""
    from kernels.linear import glu_after, normed_linear

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(1)
    M, K, C = 4, 256, 64
    x, res = (torch.randn(M, K, generator=g).to(device, dtype) for _ in range(2))
    nw = (torch.randn(K, generator=g) * 0.1).to(device, dtype)
    w = (torch.randn(2 * C, K, generator=g) * 0.05).to(device, dtype)
    picks = {("gate_up", 4): PICKS[("gate_up", 32)]}
    got = [norm_late_choice(picks, {}, 4, True), norm_late_choice(picks, {}, 4, False, warps=8)]
    for n, choice in itertools.product(NORM_READERS, got):
        s = {k: v for k, v in choice[(n, 4)].items() if k not in ("conv", "conv_early")}  # conv: its own test
        y, _ = normed_linear(x, res.clone(), nw, 1e-6, w, s)
        want = normed_linear(x, res.clone(), nw, 1e-6, w, None)[0]
        want = glu_after(want, None) if s.get("glu") else want  # silu(gate) * up after the plain launch
        err = (y.float() - want.float()).abs().max().item()
        assert y.shape == want.shape and err <= 0.02 * want.float().abs().max().item() + 1e-3, (n, err)
