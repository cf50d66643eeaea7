"""Triton GPU kernels (attention over the slot-indexed KV pool, fused residual + RMSNorm, rotary embedding, KV
store and KV copy, SiLU-mul, small-batch linear), each with a PyTorch reference in `kernels.reference` (the linear's
is F.linear). Importing a kernel module needs `triton`;
`available()` says whether it and a CUDA device are present."""


def available() -> bool:
    try:
        import torch
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()
