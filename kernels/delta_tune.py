"""The gated delta step's settings per decode graph size, timed at capture (`tune_step`), as kernels.linear.tune
times the projections: value dims per state block, the second block read with the first, a head shared among
programs at a few sequences, and the conv step in the step's own launch (kernels.delta_rule.gated_delta_step(
conv=...)) against its launch before the step or the projection's launch that does it."""

from __future__ import annotations

import json

import torch
import triton

from kernels import delta_rule, linear, sm_count

# `tune_step`'s candidates (value dims per block, the second block read with the first), from `perf/kernels.py
# hybrid-steps` on an H200 (perf/results/preload_h200/): 4 warps won everywhere, blocks of 16 value dims nowhere; a
# head shared among programs (split) only while the programs are fewer than 4 per SM
STEP_CANDIDATES = [dict(block_v=128), dict(block_v=64), dict(block_v=64, ahead=True), dict(block_v=32, ahead=True)]
SPLIT_STEP_CANDIDATES = [dict(block_v=64, split=2), dict(block_v=32, split=4), dict(block_v=32, ahead=True, split=2)]
TUNE_STATE_BYTES = 128 << 20  # tune_step's state copies: at least two, and enough to pass through L2
# the conv in the step's launch: each candidate as it is, and with 8 warps where it has blocks of 64 value dims or
# more: compiled for sm_90 by triton 3.6, the conv's tiles beside a [128, 128] state block spill 1,256 bytes per
# thread at 4 warps and 16 at 8, beside two blocks of 64 read together 288 and none (perf/kernels.py regs)
CONV_WARPS_FROM_BLOCK = 64


def step_candidates(batch: int, value_heads: int, dv: int, sms: int) -> list[dict]:
    """`tune_step`'s settings for a batch: STEP_CANDIDATES, and SPLIT_STEP_CANDIDATES where batch * value_heads
    programs are fewer than 4 per SM, each where its blocks divide the head (dv value dims) as it needs."""
    out = list(STEP_CANDIDATES) + (list(SPLIT_STEP_CANDIDATES) if batch * value_heads < 4 * sms else [])
    keep = []
    for s in out:
        blocks = triton.cdiv(dv, min(triton.next_power_of_2(dv), s["block_v"]))
        if blocks % s.get("split", 1) == 0 and (not s.get("ahead") or blocks // s.get("split", 1) > 1):
            keep.append(s)
    return keep


def conv_candidates(plain: list[dict]) -> list[dict]:
    """The candidates with the conv step in the step's launch: each of `plain` with the conv, then those with
    blocks of at least CONV_WARPS_FROM_BLOCK value dims again with 8 warps (fewer registers per thread)."""
    return [dict(s, conv=True) for s in plain] + [
        dict(s, conv=True, num_warps=8) for s in plain if s["block_v"] >= CONV_WARPS_FROM_BLOCK
    ]


# the version of the delta step's kernels and candidates (this module, kernels.delta_rule, kernels.pdl) that
# `tune_step` times: the cache's picks apply to this version only; raise it with any change that can move a pick
STEP_TUNE_VERSION = "delta-1"
_STEP_CACHE = None


def step_tune_cache():
    """`tune_step`'s picks: a kernels.linear.TuneCache in delta-tune.json beside the projections' file (the folder
    of TRITON_PD_TUNE_CACHE, or triton-pd's cache folder; none where that is "off"), for STEP_TUNE_VERSION."""
    global _STEP_CACHE
    if _STEP_CACHE is None:
        where = linear.TuneCache.default_path()
        path = None if where is None else where.with_name("delta-tune.json")
        _STEP_CACHE = linear.TuneCache(path, STEP_TUNE_VERSION)
    return _STEP_CACHE


def tune_step(shape: tuple[int, int, int, int, int, int], rows: int, layers: int, dtype, device,
              conv_launch: bool = True, conv_saving: float = 0.0,
              preload: bool = True) -> tuple[dict | None, dict]:  # fmt: skip
    """The fastest `gated_delta_step` settings for a decode graph of `rows` sequences: each candidate
    (`step_candidates`) with the conv step before it, and again with the conv step in the step's own launch (flag
    conv). conv_launch: the conv step before it is a `conv_step` launch, timed with it; else the projection's
    launch does it (not timed here), and the conv candidates win only by more than conv_saving (seconds per layer
    that the projection saves without it). shape: (key heads, value heads, key dim, value dim, conv channels, conv
    taps). Each candidate is timed as a CUDA graph of `layers` launches, as a decode graph runs them, on state
    copies of their own (at least two, so that a preloading launch never reads what the launch before writes, and
    together past L2). The pick is checked against conv_step and the step at `step_settings` (output within bf16
    rounding, state and conv state within float32 rounding) and dropped for None (the defaults) if it differs.
    Returns (settings for gated_delta_step beyond `preload`, or None for `step_settings`; {description: seconds
    per layer, or the error of a setting that did not run or was wrong}). The times are kept in `step_tune_cache`
    (the pick is made again from them, with this call's conv_saving, and checked again)."""
    HK, HV, DK, DV, C, K = shape
    dev = torch.device(device)
    cache = step_tune_cache()
    cuda = dev.type == "cuda"
    gpu = torch.cuda.get_device_name(dev) if cuda else dev.type
    key = json.dumps([gpu, torch.__version__, triton.__version__, str(dtype), list(shape), rows, layers, conv_launch,
                      preload])  # fmt: skip
    cached = cache.get(key)
    page = HV * DK * DV + C * (K - 1)
    copies = max(2, min(layers, -(-TUNE_STATE_BYTES // (rows * page * 4))))
    g = torch.Generator(device=dev).manual_seed(0)
    proj = torch.randn(rows, C + HV * DV + 2 * HV, device=dev, generator=g).to(dtype)
    cw = torch.randn(C, K, device=dev, generator=g).to(dtype)
    a_log, dt_bias = torch.rand(HV, device=dev, generator=g).log(), torch.zeros(HV, device=dev)
    norm_w = torch.ones(DV, device=dev, dtype=dtype)
    bufs = [torch.randn(rows, page, device=dev, generator=g) * 0.05 for _ in range(copies)]
    ssms = [b[:, : HV * DK * DV].view(rows, HV, DK, DV) for b in bufs]
    convs = [b[:, HV * DK * DV :].view(rows, C, K - 1) for b in bufs]
    pages = torch.arange(rows, dtype=torch.int32, device=dev)
    mixed = torch.randn(rows, C, device=dev, generator=g)  # the conv's output where the projection's launch did it
    out = torch.empty(rows, HV * DV, device=dev, dtype=dtype)
    counters = torch.zeros(rows * (HV + HK), dtype=torch.int32, device=dev)

    def step(s: dict, j: int, conv_launch: bool = conv_launch) -> torch.Tensor:
        s = dict(s)
        if s.pop("conv", False):
            return delta_rule.gated_delta_step(None, proj, a_log, dt_bias, norm_w, ssms[j], pages, HK, 1e-6, out=out,
                                               preload=preload, counters=counters, conv=(cw, convs[j]),
                                               **s)  # fmt: skip
        if conv_launch:
            delta_rule.conv_step(proj, cw, convs[j], pages, out=mixed, preload=preload)
        return delta_rule.gated_delta_step(mixed, proj, a_log, dt_bias, norm_w, ssms[j], pages, HK, 1e-6, out=out,
                                           preload=preload, counters=counters, **s)  # fmt: skip

    sms = sm_count(dev)
    plain = step_candidates(rows, HV, DV, sms)
    fused = conv_candidates(plain)
    if cached is not None:
        times = dict(cached["times"])
    else:
        times = linear.fastest(plain + fused, lambda s: [step(s, j % copies) for j in range(layers)], layers)[1]

    def fastest_of(settings: list[dict], saving: float = 0.0) -> tuple[dict | None, float]:
        timed = [(t - saving, i) for i, s in enumerate(settings) if isinstance(t := times.get(str(s)), float)]
        if not timed:
            return None, float("inf")
        t, i = min(timed)
        return settings[i], t

    best, best_t = fastest_of(plain)
    conv_best, conv_t = fastest_of(fused, conv_saving)
    if conv_t < best_t:
        best = conv_best
    if best is not None:  # the pick gives what conv_step and the defaults give, from the same state
        got, want = [], []
        default = dict(block_v=delta_rule.step_settings(rows)["block_v"])
        launch = conv_launch or best.get("conv", False)  # else both read the projection's conv output
        if not launch:  # what the projection's conv gives
            mixed.copy_(delta_rule.conv_step(proj, cw, convs[1].clone(), pages))
        for s, into in ((default, want), (best, got)):
            bufs[0].copy_(bufs[1])
            y = step(s, 0, launch).clone().float()  # out is one buffer for both
            into += [y, ssms[0].clone(), convs[0].clone()]
        bound = [0.02 * want[0].abs().max().item() + 1e-3, 1e-4 * want[1].abs().max().item() + 1e-6, 1e-6]
        for what, a, b, tol in zip(("output", "state", "conv state"), got, want, bound):
            err = (a - b).abs().max().item()
            if not err <= tol:
                times[str(best)] = f"wrong {what}: max error {err:.3g} (allowed {tol:.3g})"
                best = None
                break
    if cached is None or times != cached["times"]:
        cache.put(key, best, times)
    return best, times
