"""The offline engine: throughput and decode/prefill steps against the hardware roofline and transformers, for
dense, hybrid and MoE models, and the deterministic mode's cost against the default kernels, each in one run."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.tools import dispatch  # noqa: E402

TABLE = {
    "dense": ("engine_bench", "dense decode step vs its roofline, offline throughput vs transformers (GPU)"),
    "hybrid": ("hybrid_bench", "hybrid (Qwen3.5, Qwen3-Next) decode step and prefill vs roofline, matmul rate (GPU)"),
    "moe": ("moe_bench", "the fused MoE layer and MoE decode step vs roofline and the loop over experts (GPU)"),
    "deterministic": ("deterministic_bench", "--deterministic's decode step and prefill vs the default kernels (GPU)"),
    "cpu": ("cpu_decode_bench", "CPU decode tokens/s vs transformers on the same prompts"),
    "fp8": ("fp8_bench", "FP8 weights: W8A8 matmul vs cuBLAS FP8, decode step vs roofline and 16-bit, prefill (GPU)"),
    "vision": ("vision_bench", "Qwen3.5's vision tower: images/s vs transformers' Qwen3_5VisionModel, same card (GPU)"),
}

if __name__ == "__main__":
    sys.exit(dispatch("perf/engine.py", __doc__, TABLE))
