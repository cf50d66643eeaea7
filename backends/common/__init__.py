"""Engine pieces shared by the prefill and decode roles: model, KV pool, radix cache, sampler, requests."""
