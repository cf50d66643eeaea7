"""The device-free core: request states, KV slot and state-page accounting, the radix prefix cache, the offline
scheduler, model and role configs. Plain Python: no torch, no Triton (tests/test_layering.py checks)."""
