"""Defaults that depend on the machine and the model, computed the same way by `triton-pd serve` (for the whole
deployment, rendered into each role's config) and by a role whose config leaves them at 0 or null."""

from __future__ import annotations

import os


def default_dtype(dtype: str, gpu: bool) -> str:
    """The weights' and KV's dtype: the one given, else float32 on CPU and bfloat16 on a GPU."""
    return dtype or ("bfloat16" if gpu else "float32")


def cpu_threads_per_instance(instances: int) -> int:
    """The cores this process may use, shared among the compute instances (prefill and decode run at the same
    time; torch's OpenMP threads spin at every barrier, so oversubscribed cores slow each step several-fold)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, instances))


def kv_bytes_per_token(cfg, dtype: str) -> int:
    import torch

    from backends.common.engine.runner import parse_dtype

    itemsize = torch.empty((), dtype=parse_dtype(dtype)).element_size()
    layers = len(cfg.full_layers) + (1 if cfg.is_hybrid and cfg.mtp_layers else 0)  # hybrid: full layers, MTP
    return layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize


def state_bytes(cfg, state_pages: int, max_batch: int) -> int:
    """Bytes of a hybrid model's state store on one decode instance: its pages and a scratch page per batch row."""
    from backends.common.engine.runner import default_state_pages

    return ((state_pages or default_state_pages(max_batch)) + max_batch) * cfg.state_page_bytes()


def default_host_pages(max_batch: int) -> int:
    """Host state pages of a hybrid model's host tier: one per host copy, as many as a full decode batch (at most
    64: 4.7 GiB pinned for Qwen3-Next-80B's 75 MiB pages). A pause that finds none free reclaims the copy of a
    request that is not paused, else keeps no host copy (counted as host_full)."""
    return min(max_batch, 64)


def host_state_bytes(cfg, max_batch: int) -> int:
    """Bytes of a hybrid model's host state pages on one decode instance."""
    return default_host_pages(max_batch) * cfg.state_page_bytes()


def kv_tokens_for_gpu(per_token: int, fraction: float, device: int = 0) -> int:
    import torch

    return int(torch.cuda.get_device_properties(device).total_memory * fraction // per_token)


def default_host_kv_tokens(per_token: int, kv_tokens: int, instances: int = 1, page_bytes: int = 0) -> int:
    """Four times the device pool (paused requests outnumber running ones when the pool is over-committed), within
    a quarter of physical memory shared by the decode instances (pinned memory cannot be swapped out); page_bytes:
    what a hybrid model's host state pages take of that share first."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(0, min(4 * kv_tokens, (ram // 4 // max(1, instances) - page_bytes) // per_token))


def default_max_streams(decode_instances: int, max_batch: int) -> int:
    """Decode streams master opens at once: what the decode instances can run at once, and at least 64 (the earlier
    default), so that small batches still have requests waiting on decode. Not more: with 512 or 1,024 streams on
    2 cores a memory corruption in the 2.51 Python backend's shared-memory messages brought the server down in
    about one run in five (a stub's or tritonserver's SIGSEGV, then boost::interprocess::lock_exception;
    docs/operations.md), while 256 ran 110 rounds on an H200 and 200 ran 7 rounds on 2 cores without a fault."""
    return max(64, decode_instances * max_batch)


def default_kv_tokens(cfg, per_token: int, gpu: bool, fraction: float, device: int, state_pages: int, max_batch: int):
    """Decode's pool: 16384 tokens on CPU; on a GPU `fraction` of its memory (hybrid models: less the state
    store's bytes, at least 1024 tokens)."""
    if not gpu:
        return 16384
    tokens = kv_tokens_for_gpu(per_token, fraction, device)
    if cfg.is_hybrid:  # the state pages share the same fraction of the GPU
        tokens = max(1024, tokens - state_bytes(cfg, state_pages, max_batch) // per_token)
    return tokens


def default_prefill_kv_tokens(cfg, gpu: bool) -> int:
    """Prefill's own pool (its prefix cache): 131072 tokens on a GPU, max(8192, 2 x context) on CPU."""
    return 131072 if gpu else max(8192, 2 * cfg.max_position_embeddings)


def resolve_decode(c, model_cfg, gpu: bool, device: int, instances: int):
    """A DecodeConfig with its machine-dependent defaults (0 / "" / null) filled in as `serve` fills them; instances:
    this model's instances in the server (the host tier's share of memory, the cores' share)."""
    from dataclasses import replace

    dtype = default_dtype(c.dtype, gpu)
    per_token = kv_bytes_per_token(model_cfg, dtype)
    kv = c.kv_tokens or default_kv_tokens(
        model_cfg, per_token, gpu, c.kv_memory_fraction, device, c.state_pages, c.max_batch
    )
    host = c.host_kv_tokens
    if host is None:  # hybrid models: their host state pages come out of the same share of memory
        pages = host_state_bytes(model_cfg, c.max_batch) if model_cfg.is_hybrid else 0
        host = default_host_kv_tokens(per_token, kv, instances, pages)
    threads = c.cpu_threads or cpu_threads_per_instance(instances + 1)  # and, by default, one of the other role
    return replace(c, dtype=dtype, kv_tokens=kv, host_kv_tokens=host, cpu_threads=threads)


def resolve_prefill(c, model_cfg, gpu: bool, instances: int):
    """A PrefillConfig with its machine-dependent defaults filled in (see `resolve_decode`)."""
    from dataclasses import replace

    return replace(
        c,
        dtype=default_dtype(c.dtype, gpu),
        prefill_kv_tokens=c.prefill_kv_tokens or default_prefill_kv_tokens(model_cfg, gpu),
        cpu_threads=c.cpu_threads or cpu_threads_per_instance(instances + 1),
    )
