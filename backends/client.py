"""A streaming client for a running server (gRPC through tritonclient, or HTTP generate_stream)."""

from __future__ import annotations

import base64
import json
import queue
import sys

from .common.core.request import SamplingParams
from .common.serving.wire import TRITON_DTYPES, MasterRequest


class ClientError(Exception):
    pass


def infer_inputs(grpcclient, tensors: dict) -> list:
    """tritonclient InferInputs for named numpy arrays (a wire message's `encode()`)."""
    out = []
    for name, arr in tensors.items():
        x = grpcclient.InferInput(name, list(arr.shape), TRITON_DTYPES[arr.dtype])
        x.set_data_from_numpy(arr)
        out.append(x)
    return out


def _inputs(grpcclient, prompt: str, params: SamplingParams, chat: bool, stream: bool, images=None):
    msg = MasterRequest(text=prompt, params=_params(params), stream=stream, chat=chat, images=images or None)
    return infer_inputs(grpcclient, msg.encode())


def _params(p: SamplingParams) -> dict:
    d = p.to_dict()
    return {k: v for k, v in d.items() if v not in (None, [])}


def generate_remote(
    url: str,
    prompt: str,
    params: SamplingParams,
    chat: bool = False,
    protocol: str = "grpc",
    echo: bool = True,
    images: list[bytes] | None = None,
) -> dict:
    """images: PNG or JPEG files' bytes, sent base64 in pd_master's `image` input."""
    images = [base64.b64encode(x) for x in images or []]
    if protocol == "http":
        return _generate_http(url, prompt, params, chat, echo, images)
    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer(
            "pd_master", _inputs(grpcclient, prompt, params, chat, True, images), enable_empty_final_response=True
        )
        ids, text, reason = [], [], None
        while True:
            result, error = results.get(timeout=3600)
            if error is not None:
                raise ClientError(str(error))
            resp = result.get_response()
            if result.as_numpy("output_ids") is not None:
                new = result.as_numpy("output_ids").tolist()
                delta = result.as_numpy("text_output")[0].decode()
                ids += new
                text.append(delta)
                if echo:
                    print(delta, end="", flush=True)
                fr = result.as_numpy("finish_reason")
                if fr is not None and fr[0]:
                    reason = fr[0].decode()
            if resp.parameters.get("triton_final_response") and resp.parameters["triton_final_response"].bool_param:
                break
        if echo:
            print(file=sys.stderr)
        return {"output_ids": ids, "text": "".join(text), "finish_reason": reason}
    finally:
        client.stop_stream()
        client.close()


def _generate_http(url, prompt, params, chat, echo, images=()) -> dict:
    import urllib.request

    # stream: each event carries what is new (without it pd_master answers once, the prompt included)
    body = {"text_input": prompt, "apply_chat_template": chat, "stream": True,
            "sampling_parameters": json.dumps(_params(params))}  # fmt: skip
    if images:
        body["image"] = [x.decode() for x in images]
    body = json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://{url}/v2/models/pd_master/generate_stream", data=body, headers={"Content-Type": "application/json"}
    )
    ids, text, reason = [], [], None
    with urllib.request.urlopen(req) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data:"):
                continue
            ev = json.loads(line[5:])
            if "error" in ev:
                raise ClientError(ev["error"])
            new = ev.get("output_ids", [])
            ids += new if isinstance(new, list) else [new]  # Triton's JSON gives a one-element array as a scalar
            text.append(ev.get("text_output", ""))
            if echo:
                print(ev.get("text_output", ""), end="", flush=True)
            reason = ev.get("finish_reason") or reason
    return {
        "output_ids": ids,
        "text": "".join(text),
        "finish_reason": reason if isinstance(reason, str) else (reason[0] if reason else None),
    }
