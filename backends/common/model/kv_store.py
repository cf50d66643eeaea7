"""The tensor that holds every layer's K and V rows, indexed by slot. One buffer, so that a single handle
(a CUDA IPC handle or a shared-memory file name) lets another process write into it."""

from __future__ import annotations

import mmap
import os
import re

import torch

SHM_DIR = "/dev/shm"
_SAFE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


class SharedFile:
    """A file in /dev/shm mapped into memory. Plain os/mmap rather than multiprocessing.shared_memory: no
    resource-tracker process, which also misbehaves inside Triton's stub when its libpython and stdlib differ."""

    def __init__(self, name: str, nbytes: int | None = None):
        if not _SAFE.match(name):
            raise ValueError(f"unsafe shared-memory name {name!r}")
        self.name, self.path = name, os.path.join(SHM_DIR, name)
        create = nbytes is not None
        fd = os.open(self.path, (os.O_CREAT | os.O_EXCL | os.O_RDWR) if create else os.O_RDWR, 0o600)
        try:
            if create:
                os.ftruncate(fd, max(nbytes, 1))
            size = os.fstat(fd).st_size
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def close(self, unlink: bool = False) -> None:
        try:
            self.map.close()
        except BufferError:
            pass  # a tensor still views the mapping; it goes away with the process
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def shard_name(name: str, rank: int) -> str:
    """The shared-memory name of rank `rank`'s pool in a tensor-parallel instance whose rank 0 uses `name`."""
    return name if rank == 0 else f"{name}.r{rank}"


def gather_heads(shards: list[tuple[torch.Tensor, int, int]], index: torch.Tensor) -> torch.Tensor:
    """Rows `index` of a pool split by KV heads ((buffer, lo, hi) per rank, in head order; one entry: a whole
    pool), every head of them: [layers, 2, len(index), heads, head_dim]."""
    if len(shards) == 1:
        return shards[0][0].index_select(2, index)
    return torch.cat([buf.index_select(2, index) for buf, _, _ in shards], dim=3)


def scatter_heads(shards: list[tuple[torch.Tensor, int, int]], index: torch.Tensor, rows: torch.Tensor) -> None:
    """The reverse of gather_heads: rows [layers, 2, len(index), heads, head_dim] into slots `index`, each rank's
    heads into its buffer."""
    for buf, lo, hi in shards:
        buf.index_copy_(2, index, rows[:, :, :, lo:hi])


def tensor_on(buf, dtype: torch.dtype, shape) -> torch.Tensor:
    numel = 1
    for d in shape:
        numel *= d
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(tuple(shape))


class KVStore:
    """buffer: [num_layers, 2 (k, v), num_slots, num_kv_heads, head_dim]."""

    def __init__(self, buffer: torch.Tensor, shm: SharedFile | None = None):
        self.buffer = buffer
        self.shm = shm  # keeps a shared-memory mapping alive as long as the store
        self.num_layers, _, self.num_slots, self.num_kv_heads, self.head_dim = buffer.shape

    @classmethod
    def allocate(cls, num_layers, num_slots, num_kv_heads, head_dim, dtype, device, shm_name: str | None = None):
        shape = (num_layers, 2, num_slots, num_kv_heads, head_dim)
        if shm_name is None:
            return cls(torch.zeros(shape, dtype=dtype, device=device))
        nbytes = num_layers * 2 * num_slots * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        shm = SharedFile(shm_name, nbytes)  # a fresh file reads as zeros
        return cls(tensor_on(shm.map, dtype, shape), shm)

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
            self.shm.close(unlink)
            self.shm = None


class StateStore:
    """Every request's linear-attention state, one float32 row per state page: buffer [num_pages, floats per
    page]. A page holds, for each linear layer j, the conv inputs it keeps (`conv(j)`: [pages, conv_dim, K - 1])
    and the recurrent state (`ssm(j)`: [pages, value heads, key dim, value dim]). One buffer, shareable like the
    KV store, so that a prefill instance writes a hand-off's state into decode's page."""

    def __init__(self, cfg, buffer: torch.Tensor, shm: SharedFile | None = None):
        self.buffer, self.shm = buffer, shm
        self.num_pages = buffer.shape[0]
        self.conv_shape = (cfg.conv_dim, cfg.linear_conv_kernel_dim - 1)
        self.ssm_shape = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        self.num_layers = len(cfg.linear_layers)
        c = self.conv_shape[0] * self.conv_shape[1]
        s = self.ssm_shape[0] * self.ssm_shape[1] * self.ssm_shape[2]
        self._offsets = [(j * (c + s), j * (c + s) + c, (j + 1) * (c + s)) for j in range(self.num_layers)]

    @classmethod
    def allocate(cls, cfg, num_pages: int, device, shm_name: str | None = None) -> StateStore:
        shape = (num_pages, cfg.state_floats_per_page())
        if shm_name is None:
            return cls(cfg, torch.zeros(shape, dtype=torch.float32, device=device))
        shm = SharedFile(shm_name, shape[0] * shape[1] * 4)
        return cls(cfg, tensor_on(shm.map, torch.float32, shape), shm)

    def conv(self, j: int) -> torch.Tensor:
        a, b, _ = self._offsets[j]
        return self.buffer[:, a:b].view(self.num_pages, *self.conv_shape)

    def ssm(self, j: int) -> torch.Tensor:
        _, b, c = self._offsets[j]
        return self.buffer[:, b:c].view(self.num_pages, *self.ssm_shape)

    @property
    def bytes_per_page(self) -> int:
        return self.buffer.shape[1] * 4

    def apply(self, ops: list[tuple[int, int]]) -> None:
        """Run page copies in order: (dst, src) copies page src into dst, (dst, -1) zeroes dst."""
        for dst, src in ops:
            if src < 0:
                self.buffer[dst].zero_()
            else:
                self.buffer[dst].copy_(self.buffer[src])

    def close(self, unlink: bool = False) -> None:
        if self.shm is not None:
            self.buffer = None
            self.shm.close(unlink)
            self.shm = None
