"""The Triton kernels, each against its reference measured in the same run (the copy bandwidth of the bytes it
must read, cuBLAS, PyTorch's flash SDPA, the PyTorch reference), and the sweeps of their launch settings that
chose the defaults."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.tools import dispatch  # noqa: E402

TABLE = {
    "decode-attention": ("attn_sweep", "decode attention settings per batch vs the K/V bytes at copy bandwidth"),
    "prefill-attention": ("prefill_attention_bench", "prefill attention vs PyTorch's flash SDPA, causal, same shapes"),
    "linear": ("linear_sweep", "small-batch projections: skinny_linear's settings vs cuBLAS"),
    "delta-rule": ("delta_rule_roofline", "gated delta rule: decode step vs state copy, chunked prefill vs PyTorch"),
    "hybrid-steps": ("hybrid_sweep", "the hybrid decode graph's small launches, settings vs their bytes"),
    "invariant": ("invariant_sweep", "--deterministic's matmul tiles vs cuBLAS"),
    "invariant-attention": ("invariant_attention_sweep", "--deterministic's attention tiles vs the default kernel"),
    "regs": ("kernel_regs", "registers and spills per candidate vs the 255-register limit, for sm_90 without a GPU"),
}

if __name__ == "__main__":
    sys.exit(dispatch("perf/kernels.py", __doc__, TABLE))
