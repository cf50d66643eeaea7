"""triton-pd: prefill/decode disaggregated LLM serving on Triton's Python backend."""
