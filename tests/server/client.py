"""Test clients: gRPC streaming through tritonclient, HTTP generate / generate_stream."""

from __future__ import annotations

import json
import queue
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import tritonclient.grpc as grpcclient

from backends.client import infer_inputs
from backends.common.serving.wire import MasterRequest


@dataclass
class Result:
    ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    responses: int = 0
    chunks: list[list[int]] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # time.monotonic() at which each chunk arrived


def build_inputs(text=None, ids=None, params=None, stream=True, exclude_input=None, chat=False, raw_params=None,
                 images=None):  # fmt: skip
    msg = MasterRequest(text, ids, params or {}, stream, chat, exclude_input, raw_params, images)
    return infer_inputs(grpcclient, msg.encode())


class StreamClient:
    """One gRPC stream with one request; read responses as they arrive."""

    def __init__(self, url: str, model: str = "pd_master", **kw):
        self.q: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=lambda result, error: self.q.put((result, error, time.monotonic())))
        self.client.async_stream_infer(
            model, kw.pop("inputs", None) or build_inputs(**kw), enable_empty_final_response=True
        )
        self.result = Result()

    def read(self, until_tokens: int | None = None, timeout: float = 300) -> Result:
        r = self.result
        while r.finish_reason is None and r.error is None:
            if until_tokens is not None and len(r.ids) >= until_tokens:
                break
            try:
                res, err, at = self.q.get(timeout=timeout)
            except queue.Empty:
                r.error = f"no response from the server for {timeout:.0f} s"
                break
            if err is not None:
                r.error = f"{err.status()}: {err.message()}"
                break
            r.responses += 1
            out = res.as_numpy("output_ids")
            if out is not None:
                r.ids += out.tolist()
                r.chunks.append(out.tolist())
                r.times.append(at)
                r.text += res.as_numpy("text_output")[0].decode()
                fr = res.as_numpy("finish_reason")
                if fr is not None and fr[0]:
                    r.finish_reason = fr[0].decode()
            final = res.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param and r.finish_reason is None:
                r.finish_reason = r.finish_reason or ""
        return r

    def cancel(self) -> None:
        self.client.stop_stream(cancel_requests=True)
        self.client.close()

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def grpc_generate(url: str, timeout: float = 300, **kw) -> Result:
    c = StreamClient(url, **kw)
    done = False
    try:
        r = c.read(timeout=timeout)
        done = r.finish_reason is not None
        return r
    finally:
        # a plain close waits for the server to end the stream; one that is stuck would hang the caller for ever
        if done:
            c.close()
        else:
            c.cancel()


def grpc_generate_all(url: str, ids: list[list[int]], params: list[dict], timeout: float = 300) -> list[Result]:
    """One stream per prompt, all at once (a thread each); the results in prompt order."""
    results: list[Result | None] = [None] * len(ids)

    def go(i):
        results[i] = grpc_generate(url, timeout=timeout, ids=ids[i], params=params[i])

    threads = [threading.Thread(target=go, args=(i,), daemon=True) for i in range(len(ids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def http_post(url: str, path: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(
        f"http://{url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
