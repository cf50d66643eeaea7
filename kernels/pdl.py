"""Programmatic dependent launch (PDL, Hopper and later): a kernel launched with it may start while the kernel
before it on the stream is still running, and waits (`griddepcontrol.wait`) before it touches anything that kernel
wrote or reads. Decode at small batch is a chain of several hundred short launches (about 470 per step for a
48-layer hybrid model at batch 1); with PDL each launch's start-up, and the weight prefetch of the projections,
overlap the tail of the launch before it instead of following it. CUDA graphs keep the dependency (captured as a
programmatic edge).

Rules for a kernel that takes `PDL`:
- call `enter(PDL)` before its first load of anything the launch just before it may have written (activations,
  K/V, state pages, slot tables, counters) and before its first store; every program calls it (none returns
  before it). Since every launch waits first and only then lets the next one start, a launch starts only once
  the launch two before it has finished: loads of weights, of the graph's inputs, and of what that earlier launch
  (or an earlier step) wrote may come before the wait (`delta_rule.gated_delta_step(preload=True)`,
  `linear.skinny_linear(preload=True)`'s first weight tile, `moe`'s down projection of a few tokens); a launch of
  a library (cuBLAS, PyTorch) lets the next one start only when it has finished;
- launch it with `**launch(tensor)`: PDL=True and launch_pdl=True on a CUDA tensor when enabled, else both off
  (the CPU interpreter has no griddepcontrol).

It is on for devices of compute capability 9.0 and up."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_ENABLED: dict[int, bool] = {}


def enabled(device: torch.device) -> bool:
    """Whether launches on `device` use PDL (CUDA, compute capability >= 9.0)."""
    if device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    on = _ENABLED.get(idx)
    if on is None:
        on = _ENABLED[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return on


def launch(t: torch.Tensor) -> dict:
    """The keyword arguments of a launch whose tensors live where `t` does: the kernel's PDL flag and Triton's
    launch option."""
    on = enabled(t.device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def enter(PDL: tl.constexpr):
    """Wait for the launch before this one to finish (its writes visible), then let the next launch start."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
