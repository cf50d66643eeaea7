"""Prefill role: chunked prefill with its own radix cache; writes KV into decode's pool; recovery jobs."""
