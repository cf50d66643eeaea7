"""How prefill's K/V rows (and a hybrid model's state page) reach decode's pool: the KV transport.

Two implementations of one interface, picked by decode (`kv_transport` in its model config) and named in each
PrefillRequest's `kv_handle`, so prefill follows whatever decode chose:

- `ipc`: same host. Decode exports its pool once (a shared-memory file on CPU, a CUDA IPC handle on GPU) and prefill
  writes the rows straight into the slots decode reserved (`kv_handoff`).
- `dist`: any host. torch.distributed point-to-point over one two-rank process group per (prefill, decode) pair:
  NCCL between GPUs, gloo over TCP on CPU (and as the tests' loopback). Decode hosts a TCPStore for the
  rendezvous; a prefill joins it the first time a handle names that decode instance, and from then on sends each
  transfer as a header and one payload. `auto` (the default) uses NCCL between two GPUs and gloo otherwise: NCCL
  refuses two ranks on one GPU. Decode's receiver thread for that peer writes the rows into the
  slots of the transfer the header names, or drops them (counted) when that transfer is no longer expected: a
  stale epoch, a cancelled request, a retried attempt. Headers travel through the store (JSON under a numbered
  key per pair), so no receive is ever posted on the group while it is idle: an idle NCCL receive would trip
  NCCL's watchdog, an idle gloo one its timeout. Only the payload crosses the group, right after its header.

Every transfer is keyed by (request id, epoch, ticket): decode registers it (`expect`) before it asks prefill, waits
for it to land (`landed`) after prefill answers, and forgets it (`forget`) before it reports the job done, so rows
are written only while the slots are still reserved for that very attempt. Handles are JSON, never pickled."""

from __future__ import annotations

import json
import os
import secrets
import sys
import threading
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from backends.common.model.kv_store import gather_heads, scatter_heads
from backends.common.transfer.kv_handoff import (
    HandoffCache,
    copy_rows_sharded,
    copy_state_page,
    export_handle,
    export_shards,
)
from backends.common.transfer.mailbox import Mailbox

KINDS = ("ipc", "dist")
CONNECT_TIMEOUT = timedelta(seconds=30)  # rendezvous, and a payload's arrival once its header is posted
IDLE_WAIT = timedelta(days=1)  # a receiver's wait for the next header (close() wakes it sooner)


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"kv_transport: {kind!r} is not one of {', '.join(KINDS)}")
    return kind


@dataclass
class Expected:
    """One registered transfer: where its rows go, and whether they have landed."""

    rid: str
    epoch: int
    ticket: int
    dst_slots: list[int]
    dst_state_page: int
    kv_handle: str
    state_handle: str
    arrived: threading.Event = field(default_factory=threading.Event)


class KVSink:
    """Decode's side. `counts` holds running totals: transfers landed, bytes, and drops by reason."""

    kind = "?"

    def __init__(self):
        self.counts = {"landed": 0, "bytes": 0, "stale": 0, "unexpected": 0}
        self._lock = threading.Lock()
        self._tickets = 0
        self._expected: dict[tuple[str, int], Expected] = {}

    def expect(self, rid: str, epoch: int, dst_slots: list[int], dst_state_page: int) -> Expected:
        with self._lock:
            self._tickets += 1
            kv, state = self._handles(self._tickets, dst_state_page >= 0)
            exp = Expected(rid, epoch, self._tickets, list(dst_slots), dst_state_page, kv, state)
            self._expected[(rid, epoch)] = exp
        return exp

    def retry(self, exp: Expected) -> Expected:
        """A new attempt of the same transfer (failover): rows of the earlier attempt are dropped from now on."""
        return self.expect(exp.rid, exp.epoch, exp.dst_slots, exp.dst_state_page)

    def landed(self, exp: Expected, timeout: float) -> bool:
        """True once the attempt's rows are in decode's pool (prefill has answered it)."""
        return True

    def forget(self, exp: Expected) -> None:
        with self._lock:
            if self._expected.get((exp.rid, exp.epoch)) is exp:
                del self._expected[(exp.rid, exp.epoch)]

    def post_cancel(self, notice: str, reason: str) -> None:
        """Tell prefill instances reached through this transport to drop the job `notice` (rid:epoch)."""

    def discard_cancel(self, notice: str) -> None:
        pass

    def close(self) -> None:
        pass

    def _handles(self, ticket: int, with_state: bool) -> tuple[str, str]:
        raise NotImplementedError


class IpcSink(KVSink):
    """Prefill writes into decode's exported pool itself: by the time it answers, the rows are there. Cancel
    notices go through decode's mailbox (`mailbox.Mailbox`); the handle names it, so a prefill server of another
    deployment on this host (the split layouts) reads it too."""

    kind = "ipc"

    def __init__(self, kv, state, instance_id: str, mailbox=None):
        """kv: the pool's KVStore, or a tensor-parallel instance's (store, lo, hi) per rank."""
        super().__init__()
        extra = {"mailbox": str(mailbox.root)} if mailbox is not None else {}
        handle = export_shards(kv, instance_id) if isinstance(kv, list) else export_handle(kv, instance_id)
        self.kv_handle = json.dumps({**json.loads(handle), **extra})
        self.state_handle = export_handle(state, instance_id + ":state") if state is not None else ""
        self.mailbox = mailbox

    def post_cancel(self, notice: str, reason: str) -> None:
        if self.mailbox is not None:
            self.mailbox.post(notice, reason)

    def discard_cancel(self, notice: str) -> None:
        if self.mailbox is not None:
            self.mailbox.discard(notice)

    def _handles(self, ticket: int, with_state: bool) -> tuple[str, str]:
        return self.kv_handle, self.state_handle if with_state else ""


def gpu_id(device: torch.device) -> str:
    """The GPU's UUID ("" on CPU): two ranks of one NCCL group may not share a GPU."""
    if device.type != "cuda":
        return ""
    try:
        return str(torch.cuda.get_device_properties(device).uuid)
    except (AttributeError, RuntimeError):  # an older torch: this host's name and the device's index
        import socket

        return f"{socket.gethostname()}:{torch.device(device).index or 0}"


def pair_backend(backend: str, decode_gpu: str, prefill_gpu: str) -> str:
    """The backend of one (prefill, decode) pair, decided the same way on both sides: `auto` is NCCL between two
    different GPUs and gloo otherwise (CPU, or both on one GPU, where NCCL refuses the pair)."""
    if backend != "auto":
        return backend
    return "nccl" if decode_gpu and prefill_gpu and decode_gpu != prefill_gpu else "gloo"


def _process_group(backend: str, store, rank: int, device: torch.device | None):
    """A two-rank group of its own (no default group: each pair joins and fails alone)."""
    import torch.distributed as dist

    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, CONNECT_TIMEOUT)
    if backend == "nccl":
        # torch's default (3) tears the whole process down when a transfer times out: a prefill that dies in the
        # middle of a payload would take decode with it. 2 aborts only this pair's communicator; the pending
        # receive then fails and the receiver drops the peer. Read when the group is made; an operator's value wins.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = CONNECT_TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    raise ValueError(f"kv transport backend {backend!r} is not gloo or nccl")


class DistSink(KVSink):
    """Decode's receiver over torch.distributed: a TCPStore for the rendezvous and one receiver thread per peer.

    `backend` auto, gloo or nccl (nccl needs the pool on a GPU; auto picks per pair, `pair_backend`); `address`
    is the host name prefill servers reach this
    decode instance at; `port` 0 takes a free one (it travels in the handle)."""

    kind = "dist"

    def __init__(self, kv, state, instance_id: str, backend: str, address: str, port: int = 0, log=None):
        """kv: the pool's KVStore, or a tensor-parallel instance's (store, lo, hi) per rank (the CPU path): rows
        then arrive with every KV head and each head lands in the rank that holds it."""
        import torch.distributed as dist

        super().__init__()
        shards = kv if isinstance(kv, list) else [(kv, 0, kv.num_kv_heads)]
        self.shards = [(store.buffer, lo, hi) for store, lo, hi in shards]
        kv = shards[0][0]
        if backend == "nccl" and not kv.buffer.is_cuda:
            raise ValueError("kv_transport dist with nccl needs decode on a GPU; use gloo on CPU")
        self.kv, self.state, self.backend = kv, state, backend
        self.device = kv.buffer.device
        self.gpu = gpu_id(self.device)
        self.log = log or (lambda m: print(f"[triton-pd] kv transport: {m}", file=sys.stderr, flush=True))
        self.store = dist.TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False, timeout=CONNECT_TIMEOUT)
        self.address, self.port = address, self.store.port
        self.instance, self.generation = instance_id, secrets.token_hex(4)
        self.row_shape = [kv.num_layers, 2, self.shards[-1][2], kv.head_dim]
        self.stop = threading.Event()
        self._waiting: dict[int, str] = {}  # thread number (0: the joiner) -> the store key it waits for
        self._threads = [threading.Thread(target=self._join_loop, name="pd-kv-join", daemon=True)]
        self._threads[0].start()

    def _handles(self, ticket: int, with_state: bool) -> tuple[str, str]:
        desc = {
            "kind": "dist", "backend": self.backend, "gpu": self.gpu, "addr": self.address, "port": self.port,
            "instance": self.instance, "generation": self.generation, "ticket": ticket,
            "dtype": str(self.kv.buffer.dtype), "row_shape": self.row_shape,
            "state_floats": int(self.state.buffer.shape[1]) if self.state is not None else 0,
        }  # fmt: skip
        h = json.dumps(desc)
        return h, h if with_state else ""

    def landed(self, exp: Expected, timeout: float) -> bool:
        return exp.arrived.wait(timeout)

    def post_cancel(self, notice: str, reason: str) -> None:
        self.store.set(f"cancel/{notice}", reason)

    def discard_cancel(self, notice: str) -> None:
        try:
            self.store.delete_key(f"cancel/{notice}")
        except Exception:
            pass

    def close(self) -> None:
        """Wakes every waiting thread by writing the keys they wait for (an empty value: stop), so none is left
        inside the store's client when the process exits."""
        self.stop.set()
        for key in list(self._waiting.values()):
            try:
                self.store.set(key, "")
            except Exception:
                pass
        for t in self._threads:
            t.join(timeout=5)

    # ---- threads ------------------------------------------------------------------------------------------
    def _client(self):
        """A client of this sink's store of its own: a client blocked in a wait blocks every other use of it."""
        import torch.distributed as dist

        return dist.TCPStore("127.0.0.1", self.port, is_master=False, timeout=CONNECT_TIMEOUT)

    def _wait(self, client, me: int, key: str) -> bytes | None:
        """The value of `key` once it is set; None once the sink is closing. Waits without a timeout (a wait that
        times out logs a warning in c10d), so close() wakes it by setting the key."""
        self._waiting[me] = key
        try:
            while not self.stop.is_set():
                try:
                    client.wait([key], IDLE_WAIT)
                except Exception:
                    continue
                if self.stop.is_set():
                    return None
                value = client.get(key)
                client.delete_key(key)
                return value
            return None
        finally:
            self._waiting.pop(me, None)

    def live_peers(self) -> int:
        """Receiver threads running: one per prefill process connected to this instance."""
        return sum(t.is_alive() for t in self._threads[1:])

    def _join_loop(self) -> None:
        k, client = 0, self._client()
        while (peer := self._wait(client, 0, f"join/{k + 1}")) is not None:
            k += 1
            t = threading.Thread(target=self._receive_loop, args=(k, peer.decode()), name=f"pd-kv-recv-{k}",
                                 daemon=True)  # fmt: skip
            self._threads = [self._threads[0], *(t for t in self._threads[1:] if t.is_alive()), t]
            t.start()

    def _receive_loop(self, k: int, join: str) -> None:
        import torch.distributed as dist

        who = json.loads(join)
        peer, backend = who["id"], pair_backend(self.backend, self.gpu, who["gpu"])
        try:
            pg = _process_group(backend, dist.PrefixStore(f"pair/{k}", self._client()), 1, self.device)
            waits = self._client()
        except Exception as e:
            self.log(f"peer {peer} could not connect: {e}")
            return
        self.log(f"peer {peer} connected ({backend})")
        buf_device = self.device if backend == "nccl" else torch.device("cpu")
        n = 0
        try:
            while (raw := self._wait(waits, k, f"hdr/{k}/{n + 1}")) is not None:
                n += 1
                h = json.loads(raw)
                if h.get("bye"):  # the peer closed its side (prefill shutting down): this thread ends
                    self.log(f"peer {peer} left")
                    break
                rows, floats = int(h["rows"]), int(h["state_floats"])
                payload = torch.empty(rows * self._row_bytes() + floats * 4, dtype=torch.uint8, device=buf_device)
                if payload.numel():
                    pg.recv([payload], 0, 0).wait()
                self._land(str(h["rid"]), int(h["epoch"]), int(h["ticket"]), rows, floats, payload)
        except Exception as e:
            if not self.stop.is_set():
                self.log(f"peer {peer} lost: {e}")
        finally:
            _abort(pg)

    def _row_bytes(self) -> int:
        layers, two, heads, dim = self.row_shape
        return layers * two * heads * dim * self.kv.buffer.element_size()

    def _land(self, rid: str, epoch: int, ticket: int, rows: int, state_floats: int, payload: torch.Tensor) -> None:
        with self._lock:  # forget() takes it too: rows are never written into slots already given back
            exp = self._expected.get((rid, epoch))
            if exp is None or exp.ticket != ticket or len(exp.dst_slots) != rows:
                stale = exp is not None or any(r == rid for r, _ in self._expected)
                self.counts["stale" if stale else "unexpected"] += 1
                return
            layers, two, heads, dim = self.row_shape
            kv_bytes = rows * self._row_bytes()
            src = payload[:kv_bytes].view(self.kv.buffer.dtype).view(layers, two, rows, heads, dim)
            di = torch.tensor(exp.dst_slots, dtype=torch.int64, device=self.device)
            scatter_heads(self.shards, di, src.to(self.device, non_blocking=True))  # each head into its rank
            if state_floats and exp.dst_state_page >= 0 and self.state is not None:
                page = payload[kv_bytes:].view(torch.float32)
                self.state.buffer[exp.dst_state_page].copy_(page.to(self.device, non_blocking=True))
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            self.counts["landed"] += 1
            self.counts["bytes"] += payload.numel()
            exp.arrived.set()


def _abort(pg) -> None:
    for name in ("abort", "shutdown"):
        fn = getattr(pg, name, None)
        if fn is not None:
            try:
                fn()
                return
            except Exception:
                pass


class _Peer:
    """Prefill's connection to one decode instance (one generation of it)."""

    def __init__(self, desc: dict, me: str, device: torch.device):
        import torch.distributed as dist

        self.key = (desc["instance"], desc["generation"])
        mine = gpu_id(device)
        self.backend = pair_backend(desc["backend"], desc.get("gpu", ""), mine)
        self.device = device
        self.store = dist.TCPStore(desc["addr"], desc["port"], is_master=False, timeout=CONNECT_TIMEOUT)
        self.k = self.store.add("joins", 1)
        self.store.set(f"join/{self.k}", json.dumps({"id": me, "gpu": mine}))
        self.pg = _process_group(self.backend, dist.PrefixStore(f"pair/{self.k}", self.store), 0, device)
        self.sent = 0
        self.lock = threading.Lock()

    def send(self, header: dict, payload: torch.Tensor) -> None:
        on_gpu = self.backend == "nccl"
        payload = payload.to(self.device) if on_gpu else payload.cpu()
        with self.lock:  # one transfer at a time on the pair: its header, then its payload
            self.sent += 1
            self.store.set(f"hdr/{self.k}/{self.sent}", json.dumps(header))
            if payload.numel():
                self.pg.send([payload], 1, 0).wait()
            if on_gpu:
                torch.cuda.current_stream(self.device).synchronize()

    def cancelled(self, notices: list[str]) -> dict[str, str]:
        out = {}
        for n in notices:
            key = f"cancel/{n}"
            if self.store.check([key]):
                out[n] = self.store.get(key).decode() or "cancelled"
        return out

    def close(self, bye: bool = False) -> None:
        """Drops the group; with `bye` first tells decode's receiver for this pair that nothing more comes, so its
        thread ends (not for a peer being replaced or one whose link broke: that store may be gone or reused)."""
        if bye:
            with self.lock:
                try:
                    self.sent += 1
                    self.store.set(f"hdr/{self.k}/{self.sent}", json.dumps({"bye": True}))
                except Exception:
                    pass  # decode is gone already
        _abort(self.pg)


class KVSource:
    """Prefill's side: sends a finished job's rows wherever its handle points (either transport)."""

    def __init__(self, me: str, device: torch.device | str = "cpu"):
        self.me, self.device = me, torch.device(device)
        self.ipc = HandoffCache()
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()

    def _peer(self, desc: dict) -> _Peer:
        with self._lock:
            cur = self._peers.get(desc["instance"])
            if cur is None or cur.key != (desc["instance"], desc["generation"]):
                if cur is not None:
                    cur.close()
                cur = self._peers[desc["instance"]] = _Peer(desc, self.me, self.device)
            return cur

    def _drop_peer(self, desc: dict) -> None:
        with self._lock:
            cur = self._peers.pop(desc["instance"], None)
        if cur is not None:
            cur.close()

    def prepare(self, kv_handle: str) -> None:
        """Connect to the decode instance a dist handle names, if not yet connected (a job does this when it
        arrives, so that decode's cancel notices reach it while it computes); nothing for ipc."""
        desc = json.loads(kv_handle)
        if desc.get("kind") == "dist":
            self._peer(desc)

    def send(self, rid: str, epoch: int, kv_handle: str, src: torch.Tensor, src_slots: list[int],
             dst_slots: list[int], state_handle: str = "", state_row: torch.Tensor | None = None,
             dst_state_page: int = -1) -> None:  # fmt: skip
        """Rows src[:, :, src_slots] into decode's dst_slots; with a state_handle also state_row into its page. src:
        the pool, or a tensor-parallel prefill's (buffer, lo, hi) per rank."""
        desc = json.loads(kv_handle)
        srcs = src if isinstance(src, list) else [(src, 0, src.shape[3])]  # every head, from the rank holding it
        if desc.get("kind") != "dist":  # (one pool each, the same heads: copy_rows)
            copy_rows_sharded(srcs, src_slots, self.ipc.open(kv_handle).shards, dst_slots)
            if state_handle:
                copy_state_page(state_row.unsqueeze(0), 0, self.ipc.open(state_handle).buffer, dst_state_page)
            return
        if len(src_slots) != len(dst_slots):
            raise ValueError(f"hand-off of {len(src_slots)} rows into {len(dst_slots)} slots")
        src = srcs[0][0]
        shape = list(src.shape[:2]) + [srcs[-1][2]] + list(src.shape[4:])
        if shape != desc["row_shape"] or str(src.dtype) != desc["dtype"]:
            raise ValueError(f"decode's pool rows are {desc['row_shape']} {desc['dtype']}: not this model's")
        si = torch.tensor(src_slots, dtype=torch.int64, device=src.device)
        parts = [gather_heads(srcs, si).contiguous().view(-1).view(torch.uint8)]
        floats = 0
        if state_handle:
            if state_row is None or state_row.numel() != desc["state_floats"]:
                raise ValueError("decode expects a state page this model does not have")
            parts.append(state_row.to(src.device, torch.float32).contiguous().view(torch.uint8))
            floats = state_row.numel()
        payload = torch.cat(parts) if len(parts) > 1 else parts[0]
        header = {"rid": rid, "epoch": epoch, "ticket": desc["ticket"], "rows": len(src_slots), "state_floats": floats}
        for attempt in (1, 2):  # a broken link (decode's receiver gone) is reconnected once
            try:
                self._peer(desc).send(header, payload)
                break
            except Exception:
                self._drop_peer(desc)
                if attempt == 2:
                    raise

    def cancelled(self, handles: dict[str, str]) -> dict[str, str]:
        """Of the notices (rid:epoch), those decode has cancelled: notice -> reason. A dist handle's notices are
        read from its decode's rendezvous store; an ipc handle's from the mailbox it names (taken: read once)."""
        by_peer: dict[str, list[str]] = {}
        by_mailbox: dict[str, set[str]] = {}
        descs = {}
        for notice, handle in handles.items():
            desc = json.loads(handle)
            if desc.get("kind") == "dist":
                by_peer.setdefault(desc["instance"], []).append(notice)
                descs[desc["instance"]] = desc
            elif desc.get("mailbox"):
                by_mailbox.setdefault(desc["mailbox"], set()).add(notice)
        out = {}
        for path, notices in by_mailbox.items():
            try:
                out.update(Mailbox.named(path).take(notices))
            except ValueError:
                pass  # not a mailbox (a handle from something else): nothing to read
        for inst, notices in by_peer.items():
            with self._lock:  # only peers already connected: a poll never waits for a connection
                peer = self._peers.get(inst)
            if peer is None or peer.key != (inst, descs[inst]["generation"]):
                continue
            try:
                out.update(peer.cancelled(notices))
            except Exception:
                pass  # an unreachable decode: the job answers into nothing and is dropped there
        return out

    def close(self) -> None:
        self.ipc.close()
        for p in self._peers.values():
            p.close(bye=True)
        self._peers.clear()
