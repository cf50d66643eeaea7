"""pd_decode (decoupled): admits requests from master, asks prefill for their prompt KV, runs continuous-batching
decode, pauses requests when the KV pool runs out (or, rotating, when another's turn comes) and recovers them by the
cheapest path: local radix hit, host-memory swap-in, or prefill recompute under a new epoch. This file is the
Triton glue: it reads the config, builds the runner, scheduler, host tier and KV transport, and hands requests to
`DecodeLoop` (loop.py), whose one thread owns all request state; execute() only enqueues."""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from dataclasses import dataclass

from backends.common.core.kv_pool import KVPool
from backends.common.core.request import InferReq, ParamError
from backends.common.core.role_config import DecodeConfig, mailbox_dir, read_key
from backends.common.core.speculative import check_mode
from backends.common.core.state_pages import StatePages
from backends.common.engine.runner import ModelRunner, set_cpu_threads
from backends.common.engine.sizing import default_host_pages, resolve_decode
from backends.common.model.loader import load_config, resolve
from backends.common.model.multimodal import MMInfo, Multimodal
from backends.common.model.vision import vision_config_of
from backends.common.serving import triton_io as tio
from backends.common.serving.metrics import Metrics
from backends.common.serving.reply_channel import ReplyChannels
from backends.common.serving.wire import DecodeRequest, DecodeResponse, PrefillRequest
from backends.common.transfer.kv_transport import DistSink, IpcSink, check_kind
from backends.common.transfer.mailbox import Mailbox
from backends.common.transfer.remote import PrefillServers, parse_urls

from .host_tier import HostKV, default_costs
from .loop import DecodeLoop
from .scheduler import DecodeScheduler

# --rotation-prefetch: slots per running request left free for its growth until the prefetched request's turn
# (a quantum of 0.1 s is about 10-25 decode steps; speculation can take two slots a step)
PREFETCH_MARGIN = 64
# reply channel: the sender's pause after a round that used it, per open stream, and at most. Master's work goes
# with the parts it relays: one token per part at 256 streams outpaced it (perf/results/served_replies_h200.md)
REPLY_PACE_S = 160e-6
REPLY_PACE_MAX_S = 0.04


class DecodeModel:
    def __init__(self, args: dict):
        self.instance = args.get("model_instance_name", "pd_decode")
        gpu = args.get("model_instance_kind") == "GPU"
        index = int(args.get("model_instance_device_id", 0))
        device = f"cuda:{index}" if gpu else "cpu"
        if gpu:
            import torch

            torch.cuda.set_device(device)
        cfg = DecodeConfig.from_params(tio.model_params(args))
        self.key = read_key(cfg)
        cfg = self.cfg = resolve_decode(cfg, load_config(resolve(cfg.model)), gpu, index, tio.instance_count(args))
        # a multimodal checkpoint: the token ids and merge size of its images (decode loads no vision weights)
        self.vision_cfg = vision_config_of(resolve(cfg.model))
        set_cpu_threads(cfg.cpu_threads)
        kv_tokens = cfg.kv_tokens
        shm = None if gpu else f"tpd_{cfg.deployment}_{self.instance}"
        self.runner = ModelRunner(
            cfg.model, cfg.dtype, device, kv_tokens, kv_shm_name=shm, max_batch=cfg.max_batch,
            state_pages=cfg.state_pages or None, state_shm_name=shm and shm + "_state",
            deterministic=cfg.deterministic == "on", quantization=cfg.quantization,
            memory_fraction=cfg.kv_memory_fraction, tp=cfg.decode_tp,
        )  # fmt: skip
        state = self.runner.state
        self.mailbox = Mailbox(mailbox_dir(cfg))
        self.replies = ReplyChannels(mailbox_dir(cfg), self.key)
        self._pending: list = []  # reply-channel parts of the sender's current round (its thread only)
        self.sink = self._sink(cfg, f"{cfg.deployment}:{self.instance}")
        # prefill of this server (BLS) or prefill servers over gRPC, with failover between them
        self.prefill = RemotePrefill(cfg.prefill_urls, self.key) if cfg.prefill_urls else BlsPrefill(self.key)
        host_tokens = cfg.host_kv_tokens
        # hybrid models: one host state page per host copy (a paused request's state at its end)
        host_pages = default_host_pages(cfg.max_batch) if state is not None and host_tokens > 0 else 0
        shards = self.runner.kv_shards() if self.runner.tp is not None else None  # every rank's pool, to copy
        self.host_kv = HostKV(self.runner.kv, host_tokens, state, host_pages, shards) if host_tokens > 0 else None
        self.sched = DecodeScheduler(
            KVPool(kv_tokens),
            max_running=cfg.max_batch,
            pause_policy=cfg.pause_policy,
            on_oom=cfg.on_decode_oom,
            max_len=self.runner.cfg.max_position_embeddings,
            host_pool=KVPool(host_tokens) if host_tokens > 0 else None,
            host_pages=KVPool(host_pages) if host_pages > 0 else None,
            quantum=cfg.rotation_quantum,
            turn_wait=cfg.rotation_wait,
            turns_per_wait=cfg.rotation_turns,
            rotation_victims=cfg.rotation_victims,
            prefetch_margin=PREFETCH_MARGIN if cfg.rotation_prefetch == "on" else None,
            costs=default_costs(
                self.runner.cfg, self.runner.kv.bytes_per_slot, gpu, state.bytes_per_page if state is not None else 0
            ),  # fmt: skip
            state=StatePages(self.runner.num_state_pages) if state is not None else None,
            speculative=(spec := check_mode(cfg.speculative, self.runner.has_mtp)) != "off",
        )
        self.runner.prepare_speculative(spec)
        # test hooks (comma-separated): "stale" re-delivers every recovery completion under the previous epoch
        # (it must be dropped); "drop_paused_kv" keeps no paused KV (cache or host), forcing prefill recovery
        faults = frozenset(filter(None, cfg.fault_injection.split(",")))
        self.sched.keep_paused_kv = "drop_paused_kv" not in faults
        self.loop = DecodeLoop(
            self.runner, self.sched, self.sink, self.mailbox, self.host_kv, self.prefill, self._send,
            Metrics({"model": "pd_decode", "instance": self.instance}), overlap=cfg.decode_overlap == "on",
            speculative=spec, stall_seconds=cfg.stall_seconds, prefill_concurrency=cfg.prefill_concurrency,
            faults=faults, name=self.instance, send_flush=self._flush_replies,
        )  # fmt: skip
        self.loop.start()

    def _sink(self, cfg: DecodeConfig, instance_id: str):
        """Where prefill's rows land: `ipc` (this host: prefill writes into the exported pool) or `dist`
        (torch.distributed; `kv_backend` auto: NCCL between two GPUs, gloo otherwise)."""
        kind = check_kind(cfg.kv_transport)
        # a tensor-parallel instance: every rank's pool (ipc exports them all; dist lands each head where it lives)
        kv = self.runner.kv_shards() if self.runner.tp is not None else self.runner.kv
        if kind == "ipc":
            return IpcSink(kv, self.runner.state, instance_id, self.mailbox)
        backend, address = cfg.kv_backend, cfg.kv_address
        return DistSink(kv, self.runner.state, instance_id, backend, address, log=self._log)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                msg = DecodeRequest.decode(tio.request_getter(request), self.key)
            except ParamError as e:
                _refuse(sender, str(e), "INVALID_ARG")
                continue
            req = InferReq(msg.request_id, msg.input_ids, msg.params)
            if msg.mm_info:
                try:
                    req.mm, req.mm_wire = self._multimodal(msg), (msg.mm_info, msg.images)
                except ParamError as e:
                    _refuse(sender, str(e), "INVALID_ARG")
                    continue
            if msg.cancel:  # a notice from a master in another server: every instance here reads this mailbox
                self.mailbox.post(msg.request_id, msg.cancel)
                sender.send(flags=tio.pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            if msg.reply_to:
                try:
                    path = self.replies.check(msg.reply_to)
                    self.replies.get(path)
                except (ValueError, OSError) as e:
                    _refuse(sender, f"reply_to: {e}", "INVALID_ARG" if isinstance(e, ValueError) else "UNAVAILABLE")
                    continue
                # the response exec() returns to master; the next on this stream is its final flag
                sender.send(tio.pb().InferenceResponse(output_tensors=tio.to_tensors(DecodeResponse().encode())))
                sender = Replied(sender, path)
            self.loop.arrive(req, sender)
        return None

    def _multimodal(self, msg: DecodeRequest):
        """The positions and cache keys of a request with images (its prompt already expanded by master)."""
        if self.vision_cfg is None:
            raise ParamError("image", f"the model {self.cfg.model} takes no images")
        return Multimodal.from_expanded(msg.input_ids, MMInfo.from_json(msg.mm_info), self.vision_cfg)

    def finalize(self):
        self.loop.stop()
        self.sink.close()
        self.prefill.close()
        self.replies.close()
        if self.host_kv is not None:
            self.host_kv.close()
        self.runner.close()  # a tensor-parallel instance's workers and their pools
        self.runner.kv.close(unlink=True)
        if self.runner.state is not None:
            self.runner.state.close(unlink=True)
        self.loop.metrics.close()

    def _send(self, stream, response: DecodeResponse) -> None:
        """Errors travel as an ordinary final response (finish_reason "error" + error_message): an error response
        after data responses on a decoupled BLS stream did not reach master's iterator in Triton 2.51. A stream
        with a reply channel has its part queued for `_flush_replies`, at the end of the sender's round."""
        if isinstance(stream.sender, Replied):
            self._pending.append((stream, response))
            return
        pb = tio.pb()
        flags = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if response.final else 0
        stream.sender.send(pb.InferenceResponse(output_tensors=tio.to_tensors(response.encode())), flags=flags)

    def _flush_replies(self) -> None:
        """One frame per master socket with every part of this round, then the final flag of each stream that
        ended. A socket that fails ends its streams with an error on their BLS streams (master answers its
        clients with it), and the loop drops those requests at its next look at the senders."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        by_path: dict[str, list] = defaultdict(list)
        for stream, response in pending:
            by_path[stream.sender.path].append((stream, response))
        pb = tio.pb()
        for path, parts in by_path.items():
            try:
                self.replies.get(path).send([(stream.rid, response) for stream, response in parts])
                failed = None
            except OSError as e:
                failed = f"decode lost its reply channel to master ({e})"
                self._log(failed)
            for stream, response in parts:
                r: Replied = stream.sender
                if failed is None and not response.final:
                    continue
                r.gone = failed is not None
                stream.closed = True
                try:
                    if failed is None:
                        r.sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    else:
                        out = tio.to_tensors(DecodeResponse(error=failed, error_code="UNAVAILABLE").encode())
                        r.sender.send(
                            pb.InferenceResponse(output_tensors=out), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
                        )
                except Exception as e:
                    self._log(f"final flag to {stream.rid} not sent: {e!r}")
        # the next round merges what is pending meanwhile (REPLY_PACE_S); the loop's table holds the open streams
        time.sleep(min(REPLY_PACE_S * len(self.loop.streams), REPLY_PACE_MAX_S))

    def _log(self, message: str) -> None:
        print(f"[triton-pd] {self.instance}: {message}", file=sys.stderr, flush=True)


@dataclass(eq=False)
class Replied:
    """A request's sender when master named a reply socket: the BLS stream's own sender (for the final flag and
    cancellation) and the socket's path."""

    sender: object
    path: str
    gone: bool = False  # the socket failed: the request ends at the loop's next look at its senders

    def is_cancelled(self) -> bool:
        return self.gone or self.sender.is_cancelled()


class BlsPrefill:
    """Prefill jobs to this server's pd_prefill, as BLS calls."""

    def __init__(self, key: str):
        self.key = key

    def order(self) -> list:
        return [None]

    def ask(self, server, msg: PrefillRequest):
        """(getter, None) or (None, error message) from this server's prefill."""
        resp = (
            tio.pb()
            .InferenceRequest(
                model_name=PrefillRequest.MODEL,
                inputs=tio.to_tensors(msg.encode(self.key)),
                requested_output_names=list(PrefillRequest.OUTPUTS),
            )
            .exec()
        )
        if resp.has_error():
            return None, resp.error().message()
        return tio.response_getter(resp), None

    def close(self) -> None:
        pass


class RemotePrefill:
    """Prefill jobs to prefill servers over gRPC, round robin over the live ones (`PrefillServers`)."""

    def __init__(self, urls: str, key: str):
        self.servers = PrefillServers(parse_urls(urls, "prefill_urls"), PrefillRequest.MODEL, PrefillRequest.OUTPUTS)
        self.key = key

    def order(self) -> list:
        return self.servers.order()

    def ask(self, server, msg: PrefillRequest):
        """(getter, None) or (None, error message); raises Unreachable for a server not there."""
        get, err = self.servers.call(server, msg.encode(self.key), f"{msg.request_id}:{msg.epoch}")
        return get, (None if err is None else err[0])

    def close(self) -> None:
        self.servers.close()


def _refuse(sender, message: str, code: str) -> None:
    """A request decode does not take: one final response with the error."""
    pb = tio.pb()
    sender.send(pb.InferenceResponse(output_tensors=[], error=tio.error(message, code)),
                flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)  # fmt: skip
