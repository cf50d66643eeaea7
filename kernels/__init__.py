"""Triton GPU kernels (attention over the slot-indexed KV pool, fused residual + RMSNorm, rotary embedding, KV
store and KV copy, SiLU-mul, small-batch linear), each with a PyTorch reference in `kernels.reference` (the linear's
is F.linear). Importing a kernel module needs `triton`;
`available()` says whether it and a CUDA device are present."""

import functools


def available() -> bool:
    try:
        import torch
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@functools.lru_cache(maxsize=16)
def sm_count(device, cpu: int = 1) -> int:
    """The multiprocessors of a CUDA `device` (a torch.device); `cpu` for any other device (the interpreter, whose
    callers pick how many programs stand for a GPU's). Cached: kernels.fp8 asks at every launch."""
    import torch

    if device.type != "cuda":
        return cpu
    return torch.cuda.get_device_properties(device).multi_processor_count
