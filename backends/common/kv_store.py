"""The tensor that holds every layer's K and V rows, indexed by slot. One buffer, so that a single handle
(a CUDA IPC handle or a shared-memory name) lets another process write into it."""

from __future__ import annotations

from multiprocessing import shared_memory

import torch


class KVStore:
    """buffer: [num_layers, 2 (k, v), num_slots, num_kv_heads, head_dim]."""

    def __init__(self, buffer: torch.Tensor, shm: shared_memory.SharedMemory | None = None):
        self.buffer = buffer
        self.shm = shm  # keeps a shared-memory segment alive as long as the store
        self.num_layers, _, self.num_slots, self.num_kv_heads, self.head_dim = buffer.shape

    @classmethod
    def allocate(cls, num_layers, num_slots, num_kv_heads, head_dim, dtype, device, shm_name: str | None = None):
        shape = (num_layers, 2, num_slots, num_kv_heads, head_dim)
        if shm_name is None:
            return cls(torch.zeros(shape, dtype=dtype, device=device))
        numel = num_layers * 2 * num_slots * num_kv_heads * head_dim
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        shm = shared_memory.SharedMemory(name=shm_name, create=True, size=max(nbytes, 1))
        buf = torch.frombuffer(shm.buf, dtype=dtype, count=numel).view(shape)
        buf.zero_()
        return cls(buf, shm)

    def k(self, layer: int) -> torch.Tensor:
        return self.buffer[layer, 0]

    def v(self, layer: int) -> torch.Tensor:
        return self.buffer[layer, 1]

    @property
    def bytes_per_slot(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.buffer.element_size()

    def close(self, unlink: bool = False) -> None:
        if self.shm is not None:
            self.buffer = None
            self.shm.close()
            if unlink:
                self.shm.unlink()
            self.shm = None
