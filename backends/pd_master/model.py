"""pd_master (KIND_CPU, decoupled): the client-facing model. Parses and validates a request, tokenises it, opens a
BLS decoupled stream to pd_decode, detokenises what comes back and streams it to the client. A watchdog thread
enforces the total deadline and notices client cancellation, even while decode has the request paused."""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from backends.common.core.request import ParamError, SamplingParams
from backends.common.core.role_config import DEFAULT_MAX_STREAMS, MasterConfig, mailbox_dir, read_key
from backends.common.model.loader import load_config, load_tokenizer, resolve
from backends.common.model.multimodal import build as build_multimodal
from backends.common.model.multimodal import image_processor_for
from backends.common.model.multimodal import prompt_ids as image_prompt_ids
from backends.common.model.tokenizer import TemplateError
from backends.common.serving import triton_io as tio
from backends.common.serving.metrics import Metrics
from backends.common.serving.reply_channel import ReplyInbox, socket_path
from backends.common.serving.wire import DecodeRequest, DecodeResponse, get_blobs
from backends.common.transfer.mailbox import Mailbox
from backends.common.transfer.remote import DecodeServers, parse_urls

from .text import IncrementalDetokenizer, StopStrings

SAMPLING_KEYS = {
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "stop",
}


# Media in request parameters are refused (images come in the `image` input); video and audio are not served.
MEDIA_KEYS = frozenset({"image", "images", "image_url", "video", "audio"})
NOT_MULTIMODAL = "media in request parameters are not taken: send images in the `image` input (base64 PNG or JPEG)"


@dataclass
class ClientRequest:
    rid: str
    sender: object
    prompt_ids: list[int]
    prompt_text: str | None
    params: SamplingParams
    stream: bool
    exclude_input: bool
    started: float = field(default_factory=time.monotonic)
    deadline: float | None = None
    ended: threading.Event = field(default_factory=threading.Event)  # the client got its final response
    abort_reason: str | None = None  # set by the watchdog: "cancelled" or "timeout"
    current_rid: str = ""  # the decode request of the current segment (restart mode adds segments)
    send_lock: threading.Lock = field(default_factory=threading.Lock)  # relay and watchdog both send
    seen_cancelled: bool = False  # is_cancelled() answered True (the stub caches it)
    remote: object = None  # the current segment's stream to a decode server of its own (remote.RemoteStream)
    # a request with images: master's copy for the request's life (what it sent decode, which forwards it to prefill
    # with each job, so any prefill can rebuild them): MMInfo's JSON and the images' base64 text as the client sent it
    mm_info: str = ""
    images: list[bytes] = field(default_factory=list)


@dataclass
class Answer:
    """What the relay has built of a client's answer, across segments."""

    detok: IncrementalDetokenizer
    stops: StopStrings
    last: float  # when the last token arrived (the request's start before the first)
    ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    finish: str | None = None


@dataclass
class Segment:
    """How one decode stream ended."""

    restarted: bool = False  # decode ended it with "restart" (restart mode): master re-submits
    failure: str | None = None  # an error from decode or from the stream
    code: str = "INTERNAL"
    final_part: tuple[str, list[int]] | None = None  # the client's last (text, ids), sent after the stream ends


BLS_END = object()  # queued by a reply channel's BLS reader after the stream's last response
REPLY_GRACE_S = 10.0  # how long the last parts may trail the BLS stream's end (they were sent before it)


@dataclass(eq=False)
class ReplyWait:
    """One decode stream answered through the reply channel: the queue its socket parts and its BLS stream's
    responses meet in, and whether the BLS stream has ended."""

    q: queue.SimpleQueue
    ended: bool = False

    def wait_end(self) -> None:
        while not self.ended:
            self.ended = self.q.get() is BLS_END


class DrainedStreams:
    """Finished BLS response iterators, held until Triton's stub has surely dropped its own reference to them.

    Triton 2.51's stub keeps a second reference to every decoupled response iterator in a map. Reading the last
    response queues the iterator's id to the stub's stub-to-parent thread, which erases it from the map without the
    GIL. If Python had already dropped its reference, that erase ran the iterator's destructor there, freeing the
    numpy array of every tensor of every response it delivered without the GIL: under many short concurrent streams
    the stub's heap was corrupted ("Cannot create a circular NumPy array 'base' dependency") and the stub died.

    The same thread answers `is_cancelled()` queries, in the order they were queued, and a query returns only once
    answered. So a query queued after a stream's last response returns only after that stream's erase: it is a
    barrier. Master numbers its queries (`barrier`); an iterator kept while n queries had started is let go once a
    query numbered above n has returned. Queries come from each relay just before it answers its client, and from
    the watchdog's cancellation poll of every live request (every 0.1 s), so nothing is held for a set time: an
    iterator waits only for the next query, and its release is Python's, with the GIL held."""

    def __init__(self):
        self.started = 0  # barrier queries started
        self.completed = 0  # the highest-numbered query that has returned
        self.items: deque[tuple[int, object]] = deque()  # (queries started when kept, iterator), in that order
        self.lock = threading.Lock()

    def barrier(self, query) -> object:
        """Run `query` (an is_cancelled() call that is certain to be queued) as a numbered barrier; its result."""
        with self.lock:
            self.started += 1
            ticket = self.started
        result = query()
        with self.lock:
            self.completed = max(self.completed, ticket)
        return result  # the caller reaps, outside its own locks

    def keep(self, iterator) -> None:
        with self.lock:
            self.items.append((self.started, iterator))

    def reap(self) -> None:
        """Let go of every iterator a returned barrier has cleared."""
        expired = []
        with self.lock:
            while self.items and self.items[0][0] < self.completed:
                expired.append(self.items.popleft()[1])
        del expired  # released here, by a Python thread holding the GIL, outside the lock

    def __len__(self) -> int:
        return len(self.items)


class MasterModel:
    def __init__(self, args: dict):
        cfg = self.cfg = MasterConfig.from_params(tio.model_params(args))
        self.key = read_key(cfg)
        src = resolve(cfg.model)
        self.tokenizer = load_tokenizer(src)
        model_cfg = load_config(src)
        self.max_context, self.vocab_size = model_cfg.max_position_embeddings, model_cfg.vocab_size
        self.images, self.no_images = image_processor_for(
            src, max_images=cfg.max_images_per_request, max_pixels=cfg.max_image_pixels
        )
        self.mailbox = Mailbox(mailbox_dir(cfg))
        # decode servers of their own, over gRPC; none: this server's pd_decode
        self.decoders = DecodeServers(parse_urls(cfg.decode_urls, "decode_urls"), DecodeRequest.MODEL,
                                      DecodeResponse.OUTPUTS) if cfg.decode_urls else None  # fmt: skip
        # this server's decode answers through a socket beside each BLS stream (reply_channel.py says why)
        self.inbox = None
        if self.decoders is None:
            instance = args.get("model_instance_name", "pd_master")
            self.inbox = ReplyInbox(socket_path(mailbox_dir(cfg), instance), self.key)
        self.max_inflight = cfg.max_inflight
        # decode streams open at once; requests beyond wait here (their wait counts in TTFT and in the deadline)
        self.streams = threading.BoundedSemaphore(cfg.max_streams or DEFAULT_MAX_STREAMS)
        self.timeout = cfg.request_timeout if cfg.request_timeout >= 0 else None
        self.active: dict[str, ClientRequest] = {}
        self.lock = threading.Lock()
        m = self.metrics = Metrics({"model": "pd_master", "instance": args.get("model_instance_name", "pd_master")})
        self.m_ttft = m.histogram("pd_time_to_first_token_seconds", "Time from arrival to the first token")
        self.m_itl = m.histogram(
            "pd_inter_token_latency_seconds",
            "Time between two responses of one stream",
            buckets=[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10],
        )
        self.m_requests = m.counter("pd_requests_total", "Client requests by outcome", outcome="ok")
        self.m_rejected = m.counter("pd_requests_total", "Client requests by outcome", outcome="rejected")
        self.m_failed = m.counter("pd_requests_total", "Client requests by outcome", outcome="error")
        self.m_restarts = m.counter("pd_restarts_total", "Segments re-submitted by master (on_decode_oom=restart)")
        self.m_inflight = m.gauge("pd_master_inflight_requests", "Requests being answered")
        self.drained = DrainedStreams()
        self.m_held = m.gauge(
            "pd_master_drained_streams_held",
            "Finished decode streams master holds until Triton's stub has dropped its own reference to them",
        )
        self._held_reported = 0
        self.stop_event = threading.Event()
        self.watchdog = threading.Thread(target=self._watch, name="pd-master-watchdog", daemon=True)
        self.watchdog.start()

    # ---- request parsing ---------------------------------------------------------------------------------
    def parse(self, request) -> ClientRequest:
        images = get_blobs(lambda name: tio.input_array(request, name), "image")
        if images and self.images is None:
            raise ParamError("image", f"the model {self.cfg.model} takes no images: {self.no_images}")
        text = tio.input_str(request, "text_input")
        ids = tio.input_ids(request, "input_ids")
        if (text is None) == (ids is None):
            raise ParamError("text_input", "give exactly one of text_input and input_ids")
        raw = {}
        sp = tio.input_str(request, "sampling_parameters")
        if sp:
            try:
                raw = json.loads(sp)
            except ValueError as e:
                raise ParamError("sampling_parameters", f"malformed JSON ({e})") from None
            if not isinstance(raw, dict):
                raise ParamError("sampling_parameters", "must be a JSON object")
        try:  # request parameters (HTTP generate's "parameters", gRPC parameters) also carry sampling keys
            rp = json.loads(request.parameters() or "{}")
        except (AttributeError, ValueError):
            rp = {}
        for k, v in rp.items():
            if k in MEDIA_KEYS:
                raise ParamError(k, NOT_MULTIMODAL)
            if k in SAMPLING_KEYS:
                raw.setdefault(k, v)
        params = SamplingParams.from_json(json.dumps(raw))
        stream = tio.input_bool(request, "stream", bool(rp.get("stream", False)))
        exclude = tio.input_bool(request, "exclude_input_in_output", bool(rp.get("exclude_input_in_output", False)))
        chat = tio.input_bool(request, "apply_chat_template", bool(rp.get("apply_chat_template", False)))
        if text is not None:
            try:
                if images:
                    ids = image_prompt_ids(self.tokenizer, self.images.vc, text, len(images), chat)
                else:
                    ids = self.tokenizer.encode_chat(text) if chat else self.tokenizer.encode(text)
            except TemplateError as e:  # e.g. a random-weight model: no chat template to apply
                raise ParamError("apply_chat_template", str(e)) from None
            field_name = "text_input"
        else:
            field_name = "input_ids"
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ParamError("input_ids", f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if not ids:
            raise ParamError(field_name, "the prompt is empty")
        mm_info = ""
        if images:  # decoded here for their grids and digests; the pixels are prefill's to make
            ids, mm = build_multimodal(ids, self.images(images, "image", pixels=False), self.images.vc)
            mm_info = mm.info.to_json()
        if len(ids) >= self.max_context:
            raise ParamError(
                field_name,
                f"the prompt has {len(ids)} tokens; the model's context is "
                f"{self.max_context} (prompt + output must fit)",
            )
        rid = uuid.uuid4().hex[:16]
        req = ClientRequest(rid, request.get_response_sender(), ids, text, params, stream, exclude, current_rid=rid,
                            mm_info=mm_info, images=images)  # fmt: skip
        if self.timeout is not None:
            req.deadline = req.started + self.timeout
        return req

    # ---- Triton entry points -----------------------------------------------------------------------------
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                req = self.parse(request)
            except ParamError as e:
                self._final_error(sender, str(e), "INVALID_ARG")
                self.m_failed.increment(1)
                continue
            with self.lock:
                if len(self.active) >= self.max_inflight:
                    req = None
                else:
                    self.active[req.rid] = req
            if req is None:
                self.m_rejected.increment(1)
                self._final_error(sender, f"server busy, retry: {self.max_inflight} requests in flight", "UNAVAILABLE")
                continue
            self.m_inflight.set(len(self.active))
            threading.Thread(target=self._serve, args=(req,), name=f"pd-master-{req.rid}", daemon=True).start()
        return None

    def finalize(self):
        self.stop_event.set()
        for req in list(self.active.values()):
            self._cancel_everywhere(req, "shutdown")
        if self.inbox is not None:
            self.inbox.close()
        self.metrics.close()

    # ---- one request -------------------------------------------------------------------------------------
    def _serve(self, req: ClientRequest) -> None:
        held = False
        try:
            while not (held := self.streams.acquire(timeout=0.05)):
                if req.abort_reason or self.stop_event.is_set():
                    return  # cancelled or past its deadline while waiting: the watchdog has answered
            self._relay(req)
        except Exception as e:  # a bug or a lost decode instance: the client gets an error, never a hang
            self._finish_with_error(req, f"internal error: {e}", "INTERNAL")
        finally:
            if held:
                self.streams.release()
            with self.lock:
                self.active.pop(req.rid, None)
                self.m_inflight.set(len(self.active))
            self.mailbox.discard(req.current_rid or req.rid)

    def _decode_stream(self, req: ClientRequest, msg: DecodeRequest):
        """Decode's responses for msg: a BLS decoupled stream of this server's pd_decode, or a gRPC stream to a
        decode server (kept on req, for cancels)."""
        if self.decoders is not None:
            req.remote = self.decoders.open(
                msg.request_id, msg.encode(self.key),
                lambda reason: DecodeRequest(msg.request_id, [], msg.params, reason).encode(self.key),
            )  # fmt: skip
            return req.remote
        if self.inbox is not None:
            msg.reply_to = self.inbox.path
        bls = tio.pb().InferenceRequest(
            model_name=DecodeRequest.MODEL,
            inputs=tio.to_tensors(msg.encode(self.key)),
            requested_output_names=list(DecodeResponse.OUTPUTS),
        )
        return bls.exec(decoupled=True)

    def _relay(self, req: ClientRequest) -> None:
        """The client's answer from decode's stream, segment by segment (a segment ends at decode's "restart" in
        restart mode, and master re-submits prompt + generated ids as the next)."""
        ans = Answer(IncrementalDetokenizer(self.tokenizer), StopStrings(req.params.stop), last=req.started)
        prompt_ids, params, segment = req.prompt_ids, req.params, 0
        while ans.finish is None:
            req.current_rid = req.rid if segment == 0 else f"{req.rid}.{segment}"
            msg = DecodeRequest(req.current_rid, prompt_ids, params, mm_info=req.mm_info, images=req.images)
            seg = self._read_segment(req, ans, msg)
            if req.stream and seg.final_part is not None:
                self._send(req, *seg.final_part, ans.finish, len(ans.ids), True)
            if seg.failure is not None:
                self._finish_with_error(req, seg.failure, seg.code)
                return
            if ans.finish is None and not seg.restarted and not req.abort_reason:
                raise RuntimeError("decode closed the stream without a final response")
            if req.abort_reason and ans.finish is None:
                return  # the watchdog already answered the client (cancel or deadline)
            if ans.finish is None:
                nxt = self._next_segment(req, ans)
                if nxt is None:
                    break
                prompt_ids, params = nxt
                segment += 1
        self._complete(req, ans)

    def _read_segment(self, req: ClientRequest, ans: Answer, msg: DecodeRequest) -> Segment:
        """One decode stream, read to its end whatever happens: a response iterator dropped before its end (master
        used to stop reading at "restart" or at an error) is the pattern under which Triton 2.51's stub died."""
        seg = Segment()
        wait = ReplyWait(self.inbox.open(msg.request_id)) if self.inbox is not None else None
        try:
            stream = self._decode_stream(req, msg)
        except BaseException:
            if wait is not None:
                self.inbox.discard(msg.request_id)
            raise
        drained = False
        try:
            for error, part in self._parts(stream, wait):
                if req.abort_reason or seg.restarted or seg.failure is not None:
                    continue  # drain what decode still sends after a cancel, a restart or an error
                if error is not None:
                    seg.failure = error
                    continue
                if part is None:
                    continue  # the empty closing response of the stream
                if part.error is not None:
                    seg.failure, seg.code = part.error, part.error_code
                    continue
                self._take(req, ans, seg, part.output_ids, part.finish_reason or "")
            drained = True
        finally:
            if wait is not None:
                self.inbox.discard(msg.request_id)
            if not self._stream_ended(req, stream, drained, wait):
                self.drained.keep(stream)
            stream = None
            self.drained.reap()
        return seg

    def _take(self, req: ClientRequest, ans: Answer, seg: Segment, new_ids: list[int], reason: str) -> None:
        """One response of decode's: its tokens to text (stop strings cut it), latency metrics, and to the client
        now (streaming) or with the final response."""
        if not new_ids and not reason:
            return
        ans.ids.extend(new_ids)
        delta = ans.stops.feed(ans.detok.add(new_ids))
        if ans.stops.stopped:
            reason = "stop"
            self._cancel_everywhere(req, "stop")
        elif reason and reason != "restart":
            delta += ans.stops.feed(ans.detok.flush()) + ans.stops.flush()
        now = time.monotonic()
        if new_ids:
            (self.m_ttft if ans.last == req.started else self.m_itl).observe(now - ans.last)
            ans.last = now
        ans.text_parts.append(delta)
        # decode's sender merges what is pending for a stream, so a segment's last tokens can arrive in the same
        # response as its "restart": they go to the client before the segment ends
        seg.restarted = reason == "restart"
        if reason and not seg.restarted:  # the answer's end: its last part goes out once decode's stream has ended
            ans.finish, seg.final_part = reason, (delta, new_ids)
            if ans.stops.stopped:
                req.abort_reason = "stop"  # keep draining quietly
        elif req.stream and new_ids:
            self._send(req, delta, new_ids, None, len(ans.ids), False)

    def _next_segment(self, req: ClientRequest, ans: Answer) -> tuple[list[int], SamplingParams] | None:
        """After a restart: the next segment's prompt (prompt + generated ids, all recomputed) and parameters, or
        None when the answer is already complete (it ends with "length")."""
        self.m_restarts.increment(1)
        prompt_ids = req.prompt_ids + ans.ids
        left = req.params.max_tokens - len(ans.ids)
        if left <= 0 or len(prompt_ids) >= self.max_context:
            ans.finish = "length"
            if req.stream:
                self._send(req, "", [], ans.finish, len(ans.ids), True)
            return None
        left_min = max(0, req.params.min_tokens - len(ans.ids))
        return prompt_ids, SamplingParams(**{**req.params.to_dict(), "max_tokens": left, "min_tokens": left_min})

    def _complete(self, req: ClientRequest, ans: Answer) -> None:
        """A non-streamed answer goes out whole (with the prompt unless excluded); the request counts as served."""
        if not req.stream:
            text, ids = "".join(ans.text_parts), ans.ids
            if not req.exclude_input:
                prompt_text = req.prompt_text if req.prompt_text is not None else self.tokenizer.decode(req.prompt_ids)
                text, ids = prompt_text + text, req.prompt_ids + ans.ids
            self._send(req, text, ids, ans.finish, len(ans.ids), True)
        self.m_requests.increment(1)

    def _parts(self, stream, wait: ReplyWait | None):
        """(error message or None, DecodeResponse or None) per response of decode's, from either kind of stream: a
        gRPC stream to a decode server, or this server's reply channel with its BLS stream."""
        if wait is None:
            yield from self._decoded(stream)  # a decode server's gRPC stream
            return
        threading.Thread(target=self._read_bls, args=(stream, wait.q), name="pd-master-bls", daemon=True).start()
        final, held = False, None
        while not (final and wait.ended):
            try:
                item = held if held is not None else wait.q.get(timeout=REPLY_GRACE_S if wait.ended else None)
                held = None
            except queue.Empty:
                final = True
                yield "decode's stream ended before its last response arrived", None
                continue
            if isinstance(item, DecodeResponse) and not final:
                # parts that queued up while the client's last response went out go out as one
                while not item.final:
                    try:
                        more = wait.q.get_nowait()
                    except queue.Empty:
                        break
                    if not isinstance(more, DecodeResponse) or more.error is not None:
                        held = more
                        break
                    item = DecodeResponse(item.output_ids + more.output_ids, more.finish_reason, None, "INTERNAL",
                                          more.num_pauses)  # fmt: skip
            if item is BLS_END:
                wait.ended = True
            elif isinstance(item, tuple):  # on the BLS stream: the accept (empty), or decode refusing the request
                error, part = item
                if error is not None or (part is not None and (part.final or part.output_ids)):
                    if not final:
                        yield error, part
                    final = True
            elif not final:  # a part from the socket
                final = item.final
                yield None, item

    def _bls_responses(self, stream):
        """(error message or None, output getter) per response of this server's BLS stream."""
        for resp in stream:
            yield (resp.error().message(), None) if resp.has_error() else (None, tio.response_getter(resp))

    @staticmethod
    def _decoded(pairs):
        """(error message or None, output getter) pairs, from either kind of stream, to (error, DecodeResponse or
        None)."""
        for error, get in pairs:
            yield error, None if error is not None else DecodeResponse.decode(get)

    def _read_bls(self, stream, q: queue.SimpleQueue) -> None:
        """A reply channel's BLS stream, read to its end on a thread of its own (its relay reads the socket's
        parts): its responses, then BLS_END, go to the relay's queue."""
        try:
            for item in self._decoded(self._bls_responses(stream)):
                q.put(item)
        except Exception as e:
            q.put((f"decode stream failed: {e}", None))
        finally:
            stream = None
            q.put(BLS_END)

    def _stream_ended(self, req: ClientRequest, stream, drained: bool, wait: ReplyWait | None = None) -> bool:
        """After a decode stream's end (or a failure while reading it): True when the stub has surely erased its
        own reference to the iterator, so that the relay may drop it now; else DrainedStreams holds it."""
        if not drained:  # read to its end whatever happened: an iterator dropped before its end stays in the map
            self._cancel_everywhere(req, "cancelled")
            if wait is None:
                for _ in stream:
                    pass
        if wait is not None:
            wait.wait_end()  # the reader thread has read it to its end
        return self._barrier(req)

    def _send(self, req: ClientRequest, text: str, ids: list[int], reason: str | None, n_out: int, final: bool):
        pb = tio.pb()
        outputs = [tio.tensor("text_output", text), tio.tensor("output_ids", ids)]
        if final:
            outputs += [
                tio.tensor("finish_reason", reason or ""),
                tio.tensor("num_input_tokens", len(req.prompt_ids)),
                tio.tensor("num_output_tokens", n_out),
            ]
        self._deliver(req, pb.InferenceResponse(output_tensors=outputs), final)

    def _deliver(self, req: ClientRequest, response, final: bool) -> None:
        """The one place that sends to a client: at most one FINAL, never anything after it."""
        pb = tio.pb()
        with req.send_lock:
            if req.ended.is_set():
                return
            if final:
                req.ended.set()
            try:
                if response is None:
                    req.sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                else:
                    req.sender.send(response, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
            except Exception:  # the client is gone: stop the work it asked for everywhere
                if not req.abort_reason:
                    req.abort_reason = "cancelled"
                    self._cancel_everywhere(req, "cancelled")

    def _final_error(self, sender, message: str, code: str) -> None:
        pb = tio.pb()
        sender.send(
            pb.InferenceResponse(output_tensors=[], error=tio.error(message, code)),
            flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
        )

    def _finish_with_error(self, req: ClientRequest, message: str, code: str) -> None:
        self.m_failed.increment(1)
        pb = tio.pb()
        self._deliver(req, pb.InferenceResponse(output_tensors=[], error=tio.error(message, code)), True)

    # ---- watchdog: deadline and client cancellation ------------------------------------------------------
    def _watch(self) -> None:
        while not self.stop_event.wait(0.1):
            self.drained.reap()
            if len(self.drained) != self._held_reported:
                self._held_reported = len(self.drained)
                self.m_held.set(self._held_reported)
            now = time.monotonic()
            with self.lock:
                reqs = list(self.active.values())
            for req in reqs:
                try:
                    self._check(req, now)
                except Exception:
                    pass  # one request's failure must not stop the watchdog

    def _check(self, req: ClientRequest, now: float) -> None:
        if req.abort_reason or req.ended.is_set():
            return
        if req.deadline is not None and now > req.deadline:
            req.abort_reason = "timeout"
            self._cancel_everywhere(req, "timeout")
            self._finish_with_error(
                req, f"request timed out after {self.timeout:g} s (request_timeout)", "DEADLINE_EXCEEDED"
            )
        elif self._client_cancelled(req):
            req.abort_reason = "cancelled"
            self._cancel_everywhere(req, "cancelled")
            self._deliver(req, None, True)  # Triton releases a decoupled request only after its FINAL flag

    def _client_cancelled(self, req: ClientRequest) -> bool:
        self._barrier(req)
        return req.seen_cancelled

    def _barrier(self, req: ClientRequest) -> bool:
        """Ask the client's sender whether it was cancelled, as a DrainedStreams barrier; True when such a query
        was queued and has returned. Under the send lock, and never once FINAL went out: after FINAL, Triton frees
        the response factory that is_cancelled() reads (asking then corrupted the stub's heap under load, "malloc():
        unaligned fastbin chunk detected" in 2.51). The stub caches a True answer and queues no further query, so
        once cancelled a request gives no barrier."""
        with req.send_lock:
            if req.ended.is_set() or req.seen_cancelled:
                return False
            try:
                req.seen_cancelled = bool(self.drained.barrier(req.sender.is_cancelled))
            except Exception:
                return False
            return True

    def _cancel_everywhere(self, req: ClientRequest, reason: str) -> None:
        """Decode drops the request, releases its KV and tells prefill; the notice reaches every instance (of a
        decode server elsewhere: sent on the request's own gRPC call)."""
        self.mailbox.post(req.current_rid, reason)
        remote = req.remote
        if remote is not None:
            remote.cancel(reason)
