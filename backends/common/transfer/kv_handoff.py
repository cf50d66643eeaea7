"""KV hand-off: a decode instance exports its KV store as plain fields; a prefill instance opens it once and
copies rows into the slots decode chose. Handles are JSON (names, numbers, base64 bytes), never pickled.

On CPU the store lives in a named shared-memory segment; on GPU it is shared through a CUDA IPC handle (peer
copies when the two instances sit on different GPUs)."""

from __future__ import annotations

import base64
import json

import torch

from backends.common.model.kv_store import KVStore, SharedFile, tensor_on

_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


def export_handle(store: KVStore, instance_id: str, generation: int = 0) -> str:
    buf = store.buffer
    desc = {"instance": instance_id, "generation": generation, "dtype": str(buf.dtype), "shape": list(buf.shape)}
    if buf.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(buf)
        # (tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, storage_size, storage_offset,
        #  requires_grad, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required)
        desc.update(
            kind="cuda_ipc",
            device=args[6],
            stride=list(args[2]),
            offset=args[3],
            handle=base64.b64encode(args[7]).decode(),
            storage_size=args[8],
            storage_offset=args[9],
            ref_counter_handle=base64.b64encode(args[11]).decode(),
            ref_counter_offset=args[12],
            event_handle=base64.b64encode(args[13] or b"").decode(),
            event_sync_required=args[14],
        )
    elif store.shm is not None:
        desc.update(kind="shm", name=store.shm.name)
    else:
        raise ValueError("this KV store is not shareable (allocate it with a shared-memory name or on CUDA)")
    return json.dumps(desc)


def _open_cuda(desc: dict) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    ev = base64.b64decode(desc["event_handle"]) or None
    return rebuild_cuda_tensor(
        torch.Tensor,
        tuple(desc["shape"]),
        tuple(desc["stride"]),
        desc["offset"],
        torch.storage.TypedStorage,
        _DTYPES[desc["dtype"]],
        desc["device"],
        base64.b64decode(desc["handle"]),
        desc["storage_size"],
        desc["storage_offset"],
        False,
        base64.b64decode(desc["ref_counter_handle"]),
        desc["ref_counter_offset"],
        ev,
        desc["event_sync_required"],
    )


def export_shards(shards: list[tuple[KVStore, int, int]], instance_id: str, generation: int = 0) -> str:
    """A tensor-parallel instance's KV pool: each rank's store (shared memory) with the KV heads [lo, hi) it holds,
    in rank order. A peer copies each head range where it lives (`copy_rows_sharded`), whatever its own split."""
    parts = [{**json.loads(export_handle(store, f"{instance_id}#{r}", generation)), "heads": [lo, hi]}
             for r, (store, lo, hi) in enumerate(shards)]  # fmt: skip
    return json.dumps({"instance": instance_id, "generation": generation, "kind": "shards", "shards": parts})


class RemoteKV:
    """A peer's KV store opened from its handle; kept open for the peer's (instance, generation). A
    tensor-parallel peer's (kind "shards") is its ranks' stores: `shards`, (buffer, lo, hi) per rank."""

    def __init__(self, desc: dict):
        self.key = (desc["instance"], desc["generation"])
        self.shm = None
        self.parts: list[RemoteKV] = []
        self.shards: list[tuple[torch.Tensor, int, int]] = []
        if desc["kind"] == "shards":
            self.parts = [RemoteKV(d) for d in desc["shards"]]
            self.shards = [(p.buffer, *d["heads"]) for p, d in zip(self.parts, desc["shards"])]
            self.buffer = None
        elif desc["kind"] == "shm":
            self.shm = SharedFile(desc["name"])  # opened, not created: the decode instance owns the file
            self.buffer = tensor_on(self.shm.map, _DTYPES[desc["dtype"]], desc["shape"])
        elif desc["kind"] == "cuda_ipc":
            self.buffer = _open_cuda(desc)
        else:
            raise ValueError(f"unknown KV handle kind {desc['kind']!r}")
        if self.buffer is not None and self.buffer.dim() == 5:  # a KV pool (a state buffer is [pages, floats])
            self.shards = [(self.buffer, 0, self.buffer.shape[3])]

    def close(self) -> None:
        for p in self.parts:
            p.close()
        self.parts, self.shards = [], []
        self.buffer = None
        if self.shm is not None:
            self.shm.close()
            self.shm = None


class HandoffCache:
    """Opened peers by instance id; a new generation of the same instance replaces the old mapping."""

    def __init__(self):
        self._peers: dict[str, RemoteKV] = {}

    def open(self, handle_json: str) -> RemoteKV:
        desc = json.loads(handle_json)
        cur = self._peers.get(desc["instance"])
        if cur is None or cur.key != (desc["instance"], desc["generation"]):
            if cur is not None:
                cur.close()
            cur = self._peers[desc["instance"]] = RemoteKV(desc)
        return cur

    def close(self) -> None:
        for peer in self._peers.values():
            peer.close()
        self._peers.clear()


def copy_rows(src: torch.Tensor, src_slots: list[int], dst: torch.Tensor, dst_slots: list[int]) -> None:
    """dst[:, :, dst_slots] = src[:, :, src_slots] for every layer and both K and V ([layers, 2, slots, H, D])."""
    if len(src_slots) != len(dst_slots):
        raise ValueError(f"hand-off of {len(src_slots)} rows into {len(dst_slots)} slots")
    if not src_slots:
        return
    if not (src.is_cuda and dst.is_cuda and _triton_copy(src, src_slots, dst, dst_slots)):
        si = torch.tensor(src_slots, dtype=torch.int64, device=src.device)
        rows = src.index_select(2, si)
        if rows.device != dst.device:
            rows = rows.to(dst.device, non_blocking=True)
        di = torch.tensor(dst_slots, dtype=torch.int64, device=dst.device)
        dst.index_copy_(2, di, rows)
    # the peer reads these rows right after we answer
    for dev in {t.device for t in (src, dst) if t.is_cuda}:
        torch.cuda.current_stream(dev).synchronize()


def copy_rows_sharded(srcs: list[tuple[torch.Tensor, int, int]], src_slots: list[int],
                      dsts: list[tuple[torch.Tensor, int, int]], dst_slots: list[int]) -> None:  # fmt: skip
    """copy_rows between pools split by KV heads (tensor parallelism; (buffer, lo, hi) per rank, heads [lo, hi)
    of the whole model's): each head's rows go from the source rank that holds it to the destination rank that
    does, so a prefill of one split writes into a decode of another. One shard each and the same heads: copy_rows."""
    if len(srcs) == 1 and len(dsts) == 1 and srcs[0][1:] == dsts[0][1:]:
        return copy_rows(srcs[0][0], src_slots, dsts[0][0], dst_slots)
    if len(src_slots) != len(dst_slots):
        raise ValueError(f"hand-off of {len(src_slots)} rows into {len(dst_slots)} slots")
    heads = lambda shards: sorted(h for _, lo, hi in shards for h in range(lo, hi))  # noqa: E731
    if heads(srcs) != heads(dsts):
        raise ValueError(f"hand-off between pools of other KV heads: {heads(srcs)} into {heads(dsts)}")
    if not src_slots:
        return
    for src, slo, shi in srcs:
        si = torch.tensor(src_slots, dtype=torch.int64, device=src.device)
        rows = None
        for dst, dlo, dhi in dsts:
            a, b = max(slo, dlo), min(shi, dhi)
            if a >= b:
                continue
            rows = src.index_select(2, si) if rows is None else rows
            part = rows[:, :, :, a - slo : b - slo].to(dst.device)
            di = torch.tensor(dst_slots, dtype=torch.int64, device=dst.device)
            dst[:, :, :, a - dlo : b - dlo].index_copy_(2, di, part)  # a view: written through into dst
    for dev in {t.device for t, _, _ in srcs + dsts if t.is_cuda}:
        torch.cuda.current_stream(dev).synchronize()


def _triton_copy(src, src_slots, dst, dst_slots) -> bool:
    """One Triton kernel writing straight into dst when both pools are on the same GPU. Across GPUs the caller
    gathers on the source GPU and copies peer to peer: on an H200 pair, Triton refused to launch with the other
    GPU's IPC-mapped pool as an argument ("Pointer argument cannot be accessed from Triton")."""
    import kernels

    if src.device != dst.device or not kernels.available():
        return False
    from kernels.kv import copy_kv

    with torch.cuda.device(src.device):
        idx = torch.tensor([src_slots, dst_slots], dtype=torch.int64).to(src.device, non_blocking=False)
        copy_kv(src, idx[0], dst, idx[1])
    return True


def copy_state_page(src: torch.Tensor, src_page: int, dst: torch.Tensor, dst_page: int) -> None:
    """dst[dst_page] = src[src_page] for state buffers [pages, floats per page] (a hybrid model's hand-off)."""
    if src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"state pages of {src.shape[1]} and {dst.shape[1]} floats: not the same model")
    if not 0 <= dst_page < dst.shape[0]:
        raise ValueError(f"dst_state_page {dst_page} is outside decode's {dst.shape[0]} pages")
    dst[dst_page].copy_(src[src_page].to(dst.device, non_blocking=True))
    for dev in {t.device for t in (src, dst) if t.is_cuda}:
        torch.cuda.current_stream(dev).synchronize()
